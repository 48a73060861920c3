"""The scheduler: which ready steps run together next, and KV pages for them.

Ready `StepCall`s of all requests are grouped by (node, phase, ranks): calls in one group
run as one batched step (continuous batching: requests join and leave between steps; CFG
branches of one request on different KV tags share a group). The largest group runs next
(a bigger batch costs about the same GPU time as a small one), up to `max_batch` entries in
issue order; the group of a call that has been passed over `max_wait` times runs first, so
no request starves. Groups on a `busy` rank (one that still runs a step the conductor sent
without waiting for it) are left out until it is free: a call waiting for its rank is not
passed over by choice, so its count stands still. A decode cohort with rows
(control/cohort.py) is a candidate too (`standing`), as big as its rows and as old as its
next step, under the same rules: a large cohort runs step after step, and a prefill waiting
beside it runs at the latest after `max_wait` cohort steps.

The window gather (`gather`, off at 0; docs/runtime.md, "Window gather"): a codec window
(a call of a stateless node's phase fed by a chunked stream, `window_phases`: SNAC,
Code2Wav) released by one request is usually soon followed by windows of the others, at
other decode steps. A window group with fewer calls than its batch limit is then left out
of the choice, so that those windows join it, while its most passed-over call has been
passed over fewer than `gather` times (the bound: at most `gather` other steps run before
it), and only while a running request with no call in the group could bring one, and
something else runs meanwhile (another group, or a step in flight on a busy rank); else,
or once full, it runs as before. Counting steps, not time: windows are released by decode
steps (Orpheus: each request every 7), and the count makes the choice the same on every
machine. At most `max_wait`, past which the starvation rule runs a call anyway.

`KVPages` holds the `BlockManager` of every KV node and turns an entry's `SeqPlan` into
the `KVSlots` the worker writes to. It never preempts by itself: when a reservation fails
it raises `OutOfPages`, and the conductor decides whom to preempt. With prefix caching it
also holds the prefix chunk (`prefix_chunk`, default `DEFAULT_PREFIX_CHUNK`): a hit's cached
length is rounded down to a multiple of it, and a keyed causal entry's `KVSlots.chunk` is set
to it, so that the worker computes the rest in those chunks (engine/chunked.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mstar_runtime.control.interpreter import StepCall
from mstar_runtime.engine.engines import KVSlots
from mstar_runtime.kv.block_manager import BlockManager, OutOfPages, SlotCopy
from mstar_runtime.ops.node import SeqPlan

GroupKey = tuple[str, str, tuple[int, ...]]

DEFAULT_PREFIX_CHUNK = 512  # tokens: the prefix chunk with prefix caching on (`KVPages`)
MAX_WAIT = 8  # times a ready call may be passed over before its group must run (`Scheduler.max_wait`)


class PrefixChunkError(ValueError):
    """A prefix chunk that is not a positive multiple of the KV page size."""


def check_prefix_chunk(chunk: Any, page_size: int, node: Any = None) -> int:
    """`chunk` when it is a positive multiple of `page_size`, else a `PrefixChunkError` naming the setting."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or chunk % page_size:
        pool = f" of node {node[0] if isinstance(node, tuple) else node!r}" if node is not None else ""
        raise PrefixChunkError(f"prefix_chunk (--prefix-chunk) must be a positive multiple of the KV page "
                               f"size{pool} ({page_size} tokens), got {chunk!r}")
    return chunk


class WindowGatherError(ValueError):
    """A window gather bound that is not an int from 0 to `MAX_WAIT`."""


def check_window_gather(steps: Any) -> int:
    """`steps` when it is an int from 0 to `MAX_WAIT`, else a `WindowGatherError` naming the setting."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_WAIT:
        raise WindowGatherError(f"window_gather (--window-gather) must be an int from 0 (off) to {MAX_WAIT} "
                                f"(the steps a codec window may wait for others; a call passed over {MAX_WAIT} "
                                f"times runs anyway), got {steps!r}")
    return steps


def window_phases(plan: Any) -> frozenset[tuple[str, str]]:
    """(node, phase) of every codec window call: a stateless node's phase that takes the end
    of a chunked stream's edge (an edge with a chunk policy) as an input."""
    out: set[tuple[str, str]] = set()
    for edge in plan.body.get("edges", ()):
        node, port = edge["dst"]
        if edge.get("policy") is None or plan.node(node).engine != "stateless":
            continue
        out.update((node, name) for name, phase in plan.node(node).phases.items() if port in phase.inputs)
    return frozenset(out)


@dataclass
class Standing:
    """A decode cohort as a scheduling candidate: its rows, and `seq`, the issue order of its
    next step (set when its last step ran), which ages like a ready call's."""

    key: Any
    rows: int
    seq: int


def group_key(call: StepCall) -> GroupKey:
    return call.op["node"], call.op["phase"], tuple(call.op["ranks"])


@dataclass
class Scheduler:
    max_batch: int
    node_limits: dict[str, int] = field(default_factory=dict)  # a node's own `max_batch` setting
    max_wait: int = MAX_WAIT  # times a ready call may be passed over before its group must run
    gather: int = 0  # the window gather's bound in steps (module docstring); 0: off
    windows: frozenset[tuple[str, str]] = frozenset()  # (node, phase) of the codec window calls
    _passed: dict[int, int] = field(default_factory=dict)  # call seq -> times passed over

    def next_group(
        self, ready: Iterable[StepCall], busy: Collection[int] = (), standing: Mapping[Any, Standing] | None = None,
        running: Collection[str] = (),
    ) -> tuple[Any, list[StepCall]] | None:
        """The next group to run and its calls (at most the batch limit), or None. `busy`:
        ranks that cannot take a step now. `standing`: decode cohorts with rows (key ->
        `Standing`), candidates like a group of their size; one picked comes back with no calls.
        `running`: the ids of the running requests (the window gather holds a window group
        only while one of them has no call in it). None also when every group is held by the
        gather while a busy rank's step may bring more windows."""
        groups: dict[Any, list[Any]] = {}
        held: dict[int, int] = {}  # calls waiting for a busy rank keep their pass count
        blocked = frozenset(busy)
        for call in ready:
            key = group_key(call)
            if blocked and not blocked.isdisjoint(key[2]):
                if call.seq in self._passed:
                    held[call.seq] = self._passed[call.seq]
                continue
            groups.setdefault(key, []).append(call)
        sizes = {k: len(v) for k, v in groups.items()}
        for key, st in (standing or {}).items():
            if blocked and not blocked.isdisjoint(key[2]):
                if st.seq in self._passed:
                    held[st.seq] = self._passed[st.seq]
                continue
            groups[key], sizes[key] = [st], st.rows
        if not groups:
            self._passed = held
            return None
        gathering = self._gathering(groups, running)
        if gathering and len(gathering) == len(groups):
            if blocked:  # a step in flight may bring windows: the conductor waits for it, counting nothing
                self._passed = {**{c.seq: self._passed[c.seq] for cs in groups.values() for c in cs
                                   if c.seq in self._passed}, **held}
                return None
            gathering = set()  # nothing else runs meanwhile: holding would only add latency
        # the oldest call that has been passed over max_wait times forces its group (not only the
        # oldest call of all: one waiting for a busy rank keeps its count and may be older)
        passed = self._passed
        starving = [c for calls in groups.values() for c in calls if passed.get(c.seq, 0) >= self.max_wait]
        if starving:
            oldest = min(starving, key=lambda c: c.seq)
            key = oldest.key if isinstance(oldest, Standing) else group_key(oldest)
        else:  # the biggest batch not gathering; among equals, the one with the oldest call
            key = max((k for k in groups if k not in gathering),
                      key=lambda k: (sizes[k], -min(c.seq for c in groups[k])))
        limit = self._limit(key[0])
        calls = sorted(groups[key], key=lambda c: c.seq)[:limit]
        chosen = {c.seq for c in calls}
        self._passed = {c.seq: self._passed.get(c.seq, 0) + 1
                        for cs in groups.values() for c in cs if c.seq not in chosen}
        self._passed.update(held)
        return key, [c for c in calls if not isinstance(c, Standing)]

    def _limit(self, node: str) -> int:
        return min(self.max_batch, self.node_limits.get(node, self.max_batch))

    def _gathering(self, groups: Mapping[Any, list[Any]], running: Collection[str]) -> set[Any]:
        """The window groups the gather holds this time (module docstring): not full, passed
        over fewer than `gather` times, and with a running request that has no call in them."""
        if not self.gather:
            return set()
        out = set()
        for key, calls in groups.items():
            if (key[0], key[1]) not in self.windows or len(calls) >= self._limit(key[0]):
                continue
            if max(self._passed.get(c.seq, 0) for c in calls) >= self.gather:
                continue
            ids = {c.request_id for c in calls}
            if any(rid not in ids for rid in running):
                out.add(key)
        return out


class KVPages:
    """The conductor's view of every KV pool: page tables per (request, tag) for each KV node."""

    def __init__(self, pools: dict[Any, tuple[int, int]], prefix_caching: bool = False,
                 prefix_chunk: int = DEFAULT_PREFIX_CHUNK):
        """pools: node -> (num_pages, page_size). `prefix_caching`: reuse cached KV blocks
        (block_manager.py); `prefix_chunk`: then a keyed causal prefill is computed in chunks
        of this many tokens at absolute multiples of it, and a hit reuses cached tokens up to
        such a multiple only (docs/runtime.md, "Prefix caching"): a positive multiple of every
        pool's page size, else a `PrefixChunkError` naming the setting."""
        self.prefix_caching = prefix_caching
        self.prefix_chunk = prefix_chunk if prefix_caching else 0
        if prefix_caching:
            for node, (_, size) in pools.items():
                check_prefix_chunk(prefix_chunk, size, node)
        self.managers = {node: BlockManager(pages, size, prefix_caching) for node, (pages, size) in pools.items()}

    def reserve(self, node: str, key: tuple[str, str], plan: SeqPlan, keys: list[int] | None = None) -> KVSlots:
        """The entry's slots; with `keys` (the content keys of its leading tokens, all or some:
        prefix caching) the cached leading blocks are shared, up to a multiple of the prefix
        chunk, and only the rest is reserved, at least one token; a causal entry's rest is then
        computed chunk by chunk (`KVSlots.chunk`)."""
        bm = self.managers[node]
        start = bm.seq_len(key) if key in bm else 0
        content = bm.version(key)  # before the append: what the queries attend to besides themselves
        cached, chunk = 0, 0
        if keys is not None and plan.keep and len(keys) <= plan.q_len:  # keys of the leading tokens
            # raises OutOfPages, changing nothing
            cached, slots = bm.append_cached(key, keys, plan.q_len - 1, plan.q_len, align=self.prefix_chunk)
            # a full or block mask lets earlier queries see later keys of the step: never cut
            chunk = self.prefix_chunk if plan.mask == "causal" else 0
        else:
            slots = bm.append(key, plan.q_len)  # raises OutOfPages, changing nothing
        return KVSlots(start=start + cached, q_len=plan.q_len - cached, slots=slots, page_table=bm.page_table(key),
                       mask=plan.mask, block_size=plan.block_size, keep=plan.keep, content=content, cached=cached,
                       chunk=chunk)

    def commit(self, node: str, key: tuple[str, str]) -> None:
        """The step that wrote `key`'s tokens finished: their full blocks may be found by others."""
        bm = self.managers[node]
        if bm.prefix is not None:
            bm.commit(key)

    def prefix_stats(self) -> dict[str, int]:
        """Prefix-cache counters of all pools: tokens looked up, found cached, pages cached, evicted."""
        bms = list(self.managers.values())
        return {"prefix_query_tokens": sum(b.query_tokens for b in bms),
                "prefix_hit_tokens": sum(b.hit_tokens for b in bms),
                "prefix_cached_pages": sum(b.cached_pages for b in bms),
                "prefix_evictions": sum(b.prefix.evictions for b in bms if b.prefix is not None)}

    def truncate(self, node: str, key: tuple[str, str], length: int) -> SlotCopy | None:
        bm = self.managers[node]
        return bm.truncate(key, length) if key in bm else None

    def fork(self, node: str, src: tuple[str, str], dst: tuple[str, str]) -> SlotCopy | None:
        bm = self.managers[node]
        if dst in bm:  # the destination is replaced, also by an empty source
            bm.free(dst)
        if src not in bm:  # forking an empty context gives an empty context
            return None
        return bm.fork(src, dst)

    def rename(self, node: str, src: tuple[str, str], dst: tuple[str, str]) -> None:
        self.managers[node].rename(src, dst)

    def free(self, node: str, key: tuple[str, str]) -> None:
        bm = self.managers[node]
        if key in bm:
            bm.free(key)

    def free_request(self, request_id: str) -> int:
        return sum(bm.free_request(request_id) for bm in self.managers.values())

    def holds(self, request_id: str) -> bool:
        return any(bm.tags(request_id) for bm in self.managers.values())

    def capacity_tokens(self, node: str) -> int:
        bm = self.managers[node]
        return bm.num_pages * bm.page_size

    def used_pages(self) -> int:
        return sum(bm.used_pages for bm in self.managers.values())

    def total_pages(self) -> int:
        return sum(bm.num_pages for bm in self.managers.values())


__all__ = ["DEFAULT_PREFIX_CHUNK", "MAX_WAIT", "KVPages", "OutOfPages", "Scheduler", "PrefixChunkError", "Standing",
           "WindowGatherError", "check_prefix_chunk", "check_window_gather", "group_key", "window_phases"]
