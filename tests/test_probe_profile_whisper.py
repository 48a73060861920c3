"""The Whisper profile probe (tools/probes/profile_whisper.py) at the tiny size on the CPU.

What is checked is that the command the GPU machine runs works and records what it promises:
one record per batch size, the worker's seconds per node phase with the decoder's cohort step
(`step:cohort`) present, positive and as many rows as the batch has requests times the steps,
host time, and the top operators (no device figures on the CPU). Timings are only checked to
exist: they depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path

from support import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_probe_profile_whisper_on_cpu(tmp_path: Path) -> None:
    probe = load_script(ROOT / "tools" / "probes" / "profile_whisper.py", "profile_whisper_probe")
    out = tmp_path / "p.json"
    assert probe.main(["--device", "cpu", "--variant", "tiny", "--batches", "1", "2", "--tokens", "4",
                       "--rows", "5", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["variant"] == "tiny" and rec["tokens"] == 4 and rec["clip_seconds"] == 30.0
    assert [b["batch"] for b in rec["batches"]] == [1, 2]
    for b in rec["batches"]:
        assert b["wall_s"] > 0 and b["profiled_wall_s"] > 0 and b["warmup_s"] > 0
        for key in ("phases", "profiled_phases"):
            by = {(r["node"], r["phase"]): r for r in b[key]}
            step = by[("decoder", "step:cohort")]
            assert step["seconds"] > 0 and step["steps"] >= 1 and step["rows"] == b["batch"] * step["steps"], key
            assert by[("encoder", "encode")]["seconds"] > 0 and by[("encoder", "encode")]["rows"] == b["batch"]
            assert all(r["seconds"] >= 0 and r["steps"] > 0 for r in b[key])
        assert b["cohort_steps"] >= 1 and b["cohort_rows"] == b["batch"] * b["cohort_steps"]
        assert b["host_ms"] > 0 and b["device_ms"] is None and b["top_self_cuda"] == []
        assert len(b["top_self_cpu"]) == 5 and all(r["self_cpu_ms"] >= 0 and r["calls"] > 0
                                                    for r in b["top_self_cpu"])
