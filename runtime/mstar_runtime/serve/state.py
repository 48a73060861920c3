"""What the server knows of its plan and its engine, shared by the server and every route
module (`ServerState`), so that the routes import it and the server imports the routes
without either importing the other back: the configuration (`ServeConfig`), which OpenAI
routes the plan's walks serve (`served_walks`, `speech_walk`), the bounds of their loop
counts (`loop_limits`), and the state: the engine, admission, the drain, metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import TYPE_CHECKING, Any

from mstar_runtime.api import MStar
from mstar_runtime.plan.loader import Plan
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
    from mstar_runtime.serve.common import Flight

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
            "mstar_realtime_sessions": float(self.realtime_sessions),
            "mstar_engine_healthy": 0.0 if self.engine_problem() else 1.0,
        }


# ----------------------------------------------------------------------------- speech
# What Qwen3-Omni's speech walk is told for /v1/audio/speech: its prompt is a user turn that
# the model would otherwise answer rather than read
READ_ALOUD = ("Read the user's message aloud exactly as it is written, word for word. Do not answer it, "
              "comment on it, translate it or add anything to it.")


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


# models whose speech is not a `tts(text, voice)` walk, by the plan's model name:
# (walk, text input, voice input, instructions input, audio output, preamble)
SPEECH_WALKS: dict[str, tuple[str, str, str, str, str, str | None]] = {
    "qwen3_omni": ("speech", "prompt", "speaker", "system", "audio_out", READ_ALOUD),
}


def speech_walk(state: ServerState) -> SpeechWalk | None:
    """The walk that serves `/v1/audio/speech` (module docstring), or None."""
    known = SPEECH_WALKS.get(state.plan.model_name)
    if known is not None:
        walk, text, voice, instructions, audio, preamble = known
        program = state.plan.walks.get(walk)
        if program is None:
            return None
        inputs = {p["name"]: p for p in program["inputs"]}
        outputs = {o["name"]: o for o in program["outputs"]}
        if not (_is_str(inputs.get(text)) and is_stream(outputs.get(audio), ("f32", "f16", "bf16"))):
            return None
        transcript = next((n for n, o in outputs.items() if n != audio and is_stream(o, ("str", "i32", "i64"))),
                          None)
        return SpeechWalk(WalkRole(walk, text, audio, inputs), voice if _is_str(inputs.get(voice)) else None,
                          instructions if _is_str(inputs.get(instructions)) else None, preamble, transcript)
    role = state.walks.tts
    if role is None:
        return None
    return SpeechWalk(role, "voice" if _is_str(role.inputs.get("voice")) else None,
                      "instructions" if _is_str(role.inputs.get("instructions")) else None)


def default_voice(state: ServerState) -> str | None:
    """The voice a speech request without one gets (its walk's default), for `/v1/models`:
    what a client may send when it knows nothing of the model (Orpheus `tara`, Qwen3-Omni
    `ethan`). None when the plan has no speech walk or its voice input has no default."""
    speech = speech_walk(state)
    if speech is None or speech.voice is None:
        return None
    default = speech.role.inputs[speech.voice].get("default")
    return default if isinstance(default, str) else None


def _is_str(p: Mapping[str, Any] | None) -> bool:
    return p is not None and p["type"]["kind"] == "str"


def is_stream(o: Mapping[str, Any] | None, dtypes: tuple[str, ...]) -> bool:
    """An appended output of kind str (when "str" is in `dtypes`) or a tensor of one of `dtypes`."""
    if o is None or o["mode"] != "append":
        return False
    t = o["type"]
    return (t["kind"] == "str" and "str" in dtypes) or (t["kind"] == "tensor" and t.get("dtype") in dtypes)


__all__ = ["MAX_BODY_BYTES", "READ_ALOUD", "SPEECH_WALKS", "ServeConfig", "ServedWalks", "ServerState", "SpeechWalk",
           "WalkRole", "default_voice", "is_stream", "loop_limits", "served_walks", "speech_walk"]
