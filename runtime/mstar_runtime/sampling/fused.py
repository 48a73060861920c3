"""Top-k, top-p and the draw of the sampling stage as Triton kernels, without a sort (GPU).

`sample_rows` takes the float32 scores after the repetition penalty and the temperature
(`stage._penalised`) and the rows' uniforms, and draws the tokens `stage.sample_torch` draws
up to float rounding: a draw that lands within rounding distance of a token boundary, or a
top-p cut whose cumulative mass is within rounding of 1 - top_p, may take the neighbour (as the
torch ops' own GPU scan already does against the CPU's). tests/test_sampling_fused.py checks it
in Triton's interpreter on the CPU, tests/test_sampling_stage.py on the GPU at Orpheus' size.

It is the stage's path on a GPU with Triton (`stage.sample_columns`; `stage.sample_torch` keeps
the torch ops, which sort the whole vocabulary). Measured on the H200 (2026-12-06,
`tools/probes/sampler_parts.py --rows 1 64 256`, BENCHMARKS.md), captured in a CUDA graph, in
the form before the accumulators below were turned (the probe's "old" shape): 0.17 / 0.83 /
3.08 ms at B = 1 / 64 / 256 against the torch stage's 0.38 / 1.75 / 5.82 (which also holds the
penalty and the temperature, 0.2-0.5 ms eager); the present form is not timed yet. Its first
form, one program per row, took 5.5 ms at B = 1 and 12.3 ms at B = 256 (eager): one
multiprocessor per row, latency-bound. Hence the segments below.

A radix pass is bound by its instructions more than by its reads (at B = 64 the rows fit in
L2): an entry's digit selects one of 2**`_BITS` accumulators, a compare and a predicated add
each. So the accumulators are [2**BITS, BLOCK], all of an entry's in the thread that loaded it
(sm_90 code: ~58 instructions an entry, no shared memory); the old [BLOCK, 2**BITS] form sent
each entry's digit and mass through shared memory to 16 threads, 4 barriers a block. 4-bit
digits need about the fewest instructions over a whole select (2 bits: twice the passes; 8
bits: 16 times the accumulators). From a 16-bit prefix on (`_SKIP_BITS`) few entries of a row
share the prefix, and a pass skips the blocks that hold none (the sums stay the same).

Each row is cut into `S` segments (`segments_for`: about 16, by the vocabulary alone, so that a
row's sums do not depend on the batch, and a few rows still keep many multiprocessors busy) and
every launch runs one program per (row, segment). The row's decisions are
not kept in a state that a launch writes and the next reads: each launch replays them from the
per-segment partial sums of the launches before it (a few hundred numbers, summed over the
segments in a fixed order), so every program of every launch finds the same ones.
1. `seg_max`: each segment's maximum, its first index and its NaN count (a greedy row's token
   is the row's first maximum; a row with a NaN draws token 0, as the torch path's padding
   rows do).
2. `seg_count`, 32 / `_BITS` launches: top-k (0 < k < vocab) as the torch path takes it (the
   k-th largest value; ties stay), by a radix select over the float32 bits in order-preserving
   form: `_BITS` bits a launch, each counting its segment's entries per digit among those that
   share the digits chosen so far.
3. `seg_mass`, 32 / `_BITS` launches: top-p (p < 1), the same radix select weighted by exp(x - max): the
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
(a reduction per block is a barrier; only the skipping passes pay one, to skip a block's work). Every sum is a fixed tree, so a row
draws the same token every run and in any batch (another segment count may round otherwise).
"""

from __future__ import annotations

import torch

try:  # CUDA builds of torch ship Triton; CPU ones do not (the torch ops serve there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# entries a radix pass handles at once ([2**_BITS, _BLOCK] digit accumulators in registers: one
# entry a thread at 8 warps)
_BLOCK = 256
_SCAN = 2048  # entries a scan (maximum, draw) handles at once
# bits of the key a radix pass decides: 32 // _BITS passes for top-k, as many for top-p, each with
# 2**_BITS accumulators an entry. 8 bits halves the passes but costs 16 times the accumulators (a
# register file's worth at 8 warps); tools/probes/sampler_parts.py times 2, 4 and 8.
_BITS = 4
# prefix length (bits) from which a radix pass skips the blocks none of whose entries share the
# prefix (a block reduction each; deep prefixes are held by a few entries of a row)
_SKIP_BITS = 16

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
    def level_sums(part, r, level, S, SP: tl.constexpr, BITS: tl.constexpr):
        """A level's per-digit sums over the segments (fixed order), and the [SP, 2**BITS] partials."""
        s = tl.arange(0, SP)
        d = tl.arange(0, 1 << BITS)
        at = ((r * (32 // BITS) + level) * S + s[:, None]) * (1 << BITS) + d[None, :]
        tile = tl.load(part + at, mask=(s < S)[:, None], other=0)
        return tl.sum(tile, axis=0), tile

    @triton.jit
    def replay_count(cnt, r, levels, rank, S, SP: tl.constexpr, BITS: tl.constexpr):
        """The first `levels` digits of the key of ascending rank `rank` (0-based), as a prefix."""
        digits = tl.arange(0, 1 << BITS)
        prefix = tl.zeros([], dtype=tl.uint32)
        below = tl.zeros([], dtype=tl.int32)
        for level in range(levels):
            c, c_tile = level_sums(cnt, r, level, S, SP, BITS)
            d = tl.min(tl.where(below + tl.cumsum(c, axis=0) > rank, digits, (1 << BITS) - 1), axis=0)
            below += tl.sum(tl.where(digits < d, c, 0), axis=0)
            prefix = (prefix << BITS) | d.to(tl.uint32)
        return prefix

    @triton.jit
    def mass_digit(mass, below, q, BITS: tl.constexpr):
        """The first digit at which below + the cumulative mass exceeds q (past the end by
        rounding: the last digit with mass)."""
        digits = tl.arange(0, 1 << BITS)
        last = tl.max(tl.where(mass > 0, digits, 0), axis=0)
        return tl.min(tl.where((below + tl.cumsum(mass, axis=0) > q) & (mass > 0), digits, last), axis=0)

    @triton.jit
    def replay_mass(mass_part, r, levels, p, S, SP: tl.constexpr, BITS: tl.constexpr):
        """The first `levels` digits of v* (the top-p cut), as a prefix."""
        digits = tl.arange(0, 1 << BITS)
        m0, m0_tile = level_sums(mass_part, r, 0, S, SP, BITS)
        q = (1.0 - p) * tl.sum(m0, axis=0)
        prefix = tl.zeros([], dtype=tl.uint32)
        below = tl.zeros([], dtype=tl.float32)
        for level in range(levels):
            ms, ms_tile = level_sums(mass_part, r, level, S, SP, BITS)
            d = mass_digit(ms, below, q, BITS)
            below += tl.sum(tl.where(digits < d, ms, 0.0), axis=0)
            prefix = (prefix << BITS) | d.to(tl.uint32)
        return prefix

    @triton.jit
    def row_cut(cnt, top_k, r, vocab, S, SP: tl.constexpr, BITS: tl.constexpr):
        """The top-k cut key of row r (0: top-k off), replayed from the count partials."""
        k = tl.load(top_k + r)
        on = (k > 0) & (k < vocab)
        return tl.where(on, replay_count(cnt, r, tl.where(on, 32 // BITS, 0), (vocab - k).to(tl.int32), S, SP, BITS),
                        0)

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
    def digit_sums(row, lo, hi, m, lo_key, prefix, level, COUNT: tl.constexpr, MASS: tl.constexpr,
                   BLOCK: tl.constexpr, BITS: tl.constexpr, BY_DIGIT: tl.constexpr, SKIP: tl.constexpr):
        """Per digit of `level`: the count and the exp(x - m) mass of the entries in [lo, hi)
        whose key is >= lo_key and whose digits above `level` equal `prefix`. The accumulators
        are [2**BITS, BLOCK] (BY_DIGIT: each entry's digits in one thread) or [BLOCK, 2**BITS]
        (the 2026-12-06 form: each entry's digit and mass go to 2**BITS threads through shared
        memory); SKIP: blocks with no entry under the prefix add nothing (a block reduction)."""
        bins = tl.arange(0, 1 << BITS)
        # (the compiler folds a constexpr `if` statement, not a constexpr `a if c else b`)
        if BY_DIGIT:
            cnt = tl.zeros([1 << BITS, BLOCK], dtype=tl.int32)
            mass = tl.zeros([1 << BITS, BLOCK], dtype=tl.float32)
        else:
            cnt = tl.zeros([BLOCK, 1 << BITS], dtype=tl.int32)
            mass = tl.zeros([BLOCK, 1 << BITS], dtype=tl.float32)
        shift = 32 - BITS * (level + 1)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < hi, other=float("-inf"))
            key = keys_of(x)
            t = key >> shift  # then >> BITS: a uint32 shifted by 32 (the first level) is undefined
            hit = (offs < hi) & (key >= lo_key) & ((t >> BITS) == prefix)
            any_hit = True
            if SKIP:
                any_hit = tl.max(hit.to(tl.int32), axis=0) > 0
            if any_hit:
                digit = tl.where(hit, (t & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS)
                w = tl.exp(x - m)
                if BY_DIGIT:
                    onehot = bins[:, None] == digit[None, :]
                    w2 = w[None, :]
                else:
                    onehot = digit[:, None] == bins[None, :]
                    w2 = w[:, None]
                if COUNT:
                    cnt = tl.where(onehot, cnt + 1, cnt)
                if MASS:
                    mass = tl.where(onehot, mass + w2, mass)
        if BY_DIGIT:
            c = tl.sum(cnt, axis=1)
            ms = tl.sum(mass, axis=1)
        else:
            c = tl.sum(cnt, axis=0)
            ms = tl.sum(mass, axis=0)
        return c, ms

    @triton.jit
    def seg_count(scores, stride, vocab, seg, S, pmax, parg, pnan, greedy, top_k, cnt, level,
                  SP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BY_DIGIT: tl.constexpr,
                  SKIP: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        k = tl.load(top_k + r)
        if (tl.load(greedy + r) == 0) & (k > 0) & (k < vocab):  # most rows leave here, reading no partials
            top, top_at, bad = row_max(pmax, parg, pnan, r, S, SP)
            if not bad:
                prefix = replay_count(cnt, r, level, (vocab - k).to(tl.int32), S, SP, BITS)
                row = scores + r.to(tl.int64) * stride
                c, c_mass = digit_sums(row, s * seg, tl.minimum(s * seg + seg, vocab), 0.0, 0, prefix, level,
                                       True, False, BLOCK, BITS, BY_DIGIT, SKIP)
                at = ((r * (32 // BITS) + level) * S + s) * (1 << BITS)
                tl.store(cnt + at + tl.arange(0, 1 << BITS), c)

    @triton.jit
    def seg_mass(scores, stride, vocab, seg, S, pmax, parg, pnan, greedy, top_k, top_p, cnt, mass, ties, level,
                 SP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BY_DIGIT: tl.constexpr,
                 SKIP: tl.constexpr, LAST: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        p = tl.load(top_p + r)
        m, m_at, bad = row_max(pmax, parg, pnan, r, S, SP)
        if (not bad) & (tl.load(greedy + r) == 0) & ((p < 1.0) | (level == 0)):
            lo_key = row_cut(cnt, top_k, r, vocab, S, SP, BITS)
            prefix = replay_mass(mass, r, level, p, S, SP, BITS)
            row = scores + r.to(tl.int64) * stride
            # LAST (level == 32 // BITS - 1, a constexpr: counting costs as much as the mass)
            c, ms = digit_sums(row, s * seg, tl.minimum(s * seg + seg, vocab), m, lo_key, prefix, level,
                               LAST, True, BLOCK, BITS, BY_DIGIT, SKIP)
            at = ((r * (32 // BITS) + level) * S + s) * (1 << BITS) + tl.arange(0, 1 << BITS)
            tl.store(mass + at, ms)
            if LAST:
                tl.store(ties + (r * S + s) * (1 << BITS) + tl.arange(0, 1 << BITS), c)

    @triton.jit
    def top_p_segments(mass, ties, r, p, m, S, SP: tl.constexpr, BITS: tl.constexpr):
        """(v*, each segment's kept mass, each segment's dropped entries equal to v*) from the
        mass partials: at every level the digits above the chosen one hold entries above v*."""
        segs = tl.arange(0, SP)
        digits = tl.arange(0, 1 << BITS)
        m0, m0_tile = level_sums(mass, r, 0, S, SP, BITS)
        q = (1.0 - p) * tl.sum(m0, axis=0)
        prefix = tl.zeros([], dtype=tl.uint32)
        kept = tl.zeros([SP], dtype=tl.float32)
        below = tl.zeros([], dtype=tl.float32)
        d = tl.zeros([], dtype=tl.int32)
        for level in range(32 // BITS):
            ms, tile = level_sums(mass, r, level, S, SP, BITS)
            d = mass_digit(ms, below, q, BITS)
            below += tl.sum(tl.where(digits < d, ms, 0.0), axis=0)
            kept += tl.sum(tl.where(digits[None, :] > d, tile, 0.0), axis=1)
            prefix = (prefix << BITS) | d.to(tl.uint32)
        e_v = tl.exp(value_of(prefix) - m)
        at = (r * S + segs[:, None]) * (1 << BITS) + digits[None, :]
        tie_tile = tl.load(ties + at, mask=(segs < S)[:, None], other=0)
        seg_ties = tl.sum(tl.where(digits[None, :] == d, tie_tile, 0), axis=1)
        # ties of v* go by id, lowest first: the first `drop` of them (over the segments in order)
        room = tl.where(e_v > 0, (q - below) / e_v, 0.0)
        drop = tl.minimum(tl.maximum(tl.minimum(room, 2e9).to(tl.int32), 0), tl.sum(seg_ties, axis=0) - 1)
        before = tl.cumsum(seg_ties, axis=0) - seg_ties
        dropped_here = tl.minimum(tl.maximum(drop - before, 0), seg_ties)
        return prefix, kept + (seg_ties - dropped_here).to(tl.float32) * e_v, dropped_here

    @triton.jit
    def seg_draw(scores, stride, vocab, seg, S, pmax, parg, pnan, greedy, top_k, top_p, u, cnt, mass, ties, out,
                 SP: tl.constexpr, SCAN: tl.constexpr, BITS: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        p = tl.load(top_p + r)
        m, arg, bad = row_max(pmax, parg, pnan, r, S, SP)
        token = tl.where(bad, 0, arg)
        mine = s == 0  # who writes the token when no scan is needed
        if (not bad) & (tl.load(greedy + r) == 0):
            segs = tl.arange(0, SP)
            cut_key = row_cut(cnt, top_k, r, vocab, S, SP, BITS)
            m0_sum, m0 = level_sums(mass, r, 0, S, SP, BITS)
            kept = tl.sum(m0, axis=1)  # p = 1: everything at or above the top-k cut
            dropped_here = tl.zeros([SP], dtype=tl.int32)
            if p < 1.0:
                cut_key, kept, dropped_here = top_p_segments(mass, ties, r, p, m, S, SP, BITS)
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
                warps: int = 8, bits: int = _BITS, by_digit: bool = True, skip_bits: int = _SKIP_BITS
                ) -> torch.Tensor:
    """One token id per row (int64 [n]) from float32 scores [n, V] (after penalty and temperature),
    the rows' top-k (int64), top-p (float32), greedy flags and uniforms (float64). `segments`
    (default `segments_for`), `block`, `scan`, `warps`, `bits` (2, 4 or 8), `by_digit` and
    `skip_bits` (32: never skip; see `digit_sums`): the launches' shape, for
    tools/probes/sampler_parts.py to time others (the same tokens up to rounding)."""
    n, vocab = scores.shape
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"need float32 scores with unit stride, got {scores.dtype}, strides {scores.stride()}")
    if bits not in (2, 4, 8):
        raise ValueError(f"need 2, 4 or 8 bits a radix pass, got {bits}")
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    if not n:
        return out
    S = segments or segments_for(vocab)
    per = -(-vocab // S)
    seg = -(-per // block) * block  # a whole number of blocks a segment
    S = -(-vocab // seg)
    SP = triton.next_power_of_2(S)
    levels, bins = 32 // bits, 1 << bits
    dev = scores.device
    pmax = torch.empty(n * S, dtype=torch.float32, device=dev)
    parg = torch.empty(n * S, dtype=torch.int32, device=dev)
    pnan = torch.empty(n * S, dtype=torch.int32, device=dev)
    cnt = torch.zeros(n * levels * S * bins, dtype=torch.int32, device=dev)
    mass = torch.zeros(n * levels * S * bins, dtype=torch.float32, device=dev)
    ties = torch.zeros(n * S * bins, dtype=torch.int32, device=dev)
    grid = (n, S)
    row = (scores, scores.stride(0), vocab, seg, S, pmax, parg, pnan)
    shape = dict(SP=SP, BLOCK=block, BITS=bits, BY_DIGIT=by_digit, num_warps=warps)
    seg_max[grid](*row, SCAN=scan, num_warps=warps)
    for level in range(levels):
        skip = level * bits >= skip_bits
        seg_count[grid](*row, greedy, top_k, cnt, level, SKIP=skip, **shape)
    for level in range(levels):
        skip = level * bits >= skip_bits
        seg_mass[grid](*row, greedy, top_k, top_p, cnt, mass, ties, level, SKIP=skip, LAST=level == levels - 1,
                       **shape)
    seg_draw[grid](*row, greedy, top_k, top_p, u, cnt, mass, ties, out, SP=SP, SCAN=scan, BITS=bits, num_warps=warps)
    return out
