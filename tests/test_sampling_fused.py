"""`sampling.fused` (top-k, top-p and the draw as Triton kernels) in Triton's interpreter on the
CPU: every row draws the stage's token (`sample_columns`, the torch ops) unless its top-p
boundary is ambiguous, on a vocabulary of several segments with ties, masked entries, greedy
rows, NaN rows and every kind of setting, with the default segment count and with others.

The kernels run in a subprocess with TRITON_INTERPRET=1 (the variable is read when the kernels
are defined, at import). Skipped where Triton is not installed (CPU builds of torch have none);
the GPU checks are in tests/test_sampling_stage.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_sampling_stage import ambiguous_rows, gen, histories, mixed_params

from mstar_runtime.sampling import SamplingParams, columns_of, sample_columns

pytest.importorskip("triton")
if tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4):
    pytest.skip("Triton 3.6's interpreter fails under numpy >= 2.4 (it converts 1-element arrays "
                "to scalars)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 3001  # 5 segments of 640 entries by default (fused.segments_for)

DRIVER = """
import dataclasses, json, sys
from safetensors.torch import load_file
from mstar_runtime.sampling import fused, stage
from mstar_runtime.sampling.columns import SamplingColumns
from mstar_runtime.sampling.seeds import uniforms
saved = load_file(sys.argv[1])
x = saved.pop("x")
cols = SamplingColumns(**{f.name: saved.get(f.name) for f in dataclasses.fields(SamplingColumns)})
out = {}
for segments in (None, 1, 3):
    got = fused.sample_rows(stage._penalised(x, cols), cols.top_k, cols.top_p, cols.greedy,
                            uniforms(cols.seed, cols.step), segments=segments)
    out[str(segments)] = got.tolist()
print(json.dumps(out))
"""


def cases() -> tuple[torch.Tensor, list[SamplingParams]]:
    n = 40
    params = mixed_params(n - 8, VOCAB, 5) + [SamplingParams(0.6, 0, 0.8, 1.3, seed=b) for b in range(6)]
    params += [SamplingParams(temperature=0.0), SamplingParams(1.0, 0, 0.5, seed=3)]
    x = torch.randn(n, VOCAB, generator=gen(4)) * torch.tensor([0.3, 2.0, 8.0, 30.0]).repeat(n // 4)[:, None]
    x[::3] = (x[::3] * 2).round() / 2  # ties everywhere, at the k-th value and across segments
    x[5, :700] = float("-inf")  # masked across a segment boundary
    x[6, :] = 1.5  # one value: every entry a tie
    x[7, 11] = float("nan")  # a padding row's logits
    return x, params


@pytest.mark.slow
def test_the_kernels_draw_the_stages_tokens_in_the_interpreter(tmp_path: Path) -> None:
    x, params = cases()
    cols = columns_of(params, histories(params, VOCAB, 6), [7 * b + 3 for b in range(len(params))], "cpu")
    # safetensors, not torch.save: no pickle crosses to the subprocess (a None column is left out)
    save_file({"x": x, **{k: v for k, v in vars(cols).items() if v is not None}}, tmp_path / "cases.safetensors")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "cases.safetensors")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    drawn = json.loads(run.stdout.strip().splitlines()[-1])
    want = sample_columns(x, cols)
    amb = ambiguous_rows(x, cols)
    amb[7] = True  # a NaN row: the kernels draw 0, the torch ops' greedy argmax takes the NaN
    assert int(drawn["None"][7]) == 0
    for segments, got in drawn.items():
        bad = (torch.tensor(got) != want) & ~amb
        assert not bool(bad.any()), f"segments={segments}: rows {bad.nonzero().flatten().tolist()}"
    assert float(amb.float().mean()) <= 0.15
