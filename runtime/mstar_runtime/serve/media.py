"""`POST /v1/audio/speech` (walk `tts`), `/v1/images/generations` (walk `t2i`) and
`/v1/images/edits` (walk `edit`). Each route exists only when its walk does.

Speech. `input` goes to the walk's `text`, `voice` to its `voice` input (ignored when the
walk has none), `speed` and `instructions` only to inputs of those names (else 400 unless
left at their defaults); extra body keys that are walk inputs pass through (`seed`,
`max_tokens`), typed and bounded as on every route (`app.walk_extras`, `app.check_inputs`:
int64, and a token count above the plan's limit is a 400, not clamped). The audio output is 16-bit mono at the plan's sample rate: `wav` or raw
`pcm`. Without `stream` the response is the whole file (exact WAV sizes). With `stream:
true` (or `stream_format: "audio"`) chunks are sent as the walk decodes them (a WAV header
of unknown length first); with `stream_format: "sse"`, OpenAI's `speech.audio.delta`
events carry base64 chunks and `speech.audio.done` ends the stream. Streams start once the
first chunk exists (or the walk ended), so early failures are still 4xx. A raw stream that
fails later (a shutdown abort, a lost worker) has no way to say so inside the audio: it
ends cleanly, shorter (the chunked body is terminated, so clients read a complete but
truncated file, not a protocol error), and the server logs one line with the reason; an
SSE stream ends with an `error` event.

Images. `b64_json` PNGs only (there is no file host for `url`); `n` images are `n` requests
(seeds `seed + i` when the walk takes a `seed`, so they differ); `size` goes to `width` /
`height` inputs when the walk has them, and is otherwise the walk's own. Edits take a
multipart form (`image` file, `prompt`, optional `mask` when the walk has a `mask` input).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Annotated, Any

import torch

from mstar_runtime.api import RequestFailed
from mstar_runtime.serve.app import ERROR_RESPONSES, check_model, error_response, start_flight, walk_extras
from mstar_runtime.serve.common import ApiError, ClientGone, Flight, bad_request
from mstar_runtime.serve.io import b64, decode_image, pcm16, png_bytes, wav_header
from mstar_runtime.serve.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_PROMPT_CHARS,
    SIZE_PATTERN,
    ImageGenerationRequest,
    SpeechRequest,
)

try:  # FastAPI resolves route annotations from module globals, so these cannot be local imports
    from fastapi import File, Form, Request, UploadFile
except ImportError:  # pragma: no cover - without the `serve` extra the module only has to import
    Request = UploadFile = object  # type: ignore[assignment,misc]
    File = Form = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.server import ServerState, WalkRole

MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm"}
log = logging.getLogger("mstar_runtime.serve.server")


def install(app: FastAPI, state: ServerState) -> None:
    if state.walks.tts is not None:
        _install_speech(app, state, state.walks.tts)
    if state.walks.t2i is not None:
        _install_generations(app, state, state.walks.t2i)
    if state.walks.edit is not None:
        _install_edits(app, state, state.walks.edit)


# ----------------------------------------------------------------------------- speech
def speech_inputs(state: ServerState, role: WalkRole, body: SpeechRequest) -> tuple[dict[str, Any], dict[str, str]]:
    if not body.input.strip():
        raise bad_request("input is blank; give the text to speak", "input")
    inputs: dict[str, Any] = {role.text_input: body.input}
    fields = {role.text_input: "input"}
    voice = body.voice.id if body.voice is not None and not isinstance(body.voice, str) else body.voice
    if voice is not None and "voice" in role.inputs:
        inputs["voice"], fields["voice"] = voice, "voice"
    if body.speed != 1.0:
        if "speed" not in role.inputs:
            raise bad_request(f"walk '{role.walk}' has no speed control; use speed 1.0", "speed", "unsupported")
        inputs["speed"], fields["speed"] = body.speed, "speed"
    if body.instructions:
        if "instructions" not in role.inputs:
            raise bad_request(f"walk '{role.walk}' takes no instructions", "instructions", "unsupported")
        inputs["instructions"], fields["instructions"] = body.instructions, "instructions"
    extra = walk_extras(state, role.walk, body.model_extra, set(inputs))
    inputs.update(extra)
    fields.update({k: k for k in extra})
    return inputs, fields


def _install_speech(app: FastAPI, state: ServerState, role: WalkRole) -> None:
    from fastapi.responses import Response, StreamingResponse

    rate = state.sample_rate
    audio_responses = {**ERROR_RESPONSES, 200: {"description": "audio (wav or pcm), or SSE events",
                                               "content": {"audio/wav": {}, "audio/pcm": {}, "text/event-stream": {}}}}

    @app.post("/v1/audio/speech", tags=["openai"], responses=audio_responses, response_class=Response,
              summary=f"Text to speech (walk '{role.walk}'): wav or pcm, whole or streamed")
    async def speech(body: SpeechRequest, request: Request) -> Any:
        check_model(state, body.model)
        inputs, fields = speech_inputs(state, role, body)
        flight = await start_flight(state, request, "speech", role.walk, inputs, fields, "input")
        fmt = body.response_format
        if not body.stream and body.stream_format is None:
            async with flight:
                try:
                    chunks = [pcm16(v) async for name, v in _audio(flight, role.output)]
                except RequestFailed as e:
                    return error_response(flight.error_for(e))
                except ClientGone:
                    return error_response(ApiError(499, "client closed the request", code="cancelled"))
                flight.outcome = "finished"
            data = b"".join(chunks)
            payload = wav_header(rate, len(data)) + data if fmt == "wav" else data
            return Response(payload, media_type=MEDIA[fmt])
        return await _stream_speech(flight, role, fmt, rate, body.stream_format == "sse", StreamingResponse)


async def _audio(flight: Flight, output: str) -> AsyncIterator[tuple[str, Any]]:
    async with aclosing(flight.events()) as events:
        async for name, value in events:
            if name == output:
                yield name, value


async def _stream_speech(flight: Flight, role: WalkRole, fmt: str, rate: int, sse: bool, streaming: Any) -> Any:
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
            tokens = flight.items.get(role.output, 0)
            yield _sse({"type": "speech.audio.done",
                        "usage": {"input_tokens": 0, "output_tokens": tokens, "total_tokens": tokens}})
        except ClientGone:  # the client left mid-stream: nobody to tell; the flight cancels the request
            return
        finally:
            await events.aclose()
            flight.finish()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Sample-Rate": str(rate)}
    if sse:
        return streaming(events_sse(), media_type="text/event-stream", headers=headers)
    return streaming(raw(), media_type=MEDIA[fmt], headers=headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ----------------------------------------------------------------------------- images
def _image_inputs(role: WalkRole, prompt: str, size: str | None, seed: Any, i: int) -> tuple[dict[str, Any], dict[str, str]]:
    inputs: dict[str, Any] = {role.text_input: prompt}
    fields = {role.text_input: "prompt"}
    if size and size != "auto" and "width" in role.inputs and "height" in role.inputs:
        w, h = (int(x) for x in size.split("x"))
        inputs["width"], inputs["height"] = w, h
        fields["width"] = fields["height"] = "size"
    if "seed" in role.inputs:
        base = seed if isinstance(seed, int) and not isinstance(seed, bool) else role.inputs["seed"]["default"] or 0
        inputs["seed"], fields["seed"] = base + i, "seed"
    return inputs, fields


async def _images(state: ServerState, request: Request, route: str, role: WalkRole,
                  per_image: list[tuple[dict[str, Any], dict[str, str]]]) -> Any:
    flights: list[Flight] = []
    try:
        for inputs, fields in per_image:
            flights.append(await start_flight(state, request, route, role.walk, inputs, fields, "prompt"))
    except BaseException:  # image k was refused: the k - 1 already submitted must not run on unseen
        for f in flights:
            f.handle.cancel()
        raise

    async def one(flight: Flight) -> bytes:
        async with flight:
            outputs = await flight.outputs()
            flight.outcome = "finished"
        image = outputs.get(role.output)
        if not isinstance(image, torch.Tensor):
            raise ApiError(500, f"walk '{role.walk}' finished without its '{role.output}' output",
                           type="server_error", code="no_output")
        try:
            return png_bytes(image)
        except ValueError as e:
            raise ApiError(500, f"walk '{role.walk}': {e}", type="server_error", code="bad_output") from None

    results = await asyncio.gather(*(one(f) for f in flights), return_exceptions=True)
    for f, r in zip(flights, results):
        if isinstance(r, RequestFailed):
            return error_response(f.error_for(r))
        if isinstance(r, ClientGone):
            return error_response(ApiError(499, "client closed the request", code="cancelled"))
        if isinstance(r, BaseException):
            raise r
    return {"created": int(time.time()), "data": [{"b64_json": b64(png)} for png in results]}


def _install_generations(app: FastAPI, state: ServerState, role: WalkRole) -> None:

    @app.post("/v1/images/generations", tags=["openai"], responses=ERROR_RESPONSES,
              summary=f"Text to image (walk '{role.walk}'): b64_json PNGs")
    async def generations(body: ImageGenerationRequest, request: Request) -> Any:
        check_model(state, body.model)
        extra = walk_extras(state, role.walk, body.model_extra, {role.text_input, "width", "height"})
        seed = extra.pop("seed", None)
        per = []
        for i in range(body.n):
            inputs, fields = _image_inputs(role, body.prompt, body.size, seed, i)
            per.append(({**extra, **inputs}, {**{k: k for k in extra}, **fields}))
        return await _images(state, request, "images", role, per)


def _install_edits(app: FastAPI, state: ServerState, role: WalkRole) -> None:
    image_input = next(n for n, p in role.inputs.items() if p["type"]["kind"] == "image")

    @app.post("/v1/images/edits", tags=["openai"], responses=ERROR_RESPONSES,
              summary=f"Image edit (walk '{role.walk}'): multipart form in, b64_json PNGs out")
    async def edits(request: Request, image: Annotated[UploadFile, File()],
                    prompt: Annotated[str, Form(min_length=1, max_length=MAX_PROMPT_CHARS)],
                    model: Annotated[str, Form()], mask: Annotated[UploadFile | None, File()] = None,
                    n: Annotated[int, Form(ge=1, le=10)] = 1,
                    size: Annotated[str | None, Form(pattern=SIZE_PATTERN)] = None,
                    response_format: Annotated[str | None, Form(pattern="^b64_json$")] = None,
                    seed: Annotated[int | None, Form(ge=INT64_MIN, le=INT64_MAX)] = None) -> Any:
        check_model(state, model)
        picture = await _read_image(image, "image")
        extra: dict[str, Any] = {image_input: picture}
        fields = {image_input: "image"}
        if mask is not None:
            if "mask" not in role.inputs:
                raise bad_request(f"walk '{role.walk}' takes no mask", "mask", "unsupported")
            extra["mask"], fields["mask"] = await _read_image(mask, "mask"), "mask"
        per = []
        for i in range(n):
            inputs, f = _image_inputs(role, prompt, size, seed, i)
            per.append(({**extra, **inputs}, {**fields, **f}))
        return await _images(state, request, "images", role, per)


async def _read_image(upload: Any, param: str) -> torch.Tensor:
    data = await upload.read()
    try:
        return decode_image(data)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param, "invalid_image") from None


__all__ = ["install", "speech_inputs"]
