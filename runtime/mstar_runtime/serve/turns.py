"""A conversation as the inputs of a walk that renders its turns itself: one with a `history`
slot on its chat route (Qwen3-Omni's `chat` and `speech`: docs/models/qwen3_omni.md), for
`/v1/chat/completions` and `/v1/realtime` alike.

Every turn but the last goes to `history` as JSON (`{"role", "content", "audio"}`), each
user turn's clip at the front of the walk's `input_audio` in order; the last turn, the
user's, is the `prompt` and the rest of the audio; the system text goes to the `system`
slot. So turn N's prompt is turn N-1's followed by its reply and the new turn, clips
included, which is what lets the prefix cache reuse a conversation's earlier turns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mstar_runtime.serve.common import bad_request

if TYPE_CHECKING:
    from mstar_runtime.serve.state import WalkRole


@dataclass(frozen=True)
class Turn:
    """One turn: its role (user, assistant, system), its text, and a user turn's clip (float
    samples at the rate the walk reads)."""

    role: str
    text: str
    clip: torch.Tensor | None = None


def renders_turns(role: WalkRole) -> bool:
    """Whether the walk takes the conversation's turns (a bound `history` slot)."""
    return role.slots.get("history") is not None


def turn_inputs(role: WalkRole, turns: Sequence[Turn], system: str | None, where: str,
                audio_field: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The walk inputs of `turns` (module docstring) and the request field each is blamed on:
    `where` for the text and history (`messages`, `item`), `audio_field` for the audio. A
    conversation that does not end with a user turn, or has a clip where the walk takes
    none, is a 400 naming `where`."""
    if not turns or turns[-1].role != "user":
        last = turns[-1].role if turns else "nothing"
        raise bad_request(f"walk '{role.walk}' answers a user turn, but the conversation ends with {last}'s; end "
                          "it with a user message", where)
    audio, history, text = role.slots.get("input_audio"), role.slots["history"], role.text_input
    clips = [t.clip for t in turns if t.clip is not None]
    if clips and audio is None:
        raise bad_request(f"walk '{role.walk}' takes no audio input", where, "unsupported_modality")
    earlier = [{"role": t.role, "content": t.text} | ({"audio": int(t.clip.numel())} if t.clip is not None else {})
               for t in turns[:-1]]
    inputs: dict[str, Any] = {text: turns[-1].text, history: json.dumps(earlier)}
    fields = {text: where, history: where}
    slot = role.slots.get("system")
    if system and slot is not None:
        inputs[slot], fields[slot] = system, where
    if clips and audio is not None:
        inputs[audio], fields[audio] = torch.cat(clips), audio_field
    return inputs, fields


def audio_limit(node: Any, rate: int) -> int | None:
    """The samples of audio a request may hold in all, by its prompt node's `max_audio_seconds`
    (Qwen3-Omni's processor: 300 s), or None when the node names no limit."""
    seconds = getattr(getattr(node, "features", node), "max_audio_seconds", None)
    ok = isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds > 0
    return int(seconds * rate) if ok else None


def fit_audio(turns: Sequence[Turn], limit: int | None) -> list[Turn]:
    """`turns` with the clips of the oldest turns left out (their text kept) until all the clips
    hold at most `limit` samples; the last turn's clip is always kept. A long spoken session
    so keeps going once its audio passes the walk's limit (the prompts from then on no longer
    begin with the earlier ones: the prefix cache misses once, where a clip was dropped)."""
    out = list(turns)
    total = sum(t.clip.numel() for t in out if t.clip is not None)
    for i, t in enumerate(out[:-1]):
        if limit is None or total <= limit:
            break
        if t.clip is not None:
            total -= t.clip.numel()
            out[i] = Turn(t.role, t.text, None)
    return out


def message_turns(body: Any, rate: int, decode: Callable[[Any, str, int], torch.Tensor]) -> list[Turn]:
    """A chat request's messages as turns: each message's text parts joined, its `input_audio`
    part decoded at `rate` by `decode(part, param, rate)`; system and developer messages left
    out (the `system` slot has them)."""
    turns = []
    for i, msg in enumerate(body.messages):
        if msg.role in ("system", "developer"):
            continue
        parts = msg.content if isinstance(msg.content, list) else [msg.content or ""]
        text = "".join(p if isinstance(p, str) else p.text for p in parts if isinstance(p, str) or p.type == "text")
        clip = next((decode(p, f"messages[{i}].content[{j}]", rate) for j, p in enumerate(parts)
                     if not isinstance(p, str) and p.type == "input_audio"), None)
        turns.append(Turn(msg.role, text, clip))
    return turns


__all__ = ["Turn", "audio_limit", "fit_audio", "message_turns", "renders_turns", "turn_inputs"]
