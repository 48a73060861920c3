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

Running a group (step 6) is `steps.StepRunner`'s: remote steps overlap (a group on a worker
process is sent without waiting, its answer taken between steps). `stats` counts
`remote_steps` (sent without waiting), `overlapped_steps` (started while a remote step was in
flight), `remote_wait_seconds` (blocked on an answer with nothing else to run) and
`kv_moves` (KV contexts copied between ranks, kv_contexts.py). The parts, each in its file:
requests.py (the request records and their input checks), stream_waits.py (tasks waiting
on streams, client-fed inputs), kv_contexts.py (truncation, forks, moves, reads),
cohorts.py (decode cohorts), steps.py (running steps); the conductor keeps the loop,
admission, preemption and endings.

Overlap lets work on other ranks move ahead of a remote step, so who is batched with whom
can change with timing (tokens stay the same; floats may differ in the last bits, as with
any change of batch). `overlap=False` keeps the one-rank order of steps, for bit-exact
comparisons; in lockstep workloads (Orpheus requests decoding together: every window is
released at the same step for all of them) the batches, and so the outputs, are the same.

A loop the compiler marked as a cohort runs, where its node offers a column step, as a
decode cohort (cohorts.py, cohort.py): the scheduler sees it as one standing group of its
rows (step 4), and a cohort step replaces steps 5-6 for its rows.

Requests join and leave between steps (continuous batching); a finished request frees its
pages at once. A kv node's `max_prefill_tokens` setting bounds the new tokens of one of its
steps (`KVContexts.token_budget`, reservations.py): the calls past it wait for the next step, the first always runs. A preempted request restarts from scratch later; whatever it already
streamed is not streamed again (replay is deterministic). `preempt_every=N` forces a
preemption every N steps, for tests.

A tag with its own bound (`tag_max_len`) fails the request that would take one of its
contexts past it, naming the node and tag, before any page is reserved.

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

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mstar_runtime.control.cohort import Cohort, CohortKey
from mstar_runtime.control.cohorts import Cohorts
from mstar_runtime.control.interpreter import (
    CohortExit,
    EnterCohort,
    ForkKV,
    ForkUndo,
    Interpreter,
    Join,
    Spawn,
    StepCall,
    WaitChunk,
    WaitSpace,
    WalkError,
    WalkTask,
    _Wasted,
    concat,
    read_flag,
)
from mstar_runtime.control.kv_contexts import KVContexts
from mstar_runtime.control.requests import (
    CANCELLED,
    FAILED,
    FINISHED,
    RUNNING,
    WAITING,
    InputFeed,
    KVLog,
    Listener,
    Request,
    RequestStats,
    check_inputs,
    coerce_items,
    empty_value,
    stream_inputs,
)
from mstar_runtime.control.reservations import Reservations
from mstar_runtime.control.scheduler import (
    DEFAULT_PREFIX_CHUNK,
    GroupKey,
    Scheduler,
    check_window_gather,
    window_phases,
)
from mstar_runtime.control.steps import StepRunner
from mstar_runtime.control.stream_waits import StreamWaits
from mstar_runtime.control.streams import StreamBuffer, StreamError, policy_from_spec
from mstar_runtime.control.validate import validate_inputs
from mstar_runtime.engine.engines import StepEntry
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan
from mstar_runtime.worker.remote import EngineStopped, WorkerLost
from mstar_runtime.worker.tp_dispatch import TPDispatch
from mstar_runtime.worker.worker import StepBatch, WorkerStepError


class WorkerLike(Protocol):
    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]: ...
    def fork(self, node: str, request_id: str, src_tag: str, dst_tag: str, copy: Any) -> None: ...
    def copy_slots(self, node: str, copy: Any) -> None: ...
    def free(self, request_id: str) -> None: ...
    def drop_tag(self, node: str, request_id: str, tag: str) -> None: ...
    def export_kv(self, node: str, request_id: str, tag: str, pages: list[int]) -> dict[str, Any]: ...
    def import_kv(self, node: str, request_id: str, tag: str, pages: list[int], values: Mapping[str, Any]) -> None: ...


class Conductor:
    """The engine loop over one plan: admission, the requests' walk tasks, the scheduler, steps, endings.

    It implements the narrow interfaces its parts reach it through: `requests.RequestHost`
    (a request's effects) and `cohorts.CohortsHost` (decode cohorts and their rows)."""

    def __init__(self, plan: Plan, workers: Mapping[int, WorkerLike], *, max_running: int | None = None,
                 preempt_every: int | None = None, request_timeout: float | None = None, overlap: bool = True,
                 prefix_caching: bool = False, prefix_chunk: int = DEFAULT_PREFIX_CHUNK, window_gather: int = 0):
        """`overlap=False` waits for every remote step as it is sent: the order of steps, and so
        who is batched with whom, is then exactly that of one rank (bit-exact comparisons).
        `prefix_caching=False` never reuses KV blocks across requests; with it on, keyed prefills
        run in chunks of `prefix_chunk` tokens and a hit reuses a multiple of them
        (docs/runtime.md, "Prefix caching"; not a positive multiple of the page size: ValueError).
        `window_gather`: a codec window may wait up to that many steps for other requests'
        windows to join its call (scheduler.py; 0: off; not an int from 0 to 8: ValueError)."""
        self.plan = plan
        self.overlap = overlap
        self.workers = dict(workers)
        limits = {name: int(n.settings["max_batch"]) for name, n in plan.nodes.items()
                  if isinstance(n.settings.get("max_batch"), int) and not isinstance(n.settings.get("max_batch"), bool)}
        self.scheduler = Scheduler(max_batch=plan.max_batch, node_limits=limits,
                                   gather=check_window_gather(window_gather), windows=window_phases(plan))
        self.max_running = max_running or plan.max_batch
        self.preempt_every = preempt_every
        self.request_timeout = request_timeout
        self.contexts = KVContexts(plan, self.workers, prefix_caching, prefix_chunk)
        self.kv = self.contexts.pages
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending: dict[StepCall, None] = {}  # ready calls in issue order (a dict: O(1) removal)
        self.ready: deque[tuple[WalkTask, Any, BaseException | None]] = deque()
        self.waits = StreamWaits(self.ready)
        self._task_calls: dict[WalkTask, StepCall] = {}
        self._call_tasks: dict[StepCall, WalkTask] = {}  # a call -> the task its outputs resume
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._readmit_after_finish = False
        self.tp = TPDispatch(self.workers)
        self.steps = StepRunner(self.workers, self.tp, self.contexts, self, overlap=overlap)
        self._inflight = self.steps.inflight  # rank -> its step sent without waiting, in send order
        self.reservations = Reservations(plan, self.contexts, self.steps, self)
        self.cohort_set = Cohorts(plan, self.workers, self.tp, self.contexts, limits, self._seq, self)
        self.cohorts: dict[CohortKey, Cohort] = self.cohort_set.by_key
        self.broken: str | None = None  # set when a worker process was lost: the engine has stopped
        self.stalled = False  # the last step found nothing to run but requests waiting on their clients
        self.stats: dict[str, float] = {"steps": 0, "batched_entries": 0, "wasted_steps": 0, "preemptions": 0,
                                        "finished": 0, "failed": 0, "cancelled": 0, "step_seconds": 0.0,
                                        "remote_steps": 0, "overlapped_steps": 0, "remote_wait_seconds": 0.0,
                                        "cohort_steps": 0, "kv_moves": 0}

    # ------------------------------------------------------------------ public
    def submit(self, walk: str, inputs: Mapping[str, Any], *, request_id: str | None = None,
               listener: Listener | None = None, timeout: float | None = None, streaming: bool = False,
               checked: bool = False) -> Request:
        """Queue a request; raises RequestError (naming the field) for bad input: its types, its
        defaults and the plan's bounds (`check_inputs`). With `streaming`, the walk's streamed
        inputs left out of `inputs` are fed later (`feed`). `checked`: `inputs` is what
        `check_inputs` returned for them already (the Python API checks in the caller's
        thread, so the error is raised there), and is not checked again."""
        if self.broken is not None:
            raise EngineStopped(f"the engine stopped: {self.broken}")
        program = self.plan.walk(walk)  # raises RequestError for an unknown walk
        if checked:
            streamed = stream_inputs(program)
            values = {k: v for k, v in inputs.items() if k not in streamed}
            whole = {name: inputs.get(name) for name in streamed}
        else:
            values, whole = check_inputs(walk, program, inputs, streaming=streaming, config=self.plan.config)
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
        self.waits.pump(req, feed)
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
            self.waits.pump(req, feed)
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
        self.steps.collect()
        self._drive()
        self.cohort_set.renumber()
        standing = self.cohort_set.standing()
        running = [r.id for r in self.running] if self.scheduler.gather else ()
        picked = self.scheduler.next_group(self.pending, busy=self._inflight.keys(), standing=standing, running=running)
        if picked is not None and picked[0] in self.cohorts:
            self._run_cohort(picked[0])
            return True
        if picked is None:
            if self._inflight:  # nothing else can run: wait for the oldest remote step
                self.steps.wait_oldest()
                return True
            # tasks blocked on nothing that can ever arrive: a walk bug, never a hang; a request
            # with an input still open waits for its client instead
            stuck = [r for r in self.running if not r.done and not r.awaits_client()]
            for r in stuck:
                self.fail(r, "walk cannot make progress (all of its tasks wait on each other)")
            if not stuck and self.running:
                self.stalled = True
                return False
            return bool(self.waiting or self.running)
        key, calls = picked
        entries = self.reserve(key, calls)
        if entries:
            self.steps.run(key, entries)
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
            self.waits.start_feed(req, feed, req.buffers[sid])  # a new attempt replays it from its first item

    # ------------------------------------------------------------------ tasks
    def _drive(self) -> None:
        """Advance every ready task; those that entered a marked loop join its cohort once no
        task is ready (together: a prefill batch's requests join in one worker call), which
        may make more ready (a row the cohort cannot take goes on generic)."""
        while self.ready or self.cohort_set.entering:
            while self.ready:
                task, value, exc = self.ready.popleft()
                if task.request.done or task not in task.request.tasks:
                    continue
                self._advance(task, value, exc)
            self.cohort_set.join_entered()

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
            self.fail(req, str(e), e.field)
            return
        except (WalkError, StreamError, ValueError, TypeError, RuntimeError, KeyError, IndexError) as e:
            self.fail(req, f"walk '{req.current_walk}' failed: {type(e).__name__}: {e}")
            return
        if isinstance(y, StepCall):
            y.seq = next(self._seq)
            self._task_calls[task] = y
            self._call_tasks[y] = task
            self.pending[y] = None
        elif isinstance(y, WaitChunk):
            self.waits.wait_chunk(task, y.buffer)
        elif isinstance(y, WaitSpace):
            self.waits.wait_space(task, y)
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
            if self.reservations.fork(req, y):
                self.ready.append((task, None, None))
        elif isinstance(y, EnterCohort):
            self.cohort_set.enter(task, y)
        else:  # pragma: no cover - the interpreter yields nothing else
            self.fail(req, f"internal error: unknown yield {type(y).__name__}")

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
            self._call_tasks.pop(call, None)
        task.gen.close()

    # ------------------------------------------------------------------ cohorts (CohortsHost)
    def row_left(self, task: WalkTask, done: CohortExit) -> None:
        """A row left its loop (called by its `Cohort`): its task goes on after the loop."""
        req = task.request
        req.stats.wasted_steps += done.wasted
        self.stats["wasted_steps"] += done.wasted
        self.ready.append((task, done, None))

    def free_pages(self, cohort: Cohort) -> bool:
        """A cohort needs a page and the pool is full: preempt (or fail) as a generic step would."""
        return self.reservations.free_pages(cohort)

    def move_in(self, req: Request, node: str, tag: str, step: str, rank: int, still: Callable[[], bool]) -> bool:
        """Copy a context the plan moves to `rank` before step `step`; False when `req` is gone meanwhile."""
        return self.reservations.move_in(req, node, tag, step, rank, still)

    def reserve(self, key: GroupKey, calls: list[StepCall]) -> list[tuple[StepCall, StepEntry]]:
        """The calls' KV slots (the entries of a step); a full pool preempts the newest request."""
        return self.reservations.reserve(key, calls)

    def resume(self, task: WalkTask, value: Any = None) -> None:
        """Resume `task` with `value` at the next drive."""
        self.ready.append((task, value, None))

    def stop(self, error: Exception) -> None:
        """A worker process was lost: every request fails, and the engine accepts no more."""
        self.broken = str(error)
        self._inflight.clear()  # the workers are shut down with their steps (RemoteWorker.close)
        for req in list(self.running) + list(self.waiting):
            self.fail(req, str(error))

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
                self.fail(m.request, str(e))
            return
        except WorkerLost as e:  # a worker process died mid-cohort (or a TP member diverged)
            self.stop(e)
            return
        self.cohort_set.stepped(key)
        self.stats["step_seconds"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["cohort_steps"] += 1
        self.stats["batched_entries"] += n
        self.after_step()

    # ------------------------------------------------------------------ requests' effects (RequestHost)
    def stream_changed(self, buffer: StreamBuffer) -> None:
        """Items were pushed into a request's stream buffer, or it closed."""
        self.waits.changed(buffer)

    def iteration_wasted(self, request: Request, kv_log: KVLog) -> None:
        """A speculative iteration was thrown away: its KV changes are undone, last first: each
        write cut back to where it began, each fork's destination given back its backup."""
        self.stats["wasted_steps"] += 1
        for entry in reversed(kv_log):
            if isinstance(entry, ForkUndo):
                self.contexts.restore(request, entry.node, entry.backup, entry.key[1])
            else:
                node, key, start = entry
                self.contexts.truncate(node, key, start)

    def context_released(self, request: Request, node: str, tag: str) -> None:
        if not request.done:
            self.contexts.free(request, node, tag)

    # ------------------------------------------------------------------ steps (StepHost)
    def request_of(self, call: StepCall) -> Request | None:
        """The request of a call whose task still waits for it (None once the task is gone)."""
        task = self._call_tasks.get(call)
        return None if task is None else task.request  # type: ignore[return-value]

    def still_waits(self, call: StepCall) -> bool:
        """Whether the call's task still waits for its outputs (not ended, dropped or preempted)."""
        task = self._call_tasks.get(call)
        return task is not None and not task.request.done and task in task.request.tasks  # type: ignore[attr-defined]

    def call_done(self, call: StepCall, outputs: dict[str, Any]) -> None:
        """Resume the call's task with its outputs."""
        task = self._call_tasks.pop(call)
        task.request.stats.steps += 1  # type: ignore[attr-defined]
        self._task_calls.pop(task, None)
        self.ready.append((task, outputs, None))

    def after_step(self) -> None:
        """A step finished: every `preempt_every` steps, the newest request not preempted yet is (tests)."""
        if self.preempt_every and self.stats["steps"] % self.preempt_every == 0:
            self.steps.quiesce()  # never preempt a request with a step in flight
            # each request is preempted at most once by the forced mode, so every one finishes
            fresh = [r for r in self.running if r.stats.preemptions == 0]
            if fresh:
                self.preempt(max(fresh, key=lambda r: r.arrival), forced=True)

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
                    self.fail(req, f"transition {walk} -> {t['dst']}: {e}", e.field)
                return
        self._end(req, FINISHED, reason="stop")

    def _transition(self, req: Request, t: dict[str, Any]) -> None:
        keep = {(k["node"], k["tag"]): k["as"] for k in t["keep"]}
        for (node, tag), as_tag in keep.items():
            # a full pool preempts (or, if it can never fit, fails) as a walk's own fork does
            if tag != as_tag and not self.reservations.fork(req, ForkKV(node, tag, as_tag)):
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
        whole = {out["name"]: (concat(v) if (v := req.outputs.get(out["name"])) else empty_value(out["type"]))
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
        self.pending = {c: None for c in self.pending if c.request_id != req.id}
        for buf in req.buffers.values():
            self.waits.forget(buf)
        for feed in req.feeds.values():
            feed.buffer = None
        self.cohort_set.remove(req)
        self.kv.free_request(req.id)
        req.moved.clear()  # a new attempt moves its contexts again
        req.homes.clear()
        for w in self.workers.values():
            w.free(req.id)
        self.tp.forget(req.id)
        if req in self.running:
            self.running.remove(req)

    def preempt(self, req: Request, forced: bool = False) -> None:
        """Free everything `req` holds and queue it again in arrival order: it restarts from its first walk."""
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

    def fail(self, req: Request, message: str, field_name: str | None = None) -> None:
        """End `req` as failed with `message` (naming its input `field_name`, if any); nothing if it ended."""
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
                    req.outputs[out["name"]] = empty_value(out["type"])
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


# what other modules import from here (the request records live in control/requests.py)
__all__ = ["CANCELLED", "FAILED", "FINISHED", "RUNNING", "WAITING", "Conductor", "InputFeed", "Listener",
           "Request", "RequestStats", "WorkerLike", "check_inputs", "coerce_items", "stream_inputs"]
