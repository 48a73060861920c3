"""`/v1/audio/transcriptions` and `/v1/audio/translations` on the Whisper plan (tiny, its own
seeded weights) with the real `openai` client: the audio formats, every response format,
streamed deltas, and the 400s that name the field.

What the route answers is checked against the engine itself: the same audio, resampled by
the server's resampler, through `MStar` in this process with the same weights.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="the conformance tests need the openai client: pip install openai")
soundfile = pytest.importorskip("soundfile", reason="audio decoding needs the `serve` extra's soundfile")

from test_server_support import ROOT, Server, serving  # noqa: E402

from mstar_runtime.api import MStar  # noqa: E402
from mstar_runtime.media import resample  # noqa: E402
from mstar_runtime.serve.transcriptions import FALLBACK, srt, vtt  # noqa: E402

MODEL = "whisper"
# random weights rarely write <|endoftext|>: a bound on the tokens keeps each request short
SHORT = {"max_tokens": 24}


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mstarc.cli import main as mstarc

    out = tmp_path_factory.mktemp("whisper") / "whisper-tiny.plan"
    assert mstarc(["compile", str(ROOT / "models/whisper/whisper.walk"), "--variant", "tiny", "-p",
                   str(ROOT / "placements/cpu.yaml"), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def server(plan: Path) -> Iterator[Server]:
    with serving(plan) as s:  # --weights init: the nodes' own seeded weights
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _samples(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(3)
    return (0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _file(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _engine_text(plan: Path, audio: torch.Tensor, **inputs: object) -> dict:
    """The engine's transcript with what the route adds at temperature 0 (OpenAI's fallback)."""
    with MStar.load(plan, weights="init") as m:
        return m.submit("transcribe", {"audio": audio, **SHORT, **FALLBACK, **inputs}).result()


def test_transcription_is_the_engines(client: openai.OpenAI, plan: Path) -> None:
    samples = _samples(3.0, 44100)
    wav = _file(samples, 44100, "WAV", "FLOAT")
    r = client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), response_format="json", extra_body=SHORT)
    want = _engine_text(plan, resample(torch.from_numpy(samples), 44100, 16000))
    assert r.text == want["text"] and r.text
    text = client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), response_format="text", extra_body=SHORT)
    assert text == want["text"]
    verbose = client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), response_format="verbose_json",
                                                 timestamp_granularities=["segment"], extra_body=SHORT)
    timed = _engine_text(plan, resample(torch.from_numpy(samples), 44100, 16000), timestamps=True)
    segments = json.loads(timed["segments"])
    assert verbose.text == timed["text"] and verbose.language == timed["language"] and verbose.language
    assert verbose.duration == pytest.approx(3.0)
    assert [(s.start, s.end, s.text, s.tokens) for s in verbose.segments] == \
           [(s["start"], s["end"], s["text"], s["tokens"]) for s in segments]
    # the decode's statistics are the walk's, per window (OpenAI's verbose_json fields): the
    # float ones to float32 rounding. Seen on one dev machine (AMD EPYC), with code that CI
    # matched exactly: no_speech_prob 1.5143830e-05 in the server against 1.5143833e-05 in a
    # fresh engine (cause not pinned down; the server's engine has served requests before)
    exact, floats = ("seek", "temperature"), ("avg_logprob", "compression_ratio", "no_speech_prob")
    assert [tuple(getattr(s, k) for k in exact) for s in verbose.segments] == \
           [tuple(s[k] for k in exact) for s in segments]
    assert [tuple(getattr(s, k) for k in floats) for s in verbose.segments] == \
           [pytest.approx(tuple(s[k] for k in floats), rel=1e-5, abs=1e-9) for s in segments]
    assert all(s.avg_logprob < 0 and s.compression_ratio > 0 and 0 < s.no_speech_prob < 1 for s in verbose.segments)
    assert client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), response_format="srt",
                                                extra_body=SHORT) == srt(segments)
    assert client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), response_format="vtt",
                                                extra_body=SHORT) == vtt(segments)


@pytest.mark.parametrize(("fmt", "subtype"), [("FLAC", None), ("OGG", "VORBIS"), ("MP3", None), ("WAV", "PCM_16")])
def test_audio_formats_decode(client: openai.OpenAI, fmt: str, subtype: str | None) -> None:
    data = _file(_samples(2.0, 22050), 22050, fmt, subtype)
    r = client.audio.transcriptions.create(model=MODEL, file=(f"a.{fmt.lower()}", data), response_format="verbose_json",
                                           extra_body=SHORT)
    assert r.duration == pytest.approx(2.0, abs=0.06)  # MP3 frames pad the end a little


def test_lossless_formats_give_one_transcript(client: openai.OpenAI) -> None:
    samples = _samples(2.5, 16000)
    texts = {fmt: client.audio.transcriptions.create(model=MODEL, file=("a", _file(samples, 16000, fmt, "PCM_16")),
                                                     response_format="text", extra_body=SHORT) for fmt in ("WAV", "FLAC")}
    assert texts["WAV"] == texts["FLAC"]


def test_long_audio_is_transcribed_window_by_window(client: openai.OpenAI, plan: Path) -> None:
    samples = _samples(65.0, 16000)
    r = client.audio.transcriptions.create(model=MODEL, file=("a.wav", _file(samples, 16000, "WAV")),
                                           response_format="verbose_json", extra_body=SHORT)
    want = _engine_text(plan, torch.from_numpy(samples), timestamps=True)  # over 30 s: timestamps
    assert r.text == want["text"] and [s.tokens for s in r.segments] == \
           [s["tokens"] for s in json.loads(want["segments"])]
    assert len({s.seek for s in r.segments}) >= 2 and r.duration == pytest.approx(65.0)


def test_stream_deltas_add_up_to_the_transcript(client: openai.OpenAI) -> None:
    # a delta per window (the one a fallback settles on): audio of more than one window
    wav = _file(_samples(40.0, 16000), 16000, "WAV")
    whole = client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), extra_body=SHORT)
    events = list(client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), stream=True, extra_body=SHORT))
    assert [e.type for e in events][-1] == "transcript.text.done"
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == events[-1].text == whole.text


def test_translation(client: openai.OpenAI) -> None:
    wav = _file(_samples(2.0, 16000), 16000, "WAV")
    r = client.audio.translations.create(model=MODEL, file=("a.wav", wav), response_format="verbose_json",
                                         extra_body=SHORT)
    assert r.task == "translate" and isinstance(r.text, str)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.translations.create(model=MODEL, file=("a.wav", wav), extra_body={"language": "de"})
    assert info.value.body["param"] == "language"


def _wav_with_rate(rate: int) -> bytes:
    data = np.zeros(800, dtype="<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data"
            + struct.pack("<I", len(data)) + data)


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"file": ("a.wav", b"")}, "file", "invalid_audio"),
    ({"file": ("a.mp3", b"certainly not audio" * 20)}, "file", "invalid_audio"),
    ({"file": ("a.wav", _wav_with_rate(0))}, "file", "invalid_audio"),
    # max_audio_seconds (1800 s) and a little more, small at 4 kHz in 8 bits
    ({"file": ("a.wav", _file(np.zeros(1801 * 4000, np.float32), 4000, "WAV", "PCM_U8"))}, "file",
     "audio_too_long"),
    ({"language": "klingon"}, "language", None),
    ({"response_format": "xml"}, "response_format", None),
    ({"timestamp_granularities": ["word"], "response_format": "verbose_json"}, "timestamp_granularities[]",
     "unsupported"),
    ({"model": "whisper-1"}, "model", "model_not_found"),
    ({"extra_body": {"max_tokens": 0}}, "max_tokens", None),
    ({"extra_body": {"include[]": "logprobs"}}, "include[]", "unknown_field"),
])
def test_bad_requests_name_the_field(client: openai.OpenAI, kwargs: dict, param: str, code: str | None) -> None:
    args = {"model": MODEL, "file": ("a.wav", _file(_samples(1.0, 16000), 16000, "WAV")), **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(**args)
    body = info.value.body if isinstance(info.value.body, dict) else {}
    assert info.value.status_code in (400, 404) and body.get("param") == param, body
    if code is not None:
        assert body.get("code") == code, body
