"""A cohort's device state on its KV engine, and one step over all of its rows.

`CohortColumns` is the worker-side half of a decode cohort (the conductor-side half, which
owns membership and events, is runtime/mstar_runtime/control/cohort.py). It holds, for up
to `rows` requests of one marked loop:

- the rows' block tables (`kv.block_table.BlockTable`) and context lengths, on the device
  with a host mirror (numpy); a table is written when a row joins, moves or gains a page;
- the fed-back inputs, double-buffered: step i reads buffer i % 2 and writes the outputs
  that feed the next iteration into the other buffer, so a step never overwrites what it
  reads and the host may move rows between steps in stream order;
- the loop-invariant inputs and the node's own columns (`CohortPhase.join`).

A step (`step(n)`) runs the node's `CohortPhase.step` over rows 0..n-1 (the conductor keeps
rows dense): positions are the lengths, each row's new K/V goes to the slot its table
gives, attention is one call for all rows (FlashInfer's paged decode on a GPU, planned from
the host mirror; `decode_attention` elsewhere). Every output port comes back in one packed
`Readback` per dtype class (integers, floats), read by the conductor one step late.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar_runtime.kv.attention import KVPool
from mstar_runtime.kv.block_table import BlockTable, decode_attention
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, count_key
from mstar_runtime.ops.node import NodeError
from mstar_runtime.ops.readback import Readback


@dataclass(frozen=True)
class CohortShape:
    """What a marked loop's call looks like to its cohort (from the plan's `cohort` mark)."""

    phase: str
    fed: tuple[tuple[str, str], ...]  # (input port, output port that feeds it)
    invariant: tuple[str, ...]  # loop-invariant input ports
    outputs: tuple[str, ...]  # every output port of the phase, in the plan's order


@dataclass
class CohortResult:
    """One step's outputs as packed readbacks; `arrays()` gives port -> numpy `[n, width]`."""

    n: int
    layout: list[tuple[str, bool, int]]  # (key, is float, width), in packing order
    ints: Readback | None
    floats: Readback | None

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        packed = {False: self.ints, True: self.floats}
        at = {False: 0, True: 0}
        host = {k: (np.asarray(rb.values()).reshape(self.n, -1) if rb is not None else None) for k, rb in packed.items()}
        for key, is_float, width in self.layout:
            block = host[is_float]
            assert block is not None
            out[key] = block[:, at[is_float]: at[is_float] + width]
            at[is_float] += width
        return out


def _pack(outputs: Mapping[str, torch.Tensor], keys: Sequence[str], n: int) -> tuple[list, Readback | None, Readback | None]:
    ints, floats, layout = [], [], []
    for key in keys:
        t = outputs[key].reshape(n, -1)
        is_float = t.dtype.is_floating_point
        (floats if is_float else ints).append(t.float() if is_float else t.long())
        layout.append((key, is_float, t.shape[1]))
    rb_i = Readback(torch.cat(ints, dim=1)) if ints else None
    rb_f = Readback(torch.cat(floats, dim=1)) if floats else None
    return layout, rb_i, rb_f


class CohortColumns:
    """The device columns of one cohort on one KV engine (see the module docstring)."""

    def __init__(self, pool: KVPool, phase: CohortPhase, shape: CohortShape, rows: int, max_pages: int,
                 device: torch.device, *, scale: float | None, flashinfer: Any = None, node: str = "?"):
        self.pool, self.cphase, self.shape, self.rows = pool, phase, shape, rows
        self.device, self.scale, self.node = device, scale, node
        self.table = BlockTable(rows, max_pages, device)
        self.host_lens = np.zeros(rows, dtype=np.int64)
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.fed: list[dict[str, torch.Tensor]] = [{}, {}]
        self.inv: dict[str, torch.Tensor] = {}
        self.cols: dict[str, torch.Tensor] = {}
        self.parity = 0
        self.n = 0
        self.flashinfer = flashinfer  # a FlashInferCohortDecode on a GPU, or None
        self._keys: list[str] | None = None
        self._arange = torch.arange(rows, device=device)

    # ------------------------------------------------------------------ rows
    @staticmethod
    def _put(store: dict[str, torch.Tensor], name: str, row: int, value: Any, rows: int, device: torch.device) -> None:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if name not in store:
            store[name] = torch.zeros((rows, *t.shape), dtype=t.dtype, device=device)
        col = store[name]
        if tuple(col.shape[1:]) != tuple(t.shape):
            raise NodeError(f"cohort column '{name}': a row of shape {tuple(t.shape)}, the column holds {tuple(col.shape[1:])}")
        col[row].copy_(t.to(device=device, dtype=col.dtype))

    def join(self, row: int, state: dict[str, Any], fed: Mapping[str, Any], invariant: Mapping[str, Any],
             pages: list[int], length: int) -> None:
        """Write a joining request's table, length, fed and invariant inputs and node columns at `row`."""
        self.table.set_row(row, pages)
        self.host_lens[row] = length
        self.lens[row] = length
        for port, value in fed.items():
            for buf in self.fed:
                self._put(buf, port, row, value, self.rows, self.device)
        for port, value in invariant.items():
            self._put(self.inv, port, row, value, self.rows, self.device)
        with torch.inference_mode():
            joined = self.cphase.join(state, invariant)
        for name, value in joined.items():
            self._put(self.cols, name, row, value, self.rows, self.device)
        self.n = max(self.n, row + 1)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s whole state to row `dst` (the conductor keeps rows dense)."""
        self.table.move_row(src, dst)
        self.host_lens[dst] = self.host_lens[src]
        self.lens[dst] = self.lens[src]
        for store in (self.fed[self.parity], self.inv, self.cols):
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
        pool, ps = self.pool, self.pool.page_size
        positions = self.lens[:n]
        rows = self._arange[:n]
        pages = self.table.device[rows, positions // ps].long()
        slots = pages * ps + positions % ps
        kv_lens = positions + 1
        host_lens = self.host_lens[:n] + 1
        fi = self.flashinfer
        if fi is not None:
            fi.plan(*self.table.flashinfer_arrays(host_lens, ps))
        max_len = int(host_lens.max())
        table, scale = self.table.device, self.scale

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool.write(layer, k, v, slots)
            if fi is not None:
                return fi.run(q, layer)
            return decode_attention(q, pool, layer, table, kv_lens, max_len, scale)

        src = self.fed[self.parity]
        inputs = {port: buf[:n] for port, buf in src.items()}
        inputs.update({port: col[:n] for port, col in self.inv.items()})
        cols = {name: col[:n] for name, col in self.cols.items()}
        with torch.inference_mode():
            out = self.cphase.step(CohortStep(n, inputs, cols, positions, attend, self.device))
        keys = self._keys or self._check(out)
        self._keys = keys
        dst = self.fed[self.parity ^ 1]
        for in_port, out_port in self.shape.fed:
            dst[in_port][:n].copy_(out[out_port].reshape(dst[in_port][:n].shape))
        self.lens[:n] += 1
        self.host_lens[:n] += 1
        self.parity ^= 1
        layout, ints, floats = _pack(out, keys, n)
        return CohortResult(n, layout, ints, floats)

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


__all__ = ["CohortColumns", "CohortResult", "CohortShape"]
