"""Helpers shared by the benchmarks in tools/bench: bandwidth and matmul floors, compiling a plan, a plan for a
step path, percentiles, memory, JSON, tables.

Benchmarks run as scripts (`python tools/bench/X.py`), so this module is imported as a
sibling (`from common import ...`, the script's folder is on sys.path) or as
`tools.bench.common` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_read_bandwidth(device: torch.device | str, gib: float = 4.0, repeats: int = 10) -> float:
    """Read bandwidth in bytes/s of a big reduction (`x.sum()` over `gib` GiB of bf16), measured now.

    This is the decode floor's denominator (reference/device.md 4: 4.31 TB/s on the H200): a
    decode step must at least read every weight and the KV it attends to once. CUDA events on
    a GPU; on the CPU a smaller float32 buffer and wall time (a smoke figure only)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        x = torch.ones(int(64 * 2**20 // 4), dtype=torch.float32)
        x.sum()
        t0 = time.perf_counter()
        for _ in range(repeats):
            x.sum()
        return x.numel() * 4 * repeats / (time.perf_counter() - t0)
    x = torch.ones(int(gib * 2**30 // 2), dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        x.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        x.sum()
    end.record()
    torch.cuda.synchronize(dev)
    seconds = start.elapsed_time(end) / 1e3
    del x
    torch.cuda.empty_cache()
    return int(gib * 2**30 // 2) * 2 * repeats / seconds


def measure_bf16_peak(device: str, n: int = 8192, repeats: int = 20) -> float:
    """Dense bf16 matmul throughput in FLOP/s, measured now: `n x n @ n x n` with CUDA events
    (the compute floor's denominator). On the CPU a float32 512-cube and wall time (a smoke figure)."""
    if not device.startswith("cuda"):
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        t0 = time.perf_counter()
        for _ in range(3):
            a @ b
        return 2.0 * n**3 * 3 / (time.perf_counter() - t0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 * repeats / seconds


def reference_parser(description: str, batches: list[int], compile_help: str,
                     own: Callable[[argparse.ArgumentParser], Any]) -> argparse.ArgumentParser:
    """The options of a benchmark that times a walk, at each of `batches` sizes, against its
    model's reference (pi05.py, whisper.py); `own` adds the benchmark's own, after --repeats."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variant", default="real")
    ap.add_argument("--batches", type=int, nargs="*", default=batches)
    ap.add_argument("--repeats", type=int, default=5)
    own(ap)
    ap.add_argument("--compile-reference", action="store_true", help=compile_help)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the optional parts")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def compile_and_load(walk: Path, variant: str, device: str) -> Any:
    """WALK's VARIANT compiled for one H200 (placements/h200x1.yaml) or, for a CPU DEVICE, for the
    CPU (placements/cpu.yaml), in a temporary folder, and loaded: the Plan."""
    from mstar_runtime.plan.loader import load_plan
    from mstarc.cli import main as mstarc

    root = Path(__file__).resolve().parents[2]
    cuda = device.startswith("cuda")
    placement = root / ("placements/h200x1.yaml" if cuda else "placements/cpu.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{walk.stem}.plan"
        if mstarc(["compile", str(walk), "--variant", variant, "-p", str(placement), "-o", str(out)]) != 0:
            raise SystemExit("compile failed")
        return load_plan(out, device="cuda" if cuda else "cpu")


STEP_PATHS = ("cohort", "generic")  # what a benchmark's --path / --paths may name


def on_path(plan: Any, path: str) -> Any:
    """The Plan a benchmark runs for step path PATH: "cohort", the plan as compiled (its marked
    loops run as decode cohorts); "generic", the plan without its cohort marks (`without_cohorts`:
    every loop iteration by iteration, a step call per request per step), the baseline."""
    from mstar_runtime.plan.loader import without_cohorts

    if path not in STEP_PATHS:
        raise SystemExit(f"unknown step path {path!r}; use one of: {', '.join(STEP_PATHS)}")
    return plan if path == "cohort" else without_cohorts(plan)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def gpu_memory(device: torch.device | str) -> dict[str, float]:
    """GiB: peak allocated by torch since the last reset, reserved by torch, and used on the device
    (all processes and contexts: what nvidia-smi would show)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(dev)
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
        "reserved_gib": torch.cuda.memory_reserved(dev) / 2**30,
        "device_used_gib": (total - free) / 2**30,
    }


def reset_peak(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def environment(device: torch.device | str) -> dict[str, Any]:
    """What ran: versions and the device, for the JSON record."""
    dev = torch.device(device)
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    for name in ("transformers", "flashinfer"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - absent or broken: record why
            env[name] = f"unavailable ({type(e).__name__})"
    return env


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write atomically (a benchmark killed mid-write leaves the previous complete file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_jsonable) + "\n")
    tmp.replace(p)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def patched_copy(src: Path, pattern: str, repl: str, what: str, dst: Path) -> Path:
    """`src` with the one line matching `pattern` replaced by `repl` (re.subn), written to `dst`;
    exits naming `what` when the file does not hold exactly one such line."""
    text, n = re.subn(pattern, repl, src.read_text())
    if n != 1:
        raise SystemExit(f"{src}: expected one `{what}` line, found {n}")
    dst.write_text(text)
    return dst


class Launches:
    """Host times at which rank 0 launched steps of `node` (its phases `phases`, or its cohort
    steps), recorded by wrapping the worker's step entry points. In steady state the host is held
    back by the device (each step's readback is waited for a step later), so the mean interval
    between launches is the step period the run achieved (an Orpheus token with SNAC included,
    a Qwen3-Omni talker frame); the time a step spends inside `run_step` is only its launch time."""

    def __init__(self, worker: Any, node: str, phases: tuple[str, ...]):
        self.worker, self.at = worker, []
        run, cohort = worker.run_step, worker.cohort_step

        def run_step(batch: Any) -> Any:
            if batch.node == node and batch.phase in phases:
                self.at.append(time.perf_counter())
            return run(batch)

        def cohort_step(key: Any, n: int) -> Any:
            if key[0] == node:
                self.at.append(time.perf_counter())
            return cohort(key, n)

        worker.run_step, worker.cohort_step = run_step, cohort_step

    def period(self, skip: int = 2) -> float | None:
        """Mean seconds between launches, after `skip` warm-up launches."""
        at = self.at[skip:]
        return (at[-1] - at[0]) / (len(at) - 1) if len(at) > 1 else None

    def close(self) -> None:
        del self.worker.run_step, self.worker.cohort_step  # back to the class's methods


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, int]]) -> str:
    """A plain-text table: columns are (key, header, decimals)."""
    cells = [[h for _, h, _ in columns]] + [[fmt(r.get(k), d) for k, _, d in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Budget:
    """A wall-clock budget for optional parts of a benchmark (so one command fits its time limit)."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


def timed(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, float]:
    """(fn(), seconds) with the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
