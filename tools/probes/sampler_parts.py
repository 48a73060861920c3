"""Where the sampling stage's time goes at Orpheus' vocabulary, per part (one GPU).

    python tools/probes/sampler_parts.py [--rows 64 256] [--vocab 156940]

Times (CUDA events, median of 20) the whole stage (its GPU path: `sampling.fused` where Triton
is), the same stage in torch ops (`sample_torch`), the `sampling.fused` kernels alone on the
penalised scores at several launch shapes (FUSED_SHAPES: the 2026-12-06 form among them), and
the stage, the torch stage and the fused kernels at the default and the old shape captured in a
CUDA graph, for Orpheus' settings (T 0.6, top-p 0.8, repetition penalty 1.3 over 256 ids), and
its parts, and the kernels a sort-free top-p would be made of (torch.topk at several k, a
per-row histogram by scatter_add), on flat logits (what random weights give) and peaked ones
(what a trained model gives): a probe for the sampler's design, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "runtime"))


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def measure(b: int, kind: str, scale: float, vocab: int) -> dict[str, float]:
    """The stage and its parts for b rows of one kind of logits (ms), and the nucleus sizes."""
    from mstar_runtime.sampling import SamplingParams, fused
    from mstar_runtime.sampling import stage as st
    from mstar_runtime.sampling.columns import columns_of

    out: dict[str, float] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(b, vocab, device="cuda", generator=g) * scale).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=i) for i in range(b)]
    hist = [torch.randint(0, vocab, (256,)) for _ in range(b)]
    cols = columns_of(params, hist, list(range(b)), "cuda")
    key = f"B{b}-{kind}"
    out[f"{key} stage"] = timed(lambda: st.sample_columns(logits, cols))  # the fused kernels where Triton is
    out[f"{key} torch stage"] = timed(lambda: st.sample_torch(logits, cols))
    pen = st._penalised(logits, cols)
    if fused.available():
        out.update(fused_shapes(key, logits, pen, cols))
    out[f"{key} penalty+temperature"] = timed(lambda: st._penalised(logits, cols))
    out[f"{key} top-k/top-p"] = timed(lambda: st._top_k_top_p(pen, cols.top_k, cols.top_p))
    out[f"{key} sort"] = timed(lambda: torch.sort(pen, dim=-1, stable=True))
    scores = st._top_k_top_p(pen, cols.top_k, cols.top_p)
    u = torch.rand(b, device="cuda", dtype=torch.float64)
    out[f"{key} draw"] = timed(lambda: st.pick_from_cdf(scores, u))
    out[f"{key} softmax"] = timed(lambda: pen.softmax(-1))
    for k in (64, 256, 1024, 4096):
        out[f"{key} topk{k}"] = timed(lambda k=k: torch.topk(pen, k, dim=-1))
    keys = pen.view(torch.int32)
    bins = torch.zeros(b, 2048, device="cuda")
    probs = pen.softmax(-1)
    rows = torch.arange(b, device="cuda")[:, None] * 2048

    def hist_pass() -> None:
        idx = ((keys >> 21) & 2047) + rows
        bins.view(-1).zero_().index_add_(0, idx.view(-1), probs.view(-1))

    out[f"{key} histogram2048"] = timed(hist_pass)
    nucleus = (probs.sort(-1, descending=True).values.cumsum(-1) < 0.8).sum(-1).float()
    out[f"{key} nucleus-size-mean"] = nucleus.mean().item()
    out[f"{key} nucleus-size-max"] = nucleus.max().item()
    return out


# `fused.sample_rows`'s launch shapes timed (keyword arguments; {} is the default). "old" is the
# form timed on 2026-12-06 ([block, 16] one-hot accumulators, 256-entry blocks, no block skipping),
# so one run gives before and after.
OLD = {"block": 256, "by_digit": False, "skip_bits": 32}
FUSED_SHAPES: dict[str, dict[str, object]] = {
    "default": {}, "old": OLD, "block=512": {"block": 512}, "block=1024": {"block": 1024},
    "no skip": {"skip_bits": 32}, "skip from 12 bits": {"skip_bits": 12}, "skip from 20 bits": {"skip_bits": 20},
    "bits=2": {"bits": 2}, "bits=8 block=64": {"bits": 8, "block": 64}, "S=8": {"segments": 8},
    "S=32": {"segments": 32}, "warps=4": {"warps": 4},
}


def fused_shapes(key: str, logits: torch.Tensor, pen: torch.Tensor, cols: object) -> dict[str, float]:
    """The `sampling.fused` kernels: eager at each of FUSED_SHAPES (and how many rows draw another
    token than the default shape: rounding only, so ~0), and the default and old shapes, the stage
    and the torch stage each captured in a CUDA graph (what a decode step runs)."""
    from mstar_runtime.sampling import fused
    from mstar_runtime.sampling import stage as st

    out: dict[str, float] = {}
    u = torch.rand(pen.shape[0], device="cuda", dtype=torch.float64)

    def rows(**shape: object) -> torch.Tensor:
        return fused.sample_rows(pen, cols.top_k, cols.top_p, cols.greedy, u, **shape)

    want = rows()
    for name, shape in FUSED_SHAPES.items():
        out[f"{key} fused {name}"] = timed(lambda shape=shape: rows(**shape))
        out[f"{key} fused {name}: rows unlike default"] = float((rows(**shape) != want).sum())
    for name, fn in (("fused", rows), ("fused old", lambda: rows(**OLD)),
                     ("stage", lambda: st.sample_columns(logits, cols)),
                     ("torch stage", lambda: st.sample_torch(logits, cols))):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        out[f"{key} {name} captured"] = timed(graph.replay)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=156_940)
    args = ap.parse_args(argv)
    out: dict[str, float] = {}
    for b in args.rows:
        for kind, scale in (("flat", 1.0), ("peaked", 8.0)):
            out.update(measure(b, kind, scale, args.vocab))
    for k, v in out.items():
        print(f"{k:56s} {v:10.3f}")
    dest = Path(os.environ.get("OUT", ".")) / "sampler_parts.json"
    dest.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
