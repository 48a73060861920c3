"""BAGEL's FLUX autoencoder as two stateless nodes: `FluxVaeEncoder` and `FluxVaeDecoder`.

The network is the FLUX AE (docs/models/bagel.md, Facts): GroupNorm(32, eps 1e-6) and SiLU everywhere,
ResNet blocks of two 3x3 convs with a 1x1 `nin_shortcut` when the width changes, a stride-2
`downsample.conv` after a (0, 1, 0, 1) zero pad, an `upsample.conv` after nearest x2, one
single-head attention in each mid block, and no quant_conv. Module names are the BFL names
of `ae.safetensors` (`encoder.down.{l}.block.{b}.conv1`, `decoder.up.{l}.upsample.conv`, ...),
which the `flux_vae_encoder` / `flux_vae_decoder` archs (mstarc/archs/flux_vae.py) list, so
the runtime's loader reads the checkpoint without a prefix or rename.

Encoder phases (node `vae_enc` of models/bagel/bagel.walk):
- `resize(image) -> (resized)`: the VAE `ImageTransform` only.
- `encode(image, seed) -> (latent, height, width, resized, drawn)`: resize, map to [-1, 1],
  encode, sample the posterior z = mean + std * eps (the official code samples:
  `DiagonalGaussian(sample=True)`) with eps = randn(mean.shape) from a per-request CPU
  generator seeded with `seed`, z <- 0.3611 * (z - 0.1159), patchify 2x2 as
  `einsum("chpwq->hwpqc")` (a token is (p, q, c)). `drawn` = eps.numel(), the draws the flow
  node's `noise` skips on the same CPU stream: the official app runs the AE on the CPU with the
  global RNG, so the posterior eps come first and edit's x_1 noise next.
Decoder phase: `decode(latent, height, width) -> (image)`: unpatchify ("nhwpqc->nchpwq"),
z / 0.3611 + 0.1159, decode, then the official `(x * 0.5 + 0.5).clamp(0, 1) * 255` cast to
uint8 (a truncation, as `tensor.to(torch.uint8)` in the official `decode_image`).

Requests of the same pixel size run as one forward (at most `MAX_PIXELS_PER_FORWARD` pixels,
which bounds activation memory); the sampling, the scaling and the uint8 mapping are
computed in f32, the network in the node's dtype.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.bagel.transforms import ImageTransform
from mstar_runtime.ops import node
from mstar_runtime.ops.readback import upload_tensor

SCALE_FACTOR = 0.3611  # FLUX AE scale_factor (official load_ae)
SHIFT_FACTOR = 0.1159  # FLUX AE shift_factor
NORM_GROUPS = 32
NORM_EPS = 1e-6
# VAE ImageTransform at the released size (docs/models/bagel.md, Facts); smaller plans scale it down.
VAE_MAX_SIZE, VAE_MIN_SIZE = 1024, 512
# Pixels per forward: 4 images of 1024^2. The decoder's full-resolution level alone holds
# ~1.3 GiB of bf16 activations per 1024^2 image; the cap keeps a full batch's peak bounded.
MAX_PIXELS_PER_FORWARD = 1024 * 1024  # one 1024 x 1024 image: its decoder peak is GiBs
# torch.Generator.manual_seed's accepted range
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


# ------------------------------------------------------------------------------ layers
def _group_norm(channels: int, device: torch.device, dtype: torch.dtype) -> nn.GroupNorm:
    return nn.GroupNorm(NORM_GROUPS, channels, eps=NORM_EPS, affine=True, device=device, dtype=dtype)


def _conv(c_in: int, c_out: int, kernel: int, device: torch.device, dtype: torch.dtype,
          stride: int = 1, padding: int | None = None) -> nn.Conv2d:
    pad = kernel // 2 if padding is None else padding
    return nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=pad, device=device, dtype=dtype)


class ResnetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.norm1 = _group_norm(c_in, device, dtype)
        self.conv1 = _conv(c_in, c_out, 3, device, dtype)
        self.norm2 = _group_norm(c_out, device, dtype)
        self.conv2 = _conv(c_out, c_out, 3, device, dtype)
        self.nin_shortcut = _conv(c_in, c_out, 1, device, dtype) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """One-head self-attention over all h*w positions, with 1x1-conv projections."""

    def __init__(self, channels: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.norm = _group_norm(channels, device, dtype)
        self.q = _conv(channels, channels, 1, device, dtype)
        self.k = _conv(channels, channels, 1, device, dtype)
        self.v = _conv(channels, channels, 1, device, dtype)
        self.proj_out = _conv(channels, channels, 1, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, 1, H*W, C]
            return t.flatten(2).transpose(1, 2).unsqueeze(1)

        out = F.scaled_dot_product_attention(tokens(self.q(y)), tokens(self.k(y)), tokens(self.v(y)))
        out = out.squeeze(1).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.conv = _conv(channels, channels, 3, device, dtype, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch convs pad symmetrically; FLUX pads right and bottom only, by one pixel
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.conv = _conv(channels, channels, 3, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    def __init__(self, channels: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, device, dtype)
        self.attn_1 = AttnBlock(channels, device, dtype)
        self.block_2 = ResnetBlock(channels, channels, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """One resolution level: `block.{b}` ResNet blocks, then `downsample` / `upsample` (or none)."""

    def __init__(self, blocks: list[ResnetBlock], resample: nn.Module | None, kind: str):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.kind = kind
        if resample is not None:
            setattr(self, kind, resample)  # BFL's names: down.{l}.downsample, up.{l}.upsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        resample = getattr(self, self.kind, None)
        return x if resample is None else resample(x)


@dataclass(frozen=True)
class VaeGeometry:
    """The AE's shape (arch args) and what the plan allows (config)."""

    ch: int
    ch_mult: tuple[int, ...]
    res_blocks: int
    z_channels: int
    patch: int  # latent_patch_size
    max_latent_size: int  # latent tokens per side

    @classmethod
    def from_spec(cls, spec: node.NodeSpec) -> VaeGeometry:
        a, cfg = spec.arch_args, spec.config
        try:
            geo = cls(int(a["ch"]), tuple(int(m) for m in a["ch_mult"]), int(a["res_blocks"]),
                      int(a["z_channels"]), int(cfg.get("latent_patch_size", 2)), int(cfg["max_latent_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise node.NodeError(f"node '{spec.name}': the FLUX VAE needs arch args ch, ch_mult, res_blocks, "
                                 f"z_channels and config max_latent_size ({type(e).__name__}: {e})") from None
        widths = [geo.ch * m for m in geo.ch_mult]
        if not geo.ch_mult or any(w <= 0 or w % NORM_GROUPS for w in [geo.ch, *widths]):
            raise node.NodeError(f"node '{spec.name}': VAE widths {[geo.ch, *widths]} must be positive multiples "
                                 f"of {NORM_GROUPS} (GroupNorm)")
        if geo.res_blocks < 1 or geo.z_channels < 1 or geo.patch < 1 or geo.max_latent_size < 1:
            raise node.NodeError(f"node '{spec.name}': bad VAE geometry {geo}")
        return geo

    @property
    def downsample(self) -> int:  # pixels per latent position
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def stride(self) -> int:  # pixels per latent token side (16 for FLUX with patch 2)
        return self.downsample * self.patch

    @property
    def token_dim(self) -> int:
        return self.patch * self.patch * self.z_channels

    @property
    def max_side(self) -> int:
        return self.stride * self.max_latent_size


class Encoder(nn.Module):
    """Pixels in [-1, 1] [B, 3, H, W] -> moments [B, 2 * z, H / 8, W / 8] (mean, log-variance)."""

    def __init__(self, geo: VaeGeometry, device: torch.device, dtype: torch.dtype, channels: int = 3):
        super().__init__()
        self.conv_in = _conv(channels, geo.ch, 3, device, dtype)
        widths = [geo.ch * m for m in geo.ch_mult]
        levels, c = [], geo.ch
        for level, width in enumerate(widths):
            blocks = []
            for _ in range(geo.res_blocks):
                blocks.append(ResnetBlock(c, width, device, dtype))
                c = width
            last = level == len(widths) - 1
            levels.append(Level(blocks, None if last else Downsample(c, device, dtype), "downsample"))
        self.down = nn.ModuleList(levels)
        self.mid = MidBlock(c, device, dtype)
        self.norm_out = _group_norm(c, device, dtype)
        self.conv_out = _conv(c, 2 * geo.z_channels, 3, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    """Latents [B, z, h, w] (unscaled) -> pixels [B, 3, 8h, 8w], roughly in [-1, 1]."""

    def __init__(self, geo: VaeGeometry, device: torch.device, dtype: torch.dtype, channels: int = 3):
        super().__init__()
        widths = [geo.ch * m for m in geo.ch_mult]
        c = widths[-1]
        self.conv_in = _conv(geo.z_channels, c, 3, device, dtype)
        self.mid = MidBlock(c, device, dtype)
        levels: list[Level] = []
        for level in reversed(range(len(widths))):  # built deepest first, stored as up.{level}
            blocks = []
            for _ in range(geo.res_blocks + 1):
                blocks.append(ResnetBlock(c, widths[level], device, dtype))
                c = widths[level]
            levels.insert(0, Level(blocks, Upsample(c, device, dtype) if level else None, "upsample"))
        self.up = nn.ModuleList(levels)
        self.norm_out = _group_norm(c, device, dtype)
        self.conv_out = _conv(c, channels, 3, device, dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# ---------------------------------------------------------------------------- patchify
def patchify(z: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, c, h*p, w*p] -> [B, h*w, p*p*c] with token = (p, q, c) (official "chpwq->hwpqc")."""
    b, c, hp, wp = z.shape
    h, w = hp // patch, wp // patch
    x = z.reshape(b, c, h, patch, w, patch).permute(0, 2, 4, 3, 5, 1)  # b h w p q c
    return x.reshape(b, h * w, patch * patch * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, patch: int) -> torch.Tensor:
    """[B, h*w, p*p*c] -> [B, c, h*p, w*p] (official "nhwpqc->nchpwq")."""
    b, _, d = tokens.shape
    c = d // (patch * patch)
    x = tokens.reshape(b, h, w, patch, patch, c).permute(0, 5, 1, 3, 2, 4)  # b c h p w q
    return x.reshape(b, c, h * patch, w * patch)


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Decoder output [B, 3, H, W] -> u8 [B, H, W, 3] as the official decode_image (truncating)."""
    x = (pixels.float() * 0.5 + 0.5).clamp(0, 1) * 255
    return x.permute(0, 2, 3, 1).to(torch.uint8)


# ------------------------------------------------------------------------------ helpers
def _size_groups(keys: Sequence[Hashable], pixels: Sequence[int]) -> list[list[int]]:
    """Entry indices grouped by equal key, each group cut into runs of <= MAX_PIXELS_PER_FORWARD."""
    by_key: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    runs: list[list[int]] = []
    for idx in by_key.values():
        per = max(1, MAX_PIXELS_PER_FORWARD // max(1, pixels[idx[0]]))
        runs += [idx[i:i + per] for i in range(0, len(idx), per)]
    return runs


def _check_image(value: Any, port: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 3 or value.shape[2] != 3:
        got = (f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
               else f"a {type(value).__name__}")
        raise node.RequestError(f"FLUX VAE: '{port}' must be an RGB image (uint8 tensor [H, W, 3]), got {got}", port)
    if value.shape[0] < 1 or value.shape[1] < 1:
        raise node.RequestError(f"FLUX VAE: '{port}' is an empty image ({list(value.shape)})", port)
    return value


def _check_int(value: Any, port: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise node.RequestError(f"FLUX VAE: '{port}' must be an integer, got {value!r}", port)
    if not low <= value <= high:
        raise node.RequestError(f"FLUX VAE: '{port}' = {value} is outside [{low}, {high}]", port)
    return value


def vae_transform(geo: VaeGeometry) -> ImageTransform:
    """ImageTransform(1024, 512, 16) at the released size; a smaller plan caps it at its max side."""
    max_size = min(VAE_MAX_SIZE, geo.max_side)
    return ImageTransform(max_size, min(VAE_MIN_SIZE, max_size // 2), geo.stride)


# -------------------------------------------------------------------------------- nodes
class FluxVaeEncoder(node.StatelessNode):
    """image u8 [H, W, 3] + seed -> sampled, scaled, patchified latent f32 [h*w, p*p*z]."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.geo = VaeGeometry.from_spec(spec)
        self.encoder = Encoder(self.geo, spec.device, spec.dtype)
        self.transform = vae_transform(self.geo)

    # ------------------------------------------------------------------ tensors
    def moments(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[-1, 1] pixels [B, 3, H, W] -> (mean, logvar), f32 [B, z, H / 8, W / 8]."""
        out = self.encoder(pixels.to(device=self.spec.device, dtype=self.spec.dtype)).float()
        mean, logvar = out.chunk(2, dim=1)
        return mean, logvar

    def sample(self, mean: torch.Tensor, logvar: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
        """z = mean + std * eps, eps ~ N(0, 1) drawn per row from a CPU generator seeded with its seed."""
        # On the CPU whatever the node's device: the official app runs the AE on the CPU, so its
        # eps are the first draws of the CPU stream whose next draws are edit's x_1 noise
        # (flow.noise draws those on the CPU after skipping `drawn`); and a sample is then the
        # same on every device.
        eps = torch.stack([torch.randn(mean.shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds])
        return mean + torch.exp(0.5 * logvar) * upload_tensor(eps, mean.device)

    def latents(self, z: torch.Tensor) -> torch.Tensor:
        """Sampled z [B, z, H / 8, W / 8] -> scaled tokens f32 [B, h*w, p*p*z]."""
        return patchify(SCALE_FACTOR * (z - SHIFT_FACTOR), self.geo.patch)

    # ------------------------------------------------------------------ phases
    def _resize(self, image: torch.Tensor) -> torch.Tensor:
        resized = self.transform.resize(image)
        h, w = int(resized.shape[0]), int(resized.shape[1])
        if h % self.geo.stride or w % self.geo.stride or max(h, w) > self.geo.max_side:
            raise node.NodeError(f"node '{self.spec.name}': the VAE transform gave {h}x{w}, not multiples of "
                                 f"{self.geo.stride} within {self.geo.max_side}")
        return resized

    def phase_resize(self, batch: node.Batch) -> node.Batch:
        images = [_check_image(e.get("image"), "image") for e in batch]
        return [{"resized": self._resize(img)} for img in images]

    def phase_encode(self, batch: node.Batch) -> node.Batch:
        images = [_check_image(e.get("image"), "image") for e in batch]
        seeds = [_check_int(e.get("seed"), "seed", SEED_MIN, SEED_MAX) for e in batch]
        resized = [self._resize(img) for img in images]
        sizes = [(int(r.shape[0]), int(r.shape[1])) for r in resized]
        latents: list[torch.Tensor | None] = [None] * len(batch)
        drawn = [0] * len(batch)
        for run in _size_groups(sizes, [h * w for h, w in sizes]):
            pixels = torch.stack([self.transform.normalize(resized[i].to(self.spec.device)) for i in run])
            mean, logvar = self.moments(pixels)
            tokens = self.latents(self.sample(mean, logvar, [seeds[i] for i in run]))
            for i, t in zip(run, tokens.unbind(0), strict=True):
                latents[i], drawn[i] = t, mean[0].numel()
        return [
            {"latent": latents[i], "height": sizes[i][0], "width": sizes[i][1], "resized": resized[i],
             "drawn": drawn[i]}
            for i in range(len(batch))
        ]


class FluxVaeDecoder(node.StatelessNode):
    """latent f32 [h*w, p*p*z] + pixel height / width -> image u8 [height, width, 3]."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.geo = VaeGeometry.from_spec(spec)
        self.decoder = Decoder(self.geo, spec.device, spec.dtype)

    def pixels(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Scaled tokens [B, h*w, p*p*z] (h, w in tokens) -> decoder output f32 [B, 3, H, W]."""
        z = unpatchify(tokens.to(device=self.spec.device, dtype=torch.float32), h, w, self.geo.patch)
        z = z / SCALE_FACTOR + SHIFT_FACTOR
        return self.decoder(z.to(self.spec.dtype)).float()

    def _check(self, entry: dict[str, Any]) -> tuple[int, int]:
        geo = self.geo
        sizes = []
        for port in ("height", "width"):
            v = _check_int(entry.get(port), port, geo.stride, geo.max_side)
            if v % geo.stride:
                raise node.RequestError(f"FLUX VAE: '{port}' = {v} is not a multiple of {geo.stride}", port)
            sizes.append(v)
        h, w = sizes[0] // geo.stride, sizes[1] // geo.stride
        lat = entry.get("latent")
        want = [h * w, geo.token_dim]
        if not isinstance(lat, torch.Tensor) or not lat.is_floating_point() or list(lat.shape) != want:
            got = (f"a {lat.dtype} tensor of shape {list(lat.shape)}" if isinstance(lat, torch.Tensor)
                   else f"a {type(lat).__name__}")
            raise node.RequestError(f"FLUX VAE: 'latent' for a {sizes[0]}x{sizes[1]} image must be a float tensor "
                                    f"{want}, got {got}", "latent")
        return h, w

    def phase_decode(self, batch: node.Batch) -> node.Batch:
        grids = [self._check(e) for e in batch]
        images: list[torch.Tensor | None] = [None] * len(batch)
        s = self.geo.stride
        for run in _size_groups(grids, [h * w * s * s for h, w in grids]):
            h, w = grids[run[0]]
            tokens = torch.stack([batch[i]["latent"].to(self.spec.device, torch.float32) for i in run])
            out = to_uint8(self.pixels(tokens, h, w))
            for i, img in zip(run, out.unbind(0), strict=True):
                images[i] = img
        return [{"image": img} for img in images]
