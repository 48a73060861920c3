"""The conductor: requests, their walk tasks and stream buffers, and the engine loop.

One `Conductor` serves one plan. `submit` validates a request against its walk's typed
inputs and queues it; `step` runs one iteration of the engine loop:

1. admit waiting requests (up to `max_running`), starting each one's main `WalkTask`;
2. advance every runnable task until it blocks on a step, a chunk, space, or children;
3. take the answers of remote steps that have arrived, resuming their tasks;
4. let the `Scheduler` pick the next group of ready steps (same node, phase, ranks) among
   those whose ranks are free;
5. reserve KV pages for its entries, preempting the newest request when a pool is full;
6. run the group as one batched step on its worker(s) and resume the tasks with outputs.

Remote steps overlap: a group on one rank > 0 (a worker process, `remote.RemoteWorker`) is
sent with `submit` and the loop goes on with other ready groups (the backbone's next decode
on rank 0, say) while it runs; its answer is taken between steps once it is there, or waited
for when nothing else can run. At most one step is in flight per rank (the scheduler leaves
out groups on a busy rank). While a request has a step in flight it is never preempted (the
conductor first takes every answer in flight); if it ends meanwhile (cancelled, timed out,
failed by another of its steps) its pages are freed at once and the answer is dropped when
it comes: the worker frees its state after the step, since its pipe is FIFO, and every
later step that could reuse those pages runs on the same, still busy, rank. Local steps run
synchronously; a tensor-parallel group waits for its leader only (`tp_dispatch.TPDispatch`).
`stats` counts `remote_steps` (sent without waiting), `overlapped_steps` (started while a
remote step was in flight), `remote_wait_seconds` (blocked on an answer with nothing
else to run) and `kv_moves` (KV contexts copied between ranks, below).

KV contexts that move (the plan's `placement.transfers` of kind "kv": a context written on
one rank and continued by a step on another, as BAGEL's CFG contexts prefilled on rank 0
and denoised on ranks 1 and 2): before the consumer step's first reservation on its rank
(or before its loop's row joins that rank's cohort), the destination's context of that
(node, tag) is replaced by the source's, once per request attempt and walk (`_move_in`).
The source is the rank the context's last write went to (`Request.homes`; the plan names
each rank that may have written it last): a context last written on the destination
itself, by an earlier loop there, does not move. A move copies pages of the same length in the destination pool
(a full pool preempts as a fork does), the pages' contents and the node's state for the
context (`Worker.export_kv` / `import_kv`, through rank 0 when neither end is rank 0). A
state that cannot travel (`KVNode.export_state` refuses it) fails the request, naming the
node; a tensor-parallel node's contexts never move (the request fails, saying so).

Overlap lets work on other ranks move ahead of a remote step, so who is batched with whom
can change with timing (tokens stay the same; floats may differ in the last bits, as with
any change of batch). `overlap=False` keeps the one-rank order of steps, for bit-exact
comparisons; in lockstep workloads (Orpheus requests decoding together: every window is
released at the same step for all of them) the batches, and so the outputs, are the same.

A loop the compiler marked as a cohort (`cohort` on the loop op) runs, where its node offers
a column step, as a decode cohort (control/cohort.py, docs/runtime.md "Decode cohorts"): the
task yields `EnterCohort`, becomes a row, and is resumed only when it leaves; the scheduler
sees the cohort as one standing group of its rows (step 4), and a cohort step replaces
steps 5-6 for its rows. The node may be in a worker process (its cohort calls are messages,
worker/remote_cohort.py) or at tp > 1 (every rank of its group runs each call,
`tp_dispatch.TPCohort`). `path="generic"` (or $MSTAR_STEP_PATH) keeps every loop here.

Requests join and leave between steps (continuous batching); a finished request frees its
pages at once. A kv node's `max_prefill_tokens` setting bounds the new tokens of one of its
steps (`_token_budget`): the calls past it wait for the next step, the first always runs. A preempted request restarts from scratch later; whatever it already
streamed is not streamed again (replay is deterministic). `preempt_every=N` forces a
preemption every N steps, for tests.

Reads (plan feature `kv_reads`): a call whose op has `reads` gets, with its own KV slots,
the length and page table of every context it reads (`engines.ReadSlots`, the same
request's `node@tag` as that node's BlockManager on the call's first rank holds it), taken
after its own reservation. Such a loop is never a cohort. A tag with its own bound
(`tag_max_len`) fails the request that would take one of its contexts past it, naming
the node and tag, before any page is reserved.

Client-streamed inputs (plan feature `input_streams`): a walk input with a `stream` is fed
by the client in parts (`feed`, `close_input`; `submit(streaming=True)` leaves it out of
the inputs), or given whole at `submit`, which is one part and closed at once. Each
request keeps every part it was fed (`InputFeed`), so that an attempt after preemption
replays the input from its first item; parts move into the attempt's stream buffer as
its capacity allows (the stream's backpressure, also for one part larger than the
buffer), and the buffer closes once the client closed the input and every part is in.
A request whose tasks all wait on an input its client has not closed is waiting, not
stuck: `step()` then returns False with `stalled` set, until a feed, a close, a new
request or a cancellation (the API's engine thread sleeps meanwhile, up to the nearest
deadline: `next_deadline`). A listener with `on_input(request, name, pushed)` hears how
many items of a streamed input the current attempt has taken into its buffer.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar_runtime.control.bounds import check_bounds
from mstar_runtime.control.cohort import Cohort, CohortKey, cohort_shape, port_specs
from mstar_runtime.control.interpreter import (
    CohortExit,
    EnterCohort,
    ForkKV,
    Interpreter,
    Join,
    Spawn,
    StepCall,
    WaitChunk,
    WaitSpace,
    WalkError,
    WalkTask,
    _Wasted,
    chunk_inputs,
    concat,
    read_flag,
)
from mstar_runtime.control.scheduler import GroupKey, KVPages, Scheduler, Standing
from mstar_runtime.control.streams import StreamBuffer, StreamError, policy_from_spec
from mstar_runtime.control.validate import TORCH_DTYPES, coerce, validate_inputs
from mstar_runtime.engine.engines import KVSlots, ReadSlots, StepEntry
from mstar_runtime.kv.block_manager import OutOfPages
from mstar_runtime.ops.node import KVNode, NodeError, NodeSpec, RequestError, SeqPlan
from mstar_runtime.plan.loader import Plan
from mstar_runtime.plan.planfile import cohort_call
from mstar_runtime.worker.remote import EngineStopped, WorkerLost, can_submit
from mstar_runtime.worker.tp_dispatch import TPCohort, TPDispatch
from mstar_runtime.worker.worker import StepBatch, WorkerStepError

WAITING, RUNNING, FINISHED, FAILED, CANCELLED = "waiting", "running", "finished", "failed", "cancelled"
STEP_PATHS = ("cohort", "generic")
STEP_PATH_ENV = "MSTAR_STEP_PATH"  # "generic" forces every loop onto the generic path


def step_path(choice: str | None = None) -> str:
    """The step path to use: `choice`, else $MSTAR_STEP_PATH, else "cohort"."""
    value = (choice or os.environ.get(STEP_PATH_ENV) or "cohort").strip().lower()
    if value not in STEP_PATHS:
        raise ValueError(f"step path must be one of {', '.join(STEP_PATHS)}, got {value!r}")
    return value


def _empty(t: Mapping[str, Any]) -> Any:
    if t["kind"] == "str":
        return ""
    dtype = TORCH_DTYPES.get(t.get("dtype") or "f32", torch.float32)
    dims = [0] + [d if isinstance(d, int) else 0 for d in t.get("dims", [])[1:]]
    return torch.zeros(dims, dtype=dtype)


def stream_inputs(program: Mapping[str, Any]) -> dict[str, str]:
    """The walk's inputs the client streams in: input name -> stream id."""
    return {p["name"]: p["stream"] for p in program["inputs"] if p.get("stream")}


def coerce_items(walk: str, name: str, t: Mapping[str, Any], value: Any) -> torch.Tensor:
    """A part of a streamed input, checked against the input's type: its first dimension
    counts items (any number, also 0), the others and the dtype family as declared."""
    dims = list(t.get("dims") or [])
    return coerce(walk, name, {**t, "dims": ["items", *dims[1:]]}, value)


def port_input(call: StepCall, port: str | None) -> str | None:
    """The walk variable a node's refused port was given, so that the error names what the
    caller sent (`talker.prefill(max_frames = talker_max_frames)` refusing `max_frames` is a
    bad `talker_max_frames`); the port itself when its argument is no input of the walk (a
    value an earlier step made names no request field)."""
    arg = call.op.get("args", {}).get(port) if port is not None else None
    var = arg.get("var") if isinstance(arg, Mapping) else None
    return var if isinstance(var, str) and var in call.request.current_inputs else port


def check_inputs(walk: str, program: Mapping[str, Any], inputs: Mapping[str, Any], *,
                 streaming: bool = False, config: Mapping[str, Any] | None = None,
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor | None]]:
    """`validate_inputs` for a walk that may have streamed inputs: (the other inputs, typed and
    defaulted; streamed input -> its whole value, or None when the client feeds it). A
    streamed input may be left out only when `streaming`. With the plan's `config`, also
    the bounds of image-generation inputs (`bounds.check_bounds`: every one out of bounds,
    in one error)."""
    streamed = stream_inputs(program)
    if not streamed:
        values = validate_inputs(walk, program, inputs)
        if config is not None:
            check_bounds(walk, config, program, {k: values[k] for k in inputs if k in values})
        return values, {}
    declared = {p["name"]: p for p in program["inputs"]}
    plain = {**program, "inputs": [p for p in program["inputs"] if p["name"] not in streamed]}
    values = validate_inputs(walk, plain, {k: v for k, v in inputs.items() if k not in streamed})
    if config is not None:
        check_bounds(walk, config, plain, {k: values[k] for k in inputs if k in values})
    whole: dict[str, torch.Tensor | None] = {}
    for name in streamed:
        value = inputs.get(name)
        if value is not None:
            whole[name] = coerce_items(walk, name, declared[name]["type"], value)
        elif streaming:
            whole[name] = None
        else:
            raise RequestError(f"walk '{walk}', input '{name}': missing (the client streams it in: give it whole, "
                               "or submit with streaming=True and feed it)", name)
    return values, whole


@dataclass(eq=False)
class InputFeed:
    """A streamed walk input of one request: every part the client fed (kept, so that an attempt
    after preemption replays it), whether it is closed, and how far the current attempt has
    moved it into its stream buffer."""

    name: str
    stream: str
    type: Mapping[str, Any]
    parts: list[torch.Tensor] = field(default_factory=list)
    items: int = 0  # fed so far
    closed: bool = False
    whole: bool = False  # given whole at submit
    # ---- the current attempt
    buffer: StreamBuffer | None = None
    part: int = 0  # the next part to push, and how much of it is in already
    offset: int = 0
    pushed: int = 0

    def drained(self) -> bool:
        return self.part == len(self.parts)


def _items(value: Any) -> int:
    """How many items an appended value holds (a tensor: its rows, or 1 for a scalar; a string: its characters)."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, str):
        return len(value)
    return 1


class WorkerLike(Protocol):
    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]: ...
    def fork(self, node: str, request_id: str, src_tag: str, dst_tag: str, copy: Any) -> None: ...
    def copy_slots(self, node: str, copy: Any) -> None: ...
    def free(self, request_id: str) -> None: ...
    def drop_tag(self, node: str, request_id: str, tag: str) -> None: ...
    def export_kv(self, node: str, request_id: str, tag: str, pages: list[int]) -> dict[str, Any]: ...
    def import_kv(self, node: str, request_id: str, tag: str, pages: list[int], values: Mapping[str, Any]) -> None: ...


class StepHandleLike(Protocol):
    def ready(self) -> bool: ...
    def result(self) -> list[dict[str, Any]]: ...


_OVER_BUDGET = object()  # `_reserve_one`: the call waits for a step with room for its tokens


@dataclass(eq=False)
class _InFlight:
    """A step sent to a worker process whose answer the conductor has not taken yet."""

    key: GroupKey
    entries: list[tuple[StepCall, StepEntry]]
    handle: StepHandleLike
    seconds: float  # host seconds spent sending it


class Listener(Protocol):
    def on_output(self, request: Request, name: str, value: Any) -> None: ...
    def on_finish(self, request: Request) -> None: ...


@dataclass
class RequestStats:
    steps: int = 0
    wasted_steps: int = 0
    preemptions: int = 0
    submitted_at: float = 0.0
    first_output_at: float | None = None
    finished_at: float | None = None


@dataclass(eq=False)
class Request:
    """One client request: a walk (and the walks its transitions lead to) over typed inputs."""

    id: str
    walk: str
    inputs: dict[str, Any]
    arrival: int
    conductor: Conductor
    listener: Listener | None = None
    deadline: float | None = None
    state: str = WAITING
    error: str | None = None
    error_field: str | None = None
    finish_reason: str | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    walks_done: list[str] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    # ---- per attempt (reset on preemption)
    tasks: set[WalkTask] = field(default_factory=set)
    buffers: dict[str, StreamBuffer] = field(default_factory=dict)
    appended: dict[str, int] = field(default_factory=dict)
    moved: set[tuple[str, str, str, int]] = field(default_factory=set)  # KV moves done: (walk, step, node@tag, rank)
    homes: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, tag) -> the rank that last wrote it
    # ---- across attempts
    delivered: dict[str, int] = field(default_factory=dict)
    current_walk: str = ""
    current_inputs: dict[str, Any] = field(default_factory=dict)
    feeds: dict[str, InputFeed] = field(default_factory=dict)  # its first walk's streamed inputs

    def awaits_client(self) -> bool:
        """Whether an input of its walk is still open: its tasks may be waiting for the client."""
        return not self.walks_done and any(not f.closed for f in self.feeds.values())

    @property
    def done(self) -> bool:
        return self.state in (FINISHED, FAILED, CANCELLED)

    # ---- effects called by the interpreter
    def emit(self, name: str, value: Any, mode: str) -> None:
        if mode == "set":
            self.outputs[name] = value
            if self.stats.first_output_at is None:
                self.stats.first_output_at = time.perf_counter()
            return
        self.outputs.setdefault(name, []).append(value)
        # Counted in items (a tensor's rows, a string's characters) per walk of the request (a
        # transition starts a new count), so a replay after preemption, which restarts from the
        # first walk, lines up with what was delivered even when it appends the same items in
        # other groups (a decode cohort appends what a row made since its last flush).
        key = f"{len(self.walks_done)}:{name}"
        start = self.appended.get(key, 0)
        end = start + _items(value)
        self.appended[key] = end
        done = self.delivered.get(key, 0)
        if start < done:  # a replay after preemption: the client already has these items
            if end <= done:
                return
            value = value[done - start :]
        self.delivered[key] = end
        if self.stats.first_output_at is None:
            self.stats.first_output_at = time.perf_counter()
        if self.listener is not None:
            self.listener.on_output(self, name, value)

    def push(self, stream_id: str, buffer: StreamBuffer, items: Any) -> None:
        if isinstance(items, torch.Tensor) and items.dim() >= 1 and items.shape[0] == 0:
            return
        buffer.push(items)
        self.conductor._stream_changed(buffer)

    def stream_closed(self, stream_id: str) -> None:
        self.conductor._stream_changed(self.buffers[stream_id])

    def wasted_iteration(self, kv_log: list[tuple[str, tuple[str, str], int]]) -> None:
        self.stats.wasted_steps += 1
        self.conductor.stats["wasted_steps"] += 1
        first: dict[tuple[str, tuple[str, str]], int] = {}
        for node, key, start in kv_log:
            first[(node, key)] = min(start, first.get((node, key), start))
        for (node, key), start in first.items():
            self.conductor._truncate(node, key, start)


class Conductor:
    """Admission, per-request walk interpreters, the scheduler loop, streams, transitions."""

    def __init__(self, plan: Plan, workers: Mapping[int, WorkerLike], *, max_running: int | None = None,
                 preempt_every: int | None = None, request_timeout: float | None = None, overlap: bool = True,
                 path: str | None = None):
        """`overlap=False` waits for every remote step as it is sent: the order of steps, and so
        who is batched with whom, is then exactly that of one rank (bit-exact comparisons).
        `path`: "cohort" (default; $MSTAR_STEP_PATH) runs marked loops as decode cohorts where
        their node offers a column step; "generic" runs every loop iteration by iteration."""
        self.plan = plan
        self.path = step_path(path)
        self.cohorts: dict[CohortKey, Cohort] = {}
        self._no_cohort: set[CohortKey] = set()
        self._cohort_seq: dict[CohortKey, int] = {}  # the issue order of each cohort's next step
        self._cohort_fresh: set[CohortKey] = set()  # cohorts that just stepped: their next step's order is set after _drive
        self.overlap = overlap
        self.workers = dict(workers)
        limits = {name: int(n.settings["max_batch"]) for name, n in plan.nodes.items()
                  if isinstance(n.settings.get("max_batch"), int) and not isinstance(n.settings.get("max_batch"), bool)}
        self.scheduler = Scheduler(max_batch=plan.max_batch, node_limits=limits)
        self.max_running = max_running or plan.max_batch
        self.preempt_every = preempt_every
        self.request_timeout = request_timeout
        self.kv = KVPages({(name, rank): (plan.kv_pages(name, rank), plan.page_size)
                           for name, rank in plan.kv_pools()})
        self._kv_classes: dict[str, type[KVNode]] = {}
        self._kv_specs: dict[str, NodeSpec] = {}
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending: dict[StepCall, None] = {}  # ready calls in issue order (a dict: O(1) removal)
        self.ready: deque[tuple[WalkTask, Any, BaseException | None]] = deque()
        self._chunk_waiters: dict[int, WalkTask] = {}
        self._chunk_queues: dict[int, deque] = {}
        self._space_waiters: dict[int, list[WalkTask]] = {}
        self._task_calls: dict[WalkTask, StepCall] = {}
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._readmit_after_finish = False
        self._inflight: dict[int, _InFlight] = {}  # rank -> its step sent without waiting, in send order
        self.tp = TPDispatch(self.workers)
        self.broken: str | None = None  # set when a worker process was lost: the engine has stopped
        self.stalled = False  # the last step found nothing to run but requests waiting on their clients
        self._fed_buffers: dict[int, tuple[Request, InputFeed]] = {}  # id(stream buffer) -> its client feed
        # the plan's KV-context moves (placement.transfers of kind "kv"):
        # (walk, consumer step, "node@tag", destination rank) -> source rank
        self._kv_moves: dict[tuple[str, str, str, int], int] = {}
        for t in plan.body.get("placement", {}).get("transfers", ()):
            if t.get("kind") == "kv":
                self._kv_moves.setdefault((t["walk"], t["consumer_step"], t["value"], t["dst_rank"]), t["src_rank"])
        self.stats: dict[str, float] = {"steps": 0, "batched_entries": 0, "wasted_steps": 0, "preemptions": 0,
                                        "finished": 0, "failed": 0, "cancelled": 0, "step_seconds": 0.0,
                                        "remote_steps": 0, "overlapped_steps": 0, "remote_wait_seconds": 0.0,
                                        "cohort_steps": 0, "kv_moves": 0}

    # ------------------------------------------------------------------ public
    def submit(self, walk: str, inputs: Mapping[str, Any], *, request_id: str | None = None,
               listener: Listener | None = None, timeout: float | None = None, streaming: bool = False) -> Request:
        """Queue a request; raises RequestError (naming the field) for bad input. With
        `streaming`, the walk's streamed inputs left out of `inputs` are fed later (`feed`)."""
        if self.broken is not None:
            raise EngineStopped(f"the engine stopped: {self.broken}")
        program = self.plan.walk(walk)  # raises RequestError for an unknown walk
        values, whole = check_inputs(walk, program, inputs, streaming=streaming)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests and not self.requests[rid].done:
            raise RequestError(f"request id '{rid}' is already in use", "request_id")
        req = Request(rid, walk, values, next(self._seq), self, listener)
        declared = {p["name"]: p for p in program["inputs"]}
        for name, sid in stream_inputs(program).items():
            feed = req.feeds[name] = InputFeed(name, sid, declared[name]["type"])
            value = whole[name]
            if value is not None:
                feed.parts, feed.items, feed.closed, feed.whole = [value], int(value.shape[0]), True, True
        self.stalled = False
        req.stats.submitted_at = time.perf_counter()
        limit = timeout if timeout is not None else self.request_timeout
        req.deadline = req.stats.submitted_at + limit if limit else None
        req.current_walk, req.current_inputs = walk, values
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        req = self.requests.get(request_id)
        if req is None or req.done:
            return False
        self._end(req, CANCELLED, reason=reason)
        self.stalled = False
        return True

    def feed(self, request_id: str, name: str, items: Any) -> bool:
        """Append `items` (first dimension = items) to a streamed input of a request; False when
        the request has ended. RequestError (naming the input) for an input that is not
        streamed, given whole, or closed, and for items of the wrong type."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return False
        feed = self._input_feed(req, name)
        if feed.closed:
            how = "was given whole at submit" if feed.whole else "is closed"
            raise RequestError(f"input '{name}' of request '{request_id}' {how}; nothing more can be fed", name)
        part = coerce_items(req.walk, name, feed.type, items)
        feed.parts.append(part)
        feed.items += int(part.shape[0])
        self.stalled = False
        self._pump(req, feed)
        return True

    def close_input(self, request_id: str, name: str) -> bool:
        """The client sends no more of a streamed input (idempotent); False when the request has ended."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return False
        feed = self._input_feed(req, name)
        if not feed.closed:
            feed.closed = True
            self.stalled = False
            self._pump(req, feed)
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline (`time.perf_counter()` time) of a request not ended yet, if any has one."""
        times = [r.deadline for r in (*self.running, *self.waiting) if r.deadline is not None and not r.done]
        return min(times) if times else None

    def _input_feed(self, req: Request, name: str) -> InputFeed:
        feed = req.feeds.get(name)
        if feed is None:
            streamed = ", ".join(req.feeds) or "none"
            raise RequestError(f"walk '{req.walk}' has no streamed input '{name}' (streamed inputs: {streamed})", name)
        return feed

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self._inflight

    def run_until_idle(self, on_step: Callable[[], None] | None = None) -> None:
        while self.step():
            if on_step is not None:
                on_step()

    def step(self) -> bool:
        """One engine-loop iteration. Returns False when there is nothing left to do, or nothing
        until a client feeds or closes an input (`stalled`)."""
        self.stalled = False
        self._expire()
        self._admit()
        self._collect()
        self._drive()
        for key in self._cohort_fresh:  # newer than the calls its own last step released (a SNAC window, say)
            self._cohort_seq[key] = next(self._seq)
        self._cohort_fresh.clear()
        standing = {k: Standing(k, c.n, self._cohort_seq[k]) for k, c in self.cohorts.items() if c.n}
        picked = self.scheduler.next_group(self.pending, busy=self._inflight.keys(), standing=standing)
        if picked is not None and picked[0] in self.cohorts:
            self._run_cohort(picked[0])
            return True
        if picked is None:
            if self._inflight:  # nothing else can run: wait for the oldest remote step
                t0 = time.perf_counter()
                self._take(next(iter(self._inflight)))
                self.stats["remote_wait_seconds"] += time.perf_counter() - t0
                return True
            # tasks blocked on nothing that can ever arrive: a walk bug, never a hang; a request
            # with an input still open waits for its client instead
            stuck = [r for r in self.running if not r.done and not r.awaits_client()]
            for r in stuck:
                self._fail(r, "walk cannot make progress (all of its tasks wait on each other)")
            if not stuck and self.running:
                self.stalled = True
                return False
            return bool(self.waiting or self.running)
        key, calls = picked
        entries = self._reserve(key, calls)
        if entries:
            self._run(key, entries)
        return True

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        if self._readmit_after_finish and self.running:
            return
        self._readmit_after_finish = False
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            if req.done:
                continue
            req.state = RUNNING
            self.running.append(req)
            self._start_walk(req, req.current_walk, req.current_inputs)

    def _start_walk(self, req: Request, walk: str, inputs: dict[str, Any]) -> None:
        program = self.plan.walk(walk)
        req.buffers = {}
        for sid in program.get("streams", []):
            spec = self.plan.stream(sid)
            req.buffers[sid] = StreamBuffer(policy_from_spec(spec["policy"]), spec["capacity"])
        req.appended = {}
        req.outputs = {k: v for k, v in req.outputs.items() if k not in {o["name"] for o in program["outputs"]}}
        task = Interpreter(req, program, req.buffers).main_task(dict(inputs))
        req.tasks = {task}
        self.ready.append((task, None, None))
        for name, sid in stream_inputs(program).items():
            feed = req.feeds.get(name)
            if feed is None:  # pragma: no cover - a transition into such a walk fails its input check first
                continue
            # a new attempt replays the input from its first item
            feed.buffer, feed.part, feed.offset, feed.pushed = req.buffers[sid], 0, 0, 0
            self._fed_buffers[id(feed.buffer)] = (req, feed)
            self._pump(req, feed)

    # ------------------------------------------------------------------ tasks
    def _drive(self) -> None:
        while self.ready:
            task, value, exc = self.ready.popleft()
            if task.request.done or task not in task.request.tasks:
                continue
            self._advance(task, value, exc)

    def _advance(self, task: WalkTask, value: Any, exc: BaseException | None) -> None:
        req = task.request
        try:
            y = task.gen.throw(exc) if exc is not None else task.gen.send(value)
        except StopIteration:
            self._task_finished(task, None)
            return
        except _Wasted as e:  # raised in a branch of a speculative iteration: belongs to the parent
            self._task_finished(task, e)
            return
        except RequestError as e:
            self._fail(req, str(e), e.field)
            return
        except (WalkError, StreamError, ValueError, TypeError, RuntimeError, KeyError, IndexError) as e:
            self._fail(req, f"walk '{req.current_walk}' failed: {type(e).__name__}: {e}")
            return
        if isinstance(y, StepCall):
            y.seq, y.task = next(self._seq), task
            self._task_calls[task] = y
            self.pending[y] = None
        elif isinstance(y, WaitChunk):
            self._wait_chunk(task, y.buffer)
        elif isinstance(y, WaitSpace):
            if y.buffer.can_push(y.items):
                self.ready.append((task, None, None))
            else:
                self._space_waiters.setdefault(id(y.buffer), []).append(task)
        elif isinstance(y, Join):
            task.waiting_children = len(y.tasks)
            for child in y.tasks:
                child.parent = task
                req.tasks.add(child)
                self.ready.append((child, None, None))
            if not y.tasks:
                self.ready.append((task, None, None))
        elif isinstance(y, Spawn):
            req.tasks.add(y.task)
            self.ready.append((y.task, None, None))
            self.ready.append((task, None, None))
        elif isinstance(y, ForkKV):
            if self._fork_or_preempt(req, y):
                self.ready.append((task, None, None))
        elif isinstance(y, EnterCohort):
            self._enter_cohort(task, y)
        else:  # pragma: no cover - the interpreter yields nothing else
            self._fail(req, f"internal error: unknown yield {type(y).__name__}")

    def _task_finished(self, task: WalkTask, exc: BaseException | None) -> None:
        req = task.request
        req.tasks.discard(task)
        parent = task.parent
        if parent is not None and parent in req.tasks:
            if exc is not None:
                for sibling in [t for t in req.tasks if t.parent is parent]:
                    self._drop_task(sibling)
                self.ready.append((parent, None, exc))
            else:
                parent.waiting_children -= 1
                if parent.waiting_children == 0:
                    self.ready.append((parent, None, None))
        if not req.tasks and not req.done:
            self._walk_finished(req)

    def _drop_task(self, task: WalkTask) -> None:
        task.request.tasks.discard(task)
        call = self._task_calls.pop(task, None)
        if call is not None:
            self.pending.pop(call, None)
        task.gen.close()

    # ------------------------------------------------------------------ cohorts
    def _cohort_for(self, op: dict[str, Any]) -> Cohort | None:
        """The cohort of a marked loop, made on first use; None where the loop stays generic
        (generic path forced, a node without a column step). Raises `WorkerStepError` and
        `WorkerLost` from opening its columns on a worker process."""
        call = cohort_call(op)
        node, phase, ranks = call["node"], call["phase"], tuple(call["ranks"])
        key: CohortKey = (node, phase, ranks, op["id"])
        cohort = self.cohorts.get(key)
        if cohort is not None or key in self._no_cohort:
            return cohort
        # one rank's worker (in process or a worker process), or a TP group's fan-out
        # one rank's worker (in process or a worker process), or a TP group's fan-out, whose
        # members are worker processes
        group = len(ranks) > 1 and all(can_submit(self.workers[r]) for r in ranks[1:])
        worker = TPCohort(self.tp, ranks) if group else self.workers.get(ranks[0])
        info = self.plan.node(node)
        # a call that reads other contexts has no column step (the compiler marks no such loop)
        if (self.path != "cohort" or info.engine != "kv" or call.get("reads") or (len(ranks) > 1 and not group)
                or not hasattr(worker, "cohort_open")):
            self._no_cohort.add(key)
            return None
        bm = self.kv.managers[(node, ranks[0])]
        max_len = self.plan.kv_pool(node, ranks[0]).max_seq_len
        rows = min(self.plan.max_batch, self.scheduler.node_limits.get(node, self.plan.max_batch))
        ports = port_specs(info.raw["outputs"], info.phases[phase].outputs)
        shape = cohort_shape(op, ports)
        max_pages = -(-max_len // bm.page_size) + 1  # one more: a speculative step after the node's own limit
        if not worker.cohort_open(key, node, shape, rows, max_pages):
            self._no_cohort.add(key)
            return None
        cls, spec = self._kv_class(node)

        def kv_plan(inputs: Mapping[str, Any]) -> SeqPlan:
            return cls.kv_plan(phase, {p: tuple(v.shape) for p, v in inputs.items() if isinstance(v, torch.Tensor)},
                               spec)

        cohort = self.cohorts[key] = Cohort(key, op, ports, worker, bm, rows, max_len, max_pages,
                                            preempt=self._cohort_preempt, fail=self._fail, kv_plan=kv_plan)
        return cohort  # its step order is set when its first row joins (_enter_cohort)

    def _enter_cohort(self, task: WalkTask, y: EnterCohort) -> None:
        """Make the task a row of its loop's cohort, or resume it at once with None (generic)."""
        req = task.request
        try:
            self._join_cohort(task, y)
        except WorkerStepError as e:  # a worker process failed the open or the join: this request fails
            self._fail(req, str(e))
        except WorkerLost as e:
            self._stop(e)

    def _join_cohort(self, task: WalkTask, y: EnterCohort) -> None:
        cohort = self._cohort_for(y.op)
        req = task.request
        call = cohort_call(y.op)
        tag = call.get("tag") or "main"
        key = (req.id, tag)
        # a context the plan moves to the loop's rank is copied there first, as before a generic step
        if (cohort is not None and self._kv_moves
                and not self._move_in(req, call["node"], tag, str(call.get("id")), tuple(call["ranks"])[0],
                                      lambda: not req.done and task in req.tasks)):
            return  # the request failed or was preempted meanwhile: its task is gone
        if cohort is None or not cohort.has_room() or key not in cohort.bm or cohort.bm.seq_len(key) < 1:
            self.ready.append((task, None, None))
            return
        if cohort.n == 0:  # an idle cohort's next step is as old as this request's arrival there
            self._cohort_seq[cohort.key] = next(self._seq)
        try:
            cohort.join(req, task, y, tag)
            req.homes[(call["node"], tag)] = cohort.key[2][0]
        except RequestError:  # a row the column step cannot take (its node's join refused it): the generic loop
            self.ready.append((task, None, None))  # runs it, and reports any real input error itself

    def _cohort_resume(self, task: WalkTask, done: CohortExit) -> None:
        """A row left its loop (called by `Cohort`): its task goes on after the loop."""
        req = task.request
        req.stats.wasted_steps += done.wasted
        self.stats["wasted_steps"] += done.wasted
        self.ready.append((task, done, None))

    def _cohort_preempt(self, cohort: Cohort) -> bool:
        """A cohort needs a page and the pool is full: preempt (or fail) as a generic step would.
        False when nothing can be freed."""
        if self._inflight:  # never preempt a request with a step in flight: take them all first
            self._quiesce()
            return True
        victim = self._newest_holding_kv()
        if victim is None:
            return False
        if len(self._kv_holders()) == 1:
            node, _, ranks, _ = cohort.key
            self._fail(victim, f"request needs more KV pages for node '{node}' than its pool holds "
                       f"({self.kv.capacity_tokens((node, ranks[0]))} tokens); it can never fit")
            return True
        self._preempt(victim)
        return True

    def _run_cohort(self, key: CohortKey) -> None:
        cohort = self.cohorts[key]
        n = cohort.n
        if self._inflight:
            self.stats["overlapped_steps"] += 1
        t0 = time.perf_counter()
        try:
            cohort.step()
        except WorkerStepError as e:
            for m in list(cohort.members):
                self._fail(m.request, str(e))
            return
        except WorkerLost as e:  # a worker process died mid-cohort (or a TP member diverged)
            self._stop(e)
            return
        self._cohort_fresh.add(key)
        self.stats["step_seconds"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["cohort_steps"] += 1
        self.stats["batched_entries"] += n
        self._forced_preemption()

    def _forced_preemption(self) -> None:
        if self.preempt_every and self.stats["steps"] % self.preempt_every == 0:
            self._quiesce()  # never preempt a request with a step in flight
            # each request is preempted at most once by the forced mode, so every one finishes
            fresh = [r for r in self.running if r.stats.preemptions == 0]
            if fresh:
                self._preempt(max(fresh, key=lambda r: r.arrival), forced=True)

    # ------------------------------------------------------------------ streams
    def _wait_chunk(self, task: WalkTask, buffer: StreamBuffer) -> None:
        queue = self._chunk_queues.setdefault(id(buffer), deque())
        if not queue:
            queue.extend(buffer.pop_ready())
        if queue:
            self.ready.append((task, queue.popleft(), None))
            self._wake_space(buffer)
        elif buffer.closed:
            self._chunk_queues.pop(id(buffer), None)
            self.ready.append((task, None, None))
        else:
            self._chunk_waiters[id(buffer)] = task

    def _stream_changed(self, buffer: StreamBuffer) -> None:
        task = self._chunk_waiters.pop(id(buffer), None)
        if task is not None:
            self._wait_chunk(task, buffer)

    def _wake_space(self, buffer: StreamBuffer) -> None:
        for task in self._space_waiters.pop(id(buffer), []):
            self.ready.append((task, None, None))
        fed = self._fed_buffers.get(id(buffer))
        if fed is not None:
            self._pump(*fed)

    def _pump(self, req: Request, feed: InputFeed) -> None:
        """Move fed items into the attempt's stream buffer as far as its capacity allows (a part
        larger than the room left goes in pieces); close it once the input is closed and in."""
        buf = feed.buffer
        if buf is None or buf.closed:
            return
        moved = 0
        while not feed.drained():
            part = feed.parts[feed.part]
            n = min(buf.capacity - buf.pending, int(part.shape[0]) - feed.offset)
            if n > 0:
                buf.push(part[feed.offset : feed.offset + n])
                feed.offset += n
                moved += n
            if feed.offset < part.shape[0]:
                break  # the buffer is full: the rest follows when a chunk is taken
            feed.part, feed.offset = feed.part + 1, 0
        feed.pushed += moved
        if feed.closed and feed.drained():
            buf.close()
        if moved or buf.closed:
            self._stream_changed(buf)
        on_input = getattr(req.listener, "on_input", None)
        if moved and on_input is not None:
            on_input(req, feed.name, feed.pushed)

    # ------------------------------------------------------------------ KV
    def _kv_class(self, node: str) -> tuple[type[KVNode], NodeSpec]:
        if node not in self._kv_classes:
            info = self.plan.node(node)
            module, _, cls = info["impl"].rpartition(".")
            self._kv_classes[node] = getattr(importlib.import_module(module), cls)
            self._kv_specs[node] = self.plan.node_spec(node)
        return self._kv_classes[node], self._kv_specs[node]

    def _truncate(self, node: str, key: tuple[str, str], length: int) -> None:
        """Cut the context `key` of `node` to `length` tokens on every rank that holds more: a
        context moved to another rank (a kv transfer) leaves its shorter source copy behind."""
        for (n, rank), bm in list(self.kv.managers.items()):
            if n == node and key in bm and bm.seq_len(key) > length:
                copy = self.kv.truncate((n, rank), key, length)
                if copy is not None:
                    self.workers[rank].copy_slots(node, copy)

    def _fork(self, req: Request, f: ForkKV) -> None:
        for (n, rank), _ in list(self.kv.managers.items()):
            if n != f.node:
                continue
            copy = self.kv.fork((n, rank), (req.id, f.src), (req.id, f.dst))
            self.workers[rank].fork(f.node, req.id, f.src, f.dst, copy)
        home = req.homes.get((f.node, f.src))  # a fork copies on every rank: the copy of the last write leads
        if home is None:
            req.homes.pop((f.node, f.dst), None)
        else:
            req.homes[(f.node, f.dst)] = home

    def _fork_or_preempt(self, req: Request, f: ForkKV) -> bool:
        """Fork a KV context; when the pool is full, preempt the newest request and retry.

        Returns False when `req` itself was preempted or failed (its task is gone)."""
        return self._or_preempt(req, lambda: self._fork(req, f),
                                f"forking KV context {f.node}@{f.src} needs a page the pool does not have")

    def _or_preempt(self, req: Request, action: Callable[[], None], why: str,
                    still: Callable[[], bool] = lambda: True) -> bool:
        """Run `action`, which takes KV pages; while a pool is full, preempt the newest request
        and retry. False when `req` itself was preempted or failed, or `still()` turned false
        while the answers in flight were taken."""
        while True:
            try:
                action()
                return True
            except OutOfPages:
                if self._inflight:  # never preempt a request with a step in flight: take them all first
                    self._quiesce()
                    if req.state != RUNNING or not still():  # an answer ended or preempted it
                        return False
                    continue
                victim = self._newest_holding_kv()
                if victim is None or (victim is req and len(self._kv_holders()) == 1):
                    self._fail(req, f"{why}; the request can never fit")
                    return False
                self._preempt(victim)
                if victim is req:
                    return False

    def _move_in(self, req: Request, node: str, tag: str, step: str, rank: int, still: Callable[[], bool]) -> bool:
        """Before the first step `step` (a call's id) of `req` on `rank`: if the plan moves its KV
        context `node@tag` there (a transfer of kind "kv" into this step), copy the context from
        its source rank, once per request and walk. False when the request failed or was
        preempted meanwhile, or `still()` turned false while answers in flight were taken."""
        key = (req.current_walk, step, f"{node}@{tag}", rank)
        src = self._kv_moves.get(key)
        if src is None or key in req.moved:
            return True
        # the plan names every rank that may have written the context last (a loop that ran
        # no iteration, say); the copy to take is the one its last write went to
        src = req.homes.get((node, tag), src)
        if src == rank:  # written here last (an earlier loop on this rank): nothing to move
            req.moved.add(key)
            return True
        info = self.plan.node(node)
        if info.shard is not None and info.shard.tp > 1:
            self._fail(req, f"KV context {node}@{tag} would move from rank {src} to rank {rank} (step {key[1]}), "
                       "and contexts of a tensor-parallel node cannot move between ranks")
            return False
        try:
            ok = self._or_preempt(req, lambda: self._move_kv(req, node, tag, src, rank),
                                  f"moving KV context {node}@{tag} to rank {rank} needs pages its pool does not have",
                                  still)
        except (NodeError, WorkerStepError) as e:
            self._fail(req, f"moving KV context {node}@{tag} from rank {src} to rank {rank}: {e}")
            return False
        except WorkerLost as e:
            self._stop(e)
            return False
        if ok:
            req.moved.add(key)
            req.homes[(node, tag)] = rank
            self.stats["kv_moves"] += 1
        return ok

    def _move_kv(self, req: Request, node: str, tag: str, src: int, dst: int) -> None:
        """Rank `dst`'s context `node@tag` of `req` becomes rank `src`'s: the same length in
        pages of its own pool (whatever it held is replaced), the pages' contents and the node
        state copied over (through rank 0 when neither end is rank 0). OutOfPages changes
        nothing but the freed destination."""
        key = (req.id, tag)
        sbm, dbm = self.kv.managers[(node, src)], self.kv.managers[(node, dst)]
        n = sbm.seq_len(key) if key in sbm else 0
        src_pages = sbm.page_table(key)[: sbm.pages_needed(n)] if n else []
        if key in dbm:
            dbm.free(key)
        if n:
            dbm.append(key, n)  # raises OutOfPages
        dst_pages = dbm.page_table(key) if n else []
        values = self.workers[src].export_kv(node, req.id, tag, src_pages)
        self.workers[dst].import_kv(node, req.id, tag, dst_pages, values)

    def _reserve(self, key: tuple[str, str, tuple[int, ...]], calls: list[StepCall]) -> list[tuple[StepCall, StepEntry]]:
        node, phase, ranks = key
        is_kv = self.plan.node(node)["engine"] == "kv"
        budget = self._token_budget(node) if is_kv else None
        used = 0
        entries: list[tuple[StepCall, StepEntry]] = []
        for call in calls:
            req = call.request
            if req.done or call not in self.pending:
                continue
            inputs = chunk_inputs(call.inputs)
            kv: KVSlots | None = None
            if is_kv:
                room = None if budget is None or not entries else budget - used
                kv = self._reserve_one(node, phase, ranks[0], call, inputs, room)
                if kv is _OVER_BUDGET:  # this call and the rest wait for the next step
                    break
                if kv is None:
                    continue
                used += kv.q_len
            entries.append((call, StepEntry(req.id, call.tag, inputs, kv)))
        # a later entry's reservation may have preempted an earlier entry's request
        return [(c, e) for c, e in entries if c in self.pending and not c.request.done]

    def _token_budget(self, node: str) -> int | None:
        """The node's `max_prefill_tokens` setting, when the walk sets one: the most new tokens
        one batched step of it takes (the memory pass sized the activations for that many);
        the first entry of a step is always taken."""
        value = self._kv_class(node)[1].settings.get("max_prefill_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def _reserve_one(self, node: str, phase: str, rank: int, call: StepCall, inputs: dict[str, Any],
                     room: int | None = None) -> Any:
        """The call's KV slots; None when it failed (or lost its request); `_OVER_BUDGET` when
        its tokens do not fit the `room` left in this step's token budget. A context the plan
        moves to `rank` for this call is copied there first (`_move_in`)."""
        if self._kv_moves and not self._move_in(call.request, node, call.tag or "main", str(call.op.get("id")), rank,
                                                lambda: call in self.pending):
            return None
        cls, spec = self._kv_class(node)
        shapes = {p: tuple(v.shape) for p, v in inputs.items() if isinstance(v, torch.Tensor)}
        try:
            plan = cls.kv_plan(phase, shapes, spec)
        except RequestError as e:
            self._fail(call.request, str(e), port_input(call, e.field))
            return None
        if room is not None and plan.q_len > room:
            return _OVER_BUDGET
        key = (call.request.id, call.tag or "main")
        limit = self.plan.node(node).tag_max_len.get(key[1])
        if limit is not None:
            bm = self.kv.managers[(node, rank)]
            after = (bm.seq_len(key) if key in bm else 0) + plan.q_len
            if after > limit:
                self._fail(call.request, f"the KV context {node}@{key[1]} would hold {after} tokens, more than the "
                           f"max_len of {limit} of its tag '{key[1]}' (step {call.op.get('id', '?')})")
                return None
        while True:
            try:
                kv = self.kv.reserve((node, rank), key, plan)
            except OutOfPages:
                if self._inflight:  # never preempt a request with a step in flight: take them all first
                    self._quiesce()
                    if call.request.state != RUNNING or call not in self.pending:
                        return None
                    continue
                victim = self._newest_holding_kv()
                if victim is None or victim is call.request and len(self._kv_holders()) == 1:
                    self._fail(call.request, f"request needs more KV pages for node '{node}' than its pool holds "
                               f"({self.kv.capacity_tokens((node, rank))} tokens); it can never fit")
                    return None
                self._preempt(victim)
                if victim is call.request:
                    return None
                continue
            call.frame.log_kv(node, key, kv.start)
            call.request.homes[(node, key[1])] = rank
            reads = call.op.get("reads")
            if reads:
                kv = dataclasses.replace(kv, reads=self._read_slots(rank, call.request.id, reads))
            return kv

    def _read_slots(self, rank: int, request_id: str, reads: list[dict[str, Any]]) -> tuple[ReadSlots, ...]:
        """Where the contexts a call reads lie, as their nodes' BlockManagers on `rank` hold them now."""
        out = []
        for r in reads:
            bm = self.kv.managers[(r["node"], rank)]
            key = (request_id, r["tag"])
            n = bm.seq_len(key) if key in bm else 0
            out.append(ReadSlots(r["node"], r["tag"], n, bm.page_table(key) if n else []))
        return tuple(out)

    def _kv_holders(self) -> list[Request]:
        return [r for r in self.running if self.kv.holds(r.id)]

    def _newest_holding_kv(self) -> Request | None:
        holders = self._kv_holders()
        return max(holders, key=lambda r: r.arrival) if holders else None

    # ------------------------------------------------------------------ running a step
    def _run(self, key: GroupKey, entries: list[tuple[StepCall, StepEntry]], *, wait: bool = False) -> None:
        """Run one batched step: sent to a worker process without waiting when it is one rank
        that can take it (unless `wait`), else here and now."""
        node, phase, ranks = key
        for call, _ in entries:
            self.pending.pop(call, None)
        batch = StepBatch(node, phase, [e for _, e in entries])
        if self._inflight:
            self.stats["overlapped_steps"] += 1
        worker = self.workers[ranks[0]]
        t0 = time.perf_counter()
        try:
            if len(ranks) == 1 and self.overlap and not wait and can_submit(worker):
                handle = worker.submit(batch)  # type: ignore[attr-defined]
                self._inflight[ranks[0]] = _InFlight(key, entries, handle, time.perf_counter() - t0)
                self.stats["remote_steps"] += 1
                return
            outputs = self._dispatch(ranks, batch)
        except (RequestError, WorkerStepError, WorkerLost) as e:
            self._step_failed(key, entries, e)
            return
        self._finish(key, entries, outputs, time.perf_counter() - t0)

    def _collect(self) -> None:
        """Take the answers of remote steps that have arrived; never waits."""
        try:
            self.tp.poll()
        except WorkerLost as e:  # a TP member failed a step its leader ran
            self._stop(e)
            return
        for rank in list(self._inflight):
            flight = self._inflight.get(rank)
            if flight is not None and flight.handle.ready():
                self._take(rank)

    def _quiesce(self) -> None:
        """Take every answer in flight, waiting for them (oldest first)."""
        while self._inflight:
            self._take(next(iter(self._inflight)))

    def _take(self, rank: int) -> None:
        """Take the answer of `rank`'s step in flight (waiting for it if need be) and apply it
        to the entries whose tasks still wait for it; the others ended or were dropped
        meanwhile (their pages were freed or truncated then)."""
        flight = self._inflight.pop(rank)
        t0 = time.perf_counter()
        try:
            outputs = flight.handle.result()
        except (RequestError, WorkerStepError, WorkerLost) as e:
            self._step_failed(flight.key, [(c, e_) for c, e_ in flight.entries if self._waits(c)], e)
            return
        self._finish(flight.key, flight.entries, outputs, flight.seconds + time.perf_counter() - t0)

    def _waits(self, call: StepCall) -> bool:
        """Whether the call's task still waits for its outputs (not ended, dropped or preempted)."""
        return not call.request.done and call.task is not None and call.task in call.request.tasks

    def _finish(self, key: GroupKey, entries: list[tuple[StepCall, StepEntry]], outputs: list[dict[str, Any]],
                seconds: float) -> None:
        """A step's outputs: KV of entries that keep nothing truncated, tasks resumed."""
        node = key[0]
        self.stats["step_seconds"] += seconds
        self.stats["steps"] += 1
        self.stats["batched_entries"] += len(entries)
        for (call, entry), out in zip(entries, outputs):
            if not self._waits(call):
                continue
            if entry.kv is not None and not entry.kv.keep:
                self._truncate(node, (entry.request_id, entry.tag or "main"), entry.kv.start)
            call.request.stats.steps += 1
            self._task_calls.pop(call.task, None)
            self.ready.append((call.task, out, None))
        self._forced_preemption()

    def _step_failed(self, key: GroupKey, entries: list[tuple[StepCall, StepEntry]], error: Exception) -> None:
        if isinstance(error, RequestError):
            self._isolate(key, entries, error)
        elif isinstance(error, WorkerStepError):
            for call, _ in entries:
                self._fail(call.request, str(error))
        else:  # WorkerLost: a worker process died or hung; nothing can run any more
            self._stop(error)

    def _stop(self, error: Exception) -> None:
        self.broken = str(error)
        self._inflight.clear()  # the workers are shut down with their steps (RemoteWorker.close)
        for req in list(self.running) + list(self.waiting):
            self._fail(req, str(error))

    def _dispatch(self, ranks: tuple[int, ...], batch: StepBatch) -> list[dict[str, Any]]:
        if len(ranks) == 1:
            return self.workers[ranks[0]].run_step(batch)
        return self.tp.run(ranks, batch)  # a tensor-parallel group (runtime/mstar_runtime/worker/tp_dispatch.py)

    def _isolate(self, key, entries, error: RequestError) -> None:
        """A node rejected one entry of a batch: rerun them one by one (waiting for each) so
        only the culprit fails."""
        if not entries:
            return
        if len(entries) == 1:
            call = entries[0][0]
            self._fail(call.request, str(error), port_input(call, error.field))
            return
        for call, _ in entries:
            self.pending[call] = None
        for _, entry in entries:
            if entry.kv is not None:  # the reservation is redone on the rerun
                self._truncate(key[0], (entry.request_id, entry.tag or "main"), entry.kv.start)
        for call, _ in entries:
            if call.request.done:
                continue
            single = self._reserve(key, [call])
            if single:
                self._run(key, single, wait=True)

    # ------------------------------------------------------------------ endings
    def _walk_finished(self, req: Request) -> None:
        walk = req.current_walk
        req.walks_done.append(walk)
        for t in self.plan.transitions():
            if t["src"] != walk:
                continue
            flag = req.outputs.get(t["when"])
            if flag is not None and read_flag(flag):
                try:
                    self._transition(req, t)
                except RequestError as e:
                    self._fail(req, f"transition {walk} -> {t['dst']}: {e}", e.field)
                return
        self._end(req, FINISHED, reason="stop")

    def _transition(self, req: Request, t: dict[str, Any]) -> None:
        keep = {(k["node"], k["tag"]): k["as"] for k in t["keep"]}
        for (node, tag), as_tag in keep.items():
            # a full pool preempts (or, if it can never fit, fails) as a walk's own fork does
            if tag != as_tag and not self._fork_or_preempt(req, ForkKV(node, tag, as_tag)):
                return
        kept = {(node, as_tag) for (node, _), as_tag in keep.items()}
        for (node, rank), bm in self.kv.managers.items():
            for tag in bm.tags(req.id):
                if (node, tag) not in kept:
                    bm.free((req.id, tag))
                    self.workers[rank].drop_tag(node, req.id, tag)
                    req.homes.pop((node, tag), None)
                    self.tp.forget(req.id, node, tag)
        program = self.plan.walk(t["dst"])
        # An appended output is handed on whole (BAGEL's draw takes chat's reply `text`); the
        # request's result keeps its items, joined when the request ends.
        whole = {out["name"]: (concat(v) if (v := req.outputs.get(out["name"])) else _empty(out["type"]))
                 for out in self.plan.walk(t["src"])["outputs"] if out["mode"] == "append"}
        carried = {**req.current_inputs,
                   **{k: v for k, v in req.outputs.items() if not isinstance(v, list)}, **whole}
        inputs = validate_inputs(t["dst"], program, {p["name"]: carried[p["name"]] for p in program["inputs"]
                                                     if p["name"] in carried})
        req.current_walk, req.current_inputs = t["dst"], inputs
        self._start_walk(req, t["dst"], inputs)

    def _release(self, req: Request) -> None:
        for task in list(req.tasks):
            self._drop_task(task)
        req.tasks.clear()
        self.pending = {c: None for c in self.pending if c.request is not req}
        for buf in req.buffers.values():
            self._chunk_waiters.pop(id(buf), None)
            self._chunk_queues.pop(id(buf), None)
            self._space_waiters.pop(id(buf), None)
            self._fed_buffers.pop(id(buf), None)
        for feed in req.feeds.values():
            feed.buffer = None
        for cohort in self.cohorts.values():
            cohort.remove(req)
        self.kv.free_request(req.id)
        req.moved.clear()  # a new attempt moves its contexts again
        req.homes.clear()
        for w in self.workers.values():
            w.free(req.id)
        self.tp.forget(req.id)
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, req: Request, forced: bool = False) -> None:
        self._release(req)
        req.state = WAITING
        req.stats.preemptions += 1
        self.stats["preemptions"] += 1
        req.current_walk, req.current_inputs = req.walk, req.inputs  # recompute from the start
        req.outputs = {}
        req.walks_done = []
        # back to the head of the queue, in arrival order
        self.waiting.appendleft(req)
        self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival))
        self._readmit_after_finish = not forced

    def _fail(self, req: Request, message: str, field_name: str | None = None) -> None:
        if req.done:
            return
        req.error, req.error_field = message, field_name
        self._end(req, FAILED, reason="error")

    def _end(self, req: Request, state: str, reason: str) -> None:
        self._release(req)
        self._readmit_after_finish = False  # pages came back: a preempted request may try again
        if req in self.waiting:
            self.waiting.remove(req)
        req.state, req.finish_reason = state, reason
        req.stats.finished_at = time.perf_counter()
        for name, value in list(req.outputs.items()):
            if isinstance(value, list):
                req.outputs[name] = concat(value)
        if state == FINISHED:  # an appended output that never got an item is empty, not missing
            for out in self.plan.walk(req.current_walk)["outputs"]:
                if out["mode"] == "append" and out["name"] not in req.outputs:
                    req.outputs[out["name"]] = _empty(out["type"])
        self.stats[{FINISHED: "finished", FAILED: "failed", CANCELLED: "cancelled"}[state]] += 1
        if self.requests.get(req.id) is req:  # ended requests are the caller's to keep, not ours
            del self.requests[req.id]
        if req.listener is not None:
            req.listener.on_finish(req)

    def _expire(self) -> None:
        now = time.perf_counter()
        for req in list(self.running) + list(self.waiting):
            if req.deadline is not None and now > req.deadline and not req.done:
                req.error = f"request timed out after {req.deadline - req.stats.submitted_at:.1f} s"
                self._end(req, FAILED, reason="timeout")
