"""Qwen3-Omni's Code2Wav vocoder as a stateless node: `decode(codes [W, G]) -> pcm`.

Our implementation of transformers 5.24's `Qwen3OmniMoeCode2Wav.forward` (docs/models/qwen3_omni.md, Facts):
- the G codes of a frame index one table at rows `g * codebook_size + code`, and their
  embeddings are averaged;
- a pre-transformer of causal layers (RMSNorm, RoPE attention over a sliding window of
  `sliding_window` frames including the frame itself, SwiGLU MLP, LayerScale on both
  residual branches), then RMSNorm;
- upsampling (`upsampling_ratios`: causal transposed conv with kernel = stride, then a
  ConvNeXt block);
- the decoder: causal conv to `decoder_dim`, one block per `upsample_rates` entry r (SnakeBeta,
  causal transposed conv of kernel 2r / stride r, residual units of dilation 1, 3, 9), then
  SnakeBeta, a causal conv to 1 channel and a clamp to [-1, 1].
Every conv is causal; each decoder transposed conv trims r samples on both ends, so W frames
give `spf * W - trim` samples, spf = prod(rates) * prod(ratios) = 1920 and trim = 555 at
the released rates (8, 5, 4, 3 and 2, 2).

Streaming (docs/models/qwen3_omni.md, Facts, the keep-last rule). A window is W = ctx + new frames,
ctx of them left context (the runtime passes ctx as `codes:context`). Its output covers
the samples [spf * start, spf * (start + W) - trim) of one decode of the whole stream, so
the node keeps the last `new * spf` samples (all of them when ctx = 0): consecutive windows
then tile the full decode exactly, 1920 T - 555 samples in all. Dropping `ctx * spf`
samples from the left instead (HF's `chunked_decode`) loses `trim` samples per boundary.
The samples kept equal the full decode's exactly once ctx covers the receptive field (the
sliding window per pre-transformer layer plus a few frames of convs); with less they are an
approximation.

Batching. Windows of a batch are right-padded (code 0) to the longest and decoded in forwards
of at most `max_windows_per_forward` windows (default 8: the decoder's activations grow with
the batch), each keeping its own samples: everything is causal and the kept samples of a
W-frame window never read a later frame, so padding changes nothing but float rounding.
Codes given on the host are range-checked (a `RequestError`); codes on the device (the
talker's) are not read back: that would wait for every frame queued behind them.

Names are the checkpoint's under `code2wav.` (the `qwen3_omni_code2wav` arch); SnakeBeta's
alpha and beta are stored as logarithms, as in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_runtime.ops import node
from mstar_runtime.ops.ports import arch_values, setting_value

SLIDING_WINDOW = 72  # released code2wav_config.sliding_window
ROPE_THETA = 10000.0  # released code2wav_config.rope_parameters.rope_theta
RMS_EPS = 1e-5  # released code2wav_config.rms_norm_eps
MAX_WINDOWS = 8  # windows per forward (setting `max_windows_per_forward`)
LAYER_SCALE = 0.01  # initial LayerScale (the checkpoint overrides it)


# ---------------------------------------------------------------------------- conv parts
class CausalConv1d(nn.Module):
    """Stride-1 conv padded on the left only: output t reads inputs <= t."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.left = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.left, 0)))


class CausalConvTranspose1d(nn.Module):
    """Transposed conv trimmed by kernel - stride on both ends: L inputs -> (L - 1) * stride + (2 * stride -
    kernel) outputs, none of which needs an input past the window."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.trim : y.shape[-1] - self.trim] if self.trim else y


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + (self.gamma * h).transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + sin^2(x e^alpha) / (e^beta + 1e-9), per channel; alpha and beta are log-scale parameters."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalConvTranspose1d(cin, cout, 2 * rate, rate)]
            + [ResidualUnit(cout, d) for d in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# -------------------------------------------------------------------- pre-transformer
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), LAYER_SCALE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, w, _ = x.shape
        q = self.q_proj(x).view(b, w, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, w, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, w, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, w, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim)
        self.self_attn_layer_scale = LayerScale(hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = Mlp(hidden, intermediate)
        self.mlp_layer_scale = LayerScale(hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, window: int, theta: float):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(hidden, heads, kv_heads, head_dim, intermediate, eps) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.window, self.head_dim = window, head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = x.shape[1]
        pos = torch.arange(w, device=x.device, dtype=torch.float32)
        # positions restart at 0 in every window: RoPE scores depend on the offset q - k only
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        offset = pos[:, None] - pos[None, :]  # q - k
        mask = (offset >= 0) & (offset < self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


# ------------------------------------------------------------------------------- node
class Code2Wav(node.StatelessNode):
    """decode(codes: i32[W, G]) -> (pcm: f32[S]); see the module docstring."""

    checkpoint_prefix: ClassVar[str] = "code2wav."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a = _args(spec)
        h, self.groups, self.codebook_size = a["hidden"], a["quantizers"], a["codebook_size"]
        rates, ratios = tuple(a["upsample_rates"]), tuple(a["upsampling_ratios"])
        dd = a["decoder_dim"]
        if dd % 2 ** len(rates):
            raise node.NodeError(f"node '{spec.name}': decoder_dim {dd} is not divisible by 2^{len(rates)}")
        if a["heads"] % a["kv_heads"]:
            raise node.NodeError(f"node '{spec.name}': heads {a['heads']} is not a multiple of kv_heads "
                                 f"{a['kv_heads']}")
        window = int(setting_value(spec, "sliding_window", SLIDING_WINDOW, "c2w_"))
        theta = float(setting_value(spec, "rope_theta", ROPE_THETA, "c2w_"))
        eps = float(setting_value(spec, "rms_norm_eps", RMS_EPS, "c2w_"))
        self.max_windows = int(spec.settings.get("max_windows_per_forward", MAX_WINDOWS))
        if self.max_windows < 1:
            raise node.NodeError(f"node '{spec.name}': max_windows_per_forward must be >= 1, got {self.max_windows}")
        self.samples_per_frame = math.prod(rates) * math.prod(ratios)
        # each decoder block maps L -> (L - 1) * r: the trim is the same for every window length
        self.trim = self.samples_per_frame - _decoded_length(1, rates, ratios)

        self.code_embedding = nn.Embedding(self.groups * self.codebook_size, h)
        self.pre_transformer = PreTransformer(a["layers"], h, a["heads"], a["kv_heads"], a["head_dim"],
                                              a["intermediate"], eps, window, theta)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(h, h, f, f), ConvNeXtBlock(h)]) for f in ratios
        )
        decoder: list[nn.Module] = [CausalConv1d(h, dd, 7)]
        decoder += [DecoderBlock(dd // 2**i, dd // 2 ** (i + 1), r) for i, r in enumerate(rates)]
        out_dim = dd // 2 ** len(rates)
        decoder += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder)
        offsets = torch.arange(self.groups, dtype=torch.long) * self.codebook_size
        self.register_buffer("code_offset", offsets, persistent=False)
        self.to(device=spec.device, dtype=spec.dtype)

    # ---- tensors
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, W] (integers in [0, codebook_size)) -> audio [B, spf * W - trim], in the weights' dtype."""
        x = self.code_embedding(codes.long() + self.code_offset[None, :, None]).mean(1)  # [B, W, h]
        x = self.pre_transformer(x).transpose(1, 2)
        for blocks in self.upsample:
            for block in blocks:
                x = block(x)
        for block in self.decoder:
            x = block(x)
        return x.clamp(-1.0, 1.0)[:, 0]

    def output_length(self, frames: int) -> int:
        """Samples one decode of `frames` frames gives (0 for none)."""
        return max(0, self.samples_per_frame * frames - self.trim) if frames else 0

    def kept_range(self, frames: int, context: int) -> tuple[int, int]:
        """[start, end) of a window's own samples under the keep-last rule (module docstring)."""
        end = self.output_length(frames)
        start = 0 if context == 0 else max(0, end - self.samples_per_frame * (frames - context))
        return start, end

    # ---- the phase
    @property
    def device(self) -> torch.device:
        return self.code_embedding.weight.device

    def phase_decode(self, batch: node.Batch) -> node.Batch:
        windows = [self._window(entry) for entry in batch]
        contexts = [self._context(entry, w.shape[0]) for entry, w in zip(batch, windows, strict=True)]
        longest = max((w.shape[0] for w in windows), default=0)
        out: node.Batch = []
        if longest == 0:
            return [{"pcm": torch.zeros(0, dtype=torch.float32, device=self.device)} for _ in batch]
        codes = torch.zeros(len(windows), self.groups, longest, dtype=torch.long, device=self.device)
        for i, w in enumerate(windows):
            codes[i, :, : w.shape[0]] = w.to(self.device, torch.long).T
        # at most `max_windows` windows per forward: the decoder's activations grow with the batch
        # (at real size ~90 MB per 50-frame window), and the memory pass leaves little beside the KV pools
        audio = torch.cat([self(part).float() for part in codes.split(self.max_windows)])
        for i, (w, ctx) in enumerate(zip(windows, contexts, strict=True)):
            lo, hi = self.kept_range(w.shape[0], ctx)
            out.append({"pcm": audio[i, lo:hi].contiguous()})
        return out

    def _window(self, entry: Mapping[str, Any]) -> torch.Tensor:
        c = entry.get("codes")
        if not isinstance(c, torch.Tensor) or c.is_floating_point() or c.dtype == torch.bool:
            got = c.dtype if isinstance(c, torch.Tensor) else type(c).__name__
            raise node.RequestError(f"codes must be an integer tensor [W, {self.groups}], got {got}", "codes")
        if c.dim() != 2 or c.shape[1] != self.groups:
            raise node.RequestError(f"codes must be [W, {self.groups}] (frames x code groups), got {list(c.shape)}",
                                    "codes")
        if c.numel() and c.device.type == "cpu":
            # host codes (a client's) are checked here; codes on the device come from the talker,
            # in range by construction, and reading them would wait for every queued frame
            lo, hi = int(c.min()), int(c.max())
            if lo < 0 or hi >= self.codebook_size:
                bad = lo if lo < 0 else hi
                raise node.RequestError(f"codes must lie in [0, {self.codebook_size}); got {bad}", "codes")
        return c

    @staticmethod
    def _context(entry: Mapping[str, Any], frames: int) -> int:
        ctx = entry.get("codes:context", 0)
        if isinstance(ctx, bool) or not isinstance(ctx, int) or not 0 <= ctx <= frames:
            raise node.RequestError(f"codes:context must be an int in [0, {frames}] (the window's frames), "
                                    f"got {ctx!r}", "codes")
        return ctx


def _decoded_length(frames: int, rates: Sequence[int], ratios: Sequence[int]) -> int:
    n = frames * math.prod(ratios)
    for r in rates:
        n = (n - 1) * r
    return n


def _args(spec: node.NodeSpec) -> dict[str, Any]:
    names = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "codebook_size", "quantizers",
             "upsampling_ratios", "upsample_rates", "decoder_dim")
    out = arch_values(spec, names, "qwen3_omni_code2wav")
    out["head_dim"] = int(out["head_dim"])  # the walk computes it as hidden / heads
    return out
