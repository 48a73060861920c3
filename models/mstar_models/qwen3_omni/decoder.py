"""The decoder stack Qwen3-Omni's thinker, talker and code predictor share: QK-norm attention over the paged KV, an MLP.

One layer is transformers 5.24's `Qwen3OmniMoeThinkerTextDecoderLayer` (the talker's and the
code predictor's layers are the same math): RMSNorm (float32, cast back, then the gain),
q/k/v projections without bias, RMSNorm of every query and key head over head_dim (QK-norm)
before RoPE, RoPE in the activation dtype, attention through the runtime's `attend`, output
projection, residual; RMSNorm, MLP (`moe.SparseMoE`, or `moe.DenseMLP` in the code
predictor), residual. The parameters carry the checkpoint's names under the stack's prefix
(`layers.{i}.self_attn.q_proj.weight`, `layers.{i}.self_attn.q_norm.weight`, ...,
`layers.{i}.mlp.*`, `norm.weight`).

`forward_layers` is pure tensor code whose only attention is `attend`; `after_layer(i, h)`
lets the caller read or change the residual stream after layer i (the thinker's deepstack
additions and its hidden-state tap for the talker).

Tensor parallelism (`tp_group`, the thinker's): a stack built with this rank's heads, KV heads
and expert width holds its shard; the attention output projection (row-parallel) and the MLP
output (the experts' down projections, cut by intermediate features) are partial sums that are
all-reduced over the group (`mstar_runtime.ops.tp`), so every rank carries the same full
residual stream and `after_layer` sees it. With no group (tp 1) the collectives are no-ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.qwen3_omni.moe import DenseMLP, SparseMoE, Weight
from mstar_runtime.ops import fused, tp

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
AfterLayer = Callable[[int, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """The gain of an RMSNorm (`fused.rms_norm` applies it)."""

    def __init__(self, dim: int, eps: float, **factory: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, **factory), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, **factory: Any):
        super().__init__()
        self.q_proj = Weight(torch.empty(heads * head_dim, hidden, **factory))
        self.k_proj = Weight(torch.empty(kv_heads * head_dim, hidden, **factory))
        self.v_proj = Weight(torch.empty(kv_heads * head_dim, hidden, **factory))
        self.o_proj = Weight(torch.empty(hidden, heads * head_dim, **factory))
        self.q_norm = RMSNorm(head_dim, eps, **factory)
        self.k_norm = RMSNorm(head_dim, eps, **factory)


class DecoderLayer(nn.Module):
    def __init__(self, attention: Attention, mlp: SparseMoE | DenseMLP, hidden: int, eps: float, **factory: Any):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **factory)


class Decoder(nn.Module):
    """`layers.{i}.*` and `norm.weight`; `mlp(i)` builds layer i's MLP. `heads` and `kv_heads`
    are this rank's; `tp_group` (None at tp 1) sums the row-parallel outputs over the group."""

    def __init__(
        self,
        layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        mlp: Callable[[int], SparseMoE | DenseMLP],
        tp_group: Any = None,
        **factory: Any,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.tp_group = tp_group
        self.layers = nn.ModuleList(
            DecoderLayer(Attention(hidden, heads, kv_heads, head_dim, eps, **factory), mlp(i), hidden, eps, **factory)
            for i in range(layers)
        )
        self.norm = RMSNorm(hidden, eps, **factory)

    def forward_layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        after_layer: AfterLayer | None = None,
    ) -> torch.Tensor:
        """Packed rows h [N, hidden] with their RoPE tables [N, 1, head_dim] -> final-normed [N, hidden]."""
        n, eps = h.shape[0], self.eps
        hd = self.head_dim
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = fused.rms_norm(h, layer.input_layernorm.weight, eps)
            q = fused.rms_norm(F.linear(x, a.q_proj.weight).view(n, self.heads, hd), a.q_norm.weight, eps)
            k = fused.rms_norm(F.linear(x, a.k_proj.weight).view(n, self.kv_heads, hd), a.k_norm.weight, eps)
            v = F.linear(x, a.v_proj.weight).view(n, self.kv_heads, hd)
            q, k = fused.rope(q, k, cos, sin)
            o = F.linear(attend(i, q, k, v).reshape(n, self.heads * hd), a.o_proj.weight)
            # row-parallel outputs are partial sums of every rank: all-reduced (no-ops at tp 1)
            h, x = fused.add_rms_norm(h, tp.all_reduce(o, self.tp_group), layer.post_attention_layernorm.weight, eps)
            h = h + tp.all_reduce(layer.mlp(x), self.tp_group)
            if after_layer is not None:
                h = after_layer(i, h)
        return fused.rms_norm(h, self.norm.weight, eps)


Split = Callable[[str], tuple[int, int, int] | None]


def seeded_init_(module: nn.Module, name: str, split: Split | None = None) -> None:
    """Deterministic weights for the `init` source: N(0, 0.02) matrices, unit norm gains, zero
    biases and gates, from a generator seeded by the node name (`dummy` and checkpoints overwrite
    them). Per-expert parameters are views, so filling them fills the fused buffers.

    `split(parameter name)` -> (dim, parts, part) for a tensor-parallel shard (None: whole): the
    full matrix is drawn, in the same order, and this rank keeps its part, so tp N holds the
    values of tp 1."""
    seed = sum(ord(c) * 31**i for i, c in enumerate(name)) % (2**31)
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for pname, p in module.named_parameters():
            if p.device.type == "meta":  # shapes only (a size check): nothing to fill
                continue
            if p.dim() < 2:
                p.fill_(1.0 if "norm" in pname and not pname.endswith("bias") else 0.0)
                continue
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            cut = split(pname) if split is not None else None
            if cut is None:
                p.normal_(0.0, 0.02, generator=gen)
                continue
            dim, parts, part = cut
            full = list(p.shape)
            full[dim] *= parts
            values = torch.empty(full, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=gen)
            p.copy_(values.narrow(dim, part * p.shape[dim], p.shape[dim]))


class StackedWeights(nn.ModuleList):
    """`{g}.weight` for g < n, each a view of one [n, rows, cols] buffer `stacked`, so a batch can
    gather every entry's table or head with one index (the code predictor's 15 embeddings and heads)."""

    def __init__(self, n: int, rows: int, cols: int, **factory: Any):
        stacked = torch.empty(n, rows, cols, **factory)
        super().__init__(Weight(stacked[g]) for g in range(n))
        self.register_buffer("stacked", stacked, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> StackedWeights:
        # a conversion gives each parameter storage of its own: point them back into the buffer
        super()._apply(fn, recurse)
        for g, w in enumerate(self):
            w.weight.data = self.stacked[g]
        return self
