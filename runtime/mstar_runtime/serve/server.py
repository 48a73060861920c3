"""`mstar-run PLAN --serve`: an OpenAI-compatible HTTP server over a loaded plan (FastAPI, uvicorn).

    app = create_app(MStar.load("tf.plan"), ServeConfig())      # or: mstar-run tf.plan --serve

Routes depend on the plan's walks (`ServedWalks`): `/v1/audio/speech` for a walk `tts`,
`/v1/chat/completions` for `chat` and/or `understand` (requests with an image go to
`understand` when `chat` takes none), `/v1/images/generations` and `/edits` for `t2i` / `edit`,
`/v1/walks/<walk>` for every walk; always `/v1/models`, `/health`, `/metrics` and
`/openapi.json`. docs/serving.md lists them with their errors and metrics. With
`ServeConfig.api_key` every route but `/health` wants `Authorization: Bearer <key>`;
`access_log` writes a line per request (`serve.app`). `mstar_runtime.cli.run_server` loads
a plan and serves it as `mstar-run PLAN --serve` does.

Threads. The engine runs on its own thread (`MStar`); the server is one asyncio loop, on
the main thread, because a multi-rank plan's worker processes die with the thread that
started them (`remote.start_workers`), and signals are only delivered there. Handlers
never block: they wait on `RequestHandle.astream/aresult`, which the engine wakes.
With `--engine-process` the engine runs in a child process and `engine_process.EngineClient`
stands in for `MStar` (its handles for `RequestHandle`).

Lifecycle (`ServerState`):
- admission: a generation request is refused with 503 while draining, when the engine or a
  worker is dead, or when `max_pending` requests are already in flight;
- SIGTERM / SIGINT: admission stops (503, `/health` says "draining"), in-flight requests get
  up to `shutdown_timeout` seconds to finish, then the engine is closed, which ends the rest
  with finish reason "shutdown" (their clients get that reason, not a dropped connection),
  and uvicorn exits. A second signal exits at once;
- a client that disconnects cancels its request (`server_common.Flight`), freeing its pages;
- a dead engine thread or worker process turns `/health` to 503; its in-flight requests
  fail (503), new ones are refused, all with one stable message (`ENGINE_STOPPED`,
  `WORKER_LOST`); the details (pids, exit signals, stderr, transport errors) are logged once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from types import FrameType
from typing import TYPE_CHECKING, Any

from mstar_runtime.api import MStar
from mstar_runtime.plan.loader import Plan
from mstar_runtime.serve.chat_template import ChatTemplateError
from mstar_runtime.serve.common import (
    ENGINE_STOPPED,
    SERVER,
    WORKER_LOST,
    ApiError,
    api_key_digest,
    engine_unavailable,
)
from mstar_runtime.serve.io import sample_rate
from mstar_runtime.serve.metrics import Metrics
from mstar_runtime.serve.schemas import input_adapters
from mstar_runtime.serve.text import TextCodec

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.common import Flight

log = logging.getLogger("mstar_runtime.serve.server")
MAX_BODY_BYTES = 64 << 20  # a base64 image edit fits; a runaway upload does not
SERVE_EXTRA = "pip install 'mstar[serve]'"


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = 30.0
    model_name: str | None = None  # default: the plan's model name
    max_pending: int = 4096  # generation requests in flight before 503 "overloaded"
    weights: str | PathLike[str] = "dummy"  # for the chat walk's private tokenizer copy
    max_body_bytes: int = MAX_BODY_BYTES
    # every route but /health then wants `Authorization: Bearer <key>`; kept out of repr (logs)
    api_key: str | None = field(default=None, repr=False)
    access_log: bool = True  # one line per HTTP request (logger `mstar_runtime.serve.access`)


# ----------------------------------------------------------------------------- walks
@dataclass(frozen=True)
class WalkRole:
    """How an OpenAI route uses a walk: its text input and the output it reads."""

    walk: str
    text_input: str
    output: str
    inputs: Mapping[str, Mapping[str, Any]]  # name -> declared input


@dataclass(frozen=True)
class ServedWalks:
    tts: WalkRole | None = None
    chat: WalkRole | None = None
    understand: WalkRole | None = None  # chat requests with an image, when `chat` takes none
    t2i: WalkRole | None = None
    edit: WalkRole | None = None
    all: tuple[str, ...] = field(default_factory=tuple)


def _role(plan: Plan, walk: str, texts: tuple[str, ...], pick: Callable[[Mapping[str, Any]], bool]) -> WalkRole | None:
    program = plan.walks.get(walk)
    if program is None:
        return None
    inputs = {p["name"]: p for p in program["inputs"]}
    text = next((t for t in texts if t in inputs and inputs[t]["type"]["kind"] == "str"), None)
    out = next((o["name"] for o in program["outputs"] if pick(o)), None)
    return WalkRole(walk, text, out, inputs) if text and out else None


def _is_audio(o: Mapping[str, Any]) -> bool:
    t = o["type"]
    return o["name"] == "audio" and t["kind"] == "tensor" and t.get("dtype") in ("f32", "f16", "bf16")


def _is_text_stream(o: Mapping[str, Any]) -> bool:
    t = o["type"]
    return o["mode"] == "append" and (t["kind"] == "str" or (t["kind"] == "tensor" and t.get("dtype") in ("i32", "i64")))


def _is_image(o: Mapping[str, Any]) -> bool:
    return o["type"]["kind"] == "image" or o["name"] in ("image", "images", "pixels")


def _takes_image(role: WalkRole | None) -> bool:
    """An `image` input, or a uint8 [H, W, 3] tensor (Qwen3-Omni's), as `chat.image_input` reads it."""
    for p in (role.inputs.values() if role is not None else ()):
        t = p["type"]
        if t["kind"] == "image" or (t["kind"] == "tensor" and t.get("dtype") == "u8" and len(t.get("dims", [])) == 3
                                    and t["dims"][2] == 3):
            return True
    return False


def served_walks(plan: Plan) -> ServedWalks:
    """Which OpenAI routes this plan serves, by walk name and typed inputs/outputs."""
    edit = _role(plan, "edit", ("prompt", "text"), _is_image)
    if edit is not None and not any(p["type"]["kind"] == "image" for p in edit.inputs.values()):
        edit = None
    understand = _role(plan, "understand", ("question", "prompt", "text"), _is_text_stream)
    return ServedWalks(
        tts=_role(plan, "tts", ("text",), _is_audio),
        chat=_role(plan, "chat", ("prompt", "text"), _is_text_stream),
        understand=understand if _takes_image(understand) else None,
        t2i=_role(plan, "t2i", ("prompt", "text"), _is_image),
        edit=edit,
        all=tuple(sorted(plan.walks)),
    )


def loop_limits(program: Mapping[str, Any]) -> dict[str, int]:
    """Walk inputs that are the count of a fixed loop, with the loop's max: the interpreter
    fails a count outside [0, max] as a walk error (no field), so the server checks first
    and answers a 400 naming the input and its limit."""
    names = {p["name"] for p in program["inputs"]}
    limits: dict[str, int] = {}
    stack: list[Any] = [program.get("program")]
    while stack:
        op = stack.pop()
        if isinstance(op, list):
            stack.extend(op)
        elif isinstance(op, Mapping):
            count = op.get("count") if op.get("op") == "loop" else None
            if isinstance(count, Mapping) and count.get("var") in names and isinstance(op.get("max"), int):
                limits[count["var"]] = min(op["max"], limits.get(count["var"], op["max"]))
            stack.extend(v for k, v in op.items() if k in ("body", "branches"))
    return limits


# ----------------------------------------------------------------------------- state
class ServerState:
    """The engine, what the plan serves, admission, the drain, metrics."""

    def __init__(self, m: MStar, config: ServeConfig):
        self.m, self.config = m, config
        self.plan = m.plan
        self.model_id = config.model_name or m.plan.model_name
        self.created = int(time.time())
        self.walks = served_walks(m.plan)
        self.metrics = Metrics(self.model_id, self.sample_rate, snapshot=self.snapshot)
        self.api_key_digest = api_key_digest(config.api_key) if config.api_key else None
        self.loop_limits = {w: loop_limits(m.plan.walk(w)) for w in m.plan.walks}
        self.input_types = {w: input_adapters(m.plan.walk(w)) for w in m.plan.walks}  # one rule for every route
        self.flights: set[Flight] = set()
        self.draining = False
        self._idle = asyncio.Event()
        self._logged_faults: set[str] = set()
        # prompt counts and token rendering of each walk the chat route serves
        self.codecs = {r.walk: TextCodec(m.plan, r.walk, r.text_input, config.weights)
                       for r in (self.walks.chat, self.walks.understand) if r is not None}
        self.text = self.codecs.get(self.walks.chat.walk) if self.walks.chat is not None else None

    @property
    def sample_rate(self) -> int:
        return sample_rate(self.plan.config)

    def engine_problem(self) -> str | None:
        """Why the engine cannot serve, in the stable words clients get (`ENGINE_STOPPED`,
        `WORKER_LOST`), or None. The details (a worker's pid, exit signal and stderr, the
        transport's errors with their source paths and peer addresses) are for the server
        log only: logged once, when first seen."""
        fault = self._engine_fault()
        if fault is None:
            return None
        public, detail = fault
        self.log_fault(detail, f"the engine stopped serving: {detail}")
        return public

    def log_fault(self, detail: str, line: str) -> None:
        """Log `line` (an error) unless `detail` was logged already: each fault once."""
        if detail not in self._logged_faults:
            self._logged_faults.add(detail)
            log.error("%s", line)

    def _engine_fault(self) -> tuple[str, str] | None:
        """(stable message, details) of a dead engine or worker. Reads MStar's private `_dead`,
        `_closing` and `_thread`: the API has no public health property (see docs/serving.md).
        An engine in its own process (`engine_process.EngineClient`) answers for itself."""
        own = getattr(self.m, "engine_fault", None)
        if callable(own):
            return own()  # type: ignore[no-any-return]
        dead = getattr(self.m, "_dead", None)
        if dead:
            return ENGINE_STOPPED, str(dead)
        if getattr(self.m, "_closing", False):  # closed on purpose (the shutdown abort): no fault
            return None
        thread = getattr(self.m, "_thread", None)
        if thread is not None and not thread.is_alive():
            return ENGINE_STOPPED, "the engine thread has stopped"
        broken = self.m.conductor.broken
        if broken:
            return WORKER_LOST, str(broken)
        for rank, worker in self.m.conductor.workers.items():
            alive = getattr(worker, "alive", None)
            if callable(alive) and not alive():
                return WORKER_LOST, f"the worker process of rank {rank} is not running"
        return None

    def admit(self, walk: str) -> None:
        """Raise the 503 that refuses a new generation request, if any."""
        problem = None
        if self.draining:
            problem = ApiError(503, "the server is shutting down and admits no new requests", type=SERVER,
                               code="shutting_down", headers={"Retry-After": "5"})
        elif (dead := self.engine_problem()) is not None:
            problem = engine_unavailable(f"the engine is not serving: {dead}")
        elif len(self.flights) >= self.config.max_pending:
            problem = ApiError(503, f"the server has {len(self.flights)} requests in flight (max_pending "
                               f"{self.config.max_pending}); retry later", type=SERVER, code="overloaded",
                               headers={"Retry-After": "1"})
        if problem is not None:
            self.metrics.rejected(walk)
            raise problem

    def flight_ended(self) -> None:
        if not self.flights:
            self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Stop admission, wait up to `timeout` s for in-flight requests; the number left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.flights and (left := deadline - time.monotonic()) > 0:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, 0.5))
            except TimeoutError:
                pass
        return len(self.flights)

    def snapshot(self) -> tuple[Mapping[str, Any], dict[str, float]]:
        """The engine's stats and the server's gauges of this moment (for a scrape)."""
        stats = self.m.stats()
        return stats, self.server_gauges(stats)

    def server_gauges(self, stats: Mapping[str, Any]) -> dict[str, float]:
        return {
            "mstar_requests_active": float(stats.get("requests", {}).get("active", 0)),
            "mstar_server_inflight": float(len(self.flights)),
            "mstar_server_draining": 1.0 if self.draining else 0.0,
            "mstar_engine_healthy": 0.0 if self.engine_problem() else 1.0,
        }


# ----------------------------------------------------------------------------- app
def missing_extra() -> str | None:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "pydantic", "prometheus_client") if importlib.util.find_spec(m) is None]
    return f"--serve needs {', '.join(missing)}: {SERVE_EXTRA}" if missing else None


def create_app(m: MStar, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app serving `m`; routes follow its plan's walks."""
    from fastapi import FastAPI

    from mstar_runtime.serve import app as server_app
    from mstar_runtime.serve import chat as server_chat
    from mstar_runtime.serve import images as server_images
    from mstar_runtime.serve import media as server_media
    from mstar_runtime.serve import transcriptions as server_transcriptions
    from mstar_runtime.serve import walks as server_walks

    state = ServerState(m, config or ServeConfig())
    app = FastAPI(title=f"M* serving {state.model_id}", version="1",
                  description="OpenAI-compatible and native routes over a compiled M* plan (docs/serving.md).")
    app.state.mstar = state
    server_app.install(app, state)
    if state.walks.chat is not None or state.walks.understand is not None:
        server_chat.install(app, state)
    server_media.install(app, state)
    server_images.install(app, state)
    server_transcriptions.install(app, state)
    server_walks.install(app, state)
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
    except (ListenError, ChatTemplateError) as e:  # a checkpoint's chat template that does not compile, too
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
        print(f"mstar-run: {name}: draining {len(self.state.flights)} request(s), up to {timeout:g} s",
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


__all__ = ["ListenError", "ServeConfig", "ServedWalks", "ServerState", "create_app", "listen", "loop_limits",
           "missing_extra", "serve", "served_walks"]
