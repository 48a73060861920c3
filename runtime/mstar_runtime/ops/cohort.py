"""The column-oriented node call of the cohort path: a KV phase offered as one step over all rows.

A steady-state loop that the compiler marks (`cohort` on a `loop` op: one KV call with
fed-back ports, stream pushes and emits; docs/plan-format.md) runs as a *cohort*: the
requests in the loop are rows of device-resident columns, and one step is one call of the
node's `CohortPhase.step` over every row at once (runtime/mstar_runtime/control/cohort.py
drives it; runtime/mstar_runtime/engine/cohort_engine.py owns the columns). A node offers a
phase this way through `KVNode.cohort_phase(phase)`; one that does not keeps the generic,
list-of-dicts call (`KVNode.run`), which stays for everything else. A node that writes a
phase only as a column step (no `phase_<name>` method) gets that call from it: `KVNode.run`
runs the step over the batch as a one-step cohort (ops/column_call.py), so a loop phase is
written once.

The contract, for a phase whose every entry adds one KV token (a decode), or a fixed block
of `tokens` (Q) tokens whose queries see the row's whole context and the whole block (no
causal mask inside it: V-JEPA's frame block, `CohortPhase.tokens`):

- `join(state, inputs) -> columns`: called once when a request enters the loop, with the
  request's per-(request, tag) node state (`attn.states[i]` of the generic path, written by
  its prefill) and its loop-invariant inputs. Returns the row's columns: name -> tensor (the
  row's own shape, no batch dim; host tensors are uploaded without a wait). Host work per
  request lives here. A `RequestError` declines the row: its loop runs on the generic path.
- `step(batch: CohortStep) -> outputs`: pure tensor code over `batch.n` rows: no host reads,
  no Python per row (so the engine can capture it in a CUDA graph). It reads the fed inputs
  (`batch.inputs[port]`, `[n, ...]`), may update its columns in place (`batch.cols[name]`,
  `[n, ...]` views), attends through `batch.attend(layer, q, k, v)` (Q queries per row, row
  r's at rows r*Q .. r*Q+Q-1 of `q` `[n*Q, heads, D]`, at positions `batch.positions[r] + j`),
  and returns every output port of the phase as a `[n, ...]` tensor. A phase that reads other
  KV contexts (`reads` in the walk: Whisper's decoder over its `cross` context) attends to
  them through `batch.attend_to(layer, q, j)`: row r's queries over the whole of its j-th
  read context (the phase's `reads` order), writing nothing; the contexts are taken as they
  are when the row joins (a loop never writes what its step reads). A phase that keeps
  nothing (`CohortPhase.keep` False: π0.5's action expert, a block of `tokens` that sees
  its reads and itself and is thrown away) attends through `batch.attend_block(layer, q, k,
  v, j)` instead: row r's Q queries in one softmax over its j-th read context and the
  block's own Q keys (every query sees every key), writing nothing (`batch.attend` is then
  refused: the row's own context does not grow); `batch.read_lens[j]` `[n]` gives each
  row's length of that context. An input bound to the loop's index (the mark's `index`)
  is `batch.inputs[port]`, int64 `[n]`: the row's step count from 0. An
  output whose type has a symbolic first dim (an item list such as Orpheus' 0-or-1-item
  `code`) is returned as `port` `[n, K]` (K = `max_items`) and `port:count` `[n]` (int: how
  many of the K are items). A bool port is `[n]`.
- `limit(state, inputs) -> int` (optional): how many steps the row can run at most; a row
  whose loop asks for more (a fixed loop's count, else its `max`) is declined at join.
- `leave(state, columns, steps)`: called when the request leaves the loop, with its row's
  columns and the number of steps it ran (speculative ones included, as the generic path
  runs them too), to write them back into the node state (so a later generic call continues
  where the cohort stopped) without reading the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
AttendTo = Callable[[int, torch.Tensor, int], torch.Tensor]
AttendBlock = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
Columns = dict[str, torch.Tensor]


@dataclass
class CohortStep:
    """One cohort step as the node sees it (rows 0..n-1; every tensor's first dim is n)."""

    n: int
    inputs: Mapping[str, torch.Tensor]  # fed-back and loop-invariant input ports
    cols: Mapping[str, torch.Tensor]  # the node's own columns (views: update in place)
    positions: torch.Tensor  # int64 [n]: the absolute position of each row's (first) new token
    attend: Attend  # writes the rows' new K/V and attends over each row's context
    device: torch.device
    attend_to: AttendTo | None = None  # (layer, q, j) -> attention over read context j (None: the phase reads none)
    attend_block: AttendBlock | None = None  # (layer, q, k, v, j): read context j and the block (a phase that reads)
    read_lens: tuple[torch.Tensor, ...] = ()  # int64 [n] per read context: its length


@dataclass(frozen=True)
class CohortPhase:
    """A KV phase offered as a column step (see the module docstring)."""

    join: Callable[[dict[str, Any], Mapping[str, Any]], Columns]
    step: Callable[[CohortStep], dict[str, torch.Tensor]]
    leave: Callable[[dict[str, Any], Columns, int], None]
    max_items: Mapping[str, int] = field(default_factory=dict)  # item-list output port -> K
    tokens: int = 1  # KV tokens each row adds per step (> 1: a block that sees itself whole)
    keep: bool = True  # False: the block's K/V are kept nowhere (it attends through attend_block)
    # the most steps a joining row can run, from its node state and invariant inputs (a node's
    # position bound, say), or None: unbounded. A loop that would run more is declined at join
    # (RequestError), so that the generic path reports the step that fails.
    limit: Callable[[dict[str, Any], Mapping[str, Any]], int] | None = None


def count_key(port: str) -> str:
    """The key of an item-list port's per-row item count in a step's outputs."""
    return f"{port}:count"


__all__ = ["Attend", "AttendBlock", "AttendTo", "CohortPhase", "CohortStep", "Columns", "count_key"]
