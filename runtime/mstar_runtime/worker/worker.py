"""One rank: its node instances, their engines (KV pools, per-(request, tag) states), and step running.

A `Worker` builds every node the plan makes resident on its rank, loads its weights, and
gives each a `KVCacheEngine` (pages and page size from the plan's memory section) or a
`StatelessEngine`. A node at tp > 1 holds only this rank's shard and gets its TP group
from `tp_groups` (node -> torch.distributed group, made by `mstar_runtime.ops.tp.build_groups`
in every process). The conductor drives it with `run_step(StepBatch)`, plus the KV
bookkeeping its BlockManagers decide (`fork`, `copy_slots`, `free`; `export_kv` and
`import_kv` for a KV context the plan moves between ranks), and, for decode
cohorts, the `cohort_*` calls: open (the device columns of a marked loop, if its node offers
a column step), join rows (several in one call) / leave / move a row, add pages, and step all rows at once
(engine/cohort_engine.py); a chain's `cohort_chain_*` calls open, join, move and step its
links together (engine/cohort_chain.py). A worker process serves the same calls as messages
(worker/process.py; the conductor's side in worker/remote_cohort.py), and a tensor-parallel
node's cohort makes them on every rank of its group (`tp_dispatch.TPCohort`); `key` is
whatever the caller names the cohort by (the conductor's key here, an id from the wire there).

Errors of a step surface in two kinds, so the conductor knows whom to fail:
- `RequestError` (a node rejected an input) propagates unchanged, with `request_ids` (the
  batch's requests, in entry order) attached when the node did not set it. A node cannot
  say which entry of a batch was at fault, so with several entries the conductor reruns
  them one at a time; that is safe because K/V writes to the same slots are idempotent and
  nodes validate before they change their states.
- anything else (a bug, a shape error, out of memory, bad outputs) is a `WorkerStepError`
  naming the node and phase: every request of the batch fails with its message.

`stats()` counts steps, entries and host seconds per (node, phase). On a GPU the time is
the host's (launches, plus any sync the node does): the worker adds no synchronisation.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar_runtime.engine.cohort_chain import ChainColumns, ChainResult
from mstar_runtime.engine.cohort_engine import CohortColumns, CohortGraphs, CohortResult, CohortShape, JoinRow
from mstar_runtime.engine.engines import (
    AttentionBackend,
    KVCacheEngine,
    StatelessEngine,
    StepEntry,
    link_peers,
)
from mstar_runtime.engine.graphs import graph_buckets
from mstar_runtime.kv.block_manager import SlotCopy
from mstar_runtime.kv.flashinfer_backend import (
    FlashInferBackend,
    FlashInferCohortDecode,
    graph_prefill,
    select_backend,
    unsupported,
)
from mstar_runtime.ops.node import KVNode, RequestError
from mstar_runtime.plan.loader import Plan
from mstar_runtime.weights import build_node, load_weights

COHORT_GRAPHS_ENV = "MSTAR_COHORT_GRAPHS"  # "0": cohort steps run eagerly on a GPU too


class WorkerStepError(Exception):
    """A step failed for a reason that is not one request's input; fails the whole batch."""

    def __init__(self, node: str, phase: str, message: str):
        self.node, self.phase, self.message = node, phase, message
        super().__init__(f"node '{node}' phase '{phase}': {message}")


@dataclass(slots=True)
class StepBatch:
    """One batched step: `node.phase` over entries from one or more requests."""

    node: str
    phase: str
    entries: list[StepEntry]


@dataclass(slots=True)
class _PhaseStats:
    steps: int = 0
    entries: int = 0
    seconds: float = 0.0
    failures: int = 0


def _graph_attention(engine: KVCacheEngine, pool: Any, tokens: int, tensor_cores: bool | None = None) -> Any:
    """The per-bucket graph attention factory of a cohort of `engine`'s node over `pool` (its
    own, or a context it reads), or None where FlashInfer cannot serve it."""
    if tokens == 1:
        return engine.backend.graph_decoder(pool, engine.scale, tensor_cores)
    return graph_prefill(engine.backend, pool, engine.scale, tokens)


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic GC's reach (`gc.freeze`).

    A loaded worker holds hundreds of thousands of long-lived objects (modules, parameters,
    plan views); without this every full collection walks them all, a pause of tens of ms in
    the middle of a decode loop whose host time per step is a few ms. The objects are still
    freed by reference counting; only cycles among them would wait (as vLLM does too): a
    process that builds several workers and drops them (the tests) calls `gc.unfreeze()` and
    `gc.collect()` to free a dropped worker, whose KV pool is held in such cycles."""
    gc.collect()
    gc.freeze()


class Worker:
    """The node instances of one rank and their engines."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        device: torch.device | str,
        weights: str | Path = "dummy",
        *,
        attention_backend: AttentionBackend | None = None,
        tp_groups: Mapping[str, Any] | None = None,
    ):
        self.plan, self.rank, self.device = plan, rank, torch.device(device)
        self.engines: dict[str, KVCacheEngine | StatelessEngine] = {}
        self._stats: dict[tuple[str, str], _PhaseStats] = {}
        self._cohorts: dict[Any, CohortColumns] = {}
        self._cohort_engine: dict[Any, KVCacheEngine] = {}
        self._chains: dict[Any, ChainColumns] = {}
        self._chain_keys: dict[Any, list[Any]] = {}  # a chain's link keys, in body order
        on_gpu = self.device.type == "cuda"
        if attention_backend is None and on_gpu:
            # FlashInfer when it imports, else the reference (logged once which): one backend,
            # and so one FlashInfer workspace, for every KV node of the rank
            attention_backend = select_backend(self.device)
        for name in plan.resident_nodes(rank):
            info = plan.node(name)
            tp_rank, tp_size = info.tp_of(rank)
            group = tp_groups.get(name) if tp_groups is not None else None
            module = build_node(plan, name, rank, self.device, tp_rank, tp_size, tp_group=group)
            load_weights(module, plan, name, weights)
            ports = {p.name: p.outputs for p in info.phases.values()}
            if isinstance(module, KVNode):
                self.engines[name] = KVCacheEngine(
                    module,
                    plan.kv_pages(name, rank),
                    plan.page_size,
                    info.torch_dtype,
                    self.device,
                    attention_backend=attention_backend,
                    output_ports=ports,
                    # the plan's captured phases of this node on this rank; graphs only on a GPU
                    graphs=graph_buckets(plan.body.get("cuda_graphs", ()), name, rank) if on_gpu else None,
                )
            else:
                # the same captured phases: a stateless node that offers one (`graph_phase`, e.g.
                # Orpheus' SNAC window decode) replays it as a CUDA graph on a side stream
                self.engines[name] = StatelessEngine(
                    module, output_ports=ports,
                    graphs=graph_buckets(plan.body.get("cuda_graphs", ()), name, rank) if on_gpu else None,
                )
        link_peers(self.engines.values())  # a step that reads another node's KV context finds its pool
        freeze_heap()

    # ------------------------------------------------------------------ steps
    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]:
        """Run one batched step; one output dict per entry, in entry order (see the module docstring)."""
        engine = self.engines.get(batch.node)
        if engine is None:
            raise WorkerStepError(
                batch.node,
                batch.phase,
                f"not resident on rank {self.rank} (resident: {', '.join(self.engines) or 'none'})",
            )
        st = self._stats.setdefault((batch.node, batch.phase), _PhaseStats())
        t0 = time.perf_counter()
        try:
            out = engine.run(batch.phase, batch.entries)
        except RequestError as e:
            st.failures += 1
            if getattr(e, "request_ids", None) is None:
                e.request_ids = [x.request_id for x in batch.entries]  # type: ignore[attr-defined]
            raise
        except Exception as e:
            st.failures += 1
            raise WorkerStepError(batch.node, batch.phase, f"{type(e).__name__}: {e}") from e
        finally:
            st.seconds += time.perf_counter() - t0
        st.steps += 1
        st.entries += len(batch.entries)
        return out

    # ------------------------------------------------------------------ cohorts
    def cohort_open(self, key: Any, node: str, shape: CohortShape, rows: int, max_pages: int) -> bool:
        """Make the device columns of a cohort of `node`'s phase, if the node offers a column
        step for it (`KVNode.cohort_phase`); False when it does not (the loop stays generic)."""
        have = self._cohorts.get(key)
        if have is not None and have.rows == rows and have.shape == shape:
            return True  # a later conductor of the same plan: the columns (and graphs) are reused
        engine = self.engines.get(node)
        if not isinstance(engine, KVCacheEngine):
            return False
        cphase = engine.node.cohort_phase(shape.phase)
        if cphase is None:
            return False
        peers = getattr(engine, "peers", {})
        readers = [peers.get(r.node) for r in shape.reads]
        if any(not isinstance(e, KVCacheEngine) for e in readers):
            return False  # a read node not resident here: the generic step reports it
        read_pools = [e.pool for e in readers]
        heads = int(engine.node.spec.arch_args.get("heads", 0)) // max(engine.node.spec.tp_size, 1)
        graphs = eager = None
        eager_reads: list[Any] = []
        runner = engine.graph_runners.get(shape.phase)
        if not cphase.keep:
            # a block kept nowhere attends by gathers and SDPA (`attend_block`), no FlashInfer:
            # captured per bucket wherever the plan captures the step. Pad rows need no scratch
            # page: they write no slot, and gather from read-table rows left filled with page 0
            if (runner is not None and engine.device.type == "cuda"
                    and os.environ.get(COHORT_GRAPHS_ENV, "1") != "0"):
                graphs = CohortGraphs([b for b in runner.buckets if b <= rows] or [rows], engine.num_pages, None,
                                      reads=[(e.num_pages, None) for e in readers])
        elif isinstance(engine.backend, FlashInferBackend) and all(unsupported(p) is None
                                                                   for p in (engine.pool, *read_pools)):
            eager = FlashInferCohortDecode(engine.backend, engine.pool, engine.scale, heads, cphase.tokens)
            # a read context's attention on the CUDA-core decode kernel, whose probabilities stay
            # float32: over Whisper's 1,500-frame cross context the tensor-core kernel's bf16
            # probabilities moved its tokens off float32's at the 3rd (tools/probes/whisper_paths.py)
            eager_reads = [FlashInferCohortDecode(engine.backend, p, engine.scale, heads, cphase.tokens,
                                                  tensor_cores=False) for p in read_pools]
            # pad rows need a scratch page in every pool they touch
            has_scratch = all(e.pool.num_pages > e.num_pages for e in (engine, *readers))
            decoder = _graph_attention(engine, engine.pool, cphase.tokens)
            read_decoders = [_graph_attention(engine, p, cphase.tokens, tensor_cores=False) for p in read_pools]
            if (runner is not None and has_scratch and decoder is not None and None not in read_decoders
                    and os.environ.get(COHORT_GRAPHS_ENV, "1") != "0"):
                graphs = CohortGraphs([b for b in runner.buckets if b <= rows] or [rows], engine.num_pages, decoder,
                                      reads=[(e.num_pages, d) for e, d in zip(readers, read_decoders, strict=True)])
        self._cohorts[key] = CohortColumns(engine.pool, cphase, shape, rows, max_pages, self.device,
                                           scale=engine.scale, node=node, q_heads=heads, graphs=graphs,
                                           eager_attention=eager, read_pools=read_pools, eager_reads=eager_reads)
        self._cohort_engine[key] = engine
        return True

    def cohort_chain_open(self, key: Any, links: Sequence[tuple[Any, str, CohortShape, int]], rows: int,
                          imports: Sequence[tuple[int, str, int, str]], flag: tuple[int, str] | None) -> bool:
        """Open each link's columns (`(key, node, shape, max_pages)`, as `cohort_open`) and
        chain them under `key` (engine/cohort_chain.py); False when a link's node offers no
        column step, and then the links' columns are as they were before the call (those it
        opened dropped, those it replaced put back). A worker process serves it, and the
        other `cohort_chain_*` calls, as messages (worker/process.py); a TP group's fan-out
        has no such call (the loop stays generic)."""
        before = [(k, self._cohorts.get(k), self._cohort_engine.get(k)) for k, *_ in links]
        if not all(self.cohort_open(k, node, shape, rows, pages) for k, node, shape, pages in links):
            for k, columns, engine in before:
                self._cohorts.pop(k, None)
                self._cohort_engine.pop(k, None)
                if columns is not None and engine is not None:
                    self._cohorts[k], self._cohort_engine[k] = columns, engine
            return False
        prefixes = [f"{i}." for i in range(len(links))]
        self._chains[key] = ChainColumns([self._cohorts[k] for k, *_ in links], prefixes, imports, flag)
        self._chain_keys[key] = [k for k, *_ in links]
        return True

    def cohort_chain_join(self, key: Any, first: int, stops: Sequence[bool | torch.Tensor]) -> None:
        self._chains[key].join(first, stops)

    def cohort_chain_move(self, key: Any, src: int, dst: int) -> None:
        self._chains[key].move(src, dst)

    def cohort_chain_step(self, key: Any, n: int) -> ChainResult:
        """Each link's step through `cohort_step` (its stats and failures are that link's),
        then `stopped` from the flag's port (a failure there is the flag link's)."""
        keys, chain = self._chain_keys[key], self._chains[key]
        try:
            return chain.step(n, lambda k: self.cohort_step(keys[k], n))
        except WorkerStepError:
            raise
        except Exception as e:  # the copy of the flag's port into `stopped`, after the last link's step
            link = chain.links[chain.flag[0] if chain.flag is not None else 0]
            raise WorkerStepError(link.node, link.shape.phase, f"{type(e).__name__}: {e}") from e

    def cohort_join(self, key: Any, first: int, rows: Sequence[JoinRow]) -> None:
        """Rows `first`, `first + 1`, ... join (`CohortColumns.join_rows`: all or none; a
        refusal is a RequestError whose `request_ids` name the refused row)."""
        engine = self._cohort_engine[key]
        states = [engine.state(r.request_id, r.tag) for r in rows]
        self._cohorts[key].join_rows(first, rows, states)

    def cohort_leave(self, key: Any, row: int, request_id: str, tag: str, steps: int) -> None:
        self._cohorts[key].leave(row, self._cohort_engine[key].state(request_id, tag), steps)

    def cohort_move(self, key: Any, src: int, dst: int) -> None:
        self._cohorts[key].move(src, dst)

    def cohort_shrink(self, key: Any, n: int) -> None:
        self._cohorts[key].n = n

    def cohort_add_pages(self, key: Any, rows: Any, cols: Any, pages: Any) -> None:
        self._cohorts[key].add_pages(rows, cols, pages)

    def cohort_step(self, key: Any, n: int) -> CohortResult:
        cohort = self._cohorts[key]
        st = self._stats.setdefault((cohort.node, cohort.shape.phase + ":cohort"), _PhaseStats())
        t0 = time.perf_counter()
        try:
            out = cohort.step(n)
        except Exception as e:
            st.failures += 1
            raise WorkerStepError(cohort.node, cohort.shape.phase, f"{type(e).__name__}: {e}") from e
        finally:
            st.seconds += time.perf_counter() - t0
        st.steps += 1
        st.entries += n
        return out

    def release_graphs(self) -> None:
        """Drop the KV nodes' captured decode graphs and the cohorts' (the ones that can hold
        TP collectives), once their work is done; see `GraphRunner.release`. Later cohort
        steps run eagerly."""
        runners = [r for e in self.engines.values() if isinstance(e, KVCacheEngine) for r in e.graph_runners.values()]
        cohorts = [c for c in self._cohorts.values() if c.graphs is not None]
        if not runners and not cohorts:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for r in runners:
            r.release()
        for c in cohorts:
            c.graphs = None
        gc.collect()  # the graphs' last references may sit in frozen or cyclic garbage

    # ------------------------------------------------------------------ KV bookkeeping
    def _kv(self, node: str, what: str) -> KVCacheEngine:
        engine = self.engines.get(node)
        if not isinstance(engine, KVCacheEngine):
            why = "is not resident here" if engine is None else "is not a kv node"
            raise WorkerStepError(node, what, f"node {why} (rank {self.rank})")
        return engine

    def fork(self, node: str, request_id: str, src_tag: str, dst_tag: str, copy: SlotCopy | None) -> None:
        """Start KV context `dst_tag` as `src_tag`: copy its partial last page (if the
        BlockManager's fork returned a copy) and deep-copy its node state."""
        engine = self._kv(node, "fork")
        if copy is not None:
            engine.copy_slots(copy)
        engine.fork_state(request_id, src_tag, dst_tag)

    def export_kv(self, node: str, request_id: str, tag: str, pages: list[int]) -> dict[str, Any]:
        """One KV context as values that can cross ranks (a plan's transfer of kind "kv"): `kv`,
        the contents of its `pages` (in token order) of every layer; `has_state`; and
        `state:<name>` per value of the node's `export_state` (a NodeError, naming the node and
        the value, when the state holds something that cannot travel)."""
        engine = self._kv(node, "export_kv")
        self._check_pages(engine, pages, "export_kv")
        index = torch.tensor(pages, dtype=torch.long, device=engine.pool.device)
        values: dict[str, Any] = {"kv": engine.pool.data.index_select(1, index)}
        values["has_state"] = engine.has_state(request_id, tag)
        if values["has_state"]:
            exported = engine.node.export_state(engine.state(request_id, tag))
            values.update({f"state:{k}": v for k, v in exported.items()})
        return values

    def import_kv(self, node: str, request_id: str, tag: str, pages: list[int], values: Mapping[str, Any]) -> None:
        """KV context `tag` becomes the one `export_kv` gave on another rank: its pages' contents
        written into `pages` (this rank's, from the conductor's BlockManager) and its node state
        in place of this rank's."""
        engine = self._kv(node, "import_kv")
        self._check_pages(engine, pages, "import_kv")
        kv = values.get("kv")
        pool = engine.pool.data
        want = (pool.shape[0], len(pages), *pool.shape[2:])
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise WorkerStepError(node, "import_kv", f"KV pages of shape {want} expected, got {got}")
        if pages:
            index = torch.tensor(pages, dtype=torch.long, device=pool.device)
            pool.index_copy_(1, index, kv.to(device=pool.device, dtype=pool.dtype))
        engine.drop_tag(request_id, tag)
        if values.get("has_state"):
            state = {k[len("state:"):]: v for k, v in values.items() if k.startswith("state:")}
            engine.state(request_id, tag).update(engine.node.import_state(state))

    def _check_pages(self, engine: KVCacheEngine, pages: list[int], what: str) -> None:
        bad = [p for p in pages if not 0 <= p < engine.num_pages]
        if bad:
            raise WorkerStepError(engine.name, what, f"page {bad[0]} is not in rank {self.rank}'s pool of "
                                  f"{engine.num_pages} pages")

    def copy_slots(self, node: str, copy: SlotCopy) -> None:
        """Apply a BlockManager copy-on-write (from `fork` or `truncate`) in the node's pool."""
        self._kv(node, "copy_slots").copy_slots(copy)

    def drop_tag(self, node: str, request_id: str, tag: str) -> None:
        """Forget one KV context's node state (a transition that does not keep the tag)."""
        self._kv(node, "drop_tag").drop_tag(request_id, tag)

    def free(self, request_id: str) -> None:
        """Drop the request's node states in every engine (its pages are the conductor's to free)."""
        for engine in self.engines.values():
            if isinstance(engine, KVCacheEngine):
                engine.free(request_id)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        """Steps, entries, failures and host seconds per node and phase; KV pool sizes and live states."""
        nodes: dict[str, dict[str, dict[str, float]]] = {}
        for (node, phase), st in sorted(self._stats.items()):
            nodes.setdefault(node, {})[phase] = {
                "steps": st.steps,
                "entries": st.entries,
                "failures": st.failures,
                "seconds": st.seconds,
            }
        kv = {
            name: {"pages": e.num_pages, "page_size": e.page_size, "states": e.num_states}
            for name, e in self.engines.items()
            if isinstance(e, KVCacheEngine)
        }
        return {
            "rank": self.rank,
            "steps": sum(s.steps for s in self._stats.values()),
            "seconds": sum(s.seconds for s in self._stats.values()),
            "nodes": nodes,
            "kv": kv,
        }
