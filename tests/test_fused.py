"""runtime/mstar_runtime/ops/fused.py: the fused ops are Hugging Face's Llama math (checked against transformers'
own modules), eager on the CPU, compiled on a GPU with the same results (GPU tier)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama as hf

from mstar_runtime.ops import fused


def _rand(*shape: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_hf_llama_rmsnorm(dtype: torch.dtype) -> None:
    x = _rand(7, 64, dtype=dtype)
    norm = hf.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_rand(64, dtype=dtype))
        want = norm(x)
    assert torch.equal(fused.rms_norm(x, norm.weight, 1e-5), want)
    delta = _rand(7, 64, dtype=dtype)
    h, normed = fused.add_rms_norm(x, delta, norm.weight, 1e-5)
    assert torch.equal(h, x + delta)
    with torch.no_grad():
        assert torch.equal(normed, norm(x + delta))


def test_rope_is_hf_apply_rotary_pos_emb() -> None:
    q, k = _rand(5, 4, 16), _rand(5, 2, 16)
    angles = torch.rand(5, 8) * 6.0
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    # HF: [batch, heads, seq, dim] with cos/sin [batch, seq, dim] unsqueezed at dim 1
    want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    got_q, got_k = fused.rope(q, k, cos[:, None, :], sin[:, None, :])
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_silu_mul_is_the_llama_mlp_activation() -> None:
    g, u = _rand(3, 32), _rand(3, 32)
    assert torch.equal(fused.silu_mul(g, u), torch.nn.functional.silu(g) * u)


def test_the_cpu_runs_the_eager_math_without_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("torch.compile must not run for CPU tensors")

    monkeypatch.setattr(torch, "compile", refuse)
    op = fused._Fused(fused.silu_mul_ref)
    x = _rand(2, 8)
    assert torch.equal(op(x, x), fused.silu_mul_ref(x, x)) and op._compiled is None


def test_a_failed_compile_falls_back_to_the_eager_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without a working toolchain the op still answers, once warned."""
    op = fused._Fused(fused.silu_mul_ref)

    def broken(*a: object, **k: object) -> object:
        raise RuntimeError("no triton here")

    op._compiled = broken  # as if compiled, failing at the first call
    monkeypatch.setattr(op, "wants_compile", lambda t: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = _rand(2, 8)
    assert torch.equal(op(x, x), fused.silu_mul_ref(x, x))
    assert op._broken
    op._compiled = None
    assert torch.equal(op(x, x), fused.silu_mul_ref(x, x)) and op._compiled is None  # no second try


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 37])
def test_compiled_ops_equal_the_eager_math_on_the_gpu(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = "cuda"
    torch.manual_seed(n)
    x, delta, w = _rand(n, 3072, device=dev), _rand(n, 3072, device=dev), _rand(3072, device=dev)
    q, k = _rand(n, 24, 128, device=dev), _rand(n, 8, 128, device=dev)
    emb = torch.rand(n, 1, 128, device=dev) * 6.0
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    with torch.inference_mode():
        pairs = [
            (fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5)),
            (fused.add_rms_norm(x, delta, w, 1e-5), fused.add_rms_norm_ref(x, delta, w, 1e-5)),
            (fused.rope(q, k, cos, sin), fused.rope_ref(q, k, cos, sin)),
            (fused.silu_mul(x, delta), fused.silu_mul_ref(x, delta)),
        ]
    assert not any(op._broken for op in (fused.rms_norm, fused.add_rms_norm, fused.rope, fused.silu_mul)), \
        "torch.compile failed on the GPU machine (see the warning): the fused path did not run"
    for got, want in pairs:
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(got, want):
            # rounding of every intermediate is emulated: a few bf16 ulps apart at most, nearly always equal
            torch.testing.assert_close(a, b, rtol=2**-5, atol=1e-6)
            assert (a != b).float().mean().item() < 1e-3
