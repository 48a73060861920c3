"""The sampling stage's top-k, top-p and draw as one Triton kernel per row, without a sort (GPU).

`stage.sample_columns` calls `sample_rows` on a CUDA device when Triton is there; it takes the
float32 scores after the repetition penalty and the temperature and returns the same tokens as
the torch ops (`stage._top_k_top_p` and `stage.pick_from_cdf`) up to float rounding: a draw that
lands within rounding distance of a token boundary, or a top-p cut whose cumulative mass is
within rounding of 1 - top_p, may take the neighbour (as the torch ops' own GPU scan already does
against the CPU's). tests/test_sampling_fused_gpu.py pins that on real-size rows.

One program per row walks the row in blocks, its state in registers (each lane keeps its own
sums over the row and the lanes are reduced once per pass, which a reduction per block would
not afford at one program per row):
1. the maximum and its first index (a greedy row's token; a row with a NaN draws token 0, as
   the torch path's padding rows do);
2. top-k (0 < k < vocab): the k-th largest value as the torch path takes it (ties stay), by a
   radix select over the float32 bits in order-preserving form: 8 passes of 4-bit digits, each
   counting the row's entries per digit among those that share the digits found so far;
3. top-p (p < 1): the same radix select weighted by exp(x - max) finds the value v* where the
   ascending cumulative mass first exceeds (1 - p) * total (the first kept entry of the torch
   path's stable ascending sort), and how many entries equal to v* are dropped (ties go by id,
   lowest first, as a stable sort orders them): a scan finds the first kept id;
4. the draw: the first entry, in vocabulary order, whose cumulative mass (float64, kept entries
   only) exceeds u * kept mass, u the row's (seed, step) uniform (past the end by rounding: the
   row's maximum). The scans of 3 and 4 sum whole blocks up to the one they need.
Every sum is a fixed tree inside one program, so a row draws the same token every run and in
any batch. Kept entries are those above the cut value, or equal to it at an id >= the cut id.
"""

from __future__ import annotations

import torch

try:  # CUDA builds of torch ship Triton; CPU ones do not (the torch ops serve there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_BLOCK = 512  # entries a radix pass handles at once: [_BLOCK, 16] digit accumulators in registers
_SCAN = 4096  # entries a scan (max, tie search, draw) handles at once

if triton is not None:

    @triton.jit
    def keys_of(x):
        """float32 -> uint32 keys that order as the floats do (-0.0 as +0.0): sign set, all bits
        flipped; else the sign bit set. int32 arithmetic, since 64-bit integers cost twice."""
        i = x.to(tl.int32, bitcast=True)
        i = tl.where(i == -2147483648, 0, i)
        return (i ^ ((i >> 31) | -2147483648)).to(tl.uint32, bitcast=True)

    @triton.jit
    def value_of(key):
        """keys_of's inverse."""
        k = key.to(tl.int32, bitcast=True)
        return tl.where(k < 0, k ^ -2147483648, ~k).to(tl.float32, bitcast=True)

    @triton.jit
    def digit_sums(row, vocab, m, lo_key, prefix, shift, COUNT: tl.constexpr, MASS: tl.constexpr,
                   BLOCK: tl.constexpr):
        """Per 4-bit digit at `shift`: the count and the exp(x - m) mass of the entries whose key
        is >= lo_key and whose digits above `shift` equal `prefix`. Each lane accumulates its own
        [16] sums over the row; one reduction at the end (a reduction per block costs more)."""
        digits = tl.arange(0, 16)
        cnt = tl.zeros([BLOCK, 16], dtype=tl.int32)
        mass = tl.zeros([BLOCK, 16], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < vocab
            x = tl.load(row + offs, mask=valid, other=float("-inf"))
            t = keys_of(x) >> shift  # two shifts: a uint32 shifted by 32 (the first level) is undefined
            hit = valid & (keys_of(x) >= lo_key) & ((t >> 4) == prefix)
            onehot = tl.where(hit, (t & 15).to(tl.int32), 16)[:, None] == digits[None, :]
            if COUNT:
                cnt += onehot.to(tl.int32)
            if MASS:
                mass += tl.where(onehot, tl.exp(x - m)[:, None], 0.0)
        return tl.sum(cnt, axis=0), tl.sum(mass, axis=0)

    @triton.jit
    def kth_key(row, vocab, m, rank, BLOCK: tl.constexpr):
        """The key of the entry of ascending rank `rank` (0-based)."""
        digits = tl.arange(0, 16)
        prefix = tl.zeros([], dtype=tl.uint32)
        below = tl.zeros([], dtype=tl.int32)
        for level in range(8):
            shift = 28 - 4 * level
            cnt, _ = digit_sums(row, vocab, m, 0, prefix, shift, True, False, BLOCK)
            cum = tl.cumsum(cnt, axis=0)
            d = tl.min(tl.where(below + cum > rank, digits, 15), axis=0)
            below += tl.sum(tl.where(digits < d, cnt, 0), axis=0)
            prefix = prefix * 16 + d.to(tl.uint32)
        return prefix

    @triton.jit
    def mass_digit(mass, below, q):
        """The first digit at which below + the cumulative mass exceeds q (rounding past the end:
        the last digit with mass)."""
        digits = tl.arange(0, 16)
        cum = tl.cumsum(mass, axis=0)
        last = tl.max(tl.where(mass > 0, digits, 0), axis=0)
        return tl.min(tl.where((below + cum > q) & (mass > 0), digits, last), axis=0)

    @triton.jit
    def top_p_cut(row, vocab, m, lo_key, p, BLOCK: tl.constexpr):
        """(v*, the mass below it, its entries' count, q, the total): the key where the ascending
        cumulative mass of the entries >= lo_key first exceeds q = (1 - p) * total."""
        digits = tl.arange(0, 16)
        _, mass = digit_sums(row, vocab, m, lo_key, 0, 28, False, True, BLOCK)
        total = tl.sum(mass, axis=0)
        q = (1.0 - p) * total
        below = tl.zeros([], dtype=tl.float32)
        d = mass_digit(mass, below, q)
        below += tl.sum(tl.where(digits < d, mass, 0.0), axis=0)
        prefix = d.to(tl.uint32)
        for level in range(1, 7):
            _, mass = digit_sums(row, vocab, m, lo_key, prefix, 28 - 4 * level, False, True, BLOCK)
            d = mass_digit(mass, below, q)
            below += tl.sum(tl.where(digits < d, mass, 0.0), axis=0)
            prefix = prefix * 16 + d.to(tl.uint32)
        cnt, mass = digit_sums(row, vocab, m, lo_key, prefix, 0, True, True, BLOCK)
        d = mass_digit(mass, below, q)
        below += tl.sum(tl.where(digits < d, mass, 0.0), axis=0)
        ties = tl.sum(tl.where(digits == d, cnt, 0), axis=0)
        return prefix * 16 + d.to(tl.uint32), below, ties, q, total

    @triton.jit
    def nth_equal(row, vocab, key_want, n, SCAN: tl.constexpr):
        """The id of the n-th (0-based) entry whose key is key_want, in vocabulary order: block
        counts up to the block that holds it, then one scan inside it."""
        seen = tl.zeros([], dtype=tl.int32)
        start = tl.zeros([], dtype=tl.int32)
        go = True
        while go:
            offs = start + tl.arange(0, SCAN)
            x = tl.load(row + offs, mask=offs < vocab, other=float("-inf"))
            c = tl.sum(((offs < vocab) & (keys_of(x) == key_want)).to(tl.int32), axis=0)
            go = (seen + c <= n) & (start + SCAN < vocab)
            seen = tl.where(go, seen + c, seen)
            start = tl.where(go, start + SCAN, start)
        offs = start + tl.arange(0, SCAN)
        x = tl.load(row + offs, mask=offs < vocab, other=float("-inf"))
        eq = ((offs < vocab) & (keys_of(x) == key_want)).to(tl.int32)
        run = seen + tl.cumsum(eq, axis=0)
        found = tl.min(tl.where((eq > 0) & (run == n + 1), offs, 2147483647), axis=0)
        return tl.where(found == 2147483647, 0, found)

    @triton.jit
    def draw(row, vocab, m, cut_key, cut_id, target, fallback, SCAN: tl.constexpr):
        """The first kept entry whose cumulative mass (float64) exceeds target: block sums up to
        the block where it is crossed, then one scan inside it. `fallback` (the row's maximum,
        always kept) when rounding puts target past the kept mass."""
        run = tl.zeros([], dtype=tl.float64)
        start = tl.zeros([], dtype=tl.int32)
        go = True
        while go:
            offs = start + tl.arange(0, SCAN)
            x = tl.load(row + offs, mask=offs < vocab, other=float("-inf"))
            key = keys_of(x)
            kept = (offs < vocab) & ((key > cut_key) | ((key == cut_key) & (offs >= cut_id)))
            s = tl.sum(tl.where(kept, tl.exp(x - m), 0.0).to(tl.float64), axis=0)
            go = (run + s <= target) & (start + SCAN < vocab)
            run = tl.where(go, run + s, run)
            start = tl.where(go, start + SCAN, start)
        offs = start + tl.arange(0, SCAN)
        x = tl.load(row + offs, mask=offs < vocab, other=float("-inf"))
        key = keys_of(x)
        kept = (offs < vocab) & ((key > cut_key) | ((key == cut_key) & (offs >= cut_id)))
        w = tl.where(kept, tl.exp(x - m), 0.0).to(tl.float64)
        cdf = run + tl.cumsum(w, axis=0)
        found = tl.min(tl.where((cdf > target) & (w > 0), offs, 2147483647), axis=0)
        return tl.where(found == 2147483647, fallback, found)

    @triton.jit
    def sample_kernel(scores, stride, vocab, top_k, top_p, greedy, u, out,
                      BLOCK: tl.constexpr, SCAN: tl.constexpr):
        r = tl.program_id(0)
        row = scores + r.to(tl.int64) * stride
        # 1. the maximum and its first index (per lane, then across lanes), NaNs
        best = tl.full([SCAN], float("-inf"), tl.float32)
        best_at = tl.zeros([SCAN], dtype=tl.int32)
        nans = tl.zeros([SCAN], dtype=tl.int32)
        for start in range(0, vocab, SCAN):
            offs = start + tl.arange(0, SCAN)
            x = tl.load(row + offs, mask=offs < vocab, other=float("-inf"))
            nans += (x != x).to(tl.int32)
            better = x > best
            best = tl.where(better, x, best)
            best_at = tl.where(better, offs, best_at)
        m = tl.max(best, axis=0)
        arg = tl.min(tl.where(best == m, best_at, 2147483647), axis=0)
        arg = tl.where(arg == 2147483647, 0, arg)
        k = tl.load(top_k + r)
        p = tl.load(top_p + r)
        token = arg
        bad = tl.sum(nans, axis=0) > 0
        if (not bad) & (tl.load(greedy + r) == 0):
            cut_key = tl.zeros([], dtype=tl.uint32)
            cut_id = tl.zeros([], dtype=tl.int32)
            if (k > 0) & (k < vocab):
                cut_key = kth_key(row, vocab, m, (vocab - k).to(tl.int32), BLOCK)
            if p < 1.0:
                v, below, ties, q, kept_total = top_p_cut(row, vocab, m, cut_key, p, BLOCK)
                e_v = tl.exp(value_of(v) - m)
                room = tl.where(e_v > 0, (q - below) / e_v, 0.0)
                dropped = tl.minimum(tl.maximum(tl.minimum(room, 2e9).to(tl.int32), 0), ties - 1)
                cut_key = v
                if dropped > 0:
                    cut_id = nth_equal(row, vocab, v, dropped, SCAN)
                mass = (kept_total - below - dropped.to(tl.float32) * e_v).to(tl.float64)
            else:
                _, kmass = digit_sums(row, vocab, m, cut_key, 0, 28, False, True, BLOCK)
                mass = tl.sum(kmass, axis=0).to(tl.float64)
            token = draw(row, vocab, m, cut_key, cut_id, tl.load(u + r) * mass, arg, SCAN)
        token = tl.where(bad, 0, token)
        tl.store(out + r, token.to(tl.int64))


def available() -> bool:
    """Whether Triton can be imported (it ships with CUDA builds of torch, not with CPU ones)."""
    return triton is not None


def sample_rows(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor,
                u: torch.Tensor, *, block: int = _BLOCK, scan: int = _SCAN, warps: int = 8) -> torch.Tensor:
    """One token id per row (int64 [n]) from float32 scores [n, V] (after penalty and temperature),
    the rows' top-k (int64), top-p (float32), greedy flags and uniforms (float64). `block`, `scan`
    and `warps`: the launch's shape (tools/probes/sampler_parts.py times others)."""
    n, vocab = scores.shape
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"need float32 scores with unit stride, got {scores.dtype}, strides {scores.stride()}")
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    if n:
        sample_kernel[(n,)](scores, scores.stride(0), vocab, top_k, top_p, greedy, u, out, BLOCK=block, SCAN=scan,
                            num_warps=warps)
    return out
