"""`POST /v1/audio/speech`, installed only when the plan has a walk for it (the image routes
are `serve.images`), and the audio a client sends (WAV files, resampled to a walk's rate).

Which walk. The walk that declares `serves speech(...)` (docs/walk-language.md, "Routes");
no walk declares it, no route. Its slots say where each field goes: Orpheus' `tts` binds
`input = text` (and `voice`, `audio` by their names); Qwen3-Omni's `speech` binds `input =
prompt`, `voice = speaker`, `instructions = system` and a `preamble`: its prompt is a user
turn the model would otherwise answer, so the route sends the preamble, which asks for the
input read aloud, with `instructions` after it.

Speech. `input` goes to the walk's `input` slot, `voice` to its `voice` slot (ignored when
the walk binds none), `speed` and
`instructions` only to inputs of those names (else 400 unless left at their defaults);
extra body keys that are walk inputs pass through (`seed`,
`max_tokens`), typed and bounded as on every route (`app.walk_extras`, `app.check_inputs`:
int64, and a token count above the plan's limit is a 400, not clamped). The audio output is 16-bit mono at the plan's sample rate: `wav` or raw
`pcm`. Without `stream` the response is the whole file (exact WAV sizes). With `stream:
true` (or `stream_format: "audio"`) chunks are sent as the walk decodes them (a WAV header
of unknown length first); with `stream_format: "sse"`, OpenAI's `speech.audio.delta`
events carry base64 chunks and `speech.audio.done` ends the stream, with the usage of
`SpeechUsage` (the prompt's tokens in, the tokens the walk emitted out). Streams start once the
first chunk exists (or the walk ended), so early failures are still 4xx. A raw stream that
fails later (a shutdown abort, a lost worker) has no way to say so inside the audio: it
ends cleanly, shorter (the chunked body is terminated, so clients read a complete but
truncated file, not a protocol error), and the server logs one line with the reason; an
SSE stream ends with an `error` event.

Audio in (the chat route's `input_audio` parts) is decoded and resampled by
`mstar_runtime.media` (`decode_wav`, `resample`), the module the command line and the
Python API read files with; its docstring says which WAV files are read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mstar_runtime.api import RequestFailed
from mstar_runtime.media import (  # the audio a client sends: shared with the CLI and the API
    decode_wav,
    resample,
)
from mstar_runtime.serve.app import ERROR_RESPONSES, check_model, error_response, start_flight, walk_extras
from mstar_runtime.serve.common import ClientGone, bad_request
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.io import b64, pcm16, wav_header
from mstar_runtime.serve.schemas import SpeechRequest
from mstar_runtime.serve.state import (  # re-exported: the speech walk is found there
    SpeechWalk,
    is_stream,
    speech_walk,
)
from mstar_runtime.serve.web import Request

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState, WalkRole

MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm"}
log = logging.getLogger("mstar_runtime.serve.server")

def install(app: FastAPI, state: ServerState) -> None:
    speech = speech_walk(state)
    if speech is not None:
        _install_speech(app, state, speech)


# ----------------------------------------------------------------------------- speech
def voice_of(voice: Any) -> str | None:
    """A request's voice: a name, or `{"id": name}`."""
    return voice.id if voice is not None and not isinstance(voice, str) else voice


async def speech_inputs(state: ServerState, speech: SpeechWalk,
                        body: SpeechRequest) -> tuple[dict[str, Any], dict[str, str]]:
    role = speech.role
    if not body.input.strip():
        raise bad_request("input is blank; give the text to speak", "input")
    inputs: dict[str, Any] = {role.text_input: body.input}
    fields = {role.text_input: "input"}
    voice = voice_of(body.voice)
    if voice is not None and speech.voice is not None:
        inputs[speech.voice], fields[speech.voice] = voice, "voice"
    if body.speed != 1.0:
        if "speed" not in role.inputs:
            raise bad_request(f"walk '{role.walk}' has no speed control; use speed 1.0", "speed", "unsupported")
        inputs["speed"], fields["speed"] = body.speed, "speed"
    if body.instructions and speech.instructions is None:
        raise bad_request(f"walk '{role.walk}' takes no instructions", "instructions", "unsupported")
    told = [t for t in (speech.preamble, body.instructions) if t]
    if told and speech.instructions is not None:
        inputs[speech.instructions] = "\n\n".join(told)
        fields[speech.instructions] = "instructions"
    extra = await walk_extras(state, role.walk, body.model_extra, set(inputs))
    inputs.update(extra)
    fields.update({k: k for k in extra})
    return inputs, fields


def _install_speech(app: FastAPI, state: ServerState, speech_walk: SpeechWalk) -> None:
    from fastapi.responses import Response, StreamingResponse

    from mstar_runtime.serve.text import TextCodec

    role = speech_walk.role
    rate = state.sample_rate
    if role.walk not in state.codecs:  # the SSE usage's input_tokens; the voice checked before queueing
        state.codecs[role.walk] = TextCodec(state.plan, role.walk, role.text_input, state.config.weights)
    outputs = state.plan.walk(role.walk)["outputs"]
    usage = SpeechUsage(tuple(
        o["name"] for o in outputs if o["name"] != role.output and is_stream(o, ("str", "i32", "i64"))))
    audio_responses = {**ERROR_RESPONSES, 200: {"description": "audio (wav or pcm), or SSE events",
                                               "content": {"audio/wav": {}, "audio/pcm": {}, "text/event-stream": {}}}}

    @app.post("/v1/audio/speech", tags=["openai"], responses=audio_responses, response_class=Response,
              summary=f"Text to speech (walk '{role.walk}'): wav or pcm, whole or streamed")
    async def speech(body: SpeechRequest, request: Request) -> Any:
        check_model(state, body.model)
        inputs, fields = await speech_inputs(state, speech_walk, body)
        flight = await start_flight(state, request, "speech", role.walk, inputs, fields, "input")
        sse = replace(usage, prompt=flight.prompt_tokens) if body.stream_format == "sse" else None
        fmt = body.response_format
        if not body.stream and body.stream_format is None:
            data = await flight.whole(_pcm(flight, role.output))
            payload = wav_header(rate, len(data)) + data if fmt == "wav" else data
            return Response(payload, media_type=MEDIA[fmt])
        return await _stream_speech(flight, role, fmt, rate, sse, StreamingResponse)


async def _pcm(flight: Flight, output: str) -> bytes:
    """The whole request's audio as 16-bit PCM."""
    return b"".join([pcm16(v) async for _, v in _audio(flight, output)])


async def _audio(flight: Flight, output: str) -> AsyncIterator[tuple[str, Any]]:
    async with aclosing(flight.events()) as events:
        async for name, value in events:
            if name == output:
                yield name, value


@dataclass(frozen=True)
class SpeechUsage:
    """The `usage` of an SSE stream's `speech.audio.done`: `input_tokens` the prompt node's
    count of the walk's prompt (`TextCodec.count`, taken by `app.start_flight`),
    `output_tokens` the tokens of the walk's token outputs the stream received (Orpheus: its
    audio codes; Qwen3-Omni: the spoken text's tokens; 0 for a walk that emits none)."""

    outputs: tuple[str, ...]
    prompt: int = 0

    def of(self, flight: Flight) -> dict[str, int]:
        generated = sum(flight.token_counts.get(name, 0) for name in self.outputs)
        return {"input_tokens": self.prompt, "output_tokens": generated, "total_tokens": self.prompt + generated}


async def _stream_speech(flight: Flight, role: WalkRole, fmt: str, rate: int, sse: SpeechUsage | None,
                         streaming: Any) -> Any:
    events = _audio(flight, role.output)
    flight.begin()
    first: list[bytes] = []
    ended = False
    try:  # the first chunk (or the end) before the 200
        async for _, value in events:
            first.append(pcm16(value))
            break
        else:
            ended = True
    except (RequestFailed, ClientGone) as e:
        return error_response(flight.fail_early(e))
    except BaseException:
        flight.finish()
        raise
    header = wav_header(rate, None) if fmt == "wav" else b""

    async def chunks() -> AsyncIterator[bytes]:
        yield header
        for c in first:
            yield c
        if not ended:
            async for _, value in events:
                yield pcm16(value)

    async def raw() -> AsyncIterator[bytes]:
        sent = 0
        try:
            async for c in chunks():
                if c:
                    yield c
                    sent += len(c)
            flight.outcome = "finished"
        except RequestFailed as e:
            # raw audio cannot carry an error: the body ends cleanly (the client has a shorter
            # file, not a protocol error) and the log says why, in one line
            message = " ".join(flight.error_for(e).message.split())
            log.warning("request %s (%s): the %s audio stream ended early after %d bytes: %s",
                        e.request_id, flight.walk, fmt, sent, message)
        except ClientGone:  # the client left mid-stream: nobody to tell; the flight cancels the request
            return
        finally:
            await events.aclose()
            flight.finish()

    async def events_sse() -> AsyncIterator[str]:
        try:
            try:
                async for c in chunks():
                    if c:
                        yield _sse({"type": "speech.audio.delta", "audio": b64(c)})
            except RequestFailed as e:
                yield _sse({"type": "error", **flight.error_for(e).body()})
                return
            flight.outcome = "finished"
            assert sse is not None  # events_sse serves SSE streams only
            yield _sse({"type": "speech.audio.done", "usage": sse.of(flight)})
        except ClientGone:  # the client left mid-stream: nobody to tell; the flight cancels the request
            return
        finally:
            await events.aclose()
            flight.finish()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Sample-Rate": str(rate)}
    if sse is not None:
        return streaming(events_sse(), media_type="text/event-stream", headers=headers)
    return streaming(raw(), media_type=MEDIA[fmt], headers=headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


__all__ = ["SpeechWalk", "decode_wav", "install", "resample", "speech_inputs",
           "speech_walk", "voice_of"]
