"""BAGEL's image transform: the official `data/transforms.py` `ImageTransform` on uint8 tensors.

`ImageTransform(max_size, min_size, stride, max_pixels)` resizes an RGB image (uint8
`[H, W, 3]`) so that its long side is at most `max_size`, its short side at least
`min_size` (the long-side cap wins where both cannot hold, and a third rule caps the pixel
count), and both sides are multiples of `stride`; then `normalize` gives float32 `[3, H, W]`
in [-1, 1] (ToTensor, then mean = std = 0.5). The ViT uses (980, 224, 14), the VAE
(1024, 512, 16).

The size rules, as the official `MaxLongEdgeMinShortEdgeResize.forward`:
1. scale = max(min(max_size / long, 1), min_size / short); each side -> round(side * scale),
   then to the nearest multiple of `stride` (at least `stride`);
2. if w * h > max_pixels / img_num: scale both sides by the *area* ratio
   max_pixels / img_num / (w * h) (not its square root: the official rule), rounding again;
3. if the long side still exceeds max_size: scale by max_size / long, rounding again.
Rounding is Python's `round` (half to even: 147 / 14 = 10.5 -> 10), as in the official code.

The resampling is PIL's bicubic filter (antialiased), which is what torchvision's
`F.resize(..., BICUBIC, antialias=True)` runs on a PIL image; an image already of the
target size is returned unchanged, as torchvision does.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mstar_runtime.ops import node

DEFAULT_MAX_PIXELS = 14 * 14 * 9 * 1024  # the official default (1,806,336)


def check_image(image: object, field: str = "image") -> torch.Tensor:
    """`image` itself if it is a non-empty RGB uint8 tensor [H, W, 3]; else a RequestError naming `field`."""
    if not isinstance(image, torch.Tensor):
        raise node.RequestError(f"'{field}' must be an RGB image (uint8 tensor [H, W, 3]), got {type(image).__name__}",
                                field)
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
        raise node.RequestError(
            f"'{field}' must be an RGB image (uint8 tensor [H, W, 3]), got "
            f"{str(image.dtype).removeprefix('torch.')} {list(image.shape)}",
            field,
        )
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise node.RequestError(f"'{field}' is empty ({image.shape[0]} x {image.shape[1]} pixels)", field)
    return image


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 values (any shape) -> float32 (x / 255 - 0.5) / 0.5, ToTensor then Normalize(0.5, 0.5)."""
    return pixels.to(torch.float32).div_(255.0).sub_(0.5).div_(0.5)


class ImageTransform:
    """Resize (PIL bicubic, stride-aligned sizes) and normalise; see the module docstring."""

    def __init__(self, max_size: int, min_size: int, stride: int, max_pixels: int = DEFAULT_MAX_PIXELS):
        for name, value in (("max_size", max_size), ("min_size", min_size), ("stride", stride),
                            ("max_pixels", max_pixels)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ImageTransform: {name} must be a positive integer, got {value!r}")
        self.max_size, self.min_size, self.stride, self.max_pixels = max_size, min_size, stride, max_pixels

    def __repr__(self) -> str:
        return (f"ImageTransform(max_size={self.max_size}, min_size={self.min_size}, stride={self.stride}, "
                f"max_pixels={self.max_pixels})")

    # ------------------------------------------------------------------ sizes
    def _divisible(self, value: int) -> int:
        return max(self.stride, int(round(value / self.stride) * self.stride))

    def _scaled(self, width: int, height: int, scale: float) -> tuple[int, int]:
        return self._divisible(round(width * scale)), self._divisible(round(height * scale))

    def target_size(self, height: int, width: int, img_num: int = 1) -> tuple[int, int]:
        """(height, width) an image of `height` x `width` pixels is resized to."""
        if height <= 0 or width <= 0:
            raise ValueError(f"ImageTransform: image size must be positive, got {height} x {width}")
        scale = min(self.max_size / max(width, height), 1.0)
        scale = max(scale, self.min_size / min(width, height))
        w, h = self._scaled(width, height, scale)
        if w * h > self.max_pixels / img_num:
            w, h = self._scaled(w, h, self.max_pixels / img_num / (w * h))
        if max(w, h) > self.max_size:
            w, h = self._scaled(w, h, self.max_size / max(w, h))
        return h, w

    # ------------------------------------------------------------------ pixels
    def resize(self, image: torch.Tensor, field: str = "image") -> torch.Tensor:
        """uint8 [H, W, 3] -> uint8 [h, w, 3] at `target_size`, on the input's device."""
        check_image(image, field)
        height, width = int(image.shape[0]), int(image.shape[1])
        h, w = self.target_size(height, width)
        if (h, w) == (height, width):
            return image
        src = Image.fromarray(np.ascontiguousarray(image.detach().cpu().numpy()))
        out = src.resize((w, h), Image.Resampling.BICUBIC)
        return torch.from_numpy(np.asarray(out).copy()).to(image.device)

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 [H, W, 3] -> float32 [3, H, W] in [-1, 1]."""
        return normalize_pixels(image.permute(2, 0, 1))

    def __call__(self, image: torch.Tensor, field: str = "image") -> torch.Tensor:
        """resize, then normalize: the official `ImageTransform.__call__`."""
        return self.normalize(self.resize(image, field))
