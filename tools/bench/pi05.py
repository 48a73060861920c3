"""π0.5 action chunks: M* (prefix once into a KV context, 10 expert steps reading it) against its floor and the reference.

    python tools/bench/pi05.py --out bench-pi05.json                                    # one H200, real size
    python tools/bench/pi05.py --device cpu --variant tiny --batches 2 --repeats 2 --out /tmp/p.json   # smoke

One process, one device, random (`dummy`) weights at the variant's size, every request
with 3 cameras and a prompt of `--prompt-tokens` tokens (the instruction is sized so that
the walk's prompt, instruction and discretised state, is that long; the byte tokenizer,
since no PaliGemma tokenizer.json comes with dummy weights):

- B = 1: latency per action chunk, p50 (and p90) over `--repeats` `act` requests after a
  warm-up, each run alone through the conductor;
- B = 8 / 32 / 128 (`--batches`): B requests submitted together, chunks/s = B / wall time,
  the best of `--repeats` runs, and the fraction of the compute floor that is;
- the floor, computed in the run: FLOPs of the prefix (vision tower over 3 x 256 patches,
  the VLM over the ~968-token prefix) and of 10 expert steps over 50 tokens (2 x weights per
  token plus 4 x width x keys of attention per layer), over the bf16 matmul peak measured
  now; against the weight bytes (the vision tower and VLM once, the expert once per step:
  its 0.8 GB stays in no cache between steps) over the read bandwidth measured now. The
  floor of a batch is the larger of the two; chunks/s at the floor is B / that;
- the reference: `PI05Reference.sample_actions` (tests/pi05_reference.py: LeRobot's
  PI05Pytorch assembled from transformers, since LeRobot's own file needs openpi's
  transformers fork) in LeRobot's bfloat16 setting, on the same weights and inputs,
  eagerly and (`--compile-reference`) under torch.compile(mode="max-autotune") as LeRobot's
  `compile_model` does; its chunk is compared with ours.

Writes the figures as JSON and prints a table. `--budget` seconds bounds the optional parts.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.pi05_reference: the parity reference the tests use
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from common import (  # noqa: E402
    Budget,
    compile_and_load,
    environment,
    measure_bf16_peak,
    measure_read_bandwidth,
    percentile,
    reference_parser,
    table,
    write_json,
)

WALK = ROOT / "models/pi05/pi05.walk"


def floor_model(cfg: dict[str, Any], params: dict[str, int], prompt: int, cameras: int) -> dict[str, float]:
    """FLOPs and weight bytes of one chunk (see the module docstring)."""
    patches = int(cfg["image_tokens"])
    prefix = cameras * patches + prompt
    steps, horizon = int(cfg["flow_steps"]), int(cfg["horizon"])
    qk = int(cfg["heads"]) * int(cfg["head_dim"])
    vocab_rows = int(cfg["vocab"]) * int(cfg["width"])  # the embedding table is a lookup, not a matmul
    vis_attn = 4 * int(cfg["vis_hidden"]) * int(cfg["vis_layers"]) * patches * patches * cameras
    vision = 2 * params["vision"] * patches * cameras + vis_attn
    vlm = 2 * (params["vlm"] - vocab_rows) * prefix + 4 * qk * int(cfg["layers"]) * prefix * prefix
    expert_step = 2 * params["expert"] * horizon + 4 * qk * int(cfg["layers"]) * horizon * (prefix + horizon)
    wbytes = 2 * (params["vision"] + params["vlm"] - vocab_rows) + 2 * params["expert"] * steps
    return {"prefix_tokens": prefix, "flops_vision": vision, "flops_vlm": vlm, "flops_expert": steps * expert_step,
            "flops": vision + vlm + steps * expert_step, "weight_bytes": wbytes}


def main(argv: list[str] | None = None) -> int:
    ap = reference_parser(__doc__.split("\n")[0], [8, 32, 128], "also time the reference under torch.compile",
                          lambda ap: ap.add_argument("--prompt-tokens", type=int, default=200))
    args = ap.parse_args(argv)

    from mstar_models.pi05.prompt import prompt_text
    from mstar_runtime.control.conductor import FINISHED, Conductor
    from mstar_runtime.worker.worker import Worker
    from tests.pi05_reference import REAL, TINY, PI05Reference, checkpoint_tensors, pixels

    budget = Budget(args.budget)
    dev = args.device
    plan = compile_and_load(WALK, args.variant, dev)
    cfg = dict(plan.config)
    worker = Worker(plan, 0, dev, "dummy")
    conductor = Conductor(plan, {0: worker})
    nodes = {n: worker.engines[n].node for n in ("vision", "vlm", "expert")}
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in nodes.items()}
    cameras, img = int(cfg["cameras"]), int(cfg["img"])

    g = torch.Generator().manual_seed(0)
    state = torch.rand(int(cfg["action_dim"]), generator=g) * 2 - 1
    base = len(prompt_text("", state.numpy())) + 1  # + BOS: the byte tokenizer's length of an empty task
    if args.prompt_tokens - base < 1 or args.prompt_tokens > int(cfg["max_prompt"]):
        raise SystemExit(f"--prompt-tokens must lie in [{base + 1}, {cfg['max_prompt']}]")
    instruction = ("pick up the red block and put it in the bowl " * 20)[: args.prompt_tokens - base].strip()
    instruction += "x" * (args.prompt_tokens - base - len(instruction))

    def request(i: int) -> dict[str, Any]:
        gi = torch.Generator().manual_seed(100 + i)
        return {"images": torch.randint(0, 256, (cameras, img, img, 3), generator=gi, dtype=torch.uint8),
                "instruction": instruction, "state": state,
                "noise": torch.randn(int(cfg["horizon"]), int(cfg["action_dim"]), generator=gi)}

    def run(batch: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
        torch.cuda.synchronize() if dev.startswith("cuda") else None
        t0 = time.perf_counter()
        hs = [conductor.submit("act_noise", r) for r in batch]
        conductor.run_until_idle()
        torch.cuda.synchronize() if dev.startswith("cuda") else None
        dt = time.perf_counter() - t0
        for h in hs:
            if h.state != FINISHED:
                raise SystemExit(f"act_noise failed: {h.error}")
        return [h.outputs for h in hs], dt

    peak = measure_bf16_peak(dev)
    bandwidth = measure_read_bandwidth(dev)
    fm = floor_model(cfg, params, args.prompt_tokens, cameras)
    report: dict[str, Any] = {"env": environment(dev), "variant": args.variant, "params": params,
                              "bf16_peak_tflops": peak / 1e12, "read_bandwidth_tbs": bandwidth / 1e12, "floor": fm}

    run([request(0)])  # warm-up
    lat = [run([request(0)])[1] for _ in range(args.repeats)]
    ours0 = run([request(0)])[0][0]["actions"]
    floor1 = max(fm["flops"] / peak, fm["weight_bytes"] / bandwidth)
    report["b1"] = {"p50_ms": 1e3 * percentile(lat, 50), "p90_ms": 1e3 * percentile(lat, 90),
                    "floor_ms": 1e3 * floor1, "compute_floor_ms": 1e3 * fm["flops"] / peak,
                    "bytes_floor_ms": 1e3 * fm["weight_bytes"] / bandwidth}
    report["b1"]["x_floor"] = report["b1"]["p50_ms"] / report["b1"]["floor_ms"]

    rows = []
    for b in args.batches:
        batch = [request(i) for i in range(b)]
        run(batch)  # warm-up at this size
        best = min(run(batch)[1] for _ in range(max(1, min(args.repeats, 3))))
        compute = b * fm["flops"] / peak
        floor_b = max(compute, fm["weight_bytes"] / bandwidth)
        rows.append({"batch": b, "chunks_per_s": b / best, "ms": 1e3 * best, "floor_ms": 1e3 * floor_b,
                     "compute_floor_ms": 1e3 * compute, "x_compute_floor": best / compute})
    report["throughput"] = rows

    if not args.no_reference and budget.allows(120):
        sizes = REAL if args.variant == "real" else TINY
        with torch.device(dev):  # not meta + to_empty: that would leave the rotary and position buffers empty
            ref = PI05Reference(sizes).eval()
        ref.load_checkpoint_(checkpoint_tensors(*nodes.values()))
        ref.to_lerobot_bf16_()
        r = request(0)
        d = torch.device(dev)
        cams = [pixels(r["images"][i : i + 1]).to(d) for i in range(cameras)]
        masks = [torch.ones(1, dtype=torch.bool, device=d) for _ in cams]
        ids = [2] + [3 + c for c in prompt_text(instruction, state.numpy()).encode()]
        tokens = torch.tensor([ids], device=d)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        noise = r["noise"][None].to(d)

        def reference() -> torch.Tensor:
            return ref.sample_actions(cams, masks, tokens, mask, noise)

        def timed_ref(fn: Any) -> list[float]:
            fn()
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize() if dev.startswith("cuda") else None
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize() if dev.startswith("cuda") else None
                times.append(time.perf_counter() - t0)
            return times

        want = reference()[0].float().cpu()
        eager = timed_ref(reference)
        report["reference"] = {"eager_p50_ms": 1e3 * percentile(eager, 50),
                               "speedup_eager": percentile(eager, 50) / percentile(lat, 50),
                               "chunk_rel_l2_vs_ours": float((ours0.float().cpu() - want).norm() / want.norm())}
        if args.compile_reference and budget.allows(600):
            torch.set_float32_matmul_precision("high")
            compiled = torch.compile(copy.copy(ref).sample_actions, mode="max-autotune")
            times = timed_ref(lambda: compiled(cams, masks, tokens, mask, noise))
            report["reference"]["compiled_p50_ms"] = 1e3 * percentile(times, 50)
            report["reference"]["speedup_compiled"] = percentile(times, 50) / percentile(lat, 50)

    write_json(args.out, report)
    b1 = report["b1"]
    print(f"pi05 {args.variant} on {dev}: peak {peak / 1e12:.0f} TFLOP/s, read {bandwidth / 1e12:.2f} TB/s; "
          f"{fm['prefix_tokens']}-token prefix, {fm['flops'] / 1e12:.2f} TFLOP and {fm['weight_bytes'] / 1e9:.2f} GB "
          "per chunk")
    print(f"B=1: p50 {b1['p50_ms']:.1f} ms (p90 {b1['p90_ms']:.1f}), floor {b1['floor_ms']:.1f} ms "
          f"(compute {b1['compute_floor_ms']:.1f}, bytes {b1['bytes_floor_ms']:.1f}): {b1['x_floor']:.2f}x")
    if rows:
        print(table(rows, [("batch", "B", 0), ("chunks_per_s", "chunks/s", 1), ("ms", "ms", 1),
                           ("compute_floor_ms", "compute floor ms", 1), ("x_compute_floor", "x floor", 2)]))
    if "reference" in report:
        print("reference (LeRobot's PI05Pytorch as assembled in tests/pi05_reference.py, bf16):",
              {k: round(v, 4) if isinstance(v, float) and not math.isnan(v) else v
               for k, v in report["reference"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
