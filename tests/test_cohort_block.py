"""A cohort phase whose block is kept nowhere (`CohortPhase.keep` False, π0.5's action expert):
`attend_block` and the index column, on the CPU, eager and padded to buckets.

The phase's step makes its Q queries and keys from the fed `x` [Q, D] and the row's index,
attends through `attend_block` over a read context (random K/V in a pool of its own, rows of
different lengths) and the block itself, and feeds the result back. Each step is checked
against SDPA over the same tokens gathered by hand: one softmax over the row's read tokens
and its block, every query seeing every key. Rows join, leave (the last moves into the hole)
and cross buckets; the index column counts each row's steps from 0; neither pool is written.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mstar_runtime.engine.cohort_engine import CohortColumns, CohortGraphs, CohortRead, CohortShape
from mstar_runtime.kv.attention import KVPool
from mstar_runtime.ops.cohort import CohortPhase, CohortStep
from mstar_runtime.ops.node import NodeError

PAGE, HEADS, KV_HEADS, DIM, Q, ROWS, READ_PAGES = 4, 4, 2, 8, 3, 6, 5
SHAPE = CohortShape("step", (("x", "x"),), (), ("x",), (CohortRead("vlm", "main", READ_PAGES),), ("index",))


def _phase() -> CohortPhase:
    def step(b: CohortStep) -> dict[str, torch.Tensor]:
        x = b.inputs["x"] + b.inputs["index"].to(torch.float32)[:, None, None]  # [n, Q, D]: the index shows
        q = x.repeat(1, 1, HEADS).reshape(b.n * Q, HEADS, DIM)
        k = (0.5 * x).repeat(1, 1, KV_HEADS).reshape(b.n * Q, KV_HEADS, DIM)
        assert b.attend_block is not None
        out = b.attend_block(0, q, k, -k, 0).reshape(b.n, Q, HEADS, DIM)
        return {"x": out.mean(dim=2)}

    return CohortPhase(join=lambda state, inputs: {}, step=step, leave=lambda state, cols, steps: None,
                       tokens=Q, keep=False)


def _expected(x: torch.Tensor, index: int, read: KVPool, pages: list[int], length: int) -> torch.Tensor:
    """The step of one row by hand: SDPA over its read tokens, then its block."""
    x = x + index
    q = x.repeat(1, HEADS).reshape(Q, HEADS, DIM)
    k = (0.5 * x).repeat(1, KV_HEADS).reshape(Q, KV_HEADS, DIM)
    pos = torch.arange(length)
    page = torch.tensor(pages)[pos // PAGE]
    keys = torch.cat([read.data[0, page, 0, pos % PAGE], k])
    values = torch.cat([read.data[0, page, 1, pos % PAGE], -k])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], enable_gqa=True)
    return out[0].transpose(0, 1).mean(dim=1)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "buckets"])
def test_a_block_kept_nowhere_attends_to_its_read_context_and_itself(padded: bool) -> None:
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(5)
    own = KVPool(1, 4, PAGE, KV_HEADS, DIM, torch.float32, cpu)
    read = KVPool(1, ROWS * READ_PAGES + 1, PAGE, KV_HEADS, DIM, torch.float32, cpu)
    read.data.copy_(torch.randn(read.data.shape, generator=g))
    before = (own.data.clone(), read.data.clone())
    graphs = CohortGraphs([1, 2, 4, 6], 3, None, capture=False, reads=[(ROWS * READ_PAGES, None)]) if padded else None
    cols = CohortColumns(own, _phase(), SHAPE, ROWS, 2, cpu, scale=None, node="expert", q_heads=HEADS,
                         graphs=graphs, read_pools=[read])
    rows: list[dict[str, Any]] = []  # per row: its x, steps taken, read pages and length

    def join(i: int) -> None:
        length = int(torch.randint(1, READ_PAGES * PAGE + 1, (1,), generator=g))
        pages = list(range(i * READ_PAGES, i * READ_PAGES + -(-length // PAGE)))
        x = torch.randn(Q, DIM, generator=g)
        cols.join(len(rows), {}, {"x": x}, {}, [], 0, tokens=Q, reads=[(pages, length)])
        rows.append({"x": x, "steps": 0, "pages": pages, "len": length})

    def step() -> None:
        n = len(rows)
        got = cols.step(n).arrays()["x"].reshape(n, Q, DIM)
        for r, row in enumerate(rows):
            want = _expected(row["x"], row["steps"], read, row["pages"], row["len"])
            torch.testing.assert_close(torch.from_numpy(got[r].copy()), want, atol=1e-5, rtol=1e-5)
            row["x"], row["steps"] = want, row["steps"] + 1

    for i in range(3):
        join(i)
    step()
    step()
    cols.move(2, 0)  # row 0 leaves: the last row moves into its place
    cols.n = 2
    rows[0] = rows.pop()
    for i in range(3, 6):
        join(i)
    for _ in range(3):
        step()
    assert cols.index["index"][: len(rows)].tolist() == [row["steps"] for row in rows]
    assert torch.equal(own.data, before[0]) and torch.equal(read.data, before[1])  # nothing written
    assert (graphs.replays if graphs is not None else 5) == 5


def test_a_block_kept_nowhere_refuses_attend() -> None:
    cpu = torch.device("cpu")
    pool = KVPool(1, 8, PAGE, KV_HEADS, DIM, torch.float32, cpu)

    def step(b: CohortStep) -> dict[str, torch.Tensor]:
        q = torch.zeros(b.n * Q, HEADS, DIM)
        return {"x": b.attend(0, q, q[:, :KV_HEADS], q[:, :KV_HEADS]).reshape(b.n, Q, -1)}

    phase = CohortPhase(join=lambda s, i: {}, step=step, leave=lambda s, c, n: None, tokens=Q, keep=False)
    cols = CohortColumns(pool, phase, SHAPE, 2, 2, cpu, scale=None, node="expert", q_heads=HEADS, read_pools=[pool])
    cols.join(0, {}, {"x": torch.zeros(Q, DIM)}, {}, [], 0, tokens=Q, reads=[([0], 2)])
    with pytest.raises(NodeError, match="keeps nothing; its step attends through attend_block"):
        cols.step(1)
