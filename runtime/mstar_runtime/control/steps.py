"""Running the scheduler's groups: batched steps here, on a tensor-parallel group, or sent to a worker process.

Remote steps overlap: a group on one rank > 0 (a worker process, `remote.RemoteWorker`) is
sent with `submit` and the engine loop goes on with other ready groups (the backbone's next
decode on rank 0, say) while it runs; its answer is taken between steps once it is there
(`collect`), or waited for when nothing else can run (`wait_oldest`). At most one step is
in flight per rank (the scheduler leaves out groups on a busy rank). While a request has a
step in flight it is never preempted (the conductor first takes every answer in flight,
`quiesce`); if it ends meanwhile (cancelled, timed out, failed by another of its steps) its
pages are freed at once and the answer is dropped when it comes: the worker frees its state
after the step, since its pipe is FIFO, and every later step that could reuse those pages
runs on the same, still busy, rank. Local steps run synchronously; a tensor-parallel group
waits for its leader only (`tp_dispatch.TPDispatch`). A node that rejects one entry of a
batch (`RequestError`) gets the entries again one by one, so that only the culprit fails.

What a step's outcome does to requests goes through `StepHost` (the conductor implements it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mstar_runtime.control.interpreter import StepCall
from mstar_runtime.control.kv_contexts import KVContexts
from mstar_runtime.control.requests import Request, port_input
from mstar_runtime.control.scheduler import GroupKey
from mstar_runtime.engine.engines import StepEntry
from mstar_runtime.ops.node import RequestError
from mstar_runtime.worker.remote import WorkerLost, can_submit
from mstar_runtime.worker.tp_dispatch import TPDispatch
from mstar_runtime.worker.worker import StepBatch, WorkerStepError

Entries = list[tuple[StepCall, StepEntry]]


class StepHandleLike(Protocol):
    def ready(self) -> bool: ...
    def result(self) -> list[dict[str, Any]]: ...


@dataclass(eq=False)
class InFlight:
    """A step sent to a worker process whose answer has not been taken yet."""

    key: GroupKey
    entries: Entries
    handle: StepHandleLike
    seconds: float  # host seconds spent sending it


class StepHost(Protocol):
    """What running steps needs of the engine loop (the conductor implements it)."""

    pending: dict[StepCall, None]  # the ready calls; a call leaves it when its step is sent
    stats: dict[str, float]

    def request_of(self, call: StepCall) -> Request | None:
        """The request of a call whose task still waits for it (None once the task is gone)."""

    def still_waits(self, call: StepCall) -> bool:
        """Whether the call's task still waits for its outputs (not ended, dropped or preempted)."""

    def call_done(self, call: StepCall, outputs: dict[str, Any]) -> None:
        """Resume the call's task with its outputs."""

    def reserve(self, key: GroupKey, calls: list[StepCall]) -> Entries:
        """The calls' KV slots (the entries of a step), preempting as need be."""

    def after_step(self) -> None:
        """A step finished (the forced-preemption test mode acts here)."""

    def fail(self, req: Request, message: str, field_name: str | None = None) -> None: ...
    def stop(self, error: Exception) -> None: ...


class StepRunner:
    """The steps in flight on worker processes, and running a group of entries (module docstring)."""

    def __init__(self, workers: Mapping[int, Any], tp: TPDispatch, contexts: KVContexts, host: StepHost, *,
                 overlap: bool = True):
        self.workers, self.tp, self.contexts, self.host, self.overlap = workers, tp, contexts, host, overlap
        self.inflight: dict[int, InFlight] = {}  # rank -> its step sent without waiting, in send order

    def wait_oldest(self) -> None:
        """Nothing else can run: wait for the oldest remote step's answer."""
        t0 = time.perf_counter()
        self._take(next(iter(self.inflight)))
        self.host.stats["remote_wait_seconds"] += time.perf_counter() - t0

    def run(self, key: GroupKey, entries: Entries, *, wait: bool = False) -> None:
        """Run one batched step: sent to a worker process without waiting when it is one rank
        that can take it (unless `wait`), else here and now."""
        node, phase, ranks = key
        for call, _ in entries:
            self.host.pending.pop(call, None)
        batch = StepBatch(node, phase, [e for _, e in entries])
        if self.inflight:
            self.host.stats["overlapped_steps"] += 1
        worker = self.workers[ranks[0]]
        t0 = time.perf_counter()
        try:
            if len(ranks) == 1 and self.overlap and not wait and can_submit(worker):
                handle = worker.submit(batch)  # type: ignore[attr-defined]
                self.inflight[ranks[0]] = InFlight(key, entries, handle, time.perf_counter() - t0)
                self.host.stats["remote_steps"] += 1
                return
            outputs = self._dispatch(ranks, batch)
        except (RequestError, WorkerStepError, WorkerLost) as e:
            self._failed(key, entries, e)
            return
        self._finish(key, entries, outputs, time.perf_counter() - t0)

    def collect(self) -> None:
        """Take the answers of remote steps that have arrived; never waits."""
        try:
            self.tp.poll()
        except WorkerLost as e:  # a TP member failed a step its leader ran
            self.host.stop(e)
            return
        for rank in list(self.inflight):
            flight = self.inflight.get(rank)
            if flight is not None and flight.handle.ready():
                self._take(rank)

    def quiesce(self) -> None:
        """Take every answer in flight, waiting for them (oldest first)."""
        while self.inflight:
            self._take(next(iter(self.inflight)))

    def _take(self, rank: int) -> None:
        """Take the answer of `rank`'s step in flight (waiting for it if need be) and apply it
        to the entries whose tasks still wait for it; the others ended or were dropped
        meanwhile (their pages were freed or truncated then)."""
        flight = self.inflight.pop(rank)
        t0 = time.perf_counter()
        try:
            outputs = flight.handle.result()
        except (RequestError, WorkerStepError, WorkerLost) as e:
            self._failed(flight.key, [(c, e_) for c, e_ in flight.entries if self.host.still_waits(c)], e)
            return
        self._finish(flight.key, flight.entries, outputs, flight.seconds + time.perf_counter() - t0)

    def _finish(self, key: GroupKey, entries: Entries, outputs: list[dict[str, Any]],
                seconds: float) -> None:
        """A step's outputs: KV of entries that keep nothing truncated, tasks resumed."""
        node = key[0]
        self.host.stats["step_seconds"] += seconds
        self.host.stats["steps"] += 1
        self.host.stats["batched_entries"] += len(entries)
        for (call, entry), out in zip(entries, outputs):
            if not self.host.still_waits(call):
                continue
            if entry.kv is not None and not entry.kv.keep:
                self.contexts.truncate(node, (entry.request_id, entry.tag or "main"), entry.kv.start)
            elif entry.kv is not None and self.contexts.pages.prefix_caching:  # its blocks are written now
                self.contexts.pages.commit((node, key[2][0]), (entry.request_id, entry.tag or "main"))
            self.host.call_done(call, out)
        self.host.after_step()

    def _failed(self, key: GroupKey, entries: Entries, error: Exception) -> None:
        if isinstance(error, RequestError):
            self._isolate(key, entries, error)
        elif isinstance(error, WorkerStepError):
            for req in {id(r): r for c, _ in entries if (r := self.host.request_of(c)) is not None}.values():
                self.host.fail(req, str(error))
        else:  # WorkerLost: a worker process died or hung; nothing can run any more
            self.host.stop(error)

    def _dispatch(self, ranks: tuple[int, ...], batch: StepBatch) -> list[dict[str, Any]]:
        if len(ranks) == 1:
            return self.workers[ranks[0]].run_step(batch)
        return self.tp.run(ranks, batch)  # a tensor-parallel group (runtime/mstar_runtime/worker/tp_dispatch.py)

    def _isolate(self, key: GroupKey, entries: Entries, error: RequestError) -> None:
        """A node rejected one entry of a batch: rerun them one by one (waiting for each) so
        only the culprit fails."""
        if not entries:
            return
        if len(entries) == 1:
            call = entries[0][0]
            req = self.host.request_of(call)
            if req is not None:
                self.host.fail(req, str(error), port_input(req, call, error.field))
            return
        for call, _ in entries:
            self.host.pending[call] = None
        for _, entry in entries:
            if entry.kv is not None:  # the reservation is redone on the rerun
                self.contexts.truncate(key[0], (entry.request_id, entry.tag or "main"),
                                       entry.kv.start - entry.kv.cached)
        for call, _ in entries:
            req = self.host.request_of(call)
            if req is None or req.done:
                continue
            single = self.host.reserve(key, [call])
            if single:
                self.run(key, single, wait=True)
