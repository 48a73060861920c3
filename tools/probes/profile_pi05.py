"""Where one π0.5 action chunk's time goes (real size, dummy weights, one GPU, B = 1).

    python tools/probes/profile_pi05.py [--prompt-tokens 200]

Runs `act_noise` once to warm up, then once under torch.profiler, and prints the worker's
seconds per node phase and the top operators by host and by device time: a probe for the
B = 1 latency of tools/bench/pi05.py, not a benchmark.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args(argv)
    from mstar_runtime.control.conductor import FINISHED, Conductor
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker
    from mstarc.cli import main as mstarc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pi05.plan"
        assert mstarc(["compile", str(ROOT / "models/pi05/pi05.walk"), "-p", str(ROOT / "placements/h200x1.yaml"),
                       "-o", str(out)]) == 0
        plan = load_plan(out, device="cuda")
    cfg = dict(plan.config)
    worker = Worker(plan, 0, "cuda", "dummy")
    conductor = Conductor(plan, {0: worker})
    g = torch.Generator().manual_seed(0)
    cams, img = int(cfg["cameras"]), int(cfg["img"])
    req = {"images": torch.randint(0, 256, (cams, img, img, 3), generator=g, dtype=torch.uint8),
           "instruction": "pick up the red block and put it in the bowl",
           "state": torch.rand(int(cfg["action_dim"]), generator=g) * 2 - 1,
           "noise": torch.randn(int(cfg["horizon"]), int(cfg["action_dim"]), generator=g)}

    def once() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = conductor.submit("act_noise", req)
        conductor.run_until_idle()
        torch.cuda.synchronize()
        assert h.state == FINISHED, h.error
        return time.perf_counter() - t0

    once()
    before = worker.stats()
    print(f"warm B=1 chunk: {1e3 * once():.1f} ms")
    print("worker phases (after warm-up, cumulative):", worker.stats(), "\nbefore:", before)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        print(f"profiled B=1 chunk: {1e3 * once():.1f} ms")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
