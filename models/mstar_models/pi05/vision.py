"""π0.5's vision tower as a stateless node: camera images -> VLM-width tokens (PaliGemma's SigLIP + projector).

`encode(images: u8[N, H, W, 3]) -> (tokens: [N, (H / patch)^2, width])`, as LeRobot's
`PI05Policy._preprocess_images` + `PaliGemmaWithExpertModel.embed_image` compute it for an
image already at the model's resolution: pixels / 255 * 2 - 1 (SigLIP's [-1, 1]), the
`patch x patch` conv patch embedding, + one learned position per patch, the SigLIP encoder
layers (pre-LayerNorm, eps 1e-6, bidirectional attention within each image, tanh-GELU MLP),
`post_layernorm`, then `multi_modal_projector.linear` to the VLM's width. No division by
sqrt(width): openpi's PaliGemma drops transformers' image-feature scaling, and its language
model drops the matching sqrt(width) embedding scale (the prompt's embeddings are scaled
instead, by the VLM node).

The images must already be `image x image` with 3 channels (a resize-with-pad is the
client's): anything else, or more images than the walk's `cameras`, is a RequestError on
`images`. A missing camera is not sent: the reference masks it out of every attention,
which is what leaving its 256 tokens out of the prefix computes.

Batching: every image of the batch runs in one forward ([images, tokens, width]; one SDPA
per layer, no mask: each image attends only to itself).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.init import seeded_init_
from mstar_models.layers.mlp import Mlp
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import one_rank

LN_EPS = 1e-6  # SigLIP's layer_norm_eps


def _int(spec: node.NodeSpec, name: str, default: int | None = None) -> int:
    value = spec.arch_args.get(name, spec.settings.get(name, spec.config.get(name, default)))
    if isinstance(value, bool) or not isinstance(value, int):
        raise node.NodeError(f"node '{spec.name}' ({spec.engine}): needs an integer '{name}', got {value!r}")
    return value


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, **factory: Any):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, **factory)
        self.k_proj = nn.Linear(dim, dim, **factory)
        self.v_proj = nn.Linear(dim, dim, **factory)
        self.out_proj = nn.Linear(dim, dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as SigLIP's
        return self.out_proj(o.transpose(1, 2).reshape(b, n, d))


class _EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, **factory: Any):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=LN_EPS, **factory)
        self.self_attn = _Attention(dim, heads, **factory)
        self.layer_norm2 = nn.LayerNorm(dim, eps=LN_EPS, **factory)
        self.mlp = Mlp(dim, mlp, approximate="tanh", **factory)  # gelu_pytorch_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, dim: int, channels: int, patch: int, positions: int, **factory: Any):
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, dim, patch, stride=patch, **factory)
        self.position_embedding = nn.Embedding(positions, dim, **factory)


class _Encoder(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, mlp: int, **factory: Any):
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(dim, heads, mlp, **factory) for _ in range(layers))


class _VisionModel(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, mlp: int, channels: int, patch: int, positions: int,
                 **factory: Any):
        super().__init__()
        self.embeddings = _Embeddings(dim, channels, patch, positions, **factory)
        self.encoder = _Encoder(layers, dim, heads, mlp, **factory)
        self.post_layernorm = nn.LayerNorm(dim, eps=LN_EPS, **factory)


class _Tower(nn.Module):
    """`vision_model` only: transformers' `SiglipVisionModel` name level, kept for the checkpoint names."""

    def __init__(self, vision_model: _VisionModel):
        super().__init__()
        self.vision_model = vision_model


class _Projector(nn.Module):
    def __init__(self, dim: int, width: int, **factory: Any):
        super().__init__()
        self.linear = nn.Linear(dim, width, **factory)


class SiglipTower(node.StatelessNode):
    """encode(images: u8[N, image, image, 3]) -> (tokens: [N, (image / patch)^2, projection])."""

    checkpoint_prefix: ClassVar[str] = "model.paligemma_with_expert.paligemma.model."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        one_rank(spec, "SiglipTower")
        dim, heads = _int(spec, "hidden"), _int(spec, "heads")
        self.image, self.patch, self.channels = _int(spec, "image"), _int(spec, "patch"), _int(spec, "channels", 3)
        self.cameras = _int(spec, "cameras")
        self.grid = self.image // self.patch
        factory = {"device": spec.device, "dtype": spec.dtype}
        self.vision_tower = _Tower(_VisionModel(_int(spec, "layers"), dim, heads, _int(spec, "intermediate"),
                                                self.channels, self.patch, self.grid**2, **factory))
        self.multi_modal_projector = _Projector(dim, _int(spec, "projection"), **factory)
        seeded_init_(self, spec.name)

    def check(self, images: Any) -> None:
        """A RequestError on `images` unless they are [N, image, image, channels] uint8, 1 <= N <= cameras."""
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else None
        if shape is None or images.dtype != torch.uint8 or len(shape) != 4:
            raise node.RequestError(f"images must be a uint8 array [cameras, {self.image}, {self.image}, "
                                    f"{self.channels}], got {shape if shape is not None else type(images).__name__}"
                                    + (f" of {images.dtype}" if shape is not None else ""), "images")
        n, h, w, c = shape
        if c != self.channels:
            raise node.RequestError(f"images must have {self.channels} channels (RGB), got {c}", "images")
        if (h, w) != (self.image, self.image):
            raise node.RequestError(f"images must be {self.image} x {self.image} (resize with padding first), "
                                    f"got {h} x {w}", "images")
        if not 1 <= n <= self.cameras:
            raise node.RequestError(f"images must hold 1 to {self.cameras} cameras (leave a missing one out), got {n}",
                                    "images")

    def phase_encode(self, batch: node.Batch) -> node.Batch:
        for entry in batch:
            self.check(entry["images"])
        counts = [int(entry["images"].shape[0]) for entry in batch]
        pixels = torch.cat([entry["images"] for entry in batch]).to(self.spec.device)
        tokens = self.encode(pixels)
        return [{"tokens": part} for part in tokens.split(counts)]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images [N, H, W, C] (checked) -> projected tokens [N, grid^2, projection] in the node dtype."""
        vm = self.vision_tower.vision_model
        x = (images.permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0).to(self.spec.dtype)
        x = vm.embeddings.patch_embedding(x).flatten(2).transpose(1, 2)  # [N, grid^2, dim], row-major patches
        x = x + vm.embeddings.position_embedding.weight[None]
        for layer in vm.encoder.layers:
            x = layer(x)
        return self.multi_modal_projector.linear(vm.post_layernorm(x))
