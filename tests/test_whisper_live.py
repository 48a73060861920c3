"""Whisper on live audio (the `transcribe_live` walk, models/mstar_models/whisper/live.py), on
CPU with the tiny random config of tests/test_whisper.py (its perturbed weights, which write
timestamps often, so windows seek from them).

- fed in chunks of uneven sizes, 70 s of audio gives the segments, text, language and tokens
  of `transcribe` on the whole audio (with a detected language; conditioned on the text so
  far with a prompt), and each window is decoded once: a line of `partial` per window;
- the first window's partial text arrives while the client still holds the rest;
- audio that grows louder after a quiet (digitally silent) stretch changes the features of
  the windows decoded before (the log-mel floor follows the whole audio's maximum): they are
  decoded again once the stream closes, a line revises the text from 0 s, and the final
  segments are still `transcribe`'s;
- bad input names the field.
The HTTP route with a chunked body: tests/test_serve_live.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_whisper import _audio, plan, reference  # noqa: F401 - fixtures

from mstar_models.whisper.features import N_SAMPLES
from mstar_models.whisper.live import samples_for
from mstar_runtime.api import MStar, RequestFailed

pytest.importorskip("transformers")

SIZES = (7_001, 123_457, 50_000, 333_333, 1_000, 200_000, 16_000)  # uneven, some under a chunk
SETTINGS: dict[str, Any] = {"timestamps": True, "max_tokens": 40}


@pytest.fixture(scope="module")
def engine(reference: tuple, plan: Path) -> Iterator[MStar]:  # noqa: F811 - the imported fixtures
    with MStar.load(plan, weights=reference[1]) as m:
        yield m


def _loud_start(seconds: float) -> torch.Tensor:
    """`_audio` with a burst in its first second: the whole audio's loudest moment is heard first."""
    x = _audio(seconds, seed=3)
    x[8000:8400] *= 3
    return torch.from_numpy(x)


def _feed(m: MStar, audio: torch.Tensor, **inputs: Any) -> Any:
    h = m.submit("transcribe_live", {**SETTINGS, **inputs}, streaming=True)
    start, k = 0, 0
    while start < audio.numel():
        n = SIZES[k % len(SIZES)]
        h.feed("audio", audio[start : start + n])
        start, k = start + n, k + 1
    h.close_input("audio")
    return h


def _lines(partial: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in partial.splitlines()]


def _same_as_whole(live: dict[str, Any], whole: dict[str, Any]) -> None:
    for key in ("segments", "text", "language"):
        assert live[key] == whole[key], key
    assert torch.equal(live["tokens"], whole["tokens"])


@pytest.mark.parametrize("inputs", [{}, {"condition_on_prev_tokens": True, "prompt": " Guten Tag", "language": "de"}],
                         ids=["detected", "conditioned"])
def test_fed_in_uneven_chunks_equals_the_whole_file(engine: MStar, inputs: dict[str, Any]) -> None:
    audio = _loud_start(70.0)
    whole = engine.submit("transcribe", {"audio": audio, **SETTINGS, **inputs}).result(timeout=300)
    live = _feed(engine, audio, **inputs).result(timeout=300)
    _same_as_whole(live, whole)
    segs = json.loads(whole["segments"])
    seeks = sorted({s["seek"] for s in segs})
    assert len(seeks) >= 3 and any(s % 3000 for s in seeks), seeks  # windows seek from a timestamp
    lines = _lines(live["partial"])
    # one line per window, in order, each decoded once (no window was decoded again)
    assert [round(s / 100, 2) for s in seeks] == [line["start"] for line in lines]
    assert "".join(line["text"] for line in lines) == whole["text"]


def test_partial_text_arrives_before_the_input_is_closed(engine: MStar) -> None:
    audio = _loud_start(45.0)
    h = engine.submit("transcribe_live", dict(SETTINGS), streaming=True)
    first = samples_for(0) + 16_000  # the first window's audio and the chunk that completes it
    h.feed("audio", audio[:first])
    stream = h.stream()
    name, line = next(stream)
    assert name == "partial" and not h.done
    assert json.loads(line)["start"] == 0.0
    h.feed("audio", audio[first:])
    h.close_input("audio")
    rest = [v for n, v in stream if n == "partial"]
    out = h.result(timeout=300)
    assert out["partial"] == line + "".join(rest)
    _same_as_whole(out, engine.submit("transcribe", {"audio": audio, **SETTINGS}).result(timeout=300))


def test_louder_audio_later_decodes_the_early_windows_again(engine: MStar) -> None:
    x = _audio(50.0, seed=4)
    x[16000 * 5 : 16000 * 8] = 0.0  # digital silence: under the log-mel floor, which moves with the max
    x[16000 * 40 :] *= 4.0  # louder than anything in the first window
    audio = torch.from_numpy(x)
    h = engine.submit("transcribe_live", dict(SETTINGS), streaming=True)
    h.feed("audio", audio[: samples_for(0) + 16_000])
    stream = h.stream()
    early = next(stream)[1]  # the first window, decoded from the quieter features
    h.feed("audio", audio[samples_for(0) + 16_000 :])
    h.close_input("audio")
    out = h.result(timeout=300)
    lines = _lines(out["partial"])
    assert json.loads(early)["start"] == 0.0
    assert [line["start"] for line in lines].count(0.0) == 2  # decoded again: the text from 0 s revised
    _same_as_whole(out, engine.submit("transcribe", {"audio": audio, **SETTINGS}).result(timeout=300))


@pytest.mark.parametrize("samples", [16000 * 6, N_SAMPLES + 150])  # 150 samples over 30 s: still one window
def test_short_audio_is_decoded_once_the_stream_closes(engine: MStar, samples: int) -> None:
    audio = torch.from_numpy(_audio(31.0, seed=5)[:samples])
    live = _feed(engine, audio, timestamps=False).result(timeout=300)
    whole = engine.submit("transcribe", {"audio": audio, "max_tokens": 40}).result(timeout=300)
    _same_as_whole(live, whole)
    seeks = sorted({s["seek"] for s in json.loads(whole["segments"])})
    assert [line["start"] for line in _lines(live["partial"])] == [round(s / 100, 2) for s in seeks]


@pytest.mark.parametrize(("audio", "inputs", "field"), [
    (torch.zeros(0), {}, "audio"),  # nothing streamed
    (torch.full((100,), float("nan")), {}, "audio"),
    (torch.zeros(N_SAMPLES + 16_000), {"timestamps": False}, "timestamps"),  # over 30 s: seeks from timestamps
    (torch.zeros(1600), {"logprob_threshold": 0.5}, "logprob_threshold"),
])
def test_bad_input_names_the_field(engine: MStar, audio: torch.Tensor, inputs: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestFailed) as info:
        _feed(engine, audio, **inputs).result(timeout=60)
    assert info.value.field == field, info.value
