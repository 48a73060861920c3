"""Decode cohorts, the conductor's half: which requests are rows of a marked loop, and its events.

A loop the compiler marks (`cohort` on a `loop` op, docs/plan-format.md; a fixed `Loop(n)`
or a dynamic one) whose node offers a column step (`ops.cohort.CohortPhase`) runs here
instead of in the interpreter: the
request's walk task stops at the loop (`interpreter.EnterCohort`) and becomes a row of the
`Cohort` of that loop; its generator resumes only when it leaves. One cohort step is one
call of the worker (`CohortColumns.step`, runtime/mstar_runtime/engine/cohort_engine.py) for
every row. The host does, per step, a fixed number of numpy operations plus Python for the
rows that have an event -- never Python per row:

1. pages: rows whose next token starts a page get one from the `BlockManager` (the device
   table is written for those rows only), preempting the newest request on a full pool;
2. launch the step; every row's iteration count goes up;
3. take the previous step's outputs (one step late, so the host never waits for the step
   it just launched): items of item ports are appended to host arrays, the last values of
   every port kept for the loop's exit, and events found with vectorised compares:
   - a row whose `until` flag was raised, or that ran its limit (a fixed loop's count, a
     dynamic loop's `max`), leaves: its node columns are written back, and its task resumes
     after the loop with the carried values of its last valid step (as the interpreter's
     loops give them). A flag's row has run one more (wasted, speculative) step, which is
     truncated from its KV; a row at its limit runs none: before a launch that would step
     past a row's limit, the launched step is taken first (its outputs are waited for);
   - a row whose stream has a chunk due, or that has not flushed for `flush_every` steps,
     flushes: its new items are pushed to the stream buffer (as much as it has room for;
     the rest waits) and emitted as one appended value per emit;
4. a row that joined on an unread flag (its prefill's `done`) reads it once its first step
   is launched: if it said stop, the row leaves with nothing of the loop applied (one
   wasted step, as the interpreter's speculative loop wastes);
5. rows that left are filled by the last row (rows stay dense: a step is rows 0..n-1).

A replay after preemption may group a row's items differently (flush points depend on
buffer room); `Request.emit` counts what the client has in items, so it gets each once.

A chain (a loop body of several calls: the mark's `links`) is one cohort with one `Link` per
call: each link has its own KV context, pages and worker columns, the rows are the same on
every link, and the worker steps the links in body order (engine/cohort_chain.py); its
ports are named `k.port` (link k), so events and outputs are read as for one call.

Stream items pushed in groups and emits appended as one value per flush give the same
buffers and outputs as the item-by-item generic path (`concat` of appended values). What a
row could not push when it leaves is handed to its task, which pushes it with backpressure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from mstar_runtime.control.interpreter import CohortExit, EnterCohort, WalkTask, concat, read_flag
from mstar_runtime.control.requests import Request
from mstar_runtime.control.streams import StreamBuffer
from mstar_runtime.control.validate import TORCH_DTYPES
from mstar_runtime.engine.cohort_engine import CohortRead, CohortResult, CohortShape, JoinRow
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.kv.block_table import pinned
from mstar_runtime.ops.cohort import count_key
from mstar_runtime.ops.node import RequestError, SeqPlan
from mstar_runtime.ops.readback import Lazy, resolve
from mstar_runtime.plan.planfile import cohort_links

CohortKey = tuple[str, str, tuple[int, ...], str]  # (node, phase, ranks, loop id)
FLUSH_EVERY = 8  # steps between flushes of a row's emits when no stream chunk is due
NEVER = np.iinfo(np.int64).max  # a `due` item count no row reaches (no stream to flush for)


class CohortHost(Protocol):
    """What a cohort needs of the engine loop (the conductor implements it)."""

    def row_left(self, task: WalkTask, done: CohortExit) -> None:
        """A row's loop is over: its task goes on after the loop with `done`."""

    def free_pages(self, cohort: Cohort) -> bool:
        """The pool is full: free pages as a generic step would (preempting, or failing the one
        request that can never fit); False when nothing can be freed."""

    def fail(self, request: Request, message: str) -> None:
        """Fail one request (its row goes with it)."""


@dataclass(frozen=True)
class PortSpec:
    """How one output port of the loop's call comes back: items per step, their dtype, a row's shape."""

    name: str
    items: bool  # an item list (symbolic first dim): `count_key(name)` says how many per step
    kind: str  # "tensor" | "bool" | "int" | "float"
    dtype: torch.dtype | None
    row_shape: tuple[int, ...]  # of one step's value (items: of one item)


@dataclass(frozen=True, eq=False)
class Joining:
    """A request entering a marked loop (`Cohort.join`): its task, its `EnterCohort`, the tag
    of the KV context its steps extend."""

    request: Request
    task: WalkTask
    enter: EnterCohort
    tag: str


@dataclass(eq=False)
class Link:
    """One call of a cohort's loop as its rows' KV contexts see it: a loop of one call has one,
    a chain (engine/cohort_chain.py) one per call, in body order."""

    key: CohortKey  # its columns on the worker
    call: dict[str, Any]  # the call op
    shape: CohortShape
    bm: BlockManager
    max_len: int
    max_pages: int
    rows: int
    prefix: str = ""  # its ports' prefix in the cohort's ports and inputs ("" for a loop of one call)
    # the call's inputs -> how a step uses the row's context (its node's kv_plan)
    kv_plan: Callable[[Mapping[str, Any]], SeqPlan] = lambda inputs: SeqPlan(1)
    # a request id -> (pages, length) of each context the call reads, as they are when its row
    # joins (None: the call reads none)
    read_rows: Callable[[str], list[tuple[list[int], int]]] | None = None
    tokens: int | None = None  # KV tokens a row adds per step (the first row's kv_plan says)
    keep: bool = True  # whether a step keeps its tokens (the first row's kv_plan says): else no pages

    def __post_init__(self) -> None:
        self.lens = np.zeros(self.rows, dtype=np.int64)  # KV tokens before the row's next step
        self.pages = np.zeros(self.rows, dtype=np.int64)  # pages its table holds

    @property
    def tag(self) -> str:
        return self.call.get("tag") or "main"

    def inputs(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """This call's own inputs of an `EnterCohort`'s (a chain's are prefixed by link)."""
        if not self.prefix:
            return inputs
        return {port[len(self.prefix):]: v for port, v in inputs.items() if port.startswith(self.prefix)}


@dataclass(eq=False)
class Member:
    request: Request
    task: WalkTask
    enter: EnterCohort
    keys: list[tuple[str, str]]  # (request id, tag): its KV context on each link
    row: int
    join_lens: list[int]  # KV tokens of each link's context when it joined
    pending_flag: Any  # the loop's `until` flag bound before the loop (read after its first launch), or None
    alive: bool = True

    @property
    def key(self) -> tuple[str, str]:
        """Its first call's KV context."""
        return self.keys[0]


class Cohort:
    """The rows of one marked loop on one rank (see the module docstring)."""

    def __init__(self, key: CohortKey, op: dict[str, Any], ports: dict[str, PortSpec], worker: Any,
                 links: Sequence[Link], rows: int, host: CohortHost, *, flush_every: int = FLUSH_EVERY):
        """`ports`: every output port of every link, by its prefixed name."""
        self.key, self.op, self.ports, self.worker = key, op, ports, worker
        self.links = list(links)
        self.chain = len(self.links) > 1
        self.rows, self.flush_every = rows, flush_every
        self.host = host
        self.port_of: dict[str, str] = {}  # result var -> its (prefixed) port
        self.emits: list[tuple[str, str]] = []  # (output, port)
        self.feeds: list[tuple[str, str]] = []  # (stream, port)
        # (acc name, output port, "in" | "out", the var it accumulates): every valid step's value
        # of the port is kept on the host; "in" accumulates the value an iteration starts with
        self.accs: list[tuple[str, str, str, str]] = []
        acc_vars = {a["name"]: a["value"].get("var") for a in op.get("acc") or ()}
        for link, mark in zip(self.links, cohort_links(op["cohort"]), strict=True):
            p = link.prefix
            self.port_of.update({name: p + port for port, name in link.call["results"]})
            self.emits += [(out, p + port) for out, port in mark["emits"]]
            self.feeds += [(f["stream"], p + f["port"]) for f in link.call.get("feeds", ())]
            self.accs += [(n, p + port, w, acc_vars[n]) for n, port, w in mark.get("accs") or ()]
        self.until_port = self.port_of.get(op["until"]) if op.get("dynamic") else None
        # (node, rank) of the pool whose page the last step could not get (`host.free_pages` names it)
        self.short_pool: tuple[str, int] = (key[0], key[2][0])
        self.max_iters = int(op["max"]) if op.get("max") is not None else None
        self.members: list[Member] = []  # row order
        self._by_request: dict[str, Member] = {}  # request id -> its row (every request's release asks)
        self.step_index = 0
        # host mirrors, per row (each link's lengths and pages are its own)
        self.iters = np.zeros(rows, dtype=np.int64)  # steps launched
        self.valid = np.zeros(rows, dtype=np.int64)  # steps whose outputs were applied
        self.since = np.zeros(rows, dtype=np.int64)  # valid steps since the last flush
        self.due = np.full(rows, NEVER, dtype=np.int64)  # stream items at which to flush
        self.limit = np.full(rows, NEVER, dtype=np.int64)  # iterations it runs at most (count, or max)
        item_ports = sorted({p for _, p in self.emits} | {p for _, p in self.feeds} | {a[1] for a in self.accs})
        self.item_ports = item_ports
        self.nitems = {p: np.zeros(rows, dtype=np.int64) for p in item_ports}
        self.flushed = {p: np.zeros(rows, dtype=np.int64) for p in item_ports}
        self.pushed = {p: np.zeros(rows, dtype=np.int64) for p in item_ports}
        self.last: dict[str, np.ndarray] = {}
        self.items: dict[str, np.ndarray] = {}  # port -> [rows, cap, width] host items
        # the last launched step: its outputs, the current row of each of its rows (-1: gone; kept
        # up to date by _drop_row, so no Python runs per row to map them), and its members
        self._outstanding: tuple[CohortResult, np.ndarray, list[Member]] | None = None
        self._joined: list[Member] = []  # joined since the last launch (their lanes flush after it)
        self._flags: list[Member] = []  # rows whose first step ran on an unread `until` flag
        self.stats = {"steps": 0, "row_steps": 0, "joins": 0, "leaves": 0, "flushes": 0, "wasted_steps": 0}

    # ------------------------------------------------------------------ membership
    @property
    def n(self) -> int:
        return len(self.members)

    def join(self, joining: Sequence[Joining]) -> None:
        """Add requests as the last rows, in order, in one worker call per link (each one's KV
        context must hold at least one token, unless its steps keep nothing): all of them or
        none. RequestError declines one (its `request_ids` name it) and nothing changes: a
        step of it would not add the cohort's tokens and keep them (or not) as the cohort's
        rows do, or its node's join refuses it; a WorkerStepError (the worker failed the
        join) and WorkerLost change nothing here either."""
        first = self.n
        steps = [(link.tokens, link.keep) for link in self.links]
        rows: list[list[JoinRow]] = [[] for _ in self.links]
        members: list[Member] = []
        for j in joining:
            for li, link in enumerate(self.links):
                tokens, keep = steps[li]
                plan = link.kv_plan(link.inputs(j.enter.inputs))
                row_keep = plan.keep if tokens is None else keep
                if plan.q_len < 1 or plan.q_len != (tokens or plan.q_len) or plan.keep != row_keep:
                    err = RequestError(f"a step of {plan.q_len} tokens ({'kept' if plan.keep else 'not kept'}) in a "
                                       f"cohort of {tokens or plan.q_len}-token steps "
                                       f"({'kept' if row_keep else 'not kept'})")
                    err.request_ids = [j.request.id]  # type: ignore[attr-defined]
                    raise err
                steps[li] = (plan.q_len, plan.keep)
                rows[li].append(self._join_row(j, link, plan.q_len))
            members.append(Member(j.request, j.task, j.enter, [(j.request.id, link.tag) for link in self.links],
                                  first + len(members), [r[-1].length for r in rows],
                                  j.enter.env.get(self.op["until"]) if self.until_port is not None else None))
        if not members:
            return
        self._join_links(first, rows, members)
        for link, (tokens, keep), link_rows in zip(self.links, steps, rows, strict=True):
            link.tokens, link.keep = tokens, keep
            link.lens[first : first + len(link_rows)] = [r.length for r in link_rows]
            link.pages[first : first + len(link_rows)] = [len(r.pages) for r in link_rows]
        end = first + len(members)
        for a in (self.iters, self.valid, self.since, *self.nitems.values(), *self.flushed.values(),
                  *self.pushed.values()):
            a[first:end] = 0
        self.limit[first:end] = [NEVER if r.steps is None else r.steps for r in rows[0]]
        for m in members:
            self.members.append(m)
            self._by_request[m.request.id] = m
            self._joined.append(m)
            if m.pending_flag is not None:
                self._flags.append(m)
            self.due[m.row] = self._next_due(m, m.row)
        self.stats["joins"] += len(members)

    def _join_links(self, first: int, rows: list[list[JoinRow]], members: list[Member]) -> None:
        """The worker calls of a join: each link's rows (a link that refuses leaves the earlier
        ones as they were: their columns count `first` rows again); for a chain, whether each
        row's flag already said stop (a later link must not step such a row): its device
        value where it has one (`join_flag`), unread, as `step` reads it a step late."""
        for li, link in enumerate(self.links):
            try:
                self.worker.cohort_join(link.key, first, rows[li])
            except Exception:
                for earlier in self.links[:li]:
                    self.worker.cohort_shrink(earlier.key, first)
                raise
        if self.chain:
            self.worker.cohort_chain_join(self.key, first, [join_flag(m.pending_flag) for m in members])

    def _join_row(self, j: Joining, link: Link, tokens: int) -> JoinRow:
        """What the worker's columns of `link` need of a joining request (its context as the BlockManager has it)."""
        key = (j.request.id, link.tag)
        own = key in link.bm
        enter, inputs = j.enter, link.inputs(j.enter.inputs)
        return JoinRow(j.request.id, link.tag, {in_port: inputs[in_port] for in_port, _ in link.shape.fed},
                       {port: inputs[port] for port in link.shape.invariant},
                       link.bm.page_table(key) if own else [], link.bm.seq_len(key) if own else 0,
                       enter.count if enter.count is not None else self.max_iters, tokens,
                       link.read_rows(j.request.id) if link.read_rows is not None else [])

    def remove(self, request: Request) -> bool:
        """Drop a request's row without resuming it (preempted, cancelled, failed). True if it was here."""
        m = self._by_request.get(request.id)
        if m is None or m.request is not request:
            return False
        self._drop_row(m)
        return True

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """Pages, launch, then the previous step's events (see the module docstring)."""
        if not self.members:
            self.drain()
            return
        n = self.n
        if self._outstanding is not None and bool((self.iters[:n] >= self.limit[:n]).any()):
            # a row ran its count (or `max`): it leaves once that step is taken, before another,
            # wasted, step; only rows with a stop flag run speculatively past their end
            self.drain()
            if not self.members:
                return
        if not self._reserve_pages():
            return
        n = self.n
        result = self.worker.cohort_chain_step(self.key, n) if self.chain else self.worker.cohort_step(self.key, n)
        result.index = self.step_index
        for link in self.links:
            if link.keep:
                link.lens[:n] += link.tokens or 1
        self.iters[:n] += 1
        self.stats["steps"] += 1
        self.stats["row_steps"] += n
        prev, self._outstanding = self._outstanding, (result, np.arange(n), list(self.members))
        self.step_index += 1
        # the new rows' lanes (their prefill's lazy effects) resolve once a step of theirs is launched
        joined, self._joined = self._joined, []
        for m in joined:
            if m.alive:  # a row preempted before its first launch has no lane to resolve any more
                m.enter.frame.flush_lane()
        if prev is not None:
            self._take(*prev)
        # a flag bound before the loop (its prefill's `done`) is read once the row's first step
        # is launched, as the interpreter's speculative loop reads it: if it said stop, that one
        # step is wasted and the row leaves with nothing of the loop applied
        if self._flags:
            flags, self._flags = self._flags, []
            for m in flags:
                if m.alive and read_flag(m.pending_flag):
                    self._leave(m)

    def drain(self) -> None:
        """Take the outstanding step's outputs without launching another (nothing left to run)."""
        if self._outstanding is not None:
            prev, self._outstanding = self._outstanding, None
            self._take(*prev)

    def _reserve_pages(self) -> bool:
        """The pages every row's next step writes into, on every link (one where its next token
        starts a page; as many as its block spans; none when it keeps nothing); False when no
        row is left to step."""
        while self.members:
            blocked = None
            for li, link in enumerate(self.links):
                if link.keep:
                    blocked = self._link_pages(li, link)
                    if blocked is not None:
                        break
            if blocked is None:
                return True
            link, m = blocked
            if link.pages[m.row] >= link.max_pages:  # the node let its context outgrow the plan's bound
                self.host.fail(m.request, f"the KV context of node '{link.key[0]}' grew past its max_seq_len "
                               f"({link.max_len} tokens)")
                continue
            self._sync_lengths()
            self.short_pool = (link.key[0], link.key[2][0])
            if not self.host.free_pages(self):
                return False
        return False

    def _link_pages(self, li: int, link: Link) -> tuple[Link, Member] | None:
        """Pages for one link's rows, in row order, until one cannot have its page (that row)."""
        ps, q = link.bm.page_size, link.tokens or 1
        n = self.n
        short = -(-(link.lens[:n] + q) // ps) - link.pages[:n]  # pages the next step still needs
        rows, cols, pages = [], [], []
        blocked: tuple[Link, Member] | None = None  # the first row that could not get its page
        for r in np.nonzero(short > 0)[0].tolist():
            m = self.members[r]
            for _ in range(int(short[r])):
                if link.pages[r] >= link.max_pages or link.bm.free_pages == 0:
                    blocked = (link, m)
                    break
                pages.append(link.bm.add_page(m.keys[li]))
                cols.append(int(link.pages[r]))
                rows.append(r)
                link.pages[r] += 1
            if blocked is not None:
                break
        self.worker.cohort_add_pages(link.key, np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64),
                                     np.array(pages, dtype=np.int64))
        return blocked

    def _sync_lengths(self) -> None:
        """Tell each BlockManager every row's length (a preemption may look at them)."""
        for li, link in enumerate(self.links):
            for m in self.members if link.keep else ():
                link.bm.set_length(m.keys[li], int(link.lens[m.row]))

    # ------------------------------------------------------------------ outputs and events
    def _take(self, result: CohortResult, rows_at_launch: np.ndarray, snapshot: list[Member]) -> None:
        alive = rows_at_launch >= 0
        if not alive.any():  # every row of that step is gone: its outputs (or its failure) concern no one
            return
        arrays = result.arrays()
        leaving: list[Member] = []
        idx = np.nonzero(alive)[0]
        cur = rows_at_launch[idx]
        if idx.size:
            self._record(arrays, idx, cur)
            stop = np.zeros(idx.size, dtype=bool)
            if self.until_port is not None:
                stop |= arrays[self.until_port][idx, 0] != 0
            stop |= self.valid[cur] >= self.limit[cur]
            flush = (self.since[cur] >= self.flush_every) | stop
            for p in self.item_ports:
                flush |= self.nitems[p][cur] >= self.due[cur]
            for j in np.nonzero(flush)[0].tolist():
                self._flush(snapshot[idx[j]])
            leaving = [snapshot[idx[j]] for j in np.nonzero(stop)[0].tolist()]
        for m in leaving:
            self._leave(m)

    def _record(self, arrays: dict[str, np.ndarray], idx: np.ndarray, cur: np.ndarray) -> None:
        for name, a in arrays.items():
            if name not in self.last:
                self.last[name] = np.zeros((self.rows, a.shape[1]), dtype=a.dtype)
            self.last[name][cur] = a[idx]
        for p in self.item_ports:
            vals = arrays[p][idx]
            spec = self.ports[p]
            counts = arrays[count_key(p)][idx, 0] if spec.items else np.ones(idx.size, dtype=np.int64)
            width = max(1, int(np.prod(spec.row_shape))) if spec.row_shape else 1
            k_max = vals.shape[1] // width
            base = self.nitems[p][cur]
            store = self._items(p, width, vals.dtype, int(base.max()) + k_max)
            v3 = vals.reshape(idx.size, k_max, width)
            for k in range(k_max):
                sel = counts > k
                store[cur[sel], base[sel] + k] = v3[sel, k]
            self.nitems[p][cur] = base + counts
        self.valid[cur] += 1
        self.since[cur] += 1

    def _items(self, port: str, width: int, dtype: np.dtype, need: int) -> np.ndarray:
        """The port's host item store, with room for `need` items a row (it doubles when short:
        a fixed loop's count has no compile-time bound)."""
        store = self.items.get(port)
        if store is None or store.shape[1] < need:
            cap = max(need, (self.max_iters or 256) + 1, 2 * (store.shape[1] if store is not None else 0))
            grown = np.zeros((self.rows, cap, width), dtype=dtype)
            if store is not None:
                grown[:, : store.shape[1]] = store
            store = self.items[port] = grown
        return store

    def _tensor(self, port: str, block: np.ndarray) -> torch.Tensor:
        spec = self.ports[port]
        shape = (block.shape[0], *spec.row_shape) if spec.items else (block.shape[0] * (spec.row_shape or (1,))[0],
                                                                      *spec.row_shape[1:])
        # a copy: the host store's row is reused once the row leaves (another row moves in)
        t = torch.from_numpy(np.array(block)).reshape(shape)
        dtype = spec.dtype or torch.float32
        return t if t.dtype == dtype else t.to(dtype)

    def _flush(self, m: Member) -> None:
        r = m.row
        req, frame = m.request, m.enter.frame
        for output, port in self.emits:
            lo, hi = int(self.flushed[port][r]), int(self.nitems[port][r])
            if hi > lo:
                value = self._tensor(port, self.items[port][r, lo:hi])
                frame.effect_on_lane(lambda output=output, value=value: req.emit(output, value, "append"), False)
        for port in self.item_ports:
            self.flushed[port][r] = self.nitems[port][r]
        for sid, port in self.feeds:
            buf: StreamBuffer = req.buffers[sid]
            lo, hi = int(self.pushed[port][r]), int(self.nitems[port][r])
            room = buf.capacity - buf.pending
            take = min(hi - lo, max(room, 0))
            if take > 0:
                items = self._tensor(port, self.items[port][r, lo : lo + take])
                frame.effect_on_lane(lambda sid=sid, buf=buf, items=items: req.push(sid, buf, items), False)
                self.pushed[port][r] = lo + take
        self.since[r] = 0
        self.due[r] = self._next_due(m, r)
        self.stats["flushes"] += 1

    def _next_due(self, m: Member, r: int) -> int:
        """The item count of the row's first stream port at which its next chunk is ready."""
        best = NEVER
        for sid, port in self.feeds:
            buf: StreamBuffer = m.request.buffers[sid]
            pushed = int(self.pushed[port][r])
            if pushed < int(self.nitems[port][r]):
                return int(self.nitems[port][r])  # items still wait for room: try at the next step
            best = min(best, buf.next_ready_at(pushed))
        return best

    def _leave(self, m: Member) -> None:
        """The row's loop is over: KV truncated to its valid steps, columns written back, task resumed."""
        if not m.alive:
            return
        r = m.row
        valid = int(self.valid[r])
        wasted = int(self.iters[r]) - valid  # read before _drop_row moves the last row here
        self.stats["wasted_steps"] += wasted
        # as the generic loop counts its calls: a wasted iteration runs the first call only
        m.request.stats.steps += int(self.iters[r]) + valid * (len(self.links) - 1)
        for li, link in enumerate(self.links):
            key = m.keys[li]
            if link.keep:
                link.bm.set_length(key, int(link.lens[r]))
                # the speculative step after the last valid one
                link.bm.truncate(key, m.join_lens[li] + valid * (link.tokens or 1))
            # a chain's later links ran no wasted step for it (engine/cohort_chain.py held their state)
            self.worker.cohort_leave(link.key, r, key[0], key[1], int(self.iters[r]) if li == 0 else valid)
        carry = {}
        if valid:
            for name in self.op["carry"]:
                port = self.port_of.get(name)
                if port is not None:
                    carry[name] = self._last_value(port, r)
        for name, port, when, var in self.accs:
            carry[name] = self._accumulated(m, port, when, var, valid)
        pushes = []
        for sid, port in self.feeds:
            lo, hi = int(self.pushed[port][r]), int(self.nitems[port][r])
            if hi > lo:
                pushes.append((sid, self._tensor(port, self.items[port][r, lo:hi])))
        for output, port in self.emits:
            lo, hi = int(self.flushed[port][r]), int(self.nitems[port][r])
            if hi > lo:
                value = self._tensor(port, self.items[port][r, lo:hi])
                m.enter.frame.effect_on_lane(
                    lambda req=m.request, output=output, value=value: req.emit(output, value, "append"), False)
        self.stats["leaves"] += 1
        self._drop_row(m)
        self.host.row_left(m.task, CohortExit(carry, pushes, wasted=wasted))

    def _accumulated(self, m: Member, port: str, when: str, var: str, valid: int) -> Any:
        """An acc's value after the row's `valid` iterations, as the interpreter's loop makes it
        (`concat` of one value per iteration): "out" the port's value of each, "in" the
        var's value as each began (its value at join, then the port's of the iterations
        before). A tensor acc that starts from a device value stays on that device: the
        host's items go up from pinned memory, without waiting for the step in flight."""
        spec, r = self.ports[port], m.row
        take = valid if when == "out" else max(valid - 1, 0)
        block = self.items[port][r, :take] if take else None
        if spec.kind != "tensor":
            values = [] if block is None else [v.item() for v in block.reshape(take, -1)[:, 0]]
            return concat(([m.enter.env[var]] if when == "in" and valid else []) + values)
        rest = self._tensor(port, block) if block is not None else None
        if when == "out" or not valid:
            return rest if rest is not None else concat([])
        first = resolve(m.enter.env[var])
        if rest is None:
            return concat([first])
        if isinstance(first, torch.Tensor) and first.device.type != "cpu":
            rest = pinned(rest.numpy()).to(first.device, non_blocking=True)
        return concat([first, rest])

    def _last_value(self, port: str, r: int) -> Any:
        spec = self.ports[port]
        a = self.last[port][r]
        if spec.items:
            k = int(self.last[count_key(port)][r, 0])
            width = max(1, int(np.prod(spec.row_shape))) if spec.row_shape else 1
            return self._tensor(port, a.reshape(-1, width)[:k])
        if spec.kind == "bool":
            return bool(a[0])
        if spec.kind in ("int", "float"):
            return a[0].item()
        return torch.from_numpy(np.array(a)).reshape(spec.row_shape).to(spec.dtype or torch.float32)

    def _drop_row(self, m: Member) -> None:
        """Remove `m`'s row; the last row moves into its place (host arrays and device columns)."""
        m.alive = False
        del self._by_request[m.request.id]
        r, last = m.row, self.n - 1
        if self._outstanding is not None:  # keep the launched step's row map current
            rows = self._outstanding[1]
            rows[rows == r] = -1
            rows[rows == last] = r
        if r != last:
            mover = self.members[last]
            for link in self.links:
                self.worker.cohort_move(link.key, last, r)
                link.lens[r], link.pages[r] = link.lens[last], link.pages[last]
            if self.chain:
                self.worker.cohort_chain_move(self.key, last, r)
            for a in (self.iters, self.valid, self.since, self.due, self.limit):
                a[r] = a[last]
            for group in (self.nitems, self.flushed, self.pushed):
                for a in group.values():
                    a[r] = a[last]
            for a in (*self.last.values(), *self.items.values()):
                a[r] = a[last]
            mover.row = r
            self.members[r] = mover
        self.members.pop()
        for link in self.links:
            self.worker.cohort_shrink(link.key, self.n)


def join_flag(flag: Any) -> bool | torch.Tensor:
    """A joining chain row's flag as `ChainColumns.join` takes it, without waiting for the
    device where it can: a tensor as it is, an unread `Lazy` its device source; a `Lazy`
    with none (a node's own readback) is read here, which waits for what made it."""
    if flag is None:
        return False
    if isinstance(flag, torch.Tensor):
        return flag
    if isinstance(flag, Lazy) and not flag.resolved and flag.device is not None:
        return flag.device
    return read_flag(flag)


def cohort_shape(mark: Mapping[str, Any], call: Mapping[str, Any], ports: Mapping[str, PortSpec],
                 reads: tuple[CohortRead, ...] = ()) -> CohortShape:
    """What the worker's columns need to know of a marked loop's call (from its single-call
    mark, a chain's link's included: `ports` the call's own, unprefixed)."""
    return CohortShape(call["phase"], tuple(tuple(f) for f in mark["fed"]), tuple(mark["invariant"]), tuple(ports),
                       reads, tuple(mark.get("index") or ()))


def port_specs(node_outputs: dict[str, Any], phase_outputs: tuple[str, ...]) -> dict[str, PortSpec]:
    """The PortSpecs of a phase's outputs from the plan's port types."""
    specs = {}
    for name in phase_outputs:
        t = node_outputs[name]
        kind = t["kind"]
        dims = list(t.get("dims", []))
        items = bool(dims) and not isinstance(dims[0], int)
        row = dims[1:] if items else dims
        shape = tuple(int(d) if isinstance(d, int) else 1 for d in row)
        dtype = TORCH_DTYPES.get(t.get("dtype") or "f32") if kind == "tensor" else None
        specs[name] = PortSpec(name, items, kind, dtype, shape)
    return specs


__all__ = ["Cohort", "CohortHost", "CohortKey", "Joining", "Link", "PortSpec", "cohort_shape", "join_flag",
           "port_specs"]
