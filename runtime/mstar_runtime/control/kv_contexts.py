"""A request's KV contexts as the conductor keeps them: pages, truncation, forks, moves, reads.

`KVContexts` owns the page tables of every KV pool (`scheduler.KVPages`, one `BlockManager`
per (node, rank)) and does what changes a context on both sides at once, the host's page
tables and the worker's slots: truncation (every rank that holds more), forks (on every rank
of the node), and moves between ranks. It never preempts: an operation that needs a page the
pool lacks raises `OutOfPages`, and the conductor decides whom to preempt.

KV contexts that move (the plan's `placement.transfers` of kind "kv": a context written on
one rank and continued by a step on another, as BAGEL's CFG contexts prefilled on rank 0
and denoised on ranks 1 and 2): before the consumer step's first reservation on its rank
(or before its loop's row joins that rank's cohort), the destination's context of that
(node, tag) is replaced by the source's, once per request attempt and walk
(`Conductor.move_in`, with `move_source` and `move`). The source is the rank the context's
last write went to (`Request.homes`; the plan names each rank that may have written it
last): a context last written on the destination itself, by an earlier loop there, does not
move. A move copies pages of the same length in the destination pool (a full pool preempts
as a fork does), the pages' contents and the node's state for the context
(`Worker.export_kv` / `import_kv`, through rank 0 when neither end is rank 0). A state that
cannot travel (`KVNode.export_state` refuses it) fails the request, naming the node; a
tensor-parallel node's contexts never move (the request fails, saying so).

Undoing a fork (`restore`): a `fork` inside a speculative `dynamic_loop` iteration first
keeps the destination's context under a backup tag (interpreter.py); if the iteration is
thrown away, the backup's pages and state become the destination's again, and once the
iteration stands the backup is freed (`free`).

Reads (plan feature `kv_reads`): a call whose op has `reads` gets, with its own KV slots,
the length and page table of every context it reads (`engines.ReadSlots`, the same
request's `node@tag` as that node's BlockManager on the call's first rank holds it), taken
after its own reservation (`read_slots`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from mstar_runtime.control.interpreter import ForkKV
from mstar_runtime.control.requests import Request
from mstar_runtime.control.scheduler import DEFAULT_PREFIX_CHUNK, KVPages
from mstar_runtime.engine.engines import ReadSlots
from mstar_runtime.ops.node import KVNode, NodeSpec
from mstar_runtime.plan.loader import Plan

MoveKey = tuple[str, str, str, int]  # (walk, consumer step, "node@tag", destination rank)
NO_CONTEXT = "~none"  # a tag no context ever has: a fork from it empties its destination


class KVWorker(Protocol):
    """What a rank's worker does to KV contexts (a `Worker` here, a `RemoteWorker` for a process)."""

    def fork(self, node: str, request_id: str, src_tag: str, dst_tag: str, copy: Any) -> None: ...
    def copy_slots(self, node: str, copy: Any) -> None: ...
    def export_kv(self, node: str, request_id: str, tag: str, pages: list[int]) -> dict[str, Any]: ...
    def import_kv(self, node: str, request_id: str, tag: str, pages: list[int], values: Mapping[str, Any]) -> None: ...


class KVContexts:
    """Every KV pool's page tables and the operations on a request's contexts (module docstring)."""

    def __init__(self, plan: Plan, workers: Mapping[int, KVWorker], prefix_caching: bool = False,
                 prefix_chunk: int = DEFAULT_PREFIX_CHUNK):
        self.plan = plan
        self.workers = workers
        self.pages = KVPages({(name, rank): (plan.kv_pages(name, rank), plan.page_size)
                              for name, rank in plan.kv_pools()}, prefix_caching, prefix_chunk)
        self._classes: dict[str, type[KVNode]] = {}
        self._specs: dict[str, NodeSpec] = {}
        # the plan's KV-context moves (placement.transfers of kind "kv") -> source rank
        self.moves: dict[MoveKey, int] = {}
        for t in plan.body.get("placement", {}).get("transfers", ()):
            if t.get("kind") == "kv":
                self.moves.setdefault((t["walk"], t["consumer_step"], t["value"], t["dst_rank"]), t["src_rank"])

    def node_class(self, node: str) -> tuple[type[KVNode], NodeSpec]:
        """The node's implementation class and spec (for its `kv_plan`), imported once."""
        if node not in self._classes:
            info = self.plan.node(node)
            module, _, cls = info["impl"].rpartition(".")
            self._classes[node] = getattr(importlib.import_module(module), cls)
            self._specs[node] = self.plan.node_spec(node)
        return self._classes[node], self._specs[node]

    def token_budget(self, node: str) -> int | None:
        """The node's `max_prefill_tokens` setting, when the walk sets one: the most new tokens
        one batched step of it takes (the memory pass sized the activations for that many);
        the first entry of a step is always taken."""
        value = self.node_class(node)[1].settings.get("max_prefill_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def truncate(self, node: str, key: tuple[str, str], length: int) -> None:
        """Cut the context `key` of `node` to `length` tokens on every rank that holds more: a
        context moved to another rank (a kv transfer) leaves its shorter source copy behind."""
        for (n, rank), bm in list(self.pages.managers.items()):
            if n == node and key in bm and bm.seq_len(key) > length:
                copy = self.pages.truncate((n, rank), key, length)
                if copy is not None:
                    self.workers[rank].copy_slots(node, copy)

    def fork(self, req: Request, f: ForkKV) -> None:
        """Copy the context `f.node@f.src` of `req` to `f.dst` on every rank (shared pages); raises OutOfPages."""
        for (n, rank), _ in list(self.pages.managers.items()):
            if n != f.node:
                continue
            copy = self.pages.fork((n, rank), (req.id, f.src), (req.id, f.dst))
            self.workers[rank].fork(f.node, req.id, f.src, f.dst, copy)
        home = req.homes.get((f.node, f.src))  # a fork copies on every rank: the copy of the last write leads
        if home is None:
            req.homes.pop((f.node, f.dst), None)
        else:
            req.homes[(f.node, f.dst)] = home

    def restore(self, req: Request, node: str, backup: str, dst: str) -> None:
        """Undo a fork onto `dst` (a discarded speculative iteration's): `dst` becomes the
        `backup` taken just before it again, pages and node state, on every rank, and the
        backup is gone. No page is allocated."""
        for (n, rank), _ in list(self.pages.managers.items()):
            if n != node:
                continue
            self.pages.rename((n, rank), (req.id, backup), (req.id, dst))
            self.workers[rank].fork(node, req.id, backup, dst, None)  # the state; the pages were renamed
            self.workers[rank].fork(node, req.id, NO_CONTEXT, backup, None)  # drops the backup's state
        home = req.homes.pop((node, backup), None)
        if home is None:
            req.homes.pop((node, dst), None)
        else:
            req.homes[(node, dst)] = home

    def free(self, req: Request, node: str, tag: str) -> None:
        """Drop one context of `req` (a backup no discarded iteration can need any more)."""
        for (n, rank), _ in list(self.pages.managers.items()):
            if n == node:
                self.pages.free((n, rank), (req.id, tag))
                self.workers[rank].fork(node, req.id, NO_CONTEXT, tag, None)
        req.homes.pop((node, tag), None)

    def move_source(self, req: Request, key: MoveKey) -> int | None:
        """The rank to copy `req`'s context from before step `key` runs on rank `key[3]`; None when
        nothing moves (the plan moves nothing there, it moved already in this attempt and walk,
        or the context was last written on the destination itself)."""
        src = self.moves.get(key)
        if src is None or key in req.moved:
            return None
        node, _, tag = key[2].partition("@")
        # the plan names every rank that may have written the context last (a loop that ran
        # no iteration, say); the copy to take is the one its last write went to
        src = req.homes.get((node, tag), src)
        if src == key[3]:  # written here last (an earlier loop on this rank): nothing to move
            req.moved.add(key)
            return None
        return src

    def move(self, req: Request, node: str, tag: str, src: int, dst: int) -> None:
        """Rank `dst`'s context `node@tag` of `req` becomes rank `src`'s: the same length in
        pages of its own pool (whatever it held is replaced), the pages' contents and the node
        state copied over (through rank 0 when neither end is rank 0). OutOfPages changes
        nothing but the freed destination."""
        key = (req.id, tag)
        sbm, dbm = self.pages.managers[(node, src)], self.pages.managers[(node, dst)]
        n = sbm.seq_len(key) if key in sbm else 0
        src_pages = sbm.page_table(key)[: sbm.pages_needed(n)] if n else []
        if key in dbm:
            dbm.free(key)
        if n:
            dbm.append(key, n)  # raises OutOfPages
        dst_pages = dbm.page_table(key) if n else []
        values = self.workers[src].export_kv(node, req.id, tag, src_pages)
        self.workers[dst].import_kv(node, req.id, tag, dst_pages, values)

    def read_slots(self, rank: int, request_id: str, reads: list[dict[str, Any]]) -> tuple[ReadSlots, ...]:
        """Where the contexts a call reads lie, as their nodes' BlockManagers on `rank` hold them now."""
        out = []
        for r in reads:
            bm = self.pages.managers[(r["node"], rank)]
            key = (request_id, r["tag"])
            n = bm.seq_len(key) if key in bm else 0
            out.append(ReadSlots(r["node"], r["tag"], n, bm.page_table(key) if n else []))
        return tuple(out)

    def holders(self, running: Iterable[Request]) -> list[Request]:
        """The requests among `running` that hold KV pages."""
        return [r for r in running if self.pages.holds(r.id)]

    def newest_holder(self, running: Iterable[Request]) -> Request | None:
        """The latest-arrived request holding KV pages: the one a full pool preempts."""
        holders = self.holders(running)
        return max(holders, key=lambda r: r.arrival) if holders else None
