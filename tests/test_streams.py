"""Chunk policies emit exactly the brief's windows, whatever the push pattern; buffers apply backpressure."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_runtime.control.streams import (
    Chunk,
    ChunkPolicy,
    ChunkPolicyError,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
    StreamBuffer,
    StreamClosed,
    StreamError,
    StreamFull,
    policy_from_spec,
)

Window = tuple[int, int, int, bool]  # (start, end, context, final)


def run(
    policy: ChunkPolicy, pushes: list[int], pop_every_push: bool = True, close: bool = True
) -> list[Chunk]:
    """Push item ids 0, 1, 2, ... in groups of ``pushes``; items are [n, 2] so each item is
    a row ``(id, -id)``. Checks every chunk's items against its absolute range."""
    buf = StreamBuffer(policy, capacity=10_000)
    chunks: list[Chunk] = []
    n = 0
    for size in pushes:
        ids = torch.arange(n, n + size)
        buf.push(torch.stack([ids, -ids], dim=1))
        n += size
        if pop_every_push:
            chunks += buf.pop_ready()
    if close:
        buf.close()
    chunks += buf.pop_ready()
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        ids = torch.arange(c.start, c.start + c.items.shape[0])
        assert torch.equal(c.items, torch.stack([ids, -ids], dim=1))
    assert buf.done == close
    return chunks


def windows(chunks: list[Chunk]) -> list[Window]:
    return [(c.start, c.start + c.items.shape[0], c.context, c.final) for c in chunks]


PATTERNS = {"ones": [1] * 12, "ragged": [2, 5, 1, 0, 4], "all_at_once": [12]}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_fixed_ends_on_boundary(pattern: str) -> None:
    expect = [(0, 3, 0, False), (3, 6, 0, False), (6, 9, 0, False), (9, 12, 0, False)]
    # Popped before close: no chunk is known to be the last; ``done`` says so after close.
    assert windows(run(FixedChunkPolicy(3), PATTERNS[pattern])) == expect
    # Closed before popping: the last chunk carries the final flag.
    expect[-1] = (9, 12, 0, True)
    assert windows(run(FixedChunkPolicy(3), PATTERNS[pattern], pop_every_push=False)) == expect


@pytest.mark.parametrize("pattern", PATTERNS)
def test_fixed_releases_final_partial_chunk(pattern: str) -> None:
    chunks = run(FixedChunkPolicy(5), PATTERNS[pattern])
    assert windows(chunks) == [(0, 5, 0, False), (5, 10, 0, False), (10, 12, 0, True)]


def test_fixed_one_is_thinker_to_talker() -> None:
    assert windows(run(FixedChunkPolicy(1), [1, 1, 1])) == [
        (0, 1, 0, False),
        (1, 2, 0, False),
        (2, 3, 0, False),
    ]


@pytest.mark.parametrize("pushes", [[1] * 50, [3, 20, 4, 1, 9, 13], [50]])
def test_sliding_orpheus_windows(pushes: list[int]) -> None:
    chunks = run(SlidingWindowChunkPolicy(28, 7), pushes)
    # Windows end at item counts 28, 35, 42, 49; items 49 (a partial stride) are never decoded.
    got = [(s, e, c) for s, e, c, _ in windows(chunks)]
    assert got == [(0, 28, 0), (7, 35, 21), (14, 42, 21), (21, 49, 21)]
    assert all(len(c.items) == 28 for c in chunks)


def test_sliding_releases_nothing_partial_on_close() -> None:
    assert run(SlidingWindowChunkPolicy(4, 2), [1] * 3) == []
    assert windows(run(SlidingWindowChunkPolicy(4, 2), [1] * 9)) == [
        (0, 4, 0, False),
        (2, 6, 2, False),
        (4, 8, 2, False),
    ]
    # Closed before popping: the last full window is known to be the final one.
    assert windows(run(SlidingWindowChunkPolicy(4, 2), [9], pop_every_push=False))[-1] == (4, 8, 2, True)


def test_sliding_stride_equal_to_window_has_no_overlap() -> None:
    assert windows(run(SlidingWindowChunkPolicy(3, 3), [1] * 7)) == [(0, 3, 0, False), (3, 6, 0, False)]


@pytest.mark.parametrize("pushes", [[1] * 10, [4, 0, 1, 5], [10]])
def test_left_context(pushes: list[int]) -> None:
    got = [(s, e, c) for s, e, c, _ in windows(run(LeftContextChunkPolicy(3, 2), pushes))]
    assert got == [(0, 3, 0), (1, 6, 2), (4, 9, 2), (7, 10, 2)]


def test_left_context_qwen_code2wav_shape() -> None:
    chunks = run(LeftContextChunkPolicy(25, 25), [1] * 60)
    assert windows(chunks) == [(0, 25, 0, False), (0, 50, 25, False), (25, 60, 25, True)]


def test_left_context_with_a_short_first_chunk() -> None:
    """`first` = 5: the first window after 5 items (no context), then every 25 with 25 of context."""
    chunks = run(LeftContextChunkPolicy(25, 25, first=5), [1] * 60)
    assert windows(chunks) == [(0, 5, 0, False), (0, 30, 5, False), (5, 55, 25, False), (30, 60, 25, True)]
    policy = policy_from_spec({"kind": "left_context", "chunk": 25, "left": 25, "first": 5})
    assert policy == LeftContextChunkPolicy(25, 25, 5) and policy.spec()["first"] == 5
    assert "first" not in LeftContextChunkPolicy(25, 25).spec()  # plans without it stay as they were
    with pytest.raises(ChunkPolicyError, match="first must be an integer >= 1"):
        LeftContextChunkPolicy(25, 25, first=0)


def test_left_context_longer_than_history() -> None:
    chunks = run(LeftContextChunkPolicy(2, 5), [1] * 5)
    assert windows(chunks) == [(0, 2, 0, False), (0, 4, 2, False), (0, 5, 4, True)]


def test_done_and_final_flags() -> None:
    buf = StreamBuffer(FixedChunkPolicy(2), capacity=4)
    buf.push(torch.zeros(2))
    assert [c.final for c in buf.pop_ready()] == [False]
    assert not buf.done
    buf.close()  # nothing left: done at once, with no extra chunk
    assert buf.done and buf.pop_ready() == []
    with pytest.raises(StreamClosed):
        buf.push(torch.zeros(1))
    assert not buf.can_push(1)

    empty = StreamBuffer(FixedChunkPolicy(2), capacity=4)
    empty.close()
    empty.close()
    assert empty.done and empty.pop_ready() == []


# ------------------------------------------------------------------ property: any push pattern
def oracle(kind: str, a: int, b: int, n: int) -> list[tuple[int, int, int]]:
    """The brief's definitions, written directly over ``n`` items ever pushed."""
    if kind == "fixed":
        return [(i, min(i + a, n), 0) for i in range(0, n, a)]
    if kind == "sliding":
        return [(e - a, e, 0 if e == a else a - b) for e in range(a, n + 1, b)]
    return [(max(0, i - b), min(i + a, n), i - max(0, i - b)) for i in range(0, n, a)]


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["fixed", "sliding", "left_context"]),
    a=st.integers(1, 8),
    b=st.integers(0, 8),
    slack=st.integers(0, 6),
    pushes=st.lists(st.integers(0, 9), max_size=16),
    pops=st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_any_push_pattern_matches_oracle(
    kind: str, a: int, b: int, slack: int, pushes: list[int], pops: list[bool]
) -> None:
    if kind == "fixed":
        policy: ChunkPolicy = FixedChunkPolicy(a)
    elif kind == "sliding":
        b = max(1, min(a, b))
        policy = SlidingWindowChunkPolicy(a, b)
    else:
        policy = LeftContextChunkPolicy(a, b)
    # Tight capacities fill the ring to the last slot. After draining, fewer than
    # min_capacity items are pending, so a push of up to slack + 1 items always fits.
    capacity = policy.min_capacity + slack
    buf = StreamBuffer(policy, capacity)
    chunks: list[Chunk] = []
    n = 0
    for size, pop in zip(pushes, pops, strict=False):
        size = min(size, slack + 1)
        while not buf.can_push(size):  # backpressure: the consumer must drain first
            ready = buf.pop_ready()
            assert ready, "stalled: cannot push and nothing to pop"
            chunks += ready
        buf.push(torch.arange(n, n + size, dtype=torch.float32))
        n += size
        assert buf.pending <= capacity
        if pop:
            chunks += buf.pop_ready()
    buf.close()
    chunks += buf.pop_ready()
    assert buf.done
    expect = oracle(kind, a, b, n)
    got = [(c.start, c.start + len(c.items), c.context) for c in chunks]
    assert got == expect
    # Chunks own their items: later pushes into the ring did not overwrite them.
    for c in chunks:
        assert torch.equal(c.items, torch.arange(c.start, c.start + len(c.items), dtype=torch.float32))
    assert [c.final for c in chunks].count(True) <= 1


# ----------------------------------------------------------------------- backpressure
def test_backpressure_fixed() -> None:
    buf = StreamBuffer(FixedChunkPolicy(4), capacity=6)
    buf.push(torch.zeros(5, 3))
    assert buf.pending == 5
    assert buf.can_push(1) and not buf.can_push(2)
    with pytest.raises(StreamFull):
        buf.push(torch.zeros(2, 3))
    assert buf.pushed == 5  # the refused push changed nothing
    assert len(buf.pop_ready()) == 1
    assert buf.pending == 1 and buf.can_push(5) and not buf.can_push(6)


def test_backpressure_sliding_memory_is_bounded() -> None:
    policy = SlidingWindowChunkPolicy(28, 7)
    buf = StreamBuffer(policy, capacity=28)
    for i in range(28):
        assert buf.can_push(1)
        buf.push(torch.full((1, 7), i))
    assert not buf.can_push(1)  # the consumer has not taken the first window yet
    (first,) = buf.pop_ready()
    assert first.items[:, 0].tolist() == list(range(28))
    for i in range(28, 28 + 7 * 20):
        buf.push(torch.full((1, 7), i))
        for c in buf.pop_ready():
            assert c.items[:, 0].tolist() == list(range(c.start, c.start + 28))
    assert buf._ring is not None and buf._ring.shape[0] == 28 + 21  # capacity + kept history


@pytest.mark.parametrize(
    "policy",
    [
        FixedChunkPolicy(3),
        SlidingWindowChunkPolicy(4, 1),
        SlidingWindowChunkPolicy(5, 2),
        LeftContextChunkPolicy(3, 2),
        LeftContextChunkPolicy(3, 2, first=1),
    ],
)
def test_full_buffer_keeps_history_later_chunks_need(policy: ChunkPolicy) -> None:
    """Fill to capacity before every pop, so each push overwrites the oldest ring slot."""
    buf = StreamBuffer(policy, capacity=policy.min_capacity)
    n = 0
    for _ in range(6):
        while buf.can_push(1):
            buf.push(torch.tensor([n]))
            n += 1
        for c in buf.pop_ready():
            assert c.items.tolist() == list(range(c.start, c.start + len(c.items)))
    assert n > 3 * policy.min_capacity


def test_buffer_errors() -> None:
    with pytest.raises(StreamError, match="stall"):
        StreamBuffer(SlidingWindowChunkPolicy(28, 7), capacity=27)
    buf = StreamBuffer(FixedChunkPolicy(2), capacity=8)
    buf.push(torch.zeros(1, 3))
    with pytest.raises(StreamError):
        buf.push(torch.zeros(1, 4))
    with pytest.raises(StreamError):
        buf.push(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(StreamError):
        buf.push(torch.tensor(1.0))


# ------------------------------------------------------------------------------ specs
@pytest.mark.parametrize(
    "spec,cls",
    [
        ({"kind": "sliding", "window": 28, "stride": 7}, SlidingWindowChunkPolicy),
        ({"kind": "fixed", "size": 1}, FixedChunkPolicy),
        ({"kind": "left_context", "chunk": 25, "left": 25}, LeftContextChunkPolicy),
        ({"kind": "left_context", "chunk": 4, "left": 0}, LeftContextChunkPolicy),
    ],
)
def test_policy_from_spec(spec: dict, cls: type) -> None:
    policy = policy_from_spec(spec)
    assert isinstance(policy, cls)
    assert policy.spec() == spec


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            {"kind": "ring", "size": 1},
            "unknown chunk policy kind 'ring'; supported: fixed, sliding, left_context",
        ),
        ({"size": 1}, "unknown chunk policy kind None"),
        ({"kind": ["fixed"]}, "unknown chunk policy kind"),
        ({"kind": "fixed"}, "missing size"),
        ({"kind": "fixed", "size": 2, "stride": 1}, "unexpected stride"),
        ({"kind": "fixed", "size": 0}, "size must be an integer >= 1, got 0"),
        ({"kind": "fixed", "size": 2.0}, "size must be an integer"),
        ({"kind": "fixed", "size": True}, "size must be an integer"),
        ({"kind": "sliding", "window": 4, "stride": 0}, "stride must be an integer >= 1"),
        ({"kind": "sliding", "window": 4, "stride": 5}, "stride (5) must be <= window (4)"),
        ({"kind": "left_context", "chunk": 4, "left": -1}, "left must be an integer >= 0"),
        ([("kind", "fixed")], "must be a mapping"),
    ],
)
def test_bad_policy_specs(spec: object, message: str) -> None:
    with pytest.raises(ChunkPolicyError) as err:
        policy_from_spec(spec)  # type: ignore[arg-type]
    assert message in str(err.value)


@pytest.mark.gpu
def test_items_from_either_device_land_in_the_ring() -> None:
    """A generic step pushes its (GPU) outputs, a decode cohort host items from its readback:
    one stream takes both, in order, on the device of its first push."""
    buf = StreamBuffer(LeftContextChunkPolicy(2, 1), capacity=8)
    buf.push(torch.tensor([[0, 0], [1, -1]], dtype=torch.int32, device="cuda"))
    buf.push(torch.tensor([[2, -2], [3, -3]], dtype=torch.int32))
    buf.close()
    chunks = buf.pop_ready()
    got = torch.cat([c.items[c.context :] for c in chunks])
    assert got.device.type == "cuda" and got[:, 0].tolist() == [0, 1, 2, 3]
