"""`mstar-run PLAN --serve`: an OpenAI-compatible HTTP server over a loaded plan (FastAPI, uvicorn).

    app = create_app(MStar.load("tf.plan"), ServeConfig())      # or: mstar-run tf.plan --serve

Routes follow what the plan's walks declare (`serves ...`, docs/walk-language.md "Routes";
`ServedWalks`, checked at load: a walk that does not fit a route it declares is a
`RouteMisfit` naming both): `/v1/audio/speech`, `/v1/chat/completions` (a text walk, one
that takes an image, one with spoken replies), `/v1/images/generations` and `/edits`,
`/v1/audio/transcriptions` and `/translations`, each for the walk that declares it;
`/v1/walks/<walk>` for every walk; always `/v1/models`, `/health`, `/metrics` and
`/openapi.json`. docs/serving.md lists them with their errors and metrics. With
`ServeConfig.api_key` every route but `/health` wants `Authorization: Bearer <key>`;
`access_log` writes a line per request (`serve.app`). `mstar_runtime.cli.run_server` loads
a plan and serves it as `mstar-run PLAN --serve` does.

Threads. The engine runs on its own thread (`MStar`); the server is one asyncio loop, on
the main thread, because a multi-rank plan's worker processes die with the thread that
started them (`startup.start_workers`), and signals are only delivered there. Handlers
never block: they wait on `RequestHandle.astream/aresult`, which the engine wakes.
With `--engine-process` the engine runs in a child process and `engine_process.EngineClient`
stands in for `MStar` (its handles for `RequestHandle`).

Lifecycle (`ServerState`, in `serve.state`, which the route modules import; this module
imports them, so neither imports the other back):
- admission: a generation request is refused with 503 while draining, when the engine or a
  worker is dead, or when `max_pending` requests are already in flight;
- SIGTERM / SIGINT: admission stops (503, `/health` says "draining"), in-flight requests get
  up to `shutdown_timeout` seconds to finish, then the engine is closed, which ends the rest
  with finish reason "shutdown" (their clients get that reason, not a dropped connection),
  and uvicorn exits. A second signal exits at once;
- a client that disconnects cancels its request (`server_common.Flight`), freeing its pages;
- a dead engine thread or worker process turns `/health` to 503; its in-flight requests
  fail (503), new ones are refused, all with one stable message (`ENGINE_STOPPED`,
  `ENGINE_PROCESS_STOPPED` with `--engine-process`, `WORKER_LOST`); the details (pids, exit signals, stderr, transport errors) are logged once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from mstar_runtime.api import MStar
from mstar_runtime.plan.routes import RouteMisfit
from mstar_runtime.serve import app as server_app
from mstar_runtime.serve import chat as server_chat
from mstar_runtime.serve import images as server_images
from mstar_runtime.serve import live as server_live
from mstar_runtime.serve import media as server_media
from mstar_runtime.serve import realtime as server_realtime
from mstar_runtime.serve import transcriptions as server_transcriptions
from mstar_runtime.serve import walks as server_walks
from mstar_runtime.serve.chat_template import ChatTemplateError
from mstar_runtime.serve.state import (  # re-exported: the server's API since before serve/state.py
    MAX_BODY_BYTES,
    ServeConfig,
    ServedWalks,
    ServerState,
    WalkRole,
    loop_limits,
    served_walks,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("mstar_runtime.serve.server")
SERVE_EXTRA = "pip install 'mstar[serve]'"


# ----------------------------------------------------------------------------- app
def missing_extra() -> str | None:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "pydantic", "prometheus_client") if importlib.util.find_spec(m) is None]
    return f"--serve needs {', '.join(missing)}: {SERVE_EXTRA}" if missing else None


def create_app(m: MStar, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app serving `m`; routes follow its plan's walks."""
    from fastapi import FastAPI

    state = ServerState(m, config or ServeConfig())
    app = FastAPI(title=f"M* serving {state.model_id}", version="1",
                  description="OpenAI-compatible and native routes over a compiled M* plan (docs/serving.md).")
    app.state.mstar = state
    server_app.install(app, state)
    if state.walks.chat is not None or state.walks.understand is not None or state.walks.spoken is not None:
        server_chat.install(app, state)
    server_media.install(app, state)
    server_images.install(app, state)
    server_transcriptions.install(app, state)
    server_walks.install(app, state)
    server_live.install(app, state)
    server_realtime.install(app, state)
    server_app.finish_openapi(app, state)
    return app


# ----------------------------------------------------------------------------- running
class ListenError(Exception):
    """The address cannot be listened on (in use, not local, no permission)."""


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the plan loads: a busy port fails in a second, in one
    line, rather than after the model is up; port 0 picks a free one."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def serve(m: MStar, config: ServeConfig, sock: socket.socket | None = None) -> int:
    """Serve `m` until SIGTERM/SIGINT, drain, close it. Call on the main thread. Exit status."""
    missing = missing_extra()
    if missing is not None:
        m.close()
        print(f"mstar-run: error: {missing}", file=sys.stderr)
        return 1
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = sock or listen(config.host, config.port)
        app = create_app(m, config)
        state: ServerState = app.state.mstar
        # uvicorn's own access log stays off: ours (`app.access_line`) is written when a
        # response ends, with its size and duration, and follows --no-access-log
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=10,
                                        lifespan="off"), state)
        host, port = sock.getsockname()[:2]
        print(f"mstar-run: serving {state.model_id} ({', '.join(state.walks.all)}) on http://{host}:{port}",
              file=sys.stderr, flush=True)
        server.run(sock)
        return 1 if server.startup_failed else 0
    # a checkpoint's chat template that does not compile, a walk that does not fit its route, too
    except (ListenError, ChatTemplateError, RouteMisfit) as e:
        print(f"mstar-run: error: {e}", file=sys.stderr)
        return 1
    finally:
        m.close()
        if sock is not None:
            sock.close()


class _Server:
    """uvicorn's Server with M*'s signal handling: drain first, then exit (see the module docstring)."""

    def __init__(self, config: Any, state: ServerState):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                outer._signal(sig)

        self.state = state
        self.server = Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals = 0
        self.startup_failed = False

    def run(self, sock: socket.socket) -> None:
        asyncio.run(self._main(sock))

    async def _main(self, sock: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            await self.server.serve(sockets=[sock])
        except SystemExit:  # uvicorn's way of saying that it could not start
            self.startup_failed = True

    def _signal(self, sig: int) -> None:
        # runs in the signal handler on the main thread, between bytecodes of the loop:
        # only hand the work to the loop
        self.signals += 1
        if self.signals > 1 or self.loop is None:
            self.server.force_exit = True
            self.server.should_exit = True
            return
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._shutdown(sig)))

    async def _shutdown(self, sig: int) -> None:
        timeout = self.state.config.shutdown_timeout
        name = signal.Signals(sig).name if sig in iter(signal.Signals) else str(sig)
        print(f"mstar-run: {name}: draining {self.state.in_flight} request(s), up to {timeout:g} s",
              file=sys.stderr, flush=True)
        left = await self.state.drain(timeout)
        if left:
            print(f"mstar-run: aborting {left} request(s) still running after {timeout:g} s "
                  "(finish reason 'shutdown')", file=sys.stderr, flush=True)
            # close() ends every in-flight request with finish reason "shutdown"; it joins the
            # engine thread, so it runs off the loop, which must keep serving their replies
            await asyncio.to_thread(self.state.m.close)
            await self.state.drain(5.0)
        self.server.should_exit = True


__all__ = ["MAX_BODY_BYTES", "ListenError", "ServeConfig", "ServedWalks", "ServerState", "WalkRole", "create_app",
           "listen", "loop_limits", "missing_extra", "serve", "served_walks"]
