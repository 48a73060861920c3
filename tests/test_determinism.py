"""Compiling twice under different PYTHONHASHSEED values gives byte-identical plans."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("model,placement,variant", [
    ("bagel", "bagel_cfg3", "real"),
    ("qwen3_omni", "qwen3_omni_tp2", "real"),
    ("orpheus", "cpu", "tiny"),
    ("vjepa2", "h100x4", "real"),
])
def test_plan_bytes_do_not_depend_on_hash_seed(model: str, placement: str, variant: str, tmp_path: Path) -> None:
    outputs = []
    for seed in ("0", "12345"):
        out = tmp_path / f"plan-{seed}.bin"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-m", "mstarc.cli", "compile", f"models/{model}/{model}.walk",
                        "--variant", variant, "-p", f"placements/{placement}.yaml", "-o", str(out)],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
