"""Running one batched step of one node: KV slots in, attention context built, node called, outputs out.

`KVCacheEngine` owns a KV node's paged pool (`attention.KVPool`, geometry from
`node.kv_geometry`) and the per-(request, tag) node states (`attn.states[i]`). It never
allocates pages: the conductor's `BlockManager` does, and every entry arrives with its
`KVSlots` (where its new tokens go and its whole page table). For one step the engine:

1. checks each entry's slots against its page table (a mismatch would silently attend to
   the wrong tokens, so it is an error naming the request);
2. builds one `AttentionContext` over the mixed batch; its `attend(layer, q, k, v)` writes
   the new K/V of every entry at its slots (`keep=False` entries too: the conductor
   reserved their slots and truncates them after the step) and then runs the attention
   backend over all entries at once, with kv_len = start + q_len and each entry's mask;
3. calls `node.run(phase, inputs, attn)` under `torch.inference_mode()` (a phase the node writes
   only as a column step runs through it: ops/column_call.py);
4. checks the outputs: one mapping per entry, each holding every output port of the phase
   (extra keys are allowed and passed through). Anything else is a `NodeError` naming the
   node and the phase.

Before that, entries of one request whose not-kept query blocks (`keep=False`) meet the same
content (`KVSlots.content`, the BlockManager's version), node state and inputs are computed
once: the node sees the first, the others get copies of its outputs and of the state it left
(`shared_queries` counts them). BAGEL's text-to-image `cfg_img`, a fork of `gen` that
neither writes again, is such a twin.

Entries with `q_len == 0` (a phase that adds no KV) are part of the batch but not of the
attention metadata; they must not call `attend`.

Prefix caching's chunks (`KVSlots.chunk`, engine/chunked.py): a step with an entry that has
one and needs more than one piece binds `chunked.ChunkedRows` as `attn.graph_runner`: the
node's `attn.run_graphed(fn, ...)` then runs `fn` once per piece (each chunk of such an entry
alone, the other entries together), its `attend` and `write` going to the piece's own
metadata and slots (a backend's `prepare` is called per piece); attention outside
`run_graphed` covers the whole step (its plan made only then, as in a graphed step).

Reads (plan feature `kv_reads`): an entry of a phase that reads other KV contexts comes with
`KVSlots.reads`, one `ReadSlots` per context (node, tag, length and page table, as the
conductor's BlockManager of that node holds them), in the phase's `reads` order. The pool of
a read context is the engine's own (a decoder reading its `cross` tag) or that of another KV
node on the same worker (`peers`, set by `link_peers`: pi0's action expert reading the VLM);
its geometry must equal this pool's, since the reader attends layer by layer. The step's
`attn.attend(..., over=...)`, `attn.attend_to` and `attn.write` (ops/node.py) run on the
path below, on the CPU and on a GPU alike (no FlashInfer plan serves two pools yet), half
precision computed in float32: `_read_rows` when every entry has one query count and one
read-context length (one gather and one attention per layer), else `_read_attention` (every
entry's keys, its read contexts' tokens then its own, gathered into one padded batch with a
mask, one SDPA per layer; the layout built once per step). The read pages are only read: nothing is copied into
the reader's pool, so its pool holds its own contexts only, as the `memory` pass sized it.
Such a step is never graphed, and never shares its queries with a twin entry (below). `attn.extra` holds the step's
`AttentionMetadata` ("metadata") and the `KVPool` ("pool") for nodes that need more than
`attend` (e.g. reading cached K/V directly).

The attention backend is pluggable: any callable with `paged_attention`'s signature
`(q, pool, layer, meta, scale) -> out`. If it also has `prepare(pool, meta)`, that is called
once per step before the node runs (a FlashInfer backend plans its kernels there, once per
step rather than once per layer). A node class may set `attention_scale` (default
1/sqrt(head_dim)). On a GPU the worker passes `flashinfer_backend.select_backend(device)`.

CUDA graphs (`graphs`: phase -> batch buckets, from the plan's `cuda_graphs` entries for
this node and rank): the engine owns one `graphs.GraphRunner` per such phase (its entries
add one token each, or the fixed count the node declares in `graph_step_tokens`, e.g. the
V-JEPA rollout step's frame block) and, for a batch that fits a bucket, binds it to the
step as `attn.graph_runner`, so the node's `attn.run_graphed(fn, ...)` replays a captured
graph. The pool then has one scratch page
after the `num_pages` usable ones, for the pad rows. In such a step the backend's
`prepare` and the eager slot tensor are made only if the node attends outside
`run_graphed`.

`StatelessEngine` runs a stateless node's batched phase with the same output checks. With
`graphs` (phase -> batch buckets, from the same `cuda_graphs` entries) it owns one
`stateless_graphs.StatelessGraphRunner` per such phase that the node offers through
`graph_phase(phase)`: a batch that fits a bucket then replays a captured graph of the
phase's tensor part, on the runner's side stream by default on a GPU (the contract, the
padding and the stream ordering are in runtime/mstar_runtime/engine/stateless_graphs.py). Phases the node does
not offer, and batches beyond the largest bucket, run `node.run` / the tensor part eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mstar_runtime.engine.chunked import ChunkedRows, plan_pieces
from mstar_runtime.engine.graphs import GraphRunner, graph_runners, graph_step_tokens
from mstar_runtime.engine.stateless_graphs import Capture, StatelessGraphRunner, stateless_graph_runners
from mstar_runtime.kv.attention import (
    AttentionError,
    AttentionMetadata,
    KVPool,
    attention_mask,
    paged_attention,
)
from mstar_runtime.kv.block_manager import SlotCopy
from mstar_runtime.ops.node import AttentionContext, KVNode, NodeError, SeqState, StatelessNode
from mstar_runtime.ops.readback import upload, upload_tensor

DEFAULT_TAG = "main"  # the KV context of an entry whose tag is None (the conductor's convention)

AttentionBackend = Callable[..., torch.Tensor]
"""`(q [N, H, D], pool, layer, meta, scale) -> [N, H, D]`, like `attention.paged_attention`."""


@dataclass(frozen=True, slots=True)
class ReadSlots:
    """A KV context one entry reads besides its own: the same request's `node@tag`, read-only."""

    node: str
    tag: str
    kv_len: int  # its tokens (0: the context is empty, and adds no keys)
    page_table: list[int]  # its pages in `node`'s pool, covering kv_len tokens


@dataclass(frozen=True, slots=True)
class KVSlots:
    """Where one entry's new tokens go in the pool, as the conductor's BlockManager reserved them."""

    start: int  # tokens in the context before this step
    q_len: int  # new tokens of this step
    slots: list[int]  # pool slot of each new token (page * page_size + offset)
    page_table: list[int]  # the context's pages, covering start + q_len tokens
    mask: str = "causal"
    block_size: int | None = None
    keep: bool = True  # False: the conductor truncates these tokens after the step
    # The context's content version before the step (BlockManager.version); -1: unknown.
    # Equal versions of one request hold the same tokens, which lets `run` compute a
    # not-kept query block once for all of them.
    content: int = -1
    reads: tuple[ReadSlots, ...] = ()  # the contexts the phase reads, in its `reads` order
    # Prefix caching: leading tokens of the entry's inputs whose K/V were found cached and are
    # not computed (`start` counts them already; the node skips them: `SeqState.cached`).
    cached: int = 0
    # Prefix caching's chunk (0: none): the entry's rows run through the node's `run_graphed`
    # in pieces that end at absolute multiples of it, each piece alone (engine/chunked.py).
    chunk: int = 0


@dataclass(slots=True)
class StepEntry:
    """One request's (or one KV tag's) part of a batched step."""

    request_id: str
    tag: str | None
    inputs: dict[str, Any]
    kv: KVSlots | None = None


def check_outputs(
    name: str, phase: str, outputs: Any, n_entries: int, ports: Sequence[str] | None
) -> list[dict]:
    """A node's outputs, checked: a list of one mapping per entry with every port of the phase."""
    if not isinstance(outputs, list) or len(outputs) != n_entries:
        got = f"{len(outputs)} outputs" if isinstance(outputs, list) else f"a {type(outputs).__name__}"
        raise NodeError(
            f"node '{name}' phase '{phase}' returned {got} for a batch of {n_entries} entries; "
            "it must return a list with one dict per entry"
        )
    for i, out in enumerate(outputs):
        if not isinstance(out, Mapping):
            raise NodeError(
                f"node '{name}' phase '{phase}': output {i} is a {type(out).__name__}, not a dict"
            )
        missing = [p for p in ports or () if p not in out]
        if missing:
            raise NodeError(
                f"node '{name}' phase '{phase}': output {i} lacks port(s) {', '.join(missing)} "
                f"(it has: {', '.join(map(str, out)) or 'nothing'})"
            )
    return outputs


class _Engine:
    """What both engines share: the node, its name, and the output ports of each phase."""

    def __init__(self, node: StatelessNode | KVNode, output_ports: Mapping[str, Sequence[str]] | None):
        self.node = node
        self.name = node.spec.name
        self.output_ports = output_ports

    def _ports(self, phase: str) -> Sequence[str] | None:
        if self.output_ports is None:
            return None
        if phase not in self.output_ports:
            raise NodeError(
                f"node '{self.name}' has no phase '{phase}'; phases: {', '.join(self.output_ports)}"
            )
        return self.output_ports[phase]


class StatelessEngine(_Engine):
    """Batched forward of a stateless node (encoder, codec, VAE, tokenizer)."""

    def __init__(
        self,
        node: StatelessNode,
        output_ports: Mapping[str, Sequence[str]] | None = None,
        *,
        graphs: Mapping[str, Sequence[int]] | None = None,
        capture_graphs: bool | Capture | None = None,
        side_stream: bool | None = None,
    ):
        super().__init__(node, output_ports)
        # phase -> runner for the captured phases the node offers; `capture_graphs=False` keeps
        # the padding but runs eagerly (CPU tests), None: capture on cuda; `side_stream=None`:
        # replays on the runner's own stream whenever it captures CUDA graphs
        self.graph_runners: dict[str, StatelessGraphRunner] = stateless_graph_runners(
            node, graphs or {}, capture=capture_graphs, side_stream=side_stream, name=self.name,
        )

    def run(self, phase: str, entries: list[StepEntry]) -> list[dict[str, Any]]:
        ports = self._ports(phase)
        if not entries:
            return []
        for e in entries:
            if e.kv is not None:
                raise NodeError(
                    f"node '{self.name}' phase '{phase}': stateless, but request "
                    f"'{e.request_id}' came with KV slots"
                )
        batch = [e.inputs for e in entries]
        runner = self.graph_runners.get(phase)
        with torch.inference_mode():
            outputs = runner.run_phase(batch) if runner is not None else self.node.run(phase, batch)
        return check_outputs(self.name, phase, outputs, len(entries), ports)


class KVCacheEngine(_Engine):
    """A KV node with its paged pool and per-(request, tag) states."""

    def __init__(
        self,
        node: KVNode,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        attention_backend: AttentionBackend | None = None,
        output_ports: Mapping[str, Sequence[str]] | None = None,
        graphs: Mapping[str, Sequence[int]] | None = None,
        capture_graphs: bool | None = None,
    ):
        super().__init__(node, output_ports)
        geo = node.kv_geometry
        # Graphed phases pad their batches with rows that write and read one scratch page: the
        # pool gets it after the `num_pages` usable ones, which the BlockManager never hands out.
        scratch = 1 if graphs else 0
        self.num_pages = num_pages
        self.pool = KVPool(geo.layers, num_pages + scratch, page_size, geo.kv_heads, geo.head_dim, dtype, device)
        self.page_size = page_size
        self.device = torch.device(device)
        self.backend: AttentionBackend = attention_backend or paged_attention
        self.scale: float | None = getattr(node, "attention_scale", None)
        # phase -> GraphRunner for the phases the plan captures (`graphs`: phase -> batch buckets);
        # `capture_graphs=False` keeps the padding but runs eagerly (CPU tests), None: capture on cuda
        self.graph_runners: dict[str, GraphRunner] = graph_runners(
            self.pool, graphs or {}, self.backend, self.scale, scratch_page=num_pages,
            capture=capture_graphs, name=self.name, tokens=graph_step_tokens(node, graphs or {}),
            max_tokens=getattr(node, "graph_max_tokens", None),
        )
        self._states: dict[tuple[str, str], dict[str, Any]] = {}
        self._tags: dict[str, dict[str, None]] = {}  # request -> its tags holding a state, in order
        self.shared_queries = 0  # entries whose outputs were another entry's (see `run`)
        # KV node -> its engine on this worker, for the contexts a step reads (`link_peers`)
        self.peers: dict[str, KVCacheEngine] = {self.name: self}

    # ------------------------------------------------------------------ states
    def state(self, request_id: str, tag: str | None) -> dict[str, Any]:
        """The node state of one KV context, created empty on first use."""
        key = (request_id, tag or DEFAULT_TAG)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = {}
            self._tags.setdefault(request_id, {})[key[1]] = None
        return st

    def has_state(self, request_id: str, tag: str | None) -> bool:
        return (request_id, tag or DEFAULT_TAG) in self._states

    def fork_state(self, request_id: str, src_tag: str, dst_tag: str) -> None:
        """`dst_tag` starts as a deep copy of `src_tag`'s state (replacing any it had).

        A source without state gives the destination none, as forking an empty context
        gives an empty context."""
        src = self._states.get((request_id, src_tag))
        self.drop_tag(request_id, dst_tag)
        if src is not None:
            self.state(request_id, dst_tag).update(deepcopy(src))

    def drop_tag(self, request_id: str, tag: str) -> None:
        """Forget one KV context's state (a transition that does not keep the tag)."""
        if self._states.pop((request_id, tag), None) is not None:
            tags = self._tags[request_id]
            del tags[tag]
            if not tags:
                del self._tags[request_id]

    def free(self, request_id: str) -> None:
        """Drop every state of a finished, failed or preempted request (unknown ids are a no-op)."""
        for tag in self._tags.pop(request_id, {}):
            del self._states[(request_id, tag)]

    @property
    def num_states(self) -> int:
        return len(self._states)

    def copy_slots(self, copy: SlotCopy) -> None:
        """Apply a BlockManager fork/truncate copy-on-write: slots src[i] -> dst[i], all layers."""
        self.pool.copy_slots(list(copy.src), list(copy.dst))

    # ------------------------------------------------------------------ running
    def run(self, phase: str, entries: list[StepEntry]) -> list[dict[str, Any]]:
        """One batched step; a not-kept query block asked of several contexts of one request that
        hold the same content (the same version) with the same inputs is computed once, and its
        outputs are given to each (BAGEL's text-to-image `cfg_img` branch, a fork of `gen`)."""
        ports = self._ports(phase)
        if not entries:
            return []
        kvs = [self._check_slots(phase, e) for e in entries]
        alias = self._shared_queries(entries)
        if alias is not None:
            firsts = sorted(set(alias))
            outputs = self._run(phase, [entries[i] for i in firsts], [kvs[i] for i in firsts], ports)
            by_entry = dict(zip(firsts, outputs))
            self.shared_queries += len(entries) - len(firsts)
            for i, j in enumerate(alias):
                if i != j:  # the state the step would have left: the same as its twin's
                    e, o = entries[i], entries[j]
                    st = self.state(e.request_id, e.tag)
                    st.clear()
                    st.update(deepcopy(self.state(o.request_id, o.tag)))
            return [dict(by_entry[j]) for j in alias]
        return self._run(phase, entries, kvs, ports)

    def _shared_queries(self, entries: list[StepEntry]) -> list[int] | None:
        """For each entry the index of the first entry it can reuse (itself if none), or None
        when every entry is its own. Only not-kept queries of known content qualify: their
        result depends on nothing but the context's tokens, the node state and the inputs."""
        alias, seen, shared = list(range(len(entries))), {}, False
        for i, e in enumerate(entries):
            kv = e.kv
            # a reading entry's result also depends on the contexts it reads: never shared
            if kv is None or kv.keep or kv.content < 0 or kv.q_len == 0 or kv.reads:
                continue
            key = (e.request_id, kv.content, kv.start, kv.q_len, kv.mask, kv.block_size)
            for j in seen.get(key, ()):
                o = entries[j]
                if _same_inputs(e.inputs, o.inputs) and _same_state(
                    self.state(e.request_id, e.tag), self.state(o.request_id, o.tag)
                ):
                    alias[i], shared = j, True
                    break
            else:
                seen.setdefault(key, []).append(i)
        return alias if shared else None

    def _run(
        self, phase: str, entries: list[StepEntry], kvs: list[KVSlots], ports: Sequence[str] | None
    ) -> list[dict[str, Any]]:
        attending = [kv for kv in kvs if kv.q_len > 0]
        try:
            meta = AttentionMetadata.build(
                [kv.q_len for kv in attending],
                [kv.start + kv.q_len for kv in attending],
                [kv.page_table for kv in attending],
                [kv.mask for kv in attending],
                [kv.block_size for kv in attending],
            )
        except AttentionError as err:
            raise NodeError(f"node '{self.name}' phase '{phase}': {err}") from None
        flat = [s for kv in attending for s in kv.slots]
        reads = self._reads(phase, kvs)
        runner = self.graph_runners.get(phase)
        graphed = not reads and runner is not None and runner.accepts(meta, len(entries))
        # prefix caching's chunks: the node's run_graphed rows in pieces (engine/chunked.py)
        pieces = None if graphed or reads else plan_pieces(attending)
        lazy = graphed or pieces is not None
        pool, backend, scale = self.pool, self.backend, self.scale
        prepare = getattr(backend, "prepare", None)
        eager: dict[str, torch.Tensor] = {}
        piece: list[Any] = []  # [metadata, slots] of the piece that runs now; empty: the whole step

        def eager_slots() -> torch.Tensor:
            # Built once per step, and in a graphed or chunked step only if the node attends
            # outside run_graphed; then the backend's per-step plan is made here too, before first use.
            if "slots" not in eager:
                eager["slots"] = upload(flat, torch.long, self.device)  # no stream sync on a GPU
                if lazy and prepare is not None:
                    prepare(pool, meta)
            return eager["slots"]

        if not lazy:
            eager_slots()
            if prepare is not None:
                prepare(pool, meta)

        def use(m: AttentionMetadata | None, slots: Sequence[int]) -> None:
            piece.clear()
            if m is not None:
                piece.extend((m, upload(list(slots), torch.long, self.device)))
                if prepare is not None:
                    prepare(pool, m)  # a backend that plans per step plans per piece (the whole step's again on use)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if piece:
                pool.write(layer, k, v, piece[1])
                return backend(q, pool, layer, piece[0], scale)
            pool.write(layer, k, v, eager_slots())
            return backend(q, pool, layer, meta, scale)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            pool.write(layer, k, v, piece[1] if piece else eager_slots())

        seqs = [SeqState(kv.start, kv.q_len, self.state(e.request_id, e.tag), tuple(r.kv_len for r in kv.reads),
                         kv.cached) for e, kv in zip(entries, kvs)]
        attn = AttentionContext(seqs, attend, self.device, extra={"metadata": meta, "pool": pool},
                                reads=reads, write_fn=write)
        if reads:
            pages: dict[int, torch.Tensor | None] = {}  # read context -> its rows' pages, once per step
            read_plans: dict[Any, _ReadPlan] = {}  # the padded layout of the other cases, once per step

            def read(layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                     over: tuple[int, ...]) -> torch.Tensor:
                if k is not None and v is not None:
                    pool.write(layer, k, v, eager_slots())
                if k is None and len(over) == 1:
                    out = self._read_rows(layer, q, attending, over[0], pages)
                    if out is not None:
                        return out
                return self._read_attention(layer, q, attending, over, own=k is not None, plans=read_plans)

            attn.read_fn = read
        if graphed:
            assert runner is not None
            attn.graph_runner = runner.bind(attn, meta, flat)
        elif pieces is not None:
            attn.graph_runner = ChunkedRows(self.name, pieces, meta.num_tokens, use)
        with torch.inference_mode():
            outputs = self.node.run(phase, [e.inputs for e in entries], attn)
        return check_outputs(self.name, phase, outputs, len(entries), ports)

    def _reads(self, phase: str, kvs: list[KVSlots]) -> tuple[str, ...]:
        """The names ("node@tag", the first entry's) of the contexts the step's entries read;
        every entry of one phase reads as many."""
        if not any(kv.reads for kv in kvs):
            return ()
        counts = {len(kv.reads) for kv in kvs}
        if len(counts) != 1:
            raise NodeError(f"node '{self.name}' phase '{phase}': entries read {sorted(counts)} contexts; "
                            "every entry of a phase reads the contexts its `reads` clause names")
        return tuple(f"{r.node}@{r.tag}" for r in kvs[0].reads)

    def _read_attention(self, layer: int, q: torch.Tensor, attending: list[KVSlots], over: tuple[int, ...],
                        own: bool, plans: dict[Any, _ReadPlan] | None = None) -> torch.Tensor:
        """Per entry, one softmax over the read contexts `over` (every query sees all of their
        tokens) followed, when `own`, by the entry's own context under its mask.

        Every entry of the step in one batched attention: each entry's keys (its read contexts'
        tokens, then its own) and queries are padded to the step's longest, the padding masked
        out (`_ReadPlan`, built once per step and reused by every layer: `plans`), so a step is a
        few gathers and one SDPA per layer whatever its entries, not kernels per entry. An
        entry with no key at all (an empty read context, `attend_to`) gets zeros."""
        n_tokens = sum(kv.q_len for kv in attending)
        if q.dim() != 3 or q.shape[0] != n_tokens:
            raise NodeError(f"node '{self.name}': q must be [{n_tokens}, heads, head_dim], got {tuple(q.shape)}")
        heads, dim = q.shape[1], q.shape[2]
        if dim != self.pool.head_dim or heads % self.pool.kv_heads:
            raise NodeError(f"node '{self.name}': q has {heads} heads of dim {dim}; the pool has "
                            f"{self.pool.kv_heads} KV heads of dim {self.pool.head_dim}")
        scale = self.scale if self.scale is not None else dim**-0.5
        compute = torch.promote_types(q.dtype, torch.float32)
        key = (over, own)
        plan = plans.get(key) if plans is not None else None
        if plan is None:
            plan = _ReadPlan.build(self, attending, over, own, q.device)
            if plans is not None:
                plans[key] = plan
        e, nq, nk = plan.entries, plan.q_max, plan.k_max
        kvh = self.pool.kv_heads
        keys = torch.zeros(e * nk, kvh, dim, dtype=compute, device=q.device)
        values = torch.zeros_like(keys)
        for pool, pages, offsets, dest in plan.gathers:
            data = pool.data[layer]
            keys[dest] = data[pages, 0, offsets].to(compute)
            values[dest] = data[pages, 1, offsets].to(compute)
        qp = torch.zeros(e * nq, heads, dim, dtype=compute, device=q.device)
        qp[plan.q_dest] = q.to(compute)
        out = F.scaled_dot_product_attention(
            qp.view(e, nq, heads, dim).transpose(1, 2),
            keys.view(e, nk, kvh, dim).transpose(1, 2),
            values.view(e, nk, kvh, dim).transpose(1, 2),
            attn_mask=plan.mask[:, None], scale=scale, enable_gqa=heads != kvh,
        )
        return out.transpose(1, 2).reshape(e * nq, heads, dim)[plan.q_dest].to(q.dtype)

    def _read_rows(self, layer: int, q: torch.Tensor, attending: list[KVSlots], j: int,
                   pages: dict[int, torch.Tensor | None]) -> torch.Tensor | None:
        """`attend_to` of every entry at once, when the entries have one query count and their
        read context `j` one non-zero length (a decoder's cross-attention over its encoder's
        frames): one gather of all their pages and one batched attention per layer, the same
        math as `_read_attention` without its padding (float32 for half inputs). None when the
        entries differ (`_read_attention` serves them). `pages` caches the step's page index per context."""
        if j not in pages:
            reads = [kv.reads[j] for kv in attending]
            first = reads[0] if reads else None
            same = first is not None and first.kv_len > 0 and all(
                kv.q_len == attending[0].q_len for kv in attending) and all(
                r.kv_len == first.kv_len and r.node == first.node for r in reads)
            if same:
                assert first is not None
                n_pages = -(-first.kv_len // self.peers[first.node].pool.page_size)
                pages[j] = upload([p for r in reads for p in r.page_table[:n_pages]], torch.long, self.device)
            else:
                pages[j] = None
        index = pages[j]
        if index is None:
            return None
        first = attending[0].reads[j]
        rows, q_len = len(attending), attending[0].q_len
        n_tokens = rows * q_len
        if q.dim() != 3 or q.shape[0] != n_tokens:
            raise NodeError(f"node '{self.name}': q must be [{n_tokens}, heads, head_dim], got {tuple(q.shape)}")
        pool = self.peers[first.node].pool
        heads, dim = q.shape[1], q.shape[2]
        if dim != pool.head_dim or heads % pool.kv_heads:
            raise NodeError(f"node '{self.name}': q has {heads} heads of dim {dim}; the pool has "
                            f"{pool.kv_heads} KV heads of dim {pool.head_dim}")
        k, v = pool.gather_rows(layer, index, rows, first.kv_len)  # [rows, L, Hkv, D]
        scale = self.scale if self.scale is not None else dim**-0.5
        compute = torch.promote_types(q.dtype, torch.float32)
        group = heads // pool.kv_heads
        qr = q.view(rows, q_len, heads, dim).transpose(1, 2).to(compute)  # [rows, H, Q, D]
        kr = k.to(compute).repeat_interleave(group, dim=2).transpose(1, 2)
        vr = v.to(compute).repeat_interleave(group, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(qr, kr, vr, scale=scale)
        return out.transpose(1, 2).reshape(n_tokens, heads, dim).to(q.dtype)

    def _check_reads(self, where: str, kv: KVSlots) -> None:
        for r in kv.reads:
            peer = self.peers.get(r.node)
            if peer is None:
                raise NodeError(f"{where}: reads {r.node}@{r.tag}, but node '{r.node}' has no KV pool on this "
                                f"worker (pools here: {', '.join(self.peers)})")
            a, b = self.pool, peer.pool
            if (a.num_layers, a.kv_heads, a.head_dim) != (b.num_layers, b.kv_heads, b.head_dim):
                raise NodeError(
                    f"{where}: reads {r.node}@{r.tag}, whose pool has {b.num_layers} layers x {b.kv_heads} KV heads "
                    f"x {b.head_dim}; this node's has {a.num_layers} x {a.kv_heads} x {a.head_dim}"
                )
            need = -(-r.kv_len // b.page_size)
            if r.kv_len < 0 or len(r.page_table) < need or any(
                not 0 <= p < peer.num_pages for p in r.page_table[:need]
            ):
                raise NodeError(f"{where}: the page table {r.page_table[:need]} of {r.node}@{r.tag} does not hold "
                                f"{r.kv_len} tokens in a pool of {peer.num_pages} pages")

    def _check_slots(self, phase: str, e: StepEntry) -> KVSlots:
        where = f"node '{self.name}' phase '{phase}', request '{e.request_id}' tag '{e.tag or DEFAULT_TAG}'"
        kv = e.kv
        if kv is None:
            raise NodeError(f"{where}: a KV node's entry needs KV slots")
        if kv.start < 0 or kv.q_len < 0 or len(kv.slots) != kv.q_len or not 0 <= kv.cached <= kv.start:
            raise NodeError(f"{where}: {len(kv.slots)} slot(s) for q_len {kv.q_len} at start {kv.start} "
                            f"({kv.cached} cached)")
        ps, n_pages = self.page_size, self.num_pages
        need = -(-(kv.start + kv.q_len) // ps)
        if len(kv.page_table) < need or any(not 0 <= p < n_pages for p in kv.page_table[:need]):
            raise NodeError(
                f"{where}: page table {kv.page_table[:need]} does not hold {kv.start + kv.q_len} "
                f"tokens in a pool of {n_pages} pages"
            )
        table = kv.page_table
        for i, slot in enumerate(kv.slots):
            pos = kv.start + i
            if slot != table[pos // ps] * ps + pos % ps:
                raise NodeError(f"{where}: slot {slot} of token {pos} is not where its page table puts it")
        if kv.reads:
            self._check_reads(where, kv)
        return kv


def link_peers(engines: Iterable[Any]) -> None:
    """Let every KV engine of one worker find the others' pools, for the contexts its steps read."""
    kv = [e for e in engines if isinstance(e, KVCacheEngine)]
    for e in kv:
        e.peers = {o.name: o for o in kv}


@dataclass(frozen=True)
class _ReadPlan:
    """Where a reading step's queries and keys sit in the padded [entries, q_max / k_max] layout
    of `KVCacheEngine._read_attention`: per pool the (page, offset) of every key token and its
    padded row (`gathers`), each packed query's padded row, and the boolean mask
    [entries, q_max, k_max] (padding False; an entry without keys sees one zero key)."""

    entries: int
    q_max: int
    k_max: int
    gathers: tuple[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor], ...]
    q_dest: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def build(engine: KVCacheEngine, attending: list[KVSlots], over: tuple[int, ...], own: bool,
              device: torch.device) -> _ReadPlan:
        spans: list[list[tuple[Any, Sequence[int] | torch.Tensor, int]]] = []
        for kv in attending:
            parts = [(engine.peers[kv.reads[j].node].pool, kv.reads[j].page_table, kv.reads[j].kv_len)
                     for j in over if kv.reads[j].kv_len]
            if own:
                parts.append((engine.pool, kv.page_table, kv.start + kv.q_len))
            spans.append(parts)
        q_max = max(kv.q_len for kv in attending)
        totals = [sum(n for _, _, n in parts) for parts in spans]
        k_max = max(1, max(totals))
        # host index tensors built with a few torch ops per pool (no Python loop per token or per
        # entry where the mask is full), uploaded once: [pool id] -> (pool, parts' tables, lengths,
        # first padded key row of each part)
        groups: dict[int, tuple[Any, list[int], list[int], list[int], list[int]]] = {}
        for i, parts in enumerate(spans):
            at = 0
            for pool, table, n in parts:
                need = -(-n // pool.page_size)
                pages = table.tolist() if isinstance(table, torch.Tensor) else table
                g = groups.setdefault(id(pool), (pool, [], [], [], []))
                g[1].extend(int(p) for p in pages[:need])
                g[2].append(need)
                g[3].append(n)
                g[4].append(i * k_max + at)
                at += n
        gathers = []
        for pool, flat, needs, lengths, starts in groups.values():
            n_t, need_t = torch.tensor(lengths), torch.tensor(needs)
            part = torch.repeat_interleave(torch.arange(len(lengths)), n_t)
            t = torch.arange(int(n_t.sum())) - (torch.cumsum(n_t, 0) - n_t)[part]
            table_at = (torch.cumsum(need_t, 0) - need_t)[part]
            pages = torch.tensor(flat, dtype=torch.long)[table_at + t // pool.page_size]
            dest = torch.tensor(starts)[part] + t
            gathers.append((pool, upload_tensor(pages, device), upload_tensor(t % pool.page_size, device),
                            upload_tensor(dest, device)))
        q_lens = torch.tensor([kv.q_len for kv in attending])
        # every key of an entry visible to its queries (read contexts, and a "full" own context),
        # built on the device from the two length columns
        rows, cols = torch.arange(q_max, device=device), torch.arange(k_max, device=device)
        q_col = upload_tensor(q_lens, device)[:, None, None]
        k_col = upload_tensor(torch.tensor(totals), device)[:, None, None]
        mask = (rows[None, :, None] < q_col) & (cols[None, None, :] < k_col)
        for i, (kv, parts) in enumerate(zip(attending, spans, strict=True)):
            if totals[i] == 0:
                mask[i, :, 0] = True  # one zero key: the softmax over it gives zeros, not NaN
            elif own and kv.mask != "full" and kv.q_len > 1:  # the own context's causal / block mask
                n = parts[-1][2]
                m = attention_mask(kv.q_len, n, kv.mask, kv.block_size, device=device)  # type: ignore[arg-type]
                if m is not None:
                    mask[i, : kv.q_len, totals[i] - n : totals[i]] = m
        q_dest = torch.repeat_interleave(torch.arange(len(attending)) * q_max, q_lens)
        q_dest += torch.arange(int(q_lens.sum())) - torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens)
        return _ReadPlan(len(attending), q_max, k_max, tuple(gathers), upload_tensor(q_dest, device), mask)


def _same_value(a: Any, b: Any) -> bool:
    """Equal without reading a device: tensors only by identity (or equal CPU contents)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if a is b:
            return True
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return (a.device.type == "cpu" and b.device.type == "cpu" and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return _same_state(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # an object without a usable ==: not known to be equal
        return False


def _same_inputs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)


def _same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
