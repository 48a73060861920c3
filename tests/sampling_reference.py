"""The sampler as it was at 31b9af9 (runtime/mstar_runtime/ops/sampler.py, its column form), frozen:
the reference the sampling stage must draw the same tokens as (tests/test_sampling_stage.py).

It sorts every row over the whole vocabulary for top-k / top-p (HF's processors, op for op),
then draws by inverse CDF in vocabulary order with `uniforms(seed, step)`. Only the uniform
draw is shared with the stage (`mstar_runtime.sampling.seeds`, which this test does not cover).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar_runtime.sampling import SamplingColumns, uniforms


def reference_sample(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """One token per row: penalty, temperature, top-k, top-p from one full sort, the draw."""
    scores = reference_scores(logits, cols)
    return torch.where(cols.greedy, scores.argmax(dim=-1), _pick_from_cdf(scores, uniforms(cols.seed, cols.step)))


def reference_scores(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """The processed logits the reference draws from (removed = -inf)."""
    b, vocab = logits.shape
    flat = torch.empty(b * vocab + 1, dtype=torch.float32, device=logits.device)
    x = flat[: b * vocab].view(b, vocab)
    x.copy_(logits)
    if cols.history is not None:
        hist, penalty = cols.history, cols.penalty
        rows = torch.arange(b, device=hist.device)[:, None]
        valid = (hist >= 0) & (hist < vocab) & (penalty != 1.0)[:, None]
        idx = torch.where(valid, hist + rows * vocab, b * vocab)
        score = flat[idx]
        pen = penalty[:, None]
        flat[idx] = torch.where(score < 0, score * pen, score / pen)
    x.div_(cols.temperature[:, None])
    k, p = cols.top_k, cols.top_p
    sorted_x, order = torch.sort(x, dim=-1, descending=False, stable=True)
    on = (k > 0) & (k < vocab)
    kth = sorted_x.gather(1, (vocab - k).clamp(0, vocab - 1)[:, None])
    kth = torch.where(on[:, None], kth, float("-inf"))
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    cum = _cumsum(sorted_x.softmax(dim=-1))
    drop_sorted = cum <= (1 - p)[:, None]
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def _cumsum(x: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """cumsum(-1); on a GPU long rows in blocks of 1,024 (a scan per block, then of the block totals)."""
    rows, v = x.shape
    if x.device.type != "cuda" or v < 4096:
        return x.cumsum(dim=-1)
    nb = -(-v // 1024)
    blocks = F.pad(x, (0, nb * 1024 - v)).view(rows, nb, 1024).cumsum(dim=-1)
    totals = blocks[:, :, -1]
    out = (blocks + (totals.cumsum(dim=-1) - totals)[:, :, None]).view(rows, nb * 1024)
    return out if padded else out[:, :v]


def _pick_from_cdf(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = _cumsum(torch.softmax(scores, dim=-1).to(torch.float64), padded=True)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(picked, last).squeeze(1)
