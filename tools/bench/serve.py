"""A load generator for any OpenAI-compatible server: streamed speech, streamed chat and image requests,
at fixed concurrencies (closed loop) or Poisson arrival rates (open loop).

    python tools/bench/serve.py --base-url http://127.0.0.1:8000 --workload chat --concurrency 1,4 \
        --num-requests 32 --max-tokens 8                                        # a CPU smoke run
    python tools/bench/serve.py --base-url http://127.0.0.1:8000 --workload speech --request-rate 2,8,inf \
        --num-requests 100 --max-tokens 128 --prompts prompts.jsonl            # open loop, own prompts

It drives the server from outside, over HTTP only (`httpx`, asyncio), so the same command
measures our server, vLLM, SGLang or the M* reference's: nothing here imports the runtime.

Workloads (`--workload`, a comma list; `speech=3,chat=1` mixes them by weight, each request
drawn with the run's seed):
- `speech`: `POST /v1/audio/speech` (`model`, `input`, `voice` (`--voice`, else the served
  model's `default_voice` from `GET /v1/models`, else none), `response_format` wav or pcm,
  `stream_format` audio or sse, or not streamed: `--speech-stream none`), the length in
  `--speech-length-field` (default `max_tokens`) = `--max-tokens`. Per request: TTFA, the
  time from sending the request to the first audio byte (past the WAV header: its `data`
  chunk is found by walking the RIFF chunks, so a longer header is read right); the audio's
  seconds counted from the PCM bytes actually received, at the rate, channels and sample
  width of the WAV header (pcm: the response's `X-Sample-Rate`, else `--sample-rate`, 16-bit
  mono); RTF = request latency / audio seconds (below 1: faster than real time); the stall
  a player starting at the first byte would suffer (seconds it would wait for audio that had
  not arrived). Run figures: audio seconds per second of wall time, and how many streams
  were real time (RTF < 1).
- `chat`: `POST /v1/chat/completions`, streamed with `stream_options.include_usage` (off with
  `--no-usage`), `max_tokens` = `--max-tokens` (`--ignore-eos` adds vLLM's and SGLang's
  `ignore_eos` for fixed lengths), optionally one generated PNG as an `image_url` data-URL
  part (`--chat-image-size WxH`). From the SSE chunks: TTFT (to the first chunk with text),
  inter-token latency (the gaps between successive chunks with text: per chunk, as vLLM's
  benchmark counts it), TPOT ((latency - TTFT) / (tokens - 1)), output tokens from the
  usage chunk (else the chunks with text; `tokens_from` says which), tokens per second.
- `images`: `POST /v1/images/generations` (`size` = `--image-size`, `n`, `b64_json`), not
  streamed: latency, images per second.

A request counts as `ok` when it got a 200 and a complete body (a chat stream that reached
`[DONE]` without an error event, a speech SSE stream that reached `speech.audio.done`, a raw
audio body that ended cleanly), `cancelled` when this tool closed it on purpose
(`--cancel-fraction` of the streamed requests, after 1 to 3 chunks: the server should free
the request at once), else `failed`, with its HTTP status and error code or the exception's
type in the run's `errors` (a dead server, a reset connection, a bad body): the run goes on.
Figures are over `ok` requests; `--warmup` requests per run go first at the run's
concurrency and are left out of every figure. p50 / p90 / p99 are linear-interpolation
percentiles (`common.percentile`).

Modes: `--concurrency 1,16,64`: one closed-loop run per value, that many requests in flight
at all times until `--num-requests` were sent (default max(16, 4 x concurrency)) or
`--duration` seconds passed; `--request-rate 2,8,inf`: one open-loop run per rate,
requests sent at Poisson arrival times (exponential gaps drawn from `--seed`; `inf`: all at
once), however many are in flight (`--max-concurrency` caps them). The JSON (`--out`,
default $OUT/serve.json) is rewritten after every run: the command, the settings, the
served models (`GET /v1/models`), and per run the counts, errors, figures and, with
`--scrape-metrics`, the change of every counter of the server's `GET /metrics` over the run.
Exit status: 0 when every timed request was ok or cancelled, 1 when any failed (the table and
the JSON say which), 2 for bad usage.

GPU run (issue 17, section 4), not run this session: one H200, the Orpheus `bench` variant
with its end check disabled so that every request makes exactly 128 tokens, against our
server, then the same client against the M* reference's server when it is available (4 x
concurrency requests per run: 16 / 64 / 256 / 1,024):

    sed -E 's/(end_of_speech *= *)[0-9]+/\\12000000000/' models/orpheus/orpheus.walk > /tmp/orpheus_fixed.walk
    python -m mstarc.cli compile /tmp/orpheus_fixed.walk --variant bench -p placements/h200x1.yaml \
        -o /tmp/orpheus.plan
    mstar-run /tmp/orpheus.plan --serve --port 8000 --weights dummy --device cuda &
    python tools/bench/serve.py --base-url http://127.0.0.1:8000 --model orpheus --workload speech \
        --concurrency 1,16,64,256 --warmup 16 --max-tokens 128 \
        --scrape-metrics --out $OUT/serve_orpheus.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import random
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import percentile, table, write_json  # noqa: E402 - the sibling module (sys.path above)

WORKLOADS = ("speech", "chat", "images")
STREAMED = ("speech", "chat")
ENDPOINTS = {"speech": "/v1/audio/speech", "chat": "/v1/chat/completions", "images": "/v1/images/generations"}
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "birds", "sing",
    "near", "river", "bank", "under", "bright", "morning", "light", "every", "small", "stone", "holds", "old",
    "story", "about", "people", "who", "walked", "here", "long", "ago", "carrying", "bread", "and", "salt",
    "across", "green", "hills", "toward", "quiet", "town", "where", "bells", "rang", "at", "noon",
)
ERROR_BODY_BYTES = 64 << 10  # enough of an error body to read its message; a runaway body is cut
PCM_WIDTH = 2  # raw pcm responses: 16-bit mono, as OpenAI's speech API sends them


# ------------------------------------------------------------------------------ prompts
@dataclass(frozen=True)
class Prompt:
    """One request's content: the text (speech input, chat message, image prompt), or a JSONL
    row's own chat `messages`; its own `max_tokens`; extra body fields."""

    text: str
    messages: list[Any] | None = None
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def builtin_prompts(n: int, words: int, seed: int) -> list[Prompt]:
    """`n` distinct prompts of exactly `words` words each, drawn from a fixed word list with `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(Prompt(text[:1].upper() + text[1:] + "."))
    return out


def load_prompts(path: Path) -> list[Prompt]:
    """A JSONL prompt set: one object a line, with `prompt`, `text` or `input` (a string) or a
    chat `messages` list, and optionally `max_tokens` and `extra_body` (an object of extra
    fields); a line may also be a bare JSON string. Blank lines and `#` comments are skipped."""
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{where}: not JSON: {e.msg}") from None
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict):
            raise SystemExit(f"{where}: expected an object or a string, got {type(row).__name__}")
        text = next((row[k] for k in ("prompt", "text", "input") if isinstance(row.get(k), str)), None)
        messages = row.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise SystemExit(f"{where}: messages must be a list")
        if text is None and messages is None:
            raise SystemExit(f"{where}: needs a string `prompt` (or `text`, `input`) or a `messages` list")
        if text is None:  # the last text of the messages stands for them in speech and image requests
            text = next((m.get("content") for m in reversed(messages)
                         if isinstance(m, dict) and isinstance(m.get("content"), str)), "")
        max_tokens = row.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
            raise SystemExit(f"{where}: max_tokens must be an integer")
        extra = row.get("extra_body", {})
        if not isinstance(extra, dict):
            raise SystemExit(f"{where}: extra_body must be an object")
        prompts.append(Prompt(text, messages, max_tokens, extra))
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG of seeded noise (zlib and struct only: no imaging library on the client)."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(width * 3) for _ in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def parse_size(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise argparse.ArgumentTypeError(f"expected WxH (e.g. 64x64), got {text!r}")
    return int(w), int(h)


# ------------------------------------------------------------------------------ settings and results
@dataclass(frozen=True)
class Settings:
    """What every request of a run shares (from the command line)."""

    model: str
    max_tokens: int | None = None
    timeout_s: float = 600.0
    endpoints: dict[str, str] = field(default_factory=lambda: dict(ENDPOINTS))
    extra_body: dict[str, Any] = field(default_factory=dict)
    voice: str | None = None  # None: the served model's default_voice (GET /v1/models), else none sent
    speech_format: str = "wav"  # wav | pcm
    speech_stream: str = "audio"  # audio | sse | none
    speech_length_field: str = "max_tokens"  # "" sends no length
    sample_rate: int = 24000  # raw pcm without an X-Sample-Rate header
    include_usage: bool = True
    ignore_eos: bool = False
    temperature: float | None = None
    chat_image: str | None = None  # a data URL sent with every chat request
    image_size: str | None = None
    images_n: int = 1


@dataclass
class Result:
    """One request as the client saw it; times in seconds from sending it."""

    workload: str
    ok: bool = False
    cancelled: bool = False
    status: int | None = None
    error: str | None = None  # "HTTP 400 invalid_value", "ConnectError", ...: the key the run counts by
    message: str | None = None
    start: float = 0.0  # perf_counter when sent
    end: float = 0.0  # perf_counter when it ended, however it ended
    latency: float | None = None  # to the last byte
    first: float | None = None  # TTFA (speech), TTFT (chat)
    itl: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    tokens_from: str | None = None  # usage | chunks
    finish_reason: str | None = None
    chunks: int = 0  # chunks with audio or text
    audio_bytes: int = 0
    sample_rate: int | None = None
    bytes_per_second: int | None = None  # rate x channels x sample width
    stall: float | None = None
    images: int = 0
    image_bytes: int = 0

    @property
    def audio_s(self) -> float | None:
        return self.audio_bytes / self.bytes_per_second if self.bytes_per_second else None

    def fail(self, error: str, message: str | None = None) -> Result:
        self.ok, self.error, self.message = False, error, (message or "")[:500] or None
        return self


@dataclass(frozen=True)
class Job:
    index: int
    workload: str
    prompt: Prompt
    cancel_after: int | None  # close the stream after this many chunks with audio or text


def make_job(index: int, seed: int, mix: Sequence[tuple[str, float]], prompts: Sequence[Prompt],
             cancel_fraction: float) -> Job:
    """Job `index` of a run: its workload, prompt and cancellation drawn from (seed, index) alone,
    so that a run by count and a run by duration send the same requests in the same order."""
    rng = random.Random(seed * 1_000_003 + index)
    names, weights = zip(*mix)
    workload = rng.choices(names, weights)[0]
    cancel = rng.randint(1, 3) if workload in STREAMED and rng.random() < cancel_fraction else None
    return Job(index, workload, prompts[index % len(prompts)], cancel)


# ------------------------------------------------------------------------------ wire formats
class WavStream:
    """Counts the PCM bytes of a WAV (or raw pcm) body fed chunk by chunk. A WAV's header is
    read up to its `data` chunk (RIFF chunks walked in order, so `LIST` and other chunks before
    it are skipped); a streamed WAV's sizes may be 0xFFFFFFFF, so the data runs to the body's end."""

    def __init__(self, wav: bool, rate: int, sniff: bool = False):
        self.wav, self.header_done, self.sniff = wav, not wav, sniff
        self.buf = b""
        self.rate, self.channels, self.width = rate, 1, PCM_WIDTH

    def feed(self, chunk: bytes) -> int:
        """PCM bytes in `chunk`; ValueError when the body is not a PCM WAV."""
        if self.header_done:
            return len(chunk)
        self.buf += chunk
        if len(self.buf) < 12:
            return 0
        if self.buf[:4] != b"RIFF" or self.buf[8:12] != b"WAVE":
            if self.sniff:  # SSE deltas of raw pcm although wav was asked for: count them as pcm
                self.header_done, n, self.buf = True, len(self.buf), b""
                return n
            raise ValueError(f"not a WAV stream (starts {self.buf[:12]!r})")
        at = 12
        while len(self.buf) >= at + 8:
            kind, size = self.buf[at:at + 4], struct.unpack("<I", self.buf[at + 4:at + 8])[0]
            if kind == b"data":
                self.header_done = True
                rest = len(self.buf) - at - 8
                self.buf = b""
                return rest
            if len(self.buf) < at + 8 + size:
                return 0
            if kind == b"fmt ":
                if size < 16:
                    raise ValueError(f"a WAV fmt chunk of {size} bytes (PCM needs 16)")
                tag, self.channels, self.rate, _, _, bits = struct.unpack("<HHIIHH", self.buf[at + 8:at + 24])
                if tag not in (1, 0xFFFE) or bits % 8:
                    raise ValueError(f"a WAV of format {tag} with {bits}-bit samples: not integer PCM")
                self.width = bits // 8
            at += 8 + size + (size & 1)  # chunks are padded to even sizes
        return 0

    @property
    def bytes_per_second(self) -> int:
        return self.rate * self.channels * self.width


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data` of each server-sent event (several `data:` lines of one event joined by newlines)."""
    data: list[str] = []
    async for line in lines:
        if not line.strip():
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def stall_seconds(arrivals: Sequence[tuple[float, float]]) -> float:
    """Seconds a player that starts at the first audio would wait: arrivals are (time, seconds of audio)."""
    if not arrivals:
        return 0.0
    stall, play_end = 0.0, arrivals[0][0]
    for at, seconds in arrivals:
        if at > play_end:  # the player ran dry and waits for this chunk
            stall += at - play_end
            play_end = at
        play_end += seconds
    return stall


async def http_error(r: httpx.Response, res: Result) -> Result:
    """A non-200 answer: its status and the OpenAI error body's code and message."""
    res.status = r.status_code
    raw = b""
    async for chunk in r.aiter_bytes():
        raw += chunk
        if len(raw) > ERROR_BODY_BYTES:
            break
    code, message = None, raw[:500].decode(errors="replace")
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            code, message = err.get("code") or err.get("type"), str(err.get("message"))
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        pass
    return res.fail(f"HTTP {r.status_code}" + (f" {code}" if code else ""), message)


def stream_error(obj: Any) -> tuple[str, str] | None:
    """An `{"error": ...}` event (our servers and vLLM's), or a speech `{"type": "error"}` event."""
    if isinstance(obj, dict) and (obj.get("error") is not None or obj.get("type") == "error"):
        err = obj.get("error")
        if isinstance(err, dict):
            return f"stream error {err.get('code') or err.get('type') or ''}".strip(), str(err.get("message"))
        return "stream error", str(err)
    return None


# ------------------------------------------------------------------------------ requests
async def speech(client: httpx.AsyncClient, s: Settings, job: Job) -> Result:
    res = Result("speech", start=time.perf_counter())
    p = job.prompt
    body: dict[str, Any] = {"model": s.model, "input": p.text, "response_format": s.speech_format}
    if s.voice is not None:
        body["voice"] = s.voice
    if s.speech_stream != "none":
        body["stream_format"] = s.speech_stream
    length = p.max_tokens if p.max_tokens is not None else s.max_tokens
    if s.speech_length_field and length is not None:
        body[s.speech_length_field] = length
    body.update({**s.extra_body, **p.extra})
    t0 = res.start
    if s.speech_stream == "none":
        r = await client.post(s.endpoints["speech"], json=body)
        if r.status_code != 200:
            return await http_error(r, res)
        res.latency = res.first = time.perf_counter() - t0
        wav = WavStream(s.speech_format == "wav", int(r.headers.get("x-sample-rate") or s.sample_rate))
        res.audio_bytes, res.chunks = wav.feed(r.content), 1
        res.sample_rate, res.bytes_per_second = wav.rate, wav.bytes_per_second
        res.stall, res.ok, res.status = 0.0, True, 200
        return res
    arrivals: list[tuple[float, int]] = []
    async with client.stream("POST", s.endpoints["speech"], json=body) as r:
        if r.status_code != 200:
            return await http_error(r, res)
        res.status = 200
        # SSE deltas are the body in pieces (ours start with the WAV header), or raw pcm (sniffed)
        wav = WavStream(s.speech_format == "wav", int(r.headers.get("x-sample-rate") or s.sample_rate),
                        sniff=s.speech_stream == "sse")
        done = False
        if s.speech_stream == "audio":
            pieces: AsyncIterator[bytes] = r.aiter_bytes()
        else:
            pieces = _sse_audio(sse_events(r.aiter_lines()), res)
        async with aclosing(pieces) as it:  # closed at once on a break (a cancellation), not when collected
            async for piece in it:
                n = wav.feed(piece)
                if n:
                    arrivals.append((time.perf_counter(), n))
                    res.audio_bytes += n
                    if job.cancel_after is not None and len(arrivals) >= job.cancel_after:
                        res.cancelled = True
                        break
        done = s.speech_stream == "audio" or res.finish_reason == "done"
        if res.error is not None:
            return res
    res.latency = time.perf_counter() - t0
    res.chunks, res.sample_rate, res.bytes_per_second = len(arrivals), wav.rate, wav.bytes_per_second
    if arrivals:
        res.first = arrivals[0][0] - t0
        res.stall = stall_seconds([(at, n / wav.bytes_per_second) for at, n in arrivals])
    if res.cancelled:
        return res
    if not done:
        return res.fail("incomplete stream", "the SSE stream ended without speech.audio.done")
    res.ok = True
    return res


async def _sse_audio(events: AsyncIterator[str], res: Result) -> AsyncIterator[bytes]:
    """The audio of OpenAI's speech SSE events; `res.finish_reason` is "done" after `speech.audio.done`."""
    async for data in events:
        obj = json.loads(data)
        err = stream_error(obj)
        if err is not None:
            res.fail(*err)
            return
        if obj.get("type") == "speech.audio.delta":
            yield base64.b64decode(obj.get("audio") or "", validate=True)
        elif obj.get("type") == "speech.audio.done":
            res.finish_reason = "done"
            return


async def chat(client: httpx.AsyncClient, s: Settings, job: Job) -> Result:
    res = Result("chat", start=time.perf_counter())
    p = job.prompt
    if p.messages is not None:
        messages = p.messages
    elif s.chat_image is not None:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": s.chat_image}},
                                                 {"type": "text", "text": p.text}]}]
    else:
        messages = [{"role": "user", "content": p.text}]
    body: dict[str, Any] = {"model": s.model, "messages": messages, "stream": True}
    length = p.max_tokens if p.max_tokens is not None else s.max_tokens
    if length is not None:
        body["max_tokens"] = length
    if s.include_usage:
        body["stream_options"] = {"include_usage": True}
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.temperature is not None:
        body["temperature"] = s.temperature
    body.update({**s.extra_body, **p.extra})
    t0 = res.start
    last: float | None = None
    done = False
    async with client.stream("POST", s.endpoints["chat"], json=body) as r:
        if r.status_code != 200:
            return await http_error(r, res)
        res.status = 200
        async with aclosing(sse_events(r.aiter_lines())) as events:
            async for data in events:
                now = time.perf_counter()
                if data.strip() == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                err = stream_error(obj)
                if err is not None:
                    res.fail(*err)
                    continue  # read on to [DONE], as a client does
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    res.output_tokens, res.tokens_from = int(usage["completion_tokens"]), "usage"
                    res.prompt_tokens = usage.get("prompt_tokens")
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    text = (delta.get("content") or "") + reasoning
                    if text:
                        if last is None:
                            res.first = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                if job.cancel_after is not None and res.chunks >= job.cancel_after:
                    res.cancelled = True
                    break
    res.latency = time.perf_counter() - t0
    if res.tokens_from is None:
        res.output_tokens, res.tokens_from = res.chunks, "chunks"
    if res.error is not None or res.cancelled:
        return res
    if not done:
        return res.fail("incomplete stream", "the stream ended without data: [DONE]")
    if res.first is None:
        return res.fail("empty reply", "the stream had no text")
    res.ok = True
    return res


async def images(client: httpx.AsyncClient, s: Settings, job: Job) -> Result:
    res = Result("images", start=time.perf_counter())
    body: dict[str, Any] = {"model": s.model, "prompt": job.prompt.text, "n": s.images_n,
                            "response_format": "b64_json"}
    if s.image_size:
        body["size"] = s.image_size
    body.update({**s.extra_body, **job.prompt.extra})
    r = await client.post(s.endpoints["images"], json=body)
    if r.status_code != 200:
        return await http_error(r, res)
    res.status = 200
    res.latency = res.first = time.perf_counter() - res.start
    data = r.json().get("data")
    if not isinstance(data, list) or not data:
        return res.fail("bad body", "no `data` list of images")
    for item in data:
        raw = base64.b64decode((item or {}).get("b64_json") or "", validate=True)
        if not raw:
            return res.fail("bad body", "an image without b64_json")
        res.images, res.image_bytes = res.images + 1, res.image_bytes + len(raw)
    res.ok = True
    return res


SEND: dict[str, Callable[[httpx.AsyncClient, Settings, Job], Awaitable[Result]]] = {
    "speech": speech, "chat": chat, "images": images}


async def send(client: httpx.AsyncClient, s: Settings, job: Job) -> Result:
    """One request; whatever goes wrong becomes a failed Result (a load generator never stops for one)."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(s.timeout_s):
            res = await SEND[job.workload](client, s, job)
    except TimeoutError:
        res = Result(job.workload, start=t0).fail("timeout", f"no complete answer within {s.timeout_s} s")
    except Exception as e:  # noqa: BLE001 - a dead server, a cut stream, a bad body: counted; the run goes on
        res = Result(job.workload, start=t0).fail(type(e).__name__, str(e) or repr(e))
    res.end = time.perf_counter()
    return res


# ------------------------------------------------------------------------------ runs
def poisson_times(n: int, rate: float, seed: int, until: float | None = None) -> list[float]:
    """Send times (seconds from the start) of `n` requests, or of those before `until`, at
    exponential gaps of mean 1 / rate; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng, at, out = random.Random(seed), 0.0, []
    while len(out) < n:
        at += rng.expovariate(rate)
        if until is not None and at > until:
            break
        out.append(at)
    return out


async def closed_loop(client: httpx.AsyncClient, s: Settings, job: Callable[[int], Job], concurrency: int,
                      n: int, duration: float | None = None) -> list[Result]:
    """`concurrency` clients, each sending its next request when its last one ends, until `n`
    requests were sent or `duration` seconds passed."""
    results: list[Result] = []
    deadline = None if duration is None else time.perf_counter() + duration
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            results.append(await send(client, s, job(i)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def open_loop(client: httpx.AsyncClient, s: Settings, job: Callable[[int], Job], times: Sequence[float],
                    max_concurrency: int | None = None) -> list[Result]:
    """Request i sent at `times[i]` seconds whatever is in flight (at most `max_concurrency`, if set)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> Result:
        if limit is None:
            return await send(client, s, job(i))
        async with limit:
            return await send(client, s, job(i))

    tasks = []
    for i, at in enumerate(times):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    return list(await asyncio.gather(*tasks))


def http_client(base_url: str, api_key: str | None, connections: int | None, trust_env: bool,
                timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, trust_env=trust_env,
                             timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)))


@dataclass(frozen=True)
class RunSpec:
    mode: str  # closed | open
    level: float  # the concurrency, or the rate in requests/s
    num_requests: int
    duration: float | None = None
    max_concurrency: int | None = None
    warmup: int = 0
    cancel_fraction: float = 0.0
    seed: int = 0

    @property
    def name(self) -> str:
        if self.mode == "closed":
            return f"closed c={int(self.level)}"
        return f"open r={'inf' if math.isinf(self.level) else f'{self.level:g}'}/s"


async def run(base_url: str, s: Settings, spec: RunSpec, mix: Sequence[tuple[str, float]],
              prompts: Sequence[Prompt], api_key: str | None = None, trust_env: bool = False,
              scrape_metrics: bool = False) -> dict[str, Any]:
    """One run: its warm-up, then the timed requests; the run's record (`summarize`)."""
    conc = int(spec.level) if spec.mode == "closed" else spec.max_concurrency
    async with http_client(base_url, api_key, conc, trust_env, s.timeout_s) as client:
        warm: list[Result] = []
        if spec.warmup:
            # other indices than the run's: the warm-up does not repeat its first prompts' requests
            def warm_job(i: int) -> Job:
                return make_job(10**9 + i, spec.seed, mix, prompts, 0.0)

            warm = await closed_loop(client, s, warm_job, min(conc or spec.warmup, spec.warmup), spec.warmup)
        before = await scrape(client) if scrape_metrics else None

        def job(i: int) -> Job:
            return make_job(i, spec.seed, mix, prompts, spec.cancel_fraction)

        t0 = time.perf_counter()
        if spec.mode == "closed":
            results = await closed_loop(client, s, job, int(spec.level), spec.num_requests, spec.duration)
        else:
            times = poisson_times(spec.num_requests, spec.level, spec.seed, spec.duration)
            results = await open_loop(client, s, job, times, spec.max_concurrency)
        duration = max((r.end for r in results), default=t0) - t0
        rec = summarize(results, duration)
        rec = {"run": spec.name, **{k: v for k, v in asdict(spec).items() if v is not None}, **rec,
               "warmup": {"sent": len(warm), "ok": sum(r.ok for r in warm)}}
        if before is not None:
            after = await scrape(client)
            rec["server_metrics"] = metrics_delta(before, after) if after is not None else None
    return rec


# ------------------------------------------------------------------------------ figures
def stats(values: Iterable[float | None], scale: float = 1.0) -> dict[str, float | int | None]:
    vals = [v * scale for v in values if v is not None]
    return {"n": len(vals), "mean": sum(vals) / len(vals) if vals else None, "p50": percentile(vals, 50),
            "p90": percentile(vals, 90), "p99": percentile(vals, 99), "min": min(vals, default=None),
            "max": max(vals, default=None)}


def summarize(results: Sequence[Result], duration: float) -> dict[str, Any]:
    """Counts, errors and, per workload, the figures over the ok requests (the docstring defines them)."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and not r.cancelled]
    per_s = 1.0 / duration if duration > 0 else 0.0
    rec: dict[str, Any] = {
        "requests": len(results), "ok": len(ok), "failed": len(failed),
        "cancelled": sum(r.cancelled for r in results), "duration_s": duration,
        "request_throughput": len(ok) * per_s,
        "errors": dict(Counter(r.error for r in failed)),
        "error_samples": list(dict.fromkeys(f"{r.error}: {r.message}" for r in failed))[:5],
        "workloads": {},
    }
    for w in WORKLOADS:
        rs = [r for r in results if r.workload == w]
        if not rs:
            continue
        good = [r for r in rs if r.ok]
        fig: dict[str, Any] = {"requests": len(rs), "ok": len(good),
                               "cancelled": sum(r.cancelled for r in rs),
                               "failed": sum(not r.ok and not r.cancelled for r in rs),
                               "request_throughput": len(good) * per_s,
                               "latency_ms": stats((r.latency for r in good), 1e3)}
        if w == "speech":
            audio = [r.audio_s or 0.0 for r in good]
            rtf = [r.latency / r.audio_s for r in good if r.audio_s]
            fig.update(ttfa_ms=stats((r.first for r in good), 1e3), rtf=stats(rtf), audio_s=stats(audio),
                       stall_ms=stats((r.stall for r in good), 1e3), chunks=stats(r.chunks for r in good),
                       audio_s_total=sum(audio), audio_s_per_s=sum(audio) * per_s,
                       audio_bytes_total=sum(r.audio_bytes for r in good),
                       realtime_streams=sum(x < 1.0 for x in rtf),
                       silent=sum(not r.audio_bytes for r in good),
                       sample_rates=sorted({r.sample_rate for r in good if r.sample_rate}))
        elif w == "chat":
            tokens = [r.output_tokens or 0 for r in good]
            tpot = [(r.latency - r.first) / (r.output_tokens - 1) for r in good
                    if r.first is not None and r.latency is not None and (r.output_tokens or 0) > 1]
            fig.update(ttft_ms=stats((r.first for r in good), 1e3),
                       itl_ms=stats((x for r in good for x in r.itl), 1e3),
                       tpot_ms=stats(tpot, 1e3), output_tokens=stats(tokens), output_tokens_total=sum(tokens),
                       output_tokens_per_s=sum(tokens) * per_s,
                       prompt_tokens_total=sum(r.prompt_tokens or 0 for r in good),
                       tokens_from=dict(Counter(r.tokens_from for r in good)),
                       finish_reasons=dict(Counter(r.finish_reason for r in good)))
        else:
            made = sum(r.images for r in good)
            fig.update(images_total=made, images_per_s=made * per_s,
                       image_bytes_total=sum(r.image_bytes for r in good))
        rec["workloads"][w] = fig
    return rec


async def scrape(client: httpx.AsyncClient) -> dict[str, tuple[str, float]] | None:
    """`GET /metrics` as {sample: (type, value)} (histogram buckets left out); None if the server has none."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


def parse_metrics(text: str) -> dict[str, tuple[str, float]]:
    types: dict[str, str] = {}
    out: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name.endswith("_bucket"):
            continue
        base = next((name.removesuffix(s) for s in ("_total", "_sum", "_count", "_created", "")
                     if name.removesuffix(s) in types), name)
        try:
            out[key] = (types.get(name) or types.get(base, "untyped"), float(value))
        except ValueError:
            continue
    return out


Samples = dict[str, tuple[str, float]]


def metrics_delta(before: Samples, after: Samples) -> dict[str, Any]:
    """Counters (and histogram sums and counts): their change over the run; gauges: their value after it."""
    delta = {k: v - before.get(k, ("", 0.0))[1] for k, (kind, v) in after.items()
             if kind in ("counter", "histogram", "summary") and v != before.get(k, ("", 0.0))[1]}
    gauges = {k: v for k, (kind, v) in after.items() if kind == "gauge"}
    return {"delta": delta, "gauges_after": gauges}


# ------------------------------------------------------------------------------ report
COLUMNS: dict[str, list[tuple[str, str, int]]] = {
    "speech": [("ttfa_ms.p50", "TTFA p50 ms", 1), ("ttfa_ms.p90", "p90", 1), ("ttfa_ms.p99", "p99", 1),
               ("rtf.p50", "RTF p50", 3), ("rtf.p90", "p90", 3), ("rtf.p99", "p99", 3),
               ("audio_s_per_s", "audio s/s", 2), ("realtime_streams", "real-time", 0),
               ("stall_ms.p90", "stall p90 ms", 1)],
    "chat": [("ttft_ms.p50", "TTFT p50 ms", 1), ("ttft_ms.p90", "p90", 1), ("ttft_ms.p99", "p99", 1),
             ("itl_ms.p50", "ITL p50 ms", 2), ("itl_ms.p90", "p90", 2), ("itl_ms.p99", "p99", 2),
             ("tpot_ms.p50", "TPOT p50 ms", 2), ("output_tokens_per_s", "tok/s", 1)],
    "images": [("images_per_s", "images/s", 2)],
}
LEAD = [("run", "run", 0), ("ok", "ok", 0), ("failed", "failed", 0), ("cancelled", "cancel", 0),
        ("request_throughput", "req/s", 2), ("latency_ms.p50", "latency p50 ms", 1),
        ("latency_ms.p90", "p90", 1), ("latency_ms.p99", "p99", 1)]


def report(runs: Sequence[dict[str, Any]]) -> str:
    """One table per workload, one row per run, then each run's errors."""
    out = []
    for w in WORKLOADS:
        rows = []
        for rec in runs:
            fig = rec["workloads"].get(w)
            if fig is None:
                continue
            row: dict[str, Any] = {"run": rec["run"]}
            for key, value in fig.items():
                if isinstance(value, dict) and "p50" in value:
                    row.update({f"{key}.{q}": value[q] for q in ("p50", "p90", "p99")})
                else:
                    row[key] = value
            rows.append(row)
        if rows:
            out.append(f"{w}:\n" + table(rows, LEAD + COLUMNS[w]))
    for rec in runs:
        for kind, n in rec["errors"].items():
            out.append(f"{rec['run']}: {n} failed: {kind}")
        out.extend(f"  e.g. {sample}" for sample in rec["error_samples"][:2])
    return "\n\n".join(out)


def parse_mix(text: str) -> list[tuple[str, float]]:
    mix = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, weight = part.partition("=")
        if name not in WORKLOADS:
            raise argparse.ArgumentTypeError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: the weight must be a number") from None
        if not w > 0 or math.isinf(w):
            raise argparse.ArgumentTypeError(f"{part!r}: the weight must be positive")
        mix.append((name, w))
    if not mix:
        raise argparse.ArgumentTypeError("no workload given")
    return mix


def _numbers(kind: Callable[[str], float]) -> Callable[[str], list[float]]:
    def parse(text: str) -> list[float]:
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
        if not vals or any(not v > 0 for v in vals):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return vals
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    ap.add_argument("--model", default=None,
                    help="the model id to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)")
    ap.add_argument("--workload", type=parse_mix, default=parse_mix("chat"),
                    help="speech, chat, images, or a weighted mix such as speech=3,chat=1")
    ap.add_argument("--concurrency", type=_numbers(int), default=None, help="closed-loop runs: a comma list")
    ap.add_argument("--request-rate", type=_numbers(float), default=None,
                    help="open-loop runs: Poisson rates in requests/s, a comma list (inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open loop)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="timed requests per run (default: max(16, 4 x concurrency); open loop 100)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds per run: send until then (soak runs)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests per run, first (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a JSONL prompt set (default: built-in prompts)")
    ap.add_argument("--prompt-words", type=int, default=12,
                    help="words per built-in prompt (default 12; at most 4096 distinct prompts, "
                         "then reused in turn)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="output tokens per request (chat; speech: see --speech-length-field)")
    ap.add_argument("--cancel-fraction", type=float, default=0.0,
                    help="close this fraction of streamed requests after 1 to 3 chunks (disconnect tests)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per request before it counts as failed")
    ap.add_argument("--extra-body", type=json.loads, default={}, help="a JSON object merged into every body")
    for w in WORKLOADS:
        ap.add_argument(f"--{w}-endpoint", default=ENDPOINTS[w], help=f"default {ENDPOINTS[w]}")
    ap.add_argument("--voice", default=None,
                    help="the speech voice (default: the served model's default_voice from GET /v1/models)")
    ap.add_argument("--speech-format", choices=["wav", "pcm"], default="wav")
    ap.add_argument("--speech-stream", choices=["audio", "sse", "none"], default="audio",
                    help="stream_format sent (none: the whole file, not streamed)")
    ap.add_argument("--speech-length-field", default="max_tokens",
                    help="the speech body's field for --max-tokens ('' sends none)")
    ap.add_argument("--sample-rate", type=int, default=24000, help="raw pcm without an X-Sample-Rate header")
    ap.add_argument("--no-usage", action="store_true", help="chat: no stream_options.include_usage")
    ap.add_argument("--ignore-eos", action="store_true", help="chat: send ignore_eos (vLLM, SGLang)")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--chat-image-size", type=parse_size, default=None,
                    help="WxH: send a generated PNG as an image_url part with every chat request")
    ap.add_argument("--image-size", default=None, help="images: the `size` field (WxH)")
    ap.add_argument("--images-n", type=int, default=1)
    ap.add_argument("--scrape-metrics", action="store_true",
                    help="record GET /metrics' changes over each run")
    ap.add_argument("--trust-env", action="store_true",
                    help="let httpx read proxy settings from the environment")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "serve.json")
    args = ap.parse_args(argv)
    if not isinstance(args.extra_body, dict):
        ap.error("--extra-body must be a JSON object")
    if args.image_size is not None:
        parse_size(args.image_size)
    if not 0 <= args.cancel_fraction <= 1:
        ap.error("--cancel-fraction must be within [0, 1]")
    if args.duration is not None and any(math.isinf(r) for r in args.request_rate or ()):
        ap.error("--duration needs finite request rates (inf sends every request at once)")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = [1]
    return args


async def served_models(base_url: str, api_key: str | None, trust_env: bool) -> list[dict[str, Any]]:
    """The entries of GET /v1/models that have an id (none when the server does not answer)."""
    async with http_client(base_url, api_key, 1, trust_env, 30.0) as client:
        try:
            r = await client.get("/v1/models")
            data = r.json().get("data", []) if r.status_code == 200 else []
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return []


def served_voice(entries: Sequence[dict[str, Any]], model: str) -> str | None:
    """The `default_voice` an M* server gives `model` in /v1/models (another server: None)."""
    voice = next((m.get("default_voice") for m in entries if m["id"] == model), None)
    return voice if isinstance(voice, str) else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    entries = asyncio.run(served_models(base_url, args.api_key, args.trust_env))
    models = [m["id"] for m in entries]
    model = args.model or (models[0] if models else None)
    if model is None:
        print(f"serve.py: error: {base_url}/v1/models names no model (is the server up?); pass --model",
              file=sys.stderr)
        return 1
    image = None
    if args.chat_image_size is not None:
        image = "data:image/png;base64," + base64.b64encode(png(*args.chat_image_size, args.seed)).decode()
    settings = Settings(
        model=model, max_tokens=args.max_tokens, timeout_s=args.timeout,
        endpoints={w: getattr(args, f"{w}_endpoint") for w in WORKLOADS}, extra_body=args.extra_body,
        voice=args.voice if args.voice is not None else served_voice(entries, model), speech_format=args.speech_format, speech_stream=args.speech_stream,
        speech_length_field=args.speech_length_field, sample_rate=args.sample_rate,
        include_usage=not args.no_usage, ignore_eos=args.ignore_eos, temperature=args.temperature,
        chat_image=image, image_size=args.image_size, images_n=args.images_n)
    prompts = (load_prompts(args.prompts) if args.prompts else
               builtin_prompts(min(max(64, args.num_requests or 0), 4096), args.prompt_words, args.seed))
    specs = [RunSpec("closed", c, args.num_requests or max(16, 4 * int(c)), args.duration, None, args.warmup,
                     args.cancel_fraction, args.seed) for c in args.concurrency or ()]
    specs += [RunSpec("open", r, args.num_requests or 100, args.duration, args.max_concurrency, args.warmup,
                      args.cancel_fraction, args.seed) for r in args.request_rate or ()]
    if args.duration is not None:  # by duration: the count is only a cap
        specs = [replace(sp, num_requests=args.num_requests or 10**9) for sp in specs]
    rec: dict[str, Any] = {
        "command": " ".join(["serve.py"] + (argv if argv is not None else sys.argv[1:])),
        "base_url": base_url, "model": model, "served_models": models,
        "workload": dict(args.workload), "prompts": str(args.prompts) if args.prompts else
        f"built-in: {args.prompt_words} words each, seed {args.seed}",
        "settings": {k: v for k, v in asdict(settings).items() if k != "chat_image"},
        "chat_image_size": args.chat_image_size,
        "env": {"python": platform.python_version(), "httpx": httpx.__version__, "host": platform.node()},
        "runs": [],
    }
    for spec in specs:
        r = asyncio.run(run(base_url, settings, spec, args.workload, prompts, args.api_key, args.trust_env,
                            args.scrape_metrics))
        rec["runs"].append(r)
        write_json(args.out, rec)
        print(f"{spec.name}: {r['ok']} ok, {r['failed']} failed, {r['cancelled']} cancelled in "
              f"{r['duration_s']:.2f} s", flush=True)
    print(f"\n{model} at {base_url}\n" + report(rec["runs"]))
    print(f"wrote {args.out}")
    return 1 if any(r["failed"] for r in rec["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
