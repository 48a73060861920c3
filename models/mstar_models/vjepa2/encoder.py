"""The V-JEPA 2 ViT video encoder as a stateless node (official `VisionTransformer` with
`use_rope=True`, e.g. `vit_giant_xformers`: ViT-g/16, 40 blocks, 22 heads).

`phase_encode` follows the official `WorldModel.encode`: every RGB frame is resized to
`img x img`, ImageNet-normalised, repeated `tubelet` times in time to fill one tubelet,
encoded on its own (frames are the batch), and, with `normalize_reps` (the node setting,
default true as in the wrapper), layer-normed over the feature dim without affine weights
(`F.layer_norm`, eps 1e-5). `forward_pixels` is the bare encoder on normalised video, the
function `transformers.VJEPA2Model.get_vision_features` computes (tests compare the two).

Tensor names are the official checkpoint's (`patch_embed.proj`, `blocks.{i}.attn.qkv`, ...):
the `vjepa2_vit` arch lists exactly these, so no prefix or rename is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.vjepa2.layers import LN_EPS, Block, grid_positions, rope_tables
from mstar_runtime.ops import node

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CHUNK_FRAMES = 64  # frames per forward: bounds activation memory for big encode requests


class PatchEmbed(nn.Module):
    def __init__(self, dim: int, in_chans: int, tubelet: int, patch: int, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        k = (tubelet, patch, patch)
        self.proj = nn.Conv3d(in_chans, dim, kernel_size=k, stride=k, device=device, dtype=dtype)


class VitEncoder(node.StatelessNode):
    """frames u8 [N, H, W, 3] -> latents [N, (img/patch)^2, dim]."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a, cfg = spec.arch_args, spec.config
        dev, dt = spec.device, spec.dtype
        self.dim, self.heads = int(a["dim"]), int(a["heads"])
        self.patch, self.tubelet = int(a["patch"]), int(a["tubelet"])
        self.img = int(cfg["img"])
        self.grid = self.img // self.patch
        self.normalize_reps = bool(spec.settings.get("normalize_reps", True))
        self.patch_embed = PatchEmbed(self.dim, int(a.get("in_chans", 3)), self.tubelet, self.patch, dev, dt)
        self.blocks = nn.ModuleList(
            Block(self.dim, self.heads, int(a["mlp"]), bool(a.get("qkv_bias", True)), dev, dt)
            for _ in range(int(a["depth"]))
        )
        self.norm = nn.LayerNorm(self.dim, eps=LN_EPS, device=dev, dtype=dt)

    # ------------------------------------------------------------------ tensors
    def forward_pixels(self, video: torch.Tensor) -> torch.Tensor:
        """Normalised video [B, C, T, H, W] -> encoder output [B, T/tubelet * Hp * Wp, dim]."""
        x = self.patch_embed.proj(video.to(self.patch_embed.proj.weight.dtype))
        frames, hp, wp = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)  # token order (t, h, w), as Conv3d's flatten
        pos = grid_positions(frames, hp, wp, self.grid, x.device)
        cos, sin = rope_tables(*pos, self.dim // self.heads, x.dtype)
        for blk in self.blocks:
            q, k, v = blk.attn.qkv_heads(blk.norm1(x), cos, sin)  # [B, N, H, hd]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            x = x + blk.attn.proj(o.transpose(1, 2).flatten(2))
            x = blk.mlp_residual(x)
        return self.norm(x)

    def preprocess(self, frames: torch.Tensor) -> torch.Tensor:
        """u8 [N, H, W, 3] -> normalised clips [N, 3, tubelet, img, img] (each frame repeated)."""
        x = frames.to(self.spec.device).permute(0, 3, 1, 2).float().div_(255.0)
        if x.shape[-2:] != (self.img, self.img):
            # the official transform resizes the short side to the crop size (scale 1, ratio 1)
            x = F.interpolate(x, size=(self.img, self.img), mode="bilinear", align_corners=False,
                              antialias=True)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
        return x.unsqueeze(2).expand(-1, -1, self.tubelet, -1, -1)

    def encode_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """u8 frames -> latents in the compute dtype (layer-normed when `normalize_reps`)."""
        clips = self.preprocess(frames)
        outs = []
        for i in range(0, clips.shape[0], CHUNK_FRAMES):
            h = self.forward_pixels(clips[i : i + CHUNK_FRAMES])
            outs.append(F.layer_norm(h, (h.shape[-1],)) if self.normalize_reps else h)
        if not outs:
            return torch.zeros(0, self.grid * self.grid, self.dim, dtype=self.spec.dtype, device=self.spec.device)
        return torch.cat(outs)

    # ------------------------------------------------------------------ phases
    def phase_encode(self, batch: node.Batch) -> node.Batch:
        for entry in batch:
            f = entry["frames"]
            if f.dim() != 4 or f.shape[-1] != 3 or f.dtype != torch.uint8:
                raise node.RequestError(f"frames must be u8 [N, H, W, 3], got {f.dtype} {list(f.shape)}", "frames")
            if f.shape[0] == 0 or f.shape[1] == 0 or f.shape[2] == 0:  # resizing an empty frame fails
                raise node.RequestError(f"frames must hold at least one frame of at least 1 x 1 px, got shape "
                                        f"{list(f.shape)}", "frames")
        counts = [int(e["frames"].shape[0]) for e in batch]
        sizes = {tuple(e["frames"].shape[1:3]) for e in batch if e["frames"].shape[0]}
        if len(sizes) <= 1:  # one forward for the whole batch (the common case: same camera)
            frames = torch.cat([e["frames"] for e in batch])
            parts = torch.split(self.encode_frames(frames), counts)
        else:  # frames of different sizes resize separately
            parts = [self.encode_frames(e["frames"]) for e in batch]
        return [{"latents": p} for p in parts]
