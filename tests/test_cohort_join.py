"""Rows joining a cohort's device columns together (`CohortColumns.join_rows`), on the CPU.

A batch of rows must write exactly what as many one-row joins write: every fed, invariant
and node column, the block-table rows (device and host mirror), the lengths, the index
columns and each read context's table and length, into a cohort that has rows already and
into an empty one (whose columns the first row makes). Every row is checked before anything
is written: a row the cohort refuses (its step's tokens, its loop's steps past the phase's
limit, an empty read context, the node's own join) raises a RequestError naming its request
and leaves the cohort as it was, as does a value of another shape than its column's (or
another joining row's), a NodeError as a one-row join's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from mstar_runtime.engine.cohort_engine import CohortColumns, CohortRead, CohortShape, JoinRow
from mstar_runtime.kv.attention import KVPool
from mstar_runtime.ops.cohort import CohortPhase, CohortStep
from mstar_runtime.ops.node import NodeError, RequestError

PAGE, KV_HEADS, DIM, ROWS, MAX_PAGES, READ_PAGES = 4, 2, 8, 12, 5, 3
SHAPE = CohortShape("decode", (("token", "token"),), ("speaker", "temperature"), ("token",),
                    (CohortRead("enc", "cross", READ_PAGES),), ("index",))
CPU = torch.device("cpu")
STATE_KEYS = {"seed", "room", "refuse"}  # what `_row` changes in the state, not the join


def _join(state: dict[str, Any], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Node columns from the state and the invariant inputs: a host tensor, a 0-d one and a number."""
    if state.get("refuse"):
        raise RequestError("decode on a KV context that was never prefilled", "token")
    return {"history": torch.full((3,), state["seed"], dtype=torch.long), "k": torch.tensor(state["seed"] % 5),
            "scale": float(inputs["temperature"]) * 2}


def _step(b: CohortStep) -> dict[str, torch.Tensor]:  # never run here
    raise AssertionError("no step")


PHASE = CohortPhase(join=_join, step=_step, leave=lambda state, cols, steps: None,
                    limit=lambda state, inputs: state["room"])


def _cohort() -> CohortColumns:
    pool = KVPool(1, 64, PAGE, KV_HEADS, DIM, torch.float32, CPU)
    read = KVPool(1, 64, PAGE, KV_HEADS, DIM, torch.float32, CPU)
    return CohortColumns(pool, PHASE, SHAPE, ROWS, MAX_PAGES, CPU, scale=None, node="lm", read_pools=[read])


def _row(i: int, **change: Any) -> tuple[JoinRow, dict[str, Any]]:
    """Request i's join and its node state: its own values in every column, tables of different lengths."""
    g = torch.Generator().manual_seed(i)
    pages = [(7 * i + j) % 64 for j in range(1 + i % MAX_PAGES)]
    length = (len(pages) - 1) * PAGE + 1 + i % PAGE
    read_len = 1 + (5 * i) % (READ_PAGES * PAGE)
    read_pages = [(3 * i + j) % 64 for j in range(-(-read_len // PAGE))]
    row = JoinRow(f"r{i}", "main", {"token": torch.tensor([100 + i], dtype=torch.int32)},
                  {"speaker": torch.randn(4, generator=g, dtype=torch.float64), "temperature": 0.5 + i},
                  pages, length, steps=10 + i, reads=[(read_pages, read_len)])
    state = {"seed": 1000 + i, "room": 64}
    state.update({k: v for k, v in change.items() if k in STATE_KEYS})
    return dataclasses.replace(row, **{k: v for k, v in change.items() if k not in STATE_KEYS}), state


def _single(cols: CohortColumns, first: int, rows: list[tuple[JoinRow, dict[str, Any]]]) -> None:
    for i, (r, state) in enumerate(rows):
        cols.join(first + i, state, r.fed, r.invariant, r.pages, r.length, r.steps, r.tokens, r.reads)


def _batched(cols: CohortColumns, first: int, rows: list[tuple[JoinRow, dict[str, Any]]]) -> None:
    cols.join_rows(first, [r for r, _ in rows], [s for _, s in rows])


def _snapshot(cols: CohortColumns) -> dict[str, Any]:
    """Everything a join writes, copied."""
    out: dict[str, Any] = {"n": cols.n, "table": cols.table.host.copy(), "table_dev": cols.table.device.clone(),
                           "host_lens": cols.host_lens.copy(), "lens": cols.lens.clone()}
    for j, rc in enumerate(cols.reads):
        out[f"read{j}"] = (rc.table.host.copy(), rc.table.device.clone(), rc.host_lens.copy(), rc.lens.clone())
    for kind in ("fed", "inv", "cols", "index"):
        out[kind] = {name: t.clone() for name, t in getattr(cols, kind).items()}
    return out


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, x in a.items():
        y = b[key]
        if isinstance(x, dict):
            assert x.keys() == y.keys(), key
            for name in x:
                assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), (key, name)
        elif isinstance(x, tuple):
            for u, v in zip(x, y, strict=True):
                assert (u == v).all() if not isinstance(u, torch.Tensor) else torch.equal(u, v), key
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert (x == y).all() if hasattr(x, "all") else x == y, key


@pytest.mark.parametrize("before", [0, 3], ids=["empty", "with-rows"])
def test_rows_joined_together_write_what_one_by_one_joins_write(before: int) -> None:
    one, many = _cohort(), _cohort()
    earlier = [_row(i) for i in range(before)]
    joining = [_row(i) for i in range(before, before + 7)]
    for cols in (one, many):
        _single(cols, 0, earlier)
        cols.index["index"].fill_(9)  # steps ran: a joining row's index starts again from 0
        cols.table.host[before:] = 42  # what a row that left there had
        cols.table.device[before:] = 42
    _single(one, before, joining)
    _batched(many, before, joining)
    got, want = _snapshot(many), _snapshot(one)
    _assert_equal(got, want)
    assert got["n"] == before + 7
    assert got["index"]["index"][before: before + 7].tolist() == [0] * 7
    r = joining[-1][0]
    assert many.table.host[before + 6, : len(r.pages)].tolist() == r.pages
    assert (many.table.host[before + 6, len(r.pages):] == many.table.fill_page).all()
    assert many.host_lens[before + 6] == r.length and int(many.lens[before + 6]) == r.length
    assert many.inv["speaker"].dtype == torch.float64 and many.fed["token"].dtype == torch.int32
    assert many.cols["scale"][before: before + 7].tolist() == [(0.5 + i) * 2 for i in range(before, before + 7)]


REFUSALS = {
    "tokens": ({"tokens": 2}, "a row of 2-token steps, phase 'decode' adds 1 a step"),
    "steps": ({"room": 3}, r"a row of 1\d steps, its context has room for 3"),
    "read": ({"reads": [([1], 0)]}, "reads enc@cross, which is empty"),
    "node": ({"refuse": True}, "never prefilled"),
}


@pytest.mark.parametrize("why", list(REFUSALS))
@pytest.mark.parametrize("before", [0, 2], ids=["empty", "with-rows"])
def test_a_refused_row_among_many_leaves_the_cohort_as_it_was(why: str, before: int) -> None:
    cols = _cohort()
    _single(cols, 0, [_row(i) for i in range(before)])
    was = _snapshot(cols)
    change, message = REFUSALS[why]
    joining = [_row(i) for i in range(before, before + 6)]
    joining[4] = _row(before + 4, **change)
    with pytest.raises(RequestError, match=message) as e:
        _batched(cols, before, joining)
    assert e.value.request_ids == [f"r{before + 4}"]  # type: ignore[attr-defined]
    _assert_equal(_snapshot(cols), was)  # nothing half-written: no table, length, column, nor a new column
    _batched(cols, before, joining[:4] + joining[5:])  # the others join without it
    assert cols.n == before + 5


@pytest.mark.parametrize("among", ["column", "joining"])
def test_a_row_of_another_shape_is_refused_before_anything_is_written(among: str) -> None:
    cols = _cohort()
    if among == "column":  # the cohort's column holds [4]; the new row's speaker is [5]
        _single(cols, 0, [_row(0)])
    was = _snapshot(cols)
    joining = [_row(i) for i in range(1, 5)]
    r, state = joining[2]
    joining[2] = (dataclasses.replace(r, invariant={**r.invariant, "speaker": torch.zeros(5)}), state)
    with pytest.raises(NodeError, match=r"cohort column 'speaker': a row of shape \(5,\) \(request 'r3'\), "
                                        r"the column holds \(4,\)"):
        _batched(cols, cols.n, joining)
    _assert_equal(_snapshot(cols), was)


def test_rows_past_the_cohort_are_refused() -> None:
    cols = _cohort()
    with pytest.raises(NodeError, match="rows 10..12 join a cohort of 12 rows"):
        _batched(cols, 10, [_row(i) for i in range(3)])
    assert cols.n == 0
