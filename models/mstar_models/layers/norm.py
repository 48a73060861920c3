"""RMSNorm and its variants: Llama's (normalise in float32, cast back, then the gain), Gemma's `1 + w`, QK-norm.

`RMSNorm(dim, eps)` holds the checkpoint's `<name>.weight` gain. Its forward is
`mstar_runtime.ops.fused.rms_norm` (Hugging Face's LlamaRMSNorm op for op; one compiled kernel
on a GPU), over the last dim of any shape, so the same module is the QK-norm of Qwen3 and
BAGEL: an RMSNorm of every query and key head over head_dim ([N, heads, head_dim]).
A decoder fuses a residual add with the norm that follows it (`fused.add_rms_norm`), reading
the gain and eps from the module.

`unit_offset=True` is Gemma's variant (transformers' GemmaRMSNorm): the gain is stored as
w and applied as 1 + w, and the whole product is taken in float32 before the cast back,
not after it as Llama does.

`AdaptiveRMSNorm` is π0.5's action-expert norm (openpi's adaRMS): no gain of its own; a
`dense` layer [3 * dim, cond_dim] with bias maps a condition row (the flow time's embedding)
to (scale, shift, gate), the float32-normalised input becomes `x * (1 + scale) + shift`, and
the gate scales the residual branch the norm feeds (`h + gate * branch`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_runtime.ops import fused


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GemmaRMSNorm: float32 normalise, times (1 + w) in float32, then cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    """`weight` [dim]: the gain (1 + weight with `unit_offset`); normalises over the last dim."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False, **factory: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, **factory), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return gemma_rms_norm(x, self.weight, self.eps)
        return fused.rms_norm(x, self.weight, self.eps)


class AdaptiveRMSNorm(nn.Module):
    """`dense.weight` [3 * dim, cond_dim], `dense.bias` [3 * dim]: see the module docstring."""

    def __init__(self, dim: int, cond_dim: int, eps: float, **factory: Any):
        super().__init__()
        self.dense = nn.Linear(cond_dim, 3 * dim, **factory)
        self.eps = eps

    def modulation(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(scale, shift, gate), each [..., dim], of condition rows [..., cond_dim]."""
        return tuple(F.linear(cond, self.dense.weight, self.dense.bias).chunk(3, dim=-1))

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """x [..., dim] normalised in float32, then `* (1 + scale) + shift`, in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + scale.float()) + shift.float()).to(x.dtype)
