"""Rotary position embeddings: frequencies (default, llama3-scaled), cos/sin tables (1-D, Qwen3-Omni's M-RoPE, V-JEPA's 3-D), the rotations.

Frequencies are float32 and computed on the CPU, as transformers does (a GPU pow can differ
in the last bit), then moved by the caller. Tables are [N, 1, head_dim]: the angles in
float32, cos and sin cast to the activations' dtype, the head_dim / 2 angles written twice
(transformers' rotate-half pairing: dim i turns with dim i + head_dim / 2), so that
`apply_rope` (= `mstar_runtime.ops.fused.rope`, HF's `apply_rotary_pos_emb` in the activation
dtype) rotates q [N, H, D] and k [N, Hkv, D] in one kernel.

M-RoPE (Qwen3-Omni's interleaved multimodal RoPE): positions are (t, h, w) triples [3, N];
of the head_dim / 2 frequency slots, slot j takes its angle from h when j = 1 mod 3 and
j < 3 * s_h, from w when j = 2 mod 3 and j < 3 * s_w, from t otherwise (sections
(s_t, s_h, s_w), e.g. [24, 20, 20]).

Interleaved pairing (V-JEPA 2's `rotate_queries_or_keys`, also HF `modeling_vjepa2`): dim 2k
turns with dim 2k + 1 (`rotate_pairs`, `apply_rope_pairs`). V-JEPA's 3-D RoPE
(`rope3d_tables`) splits each head into a depth (time), a height and a width part of
`P = 2 * ((head_dim // 3) // 2)` dims each (20 for ViT-g's 64), then `head_dim - 3P`
unrotated dims. Within a part, frequency `omega_i = theta ** (-i / (P/2))` for i < P/2; the
tables are the P/2 angles *tiled* twice (`repeat(..., 2)`) while the rotation partner of dim
2k is dim 2k + 1, so dim j of a part uses angle `pos * omega[j mod P/2]`: not the textbook
pairing, reproduced exactly. A token gets one full-width row (the three parts' angles, then
cos 1 / sin 0 for the tail), so one rotation serves the whole head instead of six per tensor;
a token at h = w = 0 rotates only its depth part (V-JEPA's action and state tokens). Angles
are float32, the tables cast to the compute dtype (the official code computes them in the
activation dtype, so bf16 results differ from it by that rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mstar_runtime.ops import fused

# Llama 3.x RoPE scaling (HF `rope_type: llama3`): every Llama-3.2 checkpoint uses exactly these.
LLAMA3_ROPE = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

apply_rope = fused.rope


def inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32 (transformers' default RoPE, op for op), on the
    CPU unless `device` says (the test family's tiny models compute them where they run)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


def llama3_inv_freq(
    head_dim: int,
    theta: float,
    factor: float = LLAMA3_ROPE["factor"],
    low_freq_factor: float = LLAMA3_ROPE["low_freq_factor"],
    high_freq_factor: float = LLAMA3_ROPE["high_freq_factor"],
    original_max_position_embeddings: int = int(LLAMA3_ROPE["original_max_position_embeddings"]),
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32: HF's `_compute_llama3_parameters`, op for op
    (long wavelengths divided by `factor`, short ones kept, a smooth blend in between)."""
    freq = inv_freq(head_dim, theta)
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / freq
    freq_llama = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * freq_llama / factor + smooth * freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, freq_llama)


def _tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_tables(positions: torch.Tensor, freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, 1, head_dim] in `dtype` of 1-D positions [N] (rotate-half pairing)."""
    return _tables(positions[:, None].float() * freq.to(positions.device)[None, :], dtype)


def mrope_tables(
    positions: torch.Tensor, freq: torch.Tensor, section: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, 1, head_dim] in `dtype` for (t, h, w) positions [3, N] (interleaved M-RoPE)."""
    angles = positions[..., None].float() * freq.to(positions.device)[None, None, :]  # [3, N, D/2]
    mixed = angles[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        mixed[:, offset : section[axis] * 3 : 3] = angles[axis, :, offset : section[axis] * 3 : 3]
    return _tables(mixed, dtype)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved rotation partner of x [..., D]: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, H, D] with cos/sin [N, D] (interleaved pairing): x * cos + rotate_pairs(x) * sin."""
    return x * cos[:, None, :] + rotate_pairs(x) * sin[:, None, :]


def rope3d_part_dim(head_dim: int) -> int:
    """Dims of each of the depth / height / width parts of V-JEPA's 3-D RoPE: 2 * ((head_dim // 3) // 2)."""
    return 2 * ((head_dim // 3) // 2)


def rope3d_tables(pos_t: torch.Tensor, pos_h: torch.Tensor, pos_w: torch.Tensor, head_dim: int,
                  dtype: torch.dtype, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows [N, head_dim] in `dtype` for N tokens at float positions (t, h, w), for
    `apply_rope_pairs` (the layout of the module docstring)."""
    part = rope3d_part_dim(head_dim)
    half = part // 2
    omega = 1.0 / theta ** (torch.arange(half, dtype=torch.float32, device=pos_t.device) / half)
    angles = [p.to(torch.float32)[:, None] * omega[None, :] for p in (pos_t, pos_h, pos_w)]
    tiled = torch.cat([a.repeat(1, 2) for a in angles], dim=-1)  # [N, 3 * part]
    n, rest = pos_t.shape[0], head_dim - 3 * part
    cos = torch.cat([tiled.cos(), tiled.new_ones(n, rest)], dim=-1)
    sin = torch.cat([tiled.sin(), tiled.new_zeros(n, rest)], dim=-1)
    return cos.to(dtype), sin.to(dtype)
