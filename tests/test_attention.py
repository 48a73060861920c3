"""Paged attention equals dense attention over mixed batches, masks, GQA, page boundaries and forks."""

import random

import pytest
import torch

from mstar_runtime.kv.attention import (
    AttentionError,
    AttentionMetadata,
    KVPool,
    SequenceAttention,
    attention_mask,
    dense_attention,
    paged_attention,
)
from mstar_runtime.kv.block_manager import BlockManager

PAGE = 16
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _mask_by_definition(q_len: int, kv_len: int, kind: str, block: int | None) -> torch.Tensor:
    """The brief's wording, one element at a time."""
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        p = kv_len - q_len + i
        for j in range(kv_len):
            if kind == "full":
                out[i, j] = True
            elif kind == "causal":
                out[i, j] = j <= i + kv_len - q_len
            else:
                out[i, j] = j // block <= p // block
    return out


@pytest.mark.parametrize(
    "kind,block", [("causal", None), ("full", None), ("block_causal", 1), ("block_causal", 4)]
)
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 9), (5, 5), (3, 11), (8, 13)])
def test_mask_matches_definition(kind: str, block: int | None, q_len: int, kv_len: int) -> None:
    mask = attention_mask(q_len, kv_len, kind, block)  # type: ignore[arg-type]
    expect = _mask_by_definition(q_len, kv_len, kind, block)
    assert torch.equal(expect, torch.ones_like(expect) if mask is None else mask)


def _random_batch(
    rng: random.Random, pool: KVPool, specs: list[tuple[int, int, str, int | None]]
) -> tuple[AttentionMetadata, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Give each sequence random, disjoint, non-contiguous pages and random K/V in every
    layer; return the metadata and each sequence's dense layer-1 K/V."""
    free = list(range(pool.num_pages))
    rng.shuffle(free)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dense, seqs = [], []
    for q_len, kv_len, kind, block in specs:
        table = [free.pop() for _ in range(-(-kv_len // PAGE))]
        slots = [table[i // PAGE] * PAGE + i % PAGE for i in range(kv_len)]
        shape = (kv_len, pool.kv_heads, pool.head_dim)
        per_layer = []
        for layer in range(pool.num_layers):
            k = torch.randn(shape, generator=g, dtype=pool.dtype)
            v = torch.randn(shape, generator=g, dtype=pool.dtype)
            pool.write(layer, k, v, slots)
            per_layer.append((k, v))
        dense.append(per_layer[1])
        seqs.append(SequenceAttention(q_len, kv_len, tuple(table), kind, block))  # type: ignore[arg-type]
    return AttentionMetadata(tuple(seqs)), dense


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_paged_equals_dense_mixed_batch(dtype: torch.dtype, heads: int, kv_heads: int, seed: int) -> None:
    rng = random.Random(seed * 131 + heads)
    dim = 8
    kinds = [("causal", None), ("full", None), ("block_causal", rng.choice([1, 3, 16]))]
    specs: list[tuple[int, int, str, int | None]] = []
    for kv_len in (1, 15, 16, 17, rng.randrange(2, 60), rng.randrange(2, 60)):
        for q_len in sorted({1, kv_len, rng.randrange(1, kv_len + 1)}):
            kind, block = rng.choice(kinds)
            specs.append((q_len, kv_len, kind, block))
    rng.shuffle(specs)
    # Spare pages so tables are scattered over a larger pool than they fill.
    total_pages = 2 * sum(-(-kv // PAGE) for _, kv, _, _ in specs)
    pool = KVPool(2, total_pages, PAGE, kv_heads, dim, dtype=dtype)
    meta, dense = _random_batch(rng, pool, specs)
    q = torch.randn(meta.num_tokens, heads, dim, dtype=dtype)
    out = paged_attention(q, pool, 1, meta)
    assert out.shape == q.shape and out.dtype == dtype
    for s, start, (k, v) in zip(meta.seqs, meta.q_indptr(), dense, strict=False):
        ref = dense_attention(q[start : start + s.q_len], k, v, s.mask, s.block_size)
        torch.testing.assert_close(out[start : start + s.q_len], ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_custom_scale_and_half_precision() -> None:
    rng = random.Random(7)
    pool = KVPool(2, 8, PAGE, 2, 16, dtype=torch.bfloat16)
    meta, dense = _random_batch(rng, pool, [(4, 20, "causal", None), (1, 33, "full", None)])
    q = torch.randn(meta.num_tokens, 4, 16, dtype=torch.bfloat16)
    out = paged_attention(q, pool, 1, meta, scale=0.3)
    assert out.dtype == torch.bfloat16
    for s, start, (k, v) in zip(meta.seqs, meta.q_indptr(), dense, strict=False):
        qs = q[start : start + s.q_len].double()
        ref = dense_attention(qs, k.double(), v.double(), s.mask, s.block_size, scale=0.3)
        torch.testing.assert_close(out[start : start + s.q_len].double(), ref, atol=2e-2, rtol=2e-2)


def test_fork_copy_on_write_keeps_both_sequences_correct() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, layers = 4, 2, 8, 2
    pool = KVPool(layers, 10, PAGE, kv_heads, dim, dtype=torch.float64)
    bm = BlockManager(10, PAGE)
    src, dst = ("r", "gen"), ("r", "cfg")
    ctx = {src: [], dst: []}  # dense K/V of layer 1 per sequence

    def extend(key: tuple[str, str], n: int) -> None:
        slots = bm.append(key, n)
        for layer in range(layers):
            k, v = (
                torch.randn(n, kv_heads, dim, dtype=torch.float64),
                torch.randn(n, kv_heads, dim, dtype=torch.float64),
            )
            pool.write(layer, k, v, slots)
            if layer == 1:
                ctx[key].append((k, v))

    extend(src, 21)  # one full page + 5 tokens on a partial page
    copy = bm.fork(src, dst)
    assert copy is not None and len(copy.src) == 5
    pool.copy_slots(copy.src, copy.dst)
    ctx[dst] = list(ctx[src])
    extend(src, 6)  # both now write into what was one partial page before the fork
    extend(dst, 4)
    assert bm.page_table(src)[0] == bm.page_table(dst)[0]
    assert bm.page_table(src)[1] != bm.page_table(dst)[1]

    q_lens = [6, 4]
    meta = AttentionMetadata.build(
        q_lens, [bm.seq_len(src), bm.seq_len(dst)], [bm.page_table(src), bm.page_table(dst)]
    )
    q = torch.randn(sum(q_lens), heads, dim, dtype=torch.float64)
    out = paged_attention(q, pool, 1, meta)
    for key, start, q_len in ((src, 0, 6), (dst, 6, 4)):
        k = torch.cat([k for k, _ in ctx[key]])
        v = torch.cat([v for _, v in ctx[key]])
        ref = dense_attention(q[start : start + q_len], k, v, "causal")
        torch.testing.assert_close(out[start : start + q_len], ref, atol=1e-10, rtol=1e-10)


def test_flashinfer_arrays() -> None:
    meta = AttentionMetadata.build([3, 1], [17, 16], [[4, 2, 9], [7, 1]], masks=["causal", "full"])
    assert meta.q_indptr() == [0, 3, 4]
    assert meta.paged_kv_arrays(16) == ([0, 2, 3], [4, 2, 7], [1, 16])


def test_bad_inputs_raise_attention_error() -> None:
    with pytest.raises(AttentionError):
        SequenceAttention(5, 4, (0,))
    with pytest.raises(AttentionError):
        SequenceAttention(1, 4, (0,), "block_causal")
    with pytest.raises(AttentionError):
        SequenceAttention(1, 4, (0,), "sliding")  # type: ignore[arg-type]
    with pytest.raises(AttentionError):
        AttentionMetadata.build([1], [1, 2], [[0]])
    pool = KVPool(1, 2, PAGE, 2, 8)
    meta = AttentionMetadata.build([1], [20], [[0]])  # 20 tokens need 2 pages
    with pytest.raises(AttentionError):
        paged_attention(torch.zeros(1, 4, 8), pool, 0, meta)
    with pytest.raises(AttentionError):
        paged_attention(torch.zeros(1, 3, 8), pool, 0, AttentionMetadata.build([1], [1], [[0]]))
    with pytest.raises(AttentionError):
        pool.write(0, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), [0])
