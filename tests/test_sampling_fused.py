"""`sampling.fused` (top-k, top-p and the draw as Triton kernels) in Triton's interpreter on the
CPU: every row draws the stage's token (`sample_columns`, the torch ops) unless its top-p
boundary is ambiguous, on a vocabulary of several segments with ties, masked entries, greedy
rows, NaN rows and every kind of setting, with the default launch shape and with others (segments,
digit widths, accumulator layouts, block skipping). And the kernels compiled for sm_90 (no GPU
needed), since Triton's compiler refuses code its interpreter runs.

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

# launch shapes (`fused.sample_rows`'s keywords): the default, other segment counts, 2-bit digits
# with every pass skipping blocks, 8-bit digits in the old [block, bins] accumulators
SHAPES = [{}, {"segments": 1}, {"segments": 3}, {"segments": 3, "bits": 2, "skip_bits": 0},
          {"bits": 8, "block": 64, "by_digit": False}]

DRIVER = f"SHAPES = {SHAPES!r}\n" + """
import dataclasses, json, sys
from safetensors.torch import load_file
from mstar_runtime.sampling import fused, stage
from mstar_runtime.sampling.columns import SamplingColumns
from mstar_runtime.sampling.seeds import uniforms
saved = load_file(sys.argv[1])
x = saved.pop("x")
cols = SamplingColumns(**{f.name: saved.get(f.name) for f in dataclasses.fields(SamplingColumns)})
out = {}
for shape in SHAPES:
    got = fused.sample_rows(stage._penalised(x, cols), cols.top_k, cols.top_p, cols.greedy,
                            uniforms(cols.seed, cols.step), **shape)
    out[str(shape)] = got.tolist()
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
    assert int(drawn["{}"][7]) == 0
    assert len(drawn) == len(SHAPES)
    for shape, got in drawn.items():
        bad = (torch.tensor(got) != want) & ~amb
        assert not bool(bad.any()), f"{shape}: rows {bad.nonzero().flatten().tolist()}"
    assert float(amb.float().mean()) <= 0.15


def compiled(fn: object, args: dict[str, str], consts: dict[str, object]) -> None:
    """Compile one kernel for an H100/H200 (sm_90) through ptxas, as a launch there would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**args, **{name: "constexpr" for name in consts}}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8})


@pytest.mark.slow
def test_the_kernels_compile_for_the_gpu_in_every_launch_shape() -> None:
    """Every kernel with each set of constexprs `sample_rows` launches at Orpheus' vocabulary, at
    the default shape and at the probe's others: the interpreter accepts what the compiler does
    not (a plain int global, a name rebound with another type, a constexpr `a if c else b`)."""
    import triton

    from mstar_runtime.sampling import fused

    f32, i32 = "*fp32", "*i32"
    row = {"scores": f32, "stride": "i32", "vocab": "i32", "seg": "i32", "S": "i32", "pmax": f32, "parg": i32,
           "pnan": i32}
    sel = {**row, "greedy": "*i1", "top_k": "*i64"}
    mass = {**sel, "top_p": f32, "cnt": i32, "mass": f32, "ties": i32}
    draw = {**sel, "top_p": f32, "u": "*fp64", "cnt": i32, "mass": f32, "ties": i32, "out": "*i64"}
    sp = triton.next_power_of_2(fused.segments_for(156_940))
    compiled(fused.seg_max, row, {"SCAN": fused._SCAN})
    for bits, block, by_digit in ((fused._BITS, fused._BLOCK, True), (2, 512, True), (4, 256, False), (8, 64, True)):
        compiled(fused.seg_draw, draw, {"SP": sp, "SCAN": fused._SCAN, "BITS": bits})
        shape = {"SP": sp, "BLOCK": block, "BITS": bits, "BY_DIGIT": by_digit}
        for skip in (False, True):
            compiled(fused.seg_count, {**sel, "cnt": i32, "level": "i32"}, {**shape, "SKIP": skip})
            for last in (False, True):
                compiled(fused.seg_mass, {**mass, "level": "i32"}, {**shape, "SKIP": skip, "LAST": last})
