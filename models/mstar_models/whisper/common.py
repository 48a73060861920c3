"""What Whisper's encoder and decoder share: their sizes from the node's arch line, the layer, sinusoids."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.attention import MultiHeadAttention
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import one_rank

LN_EPS = 1e-5  # nn.LayerNorm's default, as transformers' Whisper layers use


class Sizes:
    """The `whisper_encoder` / `whisper_decoder` arch sizes of a node."""

    def __init__(self, spec: node.NodeSpec, *names: str):
        one_rank(spec)
        a = spec.arch_args
        try:
            self.layers, self.hidden = int(a["layers"]), int(a["hidden"])
            self.heads, self.intermediate = int(a["heads"]), int(a["intermediate"])
            self.extra = {n: int(a[n]) for n in names}
        except (KeyError, TypeError, ValueError) as e:
            raise node.NodeError(f"node '{spec.name}' needs its arch's sizes ({e})") from None
        if self.hidden % self.heads:
            raise node.NodeError(f"node '{spec.name}': hidden ({self.hidden}) must be a multiple of heads "
                                 f"({self.heads})")
        self.head_dim = self.hidden // self.heads


class Layer(nn.Module):
    """One Whisper layer under the checkpoint's names: pre-LN self-attention, (the decoder's)
    pre-LN cross-attention, pre-LN GELU MLP (`fc1`, `fc2`), each a residual."""

    def __init__(self, s: Sizes, cross: bool, **factory: Any):
        super().__init__()
        h = s.hidden
        self.self_attn = MultiHeadAttention(h, s.heads, bias=("q_proj", "v_proj"), **factory)
        self.self_attn_layer_norm = nn.LayerNorm(h, eps=LN_EPS, **factory)
        if cross:
            self.encoder_attn = MultiHeadAttention(h, s.heads, bias=("q_proj", "v_proj"), **factory)
            self.encoder_attn_layer_norm = nn.LayerNorm(h, eps=LN_EPS, **factory)
        self.fc1 = nn.Linear(h, s.intermediate, **factory)
        self.fc2 = nn.Linear(s.intermediate, h, **factory)
        self.final_layer_norm = nn.LayerNorm(h, eps=LN_EPS, **factory)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """h + fc2(gelu(fc1(LN(h)))): the exact GELU, as Whisper's `activation_function` "gelu"."""
        return h + self.fc2(F.gelu(self.fc1(self.final_layer_norm(h))))


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's encoder positions [length, channels]: sin then cos of log-spaced timescales
    (10,000 max), the table the checkpoint stores as `model.encoder.embed_positions.weight`."""
    if channels % 2:
        raise ValueError(f"sinusoid channels must be even, got {channels}")
    step = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)
