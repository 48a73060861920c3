"""The OpenAI Realtime protocol as `/v1/realtime` (`serve.realtime`) reads and writes it: client
events parsed and checked (`parse_event`, `session_update`, `message_item`), the `error`
event in OpenAI's shape, the session's settings (`SessionConfig`), PCM16 audio in and out,
and a resampler for audio that arrives in pieces (`StreamResampler`).

Every problem with a client event is an `EventError`: its `code`, a message that names the
event's type, `param` (the field at fault, in the event's own terms: `session.voice`,
`item.content[0].audio`, `audio`), and the client's `event_id`, sent back as

    {"type": "error", "event_id": "event_...", "error": {"type": "invalid_request_error",
     "code": "...", "message": "...", "param": "...", "event_id": "<the client's>"}}

and the session goes on (a bad event never closes the socket).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mstar_runtime.media import resample
from mstar_runtime.serve.schemas import MAX_STR, valid_unicode

CLIENT_RATE = 24000  # OpenAI's pcm16: 16-bit little-endian mono at 24 kHz, both ways
MAX_EVENT_BYTES = 16 << 20  # one client event (an append of 15 MiB of base64 is over 5 minutes of audio)
MAX_BUFFER_SECONDS = 300.0  # audio held in the input buffer (Qwen3-Omni's processor takes at most 300 s)
# client events of OpenAI's protocol this server does not serve: named as such, not "unknown"
UNSERVED_EVENTS = frozenset({"conversation.item.truncate", "conversation.item.delete", "conversation.item.retrieve",
                             "output_audio_buffer.clear", "transcription_session.update"})
CLIENT_EVENTS = frozenset({"session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                           "input_audio_buffer.clear", "conversation.item.create", "response.create",
                           "response.cancel"})
SESSION_FIELDS = frozenset({"modalities", "instructions", "voice", "input_audio_format", "output_audio_format",
                            "temperature", "max_response_output_tokens", "turn_detection", "tools", "tool_choice",
                            "input_audio_transcription", "model", "type", "object", "id"})


class EventError(Exception):
    """A client event the session refuses (module docstring)."""

    def __init__(self, code: str, message: str, param: str | None = None, event_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.event_id = code, message, param, event_id


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def error_event(code: str, message: str, param: str | None, event_id: str | None,
                kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "event_id": new_id("event"),
            "error": {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}}


def parse_event(raw: str | bytes) -> dict[str, Any]:
    """One client event: a JSON object with a string `type` of this protocol."""
    if len(raw) > MAX_EVENT_BYTES:
        raise EventError("event_too_large", f"an event is at most {MAX_EVENT_BYTES} bytes, got {len(raw)}")
    try:
        event = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise EventError("invalid_json", f"the message is not valid JSON: {e}") from None
    if not isinstance(event, dict):
        raise EventError("invalid_event", f"an event must be a JSON object, got {type(event).__name__}")
    event_id = event.get("event_id")
    event_id = event_id if isinstance(event_id, str) else None
    kind = event.get("type")
    if not isinstance(kind, str):
        raise EventError("missing_type" if kind is None else "invalid_type",
                         "an event needs a string 'type' (e.g. 'session.update')", "type", event_id)
    if kind in UNSERVED_EVENTS:
        raise EventError("unsupported_event", f"'{kind}' is an OpenAI Realtime event this server does not serve",
                         "type", event_id)
    if kind not in CLIENT_EVENTS:
        raise EventError("unknown_event", f"unknown event type '{kind}' (this server takes "
                         f"{', '.join(sorted(CLIENT_EVENTS))})", "type", event_id)
    return event


def field_of(event: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], where: str,
             required: bool = False) -> Any:
    """`event[name]` checked to be of `kinds` (None when absent and not `required`)."""
    kind = event.get("type", "?")
    if name not in event or event[name] is None:
        if required:
            raise EventError("missing_field", f"{kind}: '{where}' is required", where, event.get("event_id"))
        return None
    value = event[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        want = " or ".join(t.__name__ for t in _tuple(kinds))
        raise EventError("invalid_value", f"{kind}: '{where}' must be {want}, got {type(value).__name__}", where,
                         event.get("event_id"))
    if isinstance(value, str):
        _text(value, where, event)
    return value


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _text(value: str, where: str, event: Mapping[str, Any]) -> str:
    if len(value) > MAX_STR:
        raise EventError("invalid_value", f"{event.get('type')}: '{where}' holds more than {MAX_STR} characters",
                         where, event.get("event_id"))
    try:
        return valid_unicode(value)
    except ValueError as e:
        raise EventError("invalid_value", f"{event.get('type')}: '{where}': {e}", where, event.get("event_id")) \
            from None


# ----------------------------------------------------------------------------- audio
def pcm16_samples(data: str, where: str, event: Mapping[str, Any]) -> torch.Tensor:
    """Base64 16-bit little-endian mono PCM as float samples in [-1, 1)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError("invalid_audio", f"{event.get('type')}: '{where}' is not valid base64", where,
                         event.get("event_id")) from None
    if len(raw) % 2:
        raise EventError("invalid_audio", f"{event.get('type')}: '{where}' holds {len(raw)} bytes; pcm16 samples "
                         "are 2 bytes each", where, event.get("event_id"))
    ints = torch.frombuffer(bytearray(raw), dtype=torch.int16) if raw else torch.zeros(0, dtype=torch.int16)
    return ints.to(torch.float32) / 32768.0


class StreamResampler:
    """`media.resample` over audio that arrives in pieces: `push(x)` returns the output samples
    that no later input can change, `close()` the rest, so the pieces join to `resample(all of
    the input)` (the same taps over the same input samples, so equal up to the float32 rounding
    of a matrix product over fewer rows: 1e-7). Each push resamples only the
    new input plus the filter's reach before it, cut at a multiple of the rates' period so the
    output phases line up."""

    def __init__(self, orig: int, new: int):
        g = math.gcd(orig, new)
        self.orig, self.new, self.up, self.down = orig, new, new // g, orig // g
        cutoff = 0.99 * min(1.0, self.up / self.down) / 2  # media.ROLLOFF: the width resample uses
        self.width = math.ceil(16 / (2 * cutoff)) + 2  # media.ZERO_CROSSINGS, and the two extra taps
        self.samples = torch.zeros(0, dtype=torch.float32)  # input received from `base` on
        self.base = 0  # input index of samples[0]; a multiple of `down`
        self.emitted = 0  # output samples returned so far
        self.closed = False

    def push(self, x: torch.Tensor) -> torch.Tensor:
        if self.orig == self.new:
            self.emitted += x.numel()
            return x
        self.samples = torch.cat([self.samples, x.to(torch.float32).reshape(-1)])
        n = self.base + self.samples.numel()
        # output m reads input up to floor(m * down / up) + width: final once that is < n
        final = max(0, ((n - 1 - self.width) * self.up) // self.down + 1) if n - 1 >= self.width else 0
        return self._upto(min(final, -(-n * self.up // self.down)))

    def close(self) -> torch.Tensor:
        self.closed = True
        if self.orig == self.new:
            return torch.zeros(0, dtype=torch.float32)
        n = self.base + self.samples.numel()
        return self._upto(-(-n * self.up // self.down), last=True)

    def _upto(self, end: int, last: bool = False) -> torch.Tensor:
        if end <= self.emitted:
            return torch.zeros(0, dtype=torch.float32)
        out = resample(self.samples, self.orig, self.new)  # output 0 of it is output base * up / down overall
        first = self.base * self.up // self.down
        piece = out[self.emitted - first:end - first] if not last else out[self.emitted - first:]
        self.emitted = end if not last else first + out.numel()
        # keep the input the next outputs read: from `width` before the next output's input index
        keep = max(0, (self.emitted * self.down) // self.up - self.width - 1)
        keep = keep // (self.down * self.up) * (self.down * self.up)  # whole periods: the phases line up
        if keep > self.base:
            self.samples = self.samples[keep - self.base:]
            self.base = keep
        return piece.clone()


# ----------------------------------------------------------------------------- session
@dataclass(frozen=True)
class SessionConfig:
    """What `session.update` sets (OpenAI's session object, as far as it is served)."""

    modalities: tuple[str, ...]
    voice: str | None
    instructions: str = ""
    temperature: float | None = None
    max_output_tokens: int | None = None  # None: "inf", the walk's own bound
    turn_detection: None = None  # no server VAD: the client commits
    served_modalities: tuple[str, ...] = field(default=("text",), repr=False)

    def to_json(self, session_id: str, model: str) -> dict[str, Any]:
        return {"id": session_id, "object": "realtime.session", "model": model, "modalities": list(self.modalities),
                "instructions": self.instructions, "voice": self.voice, "input_audio_format": "pcm16",
                "output_audio_format": "pcm16", "input_audio_transcription": None, "turn_detection": None,
                "tools": [], "tool_choice": "auto", "temperature": self.temperature,
                "max_response_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens}


def check_modalities(value: Any, where: str, event: Mapping[str, Any], served: tuple[str, ...]) -> tuple[str, ...]:
    eid = event.get("event_id")
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise EventError("invalid_value", f"{event.get('type')}: '{where}' must be a list such as ['text'] or "
                         "['text', 'audio']", where, eid)
    for i, m in enumerate(value):
        if m not in ("text", "audio"):
            raise EventError("invalid_value", f"{event.get('type')}: '{where}[{i}]' must be 'text' or 'audio', got "
                             f"{m!r}", f"{where}[{i}]", eid)
        if m not in served:
            raise EventError("unsupported_modality", f"{event.get('type')}: this model answers in "
                             f"{' and '.join(served)} only, not {m}", f"{where}[{i}]", eid)
    if "audio" in value and "text" not in value:
        raise EventError("unsupported_modality", f"{event.get('type')}: audio comes with its transcript: use "
                         "['text', 'audio']", where, eid)
    return tuple(dict.fromkeys(value))


def max_tokens_of(value: Any, where: str, event: Mapping[str, Any]) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise EventError("invalid_value", f"{event.get('type')}: '{where}' must be an integer from 1 to 4096 or "
                         f"'inf', got {value!r}", where, event.get("event_id"))
    return value


def temperature_of(value: Any, where: str, event: Mapping[str, Any]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 2.0:
        raise EventError("invalid_value", f"{event.get('type')}: '{where}' must be a number from 0 to 2, got "
                         f"{value!r}", where, event.get("event_id"))
    return float(value)


def session_update(config: SessionConfig, event: Mapping[str, Any]) -> SessionConfig:
    """`config` with the fields of a `session.update` event's `session` (module docstring)."""
    eid = event.get("event_id")
    session = field_of(event, "session", dict, "session", required=True)
    for key in session:
        if key not in SESSION_FIELDS:
            raise EventError("unknown_parameter", f"session.update: unknown field 'session.{key}'", f"session.{key}",
                             eid)
    changes: dict[str, Any] = {}
    if session.get("modalities") is not None:
        changes["modalities"] = check_modalities(session["modalities"], "session.modalities", event,
                                                 config.served_modalities)
    if session.get("instructions") is not None:
        changes["instructions"] = field_of(session | {"type": "session.update", "event_id": eid}, "instructions",
                                           str, "session.instructions")
    if session.get("voice") is not None:
        voice = field_of(session | {"type": "session.update", "event_id": eid}, "voice", str, "session.voice")
        if config.voice is None:
            raise EventError("unsupported", "session.update: this model does not speak, so it takes no voice",
                             "session.voice", eid)
        changes["voice"] = voice
    for key in ("input_audio_format", "output_audio_format"):
        if session.get(key) not in (None, "pcm16"):
            raise EventError("unsupported", f"session.update: session.{key} must be 'pcm16' (16-bit PCM at 24 kHz), "
                             f"got {session[key]!r}", f"session.{key}", eid)
    if "temperature" in session and session["temperature"] is not None:
        changes["temperature"] = temperature_of(session["temperature"], "session.temperature", event)
    if "max_response_output_tokens" in session and session["max_response_output_tokens"] is not None:
        changes["max_output_tokens"] = max_tokens_of(session["max_response_output_tokens"],
                                                     "session.max_response_output_tokens", event)
    if session.get("turn_detection") is not None:
        raise EventError("unsupported", "session.update: server voice activity detection is not served; set "
                         "session.turn_detection to null and send input_audio_buffer.commit",
                         "session.turn_detection", eid)
    if session.get("input_audio_transcription") is not None:
        raise EventError("unsupported", "session.update: input audio transcription is not served beside a "
                         "conversation (a plan with a transcribe walk transcribes instead)",
                         "session.input_audio_transcription", eid)
    if session.get("tools"):
        raise EventError("unsupported", "session.update: tools are not served", "session.tools", eid)
    return replace(config, **changes)


# ----------------------------------------------------------------------------- items
@dataclass
class Item:
    """One conversation item: a message of `role` whose content is text pieces and at most
    one audio clip (float samples at CLIENT_RATE; the route resamples it for its walk)."""

    id: str
    role: str
    text: str = ""
    audio: torch.Tensor | None = None
    status: str = "completed"
    parts: list[dict[str, Any]] = field(default_factory=list)  # the content as OpenAI shows it
    heard: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # the audio resampled, by rate

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": self.parts}


CONTENT_TYPES = {"user": ("input_text", "input_audio"), "system": ("input_text",),
                 "assistant": ("text", "output_text", "audio")}


def message_item(event: Mapping[str, Any]) -> Item:
    """The item of a `conversation.item.create` event: a `message` of role user, assistant or
    system; user content `input_text` and `input_audio` (base64 pcm16, one clip), assistant
    content `text` (or `output_text`) and `audio` with its `transcript` (the text is kept)."""
    eid = event.get("event_id")
    item = field_of(event, "item", dict, "item", required=True)
    scoped = item | {"type": "conversation.item.create", "event_id": eid}
    if item.get("type", "message") != "message":
        raise EventError("unsupported", f"conversation.item.create: item.type {item.get('type')!r} is not served "
                         "(only 'message')", "item.type", eid)
    role = field_of(scoped, "role", str, "item.role", required=True)
    if role not in CONTENT_TYPES:
        raise EventError("invalid_value", f"conversation.item.create: item.role must be user, assistant or system, "
                         f"got {role!r}", "item.role", eid)
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise EventError("missing_field" if content is None else "invalid_value",
                         "conversation.item.create: item.content must be a non-empty list of parts",
                         "item.content", eid)
    item_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else new_id("item")
    out = Item(item_id, role)
    texts: list[str] = []
    for i, part in enumerate(content):
        where = f"item.content[{i}]"
        if not isinstance(part, dict):
            raise EventError("invalid_value", f"conversation.item.create: '{where}' must be an object", where, eid)
        scoped = part | {"type": "conversation.item.create", "event_id": eid}
        kind = part.get("type")
        if kind not in CONTENT_TYPES[role]:
            raise EventError("invalid_value", f"conversation.item.create: {where}.type of a {role} message must be "
                             f"{' or '.join(CONTENT_TYPES[role])}, got {kind!r}", f"{where}.type", eid)
        if kind == "input_audio":
            data = field_of(scoped, "audio", str, f"{where}.audio", required=True)
            if out.audio is not None:
                raise EventError("too_many_audio_inputs", "conversation.item.create: one input_audio part per item",
                                 where, eid)
            out.audio = pcm16_samples(data, f"{where}.audio", event)
            out.parts.append({"type": "input_audio", "transcript": None})
        elif kind == "audio":
            text = field_of(scoped, "transcript", str, f"{where}.transcript", required=True)
            texts.append(text)
            out.parts.append({"type": "audio", "transcript": text})
        else:
            text = field_of(scoped, "text", str, f"{where}.text", required=True)
            texts.append(text)
            out.parts.append({"type": kind, "text": text})
    out.text = "".join(texts)
    return out


__all__ = ["CLIENT_RATE", "EventError", "Item", "SessionConfig", "StreamResampler", "error_event", "field_of",
           "max_tokens_of", "message_item", "new_id", "parse_event", "pcm16_samples", "session_update",
           "temperature_of"]
