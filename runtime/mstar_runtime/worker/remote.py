"""Worker processes: one per rank > 0 of a plan, driven by the conductor's process (rank 0).

Rank 0 runs the conductor and an in-process `Worker`; every other rank is a process started
with `python -m mstar_runtime.worker.remote` (never multiprocessing: nothing is pickled). The
conductor talks to it through a `RemoteWorker`, which implements the conductor's
`WorkerLike` (`run_step`, `fork`, `copy_slots`, `drop_tag`, `free`, `export_kv`,
`import_kv`) plus `submit` (a step whose answer is taken later), `heartbeat` and `close`.

This module is the conductor's side of one worker (`RemoteWorker`, `StepHandle`);
`startup.py` starts and ends the whole set (`start_workers`, `shutdown_workers`, rank 0's
`LocalWorker`); `wire.py` holds what both sides share (frames, values, tensor transfers);
`process.py` is the worker's loop (`worker_main`, run by this module's `__main__`).

Control: typed msgpack messages (`messages.py`, decoded through its allowlist), one per
frame: a 4-byte big-endian length, then the bytes. The conductor writes to the worker's
stdin and reads its stdout; the worker's fd 1 is pointed at its stderr as soon as it
starts, so nothing a node prints can corrupt a frame.

Tensors: torch.distributed point-to-point (Gloo on CPU, NCCL on GPU) in the default group,
whose rank 0 is the conductor's process (tensor-parallel nodes talk among themselves in
their own groups, `mstar_runtime.ops.tp`, made by every process right after the default one).
A step's tensors travel as ONE flat byte buffer per direction, in entry order, then each
entry's input (or output) order; the message's
`TensorMeta`s (name, dtype, shape) say how to cut it up. Empty tensors and tensors of at
most `inline_bytes` ride inside the message, Python scalars too. One step:

    conductor: StepRequest frame -> dist.send(inputs buffer)    (if it has bytes)
    worker:    read frame -> dist.recv(inputs) -> run -> StepResult frame -> dist.send(outputs)
    conductor: read frame -> dist.recv(outputs buffer)           (if it has bytes)

The frame always goes first, so each side posts its receive knowing the size, and a step
that fails sends no buffer back. `ForkKV`, `CopySlots`, `DropTag` and `FreeRequest` get no
answer (the pipe keeps them in order with the steps); `Heartbeat` is echoed. A KV context
the plan moves between ranks (`Worker.export_kv` / `import_kv`) travels like a step, a step
in flight on that worker finished first:

    export (rank r -> 0): ExportKV frame; worker: KVExported frame -> dist.send(values)
    import (rank 0 -> r): ImportKV frame -> dist.send(values); worker: dist.recv, applies it

Asynchronous steps: `submit(batch)` does the conductor's first line and returns a
`StepHandle`; `handle.ready()` looks at the pipe without waiting and, once the answer frame
is there, does the last line; `handle.result()` waits for it (`run_step` is
`submit(batch).result()`). Meanwhile the conductor runs other steps, on rank 0 or on another
worker. The point-to-point transfers between rank 0 and a worker must happen in the same
order on both sides, one at a time, and they do:
- at most one step is in flight per worker: `submit`, `heartbeat` and `close` first finish
  the step in flight (its handle keeps the answer), so no two steps' transfers interleave.
  Acknowledgement-only steps (a TP member's, `send_outputs=False`: no outputs travel back,
  runtime/mstar_runtime/worker/tp_dispatch.py) are the exception: several may be in flight, answered in order;
  a full step, a heartbeat or `close` first reads their answers;
- every transfer and every conversation with a worker holds its lock (one thread at a
  time), always in the default group (TP collectives have groups of their own);
- a message without an answer posted while a full step is in flight (a request freed, a KV
  context forked or truncated meanwhile) is held here and written right after the step's
  answer is in (with only acknowledgement-only steps in flight it is written at once: the
  worker never blocks sending their outputs). The worker would apply it after the step anyway (the pipe is FIFO), and
  written at once it could fill the pipe while the worker, blocked sending its outputs,
  reads nothing.
On a GPU the worker synchronises its device before it answers, so an answer that has
arrived means outputs that exist: rank 0's receive, queued on its stream, then holds rank
0's next kernels for the transfer only, never for the worker's computation.

Failures:
- a node's `RequestError` -> `StepRejected` -> `RequestError` (with `request_ids`) here: the
  conductor fails that request only;
- any other exception in a step -> `WorkerError` with the traceback -> `WorkerStepError`
  here: the batch's requests fail, the worker serves on (as the in-process `Worker` does);
- a worker that dies, closes its pipe, breaks the protocol or does not answer within
  `answer_timeout` -> `WorkerLost(rank, message)`, naming the exit code or signal and the
  last lines of its stderr. The conductor then stops: every request fails with it. A step
  in flight counts against `answer_timeout` from its `submit`, also while the conductor is
  busy elsewhere (`ready()` checks the deadline).

A worker exits when its stdin reaches EOF (the conductor closed it or died) and, on Linux,
gets SIGKILL when the thread that started it dies (PR_SET_PDEATHSIG): start workers from a
thread that lives as long as they should (the main thread). An atexit hook closes every
`RemoteWorker`, so no worker outlives a conductor that exits normally. Under torchrun
(`launch.py`, startup.py) a `PeerWorker` (`peer.py`) is this class over a TCP connection
instead of pipes, the same protocol and failure handling. `alive()` (the server's /health)
says whether a worker serves: not lost, its process (or connection) up, no answer overdue.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from mstar_runtime.kv.block_manager import SlotCopy
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.process import ANSWER_TIMEOUT_S, worker_main
from mstar_runtime.worker.remote_cohort import RemoteCohorts
from mstar_runtime.worker.remote_process import _LIVE, RemoteProcess
from mstar_runtime.worker.wire import (
    FRAME,
    INLINE_BYTES,
    ProtocolError,
    comm_device,
    copy_to_wire,
    pack_values,
    recv_tensors,
    send_tensors,
    unpack_values,
)
from mstar_runtime.worker.worker import StepBatch, WorkerStepError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # joining the group and building the nodes


class WorkerLost(RuntimeError):
    """A worker process died, hung or broke the protocol: the run cannot go on."""

    def __init__(self, rank: int, message: str):
        self.rank, self.message = rank, message
        super().__init__(f"worker rank {rank} lost: {message}")


class EngineStopped(RequestError):
    """Raised by `Conductor.submit` once a worker was lost: no request can run any more."""


class RemoteWorker(RemoteProcess, RemoteCohorts):
    """The conductor's proxy of one worker process (see the module docstring; its decode
    cohort calls, `cohort_*`, in runtime/mstar_runtime/worker/remote_cohort.py; its process,
    `RemoteProcess`, in remote_process.py)."""

    died = "died"  # what a `WorkerLost` says of a worker found gone between steps
    channel = "control pipe"  # what carries the frames, in messages

    def __init__(
        self,
        plan: Plan,
        rank: int,
        init_method: str,
        *,
        weights: str | Path = "dummy",
        device: str = "cpu",
        answer_timeout: float = ANSWER_TIMEOUT_S,
        inline_bytes: int = INLINE_BYTES,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
        peers: _Peers | None = None,
    ):
        self._setup(plan, rank, answer_timeout, inline_bytes, peers)
        self._spawn(init_method, weights, device, threads, env)
        _LIVE.add(self)

    def _setup(self, plan: Plan, rank: int, answer_timeout: float, inline_bytes: int, peers: _Peers | None) -> None:
        """The conductor-side state of the conversation, whatever carries it."""
        self.plan, self.rank = plan, rank
        self.peers = peers
        self.answer_timeout, self.inline_bytes = answer_timeout, inline_bytes
        self.comm = comm_device(plan.torch_device(0))
        self.has_kv = any(plan.node(n)["engine"] == "kv" for n in plan.resident_nodes(rank))
        self.lost: str | None = None
        self.nodes: list[str] = []
        self._closed = False
        self._lock = threading.Lock()  # one conversation at a time (a watchdog may heartbeat)
        self._inflight: StepHandle | None = None  # the step sent and not yet answered (one at most)
        # acknowledgement-only steps (TP members) sent and not yet answered, oldest first; never
        # together with `_inflight` (a full step first takes them, an ack-only step settles it)
        self._acks: collections.deque[StepHandle] = collections.deque()
        self._held: list[bytes] = []  # messages posted while a step is in flight, sent after it
        self._step_ids = iter(range(1, 1 << 62))
        self._seq = 0
        self._kept_any = False  # a replicated step ran: the worker keeps per-request outputs
        self._cohort_ids, self._cohort_names = {}, {}
        # send the values of `refs` inputs too, for the worker to compare with its own (tests)
        self.check_refs = False

    # ------------------------------------------------------------------ start-up
    def wait_ready(self, timeout: float = START_TIMEOUT_S, digest: str | None = None) -> None:
        """Wait for the worker's `WorkerReady` (after the group is up); WorkerLost if it fails."""
        msg = self._read(timeout, "starting")
        if isinstance(msg, m.WorkerError):
            self._lose("failed to start", msg.message)
        if not isinstance(msg, m.WorkerReady) or msg.rank != self.rank:
            self._lose(f"sent {getattr(msg, 'type', msg)!r} instead of worker_ready")
        if digest is not None and msg.plan_digest != digest:
            self._lose(
                f"loaded a different plan from {self.plan.path} (the file changed since this process "
                "loaded it)"
            )
        self.nodes = list(msg.nodes)

    # ------------------------------------------------------------------ WorkerLike
    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]:
        """One step, waiting for its outputs: `submit(batch).result()`."""
        return self.submit(batch).result()

    def submit(
        self,
        batch: StepBatch,
        *,
        refs: Sequence[Mapping[str, str]] | None = None,
        replicated: bool = False,
        send_outputs: bool = True,
    ) -> StepHandle:
        """Send one step (its frame, then its input tensors) and return without waiting for
        the answer. A step still in flight is finished first (its handle keeps the answer).
        Raises at once what is known before the worker runs anything: `WorkerStepError` for
        a batch that cannot travel, `WorkerLost`.

        For a tensor-parallel step (`runtime/mstar_runtime/worker/tp_dispatch.py`): `refs[i]` maps inputs of entry
        i to outputs the worker kept from that request's last `replicated` step (those values
        do not travel, unless `check_refs` is set: then the worker compares them);
        `send_outputs=False` makes the answer an acknowledgement without outputs, sent
        without waiting for the worker's device (the handle's result is one empty dict per
        entry)."""
        with self._lock:
            self._settle()
            if send_outputs:
                self._take_acks()
            return self._send_step(batch, refs, replicated, send_outputs)

    def _send_step(
        self, batch: StepBatch, refs: Sequence[Mapping[str, str]] | None, replicated: bool, send_outputs: bool
    ) -> StepHandle:
        """`submit`'s work once the worker is ready for it. Lock held."""
        self._check_alive()
        step_id = next(self._step_ids)
        try:
            wire, tensors = [], []
            for i, e in enumerate(batch.entries):
                entry_refs = dict(refs[i]) if refs is not None else {}
                values = e.inputs
                if entry_refs and not self.check_refs:  # a referenced input stays on the worker
                    values = {k: v for k, v in values.items() if k not in entry_refs}
                metas, inline, scalars, ts = pack_values(values, self.inline_bytes, "input")
                wire.append(m.StepEntry(e.request_id, e.tag, metas, inline, scalars, e.kv, entry_refs))
                tensors += ts
            request = m.StepRequest(step_id, batch.node, batch.phase, wire, replicated, send_outputs)
            data = m.encode(request)
        except (TypeError, ValueError) as e:  # MessageError is a ValueError
            # Nothing was sent: the worker is fine, this batch cannot travel.
            raise WorkerStepError(batch.node, batch.phase, f"cannot send to rank {self.rank}: {e}") from e
        self._kept_any = self._kept_any or replicated
        self._send_bytes(data)
        try:
            send_tensors(tensors, self.rank, self.comm)
        except RuntimeError as e:
            self._lose(f"did not take the inputs of {batch.node}.{batch.phase} over torch.distributed ({_first_line(e)})")
        return self._register(batch, step_id, send_outputs)

    def _check_alive(self) -> None:
        """WorkerLost for this worker, or any of its peers, found gone. Lock held."""
        if self.lost is not None:
            raise WorkerLost(self.rank, self.lost)
        if self.peers is not None:
            self.peers.check()

    def _register(self, batch: StepBatch, step_id: int, send_outputs: bool, cohort: int | None = None) -> StepHandle:
        """The handle of a step just sent: in flight, or one more acknowledgement due. Lock held."""
        handle = StepHandle(self, batch, step_id, time.monotonic() + self.answer_timeout, send_outputs, cohort)
        if send_outputs:
            self._inflight = handle
        else:
            self._acks.append(handle)
        return handle

    def _ask(self, msg: m.CohortOpen | m.CohortJoin | m.ChainOpen, node: str, what: str,
             tensors: Sequence[Any]) -> m.CohortReply:
        """Send a cohort message that is answered at once (its values' buffer after it) and wait
        for its `CohortReply`; a step in flight is finished first. Raises `RequestError` (the
        node refused a row), `WorkerStepError` (the worker failed the call; it serves on),
        `WorkerLost`."""
        with self._lock:
            self._check_alive()
            self._settle()
            self._take_acks()
            step_id = next(self._step_ids)
            self._send_bytes(m.encode(dataclasses.replace(msg, step_id=step_id)))
            try:
                send_tensors(tensors, self.rank, self.comm)
            except RuntimeError as e:
                self._lose(f"did not take the inputs of {node} {what} over torch.distributed ({_first_line(e)})")
            doing = f"running {node} {what}"
            while True:
                reply = self._read(self.answer_timeout, doing)
                if not isinstance(reply, m.Heartbeat):  # a late echo of a heartbeat that timed out
                    break
            if isinstance(reply, m.WorkerError) and reply.step_id is None:
                self._lose("failed", reply.message)
            if getattr(reply, "step_id", None) != step_id:
                self._lose(f"answered step {getattr(reply, 'step_id', None)} with '{reply.type}' while {doing}")
            if isinstance(reply, m.StepRejected):
                err = RequestError(reply.message, reply.field)
                err.request_ids = list(reply.request_ids)  # type: ignore[attr-defined]
                raise err
            if isinstance(reply, m.WorkerError):
                text = _strip_head(reply.message, StepBatch(node, what, []))
                raise WorkerStepError(node, what, f"on rank {self.rank}: {text}")
            if not isinstance(reply, m.CohortReply):
                self._lose(f"sent '{reply.type}' while {doing}")
            return reply

    def _settle(self) -> None:
        """Finish the step in flight, if any, waiting for its answer. Lock held."""
        if self._inflight is not None:
            self._receive(self._inflight)

    def _take_acks(self, until: StepHandle | None = None) -> None:
        """Read the acknowledgements in flight, oldest first, waiting for them: all of them, or
        up to `until`'s. Lock held."""
        while self._acks and (until is None or not until.done):
            self._receive(self._acks[0])

    def _arrived(self, handle: StepHandle) -> bool:
        """Whether reading `handle`'s answer would not wait for the worker to compute."""
        return (
            self.lost is not None
            or self._out.poll()
            or time.monotonic() > handle.deadline
            or not self._running()
        )

    def _poll(self, handle: StepHandle) -> None:
        """Take `handle`'s answer if it has arrived (or its deadline passed, or the process
        ended); never waits for the worker to compute. An acknowledgement comes after those of
        the steps sent before it: those that have arrived are taken on the way."""
        if not self._lock.acquire(blocking=False):
            return  # another thread talks to the worker; it finishes this step first
        try:
            if handle is self._inflight:
                if self._arrived(handle):
                    self._receive(handle)
                return
            while not handle.done and self._acks and self._arrived(self._acks[0]):
                self._receive(self._acks[0])
        finally:
            self._lock.release()

    def _wait(self, handle: StepHandle) -> None:
        with self._lock:
            if handle is self._inflight:
                self._receive(handle)
            else:
                self._take_acks(until=handle)

    def _receive(self, handle: StepHandle) -> None:
        """Read the answer of the oldest step in flight (`handle`) and receive its outputs; the
        handle keeps them, or the error (`RequestError`, `WorkerStepError`, `WorkerLost`).
        Then send what was held back while a full step ran. Lock held."""
        try:
            handle._outputs = self._answer(handle)
        except Exception as e:  # raised by handle.result(), in the caller's context
            handle._error = e
        finally:
            handle._done = True
            if handle is self._inflight:
                self._inflight = None
            elif self._acks and self._acks[0] is handle:
                self._acks.popleft()
            if handle._outputs is None and handle._error is None:  # interrupted (KeyboardInterrupt)
                handle._error = WorkerStepError(handle.batch.node, handle.batch.phase, "the wait was interrupted")
        if self._inflight is not None:
            return
        held, self._held = self._held, []
        for data in held:
            if self.lost is not None:
                break
            try:
                self._send_bytes(data)
            except WorkerLost:
                break  # the next step or heartbeat reports it

    def _answer(self, handle: StepHandle) -> list[dict[str, Any]]:
        if self.lost is not None:
            raise WorkerLost(self.rank, self.lost)
        batch, step_id = handle.batch, handle.step_id
        while True:
            msg = self._read(
                max(0.0, handle.deadline - time.monotonic()),
                f"running {batch.node}.{batch.phase}",
                within=handle.within,
            )
            if isinstance(msg, m.Heartbeat):
                continue  # a late echo of a heartbeat that timed out
            if isinstance(msg, m.WorkerError) and msg.step_id is None:
                self._lose("failed", msg.message)
            if getattr(msg, "step_id", None) != step_id:
                self._lose(
                    f"answered step {getattr(msg, 'step_id', None)} with '{msg.type}' while step "
                    f"{step_id} was running"
                )
            break
        if isinstance(msg, m.StepRejected):
            err = RequestError(msg.message, msg.field)
            err.request_ids = list(msg.request_ids)  # type: ignore[attr-defined]
            raise err
        if isinstance(msg, m.WorkerError):
            raise WorkerStepError(
                batch.node, batch.phase, f"on rank {self.rank}: {_strip_head(msg.message, batch)}"
            )
        if handle.cohort is not None:
            if not isinstance(msg, m.CohortStepped):
                self._lose(f"answered cohort step {step_id} with '{msg.type}'")
            handle.elapsed_s, handle.waited_s = msg.elapsed_s, msg.waited_s
            return self._cohort_outputs(handle, msg)  # type: ignore[return-value]
        if not isinstance(msg, m.StepResult):
            self._lose(f"answered step {step_id} with '{msg.type}'")
        handle.elapsed_s, handle.waited_s = msg.elapsed_s, msg.waited_s
        if not handle.send_outputs:
            if msg.entries:
                self._lose(f"returned outputs for step {step_id}, which asked for none")
            return [{} for _ in batch.entries]
        if len(msg.entries) != len(batch.entries):
            self._lose(f"returned {len(msg.entries)} results for {len(batch.entries)} entries")
        metas = [meta for e in msg.entries for meta in e.outputs]
        try:
            received = iter(recv_tensors(metas, self.rank, self.comm, self.comm))
        except RuntimeError as e:
            self._lose(f"did not send the outputs of {batch.node}.{batch.phase} over torch.distributed "
                       f"({_first_line(e)})")
        return [
            unpack_values(e.outputs, [next(received) for _ in e.outputs], e.inline, e.scalars, self.comm)
            for e in msg.entries
        ]

    def fork(self, node: str, request_id: str, src_tag: str, dst_tag: str, copy: SlotCopy | None) -> None:
        wire = copy_to_wire(copy) if copy is not None else None
        self._post(m.ForkKV(node, request_id, src_tag, dst_tag, wire))

    def copy_slots(self, node: str, copy: SlotCopy) -> None:
        self._post(m.CopySlots(node, copy_to_wire(copy)))

    def import_kv(self, node: str, request_id: str, tag: str, pages: list[int], values: Mapping[str, Any]) -> None:
        """`Worker.import_kv` on this rank: the `ImportKV` frame, then its values' buffer. A step
        in flight is finished first (its handle keeps the answer), as for `submit`."""
        try:
            metas, inline, scalars, tensors = pack_values(values, self.inline_bytes, "KV context value")
            data = m.encode(m.ImportKV(node, request_id, tag, list(pages), metas, inline, scalars))
        except (TypeError, ValueError) as e:  # nothing was sent: the worker is fine
            raise WorkerStepError(node, "import_kv", f"cannot send to rank {self.rank}: {e}") from e
        with self._lock:
            if self.lost is not None:
                raise WorkerLost(self.rank, self.lost)
            self._settle()
            self._take_acks()
            self._send_bytes(data)
            try:
                send_tensors(tensors, self.rank, self.comm)
            except RuntimeError as e:
                self._lose(f"did not take KV context {node}@{tag} over torch.distributed ({_first_line(e)})")

    def export_kv(self, node: str, request_id: str, tag: str, pages: list[int]) -> dict[str, Any]:
        """`Worker.export_kv` on this rank, its values received here (rank 0 passes them on):
        the `ExportKV` frame, the `KVExported` answer, then its values' buffer. A step in
        flight is finished first. The worker's refusal (a state that cannot travel) is a
        `WorkerStepError`; the worker serves on."""
        doing = f"exporting KV context {node}@{tag}"
        with self._lock:
            if self.lost is not None:
                raise WorkerLost(self.rank, self.lost)
            self._settle()
            self._take_acks()
            self._send_bytes(m.encode(m.ExportKV(node, request_id, tag, list(pages))))
            msg = self._read(self.answer_timeout, doing)
            if isinstance(msg, m.WorkerError):
                text = msg.message.removeprefix(f"node '{node}' phase 'export_kv': ")  # not said twice
                raise WorkerStepError(node, "export_kv", f"rank {self.rank}: {text}")
            if not isinstance(msg, m.KVExported):
                self._lose(f"sent '{msg.type}' while {doing}")
            try:
                received = recv_tensors(msg.values, self.rank, self.comm, self.comm)
            except RuntimeError as e:
                self._lose(f"did not send KV context {node}@{tag} over torch.distributed ({_first_line(e)})")
            return unpack_values(msg.values, received, msg.inline, msg.scalars, self.comm)

    def drop_tag(self, node: str, request_id: str, tag: str) -> None:
        self._post(m.DropTag(node, request_id, tag))

    def free(self, request_id: str) -> None:
        if self.has_kv or self._kept_any:  # KV engines and replicated steps keep per-request state
            self._post(m.FreeRequest(request_id))

    def heartbeat(self, timeout: float = 10.0) -> float:
        """Round-trip seconds of a heartbeat; WorkerLost if there is no answer in time. A
        step in flight is finished first (its handle keeps the answer), within the same
        `timeout`: a hung worker is found in the heartbeat's time, not the step's, and a step
        that is still computing after `timeout` counts as no answer (a worker answers
        heartbeats only between steps)."""
        with self._lock:
            for h in (self._inflight, *self._acks):
                if h is not None and h.deadline > time.monotonic() + timeout:
                    h.deadline, h.within = time.monotonic() + timeout, timeout
            self._settle()
            self._take_acks()
            return self._heartbeat(timeout)

    def _heartbeat(self, timeout: float) -> float:
        if self.lost is not None:
            raise WorkerLost(self.rank, self.lost)
        self._seq += 1
        t0 = time.perf_counter()
        self._send_bytes(m.encode(m.Heartbeat(0, self._seq)))
        while True:
            msg = self._read(timeout, "answering a heartbeat")
            if isinstance(msg, m.Heartbeat) and msg.seq == self._seq:
                return time.perf_counter() - t0
            if isinstance(msg, m.WorkerError):
                self._lose("failed", msg.message)
            if not isinstance(msg, m.Heartbeat):
                self._lose(f"sent '{msg.type}' when only a heartbeat was due")

    def alive(self) -> bool:
        """Whether the worker serves: not lost, its process running, no answer overdue. A
        method (the server's /health calls it); cheap, and never waits for the worker."""
        if self.lost is not None or not self._running():
            return False
        h = self._inflight
        return h is None or h.done or time.monotonic() <= h.deadline

    def _abandon(self, timeout: float) -> None:
        """Take the answers of steps left in flight (their requests ended meanwhile), so the
        worker is not left blocked sending outputs nobody receives and can read its Shutdown."""
        if (self._inflight is None and not self._acks) or self.lost is not None or not self._running():
            return
        if self._lock.acquire(timeout=timeout):
            try:
                for h in (self._inflight, *self._acks):
                    if h is not None:
                        h.deadline = min(h.deadline, time.monotonic() + timeout)
                self._settle()
                self._take_acks()
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ plumbing
    def _post(self, msg: m.Message) -> None:
        """A message without an answer. On a lost worker it does nothing: fork and free are
        called while the conductor fails requests, and the next step reports the loss."""
        if self.lost is not None:
            return
        try:
            with self._lock:
                if self._inflight is not None:  # after the step's answer (module docstring)
                    self._held.append(m.encode(msg))
                else:
                    self._send_bytes(m.encode(msg))
        except WorkerLost:
            pass

    def _send_bytes(self, data: bytes) -> None:
        try:
            self._in.write(FRAME.pack(len(data)) + data)
            self._in.flush()
        except (BrokenPipeError, ValueError, OSError) as e:  # ValueError: the pipe was closed here
            self._lose(f"stopped reading its {self.channel} ({type(e).__name__}: {e})")

    def _read(self, timeout: float, doing: str, within: float | None = None) -> m.Message:
        """The next frame; WorkerLost when there is none in time. `within`: the limit to name
        in that message, when `timeout` is what is left of it."""
        try:
            msg = self._out.read(timeout, self._running)
        except TimeoutError:
            self._lose(f"did not answer within {within if within is not None else timeout:.0f} s while {doing}")
        except (ProtocolError, m.MessageError) as e:
            self._lose(f"sent a bad frame while {doing}: {e}")
        if msg is None:
            broke = self._out.error
            self._lose(f"closed its {self.channel} while {doing}" + (f" ({broke})" if broke else ""))
        return msg

    def _lose(self, why: str, reported: str | None = None) -> NoReturn:
        """Record the loss (killing the process if it still runs) and raise WorkerLost.

        `reported`: the text of the worker's own fatal WorkerError (error, then traceback),
        which then stands in for its stderr (that holds the same traceback)."""
        if self.lost is None:
            how = self._end_process()
            if reported is not None:
                head, _, detail = reported.partition("\n")
                self.lost = f"its process ({self._where()}) {why}: {head}; it {how}" + (
                    f"\n{detail}" if detail else ""
                )
            else:
                self.lost = f"its process ({self._where()}) {why}; it {how}" + self._output_tail()
        raise WorkerLost(self.rank, self.lost)

    def _where(self) -> str:
        return f"pid {self.pid}"

def can_submit(worker: Any) -> bool:
    """Whether the worker sends steps without waiting (`RemoteWorker.submit`). Looked up on
    the class, so a proxy that overrides only `run_step` (and forwards the rest) keeps the
    synchronous path it means to intercept."""
    return callable(getattr(type(worker), "submit", None))


class StepHandle:
    """A step sent by `RemoteWorker.submit`: its answer, once taken (module docstring)."""

    def __init__(self, worker: RemoteWorker, batch: StepBatch, step_id: int, deadline: float, send_outputs: bool = True,
                 cohort: int | None = None):
        self.worker, self.batch, self.step_id = worker, batch, step_id
        self.send_outputs = send_outputs
        self.cohort = cohort  # a cohort step's rows (its result is a CohortResult), or None
        self.elapsed_s = 0.0  # the worker's own time for the step, from its answer
        self.waited_s = 0.0  # and its time reading messages before it (StepResult.waited_s)
        self.deadline = deadline  # time.monotonic() by which the answer is due
        self.within = worker.answer_timeout  # the limit the deadline stands for, for the message
        self._done = False
        self._outputs: list[dict[str, Any]] | None = None
        self._error: Exception | None = None

    @property
    def rank(self) -> int:
        return self.worker.rank

    @property
    def done(self) -> bool:
        return self._done

    def ready(self) -> bool:
        """Whether the answer is in; takes it (receiving the outputs) if it has arrived, never
        waits for the worker to compute."""
        if not self._done:
            self.worker._poll(self)
        return self._done

    def result(self) -> list[dict[str, Any]]:
        """The step's outputs, one dict per entry, waiting for them if need be; raises what
        `run_step` raises (`RequestError`, `WorkerStepError`, `WorkerLost`)."""
        if not self._done:
            self.worker._wait(self)
        if self._error is not None:
            raise self._error
        assert self._outputs is not None
        return self._outputs


def _first_line(e: BaseException) -> str:
    """An exception's first sentence, without the source path Gloo puts first."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ", 1)[0]  # Gloo goes on with advice that does not apply


def _strip_head(message: str, batch: StepBatch) -> str:
    """A WorkerStepError's text already says node and phase; do not say it twice."""
    return message.removeprefix(f"node '{batch.node}' phase '{batch.phase}': ")


# ------------------------------------------------------------------------ the whole set
class _Peers:
    """The worker processes of one plan: any step, on any rank, first checks that all of them
    still run, so a worker that dies ends the run at the next step, not at its own next one."""

    def __init__(self) -> None:
        self.remotes: list[RemoteWorker] = []

    def check(self, within: float = 0.0) -> None:
        """WorkerLost for the first worker that is gone; with `within`, keep looking that
        long (a dead peer's connection may close a little after the error it caused)."""
        deadline = time.monotonic() + within
        while True:
            for w in self.remotes:
                if w.lost is not None:
                    raise WorkerLost(w.rank, w.lost)
                if not w._closed and not w._running():
                    w._lose(w.died)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(worker_main())
