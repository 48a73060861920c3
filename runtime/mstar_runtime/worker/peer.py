"""Workers that torchrun started: the control connection over TCP, and the conductor's proxy.

Under `mstar_runtime.worker.launch` every rank is a process of its own host's torchrun agent,
so rank 0 has no pipes to the others: each worker rank connects to a TCP port rank 0 listens
on (found in torchrun's store) and the frames of `remote.py`'s protocol travel on that
connection instead of stdin/stdout. Tensors still travel through torch.distributed.

- `ControlListener`: rank 0's port; `accept` takes one authenticated connection per worker
  rank: the first frame must be a `Hello` with the job's token (`secrets.token_hex`, put in
  the store by rank 0) and a rank not seen yet, else the connection is closed unread.
- `connect`: a worker's side.
- `PeerWorker`: a `RemoteWorker` whose process is such a connection. It is "running" while
  the connection is open (looked at without reading a frame: `select` and a 1-byte
  `MSG_PEEK`); `close` sends `Shutdown` and waits a little for the worker to hang up. It
  cannot kill a process on another host: a lost peer is disconnected, and a worker exits
  when its connection ends (`mstar_runtime.worker.launch`).
- `tune`: both sides set TCP_NODELAY (frames are small and latency-bound), keepalive probes
  and TCP_USER_TIMEOUT scaled to the launch's peer timeout, and a send timeout, so a host
  that vanished without closing its sockets is noticed within that bound even while idle.
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import struct
import time
from collections.abc import Callable, Iterable

from mstar_runtime.plan.loader import Plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.process import ANSWER_TIMEOUT_S
from mstar_runtime.worker.remote import RemoteWorker, WorkerLost, _Peers
from mstar_runtime.worker.remote_process import _LIVE, CLOSE_TIMEOUT_S, _frame
from mstar_runtime.worker.wire import INLINE_BYTES, FrameReader, ProtocolError

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # how long a new connection may take to say who it is


def tune(sock: socket.socket, timeout: float) -> None:
    """Socket options of a control connection (see the module docstring); `timeout`: the
    launch's peer timeout, in seconds."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(timeout / 3))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, int(timeout / 6))), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(timeout * 1000))):
        opt = getattr(socket, name, None)
        if opt is not None:  # Linux; elsewhere the step deadlines still bound a lost peer
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    seconds = int(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", seconds, int((timeout - seconds) * 1e6)))


class SocketWriter:
    """The write side of a control connection, as `remote.py` and `process.py` use a pipe."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def write(self, data: bytes) -> int:
        self.sock.sendall(data)  # OSError (a timeout, a reset): the caller loses the peer
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class ControlListener:
    """Rank 0's control port (see the module docstring)."""

    def __init__(self, token: str, timeout: float, bind: str = ""):
        self.token, self.timeout = token, timeout
        self.sock = socket.create_server((bind, 0), backlog=64)
        self.port = int(self.sock.getsockname()[1])

    def accept(self, ranks: Iterable[int], within: float,
               failed: Callable[[int], str | None] = lambda rank: None
               ) -> dict[int, tuple[socket.socket, FrameReader, m.Hello]]:
        """One connection per rank of `ranks`, each authenticated by its `Hello`. WorkerLost
        for a rank that `failed` says failed before connecting (polled while waiting), or
        that did not connect within `within` seconds."""
        want = set(ranks)
        out: dict[int, tuple[socket.socket, FrameReader, m.Hello]] = {}
        deadline = time.monotonic() + within
        try:
            while len(out) < len(want):
                left = deadline - time.monotonic()
                missing = sorted(want - set(out))
                for r in missing:
                    why = failed(r)
                    if why is not None:
                        raise WorkerLost(r, f"failed before it connected to rank 0: {why}")
                if left <= 0:
                    raise WorkerLost(missing[0], f"rank(s) {', '.join(map(str, missing))} did not connect to "
                                     f"rank 0 within {within:.0f} s")
                ready, _, _ = select.select([self.sock], [], [], min(left, 0.25))
                if not ready:
                    continue
                conn, addr = self.sock.accept()
                got = self._hello(conn, addr, want - set(out))
                if got is not None:
                    out[got[2].rank] = got
        except BaseException:
            for conn, _, _ in out.values():
                conn.close()
            raise
        return out

    def _hello(self, conn: socket.socket, addr: object, want: set[int]
               ) -> tuple[socket.socket, FrameReader, m.Hello] | None:
        tune(conn, self.timeout)
        reader = FrameReader(conn.fileno())
        try:
            msg = reader.read(HELLO_TIMEOUT_S, lambda: True)
        except (TimeoutError, ProtocolError, m.MessageError, OSError) as e:
            log.warning("refused a control connection from %s: %s", addr, e or type(e).__name__)
            conn.close()
            return None
        if not isinstance(msg, m.Hello) or not hmac.compare_digest(msg.token, self.token) or msg.rank not in want:
            what = getattr(msg, "type", "nothing")
            log.warning("refused a control connection from %s: %s", addr,
                        f"rank {msg.rank} is not expected (or came twice)" if isinstance(msg, m.Hello)
                        and hmac.compare_digest(msg.token, self.token) else f"no valid hello ({what})")
            conn.close()
            return None
        return conn, reader, msg

    def close(self) -> None:
        self.sock.close()


def connect(address: str, timeout: float, within: float) -> socket.socket:
    """A worker's control connection to rank 0's `host:port`, retried for `within` seconds."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + within
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=min(10.0, within))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    sock.settimeout(None)  # blocking: reads wait for rank 0; SO_SNDTIMEO bounds the writes
    tune(sock, timeout)
    return sock


class PeerWorker(RemoteWorker):
    """The conductor's proxy of a worker rank that torchrun started (module docstring)."""

    died = "closed its control connection"
    channel = "control connection"

    def __init__(
        self,
        plan: Plan,
        sock: socket.socket,
        reader: FrameReader,
        hello: m.Hello,
        *,
        answer_timeout: float = ANSWER_TIMEOUT_S,
        inline_bytes: int = INLINE_BYTES,
        peers: _Peers | None = None,
    ):
        self._setup(plan, hello.rank, answer_timeout, inline_bytes, peers)
        self.sock, self._out, self._in = sock, reader, SocketWriter(sock)
        self.pid, self.host, self.node = hello.pid, hello.host, hello.node
        self.ready = False  # it answered WorkerReady: it serves frames (and reads a Shutdown)
        self._gone = False
        _LIVE.add(self)

    def _where(self) -> str:
        return f"pid {self.pid} on host {self.node}, {self.host}"

    def _running(self) -> bool:
        if self._gone or self._out.eof:
            self._gone = True
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable and self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                self._gone = True
        except BlockingIOError:
            pass
        except (OSError, ValueError):  # reset, timed out by keepalive, or closed here
            self._gone = True
        return not self._gone

    def _end_process(self) -> str:
        deadline = time.monotonic() + 0.5  # a dying process's connection may end right now: let it say so
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._running():
            self._disconnect()
            return ("was disconnected here, as its connection was still open (a worker exits when its "
                    "connection ends)")
        return "is gone (its process ended, or its host went away)"

    def _output_tail(self) -> str:
        return f"; its output is in the log of torchrun on host {self.node} ({self.host})"

    def _disconnect(self) -> None:
        self._gone = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def probe(self, timeout: float) -> bool:
        """A heartbeat when the worker is idle and no other thread talks to it (a step in
        flight has its own deadline); False once it is lost. Never waits for the lock."""
        if not self._lock.acquire(blocking=False):
            return self.lost is None
        try:
            if self.lost is None and not self._closed and self._inflight is None and not self._acks:
                self._heartbeat(timeout)
        except WorkerLost:
            pass
        finally:
            self._lock.release()
        return self.lost is None

    def lose_if_gone(self) -> bool:
        """Record the loss of a worker whose connection closed (taking its lock, if free:
        otherwise the thread holding it finds out); whether it is lost."""
        if self.lost is None and not self._closed and not self._running() and self._lock.acquire(blocking=False):
            try:
                if self.lost is None:
                    self._lose(self.died)
            except WorkerLost:
                pass
            finally:
                self._lock.release()
        return self.lost is not None or not self._running()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ask the worker to exit, wait up to `timeout` for it to hang up, then close the
        connection. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        self._abandon(timeout)
        if self._running() and self.ready:  # one still starting reads no frame: the end of its connection stops it
            try:
                self._in.write(_frame(m.Shutdown("closed by the conductor")))
            except OSError:
                pass
            # what it still sends is dropped (nothing waits for it any more) until it hangs up
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    readable, _, _ = select.select([self.sock], [], [], min(left, 0.1))
                    if readable and not self.sock.recv(1 << 16):
                        break
                except (OSError, ValueError):
                    break
        self._gone = True
        self.sock.close()
