"""Prefix caching's chunked prefill: a step's rows run through the node's `run_graphed` in pieces
that end at absolute positions that are multiples of the prefix chunk.

Why: on a GPU the kernels a step runs depend on its shapes (cuBLAS picks tiles and split-K by
the row count M, FlashInfer its split-KV schedule by the query and key counts), and another
kernel changes the last bits of a result. A prefix-cache hit computes only the rows after its
cached tokens; for them to come out as its miss computes them, both must compute them in the
same pieces. So with prefix caching on, the conductor rounds a hit's cached length down to a
multiple of the chunk C (`KVPages.reserve`) and marks a keyed causal prefill with
`KVSlots.chunk` = C; here each such entry's rows [start, start + q_len) are cut at the
multiples of C, and each piece runs alone: the node's tensor function over the piece's rows,
attending through the piece's own metadata (q_len its rows, kv_len its end: the pages the
pieces before it wrote, and its own rows) and writing its own slots. A miss and a hit then
run every piece from the hit's first uncached boundary on with the same rows, keys and
kernels: the suffix's K/V, the logits and the draws are the same bits. The entries without a
chunk (decodes, unkeyed prefills, not-kept or non-causal queries) run together as one more piece, after them.

Every layer of a piece runs before the next piece starts, so a piece sees, in every layer,
the K/V the pieces before it wrote. That is why the cut is made around `fn`, the node's
row-wise tensor function (`AttentionContext.run_graphed`: packed per-token inputs and outputs,
its only attention `attn.attend`): cutting its rows changes nothing but the shapes its kernels
see. Attention a node runs outside `run_graphed` covers the whole step, as without a chunk.
A step that is one piece anyway (one entry, one chunk) runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar_runtime.kv.attention import AttentionMetadata
from mstar_runtime.ops.node import NodeError


@dataclass(frozen=True)
class Piece:
    """One part of a step run apart: its rows of the step's packed rows ([lo, hi) ranges in
    order), their attention metadata and their pool slots."""

    rows: tuple[tuple[int, int], ...]
    meta: AttentionMetadata
    slots: list[int]

    @property
    def num_rows(self) -> int:
        return sum(hi - lo for lo, hi in self.rows)


def chunk_spans(start: int, q_len: int, chunk: int) -> list[tuple[int, int]]:
    """The absolute positions [a, b) of an entry's rows, cut at the multiples of `chunk`."""
    spans, a, end = [], start, start + q_len
    while a < end:
        b = min(end, (a // chunk + 1) * chunk)
        spans.append((a, b))
        a = b
    return spans


def plan_pieces(kvs: Sequence[Any]) -> list[Piece] | None:
    """The pieces of a step whose attending entries (`KVSlots` with q_len > 0, in packed order)
    are `kvs`: every chunk of every entry with a `chunk`, then the other entries together;
    None when that is one piece (the step runs whole)."""
    pieces: list[Piece] = []
    rest: list[tuple[int, Any]] = []
    row = 0
    for kv in kvs:
        if kv.chunk:
            for a, b in chunk_spans(kv.start, kv.q_len, kv.chunk):
                lo = row + a - kv.start
                meta = AttentionMetadata.build([b - a], [b], [kv.page_table], [kv.mask], [kv.block_size])
                pieces.append(Piece(((lo, lo + b - a),), meta, kv.slots[a - kv.start : b - kv.start]))
        else:
            rest.append((row, kv))
        row += kv.q_len
    if not pieces or len(pieces) + (1 if rest else 0) == 1:
        return None
    if rest:
        others = [kv for _, kv in rest]
        meta = AttentionMetadata.build([kv.q_len for kv in others], [kv.start + kv.q_len for kv in others],
                                       [kv.page_table for kv in others], [kv.mask for kv in others],
                                       [kv.block_size for kv in others])
        pieces.append(Piece(tuple((r, r + kv.q_len) for r, kv in rest), meta, [s for kv in others for s in kv.slots]))
    return pieces


class ChunkedRows:
    """The step's `attn.graph_runner` when it runs in pieces: `(fn, *tensors)` runs `fn` once
    per piece over the piece's rows, `use(meta, slots)` pointing the step's attention at the
    piece first (and `use(None, ())` back at the whole step after the last), and returns `fn`'s
    outputs (a tensor, a tuple or a dict of them, a row per input row) put back in the step's
    row order."""

    def __init__(self, name: str, pieces: list[Piece], rows: int,
                 use: Callable[[AttentionMetadata | None, Sequence[int]], None]):
        self.name, self.pieces, self.rows, self.use = name, pieces, rows, use
        self.calls = 0  # run_graphed calls served in pieces (tests, probes)

    def __call__(self, fn: Callable[..., Any], *tensors: torch.Tensor, names: tuple[str, ...] | None = None) -> Any:
        del names  # each piece runs fn itself: nothing is captured that the names could contradict
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != self.rows:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise NodeError(f"node '{self.name}': run_graphed input {i} must be a tensor with one row per "
                                f"token of the step ({self.rows}), got {got}")
        outs: list[tuple[torch.Tensor, ...]] = []
        single = False
        keys: list[str] | None = None  # a dict's keys: its values are joined as a tuple's
        try:
            for piece in self.pieces:
                self.use(piece.meta, piece.slots)
                out = fn(*(_take(t, piece.rows) for t in tensors))
                if isinstance(out, Mapping):
                    keys, out = list(out), tuple(out.values())
                single = not isinstance(out, tuple)
                outs.append(self._checked((out,) if single else out, piece.num_rows))
        finally:
            self.use(None, ())
        self.calls += 1
        # each output's rows in the step's order: the pieces' row ranges sorted by their start
        at = sorted((lo, hi, j, off) for j, piece in enumerate(self.pieces)
                    for (lo, hi), off in zip(piece.rows, _offsets(piece.rows)))
        merged = tuple(torch.cat([outs[j][k][off : off + hi - lo] for lo, hi, j, off in at])
                       for k in range(len(outs[0])))
        if keys is not None:
            return dict(zip(keys, merged, strict=True))
        return merged[0] if single else merged

    def _checked(self, out: tuple[Any, ...], rows: int) -> tuple[torch.Tensor, ...]:
        for t in out:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise NodeError(f"node '{self.name}': a run_graphed output must be a tensor with one row per "
                                f"input row ({rows}), got {got}")
        return out


def _offsets(rows: tuple[tuple[int, int], ...]) -> list[int]:
    """Where each range's rows start in a piece's own (concatenated) rows."""
    out, at = [], 0
    for lo, hi in rows:
        out.append(at)
        at += hi - lo
    return out


def _take(t: torch.Tensor, rows: tuple[tuple[int, int], ...]) -> torch.Tensor:
    if len(rows) == 1:
        return t[rows[0][0] : rows[0][1]]
    return torch.cat([t[lo:hi] for lo, hi in rows])
