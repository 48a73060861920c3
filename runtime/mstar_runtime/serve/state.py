"""What the server knows of its plan and its engine, shared by the server and every route
module (`ServerState`), so that the routes import it and the server imports the routes
without either importing the other back: the configuration (`ServeConfig`), which OpenAI
routes the plan's walks declare that they serve (`served_walks`, `speech_walk`), the bounds of their loop
counts (`loop_limits`), and the state: the engine, admission, the drain, metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from os import PathLike
from typing import Any

from mstar_runtime.api import MStar
from mstar_runtime.plan.loader import Plan
from mstar_runtime.plan.routes import served_routes
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

log = logging.getLogger("mstar_runtime.serve.server")
MAX_BODY_BYTES = 64 << 20  # a base64 image edit fits; a runaway upload does not


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
    """How an OpenAI route uses a walk: its text input and the output it reads, and the
    route's slots resolved to the walk's names (`plan.routes`: `{"image": "source"}`)."""

    walk: str
    text_input: str
    output: str
    inputs: Mapping[str, Mapping[str, Any]]  # name -> declared input
    slots: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SpeechWalk:
    """How a walk serves speech: its text input and audio output (`role`), the inputs that
    `voice` and `instructions` go to, the system text sent before any instructions, and the
    walk's text output (its transcript) when it has one."""

    role: WalkRole
    voice: str | None = None
    instructions: str | None = None
    preamble: str | None = None
    transcript: str | None = None


@dataclass(frozen=True)
class ServedWalks:
    """The walks each OpenAI route is mounted for, from the walks' own declarations."""

    speech: SpeechWalk | None = None
    chat: WalkRole | None = None  # chat requests (with an image too, when it takes one)
    understand: WalkRole | None = None  # chat requests with an image, when `chat` takes none
    spoken: SpeechWalk | None = None  # chat requests with modalities ["text", "audio"]
    t2i: WalkRole | None = None
    edit: WalkRole | None = None
    transcriptions: WalkRole | None = None
    translations: WalkRole | None = None
    all: tuple[str, ...] = field(default_factory=tuple)


# each route's (text input, output) slots: what a WalkRole's text_input and output are
_ROLE_SLOTS = {"speech": ("input", "audio"), "chat": ("prompt", "text"), "image_generations": ("prompt", "image"),
               "image_edits": ("prompt", "output"), "transcriptions": ("file", "tokens"),
               "translations": ("file", "tokens")}


def served_walks(plan: Plan) -> ServedWalks:
    """The walks each route is mounted for: every walk's `routes` declarations, resolved and
    checked (`plan.routes.served_routes`: a walk that does not fit a route it declares is a
    `RouteMisfit` naming both). No walk is picked by its name or the model's."""
    roles: dict[str, list[WalkRole]] = {}
    for s in served_routes(plan.walks):
        program = plan.walks[s.walk]
        text, out = _ROLE_SLOTS[s.route]
        roles.setdefault(s.route, []).append(WalkRole(s.walk, s.slots[text], s.slots[out],
                                                      {p["name"]: p for p in program["inputs"]}, s.slots))
    one = {r: v[0] for r, v in roles.items() if r != "chat"}
    chats = roles.get("chat", [])
    spoken = next((r for r in chats if "audio" in r.slots), None)
    text_only = next((r for r in chats if "audio" not in r.slots and "image" not in r.slots), None)
    pictured = next((r for r in chats if "audio" not in r.slots and "image" in r.slots), None)
    if text_only is None and pictured is not None and pictured.inputs[pictured.slots["image"]].get("default") is not None:
        text_only, pictured = pictured, None  # its image is optional: it answers every chat request
    speech = one.get("speech")
    return ServedWalks(
        speech=SpeechWalk(speech, speech.slots.get("voice"), speech.slots.get("instructions"),
                          speech.slots.get("preamble"), speech.slots.get("transcript")) if speech else None,
        chat=text_only, understand=pictured,
        # a spoken reply's role reads the audio; its text is the transcript
        spoken=SpeechWalk(replace(spoken, output=spoken.slots["audio"]), spoken.slots.get("voice"),
                          transcript=spoken.slots["text"]) if spoken else None,
        t2i=one.get("image_generations"), edit=one.get("image_edits"),
        transcriptions=one.get("transcriptions"), translations=one.get("translations"),
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
        schema = m.plan.body.get("schema", {})
        if schema.get("minor", 0) < 3:
            log.warning("plan schema %s.%s predates route declarations (1.3): it serves no OpenAI route, only "
                        "/v1/walks; recompile it with this mstarc", schema.get("major"), schema.get("minor"))
        self.metrics = Metrics(self.model_id, self.sample_rate, snapshot=self.snapshot)
        self.api_key_digest = api_key_digest(config.api_key) if config.api_key else None
        self.loop_limits = {w: loop_limits(m.plan.walk(w)) for w in m.plan.walks}
        self.input_types = {w: input_adapters(m.plan.walk(w)) for w in m.plan.walks}  # one rule for every route
        self.in_flight = 0  # requests in flight: each `serve.flight.Flight` counts itself in and out
        # paths whose body is a streamed walk input (serve.live): read as it arrives, never
        # buffered, bounded by the walk's own limit on that input instead of max_body_bytes
        self.streamed_paths: set[str] = set()
        self.realtime_sessions = 0  # open /v1/realtime sockets (serve.realtime)
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
        elif self.in_flight >= self.config.max_pending:
            problem = ApiError(503, f"the server has {self.in_flight} requests in flight (max_pending "
                               f"{self.config.max_pending}); retry later", type=SERVER, code="overloaded",
                               headers={"Retry-After": "1"})
        if problem is not None:
            self.metrics.rejected(walk)
            raise problem

    def flight_began(self) -> None:
        self.in_flight += 1

    def flight_ended(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Stop admission, wait up to `timeout` s for in-flight requests; the number left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight and (left := deadline - time.monotonic()) > 0:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, 0.5))
            except TimeoutError:
                pass
        return self.in_flight

    def snapshot(self) -> tuple[Mapping[str, Any], dict[str, float]]:
        """The engine's stats and the server's gauges of this moment (for a scrape)."""
        stats = self.m.stats()
        return stats, self.server_gauges(stats)

    def server_gauges(self, stats: Mapping[str, Any]) -> dict[str, float]:
        return {
            "mstar_requests_active": float(stats.get("requests", {}).get("active", 0)),
            "mstar_server_inflight": float(self.in_flight),
            "mstar_server_draining": 1.0 if self.draining else 0.0,
            "mstar_realtime_sessions": float(self.realtime_sessions),
            "mstar_engine_healthy": 0.0 if self.engine_problem() else 1.0,
        }


# ----------------------------------------------------------------------------- speech
def speech_walk(state: ServerState) -> SpeechWalk | None:
    """The walk that serves `/v1/audio/speech`: the one that declares `speech`, or None."""
    return state.walks.speech


def default_voice(state: ServerState) -> str | None:
    """The voice a speech request without one gets (its walk's default), for `/v1/models`:
    what a client may send when it knows nothing of the model (Orpheus `tara`, Qwen3-Omni
    `ethan`). None when the plan has no speech walk or its voice input has no default."""
    speech = speech_walk(state)
    if speech is None or speech.voice is None:
        return None
    default = speech.role.inputs[speech.voice].get("default")
    return default if isinstance(default, str) else None


def is_stream(o: Mapping[str, Any] | None, dtypes: tuple[str, ...]) -> bool:
    """An appended output of kind str (when "str" is in `dtypes`) or a tensor of one of `dtypes`."""
    if o is None or o["mode"] != "append":
        return False
    t = o["type"]
    return (t["kind"] == "str" and "str" in dtypes) or (t["kind"] == "tensor" and t.get("dtype") in dtypes)


__all__ = ["MAX_BODY_BYTES", "ServeConfig", "ServedWalks", "ServerState", "SpeechWalk", "WalkRole", "default_voice",
           "is_stream", "loop_limits", "served_walks", "speech_walk"]
