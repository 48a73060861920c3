"""BAGEL's image-understanding encoder as a stateless node: image -> LLM-width tokens.

`phase_encode` follows the official `Bagel.prepare_vit_images` + `forward_cache_update_vit`
(docs/models/bagel.md, Facts):
1. `ImageTransform(max, min, patch)` resize (PIL bicubic; sides multiples of the patch):
   (980, 224, 14) at real size, at smaller tables max = min(980, patch * max_patches_per_side)
   and min = min(224, max // 2);
2. patchify in (h, w, p, q, c) order (the official `einsum("chpwq->hwpqc")`), normalise
   (x / 255 - 0.5) / 0.5, linear patch embedding (the conv stored in Linear form);
3. + the learned position table at "extrapolated" ids h_idx * max_patches_per_side + w_idx;
4. the SigLIP encoder layers (pre-LN, non-causal attention within each image, gelu-tanh MLP),
   then `post_layernorm`;
5. the MLP connector (fc1, gelu tanh, fc2) and + `vit_pos_embed.pos_embed` at the same ids.
N = grid_h * grid_w tokens per image, no marker tokens (the LLM adds them), in the node dtype.

Batching: every image of the batch is packed into one token sequence; the projections,
norms and MLPs run once over all of it. Attention runs per group of images with the same
token count, each group a dense [images, heads, tokens, head_dim] SDPA with no mask (the
flash kernel on a GPU in bf16), so no image attends to another and none pays for padding.

Module names are the checkpoint's (`vit_model.vision_model.*`, `connector.*`,
`vit_pos_embed.pos_embed`; the `bagel_vit` arch lists them), so `ema.safetensors` loads
without renaming. The layers are the layer library's where they apply: q/k/v as one fused
GEMM (`FusedRows`), the MLPs and the connector `Mlp`, the `init` source's seeded weights. `vit_pos_embed.pos_embed` is a buffer holding the official 2-D sin-cos
table (`get_2d_sincos_pos_embed`: the first half of the channels encodes w, the second h,
[sin | cos] within each half): the checkpoint's copy overwrites it, and `dummy` weights,
which draw parameters only, keep the real table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.bagel.transforms import ImageTransform, check_image, normalize_pixels
from mstar_models.layers.init import seeded_init_
from mstar_models.layers.linear import FusedRows
from mstar_models.layers.mlp import Mlp
from mstar_runtime.ops import node
from mstar_runtime.ops.readback import upload_tensor

LN_EPS = 1e-6  # vit_config.json layer_norm_eps (siglip-so400m)
OFFICIAL_MAX, OFFICIAL_MIN = 980, 224  # ImageTransform(980, 224, 14) in the official app


def sincos_table(side: int, dim: int) -> torch.Tensor:
    """The official 2-D sin-cos table [side * side, dim] (float64), row h * side + w."""
    if dim % 4:
        raise ValueError(f"a 2-D sin-cos table needs dim % 4 == 0, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coord = torch.arange(side, dtype=torch.float64)
    w = coord.repeat(side)  # row r = h * side + w
    h = coord.repeat_interleave(side)
    parts = []
    for c in (w, h):  # the official meshgrid(grid_w, grid_h) puts w first
        angle = c[:, None] * omega[None, :]
        parts += [angle.sin(), angle.cos()]
    return torch.cat(parts, dim=1)


# ------------------------------------------------------------------------------ modules
class _Attention(FusedRows):
    """`q_proj`, `k_proj`, `v_proj` (row views of one fused buffer: one GEMM) and `out_proj`."""

    def __init__(self, dim: int, heads: int, device: torch.device, dtype: torch.dtype):
        super().__init__({"q_proj": dim, "k_proj": dim, "v_proj": dim}, dim, bias=True, device=device, dtype=dtype)
        self.heads, self.head_dim = heads, dim // heads
        self.out_proj = nn.Linear(dim, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, groups: list[TokenGroup]) -> torch.Tensor:
        """x [N, dim] packed tokens -> [N, dim]; each image attends to its own tokens only."""
        shape = (-1, self.heads, self.head_dim)
        q, k, v = (t.view(shape) for t in self.project(x))
        outs = []
        for g in groups:
            rows = slice(g.start, g.start + g.images * g.tokens)
            q_g, k_g, v_g = (t[rows].view(g.images, g.tokens, self.heads, self.head_dim).transpose(1, 2)
                             for t in (q, k, v))
            o = F.scaled_dot_product_attention(q_g, k_g, v_g)  # scale head_dim ** -0.5, as SigLIP
            outs.append(o.transpose(1, 2).reshape(g.images * g.tokens, -1))
        return self.out_proj(outs[0] if len(outs) == 1 else torch.cat(outs))


class _EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)
        self.self_attn = _Attention(dim, heads, device, dtype)
        self.layer_norm2 = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)
        self.mlp = Mlp(dim, mlp, "tanh", device=device, dtype=dtype)  # gelu_pytorch_tanh

    def forward(self, x: torch.Tensor, groups: list[TokenGroup]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), groups)
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, dim: int, patch_dim: int, positions: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.patch_embedding = nn.Linear(patch_dim, dim, device=device, dtype=dtype)
        self.position_embedding = nn.Embedding(positions, dim, device=device, dtype=dtype)


class _Encoder(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, mlp: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(dim, heads, mlp, device, dtype) for _ in range(layers))


class _VisionTransformer(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, mlp: int, patch_dim: int, positions: int,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.embeddings = _Embeddings(dim, patch_dim, positions, device, dtype)
        self.encoder = _Encoder(layers, dim, heads, mlp, device, dtype)
        self.post_layernorm = nn.LayerNorm(dim, eps=LN_EPS, device=device, dtype=dtype)


class _VisionModel(nn.Module):
    """Holds `vision_model` only: the official wrapper's name level, kept for the checkpoint names."""

    def __init__(self, vision_model: _VisionTransformer):
        super().__init__()
        self.vision_model = vision_model


class _PositionTable(nn.Module):
    def __init__(self, side: int, llm_hidden: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("pos_embed", sincos_table(side, llm_hidden).to(device=device, dtype=dtype))


@dataclass(frozen=True)
class TokenGroup:
    """`images` images of `tokens` tokens each, packed from row `start`."""

    start: int
    images: int
    tokens: int


@dataclass
class Packed:
    """A batch's images as one token sequence, on the host: what the tensor part consumes."""

    pixels: torch.Tensor  # u8 [N, patch * patch * 3], rows grouped by token count
    positions: torch.Tensor  # i64 [N]: h_idx * max_patches_per_side + w_idx
    groups: list[TokenGroup]
    order: list[int]  # order[j] = the entry index of the j-th packed image
    counts: list[int]  # tokens of the j-th packed image


# ------------------------------------------------------------------------------ node
class SiglipNaViT(node.StatelessNode):
    """`encode(image u8 [H, W, 3]) -> tokens [grid_h * grid_w, llm_hidden]`; see the module docstring."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a = spec.arch_args
        try:
            layers, dim, heads, mlp = int(a["layers"]), int(a["hidden"]), int(a["heads"]), int(a["intermediate"])
            self.patch, self.side = int(a["patch"]), int(a["max_patches_per_side"])
            self.llm_hidden, channels = int(a["llm_hidden"]), int(a.get("channels", 3))
        except (KeyError, TypeError, ValueError) as e:
            raise node.NodeError(f"node '{spec.name}' (SiglipNaViT): bad or missing arch argument: {e}") from e
        if channels != 3 or dim % heads or self.llm_hidden % 4:
            raise node.NodeError(
                f"node '{spec.name}' (SiglipNaViT): needs 3 channels, hidden % heads == 0 and "
                f"llm_hidden % 4 == 0 (sin-cos table); got channels {channels}, hidden {dim}, heads {heads}, "
                f"llm_hidden {self.llm_hidden}"
            )
        max_size = min(OFFICIAL_MAX, self.patch * self.side)
        self.transform = ImageTransform(max_size, min(OFFICIAL_MIN, max_size // 2), self.patch)
        dev, dt = spec.device, spec.dtype
        self.vit_model = _VisionModel(_VisionTransformer(
            layers, dim, heads, mlp, 3 * self.patch**2, self.side**2, dev, dt))
        self.connector = Mlp(dim, self.llm_hidden, "tanh", out=self.llm_hidden, device=dev, dtype=dt)
        self.vit_pos_embed = _PositionTable(self.side, self.llm_hidden, dev, dt)
        seeded_init_(self, spec.name)  # the `init` source's weights (the sin-cos buffer is kept)

    # ------------------------------------------------------------------ host side
    def pack(self, images: list[torch.Tensor]) -> Packed:
        """Resize and patchify every image (uint8, exact), grouped by token count."""
        p, patches, positions, counts = self.patch, [], [], []
        for img in images:
            img = self.transform.resize(img.cpu())
            gh, gw = img.shape[0] // p, img.shape[1] // p
            if gh > self.side or gw > self.side:  # the transform's long-side cap rules this out
                raise node.RequestError(f"'image' resizes to a {gh} x {gw} patch grid, more than the "
                                        f"{self.side} x {self.side} position table", "image")
            # [gh, p, gw, q, c] -> [gh, gw, p, q, c]: the official (h, w, p, q, c) token layout
            patches.append(img.reshape(gh, p, gw, p, 3).permute(0, 2, 1, 3, 4).reshape(gh * gw, -1))
            positions.append((torch.arange(gh)[:, None] * self.side + torch.arange(gw)).flatten())
            counts.append(gh * gw)
        order = sorted(range(len(images)), key=lambda i: counts[i])
        groups: list[TokenGroup] = []
        start = 0
        for i in order:
            if groups and groups[-1].tokens == counts[i]:
                last = groups[-1]
                groups[-1] = TokenGroup(last.start, last.images + 1, last.tokens)
            else:
                groups.append(TokenGroup(start, 1, counts[i]))
            start += counts[i]
        return Packed(torch.cat([patches[i] for i in order]), torch.cat([positions[i] for i in order]),
                      groups, order, [counts[i] for i in order])

    # ------------------------------------------------------------------ tensors
    def vision(self, pixels: torch.Tensor, positions: torch.Tensor, groups: list[TokenGroup]) -> torch.Tensor:
        """Normalised patches [N, 3 p^2] -> SigLIP output after post_layernorm [N, hidden]."""
        vm = self.vit_model.vision_model
        x = vm.embeddings.patch_embedding(pixels.to(self.spec.dtype))
        x = x + vm.embeddings.position_embedding(positions)
        for layer in vm.encoder.layers:
            x = layer(x, groups)
        return vm.post_layernorm(x)

    def connect(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """SigLIP output -> LLM-width tokens: connector + vit_pos_embed at the same ids."""
        return self.connector(hidden) + self.vit_pos_embed.pos_embed[positions]

    def forward_packed(self, packed: Packed) -> torch.Tensor:
        dev = self.spec.device
        pixels = normalize_pixels(upload_tensor(packed.pixels, dev))  # uint8 travels: 4x less to copy
        positions = upload_tensor(packed.positions, dev)
        return self.connect(self.vision(pixels, positions, packed.groups), positions)

    @torch.no_grad()
    def encode_images(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Token tensors, one per image, in the given order."""
        if not images:
            return []
        packed = self.pack(images)
        out: list[torch.Tensor] = [torch.empty(0)] * len(images)
        for i, t in zip(packed.order, torch.split(self.forward_packed(packed), packed.counts), strict=True):
            out[i] = t
        return out

    # ------------------------------------------------------------------ phases
    def phase_encode(self, batch: node.Batch) -> node.Batch:
        images = [check_image(entry.get("image"), "image") for entry in batch]  # all before any work
        return [{"tokens": t} for t in self.encode_images(images)]
