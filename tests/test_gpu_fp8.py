"""FP8 weights on a Hopper GPU: `torch._scaled_mm`'s row-wise FP8 GEMM against the same operands in float32, in a CUDA graph, and tiny Orpheus' parity.

The CPU tests (tests/test_fp8.py) pin the format's error with the dequantized product; here
the GEMM itself is checked: the same E4M3 operands and scales, multiplied by the FP8 tensor
cores with float32 accumulation and a bf16 result, must equal the float32 product of the
dequantized operands up to the accumulation order and the bf16 rounding of the output
(2^-8 relative; `rtol` 1e-2 leaves room for the order over k = 3072). Then tiny Orpheus in
bf16 on the GPU, FP8 against bf16 on the same weights, must meet the CPU test's thresholds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support import capture, compile_walk, load_script

from mstar_models.layers import fp8
from mstar_models.orpheus import LlamaBackbone
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.weights import load_weights

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hopper(cuda: torch.device) -> torch.device:
    if torch.cuda.get_device_capability(cuda) < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or later")
    return cuda


@pytest.mark.parametrize("m", [1, 3, 64])
def test_scaled_mm_equals_the_dequantized_float_product(hopper: torch.device, m: int) -> None:
    gen = torch.Generator(device=hopper).manual_seed(m)
    x = torch.randn(m, 3072, device=hopper, generator=gen).to(torch.bfloat16)
    q, scale = fp8.quantize_rows(torch.randn(4096, 3072, device=hopper, generator=gen).mul_(0.02).to(torch.bfloat16))
    assert fp8._scaled_mm_fits(x, q)
    y = fp8.fp8_linear(x, q, scale)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 4096)
    ref = fp8.fp8_linear(x.float(), q, scale)  # float32 activations: the dequantized path, same operands
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-3 * float(ref.abs().max()))


def test_the_fp8_gemm_replays_in_a_cuda_graph(hopper: torch.device) -> None:
    gen = torch.Generator(device=hopper).manual_seed(7)
    q, scale = fp8.quantize_rows(torch.randn(1024, 512, device=hopper, generator=gen).mul_(0.02))
    x = torch.randn(16, 512, device=hopper, generator=gen).to(torch.bfloat16)
    graph, out = capture(lambda t: fp8.fp8_linear(t, q, scale), x)
    x.copy_(torch.randn(16, 512, device=hopper, generator=gen))
    graph.replay()
    assert torch.equal(out, fp8.fp8_linear(x, q, scale))


def test_tiny_orpheus_fp8_parity_on_the_gpu(hopper: torch.device, tmp_path: Path) -> None:
    cpu_tests = load_script(ROOT / "tests/test_fp8.py", "fp8_cpu_tests")
    (tmp_path / "fp8.yaml").write_text(cpu_tests.FP8_CPU)
    walk = ROOT / "models/orpheus/orpheus.walk"
    nodes = []
    for name, placement in (("bf16", "placements/cpu.yaml"), ("fp8", tmp_path / "fp8.yaml")):
        plan = load_plan(compile_walk(tmp_path / f"{name}.plan", walk, placement, variant="tiny"))
        spec = plan.node_spec("llm", device="cuda")
        node = LlamaBackbone(dataclasses.replace(spec, dtype=torch.bfloat16,
                                                 settings={**spec.settings, "audio_only": False}))
        load_weights(node, plan, "llm", "dummy")
        nodes.append(node.eval())
    prompt = torch.randint(0, 128000, (24,), generator=torch.Generator().manual_seed(5))
    fig = cpu_tests._bench().fp8_parity(nodes[0], nodes[1], prompt, 64)
    assert 0 < fig["max_logit_error_rel"] <= cpu_tests.MAX_LOGIT_ERROR_REL, fig
    assert fig["greedy_agreement"] >= cpu_tests.MIN_AGREEMENT, fig


def test_the_compiled_activation_quantization_is_the_eager_one(hopper: torch.device) -> None:
    """One compiled kernel for the per-token quantization (fp8.quantize_activations): the eager
    math's scales, and its E4M3 codes to within one step (a division rounded differently)."""
    gen = torch.Generator(device=hopper).manual_seed(9)
    for m, k in ((1, 3072), (7, 8192), (64, 3072)):
        x = torch.randn(m, k, device=hopper, generator=gen).to(torch.bfloat16)
        x[0, :5] = 0.0
        qc, sc = fp8.quantize_activations(x)
        qe, se = fp8.quantize_rows(x)
        assert qc.dtype == torch.float8_e4m3fn and sc.shape == (m, 1)
        torch.testing.assert_close(sc, se, rtol=1e-6, atol=0)
        assert bool(((qc.float() - qe.float()).abs() <= qe.float().abs() * 2.0**-3 + 2.0**-9).all())
