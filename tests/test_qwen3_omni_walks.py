"""Qwen3-Omni's walks end to end on the tiny variant (CPU), through `MStar` and `mstar-run`.

The weights are transformers 5.24's tiny `Qwen3OmniMoeForConditionalGeneration` (the walk's
tiny sizes, tests/qwen3_omni_lm_support.py), written by `save_pretrained` and read by the
plan's loader; its Code2Wav is re-drawn at scales that keep the audio unclipped
(tests/test_qwen3_omni_code2wav.py's `_randomize`), so audio comparisons mean something.

- `chat` with text, with an audio input and with an image input: the streamed text equals
  one decode of transformers' greedy `thinker.generate` on the processor's ids and features.
- `speech`: the text and every codec code equal `generate(..., return_audio=True)` (greedy
  thinker and talker); the audio is a 24 kHz stream of 1920 T - 555 samples, as a WAV
  through `mstar-run`; its first two Code2Wav windows (which see their whole history) equal
  transformers' waveform, later ones approximate it (4 frames of left context, tiny walk).
- Streamed Code2Wav windows joined equal one full decode of the same codes, once the left
  context covers the receptive field (a copy of the walk with an 8-frame sliding window and
  16 frames of history).
- A batch of requests equals each request alone, and so does a run with forced preemption;
  the plan as compiled (the chat decode loop is a cohort, the speech loop a chained one) and
  without its cohort marks give the same outputs; chat requests
  with the walk's default sampling (top-k 20, top-p 0.8) and other top-k settings decode on
  the cohort path, with no generic decode call, and give the generic path's text.
"""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from qwen3_omni_lm_support import TINY_IDS, hf_model
from support import as_run, compile_walk, saved_checkpoint

from mstar_runtime.api import MStar, RequestFailed
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import load_plan

pytest.importorskip("transformers")
from tests.test_qwen3_omni_code2wav import _randomize as unclipped_code2wav_  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WALK = ROOT / "models/qwen3_omni/qwen3_omni.walk"
SPF, TRIM = 1920, 555  # samples per codec frame, and what one decode trims at its right edge
ATOL = 1e-5  # fp32 audio in [-1, 1]: float rounding of other batch shapes (test_qwen3_omni_code2wav.py)
GREEDY = {"temperature": 0.0, "top_k": 0}
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def hf() -> Any:
    model = hf_model(seed=0)
    unclipped_code2wav_(model.code2wav, seed=0)
    return model


@pytest.fixture(scope="module")
def checkpoint(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_checkpoint(hf, tmp_path_factory, "qwen3_omni_ckpt")


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_walk(tmp_path_factory.mktemp("qwen3_omni") / "tiny.plan", WALK)


@pytest.fixture(scope="module")
def engine(plan_path: Path, checkpoint: Path) -> Iterator[MStar]:
    with MStar.load(plan_path, weights=checkpoint) as m:
        yield m


def nodes(m: MStar) -> dict[str, Any]:
    return {name: e.node for name, e in m.conductor.workers[0].engines.items()}


class Windows:
    """Records the (codes, left-context frames) windows Code2Wav decodes while in a `with`."""

    def __init__(self, m: MStar):
        self.node = nodes(m)["code2wav"]
        self.seen: list[tuple[torch.Tensor, int]] = []

    def __enter__(self) -> Windows:
        original: Callable[[list[dict]], list[dict]] = self.node.phase_decode

        def recording(batch: list[dict]) -> list[dict]:
            self.seen += [(e["codes"].clone(), int(e.get("codes:context", 0))) for e in batch]
            return original(batch)

        self.node.phase_decode = recording
        return self

    def __exit__(self, *exc: object) -> None:
        del self.node.phase_decode  # the class's own method again

    def codes(self) -> torch.Tensor:
        """The frames of the stream, [T, code groups], each once."""
        return torch.cat([w[c:] for w, c in self.seen])


def clip(seconds: float, seed: int) -> torch.Tensor:
    """16 kHz mono noise with a tone: something the audio encoder can tell apart."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(16000 * seconds)) / 16000
    return 0.3 * torch.sin(2 * torch.pi * (220 + 40 * seed) * t) + 0.05 * torch.randn(t.shape, generator=gen)


def picture(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


MEDIA = {"text": {}, "audio": {"audio": clip(1.2, 1)}, "image": {"image": picture(40, 56, 2)}}


def hf_inputs(m: MStar, prompt: str, media: dict[str, torch.Tensor]) -> dict[str, Any]:
    """transformers' inputs from our processor's ids, log-mel and patches (its own parity is
    tests/test_qwen3_omni_processor.py)."""
    built = nodes(m)["proc"].run("build", [{"prompt": prompt, "system": "", "audio": media.get("audio"),
                                            "image": media.get("image")}])[0]
    ids = built["ids"].long()[None]
    out: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "audio" in media:
        mel = built["mel"]
        out.update(input_features=mel[None], feature_attention_mask=torch.ones(1, mel.shape[1], dtype=torch.long))
    if "image" in media:
        out.update(pixel_values=built["pixels"], image_grid_thw=built["grid"].long())
    return out


def joins_to(pieces: str, m: MStar, ids: list[int]) -> bool:
    """Whether streamed text is one decode of `ids`, but for an unfinished last character (which
    the stream holds back for an id that never comes: at most 3 bytes, each a U+FFFD)."""
    full = nodes(m)["proc"].tokenizer.decode(ids, skip_special_tokens=True)
    return full.startswith(pieces) and set(full[len(pieces):]) <= {"\ufffd"} and len(full) - len(pieces) <= 3


# ------------------------------------------------------------------------------ chat
@pytest.mark.parametrize("media", list(MEDIA))
def test_chat_text_equals_transformers(engine: MStar, hf: Any, media: str) -> None:
    prompt = "what do you hear and see?"
    ours = engine.generate("chat", prompt=prompt, max_tokens=10, **MEDIA[media], **GREEDY)
    inputs = hf_inputs(engine, prompt, MEDIA[media])
    with torch.no_grad():
        ref = hf.thinker.generate(**inputs, max_new_tokens=10, do_sample=False,
                                  eos_token_id=TINY_IDS["im_end_token_id"])
    new = ref[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) > 2 and len(ours["text"]) > 2 and joins_to(ours["text"], engine, new)


def stream_pieces(proc: Any, ids: list[int]) -> list[str]:
    """Text pieces of ids sent as the walk's left_context(chunk = 1, left = 4) stream."""
    chunks = [{"token": torch.tensor(ids[max(0, i - 4) : i + 1], dtype=torch.int32), "token:context": min(i, 4)}
              for i in range(len(ids))]
    return [o["piece"] for o in proc.run("detokenize", chunks)]


def test_streamed_pieces_join_to_one_decode(engine: MStar) -> None:
    """A character split over several ids waits for its last one (also when the chunk's
    history starts inside a character), and the pieces join to one decode."""
    proc = nodes(engine)["proc"]
    text = "Hello wörld, 你好 😀!"
    ids = proc.tokenizer.encode(text, add_special_tokens=False).ids + [TINY_IDS["im_end_token_id"]]
    assert len(ids) > len(text) // 2  # the bundled tokenizer splits most characters into bytes
    pieces = stream_pieces(proc, ids)
    assert "".join(pieces) == text and "" in pieces[:-1]
    # any ids (invalid byte sequences too): the pieces are one decode but for an unfinished last character
    for seed in range(20):
        ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        assert joins_to("".join(stream_pieces(proc, ids)), engine, ids)


def test_audio_and_image_inputs_change_the_answer(engine: MStar) -> None:
    texts = [engine.generate("chat", prompt="and now?", max_tokens=8, **inputs, **GREEDY)["text"]
             for inputs in ({"audio": clip(1.2, 1)}, {"audio": clip(1.2, 3)}, {"image": picture(40, 56, 2)},
                            {"image": picture(40, 56, 5)})]
    assert texts[0] != texts[1] and texts[2] != texts[3]


# ------------------------------------------------------------------------------ speech
@pytest.mark.parametrize("media", ["image", "audio"])
def test_speech_equals_transformers_generate(engine: MStar, hf: Any, media: str) -> None:
    """Greedy thinker and talker: the text and the codes of every frame equal HF's; an image
    makes the talker's positions 3-D, an audio leaves them 1-D (as HF)."""
    prompt, tokens, frames = "say something", 6, 10
    with Windows(engine) as w:
        ours = engine.generate("speech", prompt=prompt, max_tokens=tokens, talker_do_sample=False,
                               talker_max_frames=frames, **MEDIA[media], **GREEDY)
    captured: dict[str, torch.Tensor] = {}
    chunked = hf.code2wav.chunked_decode

    def capture(codes: torch.Tensor, **kw: Any) -> torch.Tensor:
        captured["codes"] = codes.clone()
        return chunked(codes, **kw)

    inputs = hf_inputs(engine, prompt, MEDIA[media])
    hf.code2wav.chunked_decode = capture
    try:
        with torch.no_grad():
            seqs, wav = hf.generate(**inputs, speaker="ethan", return_audio=True, thinker_max_new_tokens=tokens,
                                    thinker_do_sample=False, thinker_eos_token_id=TINY_IDS["im_end_token_id"],
                                    talker_do_sample=False, talker_max_new_tokens=frames)
    finally:
        hf.code2wav.chunked_decode = chunked
    assert joins_to(ours["text"], engine, seqs[0, inputs["input_ids"].shape[1]:].tolist())
    # HF computes a frame's residual codes at the next talker step: its last frame has none
    ref = captured["codes"][0].T  # [frames - 1, code groups]
    codes = w.codes()
    assert codes.shape == (frames, 4) and torch.equal(codes[: frames - 1].long(), ref)
    audio, wav = ours["audio_out"], wav.reshape(-1)
    assert audio.dtype == torch.float32 and audio.shape == (SPF * frames - TRIM,)
    assert wav.shape == (SPF * (frames - 1) - TRIM,) and float(wav.std()) > 0.02
    # the first two windows (c2w_first = 2 frames, then 4 more: frames 0..5) see their whole
    # history: HF's samples
    exact = SPF * 6 - TRIM
    torch.testing.assert_close(audio[:exact], wav[:exact], atol=ATOL, rtol=0)


def test_talker_frames_stop_at_max_frames(engine: MStar) -> None:
    """A text longer than talker_max_frames: the frames past the limit are no-ops (no codes)."""
    with Windows(engine) as w:
        out = engine.generate("speech", prompt="go on", max_tokens=9, talker_max_frames=3, **GREEDY)
    assert w.codes().shape[0] == 3 and out["audio_out"].shape == (SPF * 3 - TRIM,)


def test_streamed_code2wav_equals_one_full_decode(checkpoint: Path, tmp_path: Path) -> None:
    """With an 8-frame sliding window (receptive field ~16 frames) and 16 frames of left
    context, the stream's windows join to one decode of all its frames."""
    text = WALK.read_text(encoding="utf-8")
    tiny = text.index("variant tiny")
    assert text.count("    c2w_left = 4\n", tiny) == 1
    copy = text[:tiny] + text[tiny:].replace("    c2w_left = 4\n", "    c2w_left = 16\n    c2w_sliding_window = 8\n")
    (tmp_path / "qwen3_omni.walk").write_text(copy, encoding="utf-8")
    plan = compile_walk(tmp_path / "w8.plan", tmp_path / "qwen3_omni.walk")
    with MStar.load(plan, weights=checkpoint) as m, Windows(m) as w:
        out = m.generate("speech", prompt="a longer answer, please", max_tokens=6, talker_max_frames=26, seed=4)
        node = nodes(m)["code2wav"]
        codes = w.codes()
        with torch.no_grad():
            full = node(codes.T[None].long())[0].float()
    frames = codes.shape[0]
    # 2 new frames first (c2w_first), then 4 each
    assert frames == 26 and [c for _, c in w.seen] == [0, 2, 6, 10, 14, 16, 16]
    audio = out["audio_out"]
    assert audio.shape == full.shape == (SPF * frames - TRIM,)
    assert float(audio.std()) > 0.02 and float((audio.abs() < 1).float().mean()) > 0.99  # alive, not clipped
    torch.testing.assert_close(audio, full, atol=ATOL, rtol=0)


def test_mstar_run_writes_text_and_a_wav(plan_path: Path, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    lines = [{"id": "talk", "walk": "speech", "inputs": {"prompt": "hello", "max_tokens": 4, "talker_max_frames": 7}},
             {"id": "ask", "walk": "chat", "inputs": {"prompt": "hi", "max_tokens": 5}}]
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "mstar_runtime.cli", str(plan_path), "--requests", str(requests),
                          "--out", str(out), "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for rid in ("talk", "ask"):
        record = json.loads((out / f"{rid}.json").read_text(encoding="utf-8"))
        assert record["state"] == "finished" and f"{rid}.text.txt" in record["files"]
    with wave.open(str(out / "talk.audio_out.wav"), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000)
        n = f.getnframes()
    assert n > 0 and (n + TRIM) % SPF == 0 and (n + TRIM) // SPF <= 7  # whole frames (no codes for an eos frame)


# ------------------------------------------------------------------------------ batching, step paths
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("speech", {"prompt": "tell me", "image": picture(32, 48, 7), "temperature": 0.8, "max_tokens": 5,
                "talker_max_frames": 9, "seed": 1}),
    ("speech", {"prompt": "listen", "audio": clip(0.8, 2), "max_tokens": 4, "talker_do_sample": False,
                "talker_max_frames": 6, **GREEDY}),
    ("chat", {"prompt": "greedy", "max_tokens": 9, **GREEDY}),
    ("chat", {"prompt": "sampled", "max_tokens": 9, "temperature": 0.9, "top_k": 0, "seed": 3}),
    ("chat", {"prompt": "top-k", "max_tokens": 9, "seed": 5}),  # the default top-k 20: a cohort row
]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["text"] != b["text"] or ("audio_out" in a) != ("audio_out" in b):
        return False
    return "audio_out" not in a or (a["audio_out"].shape == b["audio_out"].shape
                                    and torch.allclose(a["audio_out"], b["audio_out"], atol=ATOL, rtol=0))


def test_a_batch_equals_each_request_alone(engine: MStar) -> None:
    talker = nodes(engine)["talker"]
    sizes: list[int] = []
    original = talker.run

    def counted(phase: str, batch: list[dict], attn: Any) -> list[dict]:
        if phase == "frame":
            sizes.append(len(batch))
        return original(phase, batch, attn)

    talker.run = counted
    try:
        # queued while the engine thread waits for its (reentrant) lock: admitted together
        with engine._lock:
            handles = [engine.submit(walk, inputs) for walk, inputs in REQUESTS]
        together = [h.result(timeout=120) for h in handles]
    finally:
        del talker.run  # the class's own method again
    assert max(sizes) == 2  # the two speech requests' text frames ran as one talker step
    alone = [engine.submit(walk, inputs).result(timeout=120) for walk, inputs in REQUESTS]
    assert all(same(a, b) for a, b in zip(together, alone, strict=True))
    assert together[0]["audio_out"].numel() and together[0]["text"] != together[1]["text"]


def test_cohorts_give_the_generic_paths_outputs(plan_path: Path, checkpoint: Path) -> None:
    outs: dict[str, list[dict[str, Any]]] = {}
    for path in ("cohort", "generic"):
        with MStar.from_plan(as_run(load_plan(plan_path), path), weights=checkpoint) as m:
            outs[path] = [h.result(timeout=120) for h in [m.submit(w, i) for w, i in REQUESTS]]
            steps = m.conductor.stats["cohort_steps"]
            assert steps > 0 if path == "cohort" else steps == 0
            # the speech loop (a thinker step, then a talker frame of its item) is one chained cohort
            speech = [c for key, c in m.conductor.cohorts.items() if key[3] == "speech.l1"]
            assert [c.stats["joins"] for c in speech] == ([2] if path == "cohort" else [])
    assert all(same(a, b) for a, b in zip(outs["cohort"], outs["generic"], strict=True))


TOP_K_CHATS: list[dict[str, Any]] = [
    {"prompt": "top-k", "max_tokens": 12, "seed": 5},  # the walk's defaults: top-k 20, top-p 0.8
    {"prompt": "top-k", "max_tokens": 12, "seed": 6},
    {"prompt": "a small k", "max_tokens": 12, "temperature": 1.5, "top_k": 3, "top_p": 1.0, "seed": 7},
    {"prompt": "k of one", "max_tokens": 12, "temperature": 1.0, "top_k": 1, "seed": 8},
]


def test_top_k_chats_decode_on_the_cohort_path(plan_path: Path, checkpoint: Path) -> None:
    """Top-k rows join the thinker's decode cohort (no plain `decode` call runs there: the
    generic run's go through ops/column_call.py) and give the generic path's text, batched
    with rows of other k."""
    texts: dict[str, list[str]] = {}
    for path in ("cohort", "generic"):
        with MStar.from_plan(as_run(load_plan(plan_path), path), weights=checkpoint) as m:
            thinker = nodes(m)["thinker"]
            calls: list[int] = []
            original = thinker.run

            def counted(phase: str, batch: list[dict], attn: Any, original: Any = original,
                        calls: list[int] = calls) -> list[dict]:
                if phase == "decode":
                    calls.append(len(batch))
                return original(phase, batch, attn)

            thinker.run = counted
            with m._lock:  # admitted together: one cohort of four rows with different k
                handles = [m.submit("chat", inputs) for inputs in TOP_K_CHATS]
            texts[path] = [h.result(timeout=120)["text"] for h in handles]
            steps = m.conductor.stats["cohort_steps"]
            if path == "cohort":
                assert steps > 0 and not calls
            else:
                assert steps == 0 and calls
    assert texts["cohort"] == texts["generic"]
    assert texts["cohort"][0] != texts["cohort"][1] and all(texts["cohort"])  # the seeds matter


def test_forced_preemption_gives_the_same_outputs(plan_path: Path, checkpoint: Path, engine: MStar) -> None:
    """Preempted requests restart from scratch (node states dropped, seeded sampling): the
    same text and audio, none of it streamed twice."""
    alone = [engine.submit(walk, inputs).result(timeout=120) for walk, inputs in REQUESTS]
    with MStar.load(plan_path, weights=checkpoint, preempt_every=5) as m:
        again = [h.result(timeout=120) for h in [m.submit(w, i) for w, i in REQUESTS]]
        assert m.conductor.stats["preemptions"] > 0
    assert all(same(a, b) for a, b in zip(alone, again, strict=True))


# ------------------------------------------------------------------------------ bad input
def test_bad_inputs_fail_the_request_with_a_clear_error(engine: MStar) -> None:
    with pytest.raises(RequestFailed, match="unknown speaker") as e:
        engine.generate("speech", prompt="hi", speaker="nobody", max_tokens=2)
    assert e.value.field == "speaker"
    with pytest.raises(RequestFailed, match="nothing to answer"):
        engine.generate("chat", prompt="  ", max_tokens=2)
    with pytest.raises((RequestError, RequestFailed), match="image"):
        engine.generate("chat", prompt="hi", image=torch.zeros(8, 8, 3), max_tokens=2)
    with pytest.raises((RequestError, RequestFailed), match="audio"):
        engine.generate("chat", prompt="hi", audio=torch.zeros(100), max_tokens=2)
    # the engine still serves
    assert engine.generate("chat", prompt="still there?", max_tokens=3, **GREEDY)["text"] is not None
