"""models/mstar_models/layers: the layer library's pieces against transformers' own modules, and its weight views.

The models built on the library keep their own parity tests (test_orpheus_backbone,
test_qwen3_omni_lm, ...); these pin the pieces no model exercises alone: Gemma's `1 + w`
RMSNorm, the decoder stack against transformers' Qwen3 decoder layers (QK-norm, GQA, SwiGLU),
the fused weights' names and views through loading and conversion, and the rotations.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_models.layers.decoder import Decoder
from mstar_models.layers.linear import FusedRows, StackedWeights
from mstar_models.layers.mlp import GatedMLP
from mstar_models.layers.norm import RMSNorm
from mstar_models.layers.rotary import inv_freq, rope_tables, rotate_pairs

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.qwen3 import configuration_qwen3, modeling_qwen3  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unit_offset_rms_norm_is_gemmas(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 32, generator=gen).to(dtype)
    ref = GemmaRMSNorm(32, eps=1e-6).to(dtype)
    ours = RMSNorm(32, 1e-6, unit_offset=True, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32, generator=gen) * 0.1)
        ours.weight.copy_(ref.weight)
        assert torch.equal(ours(x), ref(x))
        plain = RMSNorm(32, 1e-6, dtype=dtype)
        plain.weight.copy_(ref.weight)
        assert not torch.equal(plain(x), ref(x))  # the offset matters: w, not 1 + w, is stored


def _causal_attend(heads: int, kv_heads: int, n: int):
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(n, heads, -1)

    return attend


def test_decoder_with_qk_norm_is_transformers_qwen3() -> None:
    """Two layers of transformers' Qwen3 model (QK-norm, GQA 4:2, SwiGLU) given our weights by name."""
    cfg = configuration_qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          rms_norm_eps=1e-6, rope_theta=10000.0, attn_implementation="eager")
    ref = modeling_qwen3.Qwen3Model(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    ours = Decoder(2, 32, 4, 2, 16, 1e-6, lambda i: GatedMLP(32, 48), qk_norm=True)
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith(("embed_tokens", "rotary"))}
    assert set(state) == {k for k, _ in ours.named_parameters()}  # the checkpoint's names, no more, no less
    ours.load_state_dict(state, strict=True)
    n = 9
    h = torch.randn(n, 32, generator=gen)
    positions = torch.arange(n)
    cos, sin = rope_tables(positions, inv_freq(16, 10000.0), h.dtype)
    with torch.no_grad():
        got = ours.forward_layers(h, cos, sin, _causal_attend(4, 2, n))
        want = ref(inputs_embeds=h[None], position_ids=positions[None]).last_hidden_state[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_rows_are_the_parts_through_loading_and_conversion() -> None:
    m = FusedRows({"q_proj": 3, "k_proj": 2}, 4, bias=True)
    assert [k for k, _ in m.named_parameters()] == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"]
    q, k = torch.arange(12.0).view(3, 4), -torch.arange(8.0).view(2, 4)
    m.load_state_dict({"q_proj.weight": q, "q_proj.bias": torch.ones(3), "k_proj.weight": k,
                       "k_proj.bias": torch.zeros(2)})
    m = m.to(torch.float64)  # a conversion must leave the parts views of the (converted) buffer
    assert m.q_proj.weight.data_ptr() == m.fused.data_ptr()
    x = torch.randn(5, 4, dtype=torch.float64)
    out_q, out_k = m.project(x)
    torch.testing.assert_close(out_q, x @ q.double().T + 1)
    torch.testing.assert_close(out_k, x @ k.double().T)
    s = StackedWeights(3, 2, 4).to(torch.float64)
    with torch.no_grad():
        s[1].weight.fill_(7.0)
    assert s.stacked[1].eq(7.0).all()


def test_fused_rows_with_some_biases_add_none_to_the_others() -> None:
    # Whisper's q/k/v: q and v have a bias, k has none (and no `k_proj.bias` in the checkpoint)
    m = FusedRows({"q_proj": 2, "k_proj": 2, "v_proj": 2}, 3, bias=("q_proj", "v_proj"))
    assert [k for k, _ in m.named_parameters()] == ["q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                    "v_proj.weight", "v_proj.bias"]
    with torch.device("meta"):
        m = FusedRows({"q_proj": 2, "k_proj": 2, "v_proj": 2}, 3, bias=("q_proj", "v_proj"))
    m = m.to_empty(device="cpu")  # undefined storage: the bias-less slice must still add nothing
    with torch.no_grad():
        for part in (m.q_proj, m.k_proj, m.v_proj):
            part.weight.copy_(torch.eye(2, 3))
        m.q_proj.bias.fill_(1.0)
        m.v_proj.bias.fill_(2.0)
    x = torch.randn(4, 3)
    q, k, v = m.project(x)
    torch.testing.assert_close(q, x[:, :2] + 1)
    torch.testing.assert_close(k, x[:, :2])
    torch.testing.assert_close(v, x[:, :2] + 2)
    with pytest.raises(ValueError, match="o_proj"):
        FusedRows({"q_proj": 2}, 3, bias=("o_proj",))


def test_rotate_pairs_turns_dim_2k_with_2k_plus_1() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_pairs(x).tolist() == [-2.0, 1.0, -4.0, 3.0]
