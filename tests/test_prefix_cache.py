"""Prefix caching in the page allocator (kv/block_manager.py, kv/prefix_cache.py): which pages a
second sequence with the same leading content shares, when, and what a full pool evicts."""

from __future__ import annotations

import pytest
import torch

from mstar_runtime.kv.block_manager import BlockManager, KVCacheError, OutOfPages
from mstar_runtime.kv.prefix_cache import MEDIA_BIT, block_hashes, media_key

PS = 4


def _bm(pages: int = 16) -> BlockManager:
    return BlockManager(pages, PS, prefix_caching=True)


def _prefill(bm: BlockManager, rid: str, keys: list[int], commit: bool = True) -> int:
    cached, slots = bm.append_cached((rid, "main"), keys, len(keys) - 1)
    assert len(slots) == len(keys) - cached
    if commit:
        bm.commit((rid, "main"))
    return cached


def test_a_second_sequence_shares_the_committed_full_blocks_of_the_same_prefix() -> None:
    bm = _bm()
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks and 3 tokens
    assert _prefill(bm, "a", prompt) == 0
    assert bm.cached_pages == 2
    assert _prefill(bm, "b", prompt) == 8
    a, b = bm.page_table(("a", "main")), bm.page_table(("b", "main"))
    assert a[:2] == b[:2] and a[2] != b[2]  # the partial block is never shared
    assert [bm.refcount(p) for p in a[:2]] == [2, 2]
    assert bm.seq_len(("b", "main")) == 11
    assert (bm.query_tokens, bm.hit_tokens) == (22, 8)


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = _bm()
    prompt = list(range(8))  # exactly two blocks
    _prefill(bm, "a", prompt)
    # max_cached = 7: only the first block can be taken, the second holds the token to compute
    assert _prefill(bm, "b", prompt) == 4


def test_blocks_of_a_step_still_running_are_not_found() -> None:
    bm = _bm()
    prompt = list(range(9))
    _prefill(bm, "a", prompt, commit=False)
    assert _prefill(bm, "b", prompt) == 0  # a's pages may not be written yet


def test_the_hash_chains_over_everything_before_a_block() -> None:
    bm = _bm()
    _prefill(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # same second block after another first block: no hit at all
    assert _prefill(bm, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0
    # a shared first block only
    assert _prefill(bm, "c", [1, 2, 3, 4, 0, 6, 7, 8, 9]) == 4
    h1 = block_hashes(b"x", [1, 2, 3, 4, 5, 6, 7, 8], PS)
    h2 = block_hashes(b"x", [9, 9, 9, 9, 5, 6, 7, 8], PS)
    assert h1[1] != h2[1] and len(h1) == 2


def test_finished_sequences_keep_their_blocks_until_the_pool_needs_the_pages() -> None:
    bm = _bm(pages=6)
    _prefill(bm, "a", list(range(9)))  # pages 0, 1 cached, 2 partial
    bm.free_request("a")
    assert bm.free_pages == 6 and bm.used_pages == 0 and bm.cached_pages == 2
    # a different request first takes the never-cached pages (2..5), then evicts the LRU cached one
    bm.append(("x", "main"), 4 * PS)
    assert sorted(bm.page_table(("x", "main"))) == [2, 3, 4, 5]
    assert bm.cached_pages == 2
    bm.append(("x", "main"), 1)
    # freed last page first: page 1 (the deeper block) is the least recently used
    assert bm.page_table(("x", "main"))[-1] == 1 and bm.cached_pages == 1
    assert bm.prefix is not None and bm.prefix.evictions == 1
    # page 0 is still found; page 1's block is gone, so only one block hits
    bm.free_request("x")
    assert _prefill(bm, "b", list(range(9))) == 4
    assert bm.page_table(("b", "main"))[0] == 0


def test_a_full_pool_fails_an_append_without_changing_anything() -> None:
    bm = _bm(pages=3)
    _prefill(bm, "a", list(range(9)))
    before = (bm.free_pages, bm.cached_pages, bm.page_table(("a", "main")))
    with pytest.raises(OutOfPages):
        bm.append_cached(("b", "main"), list(range(9)) + [0] * 8, 16)  # 2 cached + 3 new pages > 0 free
    assert (bm.free_pages, bm.cached_pages, bm.page_table(("a", "main"))) == before
    assert ("b", "main") not in bm


def test_a_truncation_into_a_cached_page_it_alone_holds_uncaches_it() -> None:
    bm = _bm()
    _prefill(bm, "a", list(range(9)))
    page1 = bm.page_table(("a", "main"))[1]
    bm.truncate(("a", "main"), 6)  # cuts into block 1, which `a` holds alone
    assert bm.cached_pages == 1 and bm.prefix is not None and page1 not in bm.prefix.hash_of
    bm.append(("a", "main"), 3, [0, 0, 0])  # overwrites slots of page 1: it must not be found
    bm.commit(("a", "main"))
    assert _prefill(bm, "b", list(range(9))) == 4


def test_a_shared_cached_page_is_copied_before_a_truncation_writes_it() -> None:
    bm = _bm()
    _prefill(bm, "a", list(range(9)))
    _prefill(bm, "b", list(range(9)))
    shared = bm.page_table(("b", "main"))[1]
    copy = bm.truncate(("b", "main"), 6)
    assert copy is not None and bm.page_table(("b", "main"))[1] != shared
    assert _prefill(bm, "c", list(range(9))) == 8  # a's page 1 is intact and still cached


def test_unknown_content_ends_the_known_run_until_a_truncation_goes_back() -> None:
    bm = _bm()
    key = ("a", "main")
    bm.append_cached(key, [1, 2, 3, 4], 3)
    bm.append(key, 4)  # decoded tokens: content unknown
    bm.commit(key)
    assert bm.cached_pages == 1  # only the known block
    cached, _ = bm.append_cached(key, [5, 6, 7, 8], 3)  # the chain is broken: no lookup
    assert cached == 0
    bm.truncate(key, 4)
    bm.append(key, 4, [5, 6, 7, 8])
    bm.commit(key)
    assert bm.cached_pages == 2


def test_a_continuation_at_a_page_boundary_finds_its_blocks() -> None:
    bm = _bm()
    _prefill(bm, "a", list(range(13)))
    key = ("b", "main")
    assert bm.append_cached(key, list(range(4)), 4)[0] == 4  # a whole block may hit when allowed
    bm.commit(key)
    cached, slots = bm.append_cached(key, list(range(4, 13)), 8)
    assert cached == 8 and len(slots) == 1


def test_a_fork_copies_the_chain_and_its_copy_continues_it() -> None:
    bm = _bm()
    _prefill(bm, "a", list(range(6)))
    bm.fork(("a", "main"), ("a", "cfg"))
    bm.append(("a", "cfg"), 2, [6, 7])
    bm.commit(("a", "cfg"))
    assert _prefill(bm, "b", list(range(9))) == 8


def test_without_prefix_caching_content_is_ignored() -> None:
    bm = BlockManager(8, PS)
    for rid in ("a", "b"):
        cached, _ = bm.append_cached((rid, "main"), list(range(9)), 8)
        bm.commit((rid, "main"))
        assert cached == 0
    assert bm.cached_pages == 0 and bm.query_tokens == 0
    bm.free_request("a")
    assert bm.free_pages == 8 - 3


def test_media_keys_name_the_bytes_and_never_a_token_id() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    k = media_key(x)
    assert k & MEDIA_BIT and k == media_key(x.clone())
    assert media_key(x + 1e-6) != k and media_key(x.reshape(4, 3)) != k and media_key(x, 1) != k
    assert media_key(x.to(torch.bfloat16)) != k


def test_keys_for_the_leading_tokens_only_let_only_those_hit() -> None:
    bm = _bm()
    key = ("a", "main")
    cached, slots = bm.append_cached(key, list(range(6)), 12, n_tokens=13)  # 7 tokens without keys
    assert cached == 0 and len(slots) == 13 and bm.seq_len(key) == 13
    bm.commit(key)
    assert bm.cached_pages == 1  # block 0 only: block 1 holds tokens without keys
    cached, slots = bm.append_cached(("b", "main"), list(range(6)), 12, n_tokens=13)
    assert cached == 4 and len(slots) == 9
    with pytest.raises(KVCacheError):
        bm.append_cached(("c", "main"), list(range(6)), 3, n_tokens=5)
