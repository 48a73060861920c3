"""On the GPU: FlashInfer decode / prefill through `FlashInferBackend` equal the CPU reference.

Every run draws fresh random inputs (the seed is printed, so a failure can be replayed with
MSTAR_TEST_SEED), and every way a kernel could silently use memory it should not is poisoned
first: pages no sequence owns hold NaN (a wrong page index shows as NaN), the unused tail of
each sequence's last page holds large finite values (reading past kv_len skews the result
visibly, without the 0 * NaN of a correctly masked tile), and the allocator's free blocks are
filled with NaN before the run, so an output element the kernel never writes is NaN.
Shapes: bf16, head_dim 128, page 16, the q/kv head counts of Orpheus (24/8) and Llama-3 (32/8),
the lengths of reference/device.md section 2d.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from support import no_host_syncs

from mstar_runtime.kv.attention import AttentionMetadata, KVPool, paged_attention
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.sampling import SamplingParams, columns_of, sample, sample_columns, uniforms

pytestmark = pytest.mark.gpu

PAGE, DIM, DT = 16, 128, torch.bfloat16
HEADS = [(24, 8), (32, 8)]


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("MSTAR_TEST_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
    print(f"MSTAR_TEST_SEED={seed}")
    torch.manual_seed(seed)
    return random.Random(seed)


def poison_free_memory(nbytes: int = 1 << 30) -> None:
    """Fill the caching allocator's free blocks with NaN: outputs allocated next start as NaN."""
    junk = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


def make_batch(
    seqs: list[tuple[int, int, str, int | None]], kv_heads: int, device: torch.device, layers: int = 2
) -> tuple[KVPool, AttentionMetadata]:
    """A pool whose owned tokens hold random K/V, unowned pages NaN, last-page tails 30.0."""
    total_pages = sum(-(-kv // PAGE) for _, kv, _, _ in seqs) + 8
    bm = BlockManager(total_pages, PAGE)
    pool = KVPool(layers, total_pages, PAGE, kv_heads, DIM, DT, device)
    pool.data.fill_(float("nan"))
    tables = []
    for i, (_, kv_len, _, _) in enumerate(seqs):
        key = (f"r{i}", "main")
        slots = bm.append(key, kv_len)
        tables.append(bm.page_table(key))
        for p in tables[-1]:
            pool.data[:, p] = 30.0  # owned pages: tails stay 30.0, real slots are overwritten below
        for layer in range(layers):
            k = torch.randn(kv_len, kv_heads, DIM, device=device, dtype=DT)
            v = torch.randn(kv_len, kv_heads, DIM, device=device, dtype=DT)
            pool.write(layer, k, v, torch.tensor(slots, device=device))
    meta = AttentionMetadata.build([s[0] for s in seqs], [s[1] for s in seqs], tables,
                                   [s[2] for s in seqs], [s[3] for s in seqs])
    return pool, meta


def check(backend, pool: KVPool, meta: AttentionMetadata, heads: int, scale: float | None = None) -> None:
    q = torch.randn(meta.num_tokens, heads, DIM, device=pool.device, dtype=DT)
    for step in range(2):  # the first step plans at its first layer, the second in prepare()
        backend.prepare(pool, meta)
        for layer in range(pool.num_layers):
            poison_free_memory()
            got = backend(q, pool, layer, meta, scale)
            want = paged_attention(q, pool, layer, meta, scale)  # computes in float32
            assert got.dtype == q.dtype and got.shape == q.shape
            assert torch.isfinite(got).all(), f"step {step} layer {layer}: non-finite output"
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < 1e-2, f"step {step} layer {layer}: relative error {float(err):.2e}"


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_decode_equals_reference(cuda: torch.device, rng: random.Random, heads: int, kv_heads: int) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    lens = [1, 15, 16, 17, 500, 2048, 3001] + [rng.randrange(1, 4096) for _ in range(9)]
    rng.shuffle(lens)
    pool, meta = make_batch([(1, n, "causal", None) for n in lens], kv_heads, cuda)
    backend = FlashInferBackend(cuda)
    check(backend, pool, meta, heads)
    check(backend, pool, meta, heads, scale=0.05)  # a node's own attention_scale


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_causal_prefill_equals_reference(cuda: torch.device, rng: random.Random, heads: int, kv_heads: int) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    pairs = [(1, 1), (17, 40), (128, 128), (300, 1000), (513, 2100), (1, 77)]
    pairs.append((q := rng.randrange(2, 400), q + rng.randrange(0, 900)))
    pool, meta = make_batch([(q, kv, "causal", None) for q, kv in pairs], kv_heads, cuda)
    check(FlashInferBackend(cuda), pool, meta, heads)


def test_full_and_mixed_masks_equal_reference(cuda: torch.device, rng: random.Random) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(cuda)
    full = [(64, 64, "full", None), (30, 200, "full", None), (1, 9, "causal", None)]
    check(backend, *make_batch(full, 8, cuda), 24)
    block = rng.choice([16, 258])
    mixed = [(100, 100, "causal", None), (64, 300, "full", None), (3 * block, 5 * block, "block_causal", block),
             (1, 40, "causal", None)]
    check(backend, *make_batch(mixed, 8, cuda), 24)


def test_reference_for_pools_flashinfer_does_not_serve(cuda: torch.device) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend, unsupported

    pool = KVPool(1, 4, PAGE, 2, 16, torch.float32, cuda)  # fp32, head_dim 16: the reference serves it
    assert unsupported(pool) is not None
    meta = AttentionMetadata.build([1], [5], [[0]])
    q = torch.randn(1, 4, 16, device=cuda)
    backend = FlashInferBackend(cuda)
    backend.prepare(pool, meta)
    assert torch.equal(backend(q, pool, 0, meta, None), paged_attention(q, pool, 0, meta))


def test_decode_step_has_no_host_sync(cuda: torch.device) -> None:
    """prepare() + every layer of a decode step, after the first step taught the backend its head
    count: no torch-level device synchronisation (pinned, non-blocking uploads only)."""
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    pool, meta = make_batch([(1, n, "causal", None) for n in (5, 100, 1000)], 8, cuda)
    backend = FlashInferBackend(cuda)
    q = torch.randn(3, 24, DIM, device=cuda, dtype=DT)
    backend.prepare(pool, meta)
    backend(q, pool, 0, meta, None)
    with no_host_syncs():
        backend.prepare(pool, meta)
        for layer in range(pool.num_layers):
            backend(q, pool, layer, meta, None)


# ------------------------------------------------------------------------------- sampler
def test_sampler_on_gpu_matches_cpu_and_never_syncs(cuda: torch.device, rng: random.Random) -> None:
    vocab, b = 156940, 64
    logits = torch.randn(b, vocab) * 4
    params = [SamplingParams(0.6, 0 if i % 3 else 50, 0.8, 1.3, seed=rng.randrange(2**64)) for i in range(b)]
    params[5] = SamplingParams(temperature=0.0, repetition_penalty=1.3)  # a greedy row
    hists = [torch.randint(0, vocab, (rng.randrange(0, 400),)) for _ in range(b)]
    steps = [rng.randrange(0, 5000) for _ in range(b)]
    cpu = sample(logits, params, hists, steps)
    cols = columns_of(params, [h.to(cuda) for h in hists], steps, cuda)
    assert torch.equal(uniforms(cols.seed, cols.step).cpu(), uniforms(cols.seed.cpu(), cols.step.cpu()))
    gl = logits.to(cuda)
    sample_columns(gl, cols)
    with no_host_syncs():
        cols = columns_of(params, [h.to(cuda, non_blocking=True) for h in hists], steps, cuda)
        gpu = sample_columns(gl, cols)
    same = (gpu.cpu() == cpu).float().mean()
    # float32 softmax/cumsum differ in the last bits between devices: an inverse-CDF draw that
    # lands within that distance of a token boundary may pick the neighbour; all others agree
    assert same >= 0.95, f"only {float(same):.0%} of rows drew the CPU's token"
    assert int(gpu[5]) == int(cpu[5])
