"""BlockManager: slots, page tables, fork copy-on-write, exhaustion and a Hypothesis model check."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar_runtime.kv.block_manager import (
    BlockManager,
    KVCacheError,
    OutOfPages,
    SequenceExists,
    SlotCopy,
    UnknownSequence,
)

A = ("r1", "main")


def test_append_gives_slots_lowest_page_first() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    assert bm.append(A, 3) == [0, 1, 2]
    assert bm.append(A, 3) == [3, 4, 5]
    assert bm.page_table(A) == [0, 1]
    assert bm.seq_len(A) == 6
    assert (bm.free_pages, bm.used_pages) == (2, 2)
    assert bm.append(("r2", "main"), 1) == [8]
    assert bm.append(A, 0) == []


@pytest.mark.parametrize("n", [1, 15, 16, 17, 32, 33])
def test_page_boundaries(n: int) -> None:
    bm = BlockManager(num_pages=8, page_size=16)
    slots = bm.append(A, n)
    assert len(slots) == n == bm.seq_len(A)
    assert len(bm.page_table(A)) == bm.pages_needed(n) == -(-n // 16)
    assert slots == [bm.page_table(A)[i // 16] * 16 + i % 16 for i in range(n)]


def test_out_of_pages_changes_nothing_and_free_returns_pages() -> None:
    bm = BlockManager(num_pages=3, page_size=4)
    bm.append(A, 10)
    assert not bm.can_append(A, 3)
    assert bm.can_append(A, 2)
    with pytest.raises(OutOfPages):
        bm.append(A, 3)
    with pytest.raises(KVCacheError):  # OutOfPages is the project's KV error
        bm.append(("r2", "x"), 1)
    assert bm.seq_len(A) == 10 and bm.free_pages == 0 and ("r2", "x") not in bm
    assert bm.free(A) == 3
    assert bm.free_pages == 3
    assert bm.append(("r2", "x"), 12) == list(range(12))


def test_free_request_frees_all_tags_and_is_idempotent() -> None:
    bm = BlockManager(num_pages=8, page_size=2)
    for tag in ("gen", "cfg_text", "cfg_img"):
        bm.append(("r", tag), 3)
    bm.append(("other", "gen"), 1)
    assert bm.tags("r") == ["gen", "cfg_text", "cfg_img"]
    assert bm.free_request("r") == 6
    assert bm.free_request("r") == 0
    assert bm.tags("r") == [] and bm.used_pages == 1
    with pytest.raises(UnknownSequence):
        bm.seq_len(("r", "gen"))
    with pytest.raises(UnknownSequence):
        bm.free(("r", "gen"))


def test_fork_shares_full_pages_and_copies_partial_one() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    bm.append(A, 10)  # pages 0, 1 full; page 2 holds 2 tokens
    copy = bm.fork(A, ("r1", "cfg"))
    assert copy == SlotCopy(src=range(8, 10), dst=range(12, 14))
    assert bm.page_table(("r1", "cfg")) == [0, 1, 3]
    assert [bm.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    # Each side grows into its own pages.
    assert bm.append(A, 3) == [10, 11, 16]
    assert bm.append(("r1", "cfg"), 3) == [14, 15, 20]
    assert bm.free(A) == 2  # pages 2 and 4; shared 0 and 1 stay for cfg
    assert bm.free_request("r1") == 4
    assert bm.free_pages == 8


def test_fork_on_page_boundary_needs_no_copy_or_page() -> None:
    bm = BlockManager(num_pages=2, page_size=4)
    bm.append(A, 8)
    assert bm.can_fork(A)
    assert bm.fork(A, ("r2", "main")) is None
    assert bm.free_pages == 0
    with pytest.raises(SequenceExists):
        bm.fork(A, ("r2", "main"))
    with pytest.raises(UnknownSequence):
        bm.fork(("nope", "main"), ("r3", "main"))


def test_fork_out_of_pages() -> None:
    bm = BlockManager(num_pages=1, page_size=4)
    bm.append(A, 3)
    assert not bm.can_fork(A)
    with pytest.raises(OutOfPages):
        bm.fork(A, ("r1", "b"))
    assert ("r1", "b") not in bm and bm.refcount(0) == 1


def test_bad_arguments() -> None:
    with pytest.raises(KVCacheError):
        BlockManager(0, 16)
    bm = BlockManager(2, 16)
    with pytest.raises(KVCacheError):
        bm.append(A, -1)
    with pytest.raises(KVCacheError):
        bm.pages_needed(-1)


# ------------------------------------------------------------------------ property test
# Ops on a few keys; a shadow model writes a distinct token id into every slot it is given
# (and performs fork copies), then reads each sequence back through its page table. Any
# double allocation or wrong copy-on-write shows up as a token read from the wrong slot.
KEYS = [(r, t) for r in ("a", "b", "c") for t in ("x", "y")]
op = st.one_of(
    st.tuples(st.just("append"), st.sampled_from(KEYS), st.integers(0, 9)),
    st.tuples(st.just("fork"), st.sampled_from(KEYS), st.sampled_from(KEYS)),
    st.tuples(st.just("free"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("free_request"), st.sampled_from("abc"), st.none()),
)


def _check_invariants(bm: BlockManager, shadow: dict, slots: dict[int, int]) -> None:
    counts = [0] * bm.num_pages
    for key, tokens in shadow.items():
        table = bm.page_table(key)
        assert bm.seq_len(key) == len(tokens)
        assert len(table) == bm.pages_needed(len(tokens))
        for page in table:
            counts[page] += 1
        ps = bm.page_size
        assert [slots[table[i // ps] * ps + i % ps] for i in range(len(tokens))] == tokens
        if len(tokens) % ps:  # a partial last page is never shared
            assert bm.refcount(table[-1]) == 1
    assert counts == [bm.refcount(p) for p in range(bm.num_pages)]
    assert bm.free_pages == counts.count(0)
    assert sorted(bm._free) == [p for p in range(bm.num_pages) if counts[p] == 0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40), page_size=st.sampled_from([1, 3, 4]))
def test_block_manager_model(ops: list, page_size: int) -> None:
    bm = BlockManager(num_pages=12, page_size=page_size)
    shadow: dict[tuple[str, str], list[int]] = {}
    slots: dict[int, int] = {}
    next_token = 0
    for name, key, arg in ops:
        if name == "append":
            if not bm.can_append(key, arg):
                with pytest.raises(OutOfPages):
                    bm.append(key, arg)
                continue
            new = list(range(next_token, next_token + arg))
            next_token += arg
            for slot, tok in zip(bm.append(key, arg), new, strict=True):
                slots[slot] = tok
            shadow.setdefault(key, []).extend(new)
        elif name == "fork":
            if key not in shadow or arg in shadow or not bm.can_fork(key):
                with pytest.raises(KVCacheError):
                    bm.fork(key, arg)
                continue
            copy = bm.fork(key, arg)
            if copy is not None:
                for s, d in zip(copy.src, copy.dst, strict=True):
                    slots[d] = slots[s]
            shadow[arg] = list(shadow[key])
        elif name == "free":
            if key not in shadow:
                with pytest.raises(UnknownSequence):
                    bm.free(key)
                continue
            bm.free(key)
            del shadow[key]
        else:
            bm.free_request(key)
            shadow = {k: v for k, v in shadow.items() if k[0] != key}
        _check_invariants(bm, shadow, slots)
    for request in "abc":
        bm.free_request(request)
    assert bm.free_pages == bm.num_pages
    assert all(bm.refcount(p) == 0 for p in range(bm.num_pages))


def test_truncate_returns_pages_and_unshares_a_partial_shared_page() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    bm.append(("r", "a"), 8)  # two full pages
    bm.fork(("r", "a"), ("r", "b"))  # shares both
    bm.append(("r", "b"), 3)  # b gets a third page of its own
    free_before = bm.free_pages
    assert bm.truncate(("r", "b"), 8) is None  # back to the shared prefix: its own page is freed
    assert bm.free_pages == free_before + 1
    copy = bm.truncate(("r", "b"), 6)  # page 2 of the prefix becomes partial: must stop sharing it
    assert copy is not None and len(copy.src) == 2
    assert bm.page_table(("r", "a"))[1] != bm.page_table(("r", "b"))[1]
    assert bm.seq_len(("r", "b")) == 6 and bm.seq_len(("r", "a")) == 8
    bm.free_request("r")
    assert bm.free_pages == 8
