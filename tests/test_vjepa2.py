"""V-JEPA 2-AC at the tiny size on the CPU: the encoder against `transformers.VJEPA2Model`, the
KV-cached rollout (one trajectory through `attn.attend`, several as rows of one context) and
the CEM plan against the recompute-everything loop written from the official math
(`mstar_models.vjepa2.reference`), pose integration against scipy, the checkpoint converter
and loader, and a smoke run of the benchmark.

Tolerances: float32 everywhere; the two sides differ only in summation order (fused vs split
RoPE, paged vs dense attention), so 1e-5 absolute on O(1) layer-normed outputs. Weights are
random with std 0.2 (not the dummy 0.02) so that attention is far from uniform and a wrong
position, mask or row would show.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support import load_script

from mstar_models.vjepa2 import reference as ref
from mstar_models.vjepa2.encoder import IMAGENET_MEAN, IMAGENET_STD
from mstar_models.vjepa2.layers import apply_rope, rope_part_dim, rope_tables
from mstar_models.vjepa2.pose import compute_new_pose
from mstar_models.vjepa2.weights import hf_encoder_state_dict
from mstar_runtime.control.conductor import FAILED, FINISHED, Conductor
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker.worker import Worker
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
TOK, DIM = 4, 64  # tiny: 2 x 2 patches per frame, encoder dim 64
ATOL = 1e-5


def _compile(out: Path, weights: Path | None = None) -> Path:
    args = ["compile", str(ROOT / "models/vjepa2/vjepa2.walk"), "--variant", "tiny",
            "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(out)]
    assert mstarc(args + (["--weights", str(weights)] if weights else [])) == 0
    return out


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(tmp_path_factory.mktemp("vjepa2") / "v.plan")


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            gain = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05) + gain)


def _engine(plan_path: Path, kv_pages_cap: int | None = None) -> tuple[Conductor, Worker]:
    plan = load_plan(plan_path, device="cpu", kv_pages_cap=kv_pages_cap)
    worker = Worker(plan, 0, "cpu", "dummy")
    _randomize(worker.engines["encoder"].node, 1)
    _randomize(worker.engines["predictor"].node, 2)
    return Conductor(plan, {0: worker}), worker


def _reference(worker: Worker) -> ref.RefACPredictor:
    pred = ref.RefACPredictor(DIM, 64, 2, 2, 256, grid=2, max_steps=4)
    pred.load_state_dict(worker.engines["predictor"].node.state_dict())
    return pred.eval()


def _run(conductor: Conductor, *requests: tuple[str, dict[str, Any]]) -> list[Any]:
    handles = [conductor.submit(w, i) for w, i in requests]
    conductor.run_until_idle()
    return handles


def _tool(path: str) -> Callable[[list[str]], int]:
    """`main` of a script under tools/ (not a package on sys.path)."""
    return load_script(path).main


def _latents(g: torch.Generator, n: int) -> torch.Tensor:
    # the walk's latent ports are bf16: round once so both sides see the same values
    return F.layer_norm(torch.randn(n, TOK, DIM, generator=g), (DIM,)).bfloat16().float()


# ------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rope_equals_the_official_rotation(head_dim: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 10, head_dim, generator=g)  # [B, heads, N, D]
    pos = [torch.randint(0, 16, (10,), generator=g).float() for _ in range(3)]
    cos, sin = rope_tables(*pos, head_dim, torch.float32)
    ours = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    p = rope_part_dim(head_dim)
    parts = [ref.rotate_queries_or_keys(x[..., i * p : (i + 1) * p], pos[i]) for i in range(3)]
    torch.testing.assert_close(ours, torch.cat(parts + [x[..., 3 * p :]], dim=-1), atol=1e-6, rtol=0)


def test_pose_integration_equals_scipy() -> None:
    g = torch.Generator().manual_seed(0)
    pose = torch.randn(16, 1, 7, generator=g, dtype=torch.float64)
    pose[..., 6] = torch.rand(16, 1, generator=g, dtype=torch.float64)
    action = torch.randn(16, 1, 7, generator=g, dtype=torch.float64) * 0.5
    torch.testing.assert_close(compute_new_pose(pose, action), ref.compute_new_pose(pose, action),
                               atol=1e-9, rtol=0)


def test_encoder_equals_transformers(plan_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _, worker = _engine(plan_path)
    enc = worker.engines["encoder"].node
    cfg = transformers.VJEPA2Config(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=4.0,
                                    crop_size=32, frames_per_clip=4, tubelet_size=2, patch_size=16,
                                    pred_hidden_size=32, pred_num_hidden_layers=1, pred_num_attention_heads=2)
    hf = transformers.VJEPA2Model(cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_encoder_state_dict(enc.state_dict(), 2, DIM), strict=False)
    assert not unexpected and not [m for m in missing if m.startswith("encoder.")]
    # 4 frames = 2 tubelets, so the temporal RoPE part is exercised too
    video = torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf.get_vision_features(video)
        got = enc.forward_pixels(video.permute(0, 2, 1, 3, 4))
    assert want.std() > 0.5
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_encode_walk_resizes_normalises_and_batches(plan_path: Path) -> None:
    conductor, worker = _engine(plan_path)
    enc = worker.engines["encoder"].node
    g = torch.Generator().manual_seed(4)
    a = (torch.rand(3, 32, 32, 3, generator=g) * 255).to(torch.uint8)
    b = (torch.rand(2, 48, 40, 3, generator=g) * 255).to(torch.uint8)
    ha, hb = _run(conductor, ("encode", {"frames": a}), ("encode", {"frames": b}))
    assert ha.state == hb.state == FINISHED
    clip = ((a.permute(0, 3, 1, 2).float() / 255 - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
            / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
    with torch.no_grad():
        want = enc.forward_pixels(clip.unsqueeze(2).repeat(1, 1, 2, 1, 1))
    torch.testing.assert_close(ha.outputs["latents"], F.layer_norm(want, (DIM,)), atol=ATOL, rtol=0)
    z = hb.outputs["latents"]
    assert z.shape == (2, TOK, DIM)
    torch.testing.assert_close(z.mean(-1), torch.zeros(2, TOK), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ rollout
@pytest.mark.parametrize("context,horizon", [(1, 3), (2, 2)])
def test_single_trajectory_rollout_equals_recompute(plan_path: Path, context: int, horizon: int) -> None:
    conductor, worker = _engine(plan_path)
    g = torch.Generator().manual_seed(5)
    ctx, states = _latents(g, context), torch.rand(context, 7, generator=g)
    actions = torch.randn(1, context - 1 + horizon, 7, generator=g) * 0.3
    (h,) = _run(conductor, ("rollout", {"context": ctx, "states": states, "actions": actions, "horizon": horizon}))
    assert h.state == FINISHED, h.error
    want, _ = ref.rollout(_reference(worker), ctx, states, actions, horizon)
    got = h.outputs["predicted"].view(horizon, 1, TOK, DIM).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert worker.engines["predictor"].num_states == 0  # freed with the request


def test_rows_share_the_history_and_equal_recompute(plan_path: Path) -> None:
    """B trajectories as rows of one KV context (per-row attention), batched with a second
    request in the same steps; each row equals its own recompute-everything rollout."""
    conductor, worker = _engine(plan_path)
    pred = _reference(worker)
    g = torch.Generator().manual_seed(6)
    ctx, states = _latents(g, 2), torch.rand(2, 7, generator=g)
    hist = torch.randn(1, 1, 7, generator=g).expand(3, -1, -1)
    rows = torch.cat([hist, torch.randn(3, 2, 7, generator=g)], dim=1) * 0.3
    single = torch.randn(1, 3, 7, generator=g) * 0.3
    h3, h1 = _run(conductor, ("rollout", {"context": ctx, "states": states, "actions": rows, "horizon": 2}),
                  ("rollout", {"context": ctx, "states": states, "actions": single, "horizon": 2}))
    assert h3.state == h1.state == FINISHED, (h3.error, h1.error)
    assert conductor.stats["batched_entries"] > conductor.stats["steps"]  # the two shared steps
    for h, acts in ((h3, rows), (h1, single)):
        want, _ = ref.rollout(pred, ctx, states, acts, 2)
        got = h.outputs["predicted"].view(2, acts.shape[0], TOK, DIM).transpose(0, 1)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_rollout_rejects_bad_requests(plan_path: Path) -> None:
    conductor, _ = _engine(plan_path)
    g = torch.Generator().manual_seed(7)
    ctx, states = _latents(g, 2), torch.rand(2, 7, generator=g)
    diverging = torch.randn(2, 3, 7, generator=g)  # rows disagree on the shared history action
    too_long = _latents(g, 5)  # 5 context frames > the tiny predictor's 4 steps
    short = torch.randn(1, 1, 7, generator=g)  # horizon 2 needs actions[:, 2]
    handles = _run(conductor,
                   ("rollout", {"context": ctx, "states": states, "actions": diverging, "horizon": 1}),
                   ("rollout", {"context": too_long, "states": torch.rand(5, 7), "actions": diverging}),
                   ("rollout", {"context": ctx, "states": states, "actions": short, "horizon": 2}))
    assert [h.state for h in handles] == [FAILED] * 3
    assert "history" in handles[0].error and "1 to 4 frames" in handles[1].error
    assert "actions[:, 1]" in handles[2].error


# ------------------------------------------------------------------------------ plan
def _plan_inputs(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(8)
    img = (torch.rand(1, 32, 32, 3, generator=g) * 255).to(torch.uint8)
    goal = (torch.rand(1, 32, 32, 3, generator=g) * 255).to(torch.uint8)
    return {"frame": img, "goal": goal, "state": torch.rand(1, 7, generator=g), "rollout": 3, "seed": seed,
            "maxnorm": 0.3}


def test_plan_equals_recompute_cem_and_is_deterministic(plan_path: Path) -> None:
    conductor, worker = _engine(plan_path)
    a, b, c = _run(conductor, ("plan", _plan_inputs(0)), ("plan", _plan_inputs(0)), ("plan", _plan_inputs(1)))
    assert a.state == b.state == c.state == FINISHED, (a.error, b.error, c.error)
    assert torch.equal(a.outputs["trajectory"], b.outputs["trajectory"])  # same seed, batched together
    assert not torch.equal(a.outputs["trajectory"], c.outputs["trajectory"])
    torch.testing.assert_close(a.outputs["action"], a.outputs["trajectory"][0])
    inputs = _plan_inputs(0)
    enc = worker.engines["encoder"].node
    with torch.no_grad():
        z, z_goal = enc.encode_frames(inputs["frame"]), enc.encode_frames(inputs["goal"])
    cfg = worker.plan.config
    want = ref.cem(_reference(worker), z, inputs["state"], z_goal, rollout=3, samples=cfg["wm_samples"],
                   topk=cfg["wm_topk"], cem_steps=cfg["wm_cem_steps"], momentum_mean=cfg["wm_momentum_mean"],
                   momentum_std=cfg["wm_momentum_std"], momentum_mean_gripper=cfg["wm_momentum_mean_gripper"],
                   momentum_std_gripper=cfg["wm_momentum_std_gripper"], maxnorm=0.3, seed=0)
    torch.testing.assert_close(a.outputs["trajectory"], want, atol=ATOL, rtol=0)


def test_plan_frees_each_cem_iterations_rollout(plan_path: Path) -> None:
    """One CEM iteration holds rollout x samples x 6 tokens = 3 x 8 x 6 = 144 (9 pages of 16);
    12 pages fit one iteration but not two: the fork of @blank over @main must free them."""
    conductor, worker = _engine(plan_path, kv_pages_cap=12)
    (h,) = _run(conductor, ("plan", {**_plan_inputs(0), "cem_steps": 4}))
    assert h.state == FINISHED, h.error
    assert conductor.stats["preemptions"] == 0
    assert conductor.kv.used_pages() == 0


# ------------------------------------------------------------------------------ weights, bench
def test_converted_official_checkpoint_loads(plan_path: Path, tmp_path: Path) -> None:
    convert = _tool("tools/convert_vjepa2.py")
    _, worker = _engine(plan_path)
    enc, pred = worker.engines["encoder"].node, worker.engines["predictor"].node
    official = {"encoder": {f"module.backbone.{k}": v for k, v in enc.state_dict().items()},
                "predictor": {f"module.{k}": v for k, v in pred.state_dict().items()}, "epoch": 3}
    official["encoder"]["module.backbone.pos_embed"] = torch.zeros(1, 4, DIM)  # stale, dropped
    torch.save(official, tmp_path / "vjepa2-ac-tiny.pt")
    assert convert([str(tmp_path / "vjepa2-ac-tiny.pt"), str(tmp_path / "w")]) == 0
    plan = load_plan(_compile(tmp_path / "w.plan", tmp_path / "w"), device="cpu")
    loaded = Worker(plan, 0, "cpu", tmp_path / "w")
    for name in ("encoder", "predictor"):
        want = worker.engines[name].node.state_dict()
        for k, v in loaded.engines[name].node.state_dict().items():
            assert torch.equal(v, want[k]), (name, k)


@pytest.mark.parametrize(("content", "says"), [(b"junk\n", "is not a checkpoint torch.load reads"),
                                               (None, "holds a list, not a dict with 'encoder'")],
                         ids=["junk", "a-list"])
def test_the_converter_names_a_file_that_is_no_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          content: bytes | None, says: str) -> None:
    """Was a traceback (the unpickler's KeyError, an AttributeError on a list)."""
    convert = _tool("tools/convert_vjepa2.py")
    path = tmp_path / "x.pt"
    if content is None:
        torch.save([torch.zeros(1)], path)
    else:
        path.write_bytes(content)
    assert convert([str(path), str(tmp_path / "w")]) == 1
    assert f"convert_vjepa2: '{path}' {says}" in capsys.readouterr().err


def test_bench_smoke(tmp_path: Path) -> None:
    bench = _tool("tools/bench/vjepa2.py")
    out = tmp_path / "bench.json"
    assert bench(["--device", "cpu", "--variant", "tiny", "--horizons", "1", "2", "--repeats", "1",
                  "--warmup", "0", "--plan-repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["horizon"] for r in report["rollout"]] == [1, 2]
    for r in report["rollout"]:
        assert r["max_abs_diff"] < 1e-4 and r["mstar_ms"] > 0 and r["predicted_ratio"] >= 1.0
    assert report["plan"]["trajectory_max_abs_diff"] < 1e-4


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_real_size_bf16_parity(tmp_path: Path) -> None:
    """Real sizes, bf16 on one GPU, dummy weights: the encoder against HF in float32 and the
    cached rollout against the recompute loop in bf16. bf16 rounds each of ~40 residual
    updates at 2^-8, so the check is relative: ours must be as close to the float32 truth as
    HF's own bf16 run is (encoder), and within 5% relative L2 of the bf16 recompute loop."""
    transformers = pytest.importorskip("transformers")
    assert torch.cuda.is_available()
    args = ["compile", str(ROOT / "models/vjepa2/vjepa2.walk"), "--variant", "real",
            "-p", str(ROOT / "placements/h200x1.yaml"), "-o", str(tmp_path / "v.plan")]
    assert mstarc(args) == 0
    plan = load_plan(tmp_path / "v.plan", device="cuda")
    worker = Worker(plan, 0, "cuda", "dummy")
    conductor = Conductor(plan, {0: worker})
    enc, node = worker.engines["encoder"].node, worker.engines["predictor"].node

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    cfg = transformers.VJEPA2Config(hidden_size=1408, num_hidden_layers=40, num_attention_heads=22,
                                    mlp_ratio=48 / 11, crop_size=256, frames_per_clip=64, tubelet_size=2,
                                    patch_size=16)
    hf = transformers.VJEPA2Model(cfg).eval()
    hf.load_state_dict(hf_encoder_state_dict({k: v.float().cpu() for k, v in enc.state_dict().items()}, 40, 1408),
                       strict=False)
    video = torch.randn(1, 2, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = hf.cuda().get_vision_features(video.cuda())
        hf_bf16 = hf.to(torch.bfloat16).get_vision_features(video.cuda().bfloat16())
        ours = enc.forward_pixels(video.cuda().permute(0, 2, 1, 3, 4))
    assert rel(ours, truth) <= max(1.5 * rel(hf_bf16, truth), 1e-2)
    del hf

    g = torch.Generator().manual_seed(1)
    ctx = F.layer_norm(torch.randn(2, 256, 1408, generator=g), (1408,)).bfloat16().cuda()
    states = torch.rand(2, 7, generator=g).cuda()
    for rows in (1, 4):
        hist = torch.randn(1, 1, 7, generator=g).expand(rows, -1, -1)
        actions = (torch.cat([hist, torch.randn(rows, 4, 7, generator=g)], dim=1) * 0.05).cuda()
        h = conductor.submit("rollout", {"context": ctx, "states": states, "actions": actions, "horizon": 4})
        conductor.run_until_idle()
        assert h.state == FINISHED, h.error
        pred = ref.RefACPredictor(1408, 1024, 24, 16, 4096, grid=16, max_steps=32)
        pred.load_state_dict(node.state_dict())
        want, _ = ref.rollout(pred.cuda().bfloat16().eval(), ctx, states, actions, 4)
        got = h.outputs["predicted"].view(4, rows, 256, 1408).transpose(0, 1)
        assert rel(got, want) < 0.05
