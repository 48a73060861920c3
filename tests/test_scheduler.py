"""Direct tests of the scheduler (runtime/mstar_runtime/control/scheduler.py), without a conductor.

`Scheduler.next_group` is fed hand-made `StepCall`s (op dicts in the plan's format, a stand-in
request, `seq` numbers set as the conductor would); `KVPages` is checked against the
`BlockManager` it wraps. These pin today's behaviour: which group runs next (biggest first,
ties to the oldest call, batch caps in issue order, the starvation rule, busy ranks), and
what a reservation, truncation, fork and free do to the page tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mstar_runtime.control.interpreter import Frame, StepCall
from mstar_runtime.control.scheduler import KVPages, OutOfPages, Scheduler, group_key
from mstar_runtime.engine.engines import KVSlots
from mstar_runtime.kv.block_manager import SlotCopy
from mstar_runtime.ops.node import SeqPlan


@dataclass(eq=False)
class FakeRequest:
    id: str


def call(seq: int, node: str = "lm", phase: str = "decode", ranks: tuple[int, ...] = (0,),
         request: str | None = None, tag: str | None = "main") -> StepCall:
    req = FakeRequest(request or f"req-{seq}")
    op = {"op": "call", "id": f"w.{node}.{phase}", "node": node, "phase": phase, "tag": tag,
          "ranks": list(ranks), "args": {}, "results": [], "feeds": [], "graph": None}
    return StepCall(op, req, tag, {}, Frame(req), seq=seq)  # type: ignore[arg-type]


def seqs(calls: list[StepCall]) -> list[int]:
    return [c.seq for c in calls]


# ---------------------------------------------------------------- group_key / grouping
def test_group_key_is_node_phase_and_ranks_as_a_tuple() -> None:
    c = call(0, "codec", "decode_window", ranks=(1, 2))
    assert group_key(c) == ("codec", "decode_window", (1, 2))
    assert isinstance(group_key(c)[2], tuple)  # hashable: a dict key of the scheduler


def test_nothing_ready_gives_none() -> None:
    s = Scheduler(max_batch=8)
    assert s.next_group([]) is None
    assert s.next_group({}) is None  # the conductor passes its dict of pending calls


def test_calls_group_by_node_phase_and_ranks() -> None:
    """Same node and phase on other ranks, or another phase of the node, are other groups; the
    tags of one request (CFG branches) share a group."""
    ready = [
        call(0, "lm", "decode", (0,), request="a", tag="cond"),
        call(1, "lm", "prefill", (0,), request="b"),
        call(2, "lm", "decode", (1,), request="c"),
        call(3, "lm", "decode", (0,), request="a", tag="uncond"),
        call(4, "lm", "decode", (0,), request="d"),
    ]
    key, calls = Scheduler(max_batch=8).next_group(ready)
    assert key == ("lm", "decode", (0,))
    assert seqs(calls) == [0, 3, 4]
    assert [c.tag for c in calls] == ["cond", "uncond", "main"]


def test_the_biggest_group_wins_over_an_older_smaller_one() -> None:
    ready = [call(0, "prompt", "encode"), call(1, "lm", "decode"), call(2, "lm", "decode")]
    key, calls = Scheduler(max_batch=8).next_group(ready)
    assert key == ("lm", "decode", (0,))
    assert seqs(calls) == [1, 2]


def test_a_tie_goes_to_the_group_with_the_oldest_call() -> None:
    # two groups of two; the codec group holds the oldest call (seq 1), whatever the input order
    ready = [call(2, "lm", "decode"), call(5, "lm", "decode"), call(1, "codec", "window"), call(9, "codec", "window")]
    for order in (ready, ready[::-1]):
        key, calls = Scheduler(max_batch=8).next_group(order)
        assert key == ("codec", "window", (0,))
        assert seqs(calls) == [1, 9]


def test_calls_come_back_in_issue_order_whatever_the_ready_order() -> None:
    ready = [call(7), call(3), call(5), call(4)]
    _, calls = Scheduler(max_batch=8).next_group(ready)
    assert seqs(calls) == [3, 4, 5, 7]


def test_max_batch_caps_the_batch_oldest_calls_first() -> None:
    ready = [call(s) for s in (6, 2, 9, 4, 1)]
    key, calls = Scheduler(max_batch=3).next_group(ready)
    assert key == ("lm", "decode", (0,))
    assert seqs(calls) == [1, 2, 4]


def test_a_node_limit_caps_its_own_node_only() -> None:
    s = Scheduler(max_batch=4, node_limits={"codec": 2})
    ready = [call(s_, "codec", "window") for s_ in (0, 1, 2, 3, 4)]
    key, calls = s.next_group(ready)
    assert key[0] == "codec"
    assert seqs(calls) == [0, 1]
    _, calls = Scheduler(max_batch=4, node_limits={"codec": 2}).next_group([call(i) for i in range(6)])
    assert seqs(calls) == [0, 1, 2, 3]  # lm has no limit of its own: max_batch


def test_a_node_limit_above_max_batch_does_not_raise_the_cap() -> None:
    _, calls = Scheduler(max_batch=2, node_limits={"lm": 16}).next_group([call(i) for i in range(5)])
    assert seqs(calls) == [0, 1]


def test_a_capped_group_is_still_chosen_by_its_full_size() -> None:
    """The group size before the cap decides: 5 lm calls (capped to 2) beat 3 codec calls."""
    ready = [call(i, "codec", "w") for i in range(3)] + [call(10 + i) for i in range(5)]
    key, calls = Scheduler(max_batch=2).next_group(ready)
    assert key == ("lm", "decode", (0,))
    assert seqs(calls) == [10, 11]


# ---------------------------------------------------------------- starvation
def _round(s: Scheduler, lonely: StepCall, fresh: int, busy: tuple[int, ...] = ()) -> tuple[str, list[int]]:
    """One scheduling round: `lonely` (its own group) against a group of two new lm calls."""
    ready = [lonely, call(fresh), call(fresh + 1)]
    key, calls = s.next_group(ready, busy=busy)
    return key[0], seqs(calls)


def test_a_call_passed_over_max_wait_times_forces_its_group() -> None:
    s = Scheduler(max_batch=8, max_wait=3)
    lonely = call(0, "prompt", "encode")
    picks = [_round(s, lonely, 10 * r) for r in range(1, 5)]
    assert picks[:3] == [("lm", [10, 11]), ("lm", [20, 21]), ("lm", [30, 31])]  # passed over 3 times
    assert picks[3] == ("prompt", [0])  # then its group runs, though smaller
    # chosen: its count is gone; the bigger group wins again
    assert _round(s, call(1, "prompt", "encode"), 50) == ("lm", [50, 51])


def test_max_wait_zero_always_runs_the_oldest_calls_group() -> None:
    s = Scheduler(max_batch=8, max_wait=0)
    assert _round(s, call(0, "prompt", "encode"), 10) == ("prompt", [0])


def test_calls_cut_by_the_batch_cap_count_as_passed_over() -> None:
    """A call left out of its own group's batch is passed over too: max_wait=1, max_batch=1."""
    s = Scheduler(max_batch=1, max_wait=1)
    old = call(0, "prompt", "encode")
    a, b = call(1), call(2)
    assert seqs(s.next_group([old, a, b])[1]) == [1]  # lm (2 calls) wins; 0 and 2 passed over
    # 0 is the oldest and was passed over once: its group is forced
    assert seqs(s.next_group([old, b, call(3)])[1]) == [0]
    # now 2 is the oldest, passed over twice: lm, and 2 first
    assert seqs(s.next_group([b, call(3), call(4, "prompt", "encode")])[1]) == [2]


def test_only_ready_calls_keep_a_pass_count() -> None:
    """A call that left the ready set (cancelled, run elsewhere) does not carry its count back."""
    s = Scheduler(max_batch=8, max_wait=2)
    lonely = call(0, "prompt", "encode")
    _round(s, lonely, 10)
    _round(s, lonely, 20)  # passed over twice
    s.next_group([call(30), call(31)])  # lonely is not ready this round
    assert _round(s, lonely, 40) == ("lm", [40, 41])  # counted from zero again
    assert s._passed[0] == 1


# ---------------------------------------------------------------- busy ranks
def test_groups_on_a_busy_rank_are_left_out() -> None:
    ready = [call(0, "codec", "w", (1,)), call(1, "codec", "w", (1,)), call(2, "lm", "decode", (0,))]
    key, calls = Scheduler(max_batch=8).next_group(ready, busy={1})
    assert key == ("lm", "decode", (0,))
    assert seqs(calls) == [2]


def test_a_group_spanning_a_busy_rank_is_left_out() -> None:
    ready = [call(0, "lm", "decode", (0, 1)), call(1, "lm", "decode", (0, 1)), call(2, "prompt", "encode", (0,))]
    key, _ = Scheduler(max_batch=8).next_group(ready, busy=[1])
    assert key == ("prompt", "encode", (0,))


def test_every_ready_call_on_a_busy_rank_gives_none() -> None:
    ready = [call(0, "codec", "w", (1,)), call(1, "codec", "w", (1,))]
    assert Scheduler(max_batch=8).next_group(ready, busy={1}) is None
    assert Scheduler(max_batch=8).next_group(ready, busy={0}) is not None


def test_the_pass_count_of_a_call_waiting_for_a_busy_rank_stands_still() -> None:
    s = Scheduler(max_batch=8, max_wait=2)
    lonely = call(0, "codec", "w", (1,))
    assert _round(s, lonely, 10) == ("lm", [10, 11])  # passed over by choice: 1
    for r in (2, 3, 4):  # rank 1 busy: left out, not passed over
        assert _round(s, lonely, 10 * r, busy=(1,)) == ("lm", [10 * r, 10 * r + 1])
        assert s._passed[0] == 1
    assert s.next_group([lonely], busy=(1,)) is None  # nothing runnable: the count is kept too
    assert s._passed[0] == 1
    assert _round(s, lonely, 50) == ("lm", [50, 51])  # free again: passed over by choice: 2
    assert _round(s, lonely, 60) == ("codec", [0])  # then forced


def test_a_call_first_seen_on_a_busy_rank_has_no_count() -> None:
    s = Scheduler(max_batch=8, max_wait=1)
    lonely = call(0, "codec", "w", (1,))
    for r in (1, 2, 3):
        _round(s, lonely, 10 * r, busy=(1,))
    assert 0 not in s._passed
    assert _round(s, lonely, 40) == ("lm", [40, 41])
    assert _round(s, lonely, 50) == ("codec", [0])


def test_no_ready_call_is_passed_over_more_than_max_wait_times() -> None:
    """The `max_wait` contract ("times a ready call may be passed over before its group must run")
    for a call that is not the oldest: `held` (seq 0, rank 1) keeps a count of 0 while rank 1 is
    busy; `newer` (seq 1, rank 0) is passed over meanwhile. Once rank 1 is free, `held` is the
    oldest call again and `newer`, passed over max_wait times already, still waits."""
    s = Scheduler(max_batch=8, max_wait=2)
    held, newer = call(0, "codec", "w", (1,)), call(1, "prompt", "encode")
    passed_over, waiting = 0, [held, newer]
    for r in range(1, 10):
        busy = (1,) if r <= 2 else ()
        _, calls = s.next_group([*waiting, call(10 * r), call(10 * r + 1)], busy=busy)
        if newer in calls:
            break
        waiting = [c for c in waiting if c not in calls]  # a call that ran leaves the ready set
        passed_over += 1
    assert passed_over <= s.max_wait  # it was 5 (2 while rank 1 was busy, 3 more after) before the fix


# ---------------------------------------------------------------- KVPages
def kv(pages: int = 8, page_size: int = 4) -> KVPages:
    return KVPages({"lm": (pages, page_size), "talker": (4, 2)})


def test_pools_capacity_and_page_counts() -> None:
    pages = kv()
    assert pages.capacity_tokens("lm") == 32
    assert pages.capacity_tokens("talker") == 8
    assert pages.total_pages() == 12
    assert pages.used_pages() == 0
    assert pages.managers["lm"].page_size == 4


def test_reserve_gives_slots_consistent_with_the_block_manager() -> None:
    pages = kv()
    bm = pages.managers["lm"]
    key = ("r1", "main")
    first = pages.reserve("lm", key, SeqPlan(q_len=6))
    assert isinstance(first, KVSlots)
    assert (first.start, first.q_len) == (0, 6)
    assert first.page_table == bm.page_table(key) == [0, 1]  # lowest free page first
    assert first.slots == [0, 1, 2, 3, 4, 5]
    assert (first.mask, first.block_size, first.keep) == ("causal", None, True)
    assert pages.used_pages() == 2

    other = pages.reserve("lm", ("r2", "main"), SeqPlan(q_len=1))
    assert other.page_table == [2] and other.slots == [8]

    second = pages.reserve("lm", key, SeqPlan(q_len=3, mask="block_causal", block_size=3, keep=False))
    assert (second.start, second.q_len) == (6, 3)
    assert second.page_table == bm.page_table(key) == [0, 1, 3]
    assert second.slots == [6, 7, 12]  # the rest of page 1, then page 3
    assert (second.mask, second.block_size, second.keep) == ("block_causal", 3, False)
    assert bm.seq_len(key) == 9
    # every slot lies on the page the table names for its position
    for pos, slot in zip(range(second.start, second.start + second.q_len), second.slots):
        assert slot == second.page_table[pos // 4] * 4 + pos % 4


def test_reserve_page_table_is_a_copy() -> None:
    pages = kv()
    slots = pages.reserve("lm", ("r1", "main"), SeqPlan(q_len=2))
    slots.page_table.append(99)
    assert pages.managers["lm"].page_table(("r1", "main")) == [0]


def test_a_zero_token_reservation_holds_an_empty_context() -> None:
    pages = kv()
    s = pages.reserve("lm", ("r1", "main"), SeqPlan(q_len=0))
    assert (s.start, s.slots, s.page_table) == (0, [], [])
    assert pages.holds("r1") and pages.used_pages() == 0


def test_out_of_pages_changes_nothing() -> None:
    pages = kv(pages=2, page_size=4)
    pages.reserve("lm", ("r1", "main"), SeqPlan(q_len=5))
    bm = pages.managers["lm"]
    with pytest.raises(OutOfPages):
        pages.reserve("lm", ("r1", "main"), SeqPlan(q_len=4))  # needs a third page
    assert bm.seq_len(("r1", "main")) == 5 and bm.page_table(("r1", "main")) == [0, 1]
    with pytest.raises(OutOfPages):
        pages.reserve("lm", ("r2", "main"), SeqPlan(q_len=4))
    assert ("r2", "main") not in bm and not pages.holds("r2")
    assert pages.used_pages() == 2
    assert pages.reserve("lm", ("r1", "main"), SeqPlan(q_len=3)).slots == [5, 6, 7]  # still fits


def test_truncate_shrinks_and_frees_pages() -> None:
    pages = kv()
    key = ("r1", "main")
    pages.reserve("lm", key, SeqPlan(q_len=9))
    assert pages.used_pages() == 3
    assert pages.truncate("lm", key, 5) is None  # nothing shared: no copy
    bm = pages.managers["lm"]
    assert bm.seq_len(key) == 5 and bm.page_table(key) == [0, 1]
    assert pages.used_pages() == 2
    again = pages.reserve("lm", key, SeqPlan(q_len=1))
    assert (again.start, again.slots) == (5, [5])  # appends go on after the truncation point


def test_truncate_of_an_unknown_context_is_a_no_op() -> None:
    pages = kv()
    assert pages.truncate("lm", ("nobody", "main"), 0) is None
    assert not pages.holds("nobody")


def test_truncate_into_a_shared_page_returns_the_copy() -> None:
    pages = kv()
    pages.reserve("lm", ("r1", "a"), SeqPlan(q_len=8))  # pages 0, 1 (both full)
    assert pages.fork("lm", ("r1", "a"), ("r1", "b")) is None  # ends on a page boundary: all shared
    copy = pages.truncate("lm", ("r1", "b"), 6)  # b's last page becomes partial and is shared
    assert copy == SlotCopy(range(4, 6), range(8, 10))
    bm = pages.managers["lm"]
    assert bm.page_table(("r1", "a")) == [0, 1] and bm.page_table(("r1", "b")) == [0, 2]


def test_fork_shares_full_pages_and_copies_the_partial_one() -> None:
    pages = kv()
    pages.reserve("lm", ("r1", "uncond"), SeqPlan(q_len=6))  # pages 0 (full), 1 (2 tokens)
    copy = pages.fork("lm", ("r1", "uncond"), ("r1", "cond"))
    assert copy == SlotCopy(range(4, 6), range(8, 10))
    bm = pages.managers["lm"]
    assert bm.page_table(("r1", "cond")) == [0, 2]
    assert bm.seq_len(("r1", "cond")) == 6
    assert bm.refcount(0) == 2 and bm.refcount(1) == 1 and bm.refcount(2) == 1
    nxt = pages.reserve("lm", ("r1", "cond"), SeqPlan(q_len=1))
    assert (nxt.start, nxt.slots) == (6, [10])  # the private copy, never the source's page


def test_fork_of_an_empty_source_gives_no_context() -> None:
    pages = kv()
    assert pages.fork("lm", ("r1", "missing"), ("r1", "dst")) is None
    assert ("r1", "dst") not in pages.managers["lm"]
    assert not pages.holds("r1")


def test_fork_replaces_an_existing_destination() -> None:
    pages = kv()
    pages.reserve("lm", ("r1", "src"), SeqPlan(q_len=4))  # page 0
    pages.reserve("lm", ("r1", "dst"), SeqPlan(q_len=10))  # pages 1, 2, 3
    assert pages.fork("lm", ("r1", "src"), ("r1", "dst")) is None
    bm = pages.managers["lm"]
    assert bm.page_table(("r1", "dst")) == [0] and bm.seq_len(("r1", "dst")) == 4
    assert pages.used_pages() == 1  # the old destination's pages went back


def test_fork_of_an_empty_source_drops_an_existing_destination() -> None:
    pages = kv()
    pages.reserve("lm", ("r1", "dst"), SeqPlan(q_len=3))
    assert pages.fork("lm", ("r1", "missing"), ("r1", "dst")) is None
    assert ("r1", "dst") not in pages.managers["lm"]
    assert pages.used_pages() == 0


def test_fork_out_of_pages_raises() -> None:
    pages = kv(pages=1, page_size=4)
    pages.reserve("lm", ("r1", "a"), SeqPlan(q_len=3))  # partial: a fork needs a page
    with pytest.raises(OutOfPages):
        pages.fork("lm", ("r1", "a"), ("r1", "b"))
    assert ("r1", "b") not in pages.managers["lm"]
    assert pages.managers["lm"].refcount(0) == 1


def test_free_request_frees_every_tag_on_every_pool() -> None:
    pages = kv()
    pages.reserve("lm", ("r1", "main"), SeqPlan(q_len=5))  # 2 pages
    pages.reserve("lm", ("r1", "cfg"), SeqPlan(q_len=1))  # 1 page
    pages.reserve("talker", ("r1", "main"), SeqPlan(q_len=3))  # 2 pages of 2
    pages.reserve("lm", ("r2", "main"), SeqPlan(q_len=1))  # 1 page
    assert pages.used_pages() == 6
    assert pages.holds("r1") and pages.holds("r2")
    assert pages.free_request("r1") == 5
    assert not pages.holds("r1") and pages.holds("r2")
    assert pages.used_pages() == 1
    assert pages.free_request("r1") == 0  # again: a no-op (cancel and preemption may both call it)
    assert pages.free_request("never-seen") == 0


def test_free_request_counts_shared_pages_once() -> None:
    pages = kv()
    pages.reserve("lm", ("r1", "a"), SeqPlan(q_len=8))
    pages.fork("lm", ("r1", "a"), ("r1", "b"))  # shares both pages
    assert pages.used_pages() == 2
    assert pages.free_request("r1") == 2
    assert pages.used_pages() == 0
