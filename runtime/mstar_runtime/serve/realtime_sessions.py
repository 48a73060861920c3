"""Which walk a plan's `/v1/realtime` sessions run, and how (serve/realtime.py's module
docstring says what each kind of session does): `served` reads the plan once at install.

A conversation when the plan has a walk that declares `chat` (with its spoken twin, chat
templates and text codecs); else a transcription by the walk that declares
`transcriptions`, or by its live twin (`live_twin`) when that walk takes its audio whole
and the engine runs in this process (an engine process takes inputs whole).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

from mstar_runtime.control.requests import stream_inputs
from mstar_runtime.serve.chat import audio_input, spoken_walk
from mstar_runtime.serve.chat_template import template_for
from mstar_runtime.serve.text import TextCodec
from mstar_runtime.serve.transcriptions import TokenText

if TYPE_CHECKING:
    from mstar_runtime.plan.loader import Plan
    from mstar_runtime.serve.state import ServerState, SpeechWalk, WalkRole


@dataclasses.dataclass
class Served:
    """What a plan's realtime sessions run (module docstring)."""

    chat: WalkRole | None = None
    speech: SpeechWalk | None = None
    templates: dict[str, Any] = dataclasses.field(default_factory=dict)
    transcribe: str | None = None
    audio: str = "audio"  # transcribe's audio input (its `file` slot)
    streamed: bool = False  # transcribe's audio is a streamed input
    tokens_output: str | None = None  # transcribe's appended token ids
    partial: str | None = None  # a live twin's appended JSON lines (`live_twin`), read instead of tokens
    fed_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # a streamed request's other inputs
    text: TokenText | None = None  # their text, or None: ids as numbers

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("text", "audio") if self.speech is not None else ("text",)

    def hears(self) -> bool:
        roles = [r for r in (self.chat, self.speech.role if self.speech else None) if r is not None]
        return self.transcribe is not None or any(audio_input(r) is not None for r in roles)


def served(state: ServerState) -> Served | None:
    plan = state.plan
    if state.walks.chat is not None:
        out = Served(chat=state.walks.chat, speech=spoken_walk(state))
        roles = [r for r in (out.chat, out.speech.role if out.speech else None) if r is not None]
        for r in roles:
            if r.walk not in state.codecs:
                state.codecs[r.walk] = TextCodec(plan, r.walk, r.text_input, state.config.weights)
            out.templates[r.walk] = template_for(plan, r.walk, r.text_input, state.config.weights)
        return out
    role = state.walks.transcriptions
    if role is None:
        return None
    program = plan.walk(role.walk)
    tokens = role.slots["tokens"]  # appended token ids (the route's rule)
    text = TokenText(plan, role.walk, str(state.config.weights), role.slots.get("text", tokens))
    # an engine in its own process (--engine-process) takes inputs whole: the audio is sent at the commit
    feeds = "streaming" in inspect.signature(state.m.submit).parameters
    audio = role.slots["file"]
    twin = live_twin(plan, role) if feeds and audio not in stream_inputs(program) else None
    if twin is not None:
        # the audio's length is unknown at the first append, and audio over one window seeks by
        # timestamps (the transcriptions route's rule): a live request always asks for them
        stamps = role.slots.get("timestamps")
        return Served(transcribe=twin[0], audio=audio, streamed=True, partial=twin[1],
                      fed_inputs={stamps: True} if stamps else {})
    return Served(transcribe=role.walk, audio=audio, streamed=feeds and audio in stream_inputs(program),
                  tokens_output=tokens, text=text if text.node is not None else None)


def live_twin(plan: Plan, role: WalkRole) -> tuple[str, str] | None:
    """The live form of a transcriptions walk that takes its audio whole (Whisper's
    `transcribe_live` beside `transcribe`), found by its shape, not its name: another walk
    with the same inputs, the route's audio among its streamed inputs, the same outputs set
    at the end (`text`), and one appended text output the whole walk lacks (its `partial`
    lines). Its walk and that output, or None."""
    whole = plan.walk(role.walk)
    names = [p["name"] for p in whole["inputs"]]
    kept = {o["name"] for o in whole["outputs"]}
    for walk in sorted(plan.walks):
        program = plan.walk(walk)
        if walk == role.walk or [p["name"] for p in program["inputs"]] != names \
                or role.slots["file"] not in stream_inputs(program):
            continue
        outputs = {o["name"]: o for o in program["outputs"]}
        extra = [n for n, o in outputs.items() if n not in kept and o["mode"] == "append"
                 and o["type"].get("kind") == "str"]
        if len(extra) == 1 and outputs.get("text", {}).get("mode") == "set" and kept <= set(outputs):
            return walk, extra[0]
    return None


__all__ = ["Served", "live_twin", "served"]
