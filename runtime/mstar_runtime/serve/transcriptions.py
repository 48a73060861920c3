"""`POST /v1/audio/transcriptions` and `/v1/audio/translations`, each installed only for the
walk that declares it (`serves transcriptions(file = audio, ...)`: Whisper's `transcribe` and
`translate`; docs/walk-language.md, "Routes"): the audio goes to the `file` slot (16 kHz
samples, a float [S] tensor), the transcript is the `text` slot, its streamed ids `tokens`
(a walk without a `text` slot: its ids, detokenized as they stream, below; as numbers when
its node has no `detokenize`).

The request is OpenAI's multipart form: `file` (the audio), `model`, and optionally
`language` (transcriptions only: a code such as "en" or a name; none detects it), `prompt`
(text the window is conditioned on), `response_format` (`json` default, `text`, `srt`,
`vtt`, `verbose_json`), `temperature` (0 to 1; 0 is greedy, raised as OpenAI's API does
while a window misses the fallback thresholds: `FALLBACK`, transformers' long-form settings,
each a walk input the body may set), each to the slot of its name
(a walk that binds none refuses the field, or the segment formats without `timestamps` and
`segments` slots, with a 400 naming it), `timestamp_granularities[]`
(`segment`; `word` is a 400: no word timings are computed) and `stream`. Other fields are
inputs of the walk (the openai client's `extra_body`: `max_tokens`, `seed`), typed by the
input's declared type and checked as on every route (`app.walk_extras`); an unknown one is
a 400 naming it (`include[]`, `chunking_strategy`: not served).

Audio in (`decode_audio`). WAV, FLAC, OGG (Vorbis, Opus) and MP3, anything libsndfile reads
(through `soundfile`), any channel count (averaged to mono), at 4 to 384 kHz, resampled to
16 kHz by the resampler every input shares (`mstar_runtime.media.resample`). An empty
file, a file that does not decode, one without samples, a sample rate outside that range (0 included), or audio
longer than the plan's `max_audio_seconds` (Whisper's: 1800 s) is a 400 naming `file`; a
file over 25 MB (OpenAI's limit) is a 413. Audio over 30 s is transcribed in windows (the
walk's long-form loop), which seek from timestamps: the route asks for them whatever the
response format.

Responses. `json`: `{"text", "usage": {"type": "duration", "seconds"}}`; `text`: the text;
`srt` / `vtt`: the segments as subtitles; `verbose_json`: `{"task", "language" (the walk's
`detected_language` slot: the name, "english"),
"duration", "text", "segments": [{"id", "seek", "start", "end", "text", "tokens",
"temperature", "avg_logprob", "compression_ratio", "no_speech_prob"}], "usage"}`: each
segment's window's seek (mel frames), the temperature its accepted decode ran at, that
decode's mean token log-probability, the compression ratio of its tokens and the
probability of <|nospeech|> (the walk's values, windows.py). The segment formats ask the
walk for timestamps; `json` and `text` on audio of up to 30 s do not (`<|notimestamps|>` in
the prompt, as OpenAI's plain transcripts).

Streaming (`stream=true`, with `json` or `text`): server-sent events as OpenAI sends them,
`transcript.text.delta` (`{"type", "delta"}`) as windows are decoded (a window's tokens
once its decode stands: a fallback may still replace an attempt), then one
`transcript.text.done` (`{"type", "text", "usage"}`); a request that fails after the stream
started ends with an `error` event. The text so far is the walk's `detokenize` phase of the
node that writes `text`, run on a copy of that node in the server (a tokenizer: no weights),
a delta held back while it ends in an incomplete UTF-8 character.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Annotated, Any

import torch

from mstar_runtime.api import RequestFailed
from mstar_runtime.media import MAX_RATE, MIN_RATE, resample
from mstar_runtime.serve.app import ERROR_RESPONSES, check_model, start_flight, walk_extras
from mstar_runtime.serve.common import ApiError, ClientGone, bad_request
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.io import form_value
from mstar_runtime.serve.web import File, Form, Request, UploadFile

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.plan.loader import Plan
    from mstar_runtime.serve.state import ServerState, WalkRole

RATE = 16000  # what the walks' `audio` input holds
MAX_FILE_BYTES = 25 * 2**20
DEFAULT_MAX_SECONDS = 30.0
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
SEGMENT_FORMATS = ("srt", "vtt", "verbose_json")
# slot -> the form field a node's complaint about its walk input names
FIELDS = {"file": "file", "language": "language", "prompt": "prompt", "temperature": "temperature",
          "timestamps": "response_format"}
TASKS = {"transcriptions": "transcribe", "translations": "translate"}  # verbose_json's `task`
WINDOW_SAMPLES = 30 * RATE  # one window: longer audio needs timestamps to seek by
# what a request at temperature 0 decodes with, unless its body sets them (walk inputs):
# transformers' long-form fallback settings (their compression ratio is zlib over token ids)
FALLBACK = {"fallback_temperatures": torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0]), "compression_ratio_threshold": 1.35,
            "logprob_threshold": -1.0, "no_speech_threshold": 0.6}
# a verbose_json segment's decode statistics, as the walk's segments give them
STATS = ("avg_logprob", "compression_ratio", "no_speech_prob", "temperature")
# the form fields the route reads itself; any other is a walk input (`max_tokens`, `seed`) or a 400
OWN_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
              "stream"}


def install(app: FastAPI, state: ServerState) -> None:
    for route, role in (("transcriptions", state.walks.transcriptions), ("translations", state.walks.translations)):
        if role is not None:
            _install(app, state, route, role)


# ----------------------------------------------------------------------------- audio in
def decode_audio(data: bytes, max_seconds: float) -> tuple[torch.Tensor, float]:
    """An uploaded audio file as float32 mono samples at 16 kHz and its duration in seconds;
    an ApiError naming `file` for anything the module docstring refuses."""
    import numpy as np
    import soundfile

    if not data:
        raise bad_request("file is empty: send the audio to transcribe", "file", "invalid_audio")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames = int(f.samplerate), int(f.frames)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise bad_request(f"file: the audio's sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} Hz are "
                                  "read", "file", "invalid_audio")
            # the length before reading it: a long file is refused without being decoded
            if frames > 0 and frames / rate > max_seconds:
                raise _too_long(frames / rate, max_seconds)
            samples = f.read(dtype="float32", always_2d=True)
    except ApiError:
        raise
    except Exception as e:  # soundfile raises LibsndfileError, RuntimeError, TypeError for what it cannot read
        raise bad_request(f"file: cannot decode the audio ({_reason(e)}); send WAV, FLAC, OGG or MP3", "file",
                          "invalid_audio") from None
    if samples.shape[0] == 0:
        raise bad_request("file holds no audio samples", "file", "invalid_audio")
    duration = samples.shape[0] / rate
    if duration > max_seconds:  # formats whose length is only known once read (some MP3s)
        raise _too_long(duration, max_seconds)
    mono = samples.mean(axis=1, dtype=np.float64)
    if not np.isfinite(mono).all():
        raise bad_request("file holds NaN or infinite samples", "file", "invalid_audio")
    out = resample(torch.from_numpy(np.clip(mono, -1.0, 1.0).astype(np.float32)), rate, RATE)
    # rounding up may add one sample past the limit: the walk takes at most max_seconds of it
    return out[: int(max_seconds * RATE)], duration


def _too_long(seconds: float, limit: float) -> ApiError:
    return bad_request(f"file: the audio is {seconds:.2f} s long; this model takes at most {limit:g} s",
                       "file", "audio_too_long")


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return text.replace("<_io.BytesIO object>", "the upload")[:200]


def max_seconds(plan: Plan) -> float:
    value = plan.config.get("max_audio_seconds", DEFAULT_MAX_SECONDS)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else DEFAULT_MAX_SECONDS


# ----------------------------------------------------------------------------- text out
class TokenText:
    """The text of token ids, by the `detokenize` phase of the walk's text-writing node, run on a
    copy of that node in the server (see the module docstring); None when there is none."""

    def __init__(self, plan: Plan, walk: str, weights: str, output: str = "text"):
        self.node: Any = None
        name = _text_node(plan, walk, output)
        if name is None or "detokenize" not in plan.node(name).phases:
            return
        from mstar_runtime.weights import build_node, load_weights

        node = build_node(plan, name, plan.node(name).ranks[0], "cpu")
        if any(True for _ in node.parameters()):
            return  # never a second copy of a model's weights
        load_weights(node, plan, name, weights)
        self.node = node

    def text(self, ids: list[int]) -> str:
        out = self.node.run("detokenize", [{"tokens": torch.tensor(ids, dtype=torch.int32)}])[0]
        return str(out["text"])


def transcript(out: Mapping[str, Any], slots: Mapping[str, str], texts: TokenText) -> str:
    """A finished request's transcript: its `text` slot's output, else its `tokens` as text."""
    if "text" in slots:
        return str(out.get(slots["text"], ""))
    ids = out.get(slots["tokens"])
    flat = [int(t) for t in ids.reshape(-1).tolist()] if isinstance(ids, torch.Tensor) else []
    return texts.text(flat) if texts.node is not None else " ".join(map(str, flat))


def _text_node(plan: Plan, walk: str, output: str) -> str | None:
    """The node of the call whose result the walk emits as `output`."""
    stack: list[Any] = [plan.walk(walk).get("program")]
    bound: dict[str, str] = {}
    emitted: str | None = None
    while stack:
        op = stack.pop()
        if isinstance(op, list):
            stack.extend(op)
        elif isinstance(op, Mapping):
            if op.get("op") == "call":
                for _port, var in op.get("results", ()):
                    bound[var] = op["node"]
            elif op.get("op") == "emit" and op.get("output") == output:
                emitted = (op.get("value") or {}).get("var")
            stack.extend(v for v in op.values() if isinstance(v, (list, Mapping)))
    return bound.get(emitted) if emitted is not None else None


def _form_value(kind: str | None, value: Any) -> Any:
    """A form field as its walk input's type wants it (`io.form_value`); a file as sent."""
    return form_value(kind, value) if isinstance(value, str) else value


def subtitle_time(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[Mapping[str, Any]]) -> str:
    return "".join(f"{i}\n{subtitle_time(s['start'], ',')} --> {subtitle_time(s['end'], ',')}\n{s['text'].strip()}\n\n"
                   for i, s in enumerate(segments, start=1))


def vtt(segments: list[Mapping[str, Any]]) -> str:
    return "WEBVTT\n\n" + "".join(
        f"{subtitle_time(s['start'], '.')} --> {subtitle_time(s['end'], '.')}\n{s['text'].strip()}\n\n"
        for s in segments)


def _usage(duration: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ----------------------------------------------------------------------------- the routes
def _install(app: FastAPI, state: ServerState, route: str, role: WalkRole) -> None:
    from fastapi.responses import PlainTextResponse, StreamingResponse

    walk, slots = role.walk, role.slots
    limit = max_seconds(state.plan)
    kinds = {p["name"]: p["type"].get("kind") for p in state.plan.walk(walk)["inputs"]}
    texts = TokenText(state.plan, walk, str(state.config.weights), slots.get("text", slots["tokens"]))
    task = TASKS[route]
    responses = {**ERROR_RESPONSES, 200: {"description": "the transcript (json, text, srt, vtt, verbose_json) or "
                                                         "SSE events", "content": {"application/json": {},
                                                                                   "text/plain": {},
                                                                                   "text/event-stream": {}}}}

    @app.post(f"/v1/audio/{route}", tags=["openai"], responses=responses,
              summary=f"Speech to text (walk '{walk}'): a multipart form with the audio file")
    async def transcribe(request: Request,
                         file: Annotated[UploadFile, File(description="the audio: WAV, FLAC, OGG or MP3")],
                         model: Annotated[str, Form()],
                         language: Annotated[str | None, Form(max_length=32)] = None,
                         prompt: Annotated[str | None, Form(max_length=4096)] = None,
                         response_format: Annotated[str, Form()] = "json",
                         temperature: Annotated[float, Form(ge=0.0, le=1.0)] = 0.0,
                         granularities: Annotated[list[str] | None,
                                                  Form(alias="timestamp_granularities[]")] = None,
                         stream: Annotated[bool, Form()] = False) -> Any:
        check_model(state, model)
        if response_format not in FORMATS:
            raise bad_request(f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}",
                              "response_format")
        for g in granularities or ():
            if g == "word":
                raise bad_request("word timestamps are not computed; use timestamp_granularities[]=segment",
                                  "timestamp_granularities[]", "unsupported")
            if g != "segment":
                raise bad_request(f"timestamp_granularities[] must be 'segment', got {g!r}",
                                  "timestamp_granularities[]")
        if stream and response_format not in ("json", "text"):
            raise bad_request(f"stream is served for response_format json or text, not {response_format}", "stream",
                              "unsupported")
        if language and route == "translations":
            raise bad_request("translations take no language (the output is English)", "language", "unsupported")
        segmented = response_format in SEGMENT_FORMATS
        asked = {"language": language, "prompt": prompt, "temperature": temperature,
                 "timestamps": segmented and ("segments" not in slots or "timestamps" not in slots)}
        for slot, value in asked.items():
            if value and slot not in slots:  # a field the walk would not honour: refused, never ignored
                what = "response_format" if slot == "timestamps" else slot
                raise bad_request(f"{what}: walk '{walk}' gives no {'timed segments' if slot == 'timestamps' else slot}"
                                  f" (its {route} declaration binds no '{slot}' slot)", what, "unsupported")
        data = await file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ApiError(413, f"file is larger than {MAX_FILE_BYTES // 2**20} MB", param="file", code="too_large")
        import asyncio

        audio, duration = await asyncio.to_thread(decode_audio, data, limit)  # decoding is CPU work
        inputs: dict[str, Any] = {slots["file"]: audio}
        if "timestamps" in slots:
            # audio over one window is transcribed window by window, each seeking from a timestamp
            inputs[slots["timestamps"]] = segmented or audio.numel() > WINDOW_SAMPLES
        if "temperature" in slots:
            inputs[slots["temperature"]] = float(temperature)
        if language:
            inputs[slots["language"]] = language
        if prompt:
            inputs[slots["prompt"]] = prompt
        form = await request.form()  # parsed already by FastAPI (cached): the fields it did not declare
        raw = {k: _form_value(kinds.get(k), v) for k in form.keys() if k not in OWN_FIELDS
               for v in form.getlist(k)[-1:]}
        own = {slots[s] for s in ("file", "timestamps") if s in slots}  # set by the route only
        extra = await walk_extras(state, walk, raw, set(inputs) | own)
        inputs.update(extra)
        if temperature == 0:  # OpenAI's temperature 0: raised while the thresholds are missed
            for k, v in FALLBACK.items():
                if k in kinds:
                    inputs.setdefault(k, v.clone() if isinstance(v, torch.Tensor) else v)
        fields = {**{slots[s]: f for s, f in FIELDS.items() if s in slots}, **{k: k for k in extra}}
        flight = await start_flight(state, request, route, walk, inputs, fields, "file")
        if stream:
            return await _streamed(flight, texts, duration, slots, StreamingResponse)
        out = await flight.whole(flight.outputs())
        text = transcript(out, slots, texts)
        if response_format == "text":
            return PlainTextResponse(text)
        if response_format == "json":
            return {"text": text, "usage": _usage(duration)}
        segments = json.loads(out.get(slots["segments"]) or "[]")
        if response_format == "srt":
            return PlainTextResponse(srt(segments))
        if response_format == "vtt":
            return PlainTextResponse(vtt(segments), media_type="text/vtt")
        detected = str(out.get(slots["detected_language"], "")) if "detected_language" in slots else ""
        return {"task": task, "language": detected, "duration": duration, "text": text,
                "segments": [{"id": i, "seek": s.get("seek", 0), "start": s["start"], "end": s["end"],
                              "text": s["text"], "tokens": s["tokens"],
                              **{k: s.get(k, float(temperature) if k == "temperature" else None) for k in STATS}}
                             for i, s in enumerate(segments)],
                "usage": _usage(duration)}


async def _streamed(flight: Flight, texts: TokenText, duration: float, slots: Mapping[str, str],
                    response: Any) -> Any:
    """The SSE response of a streamed transcript (module docstring); errors before the first
    event are the route's 4xx/5xx, as for a whole response."""
    ids: list[int] = []
    sent = ""

    def delta() -> str | None:
        nonlocal sent
        if texts.node is None:
            return None
        text = texts.text(ids)
        if text.endswith("\ufffd") or not text.startswith(sent):
            return None  # an incomplete character: wait for its other bytes
        piece, sent = text[len(sent):], text
        return piece or None

    def take(name: str, value: Any) -> str | None:
        if name != slots["tokens"] or not isinstance(value, torch.Tensor):
            return None
        ids.extend(int(t) for t in value.reshape(-1).tolist())
        piece = delta()
        return None if piece is None else _sse({"type": "transcript.text.delta", "delta": piece})

    events = flight.events()
    head = await flight.head(events, take)

    async def body() -> AsyncIterator[str]:
        try:
            for event in head:
                yield event
            async with aclosing(events) as rest:
                async for name, value in rest:
                    event = take(name, value)
                    if event is not None:
                        yield event
            out = await flight.handle.aresult()
            text = transcript(out, slots, texts)
            if text[len(sent):] and text.startswith(sent):
                yield _sse({"type": "transcript.text.delta", "delta": text[len(sent):]})
            flight.outcome = "finished"
            yield _sse({"type": "transcript.text.done", "text": text, "usage": _usage(duration)})
        except RequestFailed as e:
            err = flight.error_for(e)
            yield _sse({"type": "error", "error": err.body()["error"]})
        except ClientGone:
            return
        finally:
            flight.finish()

    return response(body(), media_type="text/event-stream")


__all__ = ["TokenText", "decode_audio", "install", "srt", "subtitle_time", "transcript", "vtt"]
