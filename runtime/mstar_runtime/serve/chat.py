"""`POST /v1/chat/completions`, served by the walks that declare `serves chat(...)`
(docs/walk-language.md, "Routes"; `state.ServedWalks`): the one without an `image` slot, and
the one with it for requests with an image (BAGEL: `chat(prompt)` for text, `understand(image,
question)`, which binds `prompt = question`, for an image and its question; one walk whose
image input has a default answers both, as Qwen3-Omni's `chat`); requests with `modalities:
["text", "audio"]` by the walk whose declaration binds the `audio` slot (Qwen3-Omni's
`speech`), answered in OpenAI's audio-output format (below).

The messages become the walk's text input. A walk whose prompt node asks for it
(`server_chat_template`) gets the conversation rendered with the chat template that
`serve.chat_template` finds (the checkpoint's, else the node's bundled one; a template that
refuses the messages is a 400 `chat_template_error` naming it). Any other walk (its prompt
node formats the prompt itself, as Qwen3-Omni's processor and BAGEL's tokenizer do, or no
template exists) gets plain text: a lone message is its text as is; several are
`role: text` lines ending with `assistant:`; system and developer messages go to the walk's
`system` slot instead, when it binds one.
Image parts go to the walk's `image` slot when it binds one (an `image`, or a uint8 [H, W, 3]
tensor; one image, as a data: URL; a remote URL is a 400: nothing is fetched); otherwise
they are a 400 naming the part. An `input_audio` part (a base64 WAV, `media.decode_wav`) goes
to the walk's `input_audio` slot (a float [A] tensor), resampled to the rate its prompt node
reads (`input_rate`); one per request (one per message for a walk with a `history` slot,
which gets the earlier messages as its turns, `serve.turns`), and mp3 is a 400 (no decoder
is bundled). A plan
whose only chat walk requires an image answers a request
without one with a 400 naming `messages`. `max_tokens`
(or `max_completion_tokens`; above the plan's limit a 400, as on every route:
`app.check_token_limit`) goes to the walk's `max_tokens` / `max_new_tokens` / `max_new`
/ `max_length` input and is also enforced here:
a walk whose transitions decode on (the test family's chat -> continue) is cut at that
many tokens, with finish reason "length". Sampling fields (`temperature`, `top_p`, `seed`,
penalties) go to walk inputs of the same name; one the walk does not take is a 400
`unsupported` naming it (the reply would not be sampled as asked), except a penalty of 0,
OpenAI's default, which asks for nothing.
Token ids become text through `server_text` (see there for the rendering rule).

Streaming follows OpenAI's chunk format: the first chunk's delta carries the role, then one
chunk per text piece, then one chunk with the finish reason, then (with
`stream_options.include_usage`) a usage chunk with no choices, then `data: [DONE]`. The
response starts only once the first token exists, so a request that fails before that
still gets its 4xx; a failure later ends the stream with a chunk whose finish reason is the
engine's (`error`, `timeout`, `shutdown`) and an `error` event. A failure that comes after
the served walk ended, in the walk a transition moved on to (BAGEL's chat -> draw for a
reply that opens an image), is not the reply's: the reply ends there ("stop") and the
failure is logged.

Audio out. `audio: {"voice", "format"}` is required with `modalities: ["text", "audio"]` and
refused without it; the voice goes to the walk's voice input (Qwen3-Omni: `speaker`; a
voice the walk does not know is the node's 400, naming `audio.voice`; the `voice` slot). The whole reply is a
message with `content: null` and `audio: {"id", "data", "expires_at", "transcript"}`:
`data` the base64 of a WAV or of raw 16-bit mono PCM at the plan's `sample_rate`, the
transcript the walk's text. Nothing is kept for later turns, so `expires_at` is the
creation time (send the transcript back as the assistant's content). Streamed (pcm16 only,
as OpenAI's), each chunk's `delta.audio` carries a `transcript` piece or a base64 PCM
`data` piece as the walk emits it (the first also the audio `id`), then one with only
`expires_at`, then the finish chunk. `max_tokens` bounds the transcript (the walk's own
input); the audio runs on until the walk ends it, so the reply is never cut early.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import torch

from mstar_runtime.api import RequestFailed
from mstar_runtime.media import DEFAULT_INPUT_RATE, decode_wav, node_input_rate, resample
from mstar_runtime.serve.app import (
    ERROR_RESPONSES,
    MAX_TOKEN_INPUTS,
    check_model,
    check_token_limit,
    error_response,
    start_flight,
    token_limit,
    walk_extras,
)
from mstar_runtime.serve.chat_template import ChatTemplate, template_for
from mstar_runtime.serve.common import ApiError, ClientGone, bad_request
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.io import b64, decode_image_text, pcm16, wav_header
from mstar_runtime.serve.media import SpeechWalk, voice_of
from mstar_runtime.serve.schemas import MAX_STR, ChatCompletionRequest, InputAudioPart
from mstar_runtime.serve.text import TextCodec, TextStream
from mstar_runtime.serve.turns import message_turns, renders_turns, turn_inputs
from mstar_runtime.serve.web import Request

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState, WalkRole

log = logging.getLogger("mstar_runtime.serve.server")
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty")
# OpenAI's defaults that mean "no penalty": what clients send when they set nothing
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0}


def image_input(role: WalkRole) -> str | None:
    """The walk input an image part goes to: its `image` slot (an `image`, or a uint8 [H, W, 3] tensor)."""
    return role.slots.get("image")


def audio_input(role: WalkRole) -> str | None:
    """The walk input an `input_audio` part goes to: its `input_audio` slot (a float [A] tensor)."""
    return role.slots.get("input_audio")


def system_input(role: WalkRole) -> str | None:
    """The walk input system and developer messages go to without a chat template: its `system` slot."""
    return role.slots.get("system")


def prompt_inputs(role: WalkRole, prompt: Any, system: str | None, param: str,
                  system_param: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A rendered prompt (and its system text, where `render_prompt` gave one apart) as walk
    inputs, each with the request field a node refusing it names."""
    inputs: dict[str, Any] = {role.text_input: prompt}
    fields = {role.text_input: param}
    if system is not None:
        name = system_input(role)
        assert name is not None  # render_prompt gives a system text only then
        inputs[name], fields[name] = system, system_param
    return inputs, fields


def audio_part(body: ChatCompletionRequest) -> tuple[str, InputAudioPart] | None:
    """The request's `input_audio` part and where it is (`messages[i].content[j]`), or None."""
    for i, msg in enumerate(body.messages):
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
            if part.type == "input_audio":
                return f"messages[{i}].content[{j}]", part
    return None


def render_prompt(body: ChatCompletionRequest, role: WalkRole, template: ChatTemplate | None = None,
                  clip_per_message: bool = False) -> tuple[str, str | None, torch.Tensor | None]:
    """The walk's text input, its `system` slot's text (when it binds one) and image, from the messages
    (an `input_audio` part is checked here and decoded by `decode_input_audio`; one per request,
    or per message with `clip_per_message`): rendered with `template` when there is one, else by
    the plain-text rule (module docstring)."""
    target = image_input(role)
    hears = audio_input(role) is not None
    audio_seen = False
    has_system = template is None and system_input(role) is not None
    conversation: list[dict[str, str]] = []
    image: torch.Tensor | None = None
    texts: list[tuple[str, str]] = []
    system: list[str] = []
    chars = 0
    for i, msg in enumerate(body.messages):
        parts = msg.content if isinstance(msg.content, list) else [msg.content or ""]
        pieces: list[str] = []
        audio_seen = audio_seen and not clip_per_message
        for j, part in enumerate(parts):
            text = part if isinstance(part, str) else part.text if part.type == "text" else None
            if text is not None:
                chars += len(text)
                if chars > MAX_STR:  # the native route's bound of a text input
                    raise bad_request(f"the messages hold more than {MAX_STR} characters of text", "messages",
                                      "too_long")
                pieces.append(text)
            elif part.type == "input_audio":
                param = f"messages[{i}].content[{j}]"
                if not hears:
                    raise bad_request(f"walk '{role.walk}' takes no audio input", param, "unsupported_modality")
                if audio_seen:
                    raise bad_request(f"one input_audio part per {'message' if clip_per_message else 'request'}",
                                      param, "too_many_audio_inputs")
                audio_seen = True
            else:
                param = f"messages[{i}].content[{j}]"
                if target is None:
                    raise bad_request(f"walk '{role.walk}' takes no image input; send text only", param,
                                      "unsupported_modality")
                if image is not None:
                    raise bad_request("one image per request", param, "too_many_images")
                try:
                    image = decode_image_text(part.image_url.url)
                except ValueError as e:
                    raise bad_request(f"image_url: {e}", f"{param}.image_url.url", "invalid_image") from None
        if template is not None:
            turn = {"role": "system" if msg.role == "developer" else msg.role, "content": "".join(pieces)}
            conversation.append(turn | ({"name": msg.name} if msg.name is not None else {}))
        elif has_system and msg.role in ("system", "developer"):
            system.append("".join(pieces))  # the walk has its own slot for instructions
        else:
            texts.append((msg.role, "".join(pieces)))
    if template is not None:
        return template.render(conversation), None, image
    sys_text = "\n".join(system) if system else None
    if len(texts) == 1:
        return texts[0][1], sys_text, image
    return "\n".join(f"{r}: {t}" for r, t in texts) + "\nassistant:", sys_text, image


def input_rate(state: ServerState, walk: str) -> int:
    """The sample rate a walk's audio input wants: its prompt node's (`media.node_input_rate`:
    Qwen3-Omni's processor reads `features.sampling_rate`, from the checkpoint's
    preprocessor_config.json), else DEFAULT_INPUT_RATE."""
    codec = state.codecs.get(walk)
    return node_input_rate(codec.node) if codec is not None and codec.node is not None else DEFAULT_INPUT_RATE


def decode_input_audio(part: InputAudioPart, param: str, rate: int) -> torch.Tensor:
    """An `input_audio` part as float mono samples at `rate` Hz; a 400 naming the field if it
    cannot be read."""
    if part.input_audio.format != "wav":
        raise bad_request(f"input_audio format '{part.input_audio.format}' is not decoded by this server (no "
                          "decoder is bundled); send a WAV file with format 'wav'", f"{param}.input_audio.format",
                          "unsupported")
    data = part.input_audio.data
    if data.startswith("data:"):  # a data: URL, as some clients send it
        data = data.partition(",")[2]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("input_audio.data is not valid base64", f"{param}.input_audio.data",
                          "invalid_audio") from None
    try:
        samples, got = decode_wav(raw)
    except ValueError as e:
        raise bad_request(f"input_audio: {e}", f"{param}.input_audio.data", "invalid_audio") from None
    return resample(samples, got, rate)


def _limit(state: ServerState, body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The reply's token limit and the field that set it (checked even when the walk has no
    token-count input: the server cuts the reply itself)."""
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    want = body.max_completion_tokens or body.max_tokens
    check_token_limit(state, param, want)
    return want, param


def _ids(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [int(x) for x in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else []


class Reply:
    """One chat reply being produced: token ids in, text pieces and the finish reason out."""

    def __init__(self, state: ServerState, flight: Flight, role: WalkRole, limit: int | None):
        self.flight, self.role, self.limit = flight, role, limit
        self.bound = token_limit(state)  # the plan's: a walk that decoded this many was cut, not stopped
        codec = state.codecs.get(role.walk)
        self.text = TextStream(codec) if codec is not None else None
        self.finish: str | None = None
        self.parts: list[str] = []

    def take(self, name: str, value: Any) -> str:
        """The text of one streamed item ("" for other outputs, or after the limit)."""
        if name != self.role.output or self.finish is not None:
            return ""
        if isinstance(value, str):
            self.flight.tokens += 1
            piece = value
        else:
            ids = _ids(value)
            if self.limit is not None:
                ids = ids[: max(0, self.limit - self.flight.tokens)]
            self.flight.tokens += len(ids)
            piece = self.text.push(ids) if self.text is not None else " ".join(map(str, ids))
        if self.limit is not None and self.flight.tokens >= self.limit:
            self.finish = "length"
            piece += self.text.flush() if self.text is not None else ""
        self.parts.append(piece)
        return piece

    def end(self) -> str:
        """Text held back until the end; sets the natural finish reason."""
        tail = self.text.flush() if self.text is not None and self.finish is None else ""
        self.finish = self.finish or ("length" if self.cut(None) else "stop")
        self.parts.append(tail)
        return tail

    def cut(self, limit: int | None) -> bool:
        """Whether the reply ended at `limit` tokens, or its walk ran into the plan's bound
        (finish reason "length"): as many tokens as the decode loop's bound allows, and no
        transition after it (a walk whose model stopped hands on, as chat -> continue does;
        past a transition the tokens of two walks add up, so the bound says nothing)."""
        if limit is not None and self.flight.tokens >= limit:
            return True
        if self.bound is None or self.flight.tokens < self.bound:
            return False
        return self.flight.handle.summary()["walks"] == [self.role.walk]

    def usage(self) -> dict[str, int]:
        p, c = self.flight.prompt_tokens, self.flight.tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class SpokenReply:
    """One reply in text and audio (modalities ["text", "audio"]): the walk's text is the
    transcript, its audio 16-bit PCM chunks; see the module docstring for the format."""

    def __init__(self, state: ServerState, flight: Flight, speech: SpeechWalk, limit: int | None, fmt: str,
                 created: int):
        role = speech.role
        assert speech.transcript is not None
        # no limit of the server's own: the walk's max_tokens bounds the text, and the audio follows it
        self.text = Reply(state, flight, dataclasses.replace(role, output=speech.transcript), None)
        self.audio_output, self.limit, self.flight = role.output, limit, flight
        self.fmt, self.rate = fmt, state.sample_rate
        self.id = f"audio_{uuid.uuid4().hex}"
        self.expires_at = created  # nothing is kept for later turns
        self.pcm: list[bytes] = []
        self.finish: str | None = None

    def take(self, name: str, value: Any) -> dict[str, str] | None:
        """The `delta.audio` of one streamed item (a transcript piece or a PCM chunk), or None."""
        if name == self.audio_output:
            chunk = pcm16(value)
            self.pcm.append(chunk)
            return {"data": b64(chunk)} if chunk else None
        piece = self.text.take(name, value)
        return {"transcript": piece} if piece else None

    def end(self) -> str:
        """The transcript's held-back tail; sets the finish reason ("length" when the text
        reached max_tokens)."""
        tail = self.text.end()
        self.finish = "length" if self.text.cut(self.limit) else "stop"
        return tail

    def audio(self) -> dict[str, Any]:
        """The whole reply's `message.audio`."""
        pcm = b"".join(self.pcm)
        data = wav_header(self.rate, len(pcm)) + pcm if self.fmt == "wav" else pcm
        return {"id": self.id, "data": b64(data), "expires_at": self.expires_at,
                "transcript": "".join(self.text.parts)}

    def usage(self) -> dict[str, int]:
        return self.text.usage()


def image_part(body: ChatCompletionRequest) -> str | None:
    """Where the request's first image part is (`messages[i].content[j]`), or None."""
    for i, msg in enumerate(body.messages):
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
            if part.type == "image_url":
                return f"messages[{i}].content[{j}]"
    return None


def has_image(body: ChatCompletionRequest) -> bool:
    return image_part(body) is not None


def pick_walk(state: ServerState, body: ChatCompletionRequest) -> WalkRole:
    """The walk that serves a chat request: `chat`, or `understand` for a request with an
    image when `chat` takes none (or when the plan has no `chat`)."""
    chat, understand = state.walks.chat, state.walks.understand
    if chat is not None and (image_input(chat) is not None or understand is None or not has_image(body)):
        return chat
    if understand is not None and (has_image(body) or chat is None):
        if not has_image(body):
            raise bad_request(f"walk '{understand.walk}' answers questions about an image: add an image_url part "
                              "(this plan has no text-only chat walk)", "messages", "missing")
        return understand
    raise bad_request("this plan's chat walk answers in speech only: use modalities ['text', 'audio'] with audio: "
                      "{\"voice\": ..., \"format\": ...}", "modalities", "unsupported_modality")


def spoken_walk(state: ServerState) -> SpeechWalk | None:
    """The walk that answers modalities ["text", "audio"]: the chat walk whose declaration binds
    `audio` (Qwen3-Omni's `speech`), its `text` the transcript."""
    return state.walks.spoken


def check_modalities(body: ChatCompletionRequest, speech: SpeechWalk | None) -> bool:
    """Whether the request wants audio out; a 400 for a combination this plan cannot answer."""
    wanted = set(body.modalities or ["text"])
    if "audio" not in wanted:
        if body.audio is not None:
            raise bad_request("audio (the voice and format of spoken output) needs modalities ['text', 'audio']",
                              "audio")
        return False
    if "text" not in wanted:
        raise bad_request("audio output comes with its transcript: use modalities ['text', 'audio']", "modalities",
                          "unsupported_modality")
    if speech is None:
        at = (body.modalities or []).index("audio")
        raise bad_request("this plan has no walk that answers in speech; use modalities ['text']",
                          f"modalities[{at}]", "unsupported_modality")
    if body.audio is None:
        raise bad_request("modalities ['text', 'audio'] needs audio: {\"voice\": ..., \"format\": \"wav\" or "
                          "\"pcm16\"}", "audio", "missing")
    if body.stream and body.audio.format != "pcm16":
        raise bad_request(f"a streamed audio reply is pcm16 (as OpenAI's), not {body.audio.format}", "audio.format",
                          "unsupported")
    return True


def install(app: FastAPI, state: ServerState) -> None:
    from fastapi.responses import StreamingResponse

    served = [r.walk for r in (state.walks.chat, state.walks.understand) if r is not None]
    speech = spoken_walk(state)
    if speech is not None:
        served.append(speech.role.walk)
        if speech.role.walk not in state.codecs:  # prompt token counts, and the audio input's rate
            state.codecs[speech.role.walk] = TextCodec(state.plan, speech.role.walk, speech.role.text_input,
                                                       state.config.weights)
    # each served walk's chat template, or None (plain text): found and compiled once, here
    roles = [r for r in (state.walks.chat, state.walks.understand, speech.role if speech else None) if r is not None]
    templates = {r.walk: template_for(state.plan, r.walk, r.text_input, state.config.weights) for r in roles}

    @app.post("/v1/chat/completions", tags=["openai"], responses=ERROR_RESPONSES,
              summary=f"Chat completions (walk {' / '.join(repr(w) for w in served)}), optionally streamed as SSE")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(state, body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if body.stop:  # OpenAI's and vLLM's clients send null or [] when they mean none
            raise bad_request("stop sequences are not supported by this server; leave 'stop' out", "stop",
                              "unsupported")
        spoken = check_modalities(body, speech)
        role = speech.role if spoken and speech is not None else pick_walk(state, body)
        # a walk that renders the turns itself gets them apart, with a clip per message (serve.turns)
        by_turns = renders_turns(role) and templates.get(role.walk) is None
        # a template over a long conversation, and an image part's decoding: off the event loop
        prompt, system, image = await asyncio.to_thread(render_prompt, body, role, templates.get(role.walk), by_turns)
        inputs, fields = prompt_inputs(role, prompt, system, "messages", "messages")
        if image is not None:
            name = image_input(role)
            assert name is not None
            inputs[name], fields[name] = image, image_part(body) or "messages"  # a node refusing it names the part
        heard = audio_part(body)
        if by_turns:
            turns = await asyncio.to_thread(message_turns, body, input_rate(state, role.walk), decode_input_audio)
            said, where = turn_inputs(role, turns, system, "messages", heard[0] if heard else "messages")
            inputs.update(said)
            fields.update(where)
        elif heard is not None:
            name = audio_input(role)
            assert name is not None  # render_prompt refused the part otherwise
            param, part = heard
            # decoding and resampling take a while for a long file: off the event loop
            inputs[name] = await asyncio.to_thread(decode_input_audio, part, param, input_rate(state, role.walk))
            fields[name] = param
        if spoken and speech is not None and speech.voice is not None and body.audio is not None:
            inputs[speech.voice], fields[speech.voice] = voice_of(body.audio.voice), "audio.voice"
        limit, limit_param = _limit(state, body)
        target = next((n for n in MAX_TOKEN_INPUTS if n in role.inputs), None)
        if limit is not None and target is not None:
            inputs[target], fields[target] = limit, limit_param
        for f in SAMPLING_FIELDS:
            value = getattr(body, f)
            if value is None or (f in NEUTRAL and value == NEUTRAL[f]):
                continue
            if f not in role.inputs:  # a reply sampled otherwise than asked would look like an answer to it
                raise bad_request(f"{f}: walk '{role.walk}' does not take {f} (it samples its own way); leave "
                                  f"{f} out", f, "unsupported")
            inputs[f], fields[f] = value, f
        extra = await walk_extras(state, role.walk, body.model_extra, set(inputs))
        inputs.update(extra)
        fields.update({k: k for k in extra})  # a node that rejects one blames it, not `messages`
        flight = await start_flight(state, request, "chat", role.walk, inputs, fields, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if spoken and speech is not None and body.audio is not None:
            created = int(time.time())
            said = SpokenReply(state, flight, speech, limit, body.audio.format, created)
            if not body.stream:
                return await _whole_spoken(flight, said, rid, state.model_id, created)
            return await _streamed_spoken(flight, said, rid, state.model_id, created, body, StreamingResponse)
        reply = Reply(state, flight, role, limit)
        if not body.stream:
            return await _whole(flight, reply, rid, state.model_id)
        return await _streamed(flight, reply, rid, state.model_id, body, StreamingResponse)


async def _whole(flight: Flight, reply: Reply, rid: str, model: str) -> Any:
    await flight.whole(_read_reply(flight, reply))
    reply.end()
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(reply.parts), "refusal": None},
                     "logprobs": None, "finish_reason": reply.finish}],
        "usage": reply.usage(),
    }


async def _read_reply(flight: Flight, reply: Reply) -> None:
    """Take the request's items into `reply` up to its end or its limit; a failure after the
    reply was complete (`after_the_reply`) is logged, not raised."""
    try:
        async with aclosing(flight.events()) as events:
            async for name, value in events:
                reply.take(name, value)
                if reply.finish is not None:
                    break  # the limit: Flight's exit cancels the rest
    except RequestFailed as e:
        if not after_the_reply(flight, e):
            raise


def after_the_reply(flight: Flight, e: RequestFailed) -> bool:
    """Whether `e` came after the served walk had ended: the walk moved on through a transition
    (BAGEL's chat -> draw, for a reply that opens an image) and that walk failed. The reply is
    then complete; the failure is logged, not answered. Cancellations, timeouts and shutdowns
    are the request's, whenever they happen."""
    if e.finish_reason != "error" or flight.walk not in flight.handle.summary()["walks"]:
        return False
    log.warning("request %s: walk '%s' ended, then the walk it moved on to failed (%s); the reply is the walk's "
                "text", e.request_id, flight.walk, e.message)
    return True


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _chunker(rid: str, created: int, model: str, include_usage: bool) -> Callable[..., str]:
    """`chunk(delta, finish=None)`: one `chat.completion.chunk` SSE event of this reply (with
    `"usage": null` when the client asked for usage, as OpenAI sends it on every chunk)."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return _sse(obj)

    return chunk


def _closing(flight: Flight, chunk: Callable[..., str], failed: RequestFailed | None, finish: str | None,
             usage: dict[str, Any] | None, ids: tuple[str, int, str]) -> Iterator[str]:
    """The end of a streamed reply, after its last delta: the chunk with the finish reason (the
    failure's for a failed request), the usage chunk when the client asked for it (`usage` not
    None), the error event of a failed request, `[DONE]`. `ids`: (reply id, created, model)."""
    if failed is None:
        flight.outcome = "finished"
        yield chunk({}, finish)
    else:
        yield chunk({}, failed.finish_reason)
    if usage is not None:
        rid, created, model = ids
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": usage})
    if failed is not None:
        yield _sse(flight.error_for(failed).body())
    yield "data: [DONE]\n\n"


def _event_stream(flight: Flight, events: AsyncGenerator[tuple[str, Any], None],
                  lines: AsyncGenerator[str, None], streaming: Any) -> Any:
    """The SSE response of a streamed reply: the events LINES yields (read from the flight's
    EVENTS). A client that leaves mid-stream ends it quietly (nobody to tell; the flight cancels
    the request); however it ends, LINES and EVENTS are closed and the flight finished."""

    async def body() -> AsyncIterator[str]:
        try:
            async for line in lines:
                yield line
        except ClientGone:
            return
        finally:
            await lines.aclose()  # neither suspends: each generator is finished or at a yield
            await events.aclose()
            flight.finish()

    return streaming(body(), media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _streamed(flight: Flight, reply: Reply, rid: str, model: str, body: ChatCompletionRequest,
                    streaming: Any) -> Any:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = int(time.time())
    events = flight.events()

    def text(name: str, value: Any) -> str | None:
        piece = reply.take(name, value)
        return piece if piece or reply.finish is not None else None

    try:  # wait for the first piece of text (or the end) before committing to a 200
        first = await flight.head(events, text)
    except ApiError as e:
        # as `after_the_reply`: only a failure (400, 413, 500), not a cancel, timeout or shutdown
        if e.status not in (400, 413, 500) or flight.walk not in flight.handle.summary()["walks"]:
            return error_response(e)
        first = []  # the walk ended without text, then a transition's walk failed: an empty reply
        log.warning("request %s: walk '%s' ended, then the walk it moved on to failed (%s); the reply is "
                    "the walk's text", flight.handle.id, flight.walk, e.message)

    chunk = _chunker(rid, created, model, include_usage)

    async def body_stream() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        for piece in first:
            if piece:
                yield chunk({"content": piece})
        failed: RequestFailed | None = None
        if reply.finish is None:
            try:
                async for name, value in events:
                    piece = reply.take(name, value)
                    if piece:
                        yield chunk({"content": piece})
                    if reply.finish is not None:
                        break
            except RequestFailed as e:
                failed = None if after_the_reply(flight, e) else e
        if failed is None:
            tail = reply.end()
            if tail:
                yield chunk({"content": tail})
        for line in _closing(flight, chunk, failed, reply.finish, reply.usage() if include_usage else None,
                             (rid, created, model)):
            yield line

    return _event_stream(flight, events, body_stream(), streaming)


async def _whole_spoken(flight: Flight, said: SpokenReply, rid: str, model: str, created: int) -> Any:
    await flight.whole(_read_spoken(flight, said))
    said.end()
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "refusal": None,
                                             "audio": said.audio()},
                     "logprobs": None, "finish_reason": said.finish}],
        "usage": said.usage(),
    }


async def _read_spoken(flight: Flight, said: SpokenReply) -> None:
    async with aclosing(flight.events()) as events:
        async for name, value in events:
            said.take(name, value)


async def _streamed_spoken(flight: Flight, said: SpokenReply, rid: str, model: str, created: int,
                           body: ChatCompletionRequest, streaming: Any) -> Any:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = flight.events()
    try:  # the first transcript piece or audio chunk (or the end) before committing to a 200
        first = await flight.head(events, said.take)
    except ApiError as e:
        return error_response(e)

    chunk = _chunker(rid, created, model, include_usage)

    named = False

    def audio_chunk(audio: dict[str, Any]) -> str:
        nonlocal named
        if not named:  # the first audio delta carries the reply's audio id
            audio, named = {"id": said.id, **audio}, True
        return chunk({"audio": audio})

    async def body_stream() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": None, "refusal": None})
        for audio in first:
            yield audio_chunk(audio)
        failed: RequestFailed | None = None
        try:
            async for name, value in events:
                audio = said.take(name, value)
                if audio is not None:
                    yield audio_chunk(audio)
        except RequestFailed as e:
            failed = e
        if failed is None:
            tail = said.end()
            if tail:
                yield audio_chunk({"transcript": tail})
            yield audio_chunk({"expires_at": said.expires_at})
        for line in _closing(flight, chunk, failed, said.finish, said.usage() if include_usage else None,
                             (rid, created, model)):
            yield line

    return _event_stream(flight, events, body_stream(), streaming)


__all__ = ["audio_input", "audio_part", "check_modalities", "decode_input_audio", "has_image", "image_input",
           "image_part", "input_rate", "install", "pick_walk", "render_prompt", "spoken_walk", "system_input"]
