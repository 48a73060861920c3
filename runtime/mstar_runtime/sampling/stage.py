"""The sampling stage: logits [n, V] and the rows' `SamplingColumns` -> one token id per row.

Row b's token depends only on its own logits, its settings and `(seed[b], step[b])`, never on
the rest of the batch, so a request gives the same tokens alone or batched, and again when it
is recomputed after preemption. Every stage runs for every row as whole-batch kernels with no
host value (so a captured step can hold it): repetition penalty, temperature, top-k, top-p,
then the draw; a greedy row takes the argmax after the penalty.

Processing follows Hugging Face's processors in `generate`'s order: repetition penalty (over
the tokens in the row's history: positive logits divided by the penalty, negative ones
multiplied; ids outside the vocabulary ignored), then temperature, top-k (ties at the k-th
value stay), top-p (ascending stable sort, drop the prefix whose cumulative probability is
<= 1 - top_p, keep the most likely token).

The draw is inverse-CDF with one uniform number per row, `seeds.uniforms(seed, step)`: the
token is the first, in vocabulary order, whose cumulative probability (float64, over the
processed distribution) exceeds it. (Gumbel-max with a hash per vocabulary entry gives the
same distribution and the same independence, but pays ~20 integer kernels over n x V per
step; one uniform per row pays one.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mstar_runtime.sampling.columns import SamplingColumns, columns_of
from mstar_runtime.sampling.fused import available as fused_available
from mstar_runtime.sampling.fused import sample_rows as fused_rows
from mstar_runtime.sampling.params import SamplingParams
from mstar_runtime.sampling.seeds import uniforms


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[torch.Tensor | None],
    steps: Sequence[int],
) -> torch.Tensor:
    """One token id per row (int64 [B], on the logits' device) for per-row Python settings:
    `sample_columns` over the batch's `columns` (a one-off call, e.g. a prefill's first token)."""
    _check_shapes(logits, params, histories)
    if len(steps) != len(params):
        raise ValueError(f"need one step per row, got {len(steps)} for {len(params)} rows")
    return sample_columns(logits, columns_of(params, histories, steps, logits.device))


def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Float32 logits after repetition penalty, temperature, top-k and top-p (removed = -inf):
    the distribution `sample` draws from. Greedy rows get only the repetition penalty."""
    _check_shapes(logits, params, histories)
    cols = columns_of(params, histories, [0] * len(params), logits.device)
    return _top_k_top_p(_penalised(logits, cols), cols.top_k, cols.top_p)


def _check_shapes(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[torch.Tensor | None]) -> None:
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(histories) != logits.shape[0]:
        raise ValueError(
            f"need logits [B, V] and B params and histories; got {tuple(logits.shape)}, "
            f"{len(params)} params, {len(histories)} histories"
        )


def sample_columns(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """The stage: one token id per row (int64 [n]) from the rows' device columns. On a GPU with
    Triton, top-k, top-p and the draw are `sampling.fused`'s sort-free kernels (the same tokens
    as `sample_torch` up to rounding at a boundary; about half its time captured, BENCHMARKS.md
    2026-12-06); elsewhere the torch ops."""
    scores = _penalised(logits, cols)
    if scores.is_cuda and fused_available():
        return fused_rows(scores, cols.top_k, cols.top_p, cols.greedy, uniforms(cols.seed, cols.step))
    return _draw_torch(scores, cols)


def sample_torch(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """`sample_columns` with the torch ops on every device: the GPU tests' reference for the
    fused kernels, and the CPU's stage."""
    return _draw_torch(_penalised(logits, cols), cols)


def _draw_torch(scores: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    scores = _top_k_top_p(scores, cols.top_k, cols.top_p)
    return torch.where(cols.greedy, scores.argmax(dim=-1), pick_from_cdf(scores, uniforms(cols.seed, cols.step)))


# ------------------------------------------------------------------------------ processing
def _penalised(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """Float32 logits after the repetition penalty and the temperature (a new tensor)."""
    b, vocab = logits.shape
    # One spare element after the rows: the repetition penalty sends padding and ids outside
    # the vocabulary there, so one scatter serves every row without a per-row filter.
    flat = torch.empty(b * vocab + 1, dtype=torch.float32, device=logits.device)
    x = flat[: b * vocab].view(b, vocab)
    x.copy_(logits)
    if cols.history is not None:
        _repetition_penalty(flat, cols.history, cols.penalty, b, vocab)
    return x.div_(cols.temperature[:, None])


def _repetition_penalty(flat: torch.Tensor, hist: torch.Tensor, penalty: torch.Tensor, b: int, vocab: int) -> None:
    """HF's RepetitionPenaltyLogitsProcessor on every row at once: gather, penalise, scatter.

    A repeated id scatters the same value several times, which is harmless; padding (-1),
    out-of-vocabulary ids and rows whose penalty is 1 all land on the spare element."""
    rows = torch.arange(b, device=hist.device)[:, None]
    valid = (hist >= 0) & (hist < vocab) & (penalty != 1.0)[:, None]
    idx = torch.where(valid, hist + rows * vocab, b * vocab)
    score = flat[idx]
    pen = penalty[:, None]
    flat[idx] = torch.where(score < 0, score * pen, score / pen)


def _top_k_top_p(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """HF's top-k then top-p with a per-row k and p as tensors, from one sort of every row.

    The k-th largest value is the ascending sort's entry V - k (as `torch.topk`'s k-th value:
    ties count), so a k that varies per row needs no host value. Masking what lies below it
    keeps the sorted rows sorted (the removed entries are a prefix), so top-p reads the same
    sorted values and the same (stable) order of the kept ones as a sort of the masked row.
    A row with k off compares against -inf; a row with p = 1 drops only entries of
    probability 0, which no draw picks.

    What top-p drops is a prefix of the sorted row (its cumulative sum only grows), so the kept
    tokens are those at or after the first kept position `cut`: in the stable order, the tokens
    whose (value, id) is at least `cut`'s. That is one comparison in vocabulary order, where
    scattering the sorted mask back (one int64 index per entry) cost a pass of its own."""
    vocab = x.shape[1]
    sorted_x, order = torch.sort(x, dim=-1, descending=False, stable=True)
    on = (k > 0) & (k < vocab)
    kth = sorted_x.gather(1, (vocab - k).clamp(0, vocab - 1)[:, None])
    kth = torch.where(on[:, None], kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    cum = _cumsum(sorted_x.softmax(dim=-1))
    drop = cum <= (1 - p)[:, None]
    drop[:, -1] = False
    cut = (~drop).to(torch.uint8).argmax(dim=-1, keepdim=True)  # the first kept position
    value, first = sorted_x.gather(1, cut), order.gather(1, cut)
    ids = torch.arange(vocab, device=x.device)
    keep = (x > value) | ((x == value) & (ids >= first))
    return x.masked_fill(~keep, float("-inf"))


# ------------------------------------------------------------------------------ the draw
_SCAN_BLOCK = 1024


def _cumsum(x: torch.Tensor, blocked: bool | None = None) -> torch.Tensor:
    """`x.cumsum(-1)` of a [R, V] tensor. On a GPU a long row is scanned in blocks: a scan inside
    each block of 1,024, then a scan of the block totals added back. torch's scan of a few very
    long rows keeps most of the GPU idle (200-265 us for [16, 156940] on an H200, twice per
    sampled step). The sums are rounded in a different order than a sequential scan, as in any
    parallel scan, so a draw that lands within rounding distance of a token boundary may pick
    its neighbour (the GPU-vs-CPU sampler test allows for that); on the CPU the plain scan runs."""
    rows, v = x.shape
    if blocked is None:
        blocked = x.device.type == "cuda"
    if not blocked or v < 4 * _SCAN_BLOCK:
        return x.cumsum(dim=-1)
    nb = -(-v // _SCAN_BLOCK)
    blocks = F.pad(x, (0, nb * _SCAN_BLOCK - v)).view(rows, nb, _SCAN_BLOCK).cumsum(dim=-1)
    totals = blocks[:, :, -1]
    before = totals.cumsum(dim=-1) - totals  # exclusive: what the blocks before each one hold
    return (blocks + before[:, :, None]).view(rows, nb * _SCAN_BLOCK)[:, :v]


def pick_from_cdf(scores: torch.Tensor, u: torch.Tensor, blocked: bool | None = None) -> torch.Tensor:
    """Inverse-CDF draw per row: the first token whose cumulative probability exceeds u * total.

    scores [R, V] (removed = -inf), u float64 [R] in [0, 1); `blocked` as in `_cumsum`."""
    # float64 CDF: exact enough that a 150k-token vocabulary loses no probability mass.
    probs = torch.softmax(scores, dim=-1).to(torch.float64)
    if blocked is None:
        blocked = probs.device.type == "cuda"
    if blocked and probs.shape[1] >= 4 * _SCAN_BLOCK:
        return _pick_blocked(probs, u)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # u * total may round up to total: then take the last token with probability > 0.
    last = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(picked, last).squeeze(1)


def _pick_blocked(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`pick_from_cdf` over `_cumsum`'s blocked CDF without adding the block offsets to every
    entry: the block totals' prefix finds the block a draw lands in, and only that block's
    1,024 entries get their offset and are searched. Every CDF value compared is the one the
    whole-row scan would hold (`blocks + before`, the same float64 sums), so the token is too."""
    rows, v = probs.shape
    nb = -(-v // _SCAN_BLOCK)
    blocks = F.pad(probs, (0, nb * _SCAN_BLOCK - v)).view(rows, nb, _SCAN_BLOCK).cumsum(dim=-1)
    totals = blocks[:, :, -1]
    before = totals.cumsum(dim=-1) - totals
    ends = before + totals  # the CDF at each block's last entry
    total = ends[:, -1:].contiguous()

    def first_index(target: torch.Tensor, right: bool) -> torch.Tensor:
        """The first entry whose CDF is > target (right) or >= target (not right)."""
        b = torch.searchsorted(ends, target, right=right).clamp_(max=nb - 1)
        inner = blocks.gather(1, b[:, :, None].expand(rows, 1, _SCAN_BLOCK)).squeeze(1) + before.gather(1, b)
        return b * _SCAN_BLOCK + torch.searchsorted(inner, target, right=right)

    picked = first_index(u[:, None] * total, right=True)
    # u * total may round up to total: then take the last token with probability > 0 (the
    # entries below total are those before the first that reaches it).
    last = first_index(total, right=False)
    # A row without a distribution (NaN logits: a bucket's padding row in a captured step)
    # draws token 0, as the whole-row count of entries below a NaN total gives: never an id
    # past the vocabulary, which the next step's embedding lookup would trip over.
    return torch.where(total.isnan(), 0, torch.minimum(picked, last).clamp_(max=v - 1)).squeeze(1)
