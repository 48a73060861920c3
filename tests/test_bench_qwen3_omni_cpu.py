"""The Qwen3-Omni benchmark's CPU smoke run: tools/bench/qwen3_omni.py end to end at the tiny size.

The figures mean nothing on a CPU; what is checked is that the command the GPU machine runs
works and that its JSON is consistent:
- with dummy weights (the benchmark's default): speech at B = 1 and 2, every request exactly
  --frames frames (1920 F - 555 samples: the talker's codec eos is masked), audio seconds per
  second = audio / wall, TTFA p50 <= p90 <= the wall time, RTF p50 times the audio within
  the wall time, the talker's frames batched at B = 2; chat in both modes (greedy and
  top-k rows alike as cohort steps); transformers at B = 1 on the same weights with the
  same frames and tokens, its stage times within its wall time; the floors and speed-ups
  computed from the figures beside them;
- with a checkpoint (transformers' tiny model at weight scales where every part matters,
  written by `save_pretrained`): the greedy parity run's text and every frame's codes equal
  transformers', so every tensor reached transformers' parameter of the same name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools/bench/qwen3_omni.py"
SPF, TRIM, RATE = 1920, 555, 24000.0  # samples per codec frame, the decode's right-edge trim, Hz


def run_bench(tmp: Path, *extra: str) -> tuple[dict[str, Any], str]:
    out = tmp / "qwen3_omni.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--variant", "tiny", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_qwen3_omni_bench_smoke_on_cpu(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    frames, tokens, chat_tokens = 10, 4, 8
    rec, stdout = run_bench(tmp_path, "--batches", "1,2", "--tokens", str(tokens), "--frames", str(frames),
                            "--chat-batches", "1,2", "--chat-tokens", str(chat_tokens), "--parity-tokens", "4",
                            "--parity-frames", "8")
    assert "M* / transformers (B = 1)" in stdout
    assert rec["errors"] == [] and rec["read_bandwidth_tb_s"] > 0 and rec["codec_eos_masked"] == 2150
    assert rec["env"]["transformers"] == rec["hf"]["model"]["version"] == transformers.__version__
    per = (SPF * frames - TRIM) / RATE
    assert close(rec["audio_per_request_s"], per)
    speech = rec["mstar"]["speech"]
    for b in (1, 2):
        m = speech[str(b)]
        assert m["frames"] == frames * b and m["min_frames"] == m["max_frames"] == frames  # the fixed length
        assert close(m["audio_s"], b * per) and close(m["audio_s_per_s"], m["audio_s"] / m["wall_s"])
        assert 0 < m["ttfa_p50_ms"] <= m["ttfa_p90_ms"] <= m["wall_s"] * 1e3
        assert 0 < m["rtf_p50"] <= m["rtf_max"] and m["rtf_max"] * per <= m["wall_s"] * (1 + 1e-6)
        assert 0 < m["text_tokens"] <= tokens * b and close(m["text_tokens_per_s"], m["text_tokens"] / m["wall_s"])
        assert m["frame_ms"] > 0 and m["nodes"]["talker.frame"]["steps"] > 0
        assert close(m["floor_s"] * m["audio_s_per_s_floor"], m["audio_s"])
        assert close(m["x_floor"], m["audio_s_per_s_floor"] / m["audio_s_per_s"])
        assert m["text_frame_floor_ms"] > m["pad_frame_floor_ms"] > 0  # a text frame also runs a thinker step
    assert speech["2"]["nodes"]["talker.frame"]["mean_batch"] > 1  # both requests' text frames in one step
    assert speech["2"]["thinker_token_floor_ms"] > speech["1"]["thinker_token_floor_ms"]  # more experts, more KV
    chat = rec["mstar"]["chat"]
    for mode in ("sampled", "greedy"):
        for b in (1, 2):
            c = chat[mode][str(b)]
            assert 0 < c["tokens"] <= chat_tokens * b and close(c["tokens_per_s"], c["tokens"] / c["wall_s"])
            assert c["step_floor_ms"] > 0 and c["tokens_per_s_floor"] > 0
            # greedy rows and the walk's top-k 20 rows alike join the decode cohort
            assert c["cohort_steps"] > 0
    fm = rec["floor_model"]
    assert (fm["thinker"]["experts"], fm["thinker"]["top_k"], fm["thinker"]["moe_layers"]) == (4, 2, 2)
    assert fm["code_predictor"]["steps_per_frame"] == 3 and fm["code2wav"]["chunk_frames"] == 4
    h = rec["hf"]["speech"]["1"]
    assert h["frames"] == frames and h["samples"] == SPF * frames - TRIM and h["text_tokens"] == tokens
    assert h["thinker_s"] + h["talker_s"] + h["code2wav_s"] <= h["wall_s"]
    assert close(h["audio_s_per_s"], h["audio_s"] / h["wall_s"]) and close(h["ttfa_p50_ms"], h["wall_s"] * 1e3)
    assert rec["hf"]["chat"]["1"]["tokens"] == chat_tokens
    s = rec["speedup_vs_hf_b1"]
    assert close(s["speech_b1"], speech["1"]["audio_s_per_s"] / h["audio_s_per_s"]) and s["speech_b2"] > 0
    assert close(s["chat_b1"], chat["sampled"]["1"]["tokens_per_s"] / rec["hf"]["chat"]["1"]["tokens_per_s"])
    p = rec["parity"]
    assert p["mstar_frames"] == p["hf_frames"] == 8


def test_qwen3_omni_bench_parity_with_a_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from qwen3_omni_lm_support import hf_model

    from tests.test_qwen3_omni_code2wav import _randomize

    model = hf_model(seed=0)
    _randomize(model.code2wav, seed=0)  # audio unclipped
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    rec, _ = run_bench(tmp_path, "--weights", str(ckpt), "--batches", "1", "--tokens", "2", "--frames", "4",
                       "--chat-batches", "", "--chat-tokens", "4", "--parity-tokens", "6", "--parity-frames", "10")
    assert rec["errors"] == [] and rec["weights"] == str(ckpt)
    assert rec["hf"]["model"]["parameters"] == sum(1 for _ in model.named_parameters(remove_duplicate=False))
    p = rec["parity"]
    assert p["codes_equal"] and p["codes_match_frames"] == p["mstar_frames"] == p["hf_frames"] == 10
    assert p["text_equal"] and p["hf_text_tokens"] > 2 and p["mstar_text_chars"] > 0
