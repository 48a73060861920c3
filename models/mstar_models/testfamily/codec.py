"""TinyCodec: stream chunks of codes -> audio samples (stateless, deterministic).

code -> embedding -> + causal conv over the chunk's items (SiLU) -> linear upsampler to `hop`
samples per item -> tanh. Only the chunk's NEW items are returned: its leading context items
(given by the runtime as `entry["<port>:context"]`, see `common.CONTEXT_SUFFIX`) only shape the
new items' samples through the causal conv, as left context does for a causal vocoder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.testfamily.common import chunk_context, seed_and_place_, setting
from mstar_runtime.ops import node

# phase -> the consumer port it reads (one port per stream, one stream per chunk policy)
PHASE_PORTS = {"decode_window": "window", "decode_block": "block", "decode_frames": "frames"}


class TinyCodec(node.StatelessNode):
    """decode_window(window: i32[win]) / decode_block(block: i32[N]) / decode_frames(frames: i32[N])
    -> (pcm: f32[(items - context) * hop])."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.codebook, self.hop = int(setting(spec, "codebook")), int(setting(spec, "hop"))
        dim, self.kernel = int(setting(spec, "codec_dim")), int(setting(spec, "codec_kernel"))
        self.embed = nn.Embedding(self.codebook, dim)
        self.conv = nn.Conv1d(dim, dim, self.kernel)
        self.up = nn.Linear(dim, self.hop)
        seed_and_place_(self, spec)

    def phase_decode_window(self, batch: node.Batch) -> node.Batch:
        return self.decode(batch, "window")

    def phase_decode_block(self, batch: node.Batch) -> node.Batch:
        return self.decode(batch, "block")

    def phase_decode_frames(self, batch: node.Batch) -> node.Batch:
        return self.decode(batch, "frames")

    def decode(self, batch: node.Batch, port: str) -> node.Batch:
        chunks = [entry[port] for entry in batch]
        for c in chunks:
            if c.dim() != 1 or c.numel() == 0:
                raise node.RequestError(
                    f"{port} must be a 1-D, non-empty chunk of codes, got {tuple(c.shape)}", port
                )
            if int(c.min()) < 0 or int(c.max()) >= self.codebook:
                raise node.RequestError(f"codes must lie in [0, {self.codebook})", port)
        contexts = [chunk_context(entry, port, c.numel()) for entry, c in zip(batch, chunks, strict=True)]
        # Right-padding is safe for a causal conv: padded items never reach earlier outputs.
        codes = nn.utils.rnn.pad_sequence([c.long() for c in chunks], batch_first=True)
        x = self.embed(codes)  # [B, n, dim]
        y = self.conv(F.pad(x.transpose(1, 2), (self.kernel - 1, 0)))  # causal: left zeros only
        samples = torch.tanh(self.up(x + F.silu(y.transpose(1, 2))))  # [B, n, hop]
        return [
            {"pcm": samples[i, ctx : c.numel()].reshape(-1)}
            for i, (c, ctx) in enumerate(zip(chunks, contexts, strict=True))
        ]
