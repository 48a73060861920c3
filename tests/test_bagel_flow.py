"""BAGEL's FlowStep node against the official generate_image / _forward_flow arithmetic
(ByteDance-Seed/Bagel modeling/bagel/bagel.py), re-derived here as plain code per case."""

from __future__ import annotations

import pytest
import torch

from mstar_models.bagel.flow import FlowStep
from mstar_runtime.ops.node import NodeSpec, RequestError

CONFIG = {"patch_dim": 16, "max_latent_size": 4, "max_timesteps": 8}


def node() -> FlowStep:
    return FlowStep(NodeSpec("flow", "stateless", CONFIG, {}, {}, torch.float32, torch.device("cpu")))


def official_velocity(v, v_text, v_img, s_text, s_img, renorm, renorm_min):
    """The official combination as its branches read (cfg_text_scale > 1 assumed)."""
    if renorm == "text_channel":
        v_t_text_ = v_text + s_text * (v - v_text)
        scale = (torch.norm(v, dim=-1, keepdim=True) / (torch.norm(v_t_text_, dim=-1, keepdim=True) + 1e-8))
        v_t_text = v_t_text_ * scale.clamp(min=renorm_min, max=1.0)
        return v_img + s_img * (v_t_text - v_img) if s_img > 1.0 else v_t_text
    v_t_text_ = v_text + s_text * (v - v_text)
    v_t_ = v_img + s_img * (v_t_text_ - v_img) if s_img > 1.0 else v_t_text_
    if renorm == "global":
        n, n_ = torch.norm(v), torch.norm(v_t_)
    else:
        n, n_ = torch.norm(v, dim=-1, keepdim=True), torch.norm(v_t_, dim=-1, keepdim=True)
    return v_t_ * (n / (n_ + 1e-8)).clamp(min=renorm_min, max=1.0)


def entry(x, v, v_text, v_img, t, dt, s_text=4.0, s_img=1.5, lo=0.4, hi=1.0, renorm="global", rmin=0.0):
    return {"latent": x, "v": v, "v_text": v_text, "v_img": v_img, "t": t, "dt": dt,
            "cfg_text_scale": s_text, "cfg_img_scale": s_img, "cfg_interval_start": lo,
            "cfg_interval_end": hi, "cfg_renorm_type": renorm, "cfg_renorm_min": rmin}


def test_schedule_and_times_are_the_official_shifted_linspace() -> None:
    f = node()
    assert f.run("schedule", [{"num_timesteps": 9}])[0]["steps"] == 8
    n, s = 9, 3.0
    ts = torch.linspace(1, 0, n)
    ts = s * ts / (1 + (s - 1) * ts)
    for i in range(n - 1):
        out = f.run("time", [{"index": i, "num_timesteps": n, "shift": s}])[0]
        assert out["t"] == float(ts[i]) and out["dt"] == float(ts[i] - ts[i + 1])
    with pytest.raises(RequestError, match=r"num_timesteps must be in 2\.\.9"):
        f.run("schedule", [{"num_timesteps": 50}])


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
@pytest.mark.parametrize("s_img", [1.5, 1.0])
def test_step_combines_as_the_official_code(renorm: str, s_img: float) -> None:
    g = torch.Generator().manual_seed(0)
    x, v, vt, vi = (torch.randn(16, 16, generator=g) for _ in range(4))
    out = node().run("step", [entry(x, v, vt, vi, 0.7, 0.05, s_img=s_img, renorm=renorm, rmin=0.2)])[0]
    want = x - official_velocity(v, vt, vi, 4.0, s_img, renorm, 0.2) * 0.05
    assert torch.allclose(out["latent"], want, atol=1e-6)


def test_guide_turns_branches_off_and_step_reads_empty_velocities() -> None:
    f = node()
    x = torch.randn(16, 16)
    empty = torch.zeros(0, 16)

    def guide(t, s_text=4.0, s_img=1.5, lo=0.4, hi=1.0):
        o = f.run("guide", [{"latent": x, "t": t, "cfg_text_scale": s_text, "cfg_img_scale": s_img,
                             "cfg_interval_start": lo, "cfg_interval_end": hi}])[0]
        return o["q_text"].shape[0] > 0, o["q_img"].shape[0] > 0

    assert guide(0.7) == (True, True)
    assert guide(0.4) == (False, False)  # the interval is open at its start: t > start
    assert guide(1.0) == (True, True)  # and closed at its end
    assert guide(0.7, s_img=1.0) == (True, False)  # no image branch when its scale is <= 1
    assert guide(0.7, s_text=1.0) == (False, False)  # the official code skips all CFG then
    v = torch.randn(16, 16)
    # outside CFG: v as is
    out = f.run("step", [entry(x, v, empty, empty, 0.3, 0.1)])[0]["latent"]
    assert torch.equal(out, x - v * 0.1)
    # the image branch not computed (its context held gen's tokens): v_img stands for v
    vt = torch.randn(16, 16)
    out = f.run("step", [entry(x, v, vt, empty, 0.7, 0.1)])[0]["latent"]
    assert torch.allclose(out, x - official_velocity(v, vt, v, 4.0, 1.5, "global", 0.0) * 0.1)


def test_noise_follows_the_official_rng_order() -> None:
    f = node()
    a = f.run("noise", [{"height": 64, "width": 32, "seed": 7, "skip": 0}])[0]["latent"]
    g = torch.Generator().manual_seed(7)
    assert torch.equal(a, torch.randn(4 * 2, 16, generator=g))
    # the edit: the VAE posterior's eps came first from the same CPU generator
    b = f.run("noise", [{"height": 64, "width": 32, "seed": 7, "skip": 4 * 8 * 4}])[0]["latent"]
    g = torch.Generator().manual_seed(7)
    torch.randn(1, 4, 8, 4, generator=g)  # randn_like(mean) of a [1, z, H/8, W/8] posterior
    assert torch.equal(b, torch.randn(8, 16, generator=g))
    with pytest.raises(RequestError, match=r"height must be a multiple of 16 in 16\.\.64"):
        f.run("noise", [{"height": 72, "width": 32, "seed": 0, "skip": 0}])


def test_bad_inputs_name_the_port() -> None:
    f = node()
    x = torch.randn(16, 16)
    with pytest.raises(RequestError, match="cfg_renorm_type must be one of") as e:
        f.run("step", [entry(x, x, x, x, 0.5, 0.1, renorm="l2")])
    assert e.value.field == "cfg_renorm_type"
    with pytest.raises(RequestError, match="do not match the latent"):
        f.run("step", [entry(x, x[:3], x, x, 0.5, 0.1)])
    with pytest.raises(RequestError, match="t must be a finite number"):
        f.run("step", [entry(x, x, x, x, float("nan"), 0.1)])
