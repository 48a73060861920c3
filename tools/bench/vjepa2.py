"""V-JEPA 2-AC planning rollout: M* (KV-cached, through the runtime) vs the recompute-everything loop.

    python tools/bench/vjepa2.py --out bench-vjepa2.json                        # H200, real size
    python tools/bench/vjepa2.py --device cpu --variant tiny --horizons 1 2 --out /tmp/v.json

One process, one device, the same (dummy or converted) weights for both sides:
- rollout latency at each horizon H (p50 over `--repeats` runs after a warm-up): a `rollout`
  request of `--context` latent frames and `--rows` trajectories through the conductor (M*),
  against `reference.rollout`, which re-runs the whole predictor over all T + h blocks at
  every step h, as the official `WorldModel.step_predictor` does. Outputs are compared too;
- one whole `plan` call (encode the current and goal images, CEM) with the walk's defaults
  for the variant, against the encoder module plus `reference.cem` (recompute rollouts);
- `encode` of 8 frames (the encoder alone; no baseline: same module either way).
Prints each ratio next to the cost model's prediction and writes the figures as JSON. Also:
- the whole plan against its compute floor: the predictor FLOPs the plan needs (2 x params x
  tokens processed, plus 4 x dim x layers x queries x keys of attention; the two encoder
  images are left out, ~0.1 % of it) over the bf16 matmul peak measured in the same run
  (`measure_bf16_peak`), and M*'s time as a multiple of that floor;
- one request of the issue's target: encode 8 frames + the H = 30 single-trajectory rollout
  (the sum of the two measured latencies; target < 100 ms);
- whether the rollout step replayed CUDA graphs and the CEM's rows ran on FlashInfer.

Cost model (per trajectory, P = 2 + tokens_per_frame = 258 tokens per step, T context frames):
  recompute: sum_{h<H} forward over (T+h)*P tokens          -> O(H^2) token-FLOPs, O(H^3) attention
  cached:    (T-1)*P history once + H new blocks of P tokens -> O(H) token-FLOPs, attention of
             each new block over the growing cache, sum_h P*(T+h)*P -> O(H^2)
FLOPs per token = 2 * (weights touched per token) + 4 * dim * keys per layer (QK^T and PV).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_bf16_peak  # noqa: E402 - the sibling module, found through the line above

WALK = ROOT / "models/vjepa2/vjepa2.walk"


# ---------------------------------------------------------------------------- set-up
def compile_plan(variant: str, device: str, out: Path, weights: str) -> Path:
    from mstarc.cli import main as mstarc

    placement = ROOT / ("placements/cpu.yaml" if device == "cpu" else "placements/h200x1.yaml")
    args = ["compile", str(WALK), "--variant", variant, "-p", str(placement), "-o", str(out)]
    if weights != "dummy":
        args += ["--weights", weights]
    if mstarc(args) != 0:
        raise SystemExit("compile failed")
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def p50(fn: Callable[[], Any], repeats: int, warmup: int, device: str) -> tuple[float, Any]:
    """Median wall seconds of `fn` (device-synchronised) and its last result."""
    result = None
    for _ in range(warmup):
        result = fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def plan_flops(cfg: dict[str, Any], params: int, samples: int, horizon: int, cem_steps: int, context: int = 1
               ) -> dict[str, float]:
    """Predictor FLOPs of a whole CEM plan: every iteration rolls `samples` rows out `horizon`
    steps from `context` frames (the history once per iteration, shared by the rows)."""
    d, depth = cfg["pred_dim"], cfg["pred_depth"]
    per = 2 + cfg["tokens_per_frame"]
    hist = (context - 1) * per
    tokens = hist + samples * horizon * per  # per iteration
    # history block i sees blocks 0..i; a row's block at step h sees the history and its h + 1 blocks
    attn = sum(4.0 * d * depth * per * (i + 1) * per for i in range(context - 1))
    attn += sum(4.0 * d * depth * samples * per * (hist + (h + 1) * per) for h in range(horizon))
    dense = 2.0 * params * tokens
    return {"plan_tokens": float(tokens * cem_steps), "plan_dense_flops": dense * cem_steps,
            "plan_attention_flops": attn * cem_steps, "plan_flops": (dense + attn) * cem_steps}


# ---------------------------------------------------------------------------- cost model
def cost_model(cfg: dict[str, Any], context: int, horizon: int, rows: int) -> dict[str, float]:
    d, mlp, depth, e = cfg["pred_dim"], cfg["pred_mlp"], cfg["pred_depth"], cfg["enc_dim"]
    per = 2 + cfg["tokens_per_frame"]
    weights_per_token = depth * (4 * d * d + 2 * d * mlp) + d * e * 2  # blocks + embed/proj
    dense = 2.0 * weights_per_token

    def attn(queries: int, keys: int) -> float:
        return 4.0 * d * depth * queries * keys

    recompute = 0.0
    for h in range(horizon):
        n = context + h  # blocks in the sequence at step h; block i sees blocks 0..i
        recompute += dense * n * per + sum(attn(per, (i + 1) * per) for i in range(n))
    cached = dense * (context - 1) * per + sum(attn(per, (i + 1) * per) for i in range(context - 1))
    for h in range(horizon):
        cached += dense * per + attn(per, (context + h) * per)
    tokens_recompute = sum((context + h) * per for h in range(horizon))
    tokens_cached = (context - 1 + horizon) * per
    return {"flops_recompute": recompute * rows, "flops_cached": cached * rows,
            "tokens_recompute": tokens_recompute * rows, "tokens_cached": tokens_cached * rows,
            "predicted_ratio": recompute / cached}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default="real", choices=["real", "tiny"])
    ap.add_argument("--weights", default="dummy", help="'dummy' or a folder from tools/convert_vjepa2.py")
    ap.add_argument("--horizons", type=int, nargs="+", default=[1, 5, 10, 20, 30])
    ap.add_argument("--context", type=int, default=1, help="context frames T (the MPC setting: 1)")
    ap.add_argument("--rows", type=int, default=1, help="trajectories per rollout request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--plan-repeats", type=int, default=3)
    ap.add_argument("--no-plan", action="store_true", help="skip the whole-plan comparison")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the figures")
    args = ap.parse_args(argv)

    from mstar_models.vjepa2 import reference as ref
    from mstar_runtime.control.conductor import FINISHED, Conductor
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    dev = args.device
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        plan = load_plan(compile_plan(args.variant, "cpu" if dev == "cpu" else "cuda", Path(tmp) / "v.plan",
                                      args.weights), device=dev)
    cfg = {k: v for k, v in plan.config.items()}
    worker = Worker(plan, 0, dev, args.weights)
    conductor = Conductor(plan, {0: worker})
    node = worker.engines["predictor"].node
    encoder = worker.engines["encoder"].node
    dtype = node.predictor_embed.weight.dtype
    grid = int(cfg["img"]) // int(cfg["patch"])
    pred = ref.RefACPredictor(int(cfg["enc_dim"]), int(cfg["pred_dim"]), int(cfg["pred_depth"]),
                              int(cfg["pred_heads"]), int(cfg["pred_mlp"]), grid, int(cfg["max_steps"]))
    pred.load_state_dict(node.state_dict())
    pred = pred.to(device=dev, dtype=dtype).eval()

    def run(walk: str, inputs: dict[str, Any]) -> dict[str, Any]:
        h = conductor.submit(walk, inputs)
        conductor.run_until_idle()
        if h.state != FINISHED:
            raise SystemExit(f"{walk} failed: {h.error}")
        return h.outputs

    g = torch.Generator().manual_seed(0)
    n_tok, e_dim, t_ctx = int(cfg["tokens_per_frame"]), int(cfg["enc_dim"]), args.context
    # the rollout walk's `context` port is bf16 (its wire dtype): round it once for both sides
    context = F.layer_norm(torch.randn(t_ctx, n_tok, e_dim, generator=g), (e_dim,)).bfloat16().to(dev, dtype)
    states = torch.rand(t_ctx, 7, generator=g).to(dev)
    max_h = int(cfg["max_steps"]) - t_ctx
    horizons = [h for h in args.horizons if 1 <= h <= max_h]
    skipped = [h for h in args.horizons if h not in horizons]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
                              "variant": args.variant, "dtype": str(dtype).removeprefix("torch."),
                              "weights": args.weights, "context": t_ctx, "rows": args.rows,
                              "repeats": args.repeats, "rollout": [], "skipped_horizons": skipped}
    print(f"V-JEPA 2-AC rollout on {report['device']} ({args.variant}, {report['dtype']}), "
          f"T={t_ctx} context frame(s), {args.rows} trajector(ies)")
    if skipped:
        print(f"  horizons {skipped} skipped: context + horizon must be <= {cfg['max_steps']} steps")
    print(f"  {'H':>3} {'M* ms':>10} {'recompute ms':>13} {'ratio':>7} {'model':>7} {'max|diff|':>10} {'rel L2':>9}")
    for horizon in horizons:
        hist = torch.randn(1, t_ctx - 1, 7, generator=g).expand(args.rows, -1, -1)
        actions = torch.cat([hist, torch.randn(args.rows, horizon, 7, generator=g)], dim=1).mul(0.05).to(dev)
        inputs = {"context": context, "states": states, "actions": actions, "horizon": horizon}
        t_m, out = p50(lambda inputs=inputs: run("rollout", inputs), args.repeats, args.warmup, dev)
        t_r, (r_frames, _) = p50(lambda a=actions, h=horizon: ref.rollout(pred, context, states, a, h),
                                 args.repeats, args.warmup, dev)
        ours = out["predicted"].view(horizon, args.rows, n_tok, e_dim).transpose(0, 1).float()
        diff = (ours - r_frames.float()).abs().max().item()
        rel = ((ours - r_frames.float()).norm() / r_frames.float().norm()).item()
        model = cost_model(cfg, t_ctx, horizon, args.rows)
        row = {"horizon": horizon, "mstar_ms": t_m * 1e3, "recompute_ms": t_r * 1e3, "ratio": t_r / t_m,
               "max_abs_diff": diff, "rel_l2_diff": rel, **model}
        report["rollout"].append(row)
        print(f"  {horizon:>3} {t_m * 1e3:>10.2f} {t_r * 1e3:>13.2f} {t_r / t_m:>6.2f}x "
              f"{model['predicted_ratio']:>6.2f}x {diff:>10.2e} {rel:>9.2e}")

    frames8 = (torch.rand(8, int(cfg["img"]), int(cfg["img"]), 3, generator=g) * 255).to(torch.uint8)
    t_enc, _ = p50(lambda: run("encode", {"frames": frames8}), args.repeats, args.warmup, dev)
    report["encode_8_frames_ms"] = t_enc * 1e3
    print(f"  encode 8 frames: {t_enc * 1e3:.2f} ms")
    h30 = next((r for r in report["rollout"] if r["horizon"] == 30), None)
    if h30 is not None and args.rows == 1:
        request = t_enc * 1e3 + h30["mstar_ms"]
        report["request_encode8_rollout30_ms"] = request
        print(f"  one request (encode 8 frames + H=30 rollout, sum of the two): {request:.1f} ms "
              f"(target < 100 ms: {'met' if request < 100 else 'missed'})")
    report["step_graphs"] = graph_stats(worker)
    print(f"  predictor.step CUDA graphs: {report['step_graphs']}")

    if not args.no_plan:
        report["plan"] = bench_plan(args, cfg, run, encoder, pred, ref, dev, g)
        params = sum(p.numel() for name, p in node.named_parameters() if not name.startswith("extrinsics_encoder"))
        k = report["plan"]
        floor = plan_flops(cfg, params, k["samples"], k["rollout"], k["cem_steps"], context=1)
        peak = measure_bf16_peak(dev)
        floor_ms = floor["plan_flops"] / peak * 1e3
        k.update(floor, predictor_params=params, bf16_peak_flops=peak, compute_floor_ms=floor_ms,
                 floor_ratio=k["mstar_ms"] / floor_ms, row_attention=row_stats(worker))
        print(f"  plan compute floor: {_si(floor['plan_flops'])}FLOP of predictor work "
              f"(2 x {_si(params)} params x {_si(floor['plan_tokens'])} tokens "
              f"+ {_si(floor['plan_attention_flops'])}FLOP attention) at the measured bf16 peak "
              f"{_si(peak)}FLOP/s = {floor_ms:.1f} ms; M* {k['mstar_ms']:.1f} ms = "
              f"{k['floor_ratio']:.2f}x the floor")
        print(f"  CEM rows' attention: {k['row_attention']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def bench_plan(args: argparse.Namespace, cfg: dict[str, Any], run: Callable[..., dict[str, Any]], encoder: Any,
               pred: Any, ref: Any, dev: str, g: torch.Generator) -> dict[str, Any]:
    """One `plan` call with the variant's CEM defaults: M* walk vs encoder + recompute CEM."""
    img = int(cfg["img"])
    frame = (torch.rand(1, img, img, 3, generator=g) * 255).to(torch.uint8)
    goal = (torch.rand(1, img, img, 3, generator=g) * 255).to(torch.uint8)
    state = torch.rand(1, 7, generator=g)
    knobs = {"rollout": int(cfg["wm_rollout"]), "samples": int(cfg["wm_samples"]), "topk": int(cfg["wm_topk"]),
             "cem_steps": int(cfg["wm_cem_steps"]), "momentum_mean": float(cfg["wm_momentum_mean"]),
             "momentum_std": float(cfg["wm_momentum_std"]),
             "momentum_mean_gripper": float(cfg["wm_momentum_mean_gripper"]),
             "momentum_std_gripper": float(cfg["wm_momentum_std_gripper"]), "maxnorm": float(cfg["wm_maxnorm"])}
    inputs = {"frame": frame, "goal": goal, "state": state, **knobs, "seed": 0}

    def baseline() -> torch.Tensor:
        with torch.inference_mode():
            z = encoder.encode_frames(frame)
            z_goal = encoder.encode_frames(goal)
            return ref.cem(pred, z, state.to(dev), z_goal, seed=0, **knobs)

    t_m, out = p50(lambda: run("plan", inputs), args.plan_repeats, args.warmup, dev)
    t_r, traj = p50(baseline, args.plan_repeats, args.warmup, dev)
    diff = (out["trajectory"].float().cpu() - traj.float().cpu()).abs().max().item()
    res = {**knobs, "mstar_ms": t_m * 1e3, "recompute_ms": t_r * 1e3, "ratio": t_r / t_m,
           "trajectory_max_abs_diff": diff,
           **cost_model(cfg, 1, knobs["rollout"], knobs["samples"] * knobs["cem_steps"])}
    print(f"  plan (S={knobs['samples']}, H={knobs['rollout']}, {knobs['cem_steps']} CEM steps): "
          f"M* {t_m * 1e3:.1f} ms, recompute {t_r * 1e3:.1f} ms, {t_r / t_m:.2f}x "
          f"(model {res['predicted_ratio']:.2f}x for the predictor), trajectory max|diff| {diff:.2e}")
    return res


def _si(x: float) -> str:
    """1.34e15 -> '1.34 P' (the unit follows)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.3g} "


def graph_stats(worker: Any) -> dict[str, Any]:
    """The predictor step's GraphRunner: buckets, replays, whether capture failed (none off a GPU)."""
    runner = worker.engines["predictor"].graph_runners.get("step")
    if runner is None:
        return {"graphed": False}
    return {"graphed": runner.capture, "tokens_per_entry": runner.tokens, "buckets": runner.buckets,
            "replays": runner.replays, "failed": runner.failed}


def row_stats(worker: Any) -> dict[str, Any]:
    """Which kernel served the CEM's per-row attention (FlashInfer plans made, or the reference)."""
    node = worker.engines["predictor"].node
    kernels = [k for k in getattr(node, "_row_kernels", {}).values() if k is not None]
    if not kernels:
        return {"kernel": "reference"}
    return {"kernel": "flashinfer", "plans": sum(getattr(k, "plans", 0) for k in kernels)}


if __name__ == "__main__":
    sys.exit(main())
