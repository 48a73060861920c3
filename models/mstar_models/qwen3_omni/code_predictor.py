"""Qwen3-Omni's code predictor: the 5-layer dense model that adds a frame's 15 residual codes.

Not a node of its own: the talker owns it (`TalkerMoE.code_predictor`, checkpoint names
`talker.code_predictor.*`), so that one talker frame -- the talker step and the 15
predictor steps -- is one tensor function the runtime captures as one CUDA graph
(talker.py).

The math is transformers 5.24's `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`
as the talker's `prepare_inputs_for_generation` runs it once per frame: a fresh context, a
2-row prefill [the talker's final-normed hidden state, `codec_embedding(code0)`] whose last row
gives code 1 through `lm_head[0]`, then single-row steps: step g feeds
`codec_embedding[g - 1](code g)` and `lm_head[g]` gives code g + 1. Layers are `layers.decoder.Decoder`
with a dense SwiGLU MLP, QK-norm and 1-D RoPE (positions 0 .. 15 within the frame).
Parameters: `model.layers.{i}.*`, `model.norm.weight`, `model.codec_embedding.{g}.weight`,
`lm_head.{g}.weight` (g < code_groups - 1), the tables and heads views of two stacked buffers.

`residual_codes` runs a frame for a batch of rows: every row is at the same step of its
frame, so each of the 15 steps has fixed shapes (2 queries per row, then 1) and the frame's
K/V is a dense [rows, kv_heads, 16, head_dim] tensor per layer made inside the call: no
paged KV, nothing kept between frames, no host value read (capturable). Sampling is HF's
code-predictor distribution (top-k 50, top-p 0.8 at temperature 1; greedy rows take the
argmax) drawn over `torch.topk`'s 50 values (`sample_top_k_top_p`); row r's draw at step g
uses `uniform(seed[r], draws[r] + g)`, all 15 computed at the start of the frame. The draw
is the stage's `pick_from_cdf`, not its `sample_columns`: that walks the CDF of the whole
processed row in vocabulary order (and keeps ties at the k-th value), this one the k values
in descending order, so the same uniform picks another code (most draws would change).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.decoder import Decoder
from mstar_models.layers.linear import StackedWeights
from mstar_models.layers.mlp import GatedMLP
from mstar_models.layers.rotary import inv_freq, rope_tables
from mstar_runtime import sampling

TOP_K, TOP_P = 50, 0.8  # HF's talker passes these to the code predictor's generate when sampling


class CodePredictor(nn.Module):
    """The predictor's weights (checkpoint names under `talker.code_predictor.`) and its frame."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 vocab: int, groups: int, eps: float, rope_theta: float, **factory: Any):
        super().__init__()
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.groups = groups
        self.model = Decoder(layers, hidden, heads, kv_heads, head_dim, eps,
                             lambda i: GatedMLP(hidden, intermediate, **factory), qk_norm=True, **factory)
        self.model.codec_embedding = StackedWeights(groups - 1, vocab, hidden, **factory)
        self.lm_head = StackedWeights(groups - 1, vocab, hidden, **factory)
        self.register_buffer("freq", inv_freq(head_dim, rope_theta).to(factory.get("device")), persistent=False)
        self.scale = head_dim**-0.5

    def residual_codes(self, first: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor,
                       draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame per row: `first` [n, 2, hidden] (the talker's hidden state and the
        embedding of code 0) -> (codes 1..G-1 int64 [n, G-1], their embeddings [n, G-1, hidden],
        each code's row of the table that embeds it: the talker's next codec input sums them)."""
        n, dev, dt = first.shape[0], first.device, first.dtype
        layers = len(self.model.layers)
        length = self.groups  # positions 0 .. G-1: the two prefill rows and G - 2 single steps
        keys = first.new_zeros(layers, n, self.kv_heads, length, self.head_dim)
        values = torch.zeros_like(keys)
        positions = torch.arange(length, device=dev)
        cos_all, sin_all = rope_tables(positions, self.freq, dt)
        # every draw of the frame at once: uniforms(seed, draws + g) for the G - 1 steps
        steps = torch.arange(self.groups - 1, device=dev)
        u = sampling.uniforms(seed[:, None].expand(n, self.groups - 1), draws[:, None] + steps)
        x, codes, embeds = first.reshape(2 * n, self.hidden), [], []
        for g in range(self.groups - 1):
            start, q = (0, 2) if g == 0 else (g + 1, 1)
            cos = cos_all[start : start + q].repeat(n, 1, 1)
            sin = sin_all[start : start + q].repeat(n, 1, 1)
            hidden = self.model.forward_layers(x, cos, sin, self._attend(keys, values, start, q, n))
            last = hidden.view(n, q, self.hidden)[:, -1]
            logits = F.linear(last, self.lm_head.stacked[g]).float()
            code = sample_top_k_top_p(logits, greedy, u[:, g])
            x = F.embedding(code, self.model.codec_embedding.stacked[g])
            codes.append(code)
            embeds.append(x)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)

    def _attend(self, keys: torch.Tensor, values: torch.Tensor, start: int, q: int, n: int) -> Any:
        """Write the step's K/V at frame positions start .. start + q - 1 of every row, then
        attend (causally within the step) over positions 0 .. start + q - 1."""
        end = start + q

        def attend(layer: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys[layer, :, :, start:end] = k.view(n, q, self.kv_heads, self.head_dim).transpose(1, 2)
            values[layer, :, :, start:end] = v.view(n, q, self.kv_heads, self.head_dim).transpose(1, 2)
            qq = qs.view(n, q, self.heads, self.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(qq, keys[layer, :, :, :end], values[layer, :, :, :end],
                                                 is_causal=q > 1, scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2).reshape(n * q, self.heads, self.head_dim)

        return attend


def sample_top_k_top_p(logits: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One code per row: the argmax where `greedy`, else a draw from HF's code-predictor
    distribution (temperature 1, top-k 50, then top-p 0.8: `TopKLogitsWarper` then
    `TopPLogitsWarper`) by inverse CDF with `u` (float64 [n] in [0, 1)).

    Only the k largest logits can survive top-k, so the draw works on `torch.topk`'s k values
    (sorted, descending) instead of a sort of the whole vocabulary: the softmax over them is
    the top-k-masked softmax, and HF's top-p rule (drop the smallest tokens whose ascending
    cumulative probability is <= 1 - p, keep at least one) keeps, in descending order, every
    token whose exclusive prefix sum is below p. The same distribution as sorting the whole
    row, in a handful of kernels (15 draws a frame)."""
    k = min(TOP_K, logits.shape[-1])
    values, ids = torch.topk(logits, k, dim=-1)
    probs = torch.softmax(values, dim=-1)
    kept = values.masked_fill(torch.cumsum(probs, dim=-1) - probs >= TOP_P, float("-inf"))
    pick = sampling.pick_from_cdf(kept, u)  # the sampler's inverse-CDF draw, over the k values
    return torch.where(greedy, logits.argmax(dim=-1), ids.gather(1, pick[:, None])[:, 0])
