"""Whisper's long-form transcription (the `transcribe` / `translate` walks on audio over 30 s)
against transformers' long-form `WhisperForConditionalGeneration.generate`, on CPU: the tiny
random config of tests/test_whisper.py, the same weights loaded into both.

The input is 70 s of a modulated tone (`_audio`), its log-mel computed over the whole audio
as transformers' long-form call of the feature extractor does (`truncation=False,
padding="longest"`). These random weights write timestamps often: over a 51,866-token
vocabulary their logits are nearly flat, so the 1,501 timestamps' summed probability
usually beats the best single text token, and `WhisperTimeStampLogitsProcessor`'s rule (ours
too) then forces a timestamp. So windows end on timestamp pairs and the next window starts at
the last complete one (the test checks that a window began at a seek that is not a multiple
of 3,000 frames): the seek path is exercised without a constructed weight or a logits
processor.

Compared: the segments (start, end, tokens) and the output tokens equal transformers' -
greedy with a detected language; with `condition_on_prev_tokens`, a prompt and a given
language; translate. The temperature fallback: a compression-ratio threshold the first
windows miss, so they run every fallback temperature; and a log-probability threshold with
a no-speech threshold that skips windows. Sampling draws differ between the two (each its own
random numbers), so the fallback temperatures are 1e-6 and 2e-6: at that temperature both
draw the greedy token (transformers' output is checked not to depend on its seed), and the
fallback's decisions, its retries, the skipped windows and the statistics
(`avg_logprob`, `compression_ratio`, `no_speech_prob`, `temperature`) are compared with
transformers' own functions on its outputs.

The windows node's pieces are checked against transformers' own functions directly: the
segments and the next seek of constructed sequences (`_retrieve_segment`), the next
window's conditioning tokens (`_pad_to_max_length`), and conditioning dropped after a
window decoded at 0.5 or more.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_whisper import LAYOUT, _audio, plan, reference  # noqa: F401 - fixtures

from mstar_models.whisper.tokens import byte_tokenizer
from mstar_runtime.api import MStar

transformers = pytest.importorskip("transformers")

SECONDS = 70.0
FALLBACK = (1e-6, 2e-6)
Segments = list[tuple[float, float, list[int]]]


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    return _audio(SECONDS, seed=3)


@pytest.fixture(scope="module")
def features(audio: np.ndarray) -> torch.Tensor:
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    return fe(audio, sampling_rate=16000, truncation=False, padding="longest", return_tensors="pt").input_features


@pytest.fixture(scope="module")
def engine(reference: tuple, plan: Path) -> Iterator[MStar]:  # noqa: F811 - the imported fixtures
    with MStar.load(plan, weights=reference[1]) as m:
        yield m


def _theirs(model: Any, features: torch.Tensor, seed: int = 0, **kw: Any) -> dict[str, Any]:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(features, return_timestamps=True, return_segments=True, max_new_tokens=40, **kw)


def _segments(out: dict[str, Any]) -> Segments:
    return [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]


def _ours(engine: MStar, audio: np.ndarray, walk: str = "transcribe", **inputs: Any) -> tuple[dict, list[dict]]:
    out = engine.submit(walk, {"audio": torch.from_numpy(audio), "timestamps": True, "max_tokens": 40,
                               **inputs}).result()
    return out, json.loads(out["segments"])


def _same(ours: tuple[dict, list[dict]], theirs: dict[str, Any]) -> None:
    out, segs = ours
    assert [(s["start"], s["end"], s["tokens"]) for s in segs] == _segments(theirs)
    assert out["tokens"].tolist() == theirs["sequences"][0].tolist()


CASES = {
    "greedy, language detected": (dict(task="transcribe"), dict()),
    "conditioned on the text so far, a prompt, a language": (
        dict(task="transcribe", language="de", condition_on_prev_tokens=True, prompt=" Guten Tag"),
        dict(language="de", condition_on_prev_tokens=True, prompt="Guten Tag")),
    "translate, conditioned": (dict(task="translate", language="fr", condition_on_prev_tokens=True),
                               dict(language="fr", condition_on_prev_tokens=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_long_form_segments_equal_transformers(reference: tuple, engine: MStar, audio: np.ndarray,  # noqa: F811
                                               features: torch.Tensor, case: str) -> None:
    model = reference[0]
    hf_kw, ours_kw = CASES[case]
    hf_kw = dict(hf_kw)
    if "prompt" in hf_kw:  # the same ids our tokenizer gives (the bundled byte-level one)
        ids = byte_tokenizer(LAYOUT).encode(hf_kw.pop("prompt"), add_special_tokens=False).ids
        hf_kw["prompt_ids"] = torch.tensor([LAYOUT.startofprev, *ids])
    theirs = _theirs(model, features, **hf_kw)
    ours = _ours(engine, audio, "translate" if hf_kw["task"] == "translate" else "transcribe", **ours_kw)
    _same(ours, theirs)
    seeks = sorted({s["seek"] for s in ours[1]})
    assert len(seeks) >= 3 and any(s % 3000 for s in seeks), seeks  # windows seek from a timestamp
    assert ours[1][-1]["end"] > 60.0


def test_compression_ratio_fallback_equals_transformers(reference: tuple, engine: MStar,  # noqa: F811
                                                         audio: np.ndarray, features: torch.Tensor) -> None:
    model = reference[0]
    # a logprob threshold no window misses: transformers then returns each attempt's scores
    kw = dict(compression_ratio_threshold=1.2, logprob_threshold=-100.0)
    theirs = _theirs(model, features, task="transcribe", temperature=(0.0, *FALLBACK), **kw)
    assert _segments(_theirs(model, features, seed=1, task="transcribe", temperature=(0.0, *FALLBACK),
                             **kw)) == _segments(theirs)  # the draws at 1e-6 are greedy
    ours = _ours(engine, audio, fallback_temperatures=torch.tensor(FALLBACK), **kw)
    _same(ours, theirs)
    temps = set()
    for seg, ref in zip(ours[1], theirs["segments"][0], strict=True):
        result = ref["result"]  # transformers' last attempt at the segment's window
        scores = result["scores"]
        seq = result["sequences"][-len(scores):]
        ratio = model._retrieve_compression_ratio(seq, LAYOUT.vocab)
        temp = FALLBACK[-1] if ratio > 1.2 else 0.0
        assert seg["compression_ratio"] == pytest.approx(ratio, rel=1e-6)
        assert seg["temperature"] == temp
        assert seg["avg_logprob"] == pytest.approx(float(model._retrieve_avg_logprobs(scores, seq, temp)), abs=1e-4)
        temps.add(temp)
    assert temps == {0.0, FALLBACK[-1]}  # some windows fell back through every temperature, some did not


def test_no_speech_skips_windows_as_transformers(reference: tuple, engine: MStar,  # noqa: F811
                                                 audio: np.ndarray, features: torch.Tensor) -> None:
    model = reference[0]
    kw = dict(logprob_threshold=-7.0, no_speech_threshold=1.8e-5)
    theirs = _theirs(model, features, task="transcribe", temperature=(0.0, *FALLBACK), **kw)
    ours = _ours(engine, audio, fallback_temperatures=torch.tensor(FALLBACK), **kw)
    _same(ours, theirs)
    assert ours[1] and ours[1][0]["seek"] >= 3000  # the first window was skipped
    lang = int(model.detect_language(features[:, :, :3000])[0])
    # the no-speech probability: <|nospeech|> after <|startoftranscript|>, from transformers' logits
    seek = ours[1][0]["seek"]
    window = torch.nn.functional.pad(features[:, :, seek : seek + 3000], (0, max(0, seek + 3000 - features.shape[-1])))
    prompt = torch.tensor([[LAYOUT.sot, lang, LAYOUT.transcribe]])
    with torch.no_grad():
        probs = model(input_features=window, decoder_input_ids=prompt).logits[0, 0].float().softmax(-1)
    assert ours[1][0]["no_speech_prob"] == pytest.approx(float(probs[LAYOUT.nospeech]), rel=1e-4)


def test_long_requests_together_equal_each_alone(engine: MStar, audio: np.ndarray) -> None:
    inputs = [dict(), dict(compression_ratio_threshold=1.2, fallback_temperatures=torch.tensor(FALLBACK)),
              dict(condition_on_prev_tokens=True, language="it")]
    alone = [_ours(engine, audio, **kw)[1] for kw in inputs]
    handles = [engine.submit("transcribe", {"audio": torch.from_numpy(audio), "timestamps": True,
                                            "max_tokens": 40, **kw}) for kw in inputs]
    together = [json.loads(h.result()["segments"]) for h in handles]
    exact = ("seek", "start", "end", "tokens", "temperature", "text")
    for a, b in zip(alone, together, strict=True):
        assert [{k: s[k] for k in exact} for s in a] == [{k: s[k] for k in exact} for s in b]
        for k in ("avg_logprob", "compression_ratio", "no_speech_prob"):  # batched float32 sums: last bits
            assert [s[k] for s in a] == pytest.approx([s[k] for s in b], rel=1e-5)


# ------------------------------------------------------------------------------ the windows node's pieces
TB = LAYOUT.timestamp_begin
SEQUENCES = {  # one window's generated tokens (<|endoftext|> removed), as transformers splits them
    "pairs, cut mid-segment": [TB + 3, 100, 101, TB + 40, TB + 40, 102, TB + 90, TB + 90, 103, 104],
    "pairs, single timestamp ending": [TB + 3, 100, TB + 40, TB + 40, 102, TB + 90],
    "pairs, closed at the end": [TB, 100, TB + 40, TB + 40, 102, TB + 90, TB + 91],
    "no pair, one timestamp": [TB + 5, 100, 101, 102],
    "no pair, <|0.00|> only": [TB, 100, 101],
    "no timestamps": [100, 101, 102],
}


@pytest.mark.parametrize("case", list(SEQUENCES))
@pytest.mark.parametrize(("seek", "span"), [(0, 3000), (2990, 3000), (6000, 1000)])
def test_window_segments_are_transformers_retrieve_segment(case: str, seek: int, span: int) -> None:
    from mstar_models.whisper.windows import window_segments

    seq = SEQUENCES[case]
    theirs, offset = transformers.WhisperForConditionalGeneration._retrieve_segment(
        seek_sequence=torch.tensor(seq), seek_outputs=[{}], time_offset=torch.tensor([seek], dtype=torch.float64)
        * 0.02 / 2, timestamp_begin=TB, seek_num_frames=torch.tensor([span]), time_precision=0.02,
        time_precision_features=0.01, input_stride=2, prev_idx=0, idx=0, return_token_timestamps=False,
        decoder_input_ids=torch.zeros(1, 3))
    ours, advance = window_segments(seq, seek, span, TB)
    assert [(s["start"], s["end"], s["tokens"]) for s in ours] == \
           [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in theirs]
    assert advance == int(offset)


def _windows_node() -> Any:
    from mstar_models.whisper.windows import Windows
    from mstar_runtime.ops.node import NodeSpec

    config = {"eot": LAYOUT.eot, "sot": LAYOUT.sot, "languages": LAYOUT.languages, "vocab": LAYOUT.vocab,
              "target_positions": 448, "max_attempts": 3}
    return Windows(NodeSpec(name="windows", engine="stateless", config=config, arch_args={}, settings={},
                            device=torch.device("cpu"), dtype=torch.float32))


def test_the_next_windows_context_is_transformers_previous_tokens() -> None:
    """`windows.cut`'s prompt head with `cond`: transformers' `_pad_to_max_length` of the
    segments so far (a double-timestamp ending without its last, the last 223 tokens)."""
    from transformers.models.whisper.generation_whisper import _pad_to_max_length

    segs = [{"tokens": [TB + 1, *range(100, 250), TB + 70, TB + 70]}, {"tokens": [TB + 70, *range(300, 400), TB + 99]},
            {"tokens": [TB + 99, 7, TB + 120, TB + 120]}]
    prompt = [LAYOUT.startofprev, 11, 12, 13, LAYOUT.sot]
    node = _windows_node()
    (got,) = node.phase_cut([{"mel": torch.zeros(80, 7000), "seek": 2990, "frames": 7000, "head": torch.tensor(prompt),
                              "segs": json.dumps(segs), "cond": True, "temperature": 0.0}])
    theirs = _pad_to_max_length([[{"tokens": torch.tensor(prompt[1:-1])}, *({"tokens": torch.tensor(s["tokens"])}
                                                                             for s in segs)]],
                                LAYOUT.eot, device="cpu", padding_side="left", bos_token_tensor=torch.tensor(
                                    [LAYOUT.startofprev]), cut_off_length=223, skip_ending_double_timestamps=True,
                                timestamp_begin=TB)[0].tolist()
    assert got["context"].tolist() == [*theirs, LAYOUT.sot]
    assert got["span"] == 3000 and torch.equal(got["window"][:, :10], torch.zeros(80, 10))
    (plain,) = node.phase_cut([{"mel": torch.zeros(80, 7000), "seek": 0, "frames": 7000, "head": torch.tensor(prompt),
                                "segs": json.dumps(segs), "cond": False, "temperature": 0.0}])
    assert plain["context"].tolist() == prompt  # not conditioned: the prompt alone, as transformers' prompt_ids


def test_a_hot_window_stops_conditioning_the_next() -> None:
    """transformers conditions the next window only after a temperature below 0.5."""
    from mstar_models.whisper.windows import STATS

    node = _windows_node()
    seq = torch.tensor(SEQUENCES["pairs, cut mid-segment"], dtype=torch.int32)
    for temp, cond in ((0.4, True), (0.6, False)):
        stats = torch.tensor([-0.5, 1.1, 0.01, temp, 0.0])
        (out,) = node.phase_advance([{"tokens": seq, "stats": stats, "seek": 0, "span": 3000, "frames": 7000,
                                      "segs": "[]", "condition": True}])
        assert out["cond"] is cond and out["seek"] == 180 and not out["finished"]
        assert json.loads(out["segs"])[0]["temperature"] == temp and len(STATS) == 4
