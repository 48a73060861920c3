"""Top-k, top-p and the draw of the sampling stage as Triton kernels, without a sort (GPU).

`sample_rows` takes the float32 scores after the repetition penalty and the temperature
(`stage._penalised`) and the rows' uniforms, and draws the tokens `stage.sample_torch` draws
up to float rounding: a draw that lands within rounding distance of a token boundary, or a
top-p cut whose cumulative mass is within rounding of 1 - top_p, may take the neighbour (as the
torch ops' own GPU scan already does against the CPU's). tests/test_sampling_fused.py checks it
in Triton's interpreter on the CPU, tests/test_sampling_stage.py on the GPU at Orpheus' size.

It is the stage's path on a GPU with Triton (`stage.sample_columns`; `stage.sample_torch` keeps
the torch ops, which sort the whole vocabulary). Measured on the H200 (2026-12-06,
`tools/probes/sampler_parts.py --rows 1 64 256`, BENCHMARKS.md), captured in a CUDA graph with
512-entry blocks (256, the default now, was faster still eager): 0.17 / 0.83 / 3.08 ms at B = 1
/ 64 / 256 against the torch stage's 0.38 / 1.75 / 5.82 (which also holds the penalty and the
temperature, 0.2-0.5 ms eager). Its first form, one program per row, took 5.5 ms at B = 1 and
12.3 ms at B = 256 (eager): one multiprocessor per row, latency-bound. Hence the segments
below.

Each row is cut into `S` segments (`segments_for`: about 16, by the vocabulary alone, so that a
row's sums do not depend on the batch, and a few rows still keep many multiprocessors busy) and
every launch runs one program per (row, segment). The row's decisions are
not kept in a state that a launch writes and the next reads: each launch replays them from the
per-segment partial sums of the launches before it (a few hundred numbers, summed over the
segments in a fixed order), so every program of every launch finds the same ones.
1. `seg_max`: each segment's maximum, its first index and its NaN count (a greedy row's token
   is the row's first maximum; a row with a NaN draws token 0, as the torch path's padding
   rows do).
2. `seg_count`, 8 launches: top-k (0 < k < vocab) as the torch path takes it (the k-th largest
   value; ties stay), by a radix select over the float32 bits in order-preserving form: 4 bits
   a launch, each counting its segment's entries per digit among those that share the digits
   chosen so far.
3. `seg_mass`, 8 launches: top-p (p < 1), the same radix select weighted by exp(x - max): the
   value v* where the ascending cumulative mass first exceeds (1 - p) * total (the first kept
   entry of the torch path's stable ascending sort), and how many of the entries equal to v*
   are dropped (ties go by id, lowest first, as a stable sort orders them). A row with p = 1
   runs the first launch only (its kept mass).
4. `seg_draw`: each segment's kept mass follows from those partials (the digits above the
   chosen one at each level are the entries above v*); the program whose segment holds
   u * kept mass (u the row's (seed, step) uniform) scans it and writes the token: the first
   kept entry, in vocabulary order, whose cumulative mass (float64) exceeds it (past the end by
   rounding: the row's maximum, always kept).
Within a program each lane keeps its own sums over the segment and the lanes are reduced once
(a reduction per block is latency a program cannot hide). Every sum is a fixed tree, so a row
draws the same token every run and in any batch (another segment count may round otherwise).
"""

from __future__ import annotations

import torch

try:  # CUDA builds of torch ship Triton; CPU ones do not (the torch ops serve there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# entries a radix pass handles at once ([_BLOCK, 16] digit accumulators in registers): 256 at 8
# warps was the fastest shape measured on the H200 at B = 1, 64 and 256 (2026-12-06, BENCHMARKS.md)
_BLOCK = 256
_SCAN = 2048  # entries a scan (maximum, draw) handles at once
_LEVELS = 8  # 4-bit digits of a 32-bit key

if triton is not None:
    # "no index": a kernel reads a global only as a constexpr (the interpreter takes a plain int,
    # the compiler does not)
    _NONE = tl.constexpr(2147483647)

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
    def row_max(pmax, parg, pnan, r, S, SP: tl.constexpr):
        """(max, its first index, whether the row has a NaN) from the segments' partials."""
        s = tl.arange(0, SP)
        on = s < S
        vals = tl.load(pmax + r * S + s, mask=on, other=float("-inf"))
        m = tl.max(vals, axis=0)
        arg = tl.min(tl.where(on & (vals == m), tl.load(parg + r * S + s, mask=on, other=_NONE), _NONE), axis=0)
        bad = tl.sum(tl.load(pnan + r * S + s, mask=on, other=0), axis=0) > 0
        return m, tl.where(arg == _NONE, 0, arg), bad

    @triton.jit
    def level_sums(part, r, level, S, SP: tl.constexpr):
        """A level's per-digit sums over the segments (fixed order), and the [SP, 16] partials."""
        s = tl.arange(0, SP)
        d = tl.arange(0, 16)
        tile = tl.load(part + ((r * 8 + level) * S + s[:, None]) * 16 + d[None, :], mask=(s < S)[:, None], other=0)
        return tl.sum(tile, axis=0), tile

    @triton.jit
    def replay_count(cnt, r, levels, rank, S, SP: tl.constexpr):
        """The first `levels` digits of the key of ascending rank `rank` (0-based), as a prefix."""
        digits = tl.arange(0, 16)
        prefix = tl.zeros([], dtype=tl.uint32)
        below = tl.zeros([], dtype=tl.int32)
        for level in range(levels):
            c, c_sum = level_sums(cnt, r, level, S, SP)
            d = tl.min(tl.where(below + tl.cumsum(c, axis=0) > rank, digits, 15), axis=0)
            below += tl.sum(tl.where(digits < d, c, 0), axis=0)
            prefix = prefix * 16 + d.to(tl.uint32)
        return prefix

    @triton.jit
    def mass_digit(mass, below, q):
        """The first digit at which below + the cumulative mass exceeds q (past the end by
        rounding: the last digit with mass)."""
        digits = tl.arange(0, 16)
        last = tl.max(tl.where(mass > 0, digits, 0), axis=0)
        return tl.min(tl.where((below + tl.cumsum(mass, axis=0) > q) & (mass > 0), digits, last), axis=0)

    @triton.jit
    def replay_mass(mass_part, r, levels, p, S, SP: tl.constexpr):
        """The first `levels` digits of v* (the top-p cut), as a prefix."""
        digits = tl.arange(0, 16)
        m0, m0_sum = level_sums(mass_part, r, 0, S, SP)
        q = (1.0 - p) * tl.sum(m0, axis=0)
        prefix = tl.zeros([], dtype=tl.uint32)
        below = tl.zeros([], dtype=tl.float32)
        for level in range(levels):
            ms, ms_sum = level_sums(mass_part, r, level, S, SP)
            d = mass_digit(ms, below, q)
            below += tl.sum(tl.where(digits < d, ms, 0.0), axis=0)
            prefix = prefix * 16 + d.to(tl.uint32)
        return prefix

    @triton.jit
    def row_cut(cnt, top_k, r, vocab, S, SP: tl.constexpr):
        """The top-k cut key of row r (0: top-k off), replayed from the count partials."""
        k = tl.load(top_k + r)
        on = (k > 0) & (k < vocab)
        return tl.where(on, replay_count(cnt, r, tl.where(on, 8, 0), (vocab - k).to(tl.int32), S, SP), 0)

    @triton.jit
    def seg_max(scores, stride, vocab, seg, S, pmax, parg, pnan, SCAN: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        row = scores + r.to(tl.int64) * stride
        lo = s * seg
        hi = tl.minimum(lo + seg, vocab)
        best = tl.full([SCAN], float("-inf"), tl.float32)
        best_at = tl.full([SCAN], _NONE, tl.int32)
        nans = tl.zeros([SCAN], dtype=tl.int32)
        for start in range(lo, hi, SCAN):
            offs = start + tl.arange(0, SCAN)
            x = tl.load(row + offs, mask=offs < hi, other=float("-inf"))
            nans += (x != x).to(tl.int32)
            better = x > best
            best = tl.where(better, x, best)
            best_at = tl.where(better, offs, best_at)
        m = tl.max(best, axis=0)
        tl.store(pmax + r * S + s, m)
        tl.store(parg + r * S + s, tl.min(tl.where(best == m, best_at, _NONE), axis=0))
        tl.store(pnan + r * S + s, tl.sum(nans, axis=0))

    @triton.jit
    def digit_sums(row, lo, hi, m, lo_key, prefix, shift, COUNT: tl.constexpr, MASS: tl.constexpr,
                   BLOCK: tl.constexpr):
        """Per 4-bit digit at `shift`: the count and the exp(x - m) mass of the entries in
        [lo, hi) whose key is >= lo_key and whose digits above `shift` equal `prefix`."""
        digits = tl.arange(0, 16)
        cnt = tl.zeros([BLOCK, 16], dtype=tl.int32)
        mass = tl.zeros([BLOCK, 16], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < hi, other=float("-inf"))
            key = keys_of(x)
            t = key >> shift  # then >> 4: a uint32 shifted by 32 (the first level) is undefined
            hit = (offs < hi) & (key >= lo_key) & ((t >> 4) == prefix)
            onehot = tl.where(hit, (t & 15).to(tl.int32), 16)[:, None] == digits[None, :]
            if COUNT:
                cnt += onehot.to(tl.int32)
            if MASS:
                mass += tl.where(onehot, tl.exp(x - m)[:, None], 0.0)
        return tl.sum(cnt, axis=0), tl.sum(mass, axis=0)

    @triton.jit
    def seg_count(scores, stride, vocab, seg, S, pmax, parg, pnan, greedy, top_k, cnt, level,
                  SP: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        k = tl.load(top_k + r)
        top, top_at, bad = row_max(pmax, parg, pnan, r, S, SP)
        if (not bad) & (tl.load(greedy + r) == 0) & (k > 0) & (k < vocab):
            prefix = replay_count(cnt, r, level, (vocab - k).to(tl.int32), S, SP)
            row = scores + r.to(tl.int64) * stride
            c, c_sum = digit_sums(row, s * seg, tl.minimum(s * seg + seg, vocab), 0.0, 0, prefix, 28 - 4 * level,
                              True, False, BLOCK)
            tl.store(cnt + ((r * 8 + level) * S + s) * 16 + tl.arange(0, 16), c)

    @triton.jit
    def seg_mass(scores, stride, vocab, seg, S, pmax, parg, pnan, greedy, top_k, top_p, cnt, mass, ties, level,
                 SP: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        p = tl.load(top_p + r)
        m, m_at, bad = row_max(pmax, parg, pnan, r, S, SP)
        if (not bad) & (tl.load(greedy + r) == 0) & ((p < 1.0) | (level == 0)):
            lo_key = row_cut(cnt, top_k, r, vocab, S, SP)
            prefix = replay_mass(mass, r, level, p, S, SP)
            row = scores + r.to(tl.int64) * stride
            c, ms = digit_sums(row, s * seg, tl.minimum(s * seg + seg, vocab), m, lo_key, prefix, 28 - 4 * level,
                               level == 7, True, BLOCK)
            tl.store(mass + ((r * 8 + level) * S + s) * 16 + tl.arange(0, 16), ms)
            if level == 7:
                tl.store(ties + (r * S + s) * 16 + tl.arange(0, 16), c)

    @triton.jit
    def top_p_segments(mass, ties, r, p, m, S, SP: tl.constexpr):
        """(v*, each segment's kept mass, each segment's dropped entries equal to v*) from the
        mass partials: at every level the digits above the chosen one hold entries above v*."""
        segs = tl.arange(0, SP)
        digits = tl.arange(0, 16)
        m0, m0_sum = level_sums(mass, r, 0, S, SP)
        q = (1.0 - p) * tl.sum(m0, axis=0)
        prefix = tl.zeros([], dtype=tl.uint32)
        kept = tl.zeros([SP], dtype=tl.float32)
        below = tl.zeros([], dtype=tl.float32)
        d = tl.zeros([], dtype=tl.int32)
        for level in range(8):
            ms, tile = level_sums(mass, r, level, S, SP)
            d = mass_digit(ms, below, q)
            below += tl.sum(tl.where(digits < d, ms, 0.0), axis=0)
            kept += tl.sum(tl.where(digits[None, :] > d, tile, 0.0), axis=1)
            prefix = prefix * 16 + d.to(tl.uint32)
        e_v = tl.exp(value_of(prefix) - m)
        tie_tile = tl.load(ties + (r * S + segs[:, None]) * 16 + digits[None, :], mask=(segs < S)[:, None], other=0)
        seg_ties = tl.sum(tl.where(digits[None, :] == d, tie_tile, 0), axis=1)
        # ties of v* go by id, lowest first: the first `drop` of them (over the segments in order)
        room = tl.where(e_v > 0, (q - below) / e_v, 0.0)
        drop = tl.minimum(tl.maximum(tl.minimum(room, 2e9).to(tl.int32), 0), tl.sum(seg_ties, axis=0) - 1)
        before = tl.cumsum(seg_ties, axis=0) - seg_ties
        dropped_here = tl.minimum(tl.maximum(drop - before, 0), seg_ties)
        return prefix, kept + (seg_ties - dropped_here).to(tl.float32) * e_v, dropped_here

    @triton.jit
    def seg_draw(scores, stride, vocab, seg, S, pmax, parg, pnan, greedy, top_k, top_p, u, cnt, mass, ties, out,
                 SP: tl.constexpr, SCAN: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        p = tl.load(top_p + r)
        m, arg, bad = row_max(pmax, parg, pnan, r, S, SP)
        token = tl.where(bad, 0, arg)
        mine = s == 0  # who writes the token when no scan is needed
        if (not bad) & (tl.load(greedy + r) == 0):
            segs = tl.arange(0, SP)
            cut_key = row_cut(cnt, top_k, r, vocab, S, SP)
            m0_cnt, m0 = level_sums(mass, r, 0, S, SP)
            kept = tl.sum(m0, axis=1)  # p = 1: everything at or above the top-k cut
            dropped_here = tl.zeros([SP], dtype=tl.int32)
            if p < 1.0:
                cut_key, kept, dropped_here = top_p_segments(mass, ties, r, p, m, S, SP)
            kept64 = tl.where(segs < S, kept, 0.0).to(tl.float64)
            target = tl.load(u + r) * tl.sum(kept64, axis=0)
            ends = tl.cumsum(kept64, axis=0)
            crossing = tl.min(tl.where((ends > target) & (kept64 > 0) & (segs < S), segs, _NONE), axis=0)
            mine = tl.where(crossing == _NONE, s == 0, s == crossing)
            if s == crossing:
                start_mass = tl.sum(tl.where(segs == s, ends - kept64, 0.0), axis=0)
                skip = tl.sum(tl.where(segs == s, dropped_here, 0), axis=0)
                row = scores + r.to(tl.int64) * stride
                token = scan_segment(row, s * seg, tl.minimum(s * seg + seg, vocab), m, cut_key, skip,
                                     start_mass, target, arg, SCAN)
        if mine:
            tl.store(out + r, token.to(tl.int64))

    @triton.jit
    def kept_block(row, start, hi, m, cut_key, skip, seen, SCAN: tl.constexpr):
        """One block of a segment's scan from `start`: its offsets, its ties with cut_key and the
        float64 mass of its kept entries (key above cut_key, or equal past the first `skip` such
        entries of the segment, `seen` of them in the blocks before)."""
        offs = start + tl.arange(0, SCAN)
        x = tl.load(row + offs, mask=offs < hi, other=float("-inf"))
        key = keys_of(x)
        tie = (offs < hi) & (key == cut_key)
        rank = seen + tl.cumsum(tie.to(tl.int32), axis=0)
        kept = (offs < hi) & ((key > cut_key) | (tie & (rank > skip)))
        return offs, tie, tl.where(kept, tl.exp(x - m), 0.0).to(tl.float64)

    @triton.jit
    def scan_segment(row, lo, hi, m, cut_key, skip, run, target, fallback, SCAN: tl.constexpr):
        """The first kept entry of [lo, hi) at which run + the cumulative mass (float64) exceeds
        target. Block sums up to the block that crosses, then one scan inside it."""
        start = lo
        seen = tl.zeros([], dtype=tl.int32)
        go = True
        while go:
            offs, tie, w = kept_block(row, start, hi, m, cut_key, skip, seen, SCAN)
            total = tl.sum(w, axis=0)
            go = (run + total <= target) & (start + SCAN < hi)
            if go:
                run += total
                seen += tl.sum(tie.to(tl.int32), axis=0)
                start += SCAN
        # the crossing block again: what a while loop's body binds is not visible after it
        offs, tie, w = kept_block(row, start, hi, m, cut_key, skip, seen, SCAN)
        cdf = run + tl.cumsum(w, axis=0)
        found = tl.min(tl.where((cdf > target) & (w > 0), offs, _NONE), axis=0)
        return tl.where(found == _NONE, fallback, found)


def available() -> bool:
    """Whether Triton can be imported (it ships with CUDA builds of torch, not with CPU ones)."""
    return triton is not None


_SEGMENTS = 16
_SEGMENT_MIN = 512  # entries a segment has at least (short rows are latency, not bandwidth)


def segments_for(vocab: int) -> int:
    """Segments a row is cut into: `_SEGMENTS`, fewer for a vocabulary of fewer than 512 entries
    a segment. Never the batch size: a row's sums, and so its token, must not depend on the
    other rows."""
    return max(1, min(_SEGMENTS, vocab // _SEGMENT_MIN))


def sample_rows(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor,
                u: torch.Tensor, *, segments: int | None = None, block: int = _BLOCK, scan: int = _SCAN,
                warps: int = 8) -> torch.Tensor:
    """One token id per row (int64 [n]) from float32 scores [n, V] (after penalty and temperature),
    the rows' top-k (int64), top-p (float32), greedy flags and uniforms (float64). `segments`
    (default `segments_for`), `block`, `scan` and `warps`: the launches' shape, for
    tools/probes/sampler_parts.py to time others (the same tokens up to rounding)."""
    n, vocab = scores.shape
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"need float32 scores with unit stride, got {scores.dtype}, strides {scores.stride()}")
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    if not n:
        return out
    S = segments or segments_for(vocab)
    per = -(-vocab // S)
    seg = -(-per // block) * block  # a whole number of blocks a segment
    S = -(-vocab // seg)
    SP = triton.next_power_of_2(S)
    dev = scores.device
    pmax = torch.empty(n * S, dtype=torch.float32, device=dev)
    parg = torch.empty(n * S, dtype=torch.int32, device=dev)
    pnan = torch.empty(n * S, dtype=torch.int32, device=dev)
    cnt = torch.zeros(n * _LEVELS * S * 16, dtype=torch.int32, device=dev)
    mass = torch.zeros(n * _LEVELS * S * 16, dtype=torch.float32, device=dev)
    ties = torch.zeros(n * S * 16, dtype=torch.int32, device=dev)
    grid = (n, S)
    row = (scores, scores.stride(0), vocab, seg, S, pmax, parg, pnan)
    seg_max[grid](*row, SCAN=scan, num_warps=warps)
    for level in range(_LEVELS):
        seg_count[grid](*row, greedy, top_k, cnt, level, SP=SP, BLOCK=block, num_warps=warps)
    for level in range(_LEVELS):
        seg_mass[grid](*row, greedy, top_k, top_p, cnt, mass, ties, level, SP=SP, BLOCK=block, num_warps=warps)
    seg_draw[grid](*row, greedy, top_k, top_p, u, cnt, mass, ties, out, SP=SP, SCAN=scan, num_warps=warps)
    return out
