"""BAGEL's image transform and SigLIP NaViT node (`mstar_models.bagel.vit`), tiny size on the CPU.

Transform: target sizes worked out by hand from the official rules (module docstring of
`mstar_models.bagel.transforms`) for several aspect ratios, pixels against PIL's bicubic
resize, normalisation against (x / 255 - 0.5) / 0.5.

ViT (docs/models/bagel.md, Facts), with the node's random weights copied into transformers 5.24:
- a full square grid against `SiglipVisionModel` (conv patch weight = the Linear weight
  reshaped [dim, p, q, c] -> [dim, c, p, q]);
- any grid against `SiglipEncoder` + `post_layernorm` fed conv patches + the learned table at
  h * side + w (HF itself would interpolate the table), then the node's output against the
  connector and sin-cos table written out from their formulas;
- a batch of different sizes against each image alone; names and shapes against the
  `bagel_vit` arch at tiny and real size; loading a safetensors file through the runtime.
float32; the sides differ only in summation order: 1e-5. Weights are N(0, 0.2^2) rather
than the dummy 0.02 so that attention is far from uniform and a wrong position, patch
order or mask shows (each of those, tried, fails several tests).
The GPU test (real size, bf16, flash attention) is marked `gpu`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from support import compile_model

from mstar_models.bagel.transforms import ImageTransform, check_image, normalize_pixels
from mstar_models.bagel.vit import SiglipNaViT, sincos_table
from mstar_runtime.ops.node import NodeSpec, RequestError
from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.weights import WeightsError, load_weights

ROOT = Path(__file__).resolve().parent.parent

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


# ------------------------------------------------------------------------------ ViT node
REAL_ARGS = {"layers": 26, "hidden": 1152, "heads": 16, "intermediate": 4304, "patch": 14,
             "max_patches_per_side": 70, "llm_hidden": 3584}
P, SIDE, DIM, LLM = 14, 4, 32, 64  # tiny: walk variant tiny
RTOL, ATOL = 1e-5, 1e-5  # float32; the two sides differ only in summation order


def compile_tiny(out: Path) -> Path:
    return compile_model(out, "bagel")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return load_plan(compile_tiny(tmp_path_factory.mktemp("bagel_vit") / "tiny.plan"))


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights under which every part matters: matrices N(0, 0.2^2) (attention far from
    uniform), the learned position table N(0, 1), biases N(0, 0.05^2), norm gains 1 + N(0, 0.1^2).
    Buffers (the sin-cos vit_pos_embed) keep their values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "position_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return module


@pytest.fixture(scope="module")
def vit(plan: Plan) -> SiglipNaViT:
    return randomize_(SiglipNaViT(plan.node_spec("vit", device="cpu")), seed=1).eval()


@pytest.fixture(scope="module")
def hf(vit: SiglipNaViT) -> Any:
    """transformers' SiglipVisionModel (eager attention) holding the node's weights; its conv
    patch embedding is the node's Linear weight reshaped [dim, p, q, c] -> [dim, c, p, q]."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SiglipVisionConfig(
        hidden_size=DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=P * SIDE,
        patch_size=P, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False,
        attn_implementation="eager")
    model = transformers.SiglipVisionModel(cfg).eval()
    prefix = "vit_model.vision_model."
    state = {k.removeprefix(prefix): v for k, v in vit.state_dict().items() if k.startswith(prefix)}
    w = state["embeddings.patch_embedding.weight"]
    state["embeddings.patch_embedding.weight"] = w.view(DIM, P, P, 3).permute(0, 3, 1, 2).contiguous()
    model.load_state_dict(state, strict=False)  # strict=False: HF's position_ids buffer
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v), k
    return model


def image(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def pixels(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[1, 3, h, w] in [-1, 1], resized to `size` by PIL itself."""
    a = img.numpy()
    if a.shape[:2] != size:
        a = np.array(Image.fromarray(a).resize((size[1], size[0]), Image.Resampling.BICUBIC))
    return (torch.from_numpy(a).permute(2, 0, 1)[None].float() / 255.0 - 0.5) / 0.5


def node_hidden(vit: SiglipNaViT, imgs: list[torch.Tensor]) -> torch.Tensor:
    """The node's SigLIP output (after post_layernorm, before the connector) of one image."""
    packed = vit.pack(imgs)
    with torch.no_grad():
        return vit.vision(normalize_pixels(packed.pixels), packed.positions, packed.groups)


def hf_hidden(hf: Any, x: torch.Tensor) -> torch.Tensor:
    """HF's SiglipEncoder + post_layernorm on conv patches + the table at h * SIDE + w (no interpolation)."""
    with torch.no_grad():
        patches = hf.embeddings.patch_embedding(x).flatten(2).transpose(1, 2)  # [1, gh * gw, dim]
        gh, gw = x.shape[2] // P, x.shape[3] // P
        hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        embeds = patches + hf.embeddings.position_embedding.weight[(hh * SIDE + ww).flatten()]
        return hf.post_layernorm(hf.encoder(inputs_embeds=embeds).last_hidden_state)[0]


def sincos_reference(side: int, dim: int) -> np.ndarray:
    """The MAE / DiT 2-D sin-cos table as the official code lays it out: a meshgrid with w first,
    half the channels per axis, [sin | cos] per half, frequencies 1 / 10000^(i / (dim / 4))."""
    def one_axis(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32)))
    return np.concatenate([one_axis(dim // 2, grid[0]), one_axis(dim // 2, grid[1])], axis=1)


def connector_reference(vit: SiglipNaViT, hidden: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """fc2(gelu_tanh(fc1(h))) + sin-cos[h * SIDE + w], written out from the formulas."""
    c = vit.connector
    x = hidden @ c.fc1.weight.T + c.fc1.bias
    x = 0.5 * x * (1.0 + torch.tanh((2.0 / math.pi) ** 0.5 * (x + 0.044715 * x**3)))
    x = x @ c.fc2.weight.T + c.fc2.bias
    ids = [h * SIDE + w for h in range(gh) for w in range(gw)]
    return x + torch.from_numpy(sincos_reference(SIDE, LLM)[ids]).float()


def encode(vit: SiglipNaViT, imgs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [out["tokens"] for out in vit.run("encode", [{"image": i} for i in imgs])]


def test_tensors_are_the_arch_tensors_at_tiny_and_real_size(plan: Plan) -> None:
    from mstarc.archs.bagel import bagel_vit

    tiny = SiglipNaViT(plan.node_spec("vit", device="cpu"))
    want = {t.name: tuple(t.shape) for t in plan.node("vit").arch.tensors}
    assert {k: tuple(v.shape) for k, v in tiny.state_dict().items()} == want
    assert tiny.transform.target_size(1000, 700) == (56, 42)  # max 56 = 14 * 4, min 28
    spec = NodeSpec("vit", "stateless", {}, REAL_ARGS, {}, torch.bfloat16, torch.device("meta"))
    real = SiglipNaViT(spec)
    want = {t.name: t.shape for t in bagel_vit(REAL_ARGS, "bf16").tensors}
    assert {k: tuple(v.shape) for k, v in real.state_dict().items()} == want
    assert want["vit_model.vision_model.embeddings.patch_embedding.weight"] == (1152, 588)
    assert sum(v.numel() for v in real.state_dict().values()) == sum(math.prod(s) for s in want.values())
    assert all(v.dtype == torch.bfloat16 for v in real.state_dict().values())
    t = real.transform
    assert (t.max_size, t.min_size, t.stride) == VIT_REAL


def test_the_sincos_table_is_the_official_one(vit: SiglipNaViT) -> None:
    np.testing.assert_allclose(vit.vit_pos_embed.pos_embed.numpy(), sincos_reference(SIDE, LLM), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sincos_table(70, 3584).numpy(), sincos_reference(70, 3584), rtol=0, atol=1e-12)


def test_a_full_square_grid_equals_siglip_vision_model(vit: SiglipNaViT, hf: Any) -> None:
    img = image(56, 56, seed=2)  # already the transform's size: 4 x 4 patches, the whole table
    with torch.no_grad():
        want = hf(pixel_values=pixels(img, (56, 56))).last_hidden_state[0]
    torch.testing.assert_close(node_hidden(vit, [img]), want, rtol=RTOL, atol=ATOL)


# (image size, the transform's size): non-square grids, and ones the transform resizes
# (14, 56): the short side doubles to 28, then the long side (112) halves back to 56;
# (100, 30): 28 x 93.3 -> 28 x 98, then x 56/98 -> 16 x 56 -> 14 x 56
GRIDS = [((28, 42), (28, 42)), ((42, 28), (42, 28)), ((14, 56), (14, 56)), ((56, 28), (56, 28)),
         ((33, 47), (28, 42)), ((100, 30), (56, 14)), ((5, 3), (42, 28))]


@pytest.mark.parametrize(("size", "resized"), GRIDS)
def test_any_grid_equals_siglip_encoder_with_extrapolated_positions(
    vit: SiglipNaViT, hf: Any, size: tuple[int, int], resized: tuple[int, int]
) -> None:
    img = image(*size, seed=size[0] * 100 + size[1])
    assert vit.transform.target_size(*size) == resized
    want = hf_hidden(hf, pixels(img, resized))
    torch.testing.assert_close(node_hidden(vit, [img]), want, rtol=RTOL, atol=ATOL)
    # the whole node: connector and vit_pos_embed from their formulas
    (tokens,) = encode(vit, [img])
    gh, gw = resized[0] // P, resized[1] // P
    assert tokens.shape == (gh * gw, LLM) and tokens.dtype == torch.float32
    torch.testing.assert_close(tokens, connector_reference(vit, want, gh, gw), rtol=RTOL, atol=ATOL)


def test_positions_are_extrapolated_not_interpolated(vit: SiglipNaViT) -> None:
    packed = vit.pack([image(28, 42, seed=0)])  # 2 x 3 patches
    assert packed.positions.tolist() == [0, 1, 2, 4, 5, 6]
    a = image(28, 28, seed=3)
    a_patch = a[14:28, 0:14].reshape(-1)  # patch (1, 0) of a 2 x 2 grid: rows of (q, c)
    assert torch.equal(vit.pack([a]).pixels[2], a_patch)


def test_a_batch_of_different_sizes_equals_each_image_alone(vit: SiglipNaViT) -> None:
    imgs = [image(28, 42, 1), image(56, 56, 2), image(42, 28, 3), image(28, 42, 4), image(14, 14, 5)]
    together = encode(vit, imgs)
    assert [t.shape[0] for t in together] == [6, 16, 6, 6, 4]
    for img, t in zip(imgs, together, strict=True):
        torch.testing.assert_close(t, encode(vit, [img])[0], rtol=RTOL, atol=ATOL)
    # equal sizes share one attention call; the groups cover the packed rows in order
    groups = vit.pack(imgs).groups
    assert [(g.images, g.tokens) for g in groups] == [(1, 4), (3, 6), (1, 16)]
    assert [g.start for g in groups] == [0, 4, 22]


def test_a_bad_image_in_a_batch_is_a_request_error(vit: SiglipNaViT) -> None:
    good = image(28, 28, 0)
    for bad in (good.float(), good[..., :2], good.permute(2, 0, 1), None):
        with pytest.raises(RequestError, match="'image' must be an RGB image") as e:
            vit.run("encode", [{"image": good}, {"image": bad}])
        assert e.value.field == "image"
    assert vit.run("encode", []) == []


def test_weights_load_from_a_checkpoint_with_the_official_names(plan: Plan, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    tensors = {t.name: 0.1 * torch.randn(t.shape, generator=g) for t in plan.node("vit").arch.tensors}
    assert "vit_model.vision_model.encoder.layers.1.self_attn.out_proj.weight" in tensors
    save_file(tensors, str(tmp_path / "ema.safetensors"))
    node = SiglipNaViT(plan.node_spec("vit", device="cpu"))
    load_weights(node, plan, "vit", tmp_path)
    state = node.state_dict()
    assert state.keys() == tensors.keys()
    assert all(torch.equal(state[k], v) for k, v in tensors.items())  # the sin-cos buffer included
    # dummy weights draw the parameters and keep the real sin-cos table
    fresh = SiglipNaViT(plan.node_spec("vit", device="cpu"))
    load_weights(fresh, plan, "vit", "dummy")
    assert torch.equal(fresh.vit_pos_embed.pos_embed, sincos_table(SIDE, LLM).float())
    del tensors["connector.fc2.bias"]
    save_file(tensors, str(tmp_path / "ema.safetensors"))
    with pytest.raises(WeightsError, match="'connector.fc2.bias' is missing"):
        load_weights(SiglipNaViT(plan.node_spec("vit", device="cpu")), plan, "vit", tmp_path)


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_real_size_bf16_on_the_gpu_runs_flash_and_tracks_float32() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    nodes = {}
    for dt in (torch.float32, torch.bfloat16):
        spec = NodeSpec("vit", "stateless", {}, REAL_ARGS, {}, dt, dev)
        torch.manual_seed(0)
        node = SiglipNaViT(spec).eval()
        g = torch.Generator(device=dev).manual_seed(3)
        with torch.no_grad():
            for name, p in node.named_parameters():  # the loader's dummy rule, same values for both
                if p.dim() == 2:
                    p.copy_(torch.empty(p.shape, device=dev).normal_(0.0, 0.02, generator=g))
                else:
                    p.copy_(torch.ones(p.shape) if "norm" in name and name.endswith("weight") else
                            torch.zeros(p.shape))
        nodes[dt] = node
    imgs = [image(700, 1000, 1).to(dev), image(2000, 300, 2).to(dev), image(700, 1000, 3).to(dev)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if any attention is not flash-eligible
        fast = encode(nodes[torch.bfloat16], imgs)
    ref = encode(nodes[torch.float32], imgs)
    assert [tuple(t.shape) for t in fast] == [(49 * 70, 3584), (70 * 10, 3584), (49 * 70, 3584)]
    for f, r in zip(fast, ref, strict=True):
        assert f.dtype == torch.bfloat16 and f.device.type == "cuda"
        err = (f.float() - r).norm() / r.norm()
        assert err < 2e-2, float(err)
    alone = encode(nodes[torch.bfloat16], imgs[1:2])[0]
    assert ((alone.float() - fast[1].float()).norm() / fast[1].float().norm()) < 1e-2
