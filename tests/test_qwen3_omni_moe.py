"""Qwen3-Omni's MoE block (models/mstar_models/qwen3_omni/moe.py): grouped experts against the loop, HF parity.

The reference is transformers 5.24's `Qwen3OmniMoeThinkerTextSparseMoeBlock` and
`Qwen3OmniMoeTalkerTextSparseMoeBlock` (eager experts), given the same weights: their fused
`experts.gate_up_proj` [E, 2I, H] is exactly our per-expert gate / up rows stacked.
float32 tolerances: the grouped GEMMs and the loop add the same products in other orders
(a few ulps); 1e-5 relative.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_models.qwen3_omni import moe
from mstar_models.qwen3_omni.moe import SparseMoE

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5


def block(hidden: int = 64, experts: int = 8, inter: int = 32, top_k: int = 3, shared: int | None = None,
          normalize: bool = True, kernel: str = "auto", seed: int = 0) -> SparseMoE:
    m = SparseMoE(hidden, experts, inter, top_k, normalize, shared, kernel=kernel)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return m


def tokens(n: int, hidden: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("n", [1, 5, 64])
def test_grouped_and_padded_experts_equal_the_loop(n: int) -> None:
    m = block()
    x = tokens(n)
    weights, ids = moe.route(x, m.gate.weight, m.top_k, m.normalize)
    ref = moe.loop_experts(x, ids, weights, m.gate_up, m.down)
    assert moe.grouped_mm_supported("cpu", torch.float32)
    torch.testing.assert_close(moe.grouped_experts(x, ids, weights, m.gate_up, m.down), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(moe.padded_experts(x, ids, weights, m.gate_up, m.down), ref, rtol=RTOL, atol=ATOL)
    if n == 1:
        assert len(set(ids[0].tolist())) == m.top_k  # distinct experts per token


def test_experts_without_tokens_and_one_hot_expert() -> None:
    m = block(experts=16, top_k=2)
    x = tokens(7)
    # every token on experts 3 and 11: fourteen empty groups, one group holding all rows
    ids = torch.tensor([[3, 11]] * 7)
    weights = torch.softmax(torch.randn(7, 2, generator=torch.Generator().manual_seed(2)), -1)
    ref = moe.loop_experts(x, ids, weights, m.gate_up, m.down)
    for fn in (moe.grouped_experts, moe.padded_experts):
        torch.testing.assert_close(fn(x, ids, weights, m.gate_up, m.down), ref, rtol=RTOL, atol=ATOL)
    # and the loop reference itself is a weighted sum of per-expert SwiGLUs (so it can fail)
    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        e_m = m.experts[e]
        return e_m.down_proj.weight @ (torch.nn.functional.silu(e_m.gate_proj.weight @ v) * (e_m.up_proj.weight @ v))
    by_hand = torch.stack([weights[t, 0] * expert(3, x[t]) + weights[t, 1] * expert(11, x[t]) for t in range(7)])
    torch.testing.assert_close(ref, by_hand, rtol=RTOL, atol=ATOL)


def test_bf16_grouped_is_close_to_the_float32_loop() -> None:
    m = block()
    x = tokens(33)
    ref = m(x)
    low = block().to(torch.bfloat16)
    assert low.experts[2].up_proj.weight.data_ptr() == low.gate_up[2, low.intermediate :].data_ptr()
    got = low(x.to(torch.bfloat16)).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_kernel_choice() -> None:
    assert block(kernel="auto").kernel == "grouped"  # torch's grouped GEMM runs on this CPU
    for k in ("grouped", "padded", "loop"):
        assert block(kernel=k).kernel == k
    with pytest.raises(ValueError, match="unknown MoE kernel"):
        block(kernel="triton")
    with pytest.raises(ValueError, match="top_k"):
        SparseMoE(8, 4, 4, 5, True)


# ---------------------------------------------------------------------------- names, views
def test_per_expert_parameters_are_views_of_the_fused_buffers() -> None:
    m = SparseMoE(16, 4, 8, 2, True, 12)
    names = set(m.state_dict())
    assert "experts.3.down_proj.weight" in names and "shared_expert_gate.weight" in names
    assert "gate_up" not in names and "down" not in names  # non-persistent: never in a checkpoint
    assert tuple(m.experts[1].gate_proj.weight.shape) == (8, 16)
    with torch.no_grad():  # what the loader does: copy a checkpoint tensor into the parameter
        m.experts[1].up_proj.weight.copy_(torch.full((8, 16), 7.0))
        m.experts[2].down_proj.weight.copy_(torch.full((16, 8), 3.0))
    assert torch.all(m.gate_up[1, 8:] == 7.0) and torch.all(m.down[2] == 3.0)
    m64 = m.to(torch.float64)  # a conversion re-ties the parameters to the converted buffers
    with torch.no_grad():
        m64.experts[0].gate_proj.weight.fill_(5.0)
    assert m64.gate_up.dtype == torch.float64 and torch.all(m64.gate_up[0, :8] == 5.0)


# ---------------------------------------------------------------------------- HF parity
def _hf_block(kind: str, normalize: bool, shared: int | None) -> Any:
    cls = C.Qwen3OmniMoeTextConfig if kind == "thinker" else C.Qwen3OmniMoeTalkerTextConfig
    extra = {"shared_expert_intermediate_size": shared} if shared else {}
    cfg = cls(hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
              norm_topk_prob=normalize, **extra)
    return (M.Qwen3OmniMoeThinkerTextSparseMoeBlock if kind == "thinker" else M.Qwen3OmniMoeTalkerTextSparseMoeBlock)(cfg)


def _copy_to_hf(ours: SparseMoE, hf: Any) -> None:
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight)
        hf.experts.gate_up_proj.copy_(ours.gate_up)
        hf.experts.down_proj.copy_(ours.down)
        if hasattr(ours, "shared_expert"):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(hf.shared_expert, proj).weight.copy_(getattr(ours.shared_expert, proj).weight)
            hf.shared_expert_gate.weight.copy_(ours.shared_expert_gate.weight)


@pytest.mark.parametrize(("kind", "normalize", "shared"), [("thinker", True, None), ("thinker", False, None),
                                                           ("talker", True, 48), ("talker", False, 48)])
def test_block_matches_hf(kind: str, normalize: bool, shared: int | None) -> None:
    ours = block(shared=shared, normalize=normalize, seed=3)
    hf = _hf_block(kind, normalize, shared).eval()
    _copy_to_hf(ours, hf)
    x = tokens(2 * 9).view(2, 9, 64)  # HF takes [B, T, H]; we take packed rows
    with torch.no_grad():
        ref = hf(x).reshape(18, 64)
        for kernel in ("grouped", "padded", "loop"):
            ours.set_kernel(kernel)
            torch.testing.assert_close(ours(x.reshape(18, 64)), ref, rtol=RTOL, atol=ATOL)
    # the renormalisation changes the answer, so the comparison can fail
    ours.set_kernel("grouped")
    flipped = block(shared=shared, normalize=not normalize, seed=3)
    assert not torch.allclose(flipped(x.reshape(18, 64)), ref, rtol=1e-3, atol=1e-3)


def test_router_matches_hf_topk_router() -> None:
    cfg = C.Qwen3OmniMoeTextConfig(hidden_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
    hf = M.Qwen3OmniMoeThinkerTextTopKRouter(cfg)
    ours = block(seed=5)
    with torch.no_grad():
        hf.weight.copy_(ours.gate.weight)
        _, w_ref, ids_ref = hf(tokens(11))
    w, ids = moe.route(tokens(11), ours.gate.weight, 3, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_grouped_bf16_is_the_loop_and_replays_from_a_cuda_graph() -> None:
    """On a GPU (bf16, the released talker's sizes): the grouped kernel is chosen, equals the loop
    to bf16 rounding, and a CUDA graph of the block replays the eager result bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    dev = torch.device("cuda")
    m = SparseMoE(1024, 128, 384, 6, True, 768, device=dev, dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    assert m.kernel == "grouped"
    x = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16, generator=gen)
    with torch.inference_mode():
        eager = m(x)
        m.set_kernel("loop")
        ref = m(x)
        m.set_kernel("grouped")
        assert (eager.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
