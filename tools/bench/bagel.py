"""BAGEL-7B-MoT: M* against the official inferencer on the same dummy weights, one process.

    python tools/bench/bagel.py --out $OUT/bagel.json                    # H200: real size
    python tools/bench/bagel.py --device cpu --variant tiny --size 64 --steps 4 --answer 8 \
        --t2i-batches 1,2 --und-batches 1,2 --out /tmp/bagel.json          # smoke

What runs (figures in the JSON written to --out, rewritten after every measurement):
- M*: models/bagel/bagel.walk compiled for placements/h200x1.yaml (cpu.yaml on the CPU), run
  through a Conductor with rank 0's Worker in this process, dummy weights.
  - t2i at --size x --size, --steps timesteps, the default CFG (text 4.0, image 1.5, interval
    (0.4, 1], global renorm): B requests submitted at once for each B of --t2i-batches;
    latency p50 over the requests (and over --repeats runs at B = 1).
  - edit at B = 1 (app defaults: text 4.0, image 2.0, interval [0, 1], text_channel) on a
    synthetic --size x --size image.
  - understanding at each B of --und-batches: a synthetic image and a question, --answer
    tokens generated per request (greedy; random weights rarely stop early: the count is of
    the tokens each request really generated). Text tokens/s over the wall time and TTFT p50
    (submit -> first text).
- Official (unless --skip-official or `.official/` is absent: tools/official_bagel.sh makes
  it): the official `InterleaveInferencer` path on a model holding the same weights
  (tools/bench/bagel_official.py), t2i and edit at B = 1, understanding at B = 1; the official
  inferencer has no batching, so its B = 16 figure is 16 sequential requests (reported as
  such, computed from the B = 1 run).
- Floors: t2i and edit = the FLOPs of the forwards actually needed (the LLM forwards of each
  step's computed CFG branches: linear layers of the expert each token uses plus attention,
  and the VAE) over the bf16 matmul peak measured in this run; understanding decode = the und
  expert's weight bytes (+ lm_head, embeddings excluded) over the read bandwidth measured now.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402 - the sibling module, found through the line above
from common import environment, gpu_memory, measure_read_bandwidth, median, percentile, write_json  # noqa: E402

log = logging.getLogger("bench.bagel")


def compile_plan(variant: str, placement: Path, out: Path) -> Path:
    cmd = [sys.executable, "-m", "mstarc.cli", "compile", str(ROOT / "models/bagel/bagel.walk"),
           "--variant", variant, "--placement", str(placement), "-o", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def test_image(size: int, seed: int = 0) -> torch.Tensor:
    """A smooth synthetic RGB image (uint8 [size, size, 3]): gradients and a few discs."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    img = torch.stack([xx, yy, (xx + yy) / 2], -1)
    for _ in range(4):
        cy, cx, r = torch.rand(3, generator=g)
        disc = ((yy - cy) ** 2 + (xx - cx) ** 2) < (0.1 + 0.2 * r) ** 2
        img[disc] = torch.rand(3, generator=g)
    return (img * 255).round().to(torch.uint8)


class Runner:
    """Submits a batch of requests to one conductor and times them; counts streamed tokens."""

    def __init__(self, conductor: Any):
        self.conductor = conductor
        self.tokens: dict[str, int] = {}
        from mstar_runtime.control import conductor as mod

        counts = self.tokens
        original = mod.Request.push

        def push(req: Any, stream_id: str, buffer: Any, items: Any) -> None:
            if isinstance(items, torch.Tensor) and "tok.tokens" in stream_id:
                counts[req.id] = counts.get(req.id, 0) + int(items.shape[0])
            original(req, stream_id, buffer, items)

        mod.Request.push = push  # a benchmark's probe: count what each request streams

    def run(self, walk: str, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        from mstar_runtime.control.conductor import FINISHED

        t0 = time.perf_counter()
        handles = [self.conductor.submit(walk, dict(i)) for i in inputs]
        self.conductor.run_until_idle()
        wall = time.perf_counter() - t0
        bad = [h for h in handles if h.state != FINISHED]
        if bad:
            raise SystemExit(f"{walk} failed: {bad[0].error}")
        lat = [h.stats.finished_at - h.stats.submitted_at for h in handles]
        first = [h.stats.first_output_at - h.stats.submitted_at for h in handles if h.stats.first_output_at]
        return {"wall_s": wall, "latency_p50_s": percentile(lat, 50), "first_output_p50_s": percentile(first, 50),
                "tokens": sum(self.tokens.pop(h.id, 0) for h in handles), "outputs": [h.outputs for h in handles]}


def t2i_flops(cfg: dict[str, Any], size: int, steps: int, ctx: int, interval: tuple[float, float] = (0.4, 1.0),
              shift: float = 3.0, branches_in: int = 2) -> dict[str, float]:
    """FLOPs of the LLM forwards a t2i needs: `branches_in` computed branches per step inside the
    CFG interval (cfg_img is gen's twin in t2i and not computed), one outside."""
    from mstar_models.bagel.flow import shifted_times

    h, inter, layers = int(cfg["hidden"]), int(cfg["intermediate"]), int(cfg["layers"])
    heads, kv, hd = int(cfg["heads"]), int(cfg["kv_heads"]), int(cfg["hidden"]) // int(cfg["heads"])
    q = (size // 16) ** 2 + 2
    per_token = 2 * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter) * layers
    attention = 4 * q * (ctx + q) * heads * hd * layers
    forward = q * per_token + attention
    ts = shifted_times(steps, shift)[:-1]
    inside = sum(1 for t in ts.tolist() if interval[0] < t <= interval[1])
    n = inside * branches_in + (len(ts) - inside)
    return {"forwards": n, "flops": n * forward, "forward_flops": forward}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default="real", choices=["real", "tiny"])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--t2i-batches", default="1,4")
    ap.add_argument("--und-batches", default="1,16")
    ap.add_argument("--answer", type=int, default=128, help="tokens per understanding answer")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-official", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated parts of M* to skip: t2i,edit,und")
    ap.add_argument("--official-skip", default="", help="comma-separated parts of the official run to skip")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from mstar_runtime.control.conductor import Conductor
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    dev = args.device
    placement = ROOT / "placements" / ("h200x1.yaml" if dev.startswith("cuda") else "cpu.yaml")
    if not args.skip_official:  # the official code needs its own transformers, imported first
        import bagel_official as off

        if off.missing() is None:
            off.setup()
    rec: dict[str, Any] = {"env": environment(dev), "args": vars(args) | {"out": str(args.out)}}
    save = lambda: write_json(args.out, rec)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        plan = load_plan(compile_plan(args.variant, placement, Path(tmp) / "bagel.plan"), device=dev)
    cfg = dict(plan.config)
    t0 = time.perf_counter()
    worker = Worker(plan, 0, dev, "dummy")
    rec["load_s"] = time.perf_counter() - t0
    conductor = Conductor(plan, {0: worker})
    run = Runner(conductor)
    skip = set(filter(None, args.skip.split(",")))
    rec["bf16_peak_flops"] = peak = common.measure_bf16_peak(dev)
    rec["read_bandwidth"] = bw = measure_read_bandwidth(dev)
    log.info("bf16 peak %.0f TFLOP/s, read %.0f GB/s", peak / 1e12, bw / 1e9)
    image = test_image(args.size)
    t2i = {"prompt": "A photo of a red fox sitting in the snow at the edge of a pine forest",
           "height": args.size, "width": args.size, "num_timesteps": args.steps, "seed": 0}
    edit = {"source": image, "prompt": "Make the sky purple and add a full moon", "num_timesteps": args.steps,
            "seed": 0}
    und = {"image": image, "question": "What is in this image? Describe it in detail.",
           "max_length": args.answer}
    # warm-up: kernels, FlashInfer plans, cuBLAS handles
    run.run("t2i", [t2i | {"height": 256 if args.size >= 256 else args.size,
                           "width": 256 if args.size >= 256 else args.size, "num_timesteps": 3}])
    run.run("understand", [und | {"max_length": 4}])
    save()

    if "t2i" not in skip:
        ctx = int(worker.engines["tok"].node.run("encode", [{"text": t2i["prompt"]}])[0]["ids"].shape[0])
        rec["t2i_floor"] = fl = t2i_flops(cfg, args.size, args.steps, ctx)
        for b in [int(x) for x in args.t2i_batches.split(",")]:
            reps = [run.run("t2i", [t2i | {"seed": i} for i in range(b)]) for _ in range(args.repeats if b == 1 else 1)]
            p50 = median([r["latency_p50_s"] for r in reps])
            floor = fl["flops"] * b / peak
            rec[f"t2i_b{b}"] = {"latency_p50_s": p50, "wall_s": median([r["wall_s"] for r in reps]),
                                "floor_s": floor, "x_floor": reps[0]["wall_s"] / floor}
            log.info("t2i B=%d: p50 %.2f s, wall %.2f s, floor %.2f s", b, p50, reps[0]["wall_s"], floor)
            save()
    if "edit" not in skip:
        r = run.run("edit", [edit])
        rec["edit_b1"] = {"latency_s": r["latency_p50_s"]}
        log.info("edit B=1: %.2f s", r["latency_p50_s"])
        save()
    if "und" not in skip:
        und_bytes = und_weight_bytes(worker.engines["llm"].node)
        rec["und_weight_bytes"] = und_bytes
        for b in [int(x) for x in args.und_batches.split(",")]:
            try:
                r = run.run("understand", [und] * b)
            except SystemExit as e:  # a failed part is recorded; the rest still runs
                rec[f"und_b{b}"] = {"failed": str(e)}
                save()
                continue
            rec[f"und_b{b}"] = {"tokens_per_s": r["tokens"] / r["wall_s"], "tokens": r["tokens"],
                                "ttft_p50_ms": 1e3 * (r["first_output_p50_s"] or float("nan")),
                                "decode_floor_ms_per_step": 1e3 * und_bytes / bw}
            log.info("understand B=%d: %.0f tokens/s, TTFT p50 %.0f ms", b, rec[f"und_b{b}"]["tokens_per_s"],
                     rec[f"und_b{b}"]["ttft_p50_ms"])
            save()
    rec["memory"] = gpu_memory(dev)
    save()
    if not args.skip_official:
        del conductor, run  # the worker's memory goes to the official model (official())
        official(args, rec, save, worker, t2i, edit, und, set(filter(None, args.official_skip.split(","))))
    return 0


def und_weight_bytes(node: Any) -> int:
    """Bytes one decode step must read: every und-expert tensor and the head (not the embedding
    table, of which a step reads one row, nor the gen expert, which text tokens never use)."""
    total = 0
    for name, p in node.named_parameters():
        if "moe_gen" in name or "embed_tokens" in name or name.startswith(("time_embedder", "vae2llm", "llm2vae",
                                                                           "latent_pos_embed")):
            continue
        total += p.numel() * p.element_size()
    return total


def official(args: argparse.Namespace, rec: dict[str, Any], save: Any, worker: Any, t2i: dict, edit: dict,
             und: dict, skip: set[str]) -> None:
    """The official inferencer on the worker's weights, after the worker is released (its KV
    pool fills the GPU): weights copied to the host, the worker's memory freed, the official
    model built from the copy (tools/bench/bagel_official.py)."""
    import bagel_official as off  # tools/bench/bagel_official.py

    why = off.missing()
    if why is not None:
        rec["official"] = {"skipped": why}
        save()
        return
    weights = off.worker_weights(worker, "cpu")
    tok = off.tokenizer_from_node(worker.engines["tok"].node, worker.plan.config)
    cfg = dict(worker.plan.config)
    dtype = next(worker.engines["llm"].node.parameters()).dtype
    off.release_worker(worker)
    model = off.official_model(weights, cfg, args.device, dtype, tokenizer=tok, vae_device=args.device)
    del weights
    rec["official"] = off.official_inferencer_timings(
        model, t2i=None if "t2i" in skip else t2i, edit=None if "edit" in skip else edit,
        und=None if "und" in skip else und, repeats=1)
    log.info("official: %s", {k: v for k, v in rec["official"].items() if not isinstance(v, dict | list)})
    save()


if __name__ == "__main__":
    raise SystemExit(main())
