"""Where Whisper-large-v3's time goes at B = 1 and B = 64 (real size, dummy weights, one GPU).

    python tools/probes/profile_whisper.py --out profile-whisper.json             # one H200
    python tools/probes/profile_whisper.py --device cpu --variant tiny --batches 1 2 --tokens 8 --out /tmp/p.json

The requests, plan, worker and conductor are tools/bench/whisper.py's (imported from it): B
`transcribe` requests of a 30 s clip of seeded noise each, English, exactly `--tokens`
generated tokens, submitted together. For each B of `--batches` the batch runs three times:
once to warm up (the CUDA graphs of this size are captured), once plainly (its wall time),
once under torch.profiler (CPU and, on a GPU, CUDA activities). Printed and written to
`--out` as JSON, per B:

- the wall time of the plain run and of the profiled one (the profiler's own host cost
  shows as their difference);
- the worker's seconds per node phase in each of the two runs (the difference of
  `Worker.stats()` across the run: host seconds around each `run_step`, `phase:cohort` for
  the decode loop's cohort steps, whose entries are rows), and the rest of the wall time,
  spent outside the worker (the conductor);
- the cohort steps and rows of the profiled run;
- the profiled run's total host time (self CPU time of every event, all threads) against
  its total device time (self CUDA time of the kernels, as torch's table sums it);
- the top `--rows` (15) operators by self CPU time and by self CUDA time.

`--trace DIR` also writes each profiled run as a Chrome trace (DIR/whisper-bB.json). A
probe for the figures of tools/bench/whisper.py, not a benchmark: one run per figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))  # the bench's folder: its `whisper` and `common` first
from common import environment, table, write_json  # noqa: E402
from whisper import CLIP_SECONDS, request, setup, transcribe  # noqa: E402 - tools/bench/whisper.py, not openai-whisper


def phases(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """What ran between two `Worker.stats()`: one row per node phase that stepped, by seconds."""
    rows = []
    for node, by_phase in after["nodes"].items():
        for phase, st in by_phase.items():
            was = before["nodes"].get(node, {}).get(phase, {})
            steps = st["steps"] - was.get("steps", 0)
            if steps:
                rows.append({"node": node, "phase": phase, "steps": steps,
                             "rows": st["entries"] - was.get("entries", 0),
                             "seconds": st["seconds"] - was.get("seconds", 0.0)})
    return sorted(rows, key=lambda r: -r["seconds"])


def operators(prof: torch.profiler.profile, rows: int, cuda: bool) -> dict[str, Any]:
    """Host against device totals and the top ROWS operators by self CPU and self CUDA time."""
    ka = prof.key_averages()
    host_us = sum(e.self_cpu_time_total for e in ka)
    device_us = sum(e.self_device_time_total for e in ka if e.device_type != torch.autograd.DeviceType.CPU)

    def row(e: Any) -> dict[str, Any]:
        return {"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "cpu_ms": e.cpu_time_total / 1e3, "self_cuda_ms": e.self_device_time_total / 1e3 if cuda else None}

    by_cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:rows]
    by_cuda = sorted(ka, key=lambda e: -e.self_device_time_total)[:rows] if cuda else []
    return {"host_ms": host_us / 1e3, "device_ms": device_us / 1e3 if cuda else None,
            "top_self_cpu": [row(e) for e in by_cpu], "top_self_cuda": [row(e) for e in by_cuda]}


PHASE_COLUMNS = [("node", "node", 0), ("phase", "phase", 0), ("steps", "steps", 0), ("rows", "rows", 0),
                 ("seconds", "s", 4), ("profiled_seconds", "s profiled", 4)]
OP_COLUMNS = [("self_cpu_ms", "self CPU ms", 2), ("self_cuda_ms", "self CUDA ms", 2), ("calls", "calls", 0),
              ("name", "operator", 0)]


def profile_batch(worker: Any, conductor: Any, b: int, args: argparse.Namespace) -> dict[str, Any]:
    """One batch size: warm-up, plain run, profiled run (module docstring); the record."""
    cuda = args.device.startswith("cuda")
    batch = [request(i, args.tokens) for i in range(b)]
    warm = transcribe(conductor, batch, args.tokens, args.device)[1]
    before = worker.stats()
    wall = transcribe(conductor, batch, args.tokens, args.device)[1]
    mid = worker.stats()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        profiled = transcribe(conductor, batch, args.tokens, args.device)[1]
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.trace / f"whisper-b{b}.json"))
    plain, under = phases(before, mid), phases(mid, worker.stats())
    seconds = {(r["node"], r["phase"]): r["seconds"] for r in under}
    for r in plain:
        r["profiled_seconds"] = seconds.get((r["node"], r["phase"]))
    cohort = [r for r in under if r["phase"].endswith(":cohort")]
    return {"batch": b, "warmup_s": warm, "wall_s": wall, "profiled_wall_s": profiled,
            "outside_worker_s": wall - sum(r["seconds"] for r in plain),
            "profiled_outside_worker_s": profiled - sum(r["seconds"] for r in under),
            "phases": plain, "profiled_phases": under,
            "cohort_steps": sum(r["steps"] for r in cohort), "cohort_rows": sum(r["rows"] for r in cohort),
            **operators(prof, args.rows, cuda)}


def show(rec: dict[str, Any]) -> None:
    b, device = rec["batch"], rec["device_ms"]
    print(f"\nB={b}: wall {1e3 * rec['wall_s']:.1f} ms (warm-up {1e3 * rec['warmup_s']:.1f}, profiled "
          f"{1e3 * rec['profiled_wall_s']:.1f}); outside the worker {1e3 * rec['outside_worker_s']:.1f} ms; "
          f"cohort {rec['cohort_steps']} steps, {rec['cohort_rows']} rows")
    print(table(rec["phases"], PHASE_COLUMNS))
    print(f"profiled: host (self CPU, all threads) {rec['host_ms']:.1f} ms, device (self CUDA) "
          + ("n/a" if device is None else f"{device:.1f} ms"))
    columns = OP_COLUMNS if device is not None else [c for c in OP_COLUMNS if c[0] != "self_cuda_ms"]
    print(f"top {len(rec['top_self_cpu'])} by self CPU time:\n" + table(rec["top_self_cpu"], columns))
    if rec["top_self_cuda"]:
        print(f"top {len(rec['top_self_cuda'])} by self CUDA time:\n" + table(rec["top_self_cuda"], OP_COLUMNS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variant", default="real")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per request (as the bench's)")
    ap.add_argument("--rows", type=int, default=15, help="operators in each top list")
    ap.add_argument("--trace", type=Path, default=None, help="a folder for Chrome traces of the profiled runs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    _, worker, conductor = setup(args.variant, args.device, args.tokens)
    report: dict[str, Any] = {"env": environment(args.device), "variant": args.variant, "tokens": args.tokens,
                              "clip_seconds": CLIP_SECONDS, "batches": []}
    for b in args.batches:
        report["batches"].append(profile_batch(worker, conductor, b, args))
        show(report["batches"][-1])
        write_json(args.out, report)  # after each batch: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
