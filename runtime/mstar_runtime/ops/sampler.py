"""Seeded, reproducible token sampling: temperature, top-k, top-p, repetition penalty.

`sample(logits, params, histories, steps)` picks one token per row. Row b's choice depends
only on its own logits, `params[b]`, `histories[b]` and `(params[b].seed, steps[b])`, never
on the rest of the batch, so a request gives the same tokens alone or batched, and again
when it is recomputed after preemption.

How: inverse-CDF sampling with one uniform number per row. The number is a counter-based
hash (splitmix64) of (seed, step), computed on the host by `uniform` when the step's
tensors are built and uploaded with them (`uniforms` computes the same bits with int64
tensor ops on any device, for checks); the token is the first whose cumulative
probability (float64, over `softmax(processed_logits)`) exceeds it. So a row's choice is
exact, costs one softmax, cumsum and search over the vocabulary, and the same (seed, step)
gives the same draw on any device. (Gumbel-max with a hash per vocabulary entry gives the
same distribution and the same independence, but pays ~20 integer kernels over B x V per
step; one uniform per row pays one.)

Device-side and batched: `SamplingTensors.build` turns the per-row settings into a handful
of tensors once per call -- on a GPU through pinned host memory and non-blocking copies --
and everything after that is a fixed sequence of whole-batch kernels: no generator objects,
no per-row kernels, no device -> host read. Which stages run (penalty, temperature, top-k,
top-p, the draw) is decided from the host-side params, never from tensor values.

Logit processing follows Hugging Face's processors in `generate`'s order: repetition
penalty (over the tokens in the history: positive logits divided by the penalty, negative
ones multiplied; ids outside the vocabulary ignored), then temperature, top-k, top-p (the
same tie and keep-one rules). `temperature == 0` is greedy: the argmax after the
repetition penalty.

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
import torch.nn.functional as F

from mstar_runtime.ops.node import RequestError
from mstar_runtime.ops.readback import upload, upload_tensor

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


# ------------------------------------------------------------------------- batch tensors
def signed64(x: int) -> int:
    """The int64 whose two's-complement bits are `x mod 2**64` (how a 64-bit key lives in a tensor)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


@dataclass(frozen=True)
class SamplingTensors:
    """One step's per-row sampling settings as tensors on the logits' device (built by `build`).

    The tensors are what the kernels read; the host fields (plain Python, known without any
    device read) decide which stages run at all."""

    temperature: torch.Tensor  # f32 [B]; 1 where greedy or off
    top_k: torch.Tensor  # i64 [B]; 0 = off (greedy rows, k >= vocab)
    top_p: torch.Tensor  # f32 [B]; 1 = off (greedy rows)
    penalty: torch.Tensor  # f32 [B]
    seed: torch.Tensor  # i64 [B], the 64-bit seed's bits
    step: torch.Tensor  # i64 [B]
    sampled_rows: torch.Tensor  # i64 [R]: the non-greedy rows
    top_p_rows: torch.Tensor  # i64 [P]: the rows that use top-p
    history: torch.Tensor | None  # i64 [B, L], -1 = no token; None when no row has a penalty
    u: torch.Tensor  # f64 [R]: the sampled rows' uniform draws, `uniform(seed, step)` of each
    vocab: int
    any_temperature: bool
    max_top_k: int
    num_sampled: int
    num_top_p: int

    @property
    def batch(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[torch.Tensor | None],
        steps: Sequence[int],
        vocab: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """From per-row Python settings: two host lists, two uploads (three with histories)."""
        dev = torch.device(device)
        n = len(params)
        if len(histories) != n or len(steps) != n:
            raise ValueError(f"need one history and one step per row, got {len(histories)} and "
                             f"{len(steps)} for {n} rows")
        temps, ks, ps, pens = [], [], [], []
        for p in params:
            greedy = p.greedy
            temps.append(1.0 if greedy else p.temperature)
            k = 0 if greedy or p.top_k >= vocab else p.top_k
            ks.append(k)
            ps.append(1.0 if greedy else p.top_p)
            pens.append(p.repetition_penalty)
        raw_seeds = [secrets.randbits(64) if p.seed is None else p.seed for p in params]
        seeds = [signed64(x) for x in raw_seeds]
        sampled = [b for b, p in enumerate(params) if not p.greedy]
        # the draws on the host: a few microseconds of Python against ~30 tiny kernels of `uniforms`
        u = upload([uniform(raw_seeds[b], steps[b]) for b in sampled], torch.float64, dev)
        top_p_rows = [b for b, p in enumerate(params) if not p.greedy and p.top_p < 1.0]
        ints = upload(ks + seeds + [signed64(s) for s in steps] + sampled + top_p_rows, torch.int64, dev)
        floats = upload(temps + ps + pens, torch.float32, dev)
        r, q = len(sampled), len(top_p_rows)
        penalised = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
        return cls(
            temperature=floats[:n], top_p=floats[n : 2 * n], penalty=floats[2 * n :],
            top_k=ints[:n], seed=ints[n : 2 * n], step=ints[2 * n : 3 * n],
            sampled_rows=ints[3 * n : 3 * n + r], top_p_rows=ints[3 * n + r : 3 * n + r + q],
            history=_pad_histories(histories, penalised, n, dev), u=u,
            vocab=vocab, any_temperature=any(t != 1.0 for t in temps), max_top_k=max(ks, default=0),
            num_sampled=r, num_top_p=q,
        )


def _pad_histories(
    histories: Sequence[torch.Tensor | None], rows: list[int], n: int, device: torch.device
) -> torch.Tensor | None:
    """The histories of `rows` as one [n, L] int64 tensor padded with -1 (other rows all -1).

    Lengths are host metadata, so no device read is needed. Histories already on the device
    (a node that keeps them there) are joined there with one cat and one gather, whatever the
    batch size; host histories are padded on the host and uploaded once."""
    hs = {b: histories[b].reshape(-1) for b in rows if histories[b] is not None and histories[b].numel()}
    if not hs:
        return None
    width = max(h.numel() for h in hs.values())
    if all(h.device.type == "cpu" for h in hs.values()):
        padded = torch.full((n, width), -1, dtype=torch.int64)
        for b, h in hs.items():
            padded[b, : h.numel()] = h
        return upload_tensor(padded, device)
    return _join_histories(hs, n, width, device)


def _join_histories(hs: dict[int, torch.Tensor], n: int, width: int, device: torch.device) -> torch.Tensor:
    """Device-side padding: one cat, then a gather at host-computed offsets (no per-row kernels)."""
    flat = torch.cat([h.to(device=device, dtype=torch.int64) for h in hs.values()])
    starts, lens, at = [0] * n, [0] * n, 0
    for b, h in hs.items():
        starts[b], lens[b] = at, h.numel()
        at += h.numel()
    meta = upload(starts + lens, torch.int64, device)
    pos = torch.arange(width, device=device)[None, :]
    src = (meta[:n, None] + pos).clamp_(max=flat.numel() - 1)
    return torch.where(pos < meta[n:, None], flat[src], -1)


# ------------------------------------------------------------------------------ processing
def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Float32 logits after repetition penalty, temperature, top-k and top-p (removed = -inf).

    Greedy rows get only the repetition penalty (the others cannot change their argmax)."""
    _check_shapes(logits, params, histories)
    st = SamplingTensors.build(params, histories, [0] * len(params), logits.shape[1], logits.device)
    return process_tensors(logits, st)


def process_tensors(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`process_logits` over prebuilt `SamplingTensors`: whole-batch kernels only."""
    b, vocab = logits.shape
    # One spare element after the rows: the repetition penalty sends padding and ids outside
    # the vocabulary there, so one scatter serves every row without a per-row filter.
    flat = torch.empty(b * vocab + 1, dtype=torch.float32, device=logits.device)
    x = flat[: b * vocab].view(b, vocab)
    x.copy_(logits)
    if st.history is not None:
        _repetition_penalty(flat, st, b, vocab)
    if st.any_temperature:
        x.div_(st.temperature[:, None])
    if 0 < st.max_top_k:
        x = _top_k(x, st)
    if st.num_top_p:
        x = _top_p(x, st)
    return x


def _repetition_penalty(flat: torch.Tensor, st: SamplingTensors, b: int, vocab: int) -> None:
    """HF's RepetitionPenaltyLogitsProcessor on every row at once: gather, penalise, scatter.

    A repeated id scatters the same value several times, which is harmless; padding (-1),
    out-of-vocabulary ids and rows whose penalty is 1 all land on the spare element."""
    hist = st.history
    assert hist is not None
    rows = torch.arange(b, device=hist.device)[:, None]
    valid = (hist >= 0) & (hist < vocab) & (st.penalty != 1.0)[:, None]
    idx = torch.where(valid, hist + rows * vocab, b * vocab)
    score = flat[idx]
    pen = st.penalty[:, None]
    flat[idx] = torch.where(score < 0, score * pen, score / pen)


def _top_k(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    # As HF's TopKLogitsWarper: remove what is below the k-th largest value (ties at the k-th
    # value stay). Rows with k = 0 compare against -inf and keep everything.
    top = torch.topk(x, st.max_top_k, dim=-1).values
    kth = top.gather(1, (st.top_k - 1).clamp(min=0)[:, None])
    kth = torch.where(st.top_k[:, None] > 0, kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    # As Hugging Face's TopPLogitsWarper: ascending sort, drop the prefix whose cumulative
    # probability is <= 1 - top_p, always keep the most likely token. Only the rows that
    # use top-p pay for the sort over the vocabulary.
    every = st.num_top_p == st.batch
    sub = x if every else x.index_select(0, st.top_p_rows)
    p = st.top_p if every else st.top_p.index_select(0, st.top_p_rows)
    # stable: the column sampler's sort of the unmasked row orders the kept ties the same way
    sorted_x, order = torch.sort(sub, dim=-1, descending=False, stable=True)
    cum = _cumsum(sorted_x.softmax(dim=-1))
    drop_sorted = cum <= (1 - p)[:, None]
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    kept = sub.masked_fill(drop, float("-inf"))
    return kept if every else x.index_copy(0, st.top_p_rows, kept)


_SCAN_BLOCK = 1024


def _cumsum(x: torch.Tensor, blocked: bool | None = None, padded: bool = False) -> torch.Tensor:
    """`x.cumsum(-1)` of a [R, V] tensor. On a GPU a long row is scanned in blocks: a scan inside
    each block of 1,024, then a scan of the block totals added back. torch's scan of a few very
    long rows keeps most of the GPU idle (200-265 us for [16, 156940] on an H200, twice per
    sampled step). The sums are rounded in a different order than a sequential scan, as in any
    parallel scan, so a draw that lands within rounding distance of a token boundary may pick
    its neighbour (the GPU-vs-CPU sampler test allows for that); on the CPU the plain scan runs.
    `padded`: a blocked result may keep its zero-padded tail (each padded column repeats the
    row's total), contiguous, for a caller that searches it."""
    rows, v = x.shape
    if blocked is None:
        blocked = x.device.type == "cuda"
    if not blocked or v < 4 * _SCAN_BLOCK:
        return x.cumsum(dim=-1)
    nb = -(-v // _SCAN_BLOCK)
    blocks = F.pad(x, (0, nb * _SCAN_BLOCK - v)).view(rows, nb, _SCAN_BLOCK).cumsum(dim=-1)
    totals = blocks[:, :, -1]
    before = totals.cumsum(dim=-1) - totals  # exclusive: what the blocks before each one hold
    out = (blocks + before[:, :, None]).view(rows, nb * _SCAN_BLOCK)
    return out if padded else out[:, :v]


# -------------------------------------------------------------------------------- sampling
def _check_shapes(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[torch.Tensor | None]) -> None:
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(histories) != logits.shape[0]:
        raise ValueError(
            f"need logits [B, V] and B params and histories; got {tuple(logits.shape)}, "
            f"{len(params)} params, {len(histories)} histories"
        )


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[torch.Tensor | None],
    steps: Sequence[int],
) -> torch.Tensor:
    """One token id per row (int64 [B], on the logits' device); see the module docstring."""
    _check_shapes(logits, params, histories)
    if len(steps) != len(params):
        raise ValueError(f"need one step per row, got {len(steps)} for {len(params)} rows")
    return sample_tensors(logits, SamplingTensors.build(params, histories, steps, logits.shape[1], logits.device))


def sample_tensors(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`sample` over prebuilt `SamplingTensors` (a node may build them once and keep them)."""
    scores = process_tensors(logits, st)
    out = scores.argmax(dim=-1)
    if not st.num_sampled:
        return out
    every = st.num_sampled == st.batch
    sub = scores if every else scores.index_select(0, st.sampled_rows)
    picked = pick_from_cdf(sub, st.u)
    return picked if every else out.index_copy(0, st.sampled_rows, picked)


@dataclass(frozen=True)
class SamplingColumns:
    """The per-row settings of a decode cohort's rows as device columns (made at join, kept
    across steps; ops/cohort.py): what `SamplingTensors` is for one generic step, without the
    host fields, so every stage runs for every row and a step is fixed tensor code."""

    temperature: torch.Tensor  # f32 [n]; 1 where greedy
    top_k: torch.Tensor  # i64 [n]; 0 where greedy; k <= 0 or k >= vocab: off
    top_p: torch.Tensor  # f32 [n]; 1 where greedy
    penalty: torch.Tensor  # f32 [n]
    greedy: torch.Tensor  # bool [n]
    seed: torch.Tensor  # i64 [n], the seed's bits
    step: torch.Tensor  # i64 [n]
    history: torch.Tensor | None  # i64 [n, L], -1 = no token; None: no row has a penalty


def sampling_row(params: SamplingParams, step: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One request's `SamplingColumns` row, as host tensors by default: the cohort uploads a
    joining row without waiting for the device."""
    seed = secrets.randbits(64) if params.seed is None else params.seed
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    i = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return {"temperature": f(1.0 if params.greedy else params.temperature),
            "top_k": i(0 if params.greedy else params.top_k), "top_p": f(1.0 if params.greedy else params.top_p),
            "penalty": f(params.repetition_penalty), "greedy": torch.tensor(params.greedy, device=device),
            "seed": i(signed64(seed)), "step": i(signed64(step))}


def sample_columns(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """`sample` for every row of a cohort: the same tokens as the generic path gives each row
    (the same processing per row, and `uniforms(seed, step)` is `uniform`'s draw on the
    device), as fixed whole-batch kernels with no host value (capturable)."""
    n, vocab = logits.shape
    rows = torch.arange(n, device=logits.device)
    # penalty and temperature through the generic stages; top-k and top-p below, per row
    st = SamplingTensors(
        temperature=cols.temperature, top_k=cols.top_k, top_p=cols.top_p, penalty=cols.penalty, seed=cols.seed,
        step=cols.step, sampled_rows=rows, top_p_rows=rows, history=cols.history,
        u=uniforms(cols.seed, cols.step), vocab=vocab, any_temperature=True, max_top_k=0, num_sampled=n,
        num_top_p=0,
    )
    scores = _top_k_top_p_columns(process_tensors(logits, st), cols.top_k, cols.top_p)
    return torch.where(cols.greedy, scores.argmax(dim=-1), pick_from_cdf(scores, st.u))


def _top_k_top_p_columns(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`_top_k` then `_top_p` with a per-row k and p as tensors, from one sort of every row.

    The k-th largest value is the ascending sort's entry V - k (as `torch.topk`'s k-th value:
    ties count), so a k that varies per row needs no host value. Masking what lies below it
    keeps the sorted rows sorted (the removed entries are a prefix), so top-p reads the same
    sorted values and the same (stable) order of the kept ones as `_top_p`'s own sort of the
    masked row. A row with k off compares against -inf; a row with p = 1 drops only entries
    of probability 0, which no draw picks."""
    vocab = x.shape[1]
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


def pick_from_cdf(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the first token whose cumulative probability exceeds u * total.

    scores [R, V] (removed = -inf), u float64 [R] in [0, 1)."""
    # float64 CDF: exact enough that a 150k-token vocabulary loses no probability mass.
    # padded (on a GPU): the tail repeats the total, which changes neither the search nor `last`,
    # and a contiguous CDF spares searchsorted a copy of it
    cdf = _cumsum(torch.softmax(scores, dim=-1).to(torch.float64), padded=True)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # u * total may round up to total: then take the last token with probability > 0.
    last = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(picked, last).squeeze(1)


# ------------------------------------------------------------------------------- hashing
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_seed(seed: int, stream: int) -> int:
    """A seed for stream `stream` of `seed` (64 bits): nodes of one request that share the
    request's seed draw from different streams of it, so that their draws at the same step are
    unrelated numbers, as `uniform(seed, step)` of one seed would not be."""
    return _splitmix64((seed & _M64) ^ _splitmix64(stream & _M64))


def uniform(seed: int | None, step: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, step): a row's only randomness.

    A missing seed draws from the OS (not reproducible). `uniforms` computes the same bits
    on tensors."""
    s = secrets.randbits(64) if seed is None else seed & _M64
    key = _splitmix64(_splitmix64(_splitmix64(s) ^ (step & _M64)))
    return (key >> 11) * 2.0**-53


_GAMMA, _MUL1, _MUL2 = (signed64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic: mask the sign copies)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """`_splitmix64` on int64 tensors: adds and multiplies wrap modulo 2**64 on CPU and CUDA."""
    x = x + _GAMMA
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def uniforms(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`uniform(seed[r], step[r])` for every r, float64 [R], computed on the tensors' device.

    The top 53 bits of the key, exactly representable in float64, so the value is in [0, 1)."""
    key = _splitmix64_t(_splitmix64_t(_splitmix64_t(seed) ^ step))
    return _shr(key, 11).to(torch.float64) * 2.0**-53
