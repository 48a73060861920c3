"""BAGEL's FLUX VAE nodes (models/mstar_models/bagel/vae.py) against diffusers 0.42.1.

The reference is `diffusers.AutoencoderKL` in the FLUX configuration (docs/models/bagel.md, Facts), loaded
with our BFL-named state dict converted by diffusers' own `convert_ldm_vae_checkpoint`, so
the key mapping is theirs, not ours. Weights are PyTorch's default init with every norm gain
and bias spread around 1 / 0, so a swapped norm or a missing bias shows.

Tolerances. In float64 the two networks agree to ~3e-14 (measured): the exact test, 1e-10.
In float32 the nodes (sampling, scaling, patchify) are compared end to end: the encoder
differs by <= 1e-6, the decoder by <= 2.2e-5 on outputs of magnitude ~2 (measured; diffusers'
mid attention uses Linear layers where FLUX uses 1x1 convs, and ~30 GroupNorm layers after it
amplify that ulp). Hence 1e-5 for the encoder and 5e-5 for the decoder; any real mistake
(padding side, norm order, a patchify transpose) is off by 1e-2 or more.

Sampling: eps is drawn on the CPU from a generator per request (see the node's docstring), so
diffusers' `latent_dist.sample(generator)` with a CPU generator of the same seed draws the
same eps, and the posterior plus the flow node's noise replay the official single CPU stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support import compile_model

from mstar_models.bagel import vae
from mstar_models.bagel.transforms import ImageTransform
from mstar_models.bagel.vae import (
    SCALE_FACTOR,
    SHIFT_FACTOR,
    FluxVaeDecoder,
    FluxVaeEncoder,
    patchify,
    to_uint8,
    unpatchify,
)
from mstar_runtime.ops.node import NodeSpec, RequestError
from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.weights import WeightsError, load_weights
from mstarc.archs.flux_vae import flux_vae_decoder, flux_vae_encoder

ROOT = Path(__file__).resolve().parent.parent
TINY = {"ch": 32, "ch_mult": [1, 2, 4, 4], "res_blocks": 2, "z_channels": 4}  # the walk's tiny variant
REAL = {"ch": 128, "ch_mult": [1, 2, 4, 4], "res_blocks": 2, "z_channels": 16}
TINY_CONFIG = {"max_latent_size": 4, "latent_patch_size": 2}  # 64 px per side
REAL_CONFIG = {"max_latent_size": 64, "latent_patch_size": 2}
ENC_ATOL, DEC_ATOL = 1e-5, 5e-5  # see the module docstring
H, W = 48, 64  # already a VAE-transform size at tiny scale (long side 64, short >= 32)


# ---------------------------------------------------------------------------- helpers
def spec(name: str, args: dict[str, Any] = TINY, config: dict[str, Any] = TINY_CONFIG,
         dtype: torch.dtype = torch.float32, device: str = "cpu") -> NodeSpec:
    return NodeSpec(name, "stateless", config, args, {}, dtype, torch.device(device))


def spread_norms(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))


def make_nodes(seed: int = 0, args: dict[str, Any] = TINY) -> tuple[FluxVaeEncoder, FluxVaeDecoder]:
    torch.manual_seed(seed)
    enc = FluxVaeEncoder(spec("vae_enc", args)).eval()
    dec = FluxVaeDecoder(spec("vae_dec", args)).eval()
    spread_norms(enc, seed + 1)
    spread_norms(dec, seed + 2)
    return enc, dec


def diffusers_config(args: dict[str, Any]) -> dict[str, Any]:
    return {
        "in_channels": 3, "out_channels": 3, "latent_channels": args["z_channels"],
        "block_out_channels": [args["ch"] * m for m in args["ch_mult"]], "layers_per_block": args["res_blocks"],
        "down_block_types": ["DownEncoderBlock2D"] * len(args["ch_mult"]),
        "up_block_types": ["UpDecoderBlock2D"] * len(args["ch_mult"]),
        "norm_num_groups": 32, "use_quant_conv": False, "use_post_quant_conv": False,
        "scaling_factor": SCALE_FACTOR, "shift_factor": SHIFT_FACTOR,
    }


def reference(enc: FluxVaeEncoder, dec: FluxVaeDecoder, args: dict[str, Any] = TINY) -> torch.nn.Module:
    diffusers = pytest.importorskip("diffusers")
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    cfg = diffusers_config(args)
    ref = diffusers.AutoencoderKL(**cfg).eval()
    ref.load_state_dict(convert_ldm_vae_checkpoint({**enc.state_dict(), **dec.state_dict()}, cfg), strict=True)
    return ref


def official_patchify(z: torch.Tensor, p: int) -> torch.Tensor:
    """forward_cache_update_vae, for one latent [c, h*p, w*p]."""
    c, hp, wp = z.shape
    x = z.reshape(c, hp // p, p, wp // p, p)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, p * p * c)


def official_unpatchify(tokens: torch.Tensor, h: int, w: int, p: int, c: int) -> torch.Tensor:
    """inferencer.decode_image, up to the VAE: [h*w, p*p*c] -> [1, c, h*p, w*p]."""
    x = torch.einsum("nhwpqc->nchpwq", tokens.reshape(1, h, w, p, p, c))
    return x.reshape(1, c, h * p, w * p)


def image(h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


def to_pixels(img: torch.Tensor) -> torch.Tensor:
    """ToTensor + Normalize(0.5, 0.5), batched: u8 [H, W, 3] -> f32 [1, 3, H, W]."""
    return (img.permute(2, 0, 1).float() / 255.0 - 0.5).div(0.5).unsqueeze(0)


@contextmanager
def forwards(module: torch.nn.Module) -> Iterator[list[int]]:
    """A list that records the batch size of every forward of `module` inside the block."""
    seen: list[int] = []
    handle = module.register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].shape[0])))
    try:
        yield seen
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def nodes() -> tuple[FluxVaeEncoder, FluxVaeDecoder]:
    return make_nodes(0)


@pytest.fixture(scope="module")
def ref(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> torch.nn.Module:
    return reference(*nodes)


# -------------------------------------------------------------------------- structure
@pytest.mark.parametrize("args", [TINY, REAL], ids=["tiny", "real"])
def test_tensor_names_and_shapes_are_the_arch(args: dict[str, Any]) -> None:
    config = TINY_CONFIG if args is TINY else REAL_CONFIG
    for cls, arch, name in ((FluxVaeEncoder, flux_vae_encoder, "vae_enc"),
                            (FluxVaeDecoder, flux_vae_decoder, "vae_dec")):
        module = cls(spec(name, args, config, torch.bfloat16, "meta"))
        ours = {n: tuple(t.shape) for n, t in module.state_dict().items()}
        listed = {t.name: tuple(t.shape) for t in arch(args, "bf16").tensors}
        assert ours == listed
        assert all(t.dtype == torch.bfloat16 for t in module.state_dict().values())
    # the released AE: 34.3 M encoder + 49.5 M decoder parameters (docs/models/bagel.md, Facts)
    if args is REAL:
        counts = [sum(math.prod(t.shape) for t in a(args, "bf16").tensors) for a in (flux_vae_encoder, flux_vae_decoder)]
        assert [round(c / 1e6, 1) for c in counts] == [34.3, 49.5]


# ----------------------------------------------------------------------------- parity
def test_networks_match_diffusers_in_float64() -> None:
    enc, dec = make_nodes(3)
    ref = reference(enc, dec).double()
    enc.double()
    dec.double()
    g = torch.Generator().manual_seed(4)
    # float64 convs are slow on a CPU: one small image (still 4 x 6 latent positions)
    x = torch.rand(1, 3, 32, 48, generator=g, dtype=torch.float64) * 2 - 1
    z = torch.randn(1, TINY["z_channels"], 4, 6, generator=g, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(enc.encoder(x), ref.encoder(x), rtol=0, atol=1e-10)
        torch.testing.assert_close(dec.decoder(z), ref.decoder(z), rtol=0, atol=1e-10)


def test_encode_matches_diffusers(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder], ref: torch.nn.Module) -> None:
    enc, _ = nodes
    img, seed = image(H, W, 5), 1234
    out = enc.run("encode", [{"image": img, "seed": seed}])[0]
    with torch.no_grad():
        mean, _ = enc.moments(to_pixels(img))
        posterior = ref.encode(to_pixels(img)).latent_dist
        # diffusers draws eps = randn(mean.shape, generator) as our per-request generator does
        z = posterior.sample(generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(mean, posterior.mean, rtol=0, atol=ENC_ATOL)
    want = official_patchify((z[0] - SHIFT_FACTOR) * SCALE_FACTOR, 2)
    assert out["latent"].shape == (H // 16 * W // 16, 16) and out["latent"].dtype == torch.float32
    torch.testing.assert_close(out["latent"], want, rtol=0, atol=ENC_ATOL)
    assert (out["height"], out["width"]) == (H, W)
    assert out["drawn"] == TINY["z_channels"] * (H // 8) * (W // 8) == posterior.mean.numel()
    assert torch.equal(out["resized"], img)  # 48 x 64 is already a VAE-transform size here


def test_decode_matches_diffusers(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder], ref: torch.nn.Module) -> None:
    _, dec = nodes
    h, w = H // 16, W // 16
    tokens = torch.randn(h * w, 16, generator=torch.Generator().manual_seed(6))
    out = dec.run("decode", [{"latent": tokens, "height": H, "width": W}])[0]["image"]
    with torch.no_grad():
        ours = dec.pixels(tokens.unsqueeze(0), h, w)
        want = ref.decode(official_unpatchify(tokens, h, w, 2, 4) / SCALE_FACTOR + SHIFT_FACTOR).sample
    torch.testing.assert_close(ours, want, rtol=0, atol=DEC_ATOL)
    assert out.shape == (H, W, 3) and out.dtype == torch.uint8
    # the official decode_image on the reference's output; a float a hair off an integer may
    # truncate the other way, so one level of difference is allowed, and must be rare
    official = ((want * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 0) * 255).to(torch.uint8)
    diff = (out.int() - official.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert torch.equal(out, to_uint8(ours)[0])
    assert out.float().std() > 10  # not a flat image: the comparison has content


def test_to_uint8_clamps_and_truncates_as_the_official() -> None:
    x = torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0, 3.0]).view(1, 1, 1, 6).expand(1, 3, 1, 6)
    assert to_uint8(x)[0, 0, :, 0].tolist() == [0, 0, 127, 254, 255, 255]


# --------------------------------------------------------------------------- patchify
def test_patchify_is_the_official_layout_and_round_trips() -> None:
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, 4, 6, 8, generator=g)
    tokens = patchify(z, 2)
    assert tokens.shape == (2, 12, 16)
    for i in range(2):
        assert torch.equal(tokens[i], official_patchify(z[i], 2))
        assert torch.equal(unpatchify(tokens[i : i + 1], 3, 4, 2), official_unpatchify(tokens[i], 3, 4, 2, 4))
    assert torch.equal(unpatchify(tokens, 3, 4, 2), z)
    # token (row 1, col 2) is z[:, 2:4, 4:6] in (p, q, c) order
    assert torch.equal(tokens[0, 1 * 4 + 2], z[0, :, 2:4, 4:6].permute(1, 2, 0).reshape(-1))


# ---------------------------------------------------------------------------- sampling
def test_sampling_is_reproducible_per_seed(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> None:
    enc, _ = nodes
    img = image(H, W, 8)
    a, b, c = (enc.run("encode", [{"image": img, "seed": s}])[0]["latent"] for s in (11, 11, 12))
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 0.01
    torch.manual_seed(0)
    first = enc.run("encode", [{"image": img, "seed": 11}])[0]["latent"]
    torch.randn(100)  # the global RNG plays no part
    assert torch.equal(first, a)
    eps = torch.randn(TINY["z_channels"], H // 8, W // 8, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(implied_eps(enc, img, a), eps, rtol=1e-4, atol=1e-4)


def implied_eps(enc: FluxVaeEncoder, img: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """The eps of z = mean + std * eps behind an encoded latent [h*w, p*p*z] -> [z, H / 8, W / 8]."""
    with torch.no_grad():
        mean, logvar = enc.moments(to_pixels(img))
    z = unpatchify(latent.unsqueeze(0), H // 16, W // 16, 2) / SCALE_FACTOR + SHIFT_FACTOR
    return ((z - mean) / torch.exp(0.5 * logvar))[0]


def test_edit_draws_in_the_official_single_rng_order(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> None:
    """Official edit on the CPU (the app keeps the AE there): after manual_seed(seed), the posterior
    takes randn_like(mean), then prepare_vae_latent takes x_1 = randn(h*w, 64) from the same stream.
    Our posterior and the flow node's noise, skipping `drawn`, must be exactly those draws."""
    from mstar_models.bagel.flow import FlowStep

    enc, _ = nodes
    img, seed = image(H, W, 10), 77
    out = enc.run("encode", [{"image": img, "seed": seed}])[0]
    flow = FlowStep(NodeSpec("flow", "stateless", {"patch_dim": 16, "max_latent_size": 4, "max_timesteps": 8},
                             {}, {}, torch.float32, torch.device("cpu")))
    x1 = flow.run("noise", [{"height": out["height"], "width": out["width"], "seed": seed,
                             "skip": out["drawn"]}])[0]["latent"]
    torch.manual_seed(seed)
    eps = torch.randn_like(torch.empty(1, TINY["z_channels"], H // 8, W // 8))
    noise = torch.randn(H // 16 * W // 16, 16)
    torch.testing.assert_close(implied_eps(enc, img, out["latent"]), eps[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(x1, noise)


# --------------------------------------------------------------------------- batching
def test_batches_group_by_size(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> None:
    enc, dec = nodes
    batch = [{"image": image(H, W, 20), "seed": 1}, {"image": image(W, H, 21), "seed": 2},
             {"image": image(H, W, 22), "seed": 3}]
    with forwards(enc.encoder) as calls:
        together = enc.run("encode", batch)
    assert sorted(calls) == [1, 2]  # one forward per size
    alone = [enc.run("encode", [e])[0] for e in batch]
    for t, a in zip(together, alone, strict=True):
        torch.testing.assert_close(t["latent"], a["latent"], rtol=0, atol=1e-5)
        assert (t["height"], t["width"], t["drawn"]) == (a["height"], a["width"], a["drawn"])
    assert [(t["height"], t["width"]) for t in together] == [(H, W), (W, H), (H, W)]
    dec_batch = [{"latent": t["latent"], "height": t["height"], "width": t["width"]} for t in together]
    with forwards(dec.decoder) as calls:
        images = dec.run("decode", dec_batch)
    assert sorted(calls) == [1, 2]
    for entry, out in zip(dec_batch, images, strict=True):
        single = dec.run("decode", [entry])[0]["image"]
        assert out["image"].shape == (entry["height"], entry["width"], 3)
        assert (out["image"].int() - single.int()).abs().max() <= 1


def test_a_big_size_group_is_cut_by_the_pixel_cap(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    enc, dec = nodes
    monkeypatch.setattr(vae, "MAX_PIXELS_PER_FORWARD", 2 * H * W)
    batch = [{"image": image(H, W, 23 + i), "seed": i} for i in range(5)]
    with forwards(enc.encoder) as calls:
        outs = enc.run("encode", batch)
    assert calls == [2, 2, 1]
    with forwards(dec.decoder) as calls:
        dec.run("decode", [{"latent": o["latent"], "height": H, "width": W} for o in outs])
    assert calls == [2, 2, 1]
    torch.testing.assert_close(outs[4]["latent"], enc.run("encode", batch[4:])[0]["latent"], rtol=0, atol=1e-5)


def test_resize_phase_is_the_vae_transform(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> None:
    enc, _ = nodes
    img = image(30, 100, 9)  # tiny plan: ImageTransform(64, 32, 16)
    want = ImageTransform(64, 32, 16).resize(img)
    got = enc.run("resize", [{"image": img}])[0]["resized"]
    assert torch.equal(got, want) and got.shape == (16, 64, 3)
    out = enc.run("encode", [{"image": img, "seed": 0}])[0]
    assert torch.equal(out["resized"], want)
    assert (out["height"], out["width"]) == (16, 64) and out["latent"].shape == (1 * 4, 16)


# ------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"image": torch.zeros(8, 8, 3), "seed": 0}, "image"),
        ({"image": torch.zeros(8, 8, 4, dtype=torch.uint8), "seed": 0}, "image"),
        ({"image": torch.zeros(0, 8, 3, dtype=torch.uint8), "seed": 0}, "image"),
        ({"image": "picture.png", "seed": 0}, "image"),
        ({"image": torch.zeros(8, 8, 3, dtype=torch.uint8), "seed": "0"}, "seed"),
        ({"image": torch.zeros(8, 8, 3, dtype=torch.uint8), "seed": True}, "seed"),
        ({"image": torch.zeros(8, 8, 3, dtype=torch.uint8), "seed": 2**64}, "seed"),
    ],
    ids=["float", "rgba", "empty", "str", "seed-str", "seed-bool", "seed-range"],
)
def test_encoder_rejects_bad_requests(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder], entry: dict[str, Any],
                                      field: str) -> None:
    enc, _ = nodes
    with pytest.raises(RequestError) as e:
        enc.run("encode", [{"image": image(H, W, 0), "seed": 0}, entry])
    assert e.value.field == field
    if field == "image":
        with pytest.raises(RequestError):
            enc.run("resize", [entry])


@pytest.mark.parametrize(
    ("entry", "field", "message"),
    [
        ({"height": 40, "width": 64}, "height", "not a multiple of 16"),
        ({"height": 80, "width": 64}, "height", r"outside \[16, 64\]"),
        ({"height": 48, "width": 0}, "width", r"outside \[16, 64\]"),
        ({"height": 48.0, "width": 64}, "height", "must be an integer"),
        ({"height": 64, "width": 64}, "latent", r"64x64 image must be a float tensor \[16, 16\], got .* \[12, 16\]"),
        ({"latent": torch.zeros(12, 64)}, "latent", r"\[12, 16\]"),
        ({"latent": torch.zeros(12, 16, dtype=torch.int32)}, "latent", "torch.int32"),
        ({"latent": [[0.0] * 16] * 12}, "latent", "got a list"),
    ],
    ids=["stride", "too-high", "zero", "float-size", "size-mismatch", "width-dim", "int", "list"],
)
def test_decoder_rejects_bad_requests(nodes: tuple[FluxVaeEncoder, FluxVaeDecoder], entry: dict[str, Any],
                                      field: str, message: str) -> None:
    _, dec = nodes
    good = {"latent": torch.zeros(12, 16), "height": H, "width": W}
    with pytest.raises(RequestError, match=message) as e:
        dec.run("decode", [good, {**good, **entry}])
    assert e.value.field == field


# ---------------------------------------------------------------------------- weights
@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return load_plan(compile_model(tmp_path_factory.mktemp("plan") / "bagel-tiny.plan", "bagel"))


def test_loader_reads_the_bfl_safetensors(tmp_path: Path, plan: Plan,
                                          nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> None:
    enc, dec = nodes
    folder = tmp_path / "weights"
    folder.mkdir()
    # one ae.safetensors with both halves, as released
    save_file({k: v.contiguous() for k, v in {**enc.state_dict(), **dec.state_dict()}.items()},
              folder / "ae.safetensors")
    loaded_enc = FluxVaeEncoder(plan.node_spec("vae_enc", device="cpu")).eval()
    loaded_dec = FluxVaeDecoder(plan.node_spec("vae_dec", device="cpu")).eval()
    load_weights(loaded_enc, plan, "vae_enc", folder)
    load_weights(loaded_dec, plan, "vae_dec", folder)
    for ours, loaded in ((enc, loaded_enc), (dec, loaded_dec)):
        want, got = ours.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    entry = {"image": image(H, W, 30), "seed": 5}
    assert torch.equal(loaded_enc.run("encode", [entry])[0]["latent"], enc.run("encode", [entry])[0]["latent"])


def test_loader_names_a_bad_tensor(tmp_path: Path, plan: Plan, nodes: tuple[FluxVaeEncoder, FluxVaeDecoder]) -> None:
    enc, dec = nodes
    state = {**enc.state_dict(), **dec.state_dict()}
    state["encoder.down.1.block.0.nin_shortcut.weight"] = torch.zeros(64, 16, 1, 1)
    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "ae.safetensors")
    module = FluxVaeEncoder(plan.node_spec("vae_enc", device="cpu"))
    with pytest.raises(WeightsError, match=r"'encoder.down.1.block.0.nin_shortcut.weight' .* \[64, 16, 1, 1\]"):
        load_weights(module, plan, "vae_enc", folder)


def test_dummy_weights_give_a_usable_round_trip(plan: Plan) -> None:
    enc = FluxVaeEncoder(plan.node_spec("vae_enc", device="cpu")).eval()
    dec = FluxVaeDecoder(plan.node_spec("vae_dec", device="cpu")).eval()
    load_weights(enc, plan, "vae_enc", "dummy")
    load_weights(dec, plan, "vae_dec", "dummy")
    out = enc.run("encode", [{"image": image(H, W, 31), "seed": 0}])[0]
    assert torch.isfinite(out["latent"]).all()
    img = dec.run("decode", [{"latent": out["latent"], "height": H, "width": W}])[0]["image"]
    assert img.shape == (H, W, 3)


# -------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_real_size_bf16_close_to_f32_on_gpu() -> None:
    """The released geometry on a 1024 x 768 image: bf16 nodes track f32 ones (relative error)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    enc32 = FluxVaeEncoder(spec("vae_enc", REAL, REAL_CONFIG, torch.float32, "cuda")).eval()
    dec32 = FluxVaeDecoder(spec("vae_dec", REAL, REAL_CONFIG, torch.float32, "cuda")).eval()
    enc16 = FluxVaeEncoder(spec("vae_enc", REAL, REAL_CONFIG, torch.bfloat16, "cuda")).eval()
    dec16 = FluxVaeDecoder(spec("vae_dec", REAL, REAL_CONFIG, torch.bfloat16, "cuda")).eval()
    # tame weights: depth-scaled convs keep the activations O(1) through the 30+ blocks
    with torch.no_grad():
        for m32, m16 in ((enc32, enc16), (dec32, dec16)):
            for p in m32.parameters():
                if p.dim() == 4:
                    p.mul_(0.5)
            m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()})
    img = image(768, 1024, 40).cuda()
    batch = [{"image": img, "seed": 3}, {"image": img.flip(0), "seed": 4}]
    outs32, outs16 = enc32.run("encode", batch), enc16.run("encode", batch)
    for a, b in zip(outs32, outs16, strict=True):
        assert a["latent"].shape == (48 * 64, 64) and (a["height"], a["width"]) == (768, 1024)
        assert a["latent"].device.type == "cuda" and a["drawn"] == 16 * 96 * 128
        rel = (a["latent"] - b["latent"]).norm() / a["latent"].norm()
        assert rel < 0.05
    lat = outs32[0]["latent"]
    with torch.no_grad():
        p32 = dec32.pixels(lat.unsqueeze(0), 48, 64)
        p16 = dec16.pixels(lat.unsqueeze(0), 48, 64)
    # measured on a CPU at 512 x 768: 0.4 % (encoder), 2.3 % (decoder)
    assert ((p32 - p16).norm() / p32.norm()) < 0.08
    out = dec16.run("decode", [{"latent": lat, "height": 768, "width": 1024}])[0]["image"]
    assert out.shape == (768, 1024, 3) and out.dtype == torch.uint8 and out.device.type == "cuda"
