"""The engine in its own process: `mstar-run PLAN --serve --engine-process` (or MSTAR_ENGINE_PROCESS=1).

The API process keeps the plan (to check inputs and build its routes) and talks to a child
process that runs `MStar`, so the HTTP layer's parsing and per-chunk streaming never takes
the GIL from the step loop. `EngineClient` has the part of `MStar`'s interface the server
uses (`plan`, `submit`, `stats`, `close`, and `engine_fault` for `/health`); its handles
(`ClientHandle`) have `RequestHandle`'s (`astream`, `aresult`, `result`, `stream`, `cancel`,
`stats`, `summary`, `add_done_callback`).

The two processes share a socketpair carrying `worker.wire` frames of the typed messages in
`worker.messages` (never pickle): API -> engine `EngineSubmit`, `EngineCancel`, `EngineAck`,
`EngineStatsRequest`, `Shutdown`; engine -> API `EngineReady` (once), `EngineOutput`,
`EngineFinish`, `EngineStatsReply`. A tensor of `SHM_BYTES` or more travels through a
shared-memory block that its reader copies and unlinks; smaller ones ride inline. An appended
output crosses once: `EngineFinish` names in `streamed` each output that equals the
concatenation of its streamed `EngineOutput` items, and the API side rebuilds it from the
items it has (`finished_outputs`, the engine's own `concat`); an output that differs (a walk
reached by a transition emitted it again) or was never streamed is sent whole.

Backpressure: the engine sends at most `WINDOW` output items of a request beyond what the
API side has acknowledged (`EngineAck`); a reader that streams acknowledges what it has read,
a request nobody streams is acknowledged as it arrives. The engine process ends when the
API process sends `Shutdown` (after `MStar.close()`, which fails what is in flight with finish
reason "shutdown") or when the socket closes (the API process died: no orphan).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing import resource_tracker, shared_memory
from os import PathLike
from typing import Any

import torch

from mstar_runtime.api import SHUTDOWN, EngineClosed, MStar, RequestHandle
from mstar_runtime.control.conductor import FAILED, FINISHED, RUNNING, WAITING
from mstar_runtime.control.interpreter import concat
from mstar_runtime.control.requests import check_submit
from mstar_runtime.ops.node import RequestError
from mstar_runtime.output_stream import OutputStream, RequestFailed
from mstar_runtime.plan.loader import Plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.wire import ProtocolError, read_frame, write_encoded

log = logging.getLogger(__name__)

SHM_BYTES = 256 << 10  # a tensor this large goes through shared memory, not the socket
WINDOW = 64  # output items of one request the engine sends beyond what the API side acknowledged
ENGINE_STOPPED = "the engine process has stopped"
START_TIMEOUT_S = 600.0  # loading a real checkpoint takes minutes


class EngineStartError(Exception):
    """The engine process could not load the plan or its weights (the message says why)."""


# ------------------------------------------------------------------------------- values
def to_value(v: Any) -> m.Value:
    """A walk value on the wire: a scalar, a tensor inline, or a large tensor in shared memory."""
    if not isinstance(v, torch.Tensor):
        return m.Value(scalar=v)
    t = v.detach().cpu().contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes < SHM_BYTES:
        return m.Value(tensor=t)
    block = shared_memory.SharedMemory(create=True, size=nbytes)
    # the reader unlinks it; without this the creator's resource tracker would unlink it (and
    # warn) when this process exits, whether or not the reader got it
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        block.buf[:nbytes] = t.view(-1).view(torch.uint8).numpy().tobytes()
    finally:
        block.close()
    return m.Value(shm=m.ShmRef(block.name, m.dtype_name(t.dtype), list(t.shape)))


def from_value(v: m.Value) -> Any:
    """The value `to_value` sent; a shared-memory block is copied out and unlinked."""
    if v.tensor is not None:
        return v.tensor
    if v.shm is None:
        return v.scalar
    dtype = m.TENSOR_DTYPES.get(v.shm.dtype)
    if dtype is None:
        raise m.MessageError(f"shared tensor: dtype {v.shm.dtype!r} is not allowed")
    block = shared_memory.SharedMemory(name=v.shm.name)
    try:
        count = 1
        for d in v.shm.shape:
            count *= d
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        data = bytearray(block.buf[:nbytes])
    finally:
        block.close()
        block.unlink()
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(v.shm.shape) if nbytes else \
        torch.zeros(v.shm.shape, dtype=dtype)


def drop_value(v: m.Value) -> None:
    """Unlink the shared block of a value nobody will read (its request is gone)."""
    if v.shm is not None:
        try:
            block = shared_memory.SharedMemory(name=v.shm.name)
        except FileNotFoundError:
            return
        block.close()
        block.unlink()


# ------------------------------------------------------------------------------- engine side
class _Sender:
    """The engine process's side of the socket: one writer at a time."""

    def __init__(self, sock: socket.socket):
        self.out = sock.makefile("wb")
        self.lock = threading.Lock()
        self.broken = False

    def send(self, msg: m.Message) -> None:
        """Write one message. A message the wire cannot encode raises here, to the caller (it is
        that message's fault: the socket is fine); a broken socket only marks the sender."""
        data = m.encode(msg)
        with self.lock:
            if self.broken:
                return
            try:
                write_encoded(self.out, data)
            except OSError:  # the API process is gone; the reader sees EOF and ends the process
                self.broken = True


class _Relay:
    """Streams one request's outputs to the API process, at most `WINDOW` ahead of its acks."""

    def __init__(self, handle: RequestHandle, sender: _Sender):
        self.handle, self.sender = handle, sender
        self.cond = threading.Condition()
        self.acked = 0
        self.stopped = False
        self.thread = threading.Thread(target=self.run, name=f"relay-{handle.id}", daemon=True)

    def ack(self, consumed: int) -> None:
        with self.cond:
            self.acked = max(self.acked, consumed)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def run(self) -> None:
        h, sent = self.handle, 0
        try:
            for name, value in h.stream():
                with self.cond:
                    while not self.stopped and sent - self.acked >= WINDOW:
                        self.cond.wait()
                    if self.stopped:
                        break
                wired = to_value(value)
                try:
                    self.sender.send(m.EngineOutput(h.id, sent, name, wired))
                except Exception as e:  # noqa: BLE001 - whatever the encoder refuses: this request cannot be relayed
                    drop_value(wired)
                    self._unsendable(f"its output '{name}'", e)
                    return
                sent += 1
        except RequestFailed:
            pass
        try:
            h.result()  # stopped: the request was cancelled, and ends at the engine's next step
        except RequestFailed:
            pass
        finish = finish_message(h, h._chunks[:sent])
        try:
            self.sender.send(finish)
        except Exception as e:  # noqa: BLE001 - as above, for its final outputs
            for v in finish.outputs.values():
                drop_value(v)
            self._unsendable("its outputs", e)

    def _unsendable(self, what: str, e: Exception) -> None:
        """End the request with an error the API side can read: a value the wire cannot carry
        (a node's bug) once killed this thread, and the request then never ended there."""
        h = self.handle
        h.cancel()
        log.error("engine process: request %s: %s cannot be sent to the API process: %s: %s", h.id, what,
                  type(e).__name__, e)
        self.sender.send(m.EngineFinish(h.id, FAILED, {}, f"{what} cannot be sent to the API process "
                                        f"({type(e).__name__})", None, "error", {}, list(h.summary()["walks"])))


def finish_message(h: RequestHandle, sent: list[tuple[str, Any]] | None = None) -> m.EngineFinish:
    """A handle's outcome as `EngineFinish` (the handle has ended). `sent`: the items already
    sent as `EngineOutput`; an output equal to the concatenation of its items there is named
    in `streamed` and not sent again (a placeholder keeps its place in the outputs' order)."""
    summary = h.summary()
    outputs: dict[str, m.Value] = {}
    streamed: list[str] = []
    if summary["state"] == FINISHED:
        for k, v in h._outputs.items():
            items = [x for name, x in sent or () if name == k]
            if items and _same(concat(items), v):
                outputs[k] = m.Value(scalar=None)
                streamed.append(k)
            else:  # set, never streamed, or not what its items add up to (a transition's walk re-emitted it)
                outputs[k] = to_value(v)
    stats = {k: v for k, v in h.stats.items() if v is None or isinstance(v, bool | int | float | str)}
    return m.EngineFinish(h.id, summary["state"], outputs, summary["error"], summary["field"],
                          summary["finish_reason"], stats, list(summary["walks"]), streamed)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.device == b.device and torch.equal(a, b)
    return type(a) is type(b) and a == b


def finished_outputs(finish: m.EngineFinish, chunks: list[tuple[str, Any]]) -> dict[str, Any]:
    """The outputs of a finished request, as `RequestHandle.result()` gives them in the engine
    process: `finish.outputs`, with each output named in `finish.streamed` rebuilt from the
    `EngineOutput` items received (`chunks`) by the engine's own concatenation."""
    return {k: concat([x for name, x in chunks if name == k]) if k in finish.streamed else from_value(v)
            for k, v in finish.outputs.items()}


def _encodes(v: m.Value) -> bool:
    """Whether one value encodes on its own (to name the input an EngineSubmit failed on)."""
    try:
        m.encode(m.EngineSubmit("r", "w", {"v": v}, None))
    except Exception:  # noqa: BLE001 - any refusal of the encoder
        return False
    return True


def engine_fault(mstar: MStar) -> tuple[str, str] | None:
    """(stable message, details) when the engine cannot serve, as `ServerState` reads it in process."""
    from mstar_runtime.serve.common import ENGINE_STOPPED as STOPPED
    from mstar_runtime.serve.common import WORKER_LOST

    if mstar._dead:
        return STOPPED, str(mstar._dead)
    if mstar._closing:
        return None
    if not mstar._thread.is_alive():
        return STOPPED, "the engine thread has stopped"
    if mstar.conductor.broken:
        return WORKER_LOST, str(mstar.conductor.broken)
    for rank, worker in mstar.conductor.workers.items():
        alive = getattr(worker, "alive", None)
        if callable(alive) and not alive():
            return WORKER_LOST, f"the worker process of rank {rank} is not running"
    return None


def stats_reply(mstar: MStar, seq: int) -> m.EngineStatsReply:
    st = mstar.stats()
    requests = {k: int(v) for k, v in st.pop("requests", {}).items()}
    scalars = {k: v for k, v in st.items() if v is None or isinstance(v, bool | int | float | str)}
    fault = engine_fault(mstar)
    return m.EngineStatsReply(seq, scalars, requests, *(fault or (None, None)))


def serve_engine(mstar: MStar, sock: socket.socket) -> None:
    """Run `mstar` for the API process at the other end of `sock` until Shutdown or EOF."""
    sender = _Sender(sock)
    sender.send(m.EngineReady(os.getpid()))
    relays: dict[str, _Relay] = {}
    inp = sock.makefile("rb")
    try:
        while True:
            try:
                msg = read_frame(inp)
            except (OSError, ProtocolError, m.MessageError) as e:
                log.error("engine process: the API connection broke: %s", e)
                break
            if msg is None or isinstance(msg, m.Shutdown):
                break
            for rid in [r for r, relay in relays.items() if not relay.thread.is_alive()]:
                del relays[rid]
            if isinstance(msg, m.EngineSubmit):
                _submit(mstar, msg, sender, relays)
            elif isinstance(msg, m.EngineCancel):
                relay = relays.get(msg.request_id)
                if relay is not None:  # its unsent items are dropped: nobody will read them
                    relay.handle.cancel()
                    relay.stop()
            elif isinstance(msg, m.EngineAck):
                relay = relays.get(msg.request_id)
                if relay is not None:
                    relay.ack(msg.consumed)
            elif isinstance(msg, m.EngineStatsRequest):
                sender.send(stats_reply(mstar, msg.seq))
    finally:
        mstar.close()  # what is in flight ends with finish reason "shutdown"; relays send it
        for relay in list(relays.values()):
            relay.ack(1 << 62)  # the API side reads the rest as it comes
            relay.thread.join(timeout=10)
        with sender.lock:
            try:
                sender.out.flush()
            except OSError:
                pass
        sock.close()


def _submit(mstar: MStar, msg: m.EngineSubmit, sender: _Sender, relays: dict[str, _Relay]) -> None:
    try:
        inputs = {k: from_value(v) for k, v in msg.inputs.items()}
        handle = mstar.submit(msg.walk, inputs, request_id=msg.request_id, timeout=msg.timeout)
    except (RequestError, EngineClosed, m.MessageError, OSError) as e:
        sender.send(m.EngineFinish(msg.request_id, FAILED, {}, str(e), getattr(e, "field", None), "error",
                                   {}, []))
        return
    relay = _Relay(handle, sender)
    relays[handle.id] = relay
    relay.thread.start()


def main(argv: list[str] | None = None) -> int:
    """The engine process: `python -m mstar_runtime.engine_process --fd N --plan P --options JSON`."""
    from mstar_runtime.engine_options import EngineOptions, start_engine
    from mstar_runtime.plan.loader import load_plan

    ap = argparse.ArgumentParser(prog="mstar-engine")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--options", required=True)
    args = ap.parse_args(argv)
    # the API process drains on SIGTERM / SIGINT and then sends Shutdown: a signal to the whole
    # process group (Ctrl-C, a supervisor) must not end the engine under its in-flight requests
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=args.fd)
    options = EngineOptions(**json.loads(args.options))
    try:
        mstar = start_engine(load_plan(args.plan, device=options.device), options)
    except Exception as e:  # noqa: BLE001 - the API process prints it as its own startup error
        sender = _Sender(sock)
        sender.send(m.EngineReady(os.getpid(), f"{e}"))
        return 1
    serve_engine(mstar, sock)
    return 0


# ------------------------------------------------------------------------------- API side
class ClientHandle(OutputStream):
    """A request running in the engine process; `RequestHandle`'s interface, for the server.
    Its streams acknowledge what they read (`_read`), which lets the engine send more."""

    def __init__(self, client: EngineClient, request_id: str, walk: str):
        super().__init__()
        self.id, self.walk = request_id, walk
        self._client = client
        self._acked = 0
        self._finish: m.EngineFinish | None = None
        self._submitted_at = time.perf_counter()
        self._first_at: float | None = None

    def __repr__(self) -> str:
        return f"ClientHandle(id={self.id!r}, walk={self.walk!r}, state={self.state!r})"

    @property
    def state(self) -> str:
        f = self._finish
        if f is not None:
            return f.state
        return RUNNING if self._chunks else WAITING

    @property
    def stats(self) -> dict[str, Any]:
        f = self._finish
        if f is not None and f.stats:
            return dict(f.stats)
        first = None if self._first_at is None else self._first_at - self._submitted_at
        return {"steps": 0, "wasted_steps": 0, "preemptions": 0, "ttft_s": first, "total_s": None}

    def summary(self) -> dict[str, Any]:
        f, st = self._finish, self.stats
        return {
            "id": self.id, "walk": self.walk, "walks": list(f.walks) if f else [], "state": self.state,
            "error": f.error if f else None, "field": f.field if f else None,
            "finish_reason": f.reason if f else None,
            "timings": {"ttft_s": st.get("ttft_s"), "total_s": st.get("total_s")},
            "steps": st.get("steps", 0), "wasted_steps": st.get("wasted_steps", 0),
            "preemptions": st.get("preemptions", 0),
        }

    def _failure(self) -> RequestFailed:
        f = self._finish
        assert f is not None
        return RequestFailed(self.id, f.error or f"request {f.state}", f.field, f.reason or "error")

    def _read(self, i: int) -> None:
        """A reader has read `i` items: acknowledge in steps of a quarter window."""
        if i - self._acked >= WINDOW // 4 and not self._done:
            self._acked = i
            self._client._send(m.EngineAck(self.id, i))

    def cancel(self) -> bool:
        if self._done:
            return False
        return self._client._send(m.EngineCancel(self.id))

    # ---- the client's reader thread
    def _push(self, name: str, value: Any) -> None:
        with self._cond:
            if self._first_at is None:
                self._first_at = time.perf_counter()
            self._chunks.append((name, value))
            n, streamed = len(self._chunks), self._readers > 0
            self._cond.notify_all()
            watchers = list(self._watchers)
        for wake in watchers:
            wake()
        if not streamed and n - self._acked >= WINDOW // 4:  # nobody streams it: no reason to hold it back
            self._acked = n
            self._client._send(m.EngineAck(self.id, n))

    def _settle(self, finish: m.EngineFinish, outputs: dict[str, Any]) -> None:
        with self._cond:
            if self._done:
                return
            self._finish, self._outputs = finish, outputs
            ended = self._end()
        self._after_end(ended, log)


class EngineClient:
    """`MStar`'s interface for the server, over an engine in a child process (`start`)."""

    def __init__(self, plan: Plan, proc: subprocess.Popen[bytes], sock: socket.socket):
        self.plan = plan
        self._proc, self._sock = proc, sock
        self._out = sock.makefile("wb")
        self._inp = sock.makefile("rb")
        self._write = threading.Lock()
        self._lock = threading.Lock()
        self._live: dict[str, ClientHandle] = {}
        self._ids = itertools.count()
        self._seq = itertools.count(1)
        self._replies: dict[int, m.EngineStatsReply] = {}
        self._reply_cond = threading.Condition(self._lock)
        self._last_stats: m.EngineStatsReply = m.EngineStatsReply(0, {}, {})
        self._dead: str | None = None
        self._closing = False
        ready = self._read_ready()
        if ready.error is not None:
            self._reap()
            raise EngineStartError(ready.error)
        self.pid = ready.pid
        self._reader = threading.Thread(target=self._read_loop, name="mstar-engine-client", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, plan: Plan, plan_path: str | PathLike[str], options: Mapping[str, Any]) -> EngineClient:
        """Start the engine process for `plan_path` (`options`: `engine_options.EngineOptions`' fields) and
        wait until it has loaded; EngineStartError if it could not."""
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "mstar_runtime.engine_process", "--fd", str(theirs.fileno()),
               "--plan", os.fspath(plan_path), "--options", json.dumps(dict(options))]
        try:
            proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        return cls(plan, proc, ours)

    def _read_ready(self) -> m.EngineReady:
        self._sock.settimeout(START_TIMEOUT_S)
        try:
            msg = read_frame(self._inp)
        except (OSError, ProtocolError, m.MessageError) as e:
            msg = None
            log.error("engine process: no ready message: %s", e)
        self._sock.settimeout(None)
        if not isinstance(msg, m.EngineReady):
            self._reap()
            raise EngineStartError(f"the engine process exited before it was ready (status {self._proc.poll()})")
        return msg

    # ---- MStar's interface
    def submit(self, walk: str, inputs: Mapping[str, Any] | None = None, *, request_id: str | None = None,
               timeout: float | None = None) -> ClientHandle:
        program = self.plan.walk(walk)
        values = check_submit(walk, program, inputs or {}, streaming=False, config=self.plan.config,
                              request_id=request_id, timeout=timeout)
        with self._lock:
            if self._dead is not None:
                raise EngineClosed(self._dead)
            if self._closing:
                raise EngineClosed("this engine is closed")
            rid = request_id
            while rid is None or (request_id is None and rid in self._live):
                rid = f"req-{next(self._ids)}"
            if rid in self._live:
                raise RequestError(f"request id '{rid}' is already in use", "request_id")
            handle = ClientHandle(self, rid, walk)
            self._live[rid] = handle
        try:
            data = self._encode_submit(rid, walk, values, timeout)
        except RequestError:
            with self._lock:
                self._live.pop(rid, None)
            raise
        if not self._send_encoded(data):
            with self._lock:
                self._live.pop(rid, None)
            raise EngineClosed(self._dead or ENGINE_STOPPED)
        return handle

    def _encode_submit(self, rid: str, walk: str, values: Mapping[str, Any], timeout: float | None) -> bytes:
        """The EngineSubmit frame's bytes. A value the wire cannot carry (text that is not valid
        Unicode, which msgpack cannot write as UTF-8) is a RequestError naming its input: the
        client's fault, not a dead engine (encoding and writing used to share one except)."""
        wired = {k: to_value(v) for k, v in values.items()}
        try:
            return m.encode(m.EngineSubmit(rid, walk, wired, timeout))
        except Exception as e:  # noqa: BLE001 - whatever the encoder refuses, it is this request's value
            for v in wired.values():
                drop_value(v)
            bad = next((k for k, v in wired.items() if not _encodes(v)), None)
            where = f"input '{bad}'" if bad is not None else "its inputs"
            raise RequestError(f"walk '{walk}', {where}: the value cannot be sent to the engine process "
                               f"({type(e).__name__})", bad) from None

    def stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """The engine's `MStar.stats()`, asked for now (the last answer if it does not come)."""
        seq = next(self._seq)
        if self._dead is None and self._send(m.EngineStatsRequest(seq)):
            with self._reply_cond:
                self._reply_cond.wait_for(lambda: seq in self._replies or self._dead is not None, timeout)
                self._replies.pop(seq, None)
        r = self._last_stats
        return {**r.stats, "requests": dict(r.requests)}

    def engine_fault(self) -> tuple[str, str] | None:
        """(stable message, details) when the engine cannot serve: its process died (said as
        such, not as the in-process engine thread), or it reported a fault of its own."""
        from mstar_runtime.serve.common import ENGINE_PROCESS_STOPPED as STOPPED

        if self._dead is not None and not self._closing:
            return STOPPED, self._dead
        if self._closing:
            return None
        code = self._proc.poll()
        if code is not None:
            return STOPPED, f"the engine process (pid {self._proc.pid}) exited with status {code}"
        r = self._last_stats
        return (r.fault, r.fault_detail or r.fault) if r.fault else None

    def close(self) -> None:
        """Shut the engine down (in-flight requests end with finish reason "shutdown"), wait for it. Idempotent."""
        with self._lock:
            if self._closing:
                closing_already = True
            else:
                self._closing, closing_already = True, False
        if not closing_already:
            self._send(m.Shutdown("close"))
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.error("the engine process (pid %d) did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=10)
        self._fail_live("MStar was closed before the request finished", SHUTDOWN)

    # ---- plumbing
    def _send(self, msg: m.Message) -> bool:
        return self._send_encoded(m.encode(msg))

    def _send_encoded(self, data: bytes) -> bool:
        """Write one encoded frame; False when the engine process is gone (the reader fails
        what is live). Only the write is guarded here: an encoding error is no dead pipe."""
        with self._write:
            try:
                write_encoded(self._out, data)
                return True
            except (OSError, ValueError):  # ValueError: the socket's file was closed
                return False

    def _read_loop(self) -> None:
        why = ENGINE_STOPPED
        try:
            while True:
                msg = read_frame(self._inp)
                if msg is None:
                    break
                self._dispatch(msg)
        except (OSError, ProtocolError, m.MessageError) as e:
            why = f"{ENGINE_STOPPED}: {e}"
        code = self._proc.poll()
        if code is None:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        detail = f"{why} (pid {self._proc.pid}, exit status {code})"
        with self._reply_cond:
            if not self._closing:
                self._dead = detail
                log.error("%s", detail)
            self._reply_cond.notify_all()
        self._fail_live(detail if not self._closing else "MStar was closed before the request finished",
                        SHUTDOWN if self._closing else "error")

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.EngineOutput):
            handle = self._live.get(msg.request_id)
            if handle is None:
                drop_value(msg.value)
                return
            handle._push(msg.name, from_value(msg.value))
        elif isinstance(msg, m.EngineFinish):
            with self._lock:
                handle = self._live.pop(msg.request_id, None)
            if handle is None:
                for v in msg.outputs.values():
                    drop_value(v)
                return
            handle._settle(msg, finished_outputs(msg, handle._chunks))
        elif isinstance(msg, m.EngineStatsReply):
            with self._reply_cond:
                self._last_stats = msg
                self._replies[msg.seq] = msg
                self._reply_cond.notify_all()
        else:
            log.error("engine process: unexpected message %s", type(msg).__name__)

    def _fail_live(self, message: str, reason: str) -> None:
        with self._lock:
            handles = list(self._live.values())
            self._live.clear()
        for h in handles:
            state = FAILED if reason == "error" else "cancelled"
            h._settle(m.EngineFinish(h.id, state, {}, message, None, reason, {}, []), {})

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()


__all__ = ["ClientHandle", "EngineClient", "EngineStartError", "engine_fault", "finish_message", "finished_outputs",
           "from_value", "main", "serve_engine", "to_value"]


if __name__ == "__main__":
    sys.exit(main())
