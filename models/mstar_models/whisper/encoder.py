"""Whisper's audio encoder as a stateless node: `encode(mel) -> (states)`.

transformers' `WhisperEncoder`: conv1 (mels -> width, kernel 3, padding 1), GELU, conv2
(kernel 3, stride 2, padding 1), GELU, so 3,000 mel frames become 1,500 positions; plus the
sinusoidal positions (`embed_positions.weight`, a buffer: the checkpoint's table loads into
it, random weights keep the computed one); then pre-LN layers (bidirectional self-attention
with q/v/out biases and none on k, the GELU MLP) and a final LayerNorm. Tensor names are the
checkpoint's, under `model.encoder.`.

Input `mel` float32 [mels, 3000] (the features node's), output `states` [1500, width] in the
node's dtype. A batch is stacked into one forward.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.init import seeded_init_
from mstar_models.whisper.common import LN_EPS, Layer, Sizes, sinusoids
from mstar_runtime.ops import node


class Positions(nn.Module):
    """`embed_positions` with its table as a persistent buffer `weight` (never random)."""

    def __init__(self, length: int, channels: int):
        super().__init__()
        self.register_buffer("weight", sinusoids(length, channels))


class Encoder(node.StatelessNode):
    """encode(mel: f32[mels, 3000]) -> (states: [source_positions, hidden]); see the module docstring."""

    checkpoint_prefix: ClassVar[str] = "model.encoder."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.sizes = s = Sizes(spec, "mels", "source_positions")
        self.mels, self.positions = s.extra["mels"], s.extra["source_positions"]
        self.conv1 = nn.Conv1d(self.mels, s.hidden, 3, padding=1)
        self.conv2 = nn.Conv1d(s.hidden, s.hidden, 3, stride=2, padding=1)
        self.embed_positions = Positions(self.positions, s.hidden)
        self.layers = nn.ModuleList(Layer(s, cross=False) for _ in range(s.layers))
        self.layer_norm = nn.LayerNorm(s.hidden, eps=LN_EPS)
        seeded_init_(self, spec.name)
        self.to(device=spec.device, dtype=spec.dtype)

    def phase_encode(self, batch: node.Batch) -> node.Batch:
        frames = 2 * self.positions
        for entry in batch:
            mel = entry.get("mel")
            if not isinstance(mel, torch.Tensor) or tuple(mel.shape) != (self.mels, frames):
                got = tuple(mel.shape) if isinstance(mel, torch.Tensor) else type(mel).__name__
                raise node.RequestError(f"mel must be [{self.mels}, {frames}], got {got}", "mel")
        x = torch.stack([entry["mel"] for entry in batch]).to(device=self.conv1.weight.device,
                                                              dtype=self.conv1.weight.dtype)
        return [{"states": h} for h in self.forward(x).unbind(0)]

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, mels, 2 * positions] -> final-normed states [B, positions, hidden]."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        h = x + self.embed_positions.weight.to(x.dtype)
        for layer in self.layers:
            a = layer.self_attn
            q, k, v = a.qkv(layer.self_attn_layer_norm(h))  # [B, F, heads, head_dim]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            h = h + a.out_proj(o.transpose(1, 2).reshape(h.shape))
            h = layer.mlp(h)
        return self.layer_norm(h)
