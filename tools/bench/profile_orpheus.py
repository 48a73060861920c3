"""Where an Orpheus decode step's time goes: a host profile and a device timeline summary.

    python tools/bench/profile_orpheus.py --out $OUT/profile.txt            # H200, real size
    python tools/bench/profile_orpheus.py --device cpu --batch 2 --tokens 12  # smoke

One warm-up run, then the same run (B requests of --tokens tokens, the `bench` variant, dummy
weights, as tools/bench/orpheus.py runs M*) twice: under cProfile (host Python: which
functions of the conductor, engine, node and sampler cost what per step) and under
torch.profiler (per-op CPU and CUDA time, and the GPU's busy time against the wall time:
a step whose GPU is idle most of the wall time is bound by the host). Before the cProfile
tables: the host stages per request (`STAGES`: the cohort joins, the prefill phase, the
stream flushes, ...), named alike on older trees, so two trees' runs compare line by line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orpheus import ROOT, compile_plan, run_mstar  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--path", default="cohort", choices=["cohort", "generic"],
                    help="the step path (generic: the plan without its cohort marks; docs/runtime.md)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "profile.txt")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    variant = "bench" if device.type == "cuda" else "tiny"
    placement = ROOT / "placements" / ("h200x1.yaml" if device.type == "cuda" else "cpu.yaml")
    plan = load_plan(compile_plan(variant, placement, Path(tempfile.mkdtemp(prefix="prof-orpheus-"))),
                     device=device.type, kv_pages_cap=None if device.type == "cuda" else 4096)
    workers = {0: Worker(plan, 0, device, "dummy")}
    report = io.StringIO()
    run_mstar(plan, workers, device, args.batch, args.tokens, 1, args.path)  # warm-up: graphs, kernels, allocator
    t0 = time.perf_counter()
    plain = run_mstar(plan, workers, device, args.batch, args.tokens, 2, args.path)
    print(f"{args.path} path, B={args.batch}", file=report)
    print(f"plain run: {time.perf_counter() - t0:.3f} s, decode step {plain['decode_step_ms']:.2f} ms, "
          f"{plain['tokens_per_s']:.0f} tokens/s", file=report)

    prof = cProfile.Profile()
    prof.enable()
    run_mstar(plan, workers, device, args.batch, args.tokens, 3, args.path)
    prof.disable()
    stages(pstats.Stats(prof), args.batch, report)
    for key in ("tottime", "cumulative"):
        print(f"\n==== cProfile, B={args.batch}, {args.tokens} tokens, by {key}", file=report)
        pstats.Stats(prof, stream=report).sort_stats(key).print_stats(30)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as tp:
        t0 = time.perf_counter()
        run_mstar(plan, workers, device, args.batch, args.tokens, 4, args.path)
        wall = time.perf_counter() - t0
    events = tp.key_averages()
    if device.type == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e6
        print(f"\n==== torch.profiler: wall {wall:.3f} s, GPU busy (sum of self device time) {busy:.3f} s "
              f"= {100 * busy / wall:.0f} % of the wall", file=report)
        print(events.table(sort_by="self_device_time_total", row_limit=40), file=report)
    print(events.table(sort_by="self_cpu_time_total", row_limit=25), file=report)
    text = report.getvalue()
    args.out.write_text(text)
    print(text)
    return 0


# the host stages a B = 256 run spends its time in, as (what, file, function): the same names
# on trees before and after batched joins (Cohort.join took one row, then every row entering)
STAGES = (
    ("cohort joins", "control/cohort.py", "join"),
    ("prefill phase", "orpheus/backbone.py", "phase_prefill"),
    ("stream flushes", "control/cohort.py", "_flush"),
    ("cohort leaves", "control/cohort.py", "_leave"),
    ("lane effects", "control/interpreter.py", "flush_lane"),
    ("cohort step calls", "control/cohort.py", "step"),  # launch, and the previous step's events
)


def stages(stats: pstats.Stats, batch: int, report: io.StringIO) -> None:
    """Cumulative host seconds of each of `STAGES` over the profiled run, and per request."""
    print(f"\n==== host stages (cProfile, cumulative over the run; B = {batch})", file=report)
    print(f"{'stage':<22}{'calls':>9}{'seconds':>10}{'ms/request':>12}", file=report)
    table = stats.stats  # type: ignore[attr-defined]  # (file, line, function) -> (cc, nc, tt, ct, callers)
    for what, path, func in STAGES:
        rows = [v for (f, _, fn), v in table.items() if fn == func and f.replace(os.sep, "/").endswith(path)]
        if not rows:
            print(f"{what:<22}{'-':>9}", file=report)
            continue
        calls, seconds = sum(r[1] for r in rows), sum(r[3] for r in rows)
        print(f"{what:<22}{calls:>9}{seconds:>10.3f}{1e3 * seconds / batch:>12.3f}", file=report)


if __name__ == "__main__":
    sys.exit(main())
