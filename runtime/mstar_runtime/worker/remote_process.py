"""The process of a `RemoteWorker` (remote.py): started on pipes, its stderr kept, its end.

`RemoteProcess` is a mixin of `RemoteWorker`: `_spawn` starts `python -m
mstar_runtime.worker.remote` with stdin and stdout as the control pipe (frames) and stderr
drained all the time (a full pipe would block the worker) into the last `STDERR_LINES`
lines, which a `WorkerLost` quotes; `close` asks the worker to exit (after taking the answers
left in flight, `_abandon`), then closes its stdin (EOF ends it too) and kills it if it
lingers; `_end_process` says how it ended (exit code or signal). An atexit hook closes every
worker still open, so none outlives a conductor that exits normally. `PeerWorker` (peer.py),
whose worker is a torchrun process on a TCP connection, overrides these.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from mstar_runtime.worker import messages as m
from mstar_runtime.worker.wire import FRAME, FrameReader

log = logging.getLogger("mstar_runtime.worker.remote")  # the proxy's own log, as before the split

CLOSE_TIMEOUT_S = 5.0
STDERR_LINES = 20  # kept per worker for the message of a WorkerLost


def _how_it_ended(proc: subprocess.Popen[bytes]) -> str:
    code = proc.poll()
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RemoteProcess:
    """The worker's OS process (module docstring); over the `RemoteWorker` state (`plan`,
    `rank`, `answer_timeout`, `_closed`, `_abandon`)."""

    plan: Any
    rank: int
    answer_timeout: float
    _closed: bool

    def _abandon(self, timeout: float) -> None: ...

    def _spawn(
        self, init_method: str, weights: str | Path, device: str, threads: int | None, env: Mapping[str, str] | None
    ) -> None:
        """Start the worker process (`python -m mstar_runtime.worker.remote`) on pipes."""
        plan, rank, answer_timeout = self.plan, self.rank, self.answer_timeout
        cmd = [
            sys.executable,
            "-m",
            "mstar_runtime.worker.remote",
            "--plan",
            os.path.abspath(plan.path),
            "--rank",
            str(rank),
            "--world",
            str(plan.num_ranks),
            "--init-method",
            init_method,
            "--weights",
            os.fspath(weights),
            "--device",
            device,
            "--parent-pid",
            str(os.getpid()),
            "--timeout",
            str(answer_timeout),
        ]
        if plan.kv_pages_cap is not None:
            cmd += ["--kv-pages-cap", str(plan.kv_pages_cap)]
        environ = os.environ if env is None else env
        if threads is None and device == "cpu" and "OMP_NUM_THREADS" not in environ:
            # The ranks of a CPU plan share this host's cores: a process each with all of them
            # oversubscribes, and OpenMP's spinning threads then slow every step by 10-100x.
            threads = max(1, (os.cpu_count() or 1) // plan.num_ranks)
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self.pid = self.proc.pid
        self._in = self.proc.stdin
        self._out = FrameReader(self.proc.stdout.fileno())
        # Drain stderr all the time (a full pipe would block the worker); keep its tail for errors.
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._stderr_thread = threading.Thread(
            target=self._drain, args=(self.proc.stderr,), name=f"mstar-worker-{rank}-stderr", daemon=True
        )
        self._stderr_thread.start()

    def _running(self) -> bool:
        """Whether the worker's process still runs (never waits, never reads a frame)."""
        return self.proc.poll() is None

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ask the worker to exit, wait a little, then kill it. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        self._abandon(timeout)
        if self.proc.poll() is None:
            try:
                self._in.write(_frame(m.Shutdown("closed by the conductor")))
                self._in.flush()
            except OSError:
                pass
        try:
            self._in.close()  # EOF: the worker exits even if it never read the Shutdown
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr_thread.join(1.0)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

    def _drain(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr.append(line)
            log.debug("[rank %d] %s", self.rank, line)

    def _end_process(self) -> str:
        """Make sure the process is gone (killing it if it still runs); how it ended."""
        killed_here = False
        if self.proc.poll() is None:
            try:  # a crashing process may be exiting right now: let it say how
                self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                killed_here = True
        self._stderr_thread.join(1.0)
        return "was killed here, as it still ran" if killed_here else _how_it_ended(self.proc)

    def _output_tail(self) -> str:
        tail = "\n".join(f"  | {line}" for line in self._stderr)
        return f"; the last lines of its stderr:\n{tail}" if tail else "; it wrote nothing to stderr"


def _frame(msg: m.Message) -> bytes:
    data = m.encode(msg)
    return FRAME.pack(len(data)) + data


_LIVE: weakref.WeakSet[RemoteProcess] = weakref.WeakSet()  # every RemoteWorker not closed yet


@atexit.register
def _close_all() -> None:
    """No worker outlives a conductor that exits normally (a killed one: pipe EOF, pdeathsig)."""
    for w in list(_LIVE):
        w.close(timeout=1.0)
