"""The sampling stage draws the tokens the sampler of 31b9af9 draws (tests/sampling_reference.py)
for the same logits, settings, seed and step: on small and on Orpheus-sized vocabularies, with
tied logits, masked rows, penalties, greedy rows and per-row top-k / top-p; on the CPU here and
on the GPU (gpu-marked, eager and captured).

Where the two can differ at all: the reference decides top-p from a float32 cumulative sum over
the whole sorted row, which is off by up to ~1e-5 near the top of a 156,940-entry row; a row
whose top-p boundary lies that close to p is `ambiguous` (counted, and required to be rare),
every other row must draw exactly the reference's token.
"""

from __future__ import annotations

import pytest
import torch
from sampling_reference import reference_sample, reference_scores
from support import capture

from mstar_runtime.sampling import SamplingColumns, SamplingParams, columns_of, sample_columns

ORPHEUS_V = 156_940
AMBIGUOUS = 1e-5  # distance of a top-p boundary from p within which float32 rounding may decide


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mixed_params(n: int, vocab: int, seed: int) -> list[SamplingParams]:
    """Per-row settings of every kind: greedy, top-k on and off (k beyond the vocabulary too),
    top-p on and off, penalties above and below 1."""
    g = gen(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    return [SamplingParams(temperature=pick([0.0, 0.4, 0.6, 1.0, 1.7]),
                           top_k=pick([0, 0, 1, 2, 5, 20, 50, vocab - 1, vocab, vocab + 5]),
                           top_p=pick([1.0, 0.95, 0.8, 0.5, 0.1]),
                           repetition_penalty=pick([1.0, 1.3, 0.8]),
                           seed=int(torch.randint(2**62, (1,), generator=g)))
            for _ in range(n)]


def histories(params: list[SamplingParams], vocab: int, seed: int) -> list[torch.Tensor | None]:
    g = gen(seed)
    return [torch.randint(-1, vocab + 3, (1 + int(torch.randint(300, (1,), generator=g)),), generator=g)
            if p.repetition_penalty != 1.0 else None for p in params]


def ambiguous_rows(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """Rows whose top-p boundary lies within AMBIGUOUS of p, from exact (float64) sums over the
    reference's top-k-masked row in its order (descending value; among ties, descending id)."""
    topk_only = SamplingColumns(**{**vars(cols), "top_p": torch.ones_like(cols.top_p)})
    x = reference_scores(logits, topk_only).double()
    n, vocab = x.shape
    key = x.flip(-1)  # a stable descending sort of the flipped row puts the larger id first among ties
    sv, _ = torch.sort(key, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sv, dim=-1)
    excl = probs.cumsum(-1) - probs
    p = cols.top_p.double()[:, None]
    near = ((excl - p).abs() < AMBIGUOUS) & (probs > 0)
    return near.any(-1) & (cols.top_p < 1) & ~cols.greedy


def check(logits: torch.Tensor, cols: SamplingColumns, max_ambiguous: float = 0.05) -> None:
    """The stage's tokens are the reference's on every row that is not ambiguous (and at most a
    `max_ambiguous` share of rows is)."""
    got, want = sample_columns(logits, cols), reference_sample(logits, cols)
    amb = ambiguous_rows(logits.cpu(), SamplingColumns(**{f: None if t is None else t.cpu()
                                                          for f, t in vars(cols).items()}))
    assert float(amb.float().mean()) <= max_ambiguous, f"{int(amb.sum())} of {len(amb)} rows are ambiguous"
    bad = (got.cpu() != want.cpu()) & ~amb
    assert not bool(bad.any()), f"rows {bad.nonzero().flatten().tolist()}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("round_to", [None, 1.0, 0.25])  # rounded: many ties, at the k-th value and in top-p
def test_small_vocabulary_every_setting(round_to: float | None) -> None:
    vocab = 97
    for trial in range(5):
        x = torch.randn(32, vocab, generator=gen(trial)) * 3
        if round_to is not None:
            x = (x / round_to).round() * round_to
        params = mixed_params(32, vocab, 100 + trial)
        hists = histories(params, vocab, 200 + trial)
        for step in (0, 1, 7, 10_000):
            # tied logits put some top-p boundaries exactly on p (two ties of 0.5 at p = 0.5)
            check(x, columns_of(params, hists, [step + b for b in range(32)], "cpu"),
                  max_ambiguous=0.05 if round_to is None else 0.15)


def orpheus_logits(kind: str, n: int, seed: int) -> torch.Tensor:
    """Logits of Orpheus' vocabulary: peaked (randn x 4), bf16-valued (ties everywhere), or the
    benchmark's audio_only rows (one code position's 4,096 ids and end_of_speech, near-flat)."""
    g = gen(seed)
    if kind == "peaked":
        return torch.randn(n, ORPHEUS_V, generator=g) * 4
    if kind == "bf16":
        return (torch.randn(n, ORPHEUS_V, generator=g) * 2.5).to(torch.bfloat16).float()
    x = torch.full((n, ORPHEUS_V), float("-inf"))
    lo = 128266 + 4096 * (torch.arange(n) % 7)
    for b in range(n):
        x[b, lo[b] : lo[b] + 4096] = torch.randn(4096, generator=g) * 0.5
        x[b, 128258] = 0.0
    return x


@pytest.mark.parametrize("kind", ["peaked", "bf16", "audio"])
def test_orpheus_vocabulary(kind: str) -> None:
    """Orpheus' settings (T 0.6, top-p 0.8, penalty 1.3 over a history) and mixed ones, 16 rows."""
    x = orpheus_logits(kind, 16, seed=len(kind))
    orpheus = [SamplingParams(0.6, 0, 0.8, 1.3, seed=1000 + b) for b in range(8)]
    params = orpheus + mixed_params(8, ORPHEUS_V, 7)
    hists = histories(params, ORPHEUS_V, 8)
    check(x, columns_of(params, hists, [3 * b + 11 for b in range(16)], "cpu"), max_ambiguous=0.15)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["peaked", "bf16", "audio"])
def test_orpheus_vocabulary_on_the_gpu_eager_and_captured(kind: str) -> None:
    """On the GPU, 64 rows: the stage against the reference on the same device, then the stage
    captured in a CUDA graph and replayed with other settings written into the same columns."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, n = torch.device("cuda"), 64
    x = orpheus_logits(kind, n, seed=3).to(dev)

    def cols_of(r: int) -> SamplingColumns:
        params = [SamplingParams(0.6, 0, 0.8, 1.3, seed=r * 100 + b) for b in range(n // 2)]
        params += mixed_params(n // 2, ORPHEUS_V, r)
        hists = [torch.randint(0, ORPHEUS_V, (400,), generator=gen(r * 1000 + b)) for b in range(n)]
        return columns_of(params, hists, [r * 10 + b for b in range(n)], dev)

    check(x, cols_of(0), max_ambiguous=0.15)
    cols = cols_of(0)
    graph, out = capture(sample_columns, x, cols)
    for r in range(1, 4):
        fresh = cols_of(r)
        for f, t in vars(fresh).items():
            getattr(cols, f).copy_(t)
        graph.replay()
        assert torch.equal(out, sample_columns(x, fresh)), r



@pytest.mark.gpu
def test_the_fused_kernels_draw_the_stages_tokens_and_a_row_its_own_alone() -> None:
    """256 rows of Orpheus' vocabulary: `sampling.fused` against the torch ops (`sample_torch`,
    the stage's CPU path) on the same logits, settings, seeds and steps, every row that is not
    ambiguous equal; captured in a CUDA graph, the same tokens; a row drawn alone, its token."""
    from mstar_runtime.sampling import fused, stage, uniforms

    if not torch.cuda.is_available() or not fused.available():
        pytest.skip("needs CUDA and Triton")
    dev, n = torch.device("cuda"), 256
    x = torch.cat([orpheus_logits(kind, n // 4, seed=9) for kind in ("peaked", "bf16", "audio")]
                  + [orpheus_logits("bf16", n // 4, seed=10) * 0.2]).to(dev)
    params = [SamplingParams(0.6, 0, 0.8, 1.3, seed=b) for b in range(n // 2)] + mixed_params(n // 2, ORPHEUS_V, 11)
    cols = columns_of(params, histories(params, ORPHEUS_V, 12), list(range(n)), dev)

    def drawn(c: SamplingColumns, rows: slice = slice(None)) -> torch.Tensor:
        return fused.sample_rows(stage._penalised(x[rows], c), c.top_k, c.top_p, c.greedy, uniforms(c.seed, c.step))

    got, want = drawn(cols), stage.sample_torch(x, cols)
    assert torch.equal(sample_columns(x, cols), got)  # the stage's GPU path is the fused one
    amb = ambiguous_rows(x.cpu(), SamplingColumns(**{f: None if t is None else t.cpu() for f, t in vars(cols).items()}))
    bad = (got.cpu() != want.cpu()) & ~amb
    assert not bool(bad.any()), f"rows {bad.nonzero().flatten().tolist()}"
    graph, out = capture(drawn, cols)
    graph.replay()
    assert torch.equal(out, got)
    for b in (0, 77, 200, n - 1):
        hist = [None if cols.history is None else cols.history[b][cols.history[b] >= 0].cpu()]
        assert int(drawn(columns_of([params[b]], hist, [b], dev), slice(b, b + 1))) == int(got[b]), b
