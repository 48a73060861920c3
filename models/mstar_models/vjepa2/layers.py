"""What the V-JEPA 2 encoder and AC predictor share: the timm-style block and the 3-D RoPE.

The 3-D RoPE is the layer library's (`mstar_models.layers.rotary`: `rope3d_tables` and the
interleaved `apply_rope_pairs`, whose docstring gives V-JEPA's layout), under the names the
encoder and predictor use; the MLP is the library's `Mlp` (exact GELU, as the official
`nn.GELU()`). Every token is a position triple (t, h, w): action and state tokens of the AC
predictor rotate only the depth part (official `ACRoPEAttention`), which is h = w = 0.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_models.layers.mlp import Mlp
from mstar_models.layers.rotary import apply_rope_pairs as apply_rope
from mstar_models.layers.rotary import rope3d_part_dim as rope_part_dim
from mstar_models.layers.rotary import rope3d_tables as rope_tables

LN_EPS = 1e-6  # nn.LayerNorm(eps=1e-6) in every official block and final norm

__all__ = ["LN_EPS", "Attention", "Block", "apply_rope", "grid_positions", "rope_part_dim", "rope_tables"]


def grid_positions(frames: int, grid_h: int, grid_w: int, grid: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t, h, w) of `frames * grid_h * grid_w` tokens in Conv3d flatten order, spatial positions
    snapped to the `grid` the model was trained at (official: `h_mask *= grid_size / H`)."""
    ids = torch.arange(frames * grid_h * grid_w, device=device)
    per_frame = grid_h * grid_w
    t = ids // per_frame
    h = (ids % per_frame) // grid_w
    w = ids % grid_w
    return t.float(), h.float() * (grid / grid_h), w.float() * (grid / grid_w)


class Attention(nn.Module):
    """Fused-qkv projections of a block; the attention itself is the caller's (dense or paged)."""

    def __init__(self, dim: int, heads: int, bias: bool, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias, device=device, dtype=dtype)
        self.proj = nn.Linear(dim, dim, device=device, dtype=dtype)

    def qkv_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[..., N, dim]` -> rotated q, rotated k, v, each `[..., N, heads, head_dim]`."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(-3)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Block(nn.Module):
    """Pre-norm block: x + proj(attn(norm1 x)); x + mlp(norm2 x). Names as the checkpoint's."""

    def __init__(self, dim: int, heads: int, mlp: int, qkv_bias: bool, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)
        self.attn = Attention(dim, heads, qkv_bias, device, dtype)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)
        self.mlp = Mlp(dim, mlp, device=device, dtype=dtype)

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm2(x))
