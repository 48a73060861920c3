"""Qwen3-Omni's audio encoder as a stateless node: `encode(mel [128, F]) -> embeds [Na, hidden]`.

Our implementation of transformers 5.24's `Qwen3OmniMoeAudioEncoder.forward` (docs/models/qwen3_omni.md, Facts):
1. The mel frames are cut into chunks of 2 * n_window = 100 frames (the last one shorter).
   Each chunk goes through three Conv2d(3x3, stride 2, padding 1) + GELU layers over
   (mel, time): 100 frames -> 13 time steps, 128 bins -> 16; `conv_out` maps the C * 16
   features to d_model, and sinusoidal positions 0..12 are added (they restart every chunk).
   Only a chunk's valid steps are kept (L frames -> three times (L - 1) // 2 + 1).
2. Transformer layers (pre-LN, GELU MLP) whose attention is block-diagonal over windows of
   13 * (n_window_infer / 100) = 104 tokens of one audio (the last window shorter).
3. `ln_post`, `proj1`, GELU, `proj2` to the thinker's width.

Padding, as transformers does it for one audio. HF pads every chunk of a call to the longest
chunk in it, and the conv steps near a chunk's end read that padding after the first layer
(it is no longer zero there: GELU(bias)). For one audio of >= 100 frames that means the tail
chunk is padded to 100; an audio shorter than 100 frames is one chunk with no padding, i.e.
zeros beyond its end at every layer. Both are reproduced per request, so a request's
embeddings do not depend on what it is batched with (HF's would, in a multi-audio call).

Batching: all chunks of all requests go through the convs together (in groups of
`conv_chunksize`), and all attention windows of all requests form one padded SDPA call.

Names are the checkpoint's under `thinker.audio_tower.` (the `qwen3_omni_audio` arch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_runtime.ops import node
from mstar_runtime.ops.ports import arch_values, setting_value

# released thinker_config.audio_config values the arch line does not carry
N_WINDOW = 50  # chunks of 2 * n_window mel frames
N_WINDOW_INFER = 800  # attention windows of n_window_infer mel frames
CONV_CHUNKSIZE = 500  # chunks per conv call (bounds activation memory)
MAX_SOURCE_POSITIONS = 1500  # rows of the sinusoid table


def conv_out_len(frames: int) -> int:
    """Time steps of one chunk of `frames` mel frames after the three stride-2 convs."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def encoded_length(frames: int, n_window: int = N_WINDOW) -> int:
    """Audio tokens of `frames` mel frames (transformers' `_get_feat_extract_output_lengths`)."""
    chunk = 2 * n_window
    tail = frames % chunk
    return (frames // chunk) * conv_out_len(chunk) + (conv_out_len(tail) if tail else 0)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels]: sin of position * timescale in the first half, cos in the second."""
    if channels % 2:
        raise ValueError(f"sinusoid positions need an even width, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


@dataclass
class Segments:
    """Packed tokens [N, H, hd] <-> padded attention segments [S, H, L, hd] (block-diagonal attention
    as one SDPA call: a segment's queries see its own keys only)."""

    slots: torch.Tensor  # [N] flat slot (segment * L + position) of each token
    key_mask: torch.Tensor  # [S, 1, 1, L] True where a key is a real token
    count: int
    width: int

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Segments:
        width = max(lengths)
        slots = [w * width + j for w, n in enumerate(lengths) for j in range(n)]
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        return cls(torch.tensor(slots, dtype=torch.long, device=device), mask[:, None, None, :].to(device),
                   len(lengths), width)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[N, H, hd] -> [S, H, L, hd], zeros in the padding."""
        out = t.new_zeros(self.count * self.width, *t.shape[1:]).index_copy_(0, self.slots, t)
        return out.view(self.count, self.width, *t.shape[1:]).transpose(1, 2)

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """[S, H, L, hd] -> [N, H, hd]."""
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).index_select(0, self.slots)


class AudioAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (segments.pack(p(x).view(n, self.heads, self.head_dim))
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.key_mask)  # [S, H, L, hd]
        return self.out_proj(segments.unpack(o).reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.self_attn = AudioAttention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), segments)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(node.StatelessNode):
    """encode(mel: f32[mel_bins, F]) -> (embeds: [Na, hidden]); see the module docstring."""

    checkpoint_prefix: ClassVar[str] = "thinker.audio_tower."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a = _args(spec)
        d, c, self.mel_bins = a["dim"], a["conv_dim"], a["mel_bins"]
        if d % a["heads"] or d % 2:
            raise node.NodeError(f"node '{spec.name}': dim {d} must be even and divisible by heads {a['heads']}")
        self.out_dim = a["out_dim"]
        self.n_window = int(setting_value(spec, "n_window", N_WINDOW, "audio_"))
        self.n_window_infer = int(setting_value(spec, "n_window_infer", N_WINDOW_INFER, "audio_"))
        self.conv_chunksize = int(setting_value(spec, "conv_chunksize", CONV_CHUNKSIZE, "audio_"))
        self.chunk = 2 * self.n_window
        if self.n_window_infer % self.chunk:
            raise node.NodeError(f"node '{spec.name}': n_window_infer {self.n_window_infer} is not a multiple of "
                                 f"2 * n_window = {self.chunk}")
        self.tokens_per_chunk = conv_out_len(self.chunk)
        self.window_tokens = self.tokens_per_chunk * (self.n_window_infer // self.chunk)
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        freq = (((self.mel_bins + 1) // 2 + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(c * freq, d, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(d, a["heads"], a["ffn"]) for _ in range(a["layers"]))
        self.ln_post = nn.LayerNorm(d)
        self.proj1 = nn.Linear(d, d)
        self.proj2 = nn.Linear(d, self.out_dim)
        positions = sinusoids(int(setting_value(spec, "max_source_positions", MAX_SOURCE_POSITIONS, "audio_")), d)
        self.register_buffer("positional_embedding", positions, persistent=False)
        self.to(device=spec.device, dtype=spec.dtype)

    @property
    def device(self) -> torch.device:
        return self.conv_out.weight.device

    # ---- tensors
    def _chunks(self, mels: list[torch.Tensor], alone: list[bool]) -> tuple[torch.Tensor, list[int], list[bool]]:
        """Every clip's chunks, padded to one chunk length: [Nc, 1, mel, chunk]; their lengths;
        whether each is a request's only, short chunk (zero past its end at every layer: what
        transformers computes for an audio under 100 frames alone, unpadded; `alone` says
        which clips are their request's only one)."""
        pieces, lengths, solo = [], [], []
        for mel, only in zip(mels, alone, strict=True):
            frames = mel.shape[1]
            for start in range(0, frames, self.chunk):
                piece = mel[:, start : start + self.chunk]
                pieces.append(F.pad(piece, (0, self.chunk - piece.shape[1])))
                lengths.append(piece.shape[1])
                solo.append(only and frames < self.chunk)
        dtype = self.conv_out.weight.dtype
        return torch.stack(pieces).unsqueeze(1).to(self.device, dtype), lengths, solo

    def _convs(self, x: torch.Tensor, lengths: torch.Tensor, solo: torch.Tensor) -> torch.Tensor:
        """[n, 1, mel, chunk] -> [n, tokens_per_chunk, dim] (before the positions)."""
        valid = lengths
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            valid = torch.div(valid - 1, 2, rounding_mode="floor") + 1
            if bool(solo.any()):
                keep = (torch.arange(x.shape[-1], device=x.device)[None, :] < valid[:, None]) | ~solo[:, None]
                x = x * keep[:, None, None, :].to(x.dtype)
        n, c, f, t = x.shape
        return self.conv_out(x.permute(0, 3, 1, 2).reshape(n, t, c * f))

    def encode(self, mels: list[torch.Tensor], alone: list[bool] | None = None) -> list[torch.Tensor]:
        """Per clip mel [mel_bins, F] -> embeds [encoded_length(F), out_dim] in the weights' dtype;
        `alone`: whether each clip is its request's only one (default: every one is)."""
        counts = [encoded_length(m.shape[1], self.n_window) for m in mels]
        busy = [(m, a) for m, a in zip(mels, alone or [True] * len(mels), strict=True) if m.shape[1]]
        if not busy:
            return [torch.zeros(0, self.out_dim, dtype=self.conv_out.weight.dtype, device=self.device) for _ in mels]
        chunks, lengths, solo = self._chunks([m for m, _ in busy], [a for _, a in busy])
        lens = torch.tensor(lengths, device=self.device)
        solos = torch.tensor(solo, device=self.device)
        embeds = torch.cat([self._convs(chunks[i : i + self.conv_chunksize], lens[i : i + self.conv_chunksize],
                                        solos[i : i + self.conv_chunksize])
                            for i in range(0, chunks.shape[0], self.conv_chunksize)])
        embeds = embeds + self.positional_embedding[: embeds.shape[1]].to(embeds.dtype)[None]
        keep = [c * self.tokens_per_chunk + j for c, n in enumerate(lengths) for j in range(conv_out_len(n))]
        x = embeds.reshape(-1, embeds.shape[-1]).index_select(0, torch.tensor(keep, device=self.device))
        windows = Segments.of(self._window_lengths([c for c in counts if c]), self.device)
        for layer in self.layers:
            x = layer(x, windows)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        parts = iter(torch.split(x, [c for c in counts if c]))
        return [next(parts) if c else x.new_zeros(0, self.out_dim) for c in counts]

    def _window_lengths(self, counts: list[int]) -> list[int]:
        out = []
        for n in counts:
            out += [self.window_tokens] * (n // self.window_tokens)
            if n % self.window_tokens:
                out.append(n % self.window_tokens)
        return out

    # ---- the phase
    def phase_encode(self, batch: node.Batch) -> node.Batch:
        """Each entry's clips (`clips`: frames per clip of its mel; absent or empty: one clip)
        encoded apart, as transformers' audio tower encodes each of its `feature_lens` in one
        call (a short clip beside others is padded there, as here), and their rows joined in
        order."""
        mels: list[torch.Tensor] = []
        alone: list[bool] = []
        counts: list[int] = []
        for entry in batch:
            mel = self._mel(entry)
            parts = torch.split(mel, self._clips(entry, mel), dim=1) if mel.shape[1] else (mel,)
            mels.extend(parts)
            alone.extend([len(parts) == 1] * len(parts))
            counts.append(len(parts))
        embeds = iter(self.encode(mels, alone))
        return [{"embeds": torch.cat([next(embeds) for _ in range(n)])} for n in counts]

    def _clips(self, entry: Mapping[str, Any], mel: torch.Tensor) -> list[int]:
        clips = entry.get("clips")
        if clips is None or (isinstance(clips, torch.Tensor) and clips.numel() == 0):
            return [int(mel.shape[1])]
        frames = [int(v) for v in clips.reshape(-1).tolist()] if isinstance(clips, torch.Tensor) \
            and not clips.is_floating_point() else None
        if frames is None or any(n <= 0 for n in frames) or sum(frames) != mel.shape[1]:
            raise node.RequestError(f"clips must be positive frame counts that add up to the mel's {mel.shape[1]} "
                                    f"frames, got {clips if frames is None else frames}", "mel")
        return frames

    def _mel(self, entry: Mapping[str, Any]) -> torch.Tensor:
        mel = entry.get("mel")
        if not isinstance(mel, torch.Tensor) or not mel.is_floating_point() or mel.dim() != 2 \
                or mel.shape[0] != self.mel_bins:
            got = f"{mel.dtype} {list(mel.shape)}" if isinstance(mel, torch.Tensor) else type(mel).__name__
            raise node.RequestError(f"mel must be a float tensor [{self.mel_bins}, frames], got {got}", "mel")
        if mel.numel() and not bool(torch.isfinite(mel).all()):
            raise node.RequestError("mel holds NaN or infinite values", "mel")
        return mel


def _args(spec: node.NodeSpec) -> dict[str, int]:
    names = ("layers", "dim", "heads", "ffn", "mel_bins", "conv_dim", "out_dim")
    return {n: int(v) for n, v in arch_values(spec, names, "qwen3_omni_audio").items()}
