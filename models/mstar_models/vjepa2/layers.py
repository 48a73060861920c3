"""What the V-JEPA 2 encoder and AC predictor share: the timm-style block and the 3-D RoPE.

3-D RoPE (official `rotate_queries_or_keys`, also in HF `modeling_vjepa2`): each head of
`head_dim` splits into a depth (time), a height and a width part of
`P = 2 * ((head_dim // 3) // 2)` dims each (20 for ViT-g's 64), then `head_dim - 3P`
unrotated dims. Within a part, frequency `omega_i = 10000 ** (-i / (P/2))` for i < P/2; the
sin/cos tables are the P/2 angles *tiled* twice (`repeat(..., 2)`), while the rotation
partner of dim 2k is dim 2k+1 (`stack((-y2, y1))`). So dim j of a part uses angle
`pos * omega[j mod P/2]`, which is not the textbook pairing; we reproduce it exactly.

Instead of rotating each part separately (six kernels per tensor per layer), a token gets one
full-width `cos`/`sin` row: the three parts' angles, then cos 1 / sin 0 for the tail. Action
and state tokens of the AC predictor rotate only the depth part (official `ACRoPEAttention`),
which is the same as height = width = 0 (cos 0 = 1, sin 0 = 0): every token is a position
triple (t, h, w) and one code path serves both kinds.

Tables are computed in float32 and cast to the compute dtype. The official code computes the
angles in the activation dtype (bf16 at real size), so bf16 results differ from it by that
rounding; float32 results are identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LN_EPS = 1e-6  # nn.LayerNorm(eps=1e-6) in every official block and final norm
ROPE_BASE = 10000.0


def rope_part_dim(head_dim: int) -> int:
    """Dims of each of the depth/height/width parts: 2 * ((head_dim // 3) // 2)."""
    return 2 * ((head_dim // 3) // 2)


def rope_tables(
    pos_t: torch.Tensor, pos_h: torch.Tensor, pos_w: torch.Tensor, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows `[N, head_dim]` for N tokens at float positions (t, h, w)."""
    part = rope_part_dim(head_dim)
    half = part // 2
    omega = 1.0 / ROPE_BASE ** (torch.arange(half, dtype=torch.float32, device=pos_t.device) / half)
    angles = [p.to(torch.float32)[:, None] * omega[None, :] for p in (pos_t, pos_h, pos_w)]
    tiled = torch.cat([a.repeat(1, 2) for a in angles], dim=-1)  # [N, 3 * part]
    n, rest = pos_t.shape[0], head_dim - 3 * part
    cos = torch.cat([tiled.cos(), tiled.new_ones(n, rest)], dim=-1)
    sin = torch.cat([tiled.sin(), tiled.new_zeros(n, rest)], dim=-1)
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[..., N, H, D]` with cos/sin `[N, D]`: x * cos + pairwise_rotate(x) * sin."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


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


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # exact GELU, as nn.GELU() in the official MLP


class Block(nn.Module):
    """Pre-norm block: x + proj(attn(norm1 x)); x + mlp(norm2 x). Names as the checkpoint's."""

    def __init__(self, dim: int, heads: int, mlp: int, qkv_bias: bool, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)
        self.attn = Attention(dim, heads, qkv_bias, device, dtype)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)
        self.mlp = Mlp(dim, mlp, device, dtype)

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm2(x))
