"""Qwen3-Omni's MoE experts: grouped GEMMs (the serving kernel) against the padded fallback and the per-expert loop.

    python tools/bench/qwen3_omni_moe.py --device cpu --sizes tiny medium --out /tmp/moe.json
    python tools/bench/qwen3_omni_moe.py --device cuda --dtype bf16 --sizes thinker talker --graphs

One `SparseMoE` block (models/mstar_models/layers/moe.py) with random weights, timed per
kernel (`grouped`, `padded`, `loop`) at each token count (`--tokens`: decode batches and a
prefill chunk): the router plus the experts, over `--repeats` calls after a warm-up (the
median of CUDA-event times on a GPU, the minimum wall time on the CPU). The outputs of the three kernels are checked against each other
first. Sizes: `tiny` (the walk's tiny thinker: H 64, E 4, I 32, top-2), `medium` (H 1024,
E 64, I 384, top-6), `talker` (the released talker: H 1024, E 128, I 384, top-6, shared
expert 768) and `thinker` (the released thinker: H 2048, E 128, I 768, top-8). `--graphs`
also times the grouped kernel replayed from a CUDA graph (the decode step's launch cost).
Prints a table and writes the figures as JSON (docs/moe.md reads them).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mstar_models.qwen3_omni.moe import SparseMoE, grouped_mm_supported

SIZES = {  # hidden, experts, intermediate, top_k, shared intermediate
    "tiny": (64, 4, 32, 2, None),
    "medium": (1024, 64, 384, 6, None),
    "talker": (1024, 128, 384, 6, 768),
    "thinker": (2048, 128, 768, 8, None),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Seconds of one call: the median on a GPU (CUDA events); the minimum on the CPU, where
    other processes' load only ever adds time (a shared CI or dev machine)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if device.type == "cuda" else min(times)


def _graphed(block: SparseMoE, x: torch.Tensor) -> tuple[Callable[[], Any], torch.Tensor]:
    """A CUDA graph of one call (its replay, and the output buffer the replays write)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            block(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    return graph.replay, out


def run(size: str, tokens: list[int], device: torch.device, dtype: torch.dtype, repeats: int,
        graphs: bool) -> list[dict[str, Any]]:
    hidden, experts, inter, top_k, shared = SIZES[size]
    block = SparseMoE(hidden, experts, inter, top_k, True, shared, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden, device=device, dtype=dtype, generator=gen)
        row: dict[str, Any] = {"size": size, "tokens": n}
        outs = {}
        with torch.inference_mode():
            for kernel in ("grouped", "padded", "loop"):
                if kernel == "grouped" and not grouped_mm_supported(device, dtype):
                    continue
                block.set_kernel(kernel)
                outs[kernel] = block(x).float()
                row[kernel] = _time(lambda x=x: block(x), device, repeats)
            ref = outs["loop"]
            row["max_rel_diff"] = max(float((o - ref).abs().max() / ref.abs().max()) for o in outs.values())
            if graphs and device.type == "cuda" and "grouped" in outs:
                block.set_kernel("grouped")
                replay, out = _graphed(block, x)
                replay()
                torch.cuda.synchronize(device)
                row["graph_equals_eager"] = bool(torch.equal(out.float(), outs["grouped"]))
                row["grouped_graph"] = _time(replay, device, repeats)
        if "grouped" in row:
            row["loop_over_grouped"] = row["loop"] / row["grouped"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "medium"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--graphs", action="store_true", help="also time the grouped kernel from a CUDA graph")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    rows = [r for size in args.sizes for r in run(size, args.tokens, device, dtype, args.repeats, args.graphs)]
    cols = ["size", "tokens", "grouped", "padded", "loop", "grouped_graph", "loop_over_grouped", "max_rel_diff",
            "graph_equals_eager"]
    print(" ".join(f"{c:>17}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{'-':>17}" if v is None else f"{v * 1e3:>14.3f} ms" if c in cols[2:6]
                         else f"{v:>17.3g}" if isinstance(v, float) else f"{v!s:>17}")
        print(" ".join(cells))
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "threads": torch.get_num_threads(), "dtype": args.dtype, "torch": torch.__version__}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
