"""The Whisper benchmark's CPU smoke run: tools/bench/whisper.py end to end at the tiny size.

The figures mean nothing on a CPU; what is checked is that the command the GPU machine runs
works: the walk compiles, M* runs B = 1 and a batch with every request generating exactly
--tokens tokens, transformers runs on the same weights (its tokens equal ours: the tiny
variant is float32, the reference bf16, so agreement is reported, not required), and the
JSON has every figure the table prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_whisper_bench_smoke_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "whisper.json"
    cmd = [sys.executable, str(ROOT / "tools/bench/whisper.py"), "--device", "cpu", "--variant", "tiny",
           "--batches", "2", "--repeats", "1", "--tokens", "6", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "B=1: p50" in proc.stdout and "audio s/s" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["tokens"] == 6 and rec["read_bandwidth_tbs"] > 0 and rec["floor"]["encoder_flops"] > 0
    assert rec["b1"]["p50_ms"] > 0 and rec["b1"]["floor_ms"] > 0
    (row,) = rec["throughput"]
    assert row["batch"] == 2 and row["audio_s_per_s"] > 0 and row["x_floor"] > 0
    (ref,) = rec["reference"]
    assert ref["b1_p50_ms"] > 0 and 0 <= ref["b1_tokens_equal"] <= 1 and ref["b2_ms"] > 0
