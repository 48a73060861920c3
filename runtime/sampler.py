"""Seeded, reproducible token sampling: temperature, top-k, top-p, repetition penalty.

`sample(logits, params, histories, steps)` picks one token per row. Row b's choice depends
only on its own logits, `params[b]`, `histories[b]` and `(params[b].seed, steps[b])`, never
on the rest of the batch, so a request gives the same tokens alone or batched, and again
when it is recomputed after preemption.

How: Gumbel-max. A token is `argmax(processed_logits + g)` with one Gumbel draw `g[v]` per
vocabulary entry, which samples exactly from `softmax(processed_logits)`. The draws come
from a counter-based hash of (seed, step, token id) computed with int64 tensor ops (no
generator objects, no per-row loop, the same bits on CPU and GPU), so a whole batch takes
one set of kernels and no host sync.

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

_M32 = 0xFFFFFFFF
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
    on = [p.top_p < 1.0 and not p.greedy for p in params]
    if not any(on):
        return x
    # As Hugging Face's TopPLogitsWarper: ascending sort, drop the prefix whose cumulative
    # probability is <= 1 - top_p, always keep the most likely token.
    sorted_x, order = torch.sort(x, dim=-1, descending=False)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    limit = torch.tensor([1 - p.top_p for p in params], dtype=torch.float32, device=x.device)[:, None]
    drop_sorted = cum <= limit
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    drop &= torch.tensor(on, device=x.device)[:, None]
    return x.masked_fill(drop, float("-inf"))


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
    keys = [_row_key(params[b].seed, steps[b]) for b in rows]
    r = torch.tensor(rows, device=scores.device)
    noisy = scores.index_select(0, r) + gumbel_noise(keys, scores.shape[1], scores.device)
    return out.index_copy(0, r, noisy.argmax(dim=-1))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _row_key(seed: int | None, step: int) -> int:
    """A 64-bit key from (seed, step): the only source of a row's randomness."""
    s = secrets.randbits(64) if seed is None else seed & _M64
    return _splitmix64(_splitmix64(s) ^ (step & _M64))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), without int64 overflow (two 16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Standard Gumbel draws [len(keys), vocab], a pure function of (key, token id)."""
    k = torch.tensor([[key & _M32, key >> 32] for key in keys], dtype=torch.int64, device=device)
    v = torch.arange(vocab, dtype=torch.int64, device=device)[None, :]
    h = _mix32(_mix32((v + k[:, :1]) & _M32) ^ k[:, 1:])
    # 24 bits: exactly representable in float32, so u is strictly inside (0, 1).
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))
