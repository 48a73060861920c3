"""Seeded, reproducible token sampling: temperature, top-k, top-p, repetition penalty.

`sample(logits, params, histories, steps)` picks one token per row. Row b's choice depends
only on its own logits, `params[b]`, `histories[b]` and `(params[b].seed, steps[b])`, never
on the rest of the batch, so a request gives the same tokens alone or batched, and again
when it is recomputed after preemption.

How: inverse-CDF sampling with one uniform number per row. The number is a counter-based
hash (splitmix64) of (seed, step), computed on the host with no generator object and no
device sync; the token is the first whose cumulative probability (float64, over
`softmax(processed_logits)`) exceeds it. So a row's choice is exact, costs one softmax,
cumsum and search over the vocabulary, and the same (seed, step) gives the same draw on any
device.

Logit processing follows Hugging Face's processors in `generate`'s order: repetition
penalty (over the tokens in the history: positive logits divided by the penalty, negative
ones multiplied), then temperature, top-k, top-p (the same tie and keep-one rules).
`temperature == 0` is greedy: the argmax after the repetition penalty.

A request without a seed (`seed=None`) gets fresh OS randomness on every call, so it is
not reproducible; the conductor should give every request a seed at admission
(`with_seed`) so that a recomputed request replays the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar_runtime.node import RequestError

_M64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling settings; invalid values raise a `RequestError` naming the field."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", "temperature"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}", "top_k")
        if not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> SamplingParams:
        """These params with a fresh random seed if they have none (call once, at admission)."""
        return self if self.seed is not None else dataclasses.replace(self, seed=secrets.randbits(63))


# ------------------------------------------------------------------------------ processing
def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Float32 logits after repetition penalty, temperature, top-k and top-p (removed = -inf).

    Greedy rows get only the repetition penalty (the others cannot change their argmax)."""
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(histories) != logits.shape[0]:
        raise ValueError(
            f"need logits [B, V] and B params and histories; got {tuple(logits.shape)}, "
            f"{len(params)} params, {len(histories)} histories"
        )
    x = logits.to(torch.float32, copy=True)
    _repetition_penalty(x, params, histories)
    dev = x.device
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=torch.float32, device=dev)[:, None]
    x = _top_k(x, params)
    return _top_p(x, params)


def _repetition_penalty(
    x: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[torch.Tensor | None]
) -> None:
    vocab = x.shape[1]
    rows, ids = [], []
    for b, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.repetition_penalty == 1.0 or h is None or h.numel() == 0:
            continue
        h = h.reshape(-1).to(device=x.device, dtype=torch.long)
        h = h[(h >= 0) & (h < vocab)]  # ids beyond the head's vocabulary cannot be sampled anyway
        if h.numel():
            rows.append(b)
            ids.append(h)
    if not rows:
        return
    width = max(h.numel() for h in ids)
    # Pad with the row's own first id: scattering the same penalised value twice is harmless.
    index = torch.stack([torch.cat([h, h[:1].expand(width - h.numel())]) for h in ids])
    r = torch.tensor(rows, device=x.device)
    penalty = torch.tensor([params[b].repetition_penalty for b in rows], dtype=torch.float32, device=x.device)
    sub = x.index_select(0, r)
    score = sub.gather(1, index)
    score = torch.where(score < 0, score * penalty[:, None], score / penalty[:, None])
    x.index_copy_(0, r, sub.scatter(1, index, score))


def _top_k(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab = x.shape[1]
    ks = [min(p.top_k, vocab) if p.top_k > 0 and not p.greedy else 0 for p in params]
    if not any(k and k < vocab for k in ks):
        return x
    top = torch.topk(x, max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=x.device)[:, None])
    kth = torch.where(torch.tensor(ks, device=x.device)[:, None] > 0, kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    rows = [b for b, p in enumerate(params) if p.top_p < 1.0 and not p.greedy]
    if not rows:
        return x
    # As Hugging Face's TopPLogitsWarper: ascending sort, drop the prefix whose cumulative
    # probability is <= 1 - top_p, always keep the most likely token. Only the rows that
    # use top-p pay for the sort over the vocabulary.
    r = torch.tensor(rows, device=x.device)
    sub = x.index_select(0, r)
    sorted_x, order = torch.sort(sub, dim=-1, descending=False)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    limit = torch.tensor([1 - params[b].top_p for b in rows], dtype=torch.float32, device=x.device)[:, None]
    drop_sorted = cum <= limit
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return x.index_copy(0, r, sub.masked_fill(drop, float("-inf")))


# -------------------------------------------------------------------------------- sampling
def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[torch.Tensor | None],
    steps: Sequence[int],
) -> torch.Tensor:
    """One token id per row (int64 [B], on the logits' device); see the module docstring."""
    if len(steps) != len(params):
        raise ValueError(f"need one step per row, got {len(steps)} for {len(params)} rows")
    scores = process_logits(logits, params, histories)
    out = scores.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    r = torch.tensor(rows, device=scores.device)
    # float64 CDF: exact enough that a 150k-token vocabulary loses no probability mass.
    cdf = torch.softmax(scores.index_select(0, r), dim=-1).to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor(
        [[uniform(params[b].seed, steps[b])] for b in rows], dtype=torch.float64, device=cdf.device
    )
    picked = torch.searchsorted(cdf, u * total, right=True)
    # u * total may round up to total: then take the last token with probability > 0.
    last = (cdf < total).sum(dim=-1, keepdim=True)
    return out.index_copy(0, r, torch.minimum(picked, last).squeeze(1))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int | None, step: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, step): a row's only randomness.

    A missing seed draws from the OS (not reproducible)."""
    s = secrets.randbits(64) if seed is None else seed & _M64
    key = _splitmix64(_splitmix64(_splitmix64(s) ^ (step & _M64)))
    return (key >> 11) * 2.0**-53
