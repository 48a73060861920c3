"""Grouped-query attention over the runtime's paged KV: fused q/k/v, optional QK-norm and bias, RoPE, row-parallel output.

`Attention` holds `q_proj`, `k_proj`, `v_proj` (row views of one fused buffer: one GEMM),
`o_proj` and, with `qk_norm`, `q_norm` / `k_norm` (an RMSNorm of each head over head_dim,
before RoPE, as Qwen3 and BAGEL do), under the checkpoint's names. The attention itself is
the caller's `attend(layer, q, k, v)`: the runtime's `AttentionContext.attend` (FlashInfer
over the paged pool on a GPU, the PyTorch paged path on the CPU), a cohort step's, or a
dense one (Qwen3-Omni's code predictor), so the module is pure tensor code a CUDA graph can
capture.

`MultiHeadAttention` is the rotary-free kind with biases (Whisper): q/k/v fused, `out_proj`,
and the queries or the keys and values alone for a cross-attention. `cross_plan` is the KV
plan of the phase that stores a cross-attention's keys and values (a decoder's `listen`).

Tensor parallelism (`Attention`): built with this rank's heads and KV heads (`tp.MegatronLayout`), q/k/v
are column-parallel and `o_proj` row-parallel (all-reduced over `group`; None at tp 1).

Experts (Mixture-of-Transformers, BAGEL): `experts` lists name suffixes, one full set of
projections and QK-norms per suffix (`q_proj`, ..., `q_proj_moe_gen`, ...), each expert's
q/k/v one fused GEMM. The caller runs `qkv(..., expert)` on each expert's rows, attends over
all of them at once, and `out(o, expert)` on each expert's rows of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.linear import FusedRows, RowParallel
from mstar_models.layers.norm import RMSNorm
from mstar_models.layers.rotary import apply_rope
from mstar_runtime.ops import node

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(FusedRows):
    """`self_attn` of one decoder layer; `heads` and `kv_heads` are this rank's."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, *, eps: float = 1e-6,
                 qk_norm: bool = False, bias: bool = False, group: Any = None, experts: Sequence[str] = ("",),
                 **factory: Any):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        for sfx in experts:  # per expert: q/k/v, o, the norms (the checkpoint's order)
            self.fuse(sfx, {f"q_proj{sfx}": heads * head_dim, f"k_proj{sfx}": kv_heads * head_dim,
                            f"v_proj{sfx}": kv_heads * head_dim}, hidden, bias, **factory)
            setattr(self, f"o_proj{sfx}", RowParallel(hidden, heads * head_dim, group, **factory))
            if qk_norm:
                setattr(self, f"q_norm{sfx}", RMSNorm(head_dim, eps, **factory))
                setattr(self, f"k_norm{sfx}", RMSNorm(head_dim, eps, **factory))
        self.qk_norm = qk_norm

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, expert: str = "") -> tuple[torch.Tensor, ...]:
        """x [N, hidden] -> q [N, heads, hd], k and v [N, kv_heads, hd]: QK-normed, then rotated."""
        n, hd = x.shape[0], self.head_dim
        q, k, v = self.project(x, expert)
        q, k = q.view(n, self.heads, hd), k.view(n, self.kv_heads, hd)
        if self.qk_norm:
            q, k = getattr(self, f"q_norm{expert}")(q), getattr(self, f"k_norm{expert}")(k)
        q, k = apply_rope(q, k, cos, sin)
        return q, k, v.view(n, self.kv_heads, hd)

    def out(self, o: torch.Tensor, expert: str = "") -> torch.Tensor:
        """The attention's output rows o [N, heads, hd] (or [N, heads * hd]) -> o_proj [N, hidden]
        (summed over the TP group)."""
        return getattr(self, f"o_proj{expert}")(o.reshape(o.shape[0], self.heads * self.head_dim))

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [N, hidden] with RoPE tables [N, 1, head_dim] -> the layer's attention output [N, hidden]
        (summed over the TP group)."""
        return self.out(attend(layer, *self.qkv(x, cos, sin)))


class MultiHeadAttention(FusedRows):
    """Multi-head attention without rotary positions (Whisper's encoder, decoder and cross-attention):
    `q_proj`, `k_proj`, `v_proj` (one fused GEMM; the biases of the parts named in `bias`) and
    `out_proj` with a bias, under the checkpoint's names. The attention itself is the caller's."""

    def __init__(self, hidden: int, heads: int, *, bias: tuple[str, ...] = ("q_proj", "k_proj", "v_proj"),
                 **factory: Any):
        super().__init__({"q_proj": hidden, "k_proj": hidden, "v_proj": hidden}, hidden, bias=bias, **factory)
        self.heads, self.head_dim = heads, hidden // heads
        self.out_proj = nn.Linear(hidden, hidden, **factory)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> q, k, v [..., heads, head_dim]."""
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = self.project(x)
        return q.view(shape), k.view(shape), v.view(shape)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        """The queries alone (a cross-attention step, whose keys and values were stored before)."""
        return self.q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values alone, from one GEMM over the k/v rows of the fused weight."""
        rows = self.sizes[0]
        fb = self.fused_bias
        k, v = F.linear(x, self.fused_weight()[rows:], None if fb is None else fb[rows:]).split(self.sizes[1:], dim=-1)
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        return k.reshape(shape), v.reshape(shape)


def cross_plan(shapes: Mapping[str, tuple[int, ...]], port: str = "states") -> node.SeqPlan:
    """The KV plan of a phase that stores the encoder states at `port` ([frames, hidden]) as a
    cross-attention's keys and values: one entry a frame, all written at once (mask "full")."""
    shape = tuple(shapes.get(port, ()))
    if len(shape) != 2:
        raise node.RequestError(f"{port} must be [frames, hidden], got shape {shape}", port)
    return node.SeqPlan(q_len=shape[0], mask="full")
