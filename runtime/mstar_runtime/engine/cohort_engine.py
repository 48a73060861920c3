"""A cohort's device state on its KV engine, and one step over all of its rows.

`CohortColumns` is the worker-side half of a decode cohort (the conductor-side half, which
owns membership and events, is runtime/mstar_runtime/control/cohort.py). It holds, for up
to `rows` requests of one marked loop:

- the rows' block tables (`kv.block_table.BlockTable`) and context lengths, on the device
  with a host mirror (numpy); a table is written when a row joins, moves or gains a page;
- the fed-back inputs: a step reads them first and overwrites them with the outputs that
  feed the next iteration at its end (the host moves rows between steps, in stream order);
- the loop-invariant inputs and the node's own columns (`CohortPhase.join`).

A step (`step(n)`) runs the node's `CohortPhase.step` over rows 0..n-1 (the conductor keeps
rows dense): positions are the lengths, each row's new K/V (one token, or the phase's block
of `tokens`) goes to the slots its table gives, attention is one call for all rows. On a GPU with FlashInfer and a scratch page
(`CohortGraphs`), the whole step -- forward, sampling, stop flags, the fed-back copy, the
K/V append, the length update, a chain's later link putting back the node columns of the
rows it holds (`hold`) -- is one CUDA graph per batch bucket, padded with rows that
touch only the scratch page; elsewhere it runs eagerly over exactly n rows with
`decode_attention`. Every output port comes back in one packed `Readback` per dtype class
(integers, floats), read by the conductor one step late.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar_runtime.kv.attention import AttentionMetadata, KVPool, paged_attention
from mstar_runtime.kv.block_table import BlockTable, decode_attention, pinned
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, count_key
from mstar_runtime.ops.node import NodeError, RequestError
from mstar_runtime.ops.readback import Readback


@dataclass(frozen=True)
class CohortShape:
    """What a marked loop's call looks like to its cohort (from the plan's `cohort` mark)."""

    phase: str
    fed: tuple[tuple[str, str], ...]  # (input port, output port that feeds it)
    invariant: tuple[str, ...]  # loop-invariant input ports
    outputs: tuple[str, ...]  # every output port of the phase, in the plan's order
    reads: tuple[CohortRead, ...] = ()  # the contexts the phase reads, in its `reads` order
    index: tuple[str, ...] = ()  # input ports bound to the loop's index: a column from 0, +1 a step


@dataclass(frozen=True, slots=True)
class CohortRead:
    """A KV context every row of a cohort reads (its own request's `node@tag`), read-only."""

    node: str
    tag: str
    max_pages: int  # pages such a context spans at most (its tag's `max_len`, else the node's)


class ReadColumns:
    """Row tables and lengths of one read context: written at join, moved with the row, never grown."""

    def __init__(self, pool: KVPool, rows: int, max_pages: int, device: torch.device, fill_page: int):
        self.pool = pool
        self.table = BlockTable(rows, max_pages, device, fill_page=fill_page)
        self.host_lens = np.zeros(rows, dtype=np.int64)
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)

    def set_rows(self, first: int, rows: Sequence[tuple[Sequence[int], int]]) -> None:
        """(pages, length) of rows `first`, `first + 1`, ...: one upload for the tables, one for the lengths."""
        end = first + len(rows)
        self.table.set_rows(first, [pages for pages, _ in rows])
        self.host_lens[first:end] = [length for _, length in rows]
        self.lens[first:end].copy_(pinned(self.host_lens[first:end]), non_blocking=True)

    def move(self, src: int, dst: int) -> None:
        self.table.move_row(src, dst)
        self.host_lens[dst] = self.host_lens[src]
        self.lens[dst] = self.lens[src]


@dataclass(frozen=True, slots=True)
class JoinRow:
    """One request joining a cohort (`CohortColumns.join_rows`; the worker's `cohort_join`
    finds its node state by `request_id` and `tag`, and a refusal names `request_id`)."""

    request_id: str
    tag: str
    fed: Mapping[str, Any]  # fed input port -> its value for the first step
    invariant: Mapping[str, Any]  # loop-invariant input port -> value
    pages: Sequence[int]  # its own context's page table
    length: int  # and that context's tokens
    steps: int | None = None  # the most steps its loop may run (None: the cohort's bound)
    tokens: int = 1  # KV tokens each of its steps adds
    reads: Sequence[tuple[Sequence[int], int]] = ()  # (pages, length) of each context it reads, in `reads` order


# per column name: the column (made for the first joining row where the cohort has none yet)
# and each joining row's value, in row order
_Values = dict[str, tuple[torch.Tensor, list[torch.Tensor]]]


def _write_rows(dst: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
    """`dst[i] = values[i]` (already of `dst`'s dtype) in one copy: host values for a GPU
    column stacked into one pinned buffer, so that the upload waits for no step in flight;
    values on the column's device stacked straight into it."""
    if dst.is_cuda and all(v.device.type == "cpu" for v in values):
        src = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
        torch.stack(list(values), out=src)
        dst.copy_(src, non_blocking=True)
    else:
        torch.stack([v.to(dst.device, non_blocking=True) for v in values], out=dst)


@dataclass
class CohortResult:
    """One step's outputs as packed readbacks; `arrays()` gives port -> numpy `[n, width]`.

    A step that ran in a worker process comes back later: `fetch` then gives its result (the
    answer's readback, received on first use; runtime/mstar_runtime/worker/remote_cohort.py)."""

    n: int
    layout: list[tuple[str, bool, int]]  # (key, is float, width), in packing order
    ints: Readback | None
    floats: Readback | None
    index: int = 0  # the cohort's step index (set by the conductor's Cohort)
    fetch: Callable[[], CohortResult] | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        if self.fetch is not None:
            got, self.fetch = self.fetch(), None
            self.layout, self.ints, self.floats = got.layout, got.ints, got.floats
        out: dict[str, np.ndarray] = {}
        packed = {False: self.ints, True: self.floats}
        at = {False: 0, True: 0}
        host = {k: (rb.array().reshape(self.n, -1) if rb is not None else None) for k, rb in packed.items()}
        for key, is_float, width in self.layout:
            block = host[is_float]
            assert block is not None
            out[key] = block[:, at[is_float]: at[is_float] + width]
            at[is_float] += width
        return out


def _block_attention(pool: KVPool, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                     offsets: torch.Tensor, mask: torch.Tensor, rows: int, q_len: int, scale: float | None) -> torch.Tensor:
    """Each row's Q queries over its read context's tokens (`pages`/`offsets` `[rows, K]`,
    `mask` `[rows, K + Q]`) and the block's own K/V, in one softmax, in float32 (as the generic
    step's read attention); pure tensor code (captured inside a cohort graph)."""
    heads, dim = q.shape[1], q.shape[2]
    kvh = k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    data = pool.data[layer]
    keys = torch.cat([data[pages, 0, offsets].to(compute), k.reshape(rows, q_len, kvh, dim).to(compute)], dim=1)
    values = torch.cat([data[pages, 1, offsets].to(compute), v.reshape(rows, q_len, kvh, dim).to(compute)], dim=1)
    out = F.scaled_dot_product_attention(
        q.reshape(rows, q_len, heads, dim).to(compute).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=heads != kvh)
    return out.transpose(1, 2).reshape(rows * q_len, heads, dim).to(q.dtype)


def _pack(outputs: Mapping[str, torch.Tensor], keys: Sequence[str], n: int) -> tuple[list, Any, Any]:
    """The outputs as one int64 and one float32 tensor `[n, width]` (None when there is none), and their layout."""
    ints, floats, layout = [], [], []
    for key in keys:
        t = outputs[key].reshape(n, -1)
        is_float = t.dtype.is_floating_point
        (floats if is_float else ints).append(t.float() if is_float else t.long())
        layout.append((key, is_float, t.shape[1]))
    return layout, torch.cat(ints, dim=1) if ints else None, torch.cat(floats, dim=1) if floats else None


class CohortColumns:
    """The device columns of one cohort on one KV engine (see the module docstring)."""

    def __init__(self, pool: KVPool, phase: CohortPhase, shape: CohortShape, rows: int, max_pages: int,
                 device: torch.device, *, scale: float | None, node: str = "?", q_heads: int = 0,
                 graphs: CohortGraphs | None = None, eager_attention: Any = None,
                 read_pools: Sequence[KVPool] = (), eager_reads: Sequence[Any] = ()):
        """`read_pools`: the pool of each context the phase reads (`shape.reads` order);
        `eager_reads`: a FlashInferCohortDecode per read for eager GPU steps (None entries, or
        none at all: `decode_attention`)."""
        if len(read_pools) != len(shape.reads):
            raise NodeError(f"node '{node}': phase '{shape.phase}' reads {len(shape.reads)} contexts, "
                            f"got {len(read_pools)} pools")
        self.pool, self.cphase, self.shape, self.rows = pool, phase, shape, rows
        self.tokens = phase.tokens  # KV tokens a row adds per step (or, not `keep`, attends as a block)
        self.keep = phase.keep
        self.device, self.scale, self.node, self.q_heads = device, scale, node, q_heads
        self.graphs = graphs  # capture and replay per batch bucket (a GPU with FlashInfer), or None: eager
        self.eager_attention = eager_attention  # a FlashInferCohortDecode for eager GPU steps, or None
        fill = graphs.scratch_page if graphs is not None else 0
        self.table = BlockTable(rows, max_pages, device, fill_page=fill)
        self.host_lens = np.zeros(rows, dtype=np.int64)
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.fed: dict[str, torch.Tensor] = {}  # read at a step's start, overwritten at its end
        self.inv: dict[str, torch.Tensor] = {}
        self.cols: dict[str, torch.Tensor] = {}
        self.index = {port: torch.zeros(rows, dtype=torch.long, device=device) for port in shape.index}
        self.n = 0
        self.n_dev = torch.zeros((), dtype=torch.long, device=device)  # active rows, for padded (graphed) steps
        self._keys: list[str] | None = None
        self._arange = torch.arange(max(rows, self.tokens), device=device)
        self.reads = [ReadColumns(p, rows, r.max_pages, device, 0) for r, p in zip(shape.reads, read_pools, strict=True)]
        # every token position a read table spans (attend_block gathers them all, masked by length)
        self._read_pos = [torch.arange(rc.table.max_pages * rc.pool.page_size, device=device) for rc in self.reads]
        self.eager_reads = list(eager_reads) or [None] * len(self.reads)
        # a chain's link (engine/cohort_chain.py): input ports taken from an earlier link's
        # output of the same step (that link's columns, its port), and the output ports this
        # step leaves in `exports` ([rows, ...], made on its first step) for later links
        self.imports: dict[str, tuple[CohortColumns, str]] = {}
        self.export_ports: set[str] = set()
        self.exports: dict[str, torch.Tensor] = {}
        # a chain's later link: the rows ([rows] bool, the chain's `stopped`) whose node columns
        # a step leaves as it found them (their outputs are computed, never applied), or None
        self.hold: torch.Tensor | None = None

    # ------------------------------------------------------------------ rows
    def join(self, row: int, state: dict[str, Any], fed: Mapping[str, Any], invariant: Mapping[str, Any],
             pages: Sequence[int], length: int, steps: int | None = None, tokens: int = 1,
             reads: Sequence[tuple[Sequence[int], int]] = ()) -> None:
        """One row's `join_rows` (its refusals, and what it writes)."""
        self.join_rows(row, [JoinRow("", "", fed, invariant, pages, length, steps, tokens, reads)], [state])

    def join_rows(self, first: int, rows: Sequence[JoinRow], states: Sequence[dict[str, Any]]) -> None:
        """Write the joining rows at `first`, `first + 1`, ... (rows join at the end: the
        conductor keeps them dense), each with its node state in `states`: its table, length,
        fed and invariant inputs, node columns (`CohortPhase.join`, run per row) and the
        (pages, length) of each context it reads, every column in one upload for all rows.

        Every row is checked before anything is written, so a refusal leaves the cohort as it
        was: RequestError (with `request_ids`, the refused row's) when a step of a row adds
        other than the phase's `tokens` (the conductor reserves pages for `tokens`), its
        loop's `steps` are more than the phase's `limit` lets it run, a context it reads is
        missing, empty or larger than the cohort holds, or the node's join refuses it;
        NodeError when a value's shape is not its column's (or another joining row's)."""
        if len(states) != len(rows):
            raise NodeError(f"node '{self.node}': {len(rows)} joining rows with {len(states)} node states")
        if first < 0 or first + len(rows) > self.rows:
            raise NodeError(f"node '{self.node}': rows {first}..{first + len(rows) - 1} join a cohort of "
                            f"{self.rows} rows")
        if not rows:
            return
        fed, inv, cols = self._checked_rows(rows, states)
        end = first + len(rows)
        self.table.set_rows(first, [r.pages for r in rows])
        self.host_lens[first:end] = [r.length for r in rows]
        self.lens[first:end].copy_(pinned(self.host_lens[first:end]), non_blocking=True)
        for j, rc in enumerate(self.reads):
            rc.set_rows(first, [r.reads[j] for r in rows])
        for store, values in ((self.fed, fed), (self.inv, inv), (self.cols, cols)):
            for name, (col, column) in values.items():
                store[name] = col
                _write_rows(col[first:end], column)
        for col in self.index.values():
            col[first:end].zero_()
        self.n = end

    def _checked_rows(self, rows: Sequence[JoinRow], states: Sequence[dict[str, Any]]) -> tuple[_Values, _Values, _Values]:
        """Each row checked (join_rows' refusals) and its node columns made; per store, each
        name's column (made here when new) and its rows' values. Writes nothing."""
        fed: _Values = {}
        inv: _Values = {}
        cols: _Values = {}
        for row, state in zip(rows, states, strict=True):
            try:
                self._check_row(row, state)
                with torch.inference_mode():
                    joined = self.cphase.join(state, row.invariant)
            except RequestError as e:
                if getattr(e, "request_ids", None) is None and row.request_id:
                    e.request_ids = [row.request_id]  # type: ignore[attr-defined]
                raise
            for store, values, target in ((self.fed, row.fed, fed), (self.inv, row.invariant, inv),
                                          (self.cols, joined, cols)):
                for name, value in values.items():
                    self._take(store, target, name, value, row.request_id)
        return fed, inv, cols

    def _check_row(self, row: JoinRow, state: dict[str, Any]) -> None:
        self._check_reads(row.reads)
        if row.tokens != self.tokens:
            raise RequestError(f"node '{self.node}': a row of {row.tokens}-token steps, phase '{self.shape.phase}' "
                               f"adds {self.tokens} a step")
        if self.cphase.limit is not None and row.steps is not None:
            room = self.cphase.limit(state, row.invariant)
            if row.steps > room:
                raise RequestError(f"node '{self.node}': a row of {row.steps} steps, its context has room for {room}")

    def _take(self, store: dict[str, torch.Tensor], target: _Values, name: str, value: Any, request_id: str) -> None:
        """One row's value of column `name`, as the column's dtype, added to `target`; a column
        the cohort does not hold yet is made (not yet stored) from the first row's value."""
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if name not in target:
            col = store.get(name)
            if col is None:
                col = torch.zeros((self.rows, *t.shape), dtype=t.dtype, device=self.device)
            target[name] = (col, [])
        col, column = target[name]
        if tuple(col.shape[1:]) != tuple(t.shape):
            whose = f" (request '{request_id}')" if request_id else ""
            raise NodeError(f"cohort column '{name}': a row of shape {tuple(t.shape)}{whose}, the column holds "
                            f"{tuple(col.shape[1:])}")
        column.append(t if t.dtype == col.dtype else t.to(dtype=col.dtype))

    def _check_reads(self, reads: Sequence[tuple[Sequence[int], int]]) -> None:
        if len(reads) != len(self.reads):
            raise RequestError(f"node '{self.node}': a row reading {len(reads)} contexts, phase '{self.shape.phase}' "
                               f"reads {len(self.reads)}")
        for spec, rc, (pages, length) in zip(self.shape.reads, self.reads, reads, strict=True):
            where = f"node '{self.node}' reads {spec.node}@{spec.tag}"
            if length < 1:
                raise RequestError(f"{where}, which is empty")
            if len(pages) > rc.table.max_pages or len(pages) * rc.pool.page_size < length:
                raise RequestError(f"{where}: {length} tokens in {len(pages)} pages, the cohort holds "
                                   f"{rc.table.max_pages} pages of {rc.pool.page_size}")

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s whole state to row `dst` (the conductor keeps rows dense)."""
        self.table.move_row(src, dst)
        self.host_lens[dst] = self.host_lens[src]
        self.lens[dst] = self.lens[src]
        for rc in self.reads:
            rc.move(src, dst)
        for store in (self.fed, self.inv, self.cols, self.index):
            for col in store.values():
                col[dst].copy_(col[src])

    def leave(self, row: int, state: dict[str, Any], steps: int) -> None:
        """Write the row's columns back into its node state (`steps`: the steps it ran)."""
        with torch.inference_mode():  # the node's states are inference tensors (made in its phases)
            self.cphase.leave(state, {name: col[row].clone() for name, col in self.cols.items()}, steps)

    def add_pages(self, rows: np.ndarray, cols: np.ndarray, pages: np.ndarray) -> None:
        self.table.add_pages(rows, cols, pages)

    # ------------------------------------------------------------------ the step
    def step(self, n: int) -> CohortResult:
        """One step of rows 0..n-1; returns its outputs as readbacks (not waited for)."""
        if n < 1 or n > self.rows:
            raise NodeError(f"node '{self.node}': a cohort step of {n} rows (capacity {self.rows})")
        graphs = self.graphs
        bucket = graphs.bucket(n) if graphs is not None else None
        if bucket is None:
            fi = self.eager_attention
            if fi is not None:
                fi.plan(*self.table.flashinfer_arrays(self.host_lens[:n] + self.tokens, self.pool.page_size))
            for rc, a in zip(self.reads, self.eager_reads, strict=True):
                if a is not None:
                    a.plan(*rc.table.flashinfer_arrays(rc.host_lens[:n], rc.pool.page_size))
            packed = self._body(n, n, eager=True, attention=fi, read_attention=self.eager_reads)
        else:
            self.n_dev.fill_(n)
            packed = graphs.replay(self, bucket, n)
        if self.keep:
            self.host_lens[:n] += self.tokens
        layout, ints, floats = packed
        return CohortResult(n, layout, Readback(ints[:n]) if ints is not None else None,
                            Readback(floats[:n]) if floats is not None else None)

    def _body(self, rows: int, n: int, *, eager: bool, attention: Any = None,
              read_attention: Sequence[Any] = ()) -> tuple[list, Any, Any]:
        """The step over `rows` rows (n of them real; the rest are pad rows that write and read
        only the scratch page): pure tensor code when not `eager`, so that it can be captured.
        `read_attention`: a planned attention per read context (None entries: `decode_attention`,
        eager steps only)."""
        pool, ps, q_len = self.pool, self.pool.page_size, self.tokens
        positions = self.lens[:rows]
        slots = active = None
        if self.keep:  # a phase that keeps nothing has no own pages: its rows write no slot
            ar = self._arange[:rows]
            at = positions[:, None] + self._arange[None, :q_len] if q_len > 1 else positions[:, None]  # [rows, Q]
            page = self.table.device[ar[:, None], (at // ps).clamp(max=self.table.max_pages - 1)].long()
            slots = page * ps + at % ps
            if not eager:
                active = ar < self.n_dev
                assert self.graphs is not None
                slots = torch.where(active[:, None], slots, self.graphs.scratch_page * ps + self._arange[:q_len] % ps)
            slots = slots.reshape(-1)  # row r's block at r*Q .. r*Q+Q-1
        table, scale = self.table.device, self.scale
        if eager:
            kv_lens = positions + q_len
            max_len = int(self.host_lens[:n].max()) + q_len

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not self.keep:
                raise NodeError(f"node '{self.node}': phase '{self.shape.phase}' keeps nothing; its step attends "
                                "through attend_block")
            pool.write(layer, k, v, slots)
            if attention is not None:
                return attention.run(q, layer)
            return decode_attention(q, pool, layer, table, kv_lens, max_len, scale, q_len)

        read_max = [int(rc.host_lens[:n].max()) if eager and n else 0 for rc in self.reads]

        def attend_to(layer: int, q: torch.Tensor, j: int = 0) -> torch.Tensor:
            if not self.keep:
                raise NodeError(f"node '{self.node}': phase '{self.shape.phase}' keeps nothing; its step attends "
                                "through attend_block")
            a = read_attention[j] if read_attention else None
            if a is not None:
                return a.run(q, layer)
            rc = self.reads[j]
            return decode_attention(q, rc.pool, layer, rc.table.device, rc.lens[:rows], read_max[j], scale, q_len)

        layouts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # read j -> its gather, once a step

        def attend_block(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, j: int = 0) -> torch.Tensor:
            if j not in layouts:
                layouts[j] = self._block_layout(j, rows, q_len)
            return _block_attention(self.reads[j].pool, layer, q, k, v, *layouts[j], rows, q_len, scale)

        inputs = {port: buf[:rows] for port, buf in self.fed.items()}
        inputs.update({port: col[:rows] for port, col in self.inv.items()})
        inputs.update({port: col[:rows] for port, col in self.index.items()})
        inputs.update({port: src.exports[out_port][:rows] for port, (src, out_port) in self.imports.items()})
        cols = {name: col[:rows] for name, col in self.cols.items()}
        hold = self.hold[:rows] if self.hold is not None and cols else None
        with torch.inference_mode():
            # on the device, captured with the step: no host wait, no launch outside the graph
            before = {name: col.clone() for name, col in cols.items()} if hold is not None else {}
            out = self.cphase.step(CohortStep(rows, inputs, cols, positions, attend, self.device,
                                              attend_to if self.reads else None,
                                              attend_block if self.reads else None,
                                              tuple(rc.lens[:rows] for rc in self.reads)))
            keys = self._keys or self._check(out)
            self._keys = keys
            for in_port, out_port in self.shape.fed:
                dst = self.fed[in_port][:rows]
                dst.copy_(out[out_port].reshape(dst.shape))
            for col in self.index.values():
                col[:rows].add_(1)
            for port in self.export_ports:
                self._export(port, out[port])
            if self.keep:  # else the block is thrown away: the row's context stays as it is
                self.lens[:rows] += q_len if active is None else active.long() * q_len
            packed = _pack(out, keys, rows)  # copies: the outputs are the step's, held rows' too
            for name, col in cols.items() if hold is not None else ():
                torch.where(hold.reshape(rows, *([1] * (col.dim() - 1))), before[name], col, out=col)
            return packed

    def _export(self, port: str, value: torch.Tensor) -> None:
        """Leave this step's `[rows, ...]` value of `port` where later links read it (a buffer of
        the cohort's capacity, made at the first step: a captured step writes and reads it in place)."""
        buf = self.exports.get(port)
        if buf is None or tuple(buf.shape[1:]) != tuple(value.shape[1:]) or buf.dtype != value.dtype:
            buf = self.exports[port] = torch.zeros((self.rows, *value.shape[1:]), dtype=value.dtype,
                                                   device=self.device)
        buf[: value.shape[0]].copy_(value)

    def _block_layout(self, j: int, rows: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read context j's gather for `attend_block`: every row's pages and offsets of all the
        positions its table spans, and the mask over them (< the row's length) and the block."""
        rc, pos = self.reads[j], self._read_pos[j]
        ps = rc.pool.page_size
        pages = rc.table.device[:rows][:, pos // ps].long()  # [rows, K]
        seen = pos[None, :] < rc.lens[:rows, None]
        mask = torch.cat([seen, torch.ones(rows, q_len, dtype=torch.bool, device=pos.device)], dim=1)
        return pages, pos % ps, mask

    def _check(self, out: Mapping[str, torch.Tensor]) -> list[str]:
        keys = []
        for port in self.shape.outputs:
            keys.append(port)
            if port in self.cphase.max_items:
                keys.append(count_key(port))
        missing = [k for k in keys if k not in out or not isinstance(out[k], torch.Tensor)]
        if missing:
            raise NodeError(f"node '{self.node}' cohort step of phase '{self.shape.phase}' lacks {', '.join(missing)}")
        return keys


class ReferenceCohortDecode:
    """A bucket's attention from the same planned host arrays as FlashInfer's graph decode
    (or, for blocks of `tokens`, its graph prefill), computed by `paged_attention` (the CPU
    tests of the padded step; never captured)."""

    def __init__(self, pool: KVPool, scale: float | None, tokens: int = 1):
        self.pool, self.scale, self.tokens = pool, scale, tokens
        self.meta: AttentionMetadata | None = None

    def plan(self, step: Any, q_heads: int) -> None:
        indptr, indices, last = step.indptr.tolist(), step.indices.tolist(), step.last_page_len.tolist()
        ps, q = self.pool.page_size, self.tokens
        if q > 1:
            assert step.qo_indptr.tolist() == list(range(0, q * len(last) + 1, q)), "Q queries per row"
        tables = [indices[a:b] for a, b in zip(indptr, indptr[1:])]
        self.meta = AttentionMetadata.build([q] * len(tables), [(len(t) - 1) * ps + x for t, x in zip(tables, last)],
                                            tables, "full" if q > 1 else "causal")

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        assert self.meta is not None, "plan() before run()"
        return paged_attention(q, self.pool, layer, self.meta, self.scale)


class CohortGraphs:
    """A cohort step captured as one CUDA graph per batch bucket (sampling, stop flags, the
    fed-back copy and the K/V append inside it), replayed with FlashInfer's graph decode
    planned from the block table's host mirror before each replay.

    Captured on the first step, every bucket largest first in one memory pool, with no row
    active (`n_dev` = 0: every row is a pad row writing the scratch page) and the columns
    saved and restored around the captures, so the warm-up runs change nothing real.

    A phase that reads other contexts gets, per bucket, one more attention per read context
    (`reads`: the scratch page of that context's pool and its attention factory), planned
    from the read tables before each replay as the row's own; pad rows read one token of the
    read pool's scratch page."""

    def __init__(self, buckets: list[int], scratch_page: int, make_attention: Any, *, capture: bool = True,
                 reads: Sequence[tuple[int, Any]] = ()):
        self.buckets = sorted(buckets)
        self.scratch_page = scratch_page
        # bucket, max_indices -> the bucket's attention: FlashInferGraphDecode, or ReferenceCohortDecode
        self.make_attention = make_attention
        self.reads = list(reads)
        # False: the same padded step, planned the same way, run eagerly (CPU tests check the bookkeeping)
        self.capture = capture
        self._graphs: dict[int, tuple[Any, tuple[list, Any, Any], Any, list[Any]]] = {}
        self._eager: dict[int, tuple[Any, list[Any]]] = {}
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def _attention(self, cols: CohortColumns, bucket: int) -> tuple[Any, list[Any]]:
        """A bucket's own attention and one per read context, unplanned (none for a block that
        keeps nothing: it attends by gathers, `attend_block`)."""
        if not cols.keep:
            return None, [None] * len(cols.reads)
        own = self.make_attention(bucket, bucket * max(cols.table.max_pages, -(-cols.tokens // cols.pool.page_size)))
        return own, [make(bucket, bucket * rc.table.max_pages) for (_, make), rc in zip(self.reads, cols.reads,
                                                                                       strict=True)]

    def _plan(self, cols: CohortColumns, attention: tuple[Any, list[Any]], bucket: int, n: int) -> None:
        """Plan the bucket's attention: rows 0..n-1 from the table's host mirror, the pad rows
        over Q tokens of the scratch page (as `graphs.pad_step` pads a fixed-block step); and
        each read's, the pad rows over one token of its pool's scratch page."""
        own, reads = attention
        if own is None:
            return
        q = cols.tokens
        self._plan_one(own, cols.table, cols.host_lens[:n] + q, cols.pool.page_size, self.scratch_page, q, q,
                       bucket, cols.q_heads)
        for (scratch, _), rc, a in zip(self.reads, cols.reads, reads, strict=True):
            self._plan_one(a, rc.table, rc.host_lens[:n], rc.pool.page_size, scratch, q, 1, bucket, cols.q_heads)

    @staticmethod
    def _plan_one(attention: Any, table: BlockTable, kv_lens: np.ndarray, ps: int, scratch: int, q: int,
                  pad_tokens: int, bucket: int, q_heads: int) -> None:
        indptr, indices, last = table.flashinfer_arrays(kv_lens, ps)
        n = kv_lens.shape[0]
        pad, pad_pages = bucket - n, -(-pad_tokens // ps)
        indptr = np.concatenate([indptr, indptr[-1] + pad_pages * np.arange(1, pad + 1, dtype=np.int32)])
        indices = np.concatenate([indices, np.full(pad * pad_pages, scratch, dtype=np.int32)])
        last = np.concatenate([last, np.full(pad, pad_tokens - (pad_pages - 1) * ps, dtype=np.int32)])
        qo = np.arange(0, (bucket + 1) * q, q, dtype=np.int32)
        host = pinned(np.concatenate([qo, indptr, indices, last]).astype(np.int32))
        a, m = bucket + 1, indices.shape[0]
        step = SimpleNamespace(qo_indptr=host[:a], indptr=host[a : 2 * a], indices=host[2 * a : 2 * a + m],
                               last_page_len=host[2 * a + m :])
        attention.plan(step, q_heads)

    def _capture(self, cols: CohortColumns) -> None:
        saved = [(t, t.clone()) for store in (cols.fed, cols.inv, cols.cols, cols.index) for t in store.values()]
        saved.append((cols.lens, cols.lens.clone()))
        cols.n_dev.fill_(0)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for b in sorted(self.buckets, reverse=True):
            attention = self._attention(cols, b)
            self._plan(cols, attention, b, 0)
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy inits (cuBLAS, FlashInfer JIT) must not happen inside the capture
                    cols._body(b, 0, eager=False, attention=attention[0], read_attention=attention[1])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outs = cols._body(b, 0, eager=False, attention=attention[0], read_attention=attention[1])
            self._graphs[b] = (graph, outs, *attention)
        for t, copy in saved:
            t.copy_(copy)

    def replay(self, cols: CohortColumns, bucket: int, n: int) -> tuple[list, Any, Any]:
        if not self.capture:
            attention = self._eager.get(bucket)
            if attention is None:
                attention = self._eager[bucket] = self._attention(cols, bucket)
            self._plan(cols, attention, bucket, n)
            self.replays += 1
            return cols._body(bucket, n, eager=False, attention=attention[0], read_attention=attention[1])
        if not self._graphs:
            self._capture(cols)
            cols.n_dev.fill_(n)
        graph, outs, own, reads = self._graphs[bucket]
        self._plan(cols, (own, reads), bucket, n)
        graph.replay()
        self.replays += 1
        return outs


__all__ = ["CohortColumns", "CohortGraphs", "CohortRead", "CohortResult", "CohortShape", "ReadColumns",
           "ReferenceCohortDecode"]
