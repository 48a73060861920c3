"""A column step run as a plain batched call: one implementation of a loop phase for both paths.

A node that offers a phase as a column step (`KVNode.cohort_phase`, ops/cohort.py) need not
write it a second time for the list-of-dicts call: where the node has no `phase_<name>`
method, `KVNode.run` calls `run_columns`, the batch as a cohort that lives for one step.
Each entry joins (its node state and inputs become a row of columns), the step runs over
the rows, each entry leaves (its columns go back into its node state, one step later), and
the step's `[n, ...]` outputs become the entries' output values:

- an item-list port (`port` `[n, K]` with `port:count` `[n]`): the row's first `count`
  items, a `Lazy` host tensor (items and count are read back in the background, so a
  consumer on the host, a tokenizer, or a stream whose ring is there, never waits for the
  device: a cohort's items are host values too);
- a bool port (`[n]`): a `Lazy` bool, read back with the counts in one copy;
- any other port: row i's `[...]` view, on the device.

So the call never waits for the device (as a hand-written generic decode does not), and the
interpreter's lanes resolve the lazy values a step late. This is the path of a loop the
compiler did not mark, of a marked loop no cohort runs (a chain of several calls in a worker
process, say), of a cohort-capable loop whose cohort is full or declined the row, and of a
one-off call of the phase. Where the engine bound a graph runner to the step (the plan's `cuda-graphs` pass
captures the phase) and the step adds one token over the row's own context, it runs through
`attn.run_graphed`: the fed inputs, the columns and the positions are its rows, so on a GPU
one CUDA graph per batch bucket replays it. A replay runs no Python, so what the step
checks it checks at capture, and the captured step reads its tensors where the captured
entries' ports put them: the call names its tensors (its ports and columns) to the runner,
and a step whose names differ from the captured step's runs eagerly (the entries' ports are
the walk's wiring, the same every step, so only a step that breaks that pays for it; one
with the same names but other shapes or dtypes is the runner's NodeError). Otherwise (no
runner, a block of several tokens, a step that reads other contexts) it runs eagerly.

Requires: every entry adds `phase.tokens` KV tokens (the node's `kv_plan` says so) and
          carries the phase's input ports (fed-back and invariant; an index port as an int);
          for a phase that keeps nothing (`keep` False), an entry whose own context is empty,
          so that `attend_block` (the engine's `attend` over read context j and the entry's
          own context, under the plan's "full" mask) sees read context j and the block only,
          as a cohort's does.
Ensures:  the same outputs a cohort step gives the same rows, per entry; every entry's state
          as `leave` writes it after one step.
Fails when: an entry's inputs are missing or malformed, or its `join` refuses it
          (RequestError naming the port: the conductor retries the entries one by one);
          a context an entry reads is empty (RequestError, as a cohort declines the row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from mstar_runtime.ops.cohort import CohortPhase, CohortStep, count_key
from mstar_runtime.ops.errors import NodeError, RequestError
from mstar_runtime.ops.readback import Lazy, Readback, upload, upload_tensor


class _Seq(Protocol):
    """What the call reads of one entry (`ops.node.SeqState`)."""

    start: int
    q_len: int
    state: dict[str, Any]
    read_lens: tuple[int, ...]


class AttentionContext(Protocol):
    """What the call needs of a KV step's `ops.node.AttentionContext` (ops/node.py imports
    this module, so the class itself is not imported here)."""

    seqs: Sequence[_Seq]
    reads: tuple[str, ...]
    device: torch.device
    graph_runner: Any

    def run_graphed(self, fn: Any, *tensors: torch.Tensor) -> Any: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               over: Sequence[int | str] = ()) -> torch.Tensor: ...

    def attend_to(self, layer: int, q: torch.Tensor, context: int | str = 0) -> torch.Tensor: ...


Batch = list[dict[str, Any]]


def run_columns(node: str, cphase: CohortPhase, batch: Batch, attn: AttentionContext) -> Batch:
    """The phase's column step over the batch's entries as rows (module docstring)."""
    q_len = cphase.tokens
    for seq in attn.seqs:
        if seq.q_len != q_len:
            raise NodeError(f"node '{node}': an entry of {seq.q_len} tokens, the column step adds {q_len}")
        if not cphase.keep and seq.start:
            raise NodeError(f"node '{node}': an entry whose context holds {seq.start} tokens; the column step's "
                            "block is kept nowhere and sees only its reads and itself")
        # as a cohort's join refuses such a row (engine/cohort_engine.py): attention over an
        # empty context would give zeros, a wrong answer rather than an error
        for name, length in zip(attn.reads, seq.read_lens, strict=True):
            if length < 1:
                raise RequestError(f"node '{node}' reads {name}, which is empty")
    device = attn.device
    ports = sorted({port for entry in batch for port in entry})
    inputs = _Inputs(node, {port: _stack(node, port, [entry.get(port) for entry in batch], device) for port in ports})
    with torch.inference_mode():
        joined = [cphase.join(seq.state, entry) for entry, seq in zip(batch, attn.seqs, strict=True)]
        names = sorted(joined[0]) if joined else []
        cols = {name: _stack(node, name, [row.get(name) for row in joined], device) for name in names}
        positions = upload([seq.start for seq in attn.seqs], torch.long, device)
        n = len(batch)
        read_lens = tuple(upload([seq.read_lens[j] for seq in attn.seqs], torch.long, device)
                          for j in range(len(attn.reads)))
        reads = bool(attn.reads)
        if _graphable(cphase, attn):
            out, cols = _graphed(node, cphase, inputs, cols, positions, attn)
        else:
            out = cphase.step(CohortStep(
                n, inputs, cols, positions, attn.attend, device,
                (lambda layer, q, j: attn.attend_to(layer, q, j)) if reads else None,
                (lambda layer, q, k, v, j: attn.attend(layer, q, k, v, over=(j,))) if reads else None,
                read_lens))
        # each row's views: the columns are this call's own (stacked, or the runner's
        # copies), so a leave may keep them, as a hand-written step kept its rows' views, and
        # no row pays a copy per column (a clone is a kernel launch on a GPU)
        for i, seq in enumerate(attn.seqs):
            cphase.leave(seq.state, {name: col[i] for name, col in cols.items()}, 1)
    return rows_of(out, n)


_COLUMN = "cols/"  # the prefix of a graphed step's columns among its outputs (no port name has a '/')


def _graphable(cphase: CohortPhase, attn: AttentionContext) -> bool:
    """Whether the step goes through `attn.run_graphed`: the engine bound a runner (the plan
    captures the phase) and the step is one a runner replays, a one-token step over the row's
    own context (a block of several tokens, a block kept nowhere and a step that reads other
    contexts run eagerly, as the engine runs such generic steps)."""
    return attn.graph_runner is not None and cphase.tokens == 1 and cphase.keep and not attn.reads


def _graphed(node: str, cphase: CohortPhase, inputs: Mapping[str, torch.Tensor], cols: Mapping[str, torch.Tensor],
             positions: torch.Tensor, attn: AttentionContext) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The step through `attn.run_graphed` (on a GPU one CUDA graph per batch bucket, as a
    hand-written generic decode's forward runs): the inputs, the columns and the positions go
    in as rows; the outputs and the columns as the step left them come out (a captured step
    updates the runner's copies of the columns, not these)."""
    ports, names = list(inputs), list(cols)

    def fn(pos: torch.Tensor, *rows: torch.Tensor) -> dict[str, torch.Tensor]:
        fed = _Inputs(node, dict(zip(ports, rows[: len(ports)], strict=True)))
        own = dict(zip(names, rows[len(ports):], strict=True))
        out = cphase.step(CohortStep(pos.shape[0], fed, own, pos, attn.attend, attn.device))
        return {**out, **{_COLUMN + name: col for name, col in own.items()}}

    got = attn.run_graphed(fn, positions, *inputs.values(), *cols.values(),
                           names=("positions", *ports, *(_COLUMN + name for name in names)))
    out = {key: t for key, t in got.items() if not key.startswith(_COLUMN)}
    return out, {name: got[_COLUMN + name] for name in names}


class _Inputs(dict):
    """The step's input columns; one the step reads and no entry carries is the request's error."""

    def __init__(self, node: str, columns: Mapping[str, torch.Tensor]):
        super().__init__(columns)
        self.node = node

    def __missing__(self, port: str) -> torch.Tensor:
        raise RequestError(f"node '{self.node}': input '{port}' is missing", port)


def _stack(node: str, name: str, values: list[Any], device: torch.device) -> torch.Tensor:
    """One value per row -> a `[n, ...]` column on the device; a RequestError naming the port
    for a missing value, one that is no tensor or number (stacked before any `join` can check
    it) or rows of different shapes."""
    if any(v is None for v in values):
        raise RequestError(f"node '{node}': input '{name}' is missing", name)
    try:
        rows = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
    except (TypeError, ValueError, RuntimeError):
        bad = sorted({type(v).__name__ for v in values if not isinstance(v, torch.Tensor)})
        raise RequestError(f"node '{node}': input '{name}' must be a tensor or a number, got {', '.join(bad)}",
                           name) from None
    shape = tuple(rows[0].shape)
    if any(tuple(r.shape) != shape for r in rows):
        raise RequestError(f"node '{node}': '{name}' of shapes {sorted({tuple(r.shape) for r in rows})} in one "
                           f"step (each must be {shape})", name)
    if all(r.device.type == "cpu" for r in rows):  # a join's host values: one upload that waits for nothing
        return upload_tensor(torch.stack(rows), device)
    return torch.stack([r.to(device) for r in rows])


def rows_of(out: Mapping[str, torch.Tensor], n: int) -> Batch:
    """A step's `[n, ...]` outputs as one dict of port values per row (module docstring); also
    what a node's prefill may give for the outputs it shares with its column step (Qwen3-Omni's
    thinker), so that the two come back alike."""
    counted = [key for key in out if count_key(key) in out]
    flags = [key for key, t in out.items() if t.dtype == torch.bool and key not in counted]
    # one readback of every count and flag, `[n, len(host_cols)]`, and the column of each
    host_cols = {key: j for j, key in enumerate([count_key(key) for key in counted] + flags)}
    cols = torch.stack([out[k].reshape(n).long() for k in host_cols], dim=1) if host_cols else None
    back = Readback(cols) if cols is not None else None
    items = {key: Readback(out[key]) for key in counted}  # in their own dtype: one copy per port
    plain = [key for key in out if key not in items and key not in host_cols]
    rows: Batch = []
    for i in range(n):
        row: dict[str, Any] = {key: out[key][i] for key in plain}
        for key in counted:
            row[key] = _lazy_items(items[key], back, i, host_cols[count_key(key)])  # type: ignore[arg-type]
        for key in flags:
            # `cols` is this step's own (no later step writes it): a chain's join copies it on the device
            row[key] = Lazy(lambda i=i, j=host_cols[key]: bool(back.array()[i, j]),  # type: ignore[union-attr]
                            cols[i, host_cols[key]])  # type: ignore[index]
        rows.append(row)
    return rows


def _lazy_items(items: Readback, counts: Readback, row: int, col: int) -> Lazy:
    """Row `row`'s first items, as many as column `col` of `counts` says: a host tensor
    `[count, ...]` of the step output's dtype."""

    def get() -> torch.Tensor:
        count = int(counts.array()[row, col])
        return items.tensor()[row, :count].clone()  # the row's own: not a view of every row's copy

    return Lazy(get)


__all__ = ["rows_of", "run_columns"]
