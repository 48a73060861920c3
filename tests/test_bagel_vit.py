"""BAGEL's image transform and SigLIP NaViT node at the tiny size on the CPU.

Transform: target sizes worked out by hand from the official rules (module docstring of
`mstar_models.bagel.transforms`) for several aspect ratios, pixels against PIL's bicubic
resize, normalisation against (x / 255 - 0.5) / 0.5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mstar_models.bagel.transforms import ImageTransform, check_image
from mstar_runtime.ops.node import RequestError

VIT_REAL = (980, 224, 14)
VAE_REAL = (1024, 512, 16)


# ------------------------------------------------------------------------------ transform
# (height, width) -> (height, width), each worked out by hand:
VIT_SIZES = [
    # 0.98 * (700, 1000) = (686, 980), both multiples of 14
    ((700, 1000), (686, 980)),
    # min side 300 -> 224: scale 0.7467 gives (1493, 224) -> (1498, 224); long side 1498 > 980:
    # scale 980/1498 gives (980, 146.54 -> 147), and 147 / 14 = 10.5 rounds to 10 (half to even)
    ((2000, 300), (980, 140)),
    # tiny: scale 224/3 gives (373.3 -> 373, 224); 373 / 14 = 26.6 -> 27 * 14 = 378
    ((5, 3), (378, 224)),
    # already in range: 800 / 14 = 57.1 -> 798, 600 / 14 = 42.9 -> 602
    ((600, 800), (602, 798)),
    ((980, 980), (980, 980)),
    ((224, 224), (224, 224)),
    ((1, 1), (224, 224)),
]
VAE_SIZES = [
    # short side 500 -> 512 (scale 1.024) gives (3072, 512); long side 3072 > 1024: scale 1/3
    # gives (1024, 170.7 -> 171 -> 176)
    ((3000, 500), (1024, 176)),
    # short side 300 -> 512 gives (512, 5120): 2,621,440 pixels > 1,806,336, so both sides scale
    # by the area ratio 441/640: (352.8 -> 353 -> 352, 3528 -> 220.5 * 16 -> 220 * 16 = 3520);
    # long side 3520 > 1024: scale 1024/3520 gives (102.4 -> 102 -> 96, 1024)
    ((300, 3000), (96, 1024)),
    ((1024, 768), (1024, 768)),
    ((2048, 2048), (1024, 1024)),
]


@pytest.mark.parametrize(("size", "want"), VIT_SIZES)
def test_vit_target_sizes_follow_the_official_rules(size: tuple[int, int], want: tuple[int, int]) -> None:
    assert ImageTransform(*VIT_REAL).target_size(*size) == want


@pytest.mark.parametrize(("size", "want"), VAE_SIZES)
def test_vae_target_sizes_follow_the_official_rules(size: tuple[int, int], want: tuple[int, int]) -> None:
    assert ImageTransform(*VAE_REAL).target_size(*size) == want


def test_tiny_sizes_stay_inside_the_position_table() -> None:
    t = ImageTransform(56, 28, 14)  # the tiny ViT's transform: 4 x 4 patches at most
    for h in range(1, 120, 7):
        for w in range(1, 120, 5):
            th, tw = t.target_size(h, w)
            assert th % 14 == 0 and tw % 14 == 0 and 14 <= min(th, tw) and max(th, tw) <= 56


def test_resize_is_pil_bicubic_and_normalize_maps_to_minus_one_one() -> None:
    t = ImageTransform(*VIT_REAL)
    a = np.random.RandomState(0).randint(0, 256, (300, 200, 3)).astype(np.uint8)
    out = t.resize(torch.from_numpy(a))
    h, w = t.target_size(300, 200)
    ref = np.array(Image.fromarray(a).resize((w, h), Image.Resampling.BICUBIC))
    assert out.dtype == torch.uint8 and tuple(out.shape) == (h, w, 3)
    assert np.array_equal(out.numpy(), ref)
    x = t(torch.from_numpy(a))
    want = (torch.from_numpy(ref).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5
    assert x.dtype == torch.float32 and torch.equal(x, want)
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0


def test_an_image_of_the_target_size_is_not_resampled() -> None:
    img = torch.randint(0, 256, (224, 238, 3), dtype=torch.uint8)
    assert ImageTransform(*VIT_REAL).resize(img) is img


@pytest.mark.parametrize("bad", [
    torch.zeros(10, 10, 3),  # float
    torch.zeros(10, 10, dtype=torch.uint8),  # gray, 2-D
    torch.zeros(3, 10, 10, dtype=torch.uint8),  # CHW
    torch.zeros(10, 10, 4, dtype=torch.uint8),  # RGBA
    torch.zeros(0, 10, 3, dtype=torch.uint8),  # empty
    [[0, 0, 0]],
])
def test_a_bad_image_is_a_request_error(bad: object) -> None:
    with pytest.raises(RequestError, match="'source'") as e:
        check_image(bad, "source")
    assert e.value.field == "source"
    with pytest.raises(RequestError):
        ImageTransform(*VIT_REAL).resize(bad)  # type: ignore[arg-type]
