"""The Orpheus benchmark's CPU smoke run: tools/bench/orpheus.py end to end at the tiny size.

The figures mean nothing on a CPU; what is checked is that the one command the GPU machine
runs works: the walk compiles with the end check disabled, M* and both HF modes run on the
same weights at every batch size, on both step paths (cohort, and generic: the plan without
its cohort marks), the in-process
closed loop runs, every request generates exactly --tokens tokens, and the JSON has every
figure the table prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_orpheus_bench_smoke_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "orpheus.json"
    cmd = [sys.executable, str(ROOT / "tools/bench/orpheus.py"), "--device", "cpu", "--variant", "tiny",
           "--batches", "1,2", "--hf-batches", "1,2", "--tokens", "16", "--closed-loop", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "M* / best HF tokens/s" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["errors"] == [] and rec["audio_only"] is True and rec["read_bandwidth_tb_s"] > 0
    for b in ("1", "2"):
        m = rec["mstar"][b]
        assert m["generated_tokens"] == 16 * int(b) and m["min_tokens"] == 16  # the end check never fired
        assert m["decode_step_ms"] > 0 and m["floor_ms"] > 0 and m["rtf_p50"] > 0
        # both step paths ran: the cohort path (the default, first) as cohort steps, the generic one without
        g = rec["mstar"][f"{b}:generic"]
        assert m["path"] == "cohort" and m["cohort_steps"] > 0 and g["path"] == "generic" and g["cohort_steps"] == 0
        assert g["generated_tokens"] == m["generated_tokens"]
        for mode in ("dynamic", "static"):
            h = rec["hf"][mode][b]
            assert h["generated_tokens"] == 16 * int(b) and h["tokens_per_s"] > 0
        assert rec["speedup_vs_best_hf"][b] > 0
    # the closed loop: 4 x 2 requests, 2 in flight, each of exactly 16 tokens
    c = rec["mstar_closed"]["2"]
    assert c["requests"] == 8 and c["generated_tokens"] == 8 * 16 and c["tokens_per_s"] > 0 and c["vs_lockstep"] > 0
    assert c["rtf_p50"] > 0 and c["cohort_steps"] > 0  # (16 tokens make no audio window: no TTFA)


def test_orpheus_bench_fp8_on_cpu(tmp_path: Path) -> None:
    """`--fp8`: the llm compiled with `weights: fp8`, the parity figure printed and recorded, no HF."""
    out = tmp_path / "orpheus.json"
    cmd = [sys.executable, str(ROOT / "tools/bench/orpheus.py"), "--device", "cpu", "--variant", "tiny",
           "--batches", "1", "--tokens", "8", "--paths", "cohort", "--fp8", "--parity-tokens", "8", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FP8 parity against bf16 on the same weights, 8 greedy tokens" in proc.stdout
    assert "M* cohort fp8" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["errors"] == [] and rec["weights"] == "fp8" and rec["hf"] == {}
    fig = rec["fp8_parity"]
    assert fig["tokens"] == 8 and 0 < fig["max_logit_error_rel"] < 0.1 and 0 <= fig["greedy_agreement"] <= 1
    assert rec["mstar"]["1"]["generated_tokens"] == 8
