"""The Python API: load a plan, submit requests to its walks, await or stream their outputs.

    with MStar.load("tts.plan", weights="ckpt/") as m:
        h = m.submit("tts", {"prompt": "hello"})
        for name, chunk in h.stream():      # appended outputs, as they are produced
            ...
        outputs = h.result()                # {output name: value}; RequestFailed if it failed

Threading. The `Conductor` is not thread-safe, so one background thread (the engine) owns
it. `submit` and `cancel` only queue a command and wake the engine; the engine applies
queued commands between steps, steps while anything is in flight and sleeps on a condition
when idle (no polling). The conductor reports back through its `Listener` callbacks, on the
engine thread; they hand outputs to the request's `RequestHandle` under the handle's own
lock, and wake blocked readers (`result`, `stream`) or event loops (`aresult`, `astream`,
through `loop.call_soon_threadsafe`).

Input errors (unknown walk, missing, unknown or mistyped input) raise `RequestError` in the
caller, before anything is queued: `submit` validates with the walk's typed inputs exactly
as the conductor would.

Streamed inputs (a walk input with a `stream` in the plan, e.g. audio from a microphone):
give the input whole to `submit`, or submit with `streaming=True` and send it in parts,

    h = m.submit("transcribe", {}, streaming=True)
    for part in microphone():
        h.feed("audio", part)              # blocks while the engine lags (backpressure)
    h.close_input("audio")
    text = h.result()["text"]

Each part goes through the engine thread's queue like a submit; the conductor moves it into
the stream buffer as its capacity allows, and the walk's `on stream` block takes chunks of
it by the stream's policy as if the input had come whole. `feed` returns once fewer than
the stream's `capacity` items of that input wait at the engine, so a client that sends
faster than the walk consumes is slowed to its pace. Feed one input from one thread. Everything that happens later (a node rejecting an input, a
timeout, a cancellation, `close()`, the engine thread dying) ends the handle, and
`result()` raises `RequestFailed` with the message, the field and the finish reason.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from mstar_runtime import media
from mstar_runtime.control.conductor import (
    CANCELLED,
    FAILED,
    FINISHED,
    RUNNING,
    WAITING,
    Conductor,
    Request,
    WorkerLike,
    coerce_items,
    stream_inputs,
)
from mstar_runtime.control.requests import check_submit
from mstar_runtime.control.scheduler import (
    DEFAULT_PREFIX_CHUNK,
    PrefixChunkError,
    check_prefix_chunk,
    check_window_gather,
)
from mstar_runtime.control.validate import TORCH_DTYPES
from mstar_runtime.ops.node import RequestError
from mstar_runtime.output_stream import OutputStream, RequestFailed
from mstar_runtime.plan.loader import Plan, PlanError, load_plan

log = logging.getLogger(__name__)

SHUTDOWN = "shutdown"  # the finish reason of requests still in flight when `MStar.close()` runs
TIMEOUT = "timeout"  # the conductor's finish reason for a request past its deadline


class EngineClosed(RuntimeError):
    """`submit` after `close()`, or after the engine thread died (the message says why)."""


# ------------------------------------------------------------------------------- workers
def start_workers(plan: Plan, weights: str | PathLike[str]) -> tuple[dict[int, WorkerLike], Callable[[], None]]:
    """The plan's workers and a function that shuts them down.

    Uses `mstar_runtime.worker.startup.start_workers` (rank 0 in-process, other ranks as processes)
    when that module is installed; without it, only single-rank plans run, in-process.
    `find_spec` rather than `try: import`: an ImportError *inside* remote.py is a bug to see,
    not a reason to fall back silently.
    """
    if importlib.util.find_spec("mstar_runtime.worker.remote") is not None:
        from mstar_runtime.worker import startup

        workers: dict[int, WorkerLike] = startup.start_workers(plan, weights, plan.device)
        return workers, lambda: startup.shutdown_workers(workers)
    if plan.num_ranks != 1:
        raise PlanError(plan.path, f"the plan has {plan.num_ranks} ranks; running more than one rank needs "
                        "mstar_runtime.worker.remote, which this installation lacks")
    from mstar_runtime.worker.worker import Worker

    weights_src = weights if isinstance(weights, str) else Path(weights)
    return {0: Worker(plan, 0, plan.torch_device(0), weights_src)}, lambda: None


# ------------------------------------------------------------------------------- handles
class RequestHandle(OutputStream):
    """A submitted request. Thread-safe; every method may be called from any thread."""

    def __init__(self, engine: MStar, request_id: str, walk: str, inputs: dict[str, Any], timeout: float | None,
                 streaming: bool = False):
        self.id = request_id
        self.walk = walk
        self._engine = engine
        self._inputs = inputs  # the engine submits these to the conductor
        self._timeout = timeout
        self._streaming = streaming
        # streamed inputs the client feeds: items fed, items the engine took into its buffer
        # (this attempt), closed ones
        fed = [n for n in stream_inputs(engine.plan.walk(walk)) if n not in inputs] if streaming else []
        self._fed: dict[str, int] = dict.fromkeys(fed, 0)
        self._taken: dict[str, int] = dict.fromkeys(fed, 0)
        self._closed_inputs: set[str] = set()
        self._submitted_at = time.perf_counter()
        super().__init__()
        self._request: Request | None = None  # set by the engine when the conductor has it
        self._state = WAITING
        self._error: str | None = None
        self._field: str | None = None
        self._reason: str | None = None
        self._final_stats: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RequestHandle(id={self.id!r}, walk={self.walk!r}, state={self.state!r})"

    # ---- reading
    @property
    def state(self) -> str:
        """waiting, running, finished, failed or cancelled."""
        with self._cond:
            if self._done:
                return self._state
            req = self._request
        if req is None:
            return WAITING
        # the conductor marks a request ended just before it tells us: until then it still runs
        return req.state if req.state in (WAITING, RUNNING) else RUNNING

    @property
    def stats(self) -> dict[str, Any]:
        """Steps, wasted speculative steps, preemptions, prompt tokens found in the prefix cache
        (`cached_tokens`), time to first output and total (seconds, from this `submit` call), so
        far or final."""
        with self._cond:
            if self._final_stats is not None:
                return dict(self._final_stats)
        return self._stats_now()

    def _stats_now(self) -> dict[str, Any]:
        req = self._request
        if req is None:
            return {"steps": 0, "wasted_steps": 0, "preemptions": 0, "cached_tokens": 0, "ttft_s": None,
                    "total_s": None}
        s = req.stats
        first, end = s.first_output_at, s.finished_at
        return {
            "steps": s.steps,
            "wasted_steps": s.wasted_steps,
            "preemptions": s.preemptions,
            "cached_tokens": s.cached_tokens,
            "ttft_s": None if first is None else first - self._submitted_at,
            "total_s": None if end is None else end - self._submitted_at,
        }

    def summary(self) -> dict[str, Any]:
        """What `<id>.json` records: walk, state, error, field, finish reason, timings, counts."""
        st, state = self.stats, self.state
        walks = list(self._request.walks_done) if self._request is not None else []
        return {
            "id": self.id, "walk": self.walk, "walks": walks, "state": state,
            "error": self._error, "field": self._field, "finish_reason": self._reason,
            "timings": {"ttft_s": st["ttft_s"], "total_s": st["total_s"]},
            "steps": st["steps"], "wasted_steps": st["wasted_steps"], "preemptions": st["preemptions"],
        }

    def _failure(self) -> RequestFailed:
        return RequestFailed(self.id, self._error or f"request {self._state}", self._field, self._reason or "error")

    def cancel(self) -> bool:
        """Ask the engine to cancel the request (it fails with finish reason "cancelled").
        False if it had already ended; a request that finishes first stays finished."""
        return self._engine._queue_cancel(self)

    # ---- streamed inputs
    def feed(self, name: str, items: Any, timeout: float | None = None) -> None:
        """Send the next part of streamed input `name` (a tensor whose first dimension counts
        items: samples of `audio: f32[S]`). Waits while the stream's `capacity` or more items of
        this input wait at the engine. Raises `RequestError` (naming the input) for an input
        that is not fed this way or is closed, or items of the wrong type; `RequestFailed` if
        the request ended without its outputs; `TimeoutError` after `timeout` seconds of waiting."""
        program = self._engine.plan.walk(self.walk)
        sid = self._fed_input(name)
        part = coerce_items(self.walk, name, next(p for p in program["inputs"] if p["name"] == name)["type"], items)
        capacity = self._engine.plan.stream(sid).capacity
        with self._cond:
            self._check_feedable(name)
            if not self._cond.wait_for(lambda: self._done or self._fed[name] - self._taken[name] < capacity, timeout):
                raise TimeoutError(f"request '{self.id}': input '{name}' was not taken within {timeout} s")
            self._check_feedable(name)
            self._fed[name] += int(part.shape[0])
        self._engine._queue_input(self, "feed", name, part)

    def close_input(self, name: str) -> None:
        """No more parts of streamed input `name` will come (idempotent): the walk sees its end."""
        self._fed_input(name)
        with self._cond:
            if name in self._closed_inputs or self._done:
                return
            self._closed_inputs.add(name)
        self._engine._queue_input(self, "close_input", name, None)

    def _fed_input(self, name: str) -> str:
        """The stream id of an input this handle feeds; RequestError for any other name."""
        streamed = stream_inputs(self._engine.plan.walk(self.walk))
        if name not in self._fed:
            # a streamed input this handle does not feed was given whole (submit requires it then)
            why = ("was given whole at submit" if name in streamed else
                   f"is not a streamed input of walk '{self.walk}' (streamed: {', '.join(streamed) or 'none'})")
            raise RequestError(f"request '{self.id}': input '{name}' {why}", name)
        return streamed[name]

    def _check_feedable(self, name: str) -> None:  # under self._cond
        if name in self._closed_inputs:
            raise RequestError(f"request '{self.id}': input '{name}' is closed; nothing more can be fed", name)
        if self._done:
            if self._state != FINISHED:
                raise self._failure()
            raise RequestError(f"request '{self.id}' has finished; input '{name}' can take no more", name)

    def _input_taken(self, name: str, pushed: int) -> None:  # engine thread
        with self._cond:
            if name in self._taken:
                self._taken[name] = pushed
                self._cond.notify_all()

    # ---- called by the engine thread
    def _push(self, name: str, value: Any) -> None:
        with self._cond:
            self._chunks.append((name, value))
            watchers = list(self._watchers)
            self._cond.notify_all()
        for wake in watchers:
            wake()

    def _settle(self, state: str, outputs: dict[str, Any], error: str | None, field: str | None,
                reason: str | None) -> None:
        stats = self._stats_now()
        with self._cond:
            if self._done:
                return
            self._state, self._outputs, self._error, self._field, self._reason = state, outputs, error, field, reason
            self._final_stats = stats
            ended = self._end()
        self._after_end(ended, log)


class _Relay:
    """The conductor's `Listener` for one handle (runs on the engine thread)."""

    def __init__(self, engine: MStar, handle: RequestHandle):
        self.engine, self.handle = engine, handle

    def on_output(self, request: Request, name: str, value: Any) -> None:
        self.handle._push(name, value)

    def on_finish(self, request: Request) -> None:
        self.engine._request_ended(self.handle, request)

    def on_input(self, request: Request, name: str, pushed: int) -> None:
        self.handle._input_taken(name, pushed)


def _empty_output(t: Mapping[str, Any]) -> Any:
    """The value of an appended output that never got an item (a short request's audio)."""
    if t.get("kind") == "str":
        return ""
    if t.get("kind") != "tensor" or t.get("dtype") not in TORCH_DTYPES:
        return None
    dims = [d if isinstance(d, int) else 0 for d in t.get("dims", [])] or [0]
    dims[0] = 0
    return torch.zeros(dims, dtype=TORCH_DTYPES[t["dtype"]])


# ------------------------------------------------------------------------------- engine
class MStar:
    """A loaded plan with its workers and the engine thread that serves it."""

    def __init__(self, plan: Plan, workers: Mapping[int, WorkerLike], *, shutdown: Callable[[], None] | None = None,
                 max_running: int | None = None, preempt_every: int | None = None,
                 request_timeout: float | None = None, weights: str | PathLike[str] = "dummy",
                 prefix_caching: bool = False, prefix_chunk: int = DEFAULT_PREFIX_CHUNK, window_gather: int = 0):
        """`weights`: what the workers loaded, for the rate an audio file is resampled to (`input_rate`).
        `prefix_caching`: reuse the KV of prompts' shared leading blocks across requests, in
        multiples of `prefix_chunk` tokens (docs/runtime.md, "Prefix caching"). `window_gather`:
        a codec window may wait up to that many steps for other requests' windows to join its
        call (docs/runtime.md, "Window gather"; 0: off)."""
        self.plan = plan
        self._rates = media.InputRates(plan, weights)
        self._conductor = Conductor(plan, workers, max_running=max_running, preempt_every=preempt_every,
                                    request_timeout=request_timeout, prefix_caching=prefix_caching,
                                    prefix_chunk=prefix_chunk, window_gather=window_gather)
        self._shutdown = shutdown
        self._lock = threading.Condition()  # guards everything below; the engine sleeps on it
        # (command, handle, args): submit, cancel, and a streamed input's feed / close_input
        self._inbox: deque[tuple[str, RequestHandle, tuple[Any, ...]]] = deque()
        self._live: dict[str, RequestHandle] = {}
        self._counts = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, TIMEOUT: 0, SHUTDOWN: 0}
        self._ids = itertools.count()
        self._closing = False
        self._dead: str | None = None
        self._workers_down = False
        self._snapshot: dict[str, Any] = {}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="mstar-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, plan_path: str | PathLike[str], *, weights: str | PathLike[str] = "dummy",
             device: str | None = None, max_running: int | None = None, preempt_every: int | None = None,
             request_timeout: float | None = None, prefix_caching: bool = False,
             prefix_chunk: int | None = None, window_gather: int = 0) -> MStar:
        """Load a plan (a bad one raises `PlanError`, unchanged), start its workers and the engine."""
        plan = load_plan(plan_path, device=device)
        return cls.from_plan(plan, weights=weights, max_running=max_running, preempt_every=preempt_every,
                             request_timeout=request_timeout, prefix_caching=prefix_caching,
                             prefix_chunk=prefix_chunk, window_gather=window_gather)

    @classmethod
    def from_plan(cls, plan: Plan, *, weights: str | PathLike[str] = "dummy", max_running: int | None = None,
                  preempt_every: int | None = None, request_timeout: float | None = None,
                  prefix_caching: bool = False, prefix_chunk: int | None = None,
                  window_gather: int = 0) -> MStar:
        """Like `load`, for a plan already loaded (the CLI checks its inputs against it first).
        `prefix_chunk` (default `DEFAULT_PREFIX_CHUNK`) goes with `prefix_caching=True`: given
        without it, or not a positive multiple of the plan's page size, it is a
        `PrefixChunkError`; a `window_gather` that is not an int from 0 to 8 a
        `WindowGatherError` (both ValueErrors), before any worker starts."""
        check_window_gather(window_gather)
        if prefix_chunk is not None and not prefix_caching:  # it would be ignored (as mstar-run refuses it)
            raise PrefixChunkError(f"prefix_chunk={prefix_chunk!r} goes with prefix_caching=True")
        prefix_chunk = DEFAULT_PREFIX_CHUNK if prefix_chunk is None else prefix_chunk
        if prefix_caching:
            check_prefix_chunk(prefix_chunk, plan.page_size)
        workers, shutdown = start_workers(plan, weights)
        try:
            return cls(plan, workers, shutdown=shutdown, max_running=max_running, preempt_every=preempt_every,
                       request_timeout=request_timeout, weights=weights,
                       prefix_caching=prefix_caching, prefix_chunk=prefix_chunk, window_gather=window_gather)
        except BaseException:
            shutdown()
            raise

    def __enter__(self) -> MStar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def conductor(self) -> Conductor:
        """The engine's conductor, for introspection after `close()` (not thread-safe before)."""
        return self._conductor

    # ---- client side
    def submit(self, walk: str, inputs: Mapping[str, Any] | None = None, *, request_id: str | None = None,
               timeout: float | None = None, streaming: bool = False) -> RequestHandle:
        """Queue a request. Raises `RequestError` (naming the field) for bad input, here and
        now; `EngineClosed` after `close()`. `streaming`: the walk's streamed inputs that
        `inputs` leaves out are sent through the handle (`feed`, `close_input`).

        Images and audio may be given as a caller has them (`mstar_runtime.media`): a PIL
        image, a numpy array or a file path (`str` or `Path`: PNG, JPEG, ..., a WAV file,
        resampled to the walk's rate, or a `.safetensors` file) where the walk takes an image
        or a tensor."""
        program = self.plan.walk(walk)  # UnknownWalk, a RequestError naming the field 'walk'
        if inputs is not None and not isinstance(inputs, Mapping):
            raise RequestError(f"inputs of walk '{walk}' must be a mapping of input name to value "
                               f"(inputs={{'name': value}}), got {type(inputs).__name__}", "inputs")
        inputs = media.to_walk_values(walk, program, inputs or {}, lambda name: self.input_rate(walk, name))
        values = check_submit(walk, program, inputs, streaming=streaming, config=self.plan.config,
                              request_id=request_id, timeout=timeout)
        with self._lock:
            self._check_open()
            rid = request_id or self._new_id()
            if rid in self._live:
                raise RequestError(f"request id '{rid}' is already in use", "request_id")
            handle = RequestHandle(self, rid, walk, values, timeout, streaming)
            self._live[rid] = handle
            self._counts["submitted"] += 1
            self._inbox.append(("submit", handle, ()))
            self._lock.notify()
        return handle

    def input_rate(self, walk: str, name: str) -> int:
        """The sample rate walk input `name` reads audio at (`media.input_rate`), which a WAV
        file given for it is resampled to."""
        return self._rates(walk, name)

    def generate(self, walk: str, /, **inputs: Any) -> dict[str, Any]:
        """Submit and wait: `m.generate("generate", prompt="hi", max_new=8)`."""
        return self.submit(walk, inputs).result()

    def stats(self) -> dict[str, Any]:
        """The conductor's counters (as of its last step), KV use, and per-request counts."""
        with self._lock:
            snap = dict(self._snapshot)
            counts = {**self._counts, "active": len(self._live)}
        return {**snap, "requests": counts}

    def close(self) -> None:
        """Fail what is in flight (finish reason "shutdown"), stop the engine, shut the workers
        down. Idempotent."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self._shutdown_workers()

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineClosed(self._dead)
        if self._closing:
            raise EngineClosed("this MStar is closed")

    def _new_id(self) -> str:
        while True:  # skip ids a client chose itself
            rid = f"req-{next(self._ids)}"
            if rid not in self._live:
                return rid

    def _queue_cancel(self, handle: RequestHandle) -> bool:
        with self._lock:
            if handle.done or self._dead is not None or self._closing:
                return False
            self._inbox.append(("cancel", handle, ()))
            self._lock.notify()
            return True

    def _queue_input(self, handle: RequestHandle, kind: str, name: str, part: torch.Tensor | None) -> None:
        with self._lock:
            if handle.done or self._dead is not None or self._closing:
                return  # the handle has ended, or is about to: its outcome says why
            self._inbox.append((kind, handle, (name, part)))
            self._lock.notify()

    # ---- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._inbox and not self._closing and (self._conductor.idle or self._conductor.stalled):
                        # stalled: every request waits on an input its client has not closed; sleep
                        # until a command comes, or until the nearest deadline is due
                        deadline = self._conductor.next_deadline() if self._conductor.stalled else None
                        if deadline is None:
                            self._lock.wait()
                        elif (left := deadline - time.perf_counter()) > 0:
                            self._lock.wait(left)
                        else:
                            break
                    commands = list(self._inbox)
                    self._inbox.clear()
                    closing = self._closing
                if closing:
                    self._drain(commands)
                    return
                self._apply(commands)
                if not self._conductor.idle:
                    self._conductor.step()
                self._publish()
        except BaseException as e:  # whatever kills the engine must fail its handles, never hang them
            self._die(e)

    def _apply(self, commands: list[tuple[str, RequestHandle, tuple[Any, ...]]]) -> None:
        for kind, handle, args in commands:
            if kind == "cancel":
                self._conductor.cancel(handle.id)
                continue
            if kind in ("feed", "close_input"):
                name, part = args
                try:
                    if kind == "feed":
                        self._conductor.feed(handle.id, name, part)
                    else:
                        self._conductor.close_input(handle.id, name)
                except RequestError:  # the handle checked it; an input the conductor refuses is a bug to see
                    log.exception("request '%s': %s of input '%s' refused", handle.id, kind, name)
                continue
            try:
                req = self._conductor.submit(handle.walk, handle._inputs, request_id=handle.id,
                                             listener=_Relay(self, handle), timeout=handle._timeout,
                                             streaming=handle._streaming, checked=True)
            except RequestError as e:  # submit validated already; a conductor-side refusal
                self._forget(handle.id, FAILED, "error")
                handle._settle(FAILED, {}, str(e), e.field, "error")
                continue
            with handle._cond:
                handle._request = req

    def _drain(self, commands: list[tuple[str, RequestHandle, tuple[Any, ...]]]) -> None:
        """close(): queued submissions never reach the conductor; running requests are cancelled."""
        message = "MStar was closed before the request finished"
        for kind, handle, _ in commands:
            if kind == "submit":
                self._forget(handle.id, CANCELLED, SHUTDOWN)
                handle._settle(CANCELLED, {}, message, None, SHUTDOWN)
        for rid in [r.id for r in (*self._conductor.running, *self._conductor.waiting) if not r.done]:
            self._conductor.cancel(rid, reason=SHUTDOWN)
        self._publish()
        self._shutdown_workers()

    def _request_ended(self, handle: RequestHandle, req: Request) -> None:
        error = req.error
        if req.state == CANCELLED and error is None:
            error = ("MStar was closed before the request finished" if req.finish_reason == SHUTDOWN
                     else "request cancelled")
        outputs = dict(req.outputs)
        if req.state == FINISHED:
            for o in self.plan.walk(req.current_walk)["outputs"]:
                if o.get("mode") == "append" and o["name"] not in outputs:
                    empty = _empty_output(o["type"])
                    if empty is not None:
                        outputs[o["name"]] = empty
        # the conductor keeps every request it ever saw; the engine is the one that knows a
        # handle holds the result now, so it drops the conductor's copy (a server runs for days)
        if self._conductor.requests.get(req.id) is req:
            del self._conductor.requests[req.id]
        # forget before settling: a client woken by the settle may reuse the id at once
        self._forget(handle.id, req.state, req.finish_reason)
        self._publish()  # so stats() read right after result() sees the freed KV pages
        handle._settle(req.state, outputs, error, req.error_field, req.finish_reason)

    def _forget(self, rid: str, state: str, reason: str | None) -> None:
        with self._lock:
            self._live.pop(rid, None)
            key = reason if reason in (TIMEOUT, SHUTDOWN) else state
            self._counts[key] = self._counts.get(key, 0) + 1

    def _publish(self) -> None:
        c = self._conductor
        st = dict(c.stats)
        snap: dict[str, Any] = {
            **st,
            "mean_batch": st["batched_entries"] / st["steps"] if st["steps"] else 0.0,
            "running": len(c.running),
            "waiting": len(c.waiting),
            "kv_used_pages": c.kv.used_pages(),
            "kv_total_pages": c.kv.total_pages(),
            **c.kv.prefix_stats(),
        }
        with self._lock:
            self._snapshot = snap

    def _die(self, exc: BaseException) -> None:
        log.error("the M* engine thread died", exc_info=exc)
        message = f"the engine thread died: {type(exc).__name__}: {exc}"
        with self._lock:
            self._dead = message
            handles = list(self._live.values())
            self._live.clear()
            self._inbox.clear()
            self._counts[FAILED] += len(handles)
        for handle in handles:
            handle._settle(FAILED, {}, message, None, "error")

    def _shutdown_workers(self) -> None:
        with self._lock:
            if self._workers_down:
                return
            self._workers_down = True
        if self._shutdown is not None:
            self._shutdown()


__all__ = ["EngineClosed", "MStar", "RequestFailed", "RequestHandle", "start_workers"]
