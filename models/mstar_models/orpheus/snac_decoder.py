"""Orpheus' SNAC node: a 28-code window (4 coarse frames) -> the 2nd frame's 2048 samples.

Our own implementation of `snac.SNAC.decode` (hubertsiuzdak/snac 1.2.1; docs/models/orpheus.md, Facts):
`quantizer.from_codes` (per codebook: embedding -> out_proj 1x1 conv -> repeat_interleave by
its vq stride; summed), then the decoder (depthwise + pointwise conv, [LocalMHA], DecoderBlocks
of Snake -> ConvTranspose -> NoiseBlock -> ResidualUnits d=1,3,9, then Snake, conv, tanh).
Module and state-dict names equal the package's (`quantizer.quantizers.{i}.*`,
`decoder.model.{k}.*`) with weight norm folded into a plain `weight`, which is what the
`snac_decoder` arch (mstarc/archs/snac.py) lists and `tools/convert_snac.py` writes. Folding
saves SNAC's per-forward `g * v / ||v||` recompute of every conv weight.

Orpheus layout (docs/models/orpheus.md, Facts): the window is 4 frames of 7 codes [L0, L1, L2, L2, L1, L2, L2],
so codes_0 = [f0], codes_1 = [f1, f4], codes_2 = [f2, f3, f5, f6] per frame, concatenated over
frames. The window decodes to 4 * 2048 samples; like the reference `convert_to_audio` we keep
samples [2048:4096] (1 frame of left context, 2 of right context).

NoiseBlock determinism. SNAC's NoiseBlock adds `randn(B, 1, T) * linear(x)` from the global
RNG, so the same codes give different audio per call and per batch. Here the noise is a pure
function of a per-window key, so a request's audio is the same alone, batched, on a rerun after
preemption, and on any device (integer hashing, no device RNG):
    key = H(seed, chunk index, the window's 28 codes)
- seed: `entry["seed"]` if the walk passes one to this node, else 0;
- chunk index: `entry["codes:index"]` if the runtime passes it, else 0 (today
  `interpreter.chunk_inputs` passes only `codes:context` / `codes:final`, and the walk passes
  no seed, so the key is the window's content alone: still a per-request constant);
- sample j of the window's flattened noise (all 4 blocks, 128 + 1024 + 4096 + 8192 values
  for the 24 kHz rates) is a Box-Muller normal from two 24-bit uniforms, each
  `lowbias32(lowbias32(counter) ^ key)`: a counter-based generator, so the whole batch's noise
  is a few elementwise int64 kernels with fixed shapes (CUDA-graph friendly).
`decode(codes, noise)` also takes explicit noise tensors (a parity test feeds it the values
`torch.randn` gives SNAC), and `noise=None` skips the NoiseBlocks (the node setting
`noise: false`, equivalent to SNAC with zeroed NoiseBlock weights).

CUDA graphs (runtime/mstar_runtime/engine/stateless_graphs.py): `graph_phase("decode")` offers the phase for
capture, split as that contract says, and `phase_decode` runs the same split eagerly, so the
eager and the graphed path differ only in how the tensor part is called:
- prepare: shape checks and the noise-key words (seed, chunk index) on the host. Windows
  whose codes are host tensors are range-checked on the host and stay there (the runner
  uploads them from pinned memory: no device sync at all). Device-resident codes are
  checked on the device: a per-window report (bad?, first bad code) is copied back without
  waiting (`readback.Readback`) and read only after the decode is queued (`Prepared.check`).
  Either way a code outside [0, codebook_size) fails its request with a RequestError on
  port `codes`, never an index error. The backbone's `code` items are device tensors today,
  so Orpheus takes the device path: the side-stream replay waits for the work queued before
  it on the current stream (the next LLM decode step), and the host waits for the report.
  Codes pushed as host tensors (the backbone reads its tokens back anyway) would take the
  host path: no wait at all, and a replay that overlaps the queued LLM step.
- fn: `decode_windows(windows [B, 28], words [B, 3]) -> pcm [B, 2048]`: the noise keys and
  `forward`, fixed shapes for a batch size, no host syncs, no Python branches on data, rows
  independent. `split_layers` clamps the codes into the codebook (the identity for valid
  codes), so a window that its deferred check rejects, or a stale pad row, never gathers
  out of the codebook inside a graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_runtime.engine.stateless_graphs import GraphPhase, Prepared, run_phase
from mstar_runtime.ops import node
from mstar_runtime.ops.readback import Readback, upload_tensor

# Orpheus' 7-code frame (docs/models/orpheus.md, Facts): position in the frame -> SNAC layer.
FRAME_LAYOUT = (0, 1, 2, 2, 1, 2, 2)
FRAME_TOKENS = len(FRAME_LAYOUT)
WINDOW_FRAMES = 4  # the reference decodes buffer[-28:]
EMIT_FRAME = 1  # ... and keeps its 2nd frame: audio[2048:4096]
ORPHEUS_VQ_STRIDES = (4, 2, 1)  # the layout above only exists for these strides
_ATTN_HEAD_DIM = 64  # SNAC's LocalMHA dim_head
_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------------- SNAC layers
class Snake1d(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SNAC's formula, op for op (the 1e-9 keeps alpha = 0 finite), for bitwise-close parity
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation, groups=groups),
            Snake1d(dim),
            nn.Conv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SNAC crops x when y is shorter; with padding 3 * dilation they are always equal
        return x + self.block(x)


class NoiseBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return x + noise * self.linear(x)  # noise: [B, 1, T], shared by all channels


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int, noise: bool, groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            Snake1d(in_dim),
            nn.ConvTranspose1d(in_dim, out_dim, 2 * stride, stride=stride,
                               padding=math.ceil(stride / 2), output_padding=stride % 2),
        ]
        if noise:
            layers.append(NoiseBlock(out_dim))
        layers += [ResidualUnit(out_dim, d, groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        for layer in self.block:
            if isinstance(layer, NoiseBlock):
                if noise is not None:  # a static choice per call, never a data-dependent one
                    x = layer(x, noise)
            else:
                x = layer(x)
        return x


class SinusoidalEmbeddings(nn.Module):
    """Only its persistent `inv_freq` buffer (in SNAC's state dict); xpos is off in SNAC."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))


class LocalMHA(nn.Module):
    """SNAC's windowed self-attention with rotary positions (not used by snac_24khz)."""

    def __init__(self, dim: int, window: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.heads, self.window = dim // _ATTN_HEAD_DIM, window
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.rel_pos = SinusoidalEmbeddings(_ATTN_HEAD_DIM)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        w, n, h = t // self.window, self.window, self.heads
        q, k, v = self.to_qkv(self.norm(x.transpose(1, 2))).chunk(3, dim=-1)
        q, k, v = (y.reshape(b, w, n, h, -1).permute(0, 3, 1, 2, 4) for y in (q, k, v))  # b h w n d
        # angles in fp32 whatever the weights' dtype (SNAC's own fp32 path does the same ops)
        pos = torch.arange(n, device=x.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.rel_pos.inv_freq.float())
        freqs = torch.cat((freqs, freqs), dim=-1)
        cos, sin = freqs.cos().to(q.dtype), freqs.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, t, c)
        return self.to_out(out).transpose(1, 2) + x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Decoder(nn.Module):
    def __init__(self, latent: int, channels: int, rates: Sequence[int], noise: bool, depthwise: bool,
                 attn_window: int):
        super().__init__()
        if depthwise:
            layers: list[nn.Module] = [nn.Conv1d(latent, latent, 7, padding=3, groups=latent),
                                       nn.Conv1d(latent, channels, 1)]
        else:
            layers = [nn.Conv1d(latent, channels, 7, padding=3)]
        if attn_window:
            layers.append(LocalMHA(channels, attn_window))
        out_dim = channels
        for i, stride in enumerate(rates):
            in_dim, out_dim = channels // 2**i, channels // 2 ** (i + 1)
            layers.append(DecoderBlock(in_dim, out_dim, stride, noise, out_dim if depthwise else 1))
        layers += [Snake1d(out_dim), nn.Conv1d(out_dim, 1, 7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, noise: Sequence[torch.Tensor] | None) -> torch.Tensor:
        blocks = 0
        for layer in self.model:
            if isinstance(layer, DecoderBlock):
                z = layer(z, None if noise is None else noise[blocks])
                blocks += 1
            else:
                z = layer(z)
        return z


class VectorQuantize(nn.Module):
    def __init__(self, latent: int, codebook_size: int, codebook_dim: int, stride: int):
        super().__init__()
        self.stride = stride
        self.in_proj = nn.Conv1d(latent, codebook_dim, 1)  # encoding only; kept for the state dict
        self.out_proj = nn.Conv1d(codebook_dim, latent, 1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)


class ResidualVectorQuantize(nn.Module):
    def __init__(self, latent: int, codebook_size: int, codebook_dim: int, strides: Sequence[int]):
        super().__init__()
        self.quantizers = nn.ModuleList(
            VectorQuantize(latent, codebook_size, codebook_dim, s) for s in strides
        )

    def from_codes(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """codes[i]: [B, T / stride_i] int64 -> z_q [B, latent, T]."""
        z: torch.Tensor | None = None
        for vq, c in zip(self.quantizers, codes, strict=True):
            zi = vq.out_proj(vq.codebook(c).transpose(1, 2)).repeat_interleave(vq.stride, dim=-1)
            z = zi if z is None else z + zi  # SNAC's summation order
        assert z is not None
        return z


# ------------------------------------------------------------------------- noise keys
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), exact in int64 (split c so no product overflows)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """C. Wellons' `lowbias32` integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def key_words(seed: int, index: int) -> list[int]:
    """An entry's (seed, chunk index) as three 32-bit words: any Python int, negative or huge."""
    return [seed & _M32, (seed >> 32) & _M32, index & _M32]


def window_keys(windows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """32-bit noise key per window: H(seed, chunk index, codes). windows [B, N]; words [B, 3]
    from `key_words`. The codes are hashed with their position and summed mod 2^32 (order
    matters), which keeps it a fixed handful of elementwise kernels."""
    pos = torch.arange(windows.shape[1], device=windows.device, dtype=torch.int64)
    per_code = lowbias32((windows.long() & _M32) ^ lowbias32((pos + 0x9E3779B9) & _M32))
    content = lowbias32(per_code.sum(dim=1) & _M32)
    key = lowbias32(words[:, 0] ^ 0x2545F491)
    key = lowbias32(key ^ words[:, 1])
    key = lowbias32(key ^ words[:, 2])
    return lowbias32(key ^ content)


def counter_normal(keys: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, n] standard normals from per-row 32-bit keys (n even): Box-Muller over hashed counters."""
    half = n // 2
    ctr = lowbias32(torch.arange(2 * half, device=keys.device, dtype=torch.int64))  # [2 * half]
    bits = lowbias32(ctr[None, :] ^ keys[:, None])  # [B, 2 * half]
    u = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24  # 24-bit uniforms in (0, 1)
    r = torch.sqrt(-2.0 * torch.log(u[:, :half]))
    theta = 2.0 * math.pi * u[:, half:]
    return torch.cat((r * torch.cos(theta), r * torch.sin(theta)), dim=1).to(dtype)


# ------------------------------------------------------------------------------- node
class SnacDecoder(node.StatelessNode):
    """decode(codes: i32[28]) -> (pcm: f32[2048]); see the module docstring."""

    # the SNAC checkpoint ships beside the backbone's: --weights DIR holds it in DIR/snac/
    checkpoint_subdir: ClassVar[str] = "snac"

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a = _config(spec)
        self.codebook_size = a["codebook_size"]
        strides = tuple(a["vq_strides"])
        if strides != ORPHEUS_VQ_STRIDES:
            raise node.NodeError(f"node '{spec.name}': the Orpheus 7-code layout needs vq_strides "
                                 f"{list(ORPHEUS_VQ_STRIDES)}, got {list(strides)}")
        latent = a["encoder_dim"] * 2 ** len(a["encoder_rates"])  # config.json's latent_dim=None
        rates = tuple(a["decoder_rates"])
        if a["decoder_dim"] % 2 ** len(rates):
            raise node.NodeError(f"node '{spec.name}': decoder_dim {a['decoder_dim']} is not divisible "
                                 f"by 2^{len(rates)}")
        self.latent_len = WINDOW_FRAMES * strides[0]  # latent steps of one window (16)
        attn = a["attn_window"]
        if attn and (self.latent_len % attn or a["decoder_dim"] % _ATTN_HEAD_DIM):
            raise node.NodeError(f"node '{spec.name}': attn_window {attn} must divide the window's "
                                 f"{self.latent_len} latent steps and decoder_dim be a multiple of "
                                 f"{_ATTN_HEAD_DIM}")
        self.frame_samples = math.prod(rates) * strides[0]  # 2048
        want = spec.config.get("snac_window_samples")
        if want is not None and want != self.frame_samples:
            raise node.NodeError(f"node '{spec.name}': snac_window_samples is {want}, but the rates give "
                                 f"{self.frame_samples} samples per coarse frame")
        # noise lengths per DecoderBlock: the latent length times the rates so far
        self.noise_lens = [self.latent_len * math.prod(rates[: i + 1]) for i in range(len(rates))]
        self.has_noise = bool(a["noise"])
        # node setting `noise: false` skips the noise (== SNAC with zeroed NoiseBlock weights)
        self.noise_enabled = self.has_noise and bool(spec.settings.get("noise", True))

        self.quantizer = ResidualVectorQuantize(latent, a["codebook_size"], a["codebook_dim"], strides)
        self.decoder = Decoder(latent, a["decoder_dim"], rates, self.has_noise, a["depthwise"], attn)
        # window position -> index into the codes of its layer: non-persistent (not weights)
        for layer in range(len(strides)):
            pos = [f * FRAME_TOKENS + j for f in range(WINDOW_FRAMES)
                   for j, lay in enumerate(FRAME_LAYOUT) if lay == layer]
            self.register_buffer(f"_layer{layer}", torch.tensor(pos, dtype=torch.long), persistent=False)
        self.to(device=spec.device, dtype=spec.dtype)

    @property
    def window(self) -> int:
        return WINDOW_FRAMES * FRAME_TOKENS

    # ---- tensor paths (no host syncs, fixed shapes)
    def split_layers(self, windows: torch.Tensor) -> list[torch.Tensor]:
        """[B, 28] window codes -> [codes_0 [B, 4], codes_1 [B, 8], codes_2 [B, 16]] (int64).

        Clamped into the codebook: the identity for valid codes; out-of-range ones are
        rejected by `phase_decode`'s check, which on the GPU may come after the decode ran."""
        w = windows.long().clamp(0, self.codebook_size - 1)
        return [w.index_select(1, getattr(self, f"_layer{i}")) for i in range(len(ORPHEUS_VQ_STRIDES))]

    def noise_for(self, keys: torch.Tensor) -> list[torch.Tensor]:
        """The NoiseBlocks' noise for windows with these keys: [B, 1, T_i] per DecoderBlock."""
        flat = counter_normal(keys, sum(self.noise_lens), self.decoder.model[0].weight.dtype)
        return [n.unsqueeze(1) for n in flat.split(self.noise_lens, dim=1)]

    def decode(self, codes: Sequence[torch.Tensor], noise: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """SNAC.decode: codes per layer [B, T_i] -> audio [B, 1, samples] in the weights' dtype.
        `noise`: [B, 1, T] per DecoderBlock, or None for no noise."""
        z = self.quantizer.from_codes([c.long() for c in codes])
        return self.decoder(z, noise if self.has_noise else None)

    def forward(self, windows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, 28] codes, [B] noise keys -> [B, 2048] f32 samples (the window's 2nd frame)."""
        noise = self.noise_for(keys) if self.noise_enabled else None
        audio = self.decode(self.split_layers(windows), noise)
        lo = EMIT_FRAME * self.frame_samples
        return audio[:, 0, lo : lo + self.frame_samples].float()

    def decode_windows(self, windows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """The captured part of `decode`: [B, 28] codes, [B, 3] key words (`key_words`) -> [B, 2048] f32."""
        return self(windows, window_keys(windows, words))

    # ---- the phase
    @property
    def device(self) -> torch.device:
        return self.quantizer.quantizers[0].codebook.weight.device

    def graph_phase(self, phase: str) -> GraphPhase | None:
        """The stateless-graph contract (runtime/mstar_runtime/engine/stateless_graphs.py) for `decode`."""
        return self._decode_phase() if phase == "decode" else None

    def phase_decode(self, batch: node.Batch) -> node.Batch:
        return run_phase(self._decode_phase(), batch)  # eagerly: the engine's runner is not here

    def _decode_phase(self) -> GraphPhase:
        return GraphPhase(self.device, self._prepare_decode, self.decode_windows, _finish_decode)

    def _prepare_decode(self, batch: node.Batch) -> Prepared:
        """Validation and inputs of `decode_windows` (module docstring, "CUDA graphs")."""
        for entry in batch:
            c = entry["codes"]
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != (self.window,) or c.is_floating_point():
                got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
                raise node.RequestError(f"codes must be {self.window} integer SNAC codes (4 frames of 7), "
                                        f"got {got}", "codes")
        words = torch.tensor([key_words(int(e.get("seed", 0)), int(e.get("codes:index", 0))) for e in batch],
                             dtype=torch.int64)
        codes = [entry["codes"] for entry in batch]
        if all(c.device.type == "cpu" for c in codes):
            windows = torch.stack(codes).long()
            self._reject_bad_codes(bad_code_report(windows, self.codebook_size).tolist())
            return Prepared((windows, words))
        device = self.device
        windows = torch.stack([upload_tensor(c, device) for c in codes]).long()
        # no wait here: the report comes back while the decode runs, and is read after it is queued
        back = Readback(bad_code_report(windows, self.codebook_size))
        return Prepared((windows, words), check=lambda: self._reject_bad_codes(back.values()))

    def _reject_bad_codes(self, report: list[list[int]]) -> None:
        for bad, first in report:
            if bad:
                raise node.RequestError(f"codes must lie in [0, {self.codebook_size}); got {first}", "codes")


def bad_code_report(windows: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """Per window [B, N]: (1 if it holds a code outside [0, codebook_size) else 0, its first such
    code or 0), as int64 [B, 2]; the same few kernels on the host or the device."""
    w = windows.long()
    mask = (w < 0) | (w >= codebook_size)
    first = w.gather(1, mask.long().argmax(dim=1, keepdim=True)).squeeze(1)
    bad = mask.any(dim=1)
    return torch.stack([bad.long(), torch.where(bad, first, torch.zeros_like(first))], dim=1)


def _finish_decode(batch: node.Batch, pcm: torch.Tensor) -> node.Batch:
    return [{"pcm": p} for p in pcm.unbind(0)]


def _config(spec: node.NodeSpec) -> Mapping[str, Any]:
    """The SNAC sizes: the node's `arch snac_decoder(...)` arguments (what its weights were
    checked against), else the model config's `snac_*` values."""
    names = ("encoder_dim", "encoder_rates", "decoder_dim", "decoder_rates", "codebook_dim",
             "vq_strides", "depthwise", "noise", "attn_window")
    out: dict[str, Any] = {}
    for n in (*names, "codebook_size"):
        if n in spec.arch_args:
            out[n] = spec.arch_args[n]
        elif n == "codebook_size" and n in spec.config:
            out[n] = spec.config[n]
        elif f"snac_{n}" in spec.config:
            out[n] = spec.config[f"snac_{n}"]
        else:
            raise node.NodeError(f"node '{spec.name}': SNAC setting '{n}' is neither an arch argument "
                                 f"nor config 'snac_{n}'")
    return out
