"""The GPU fast path's host-side logic, on the CPU.

- `GraphRunner` with `capture=False`: bucketing, padding with scratch rows, static buffers and
  slicing, checked by running the test family's TinyLM decode through `attn.run_graphed`
  and comparing every step with the plain (unpadded, eager) engine: same tokens, same hidden
  states, same KV in every real page.
- `FlashInferBackend` and `FlashInferGraphDecode` against a fake `flashinfer` module whose
  wrappers compute attention from the indptr / indices / last_page_len / mask arrays they are
  given (an independent reading of FlashInfer's conventions): so the host arrays, the mask
  kinds and the plan/run order are checked here; the real kernels are checked by
  tests/test_gpu_flashinfer.py on the device.
"""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch
from support import KVDriver, bound_layer_equals_paged
from support import fake_flashinfer as install_fake_flashinfer

from mstar_models.testfamily import TinyLM
from mstar_models.testfamily.family import CONFIGS, node_spec
from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
from mstar_runtime.engine.graphs import GraphRunner, ReferenceBucketDecode, graph_buckets, pad_decode
from mstar_runtime.kv import flashinfer_backend as fib
from mstar_runtime.kv.attention import (
    AttentionMetadata,
    KVPool,
    attention_mask,
    paged_attention,
)
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import AttentionContext, Batch, NodeError
from mstar_runtime.ops.readback import resolve

PAGE, PAGES, BUCKETS = 4, 64, (1, 2, 4, 8)
PORTS = {"prefill": ("token", "code", "done"), "decode": ("token", "code", "done"), "denoise": ("v",)}


class GraphedTinyLM(TinyLM):
    """TinyLM whose decode forward goes through `attn.run_graphed`, as a GPU-served node's does."""

    def phase_decode(self, batch: Batch, attn: AttentionContext) -> Batch:
        for seq in attn.seqs:
            assert "gen_base" in seq.state
        ids = torch.cat([entry["token"] for entry in batch]).long()
        hidden = attn.run_graphed(
            lambda i, p: self.forward_hidden(self.model.embed_tokens(i), p, attn.attend), ids, attn.positions()
        )
        return self._next_tokens(hidden, attn)


def tiny_lm(cls: type[TinyLM]) -> TinyLM:
    return cls(node_spec("lm", CONFIGS["tiny"])).eval()


@pytest.fixture
def drivers() -> tuple[KVDriver, KVDriver]:
    plain = tiny_lm(TinyLM)
    graphed = tiny_lm(GraphedTinyLM)
    graphed.load_state_dict(plain.state_dict())  # weights are seeded by class name: copy them
    a = KVCacheEngine(plain, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS)
    b = KVCacheEngine(graphed, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS,
                      graphs={"decode": BUCKETS}, capture_graphs=False)
    return KVDriver(a, PAGES, PAGE), KVDriver(b, PAGES, PAGE)


def test_buckets_and_acceptance() -> None:
    pool = KVPool(1, 5, PAGE, 1, 8)
    runner = GraphRunner(pool, [8, 1, 2, 4, 4], lambda b, m: ReferenceBucketDecode(pool, None),
                         scratch_page=4, capture=False)
    assert runner.buckets == [1, 2, 4, 8]
    assert [runner.bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 0)] == [1, 2, 4, 8, 8, None, None]
    decode = AttentionMetadata.build([1, 1, 1], [3, 9, 1], [[0], [1, 2, 3], [0]])
    assert runner.accepts(decode, 3)
    assert not runner.accepts(decode, 4)  # an entry with q_len 0 is in the batch but not attending
    assert not runner.accepts(AttentionMetadata.build([2, 1], [3, 9], [[0], [1, 2, 3]]), 2)  # prefill
    assert not runner.accepts(AttentionMetadata.build([1] * 9, [1] * 9, [[0]] * 9), 9)  # beyond 8
    runner.release()  # before a NCCL group ends: the graphs go, later steps run eagerly
    assert not runner.accepts(decode, 3) and runner.failed == "released"
    with pytest.raises(ValueError, match="cuda pool"):
        GraphRunner(pool, [1], lambda b, m: ReferenceBucketDecode(pool, None), scratch_page=4, capture=True)


def test_padded_arrays_use_the_scratch_page_for_pad_rows() -> None:
    meta = AttentionMetadata.build([1, 1], [5, 1], [[3, 7], [2]])
    step = pad_decode(meta, [7 * 4 + 0, 2 * 4 + 0], 4, 4, scratch_page=9, pin=False)
    assert step.indptr.tolist() == [0, 2, 3, 4, 5] and step.indptr.dtype == torch.int32
    assert step.indices.tolist() == [3, 7, 2, 9, 9] and step.last_page_len.tolist() == [1, 1, 1, 1]
    assert step.pages.tolist() == [7, 2, 9, 9] and step.offsets.tolist() == [0, 0, 0, 0]
    assert [s.page_table for s in step.meta.seqs[2:]] == [(9,), (9,)] and step.real == 2
    with pytest.raises(ValueError):
        pad_decode(meta, [1, 2], 1, 4, scratch_page=9, pin=False)


def test_graph_buckets_from_plan_entries() -> None:
    entries = [
        {"kind": "step", "node": "llm", "phase": "decode", "rank": 0, "buckets": [1, 2, 4]},
        {"kind": "step", "node": "llm", "phase": "decode", "rank": 1, "buckets": [8]},
        {"kind": "step", "node": "snac", "phase": "decode", "rank": 0, "buckets": [1]},
        {"kind": "loop", "node": None, "phase": None, "rank": 0, "buckets": [1]},
    ]
    assert graph_buckets(entries, "llm", 0) == {"decode": (1, 2, 4)}
    assert graph_buckets(entries, "llm", 2) == {}


def test_padded_decode_equals_the_unpadded_run(drivers: tuple[KVDriver, KVDriver]) -> None:
    plain, graphed = drivers
    runner = graphed.engine.graph_runners["decode"]
    assert graphed.engine.pool.num_pages == PAGES + 1 and graphed.engine.num_pages == PAGES
    prompts = [torch.randint(16, 272, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)) for i in range(9)]
    tokens: dict[str, torch.Tensor] = {}
    for d in drivers:
        outs = d.step("prefill", [(f"r{i}", {"tokens": p, "max_new": 30}, len(p)) for i, p in enumerate(prompts)])
        tokens = {f"r{i}": o["token"] for i, o in enumerate(outs)}
    # batches of 3 (bucket 4), 5 (8), 1 (1), 9 (beyond the largest bucket: eager), 2 (2), 8 (8)
    groups = [[0, 1, 2], [0, 1, 2, 3, 4], [5], list(range(9)), [6, 7], [1, 2, 3, 4, 5, 6, 7, 8]] * 3
    graphed_steps = 0
    for group in groups:
        items = [(f"r{i}", {"token": tokens[f"r{i}"]}, 1) for i in group]
        a = plain.step("decode", items)
        b = graphed.step("decode", items)
        graphed_steps += len(group) <= max(BUCKETS)
        for i, x, y in zip(group, a, b):
            assert x["token"].tolist() == y["token"].tolist() and resolve(x["done"]) == resolve(y["done"]), i
            torch.testing.assert_close(x["hidden"], y["hidden"], atol=1e-5, rtol=1e-5)
            tokens[f"r{i}"] = x["token"]
    assert runner.replays == graphed_steps
    # the pad rows wrote only the scratch page: every real page holds exactly what the plain engine wrote
    torch.testing.assert_close(graphed.engine.pool.data[:, :PAGES], plain.engine.pool.data, atol=1e-5, rtol=1e-5)
    assert torch.equal(graphed.engine.pool.data[:, :PAGES] == 0, plain.engine.pool.data == 0)
    assert graphed.engine.pool.data[:, PAGES].abs().sum() > 0  # ... and they did write it


def test_a_column_step_replays_through_the_runner() -> None:
    """TinyLM writes `decode` only as a column step: a plain call with a graph runner bound
    runs it through `run_graphed` (ops/column_call.py: inputs, columns and positions as rows;
    the columns as the step left them come back), so the padded replay gives the unpadded
    eager run's tokens, flags and hidden states, and beyond the largest bucket it runs eagerly."""
    plain = tiny_lm(TinyLM)
    twin = tiny_lm(TinyLM)
    twin.load_state_dict(plain.state_dict())
    a = KVDriver(KVCacheEngine(plain, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS), PAGES, PAGE)
    b = KVDriver(KVCacheEngine(twin, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS,
                               graphs={"decode": BUCKETS}, capture_graphs=False), PAGES, PAGE)
    runner = b.engine.graph_runners["decode"]
    prompts = [torch.randint(16, 272, (2 + i,), generator=torch.Generator().manual_seed(i)) for i in range(9)]
    tokens: dict[str, torch.Tensor] = {}
    for d in (a, b):
        outs = d.step("prefill", [(f"r{i}", {"tokens": p, "max_new": 12}, len(p)) for i, p in enumerate(prompts)])
        tokens = {f"r{i}": o["token"] for i, o in enumerate(outs)}
    replays = 0
    for group in [[0, 1, 2], [4], list(range(9)), [5, 6, 7, 8, 0]] * 2:
        items = [(f"r{i}", {"token": tokens[f"r{i}"]}, 1) for i in group]
        x_out, y_out = a.step("decode", items), b.step("decode", items)
        replays += len(group) <= max(BUCKETS)
        for i, x, y in zip(group, x_out, y_out, strict=True):
            assert x["token"].tolist() == y["token"].tolist() and resolve(x["done"]) == resolve(y["done"]), i
            assert resolve(x["code"]).tolist() == resolve(y["code"]).tolist(), i
            torch.testing.assert_close(x["hidden"], y["hidden"], atol=1e-5, rtol=1e-5)
            tokens[f"r{i}"] = x["token"]
    assert runner.replays == replays > 0
    torch.testing.assert_close(b.engine.pool.data[:, :PAGES], a.engine.pool.data, atol=1e-5, rtol=1e-5)


def test_a_column_step_whose_ports_differ_from_the_captured_ones_runs_eagerly() -> None:
    """A replay runs the captured step, which reads each tensor where the captured entries'
    ports put it (sorted by name): a step whose entries carry other ports ('z' sorts after
    'token', 'a' before it) would feed 'z' as the token. So the call names its tensors and
    such a step runs eagerly, with the eager run's tokens; a step like the captured one
    replays again."""
    plain, twin = tiny_lm(TinyLM), tiny_lm(TinyLM)
    twin.load_state_dict(plain.state_dict())
    a = KVDriver(KVCacheEngine(plain, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS), PAGES, PAGE)
    b = KVDriver(KVCacheEngine(twin, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS,
                               graphs={"decode": BUCKETS}, capture_graphs=False), PAGES, PAGE)
    runner = b.engine.graph_runners["decode"]
    prompts = [torch.randint(16, 272, (3 + i,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    tokens: dict[str, torch.Tensor] = {}
    for d in (a, b):
        outs = d.step("prefill", [(f"r{i}", {"tokens": p, "max_new": 12}, len(p)) for i, p in enumerate(prompts)])
        tokens = {f"r{i}": o["token"] for i, o in enumerate(outs)}
    for extra, replays, renamed in (("a", 1, 0), ("z", 1, 1), ("a", 2, 1)):
        items = [(rid, {"token": t, extra: torch.full_like(t, 7)}, 1) for rid, t in tokens.items()]
        x_out, y_out = a.step("decode", items), b.step("decode", items)
        assert (runner.replays, runner.renamed) == (replays, renamed), extra
        for rid, x, y in zip(tokens, x_out, y_out, strict=True):
            assert x["token"].tolist() == y["token"].tolist(), (extra, rid)
            tokens[rid] = x["token"]


def test_run_graphed_checks_its_inputs(drivers: tuple[KVDriver, KVDriver]) -> None:
    _, graphed = drivers
    pool = graphed.engine.pool
    runner = graphed.engine.graph_runners["decode"]
    meta = AttentionMetadata.build([1, 1], [1, 1], [[0], [1]])
    attn = AttentionContext([], lambda *a: a[1], pool.device)
    bound = runner.bind(attn, meta, [0, 4])
    with pytest.raises(NodeError, match="one row per entry"):
        bound(lambda x: x, torch.zeros(3, 2))


# ------------------------------------------------------------------------ a fake flashinfer
def _fake_attention(q: torch.Tensor, kv: torch.Tensor, rows: list[tuple[int, int]], tables: list[list[int]],
                    lasts: list[int], scale: float, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Attention read straight from FlashInfer-style arrays: rows (qo range), page lists, last_page_len."""
    out = torch.empty_like(q)
    ps = kv.shape[2]
    for (a, b), pages, last, mask in zip(rows, tables, lasts, masks):
        kv_len = (len(pages) - 1) * ps + last
        k = kv[pages, 0].reshape(-1, *kv.shape[3:])[:kv_len].float()
        v = kv[pages, 1].reshape(-1, *kv.shape[3:])[:kv_len].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        if mask is not None:
            s = s.masked_fill(~mask.view(1, b - a, kv_len), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


class _FakeWrapper:
    """Records plan() arguments (as host lists) and computes run() from them."""

    calls: list[str] = []

    def __init__(self, workspace: torch.Tensor, layout: str, **kw: Any):
        assert layout == "NHD"
        self.kw = kw
        self.plan_args: dict[str, Any] | None = None

    def _tables(self, indptr: list[int], indices: list[int]) -> list[list[int]]:
        return [indices[indptr[i] : indptr[i + 1]] for i in range(len(indptr) - 1)]

    def run(self, q: torch.Tensor, kv: torch.Tensor, **kw: Any) -> torch.Tensor:
        p = self.plan_args
        assert p is not None, "run() before plan()"
        assert q.dtype == p["q_data_type"] and kv.dtype == p["kv_data_type"] and q.shape[1] == p["heads"]
        _FakeWrapper.calls.append(f"run {type(self).__name__}")
        return _fake_attention(q, kv, p["rows"], p["tables"], p["last"], p["sm_scale"], p["masks"])


class FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page_size, **kw: Any) -> None:
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32 and indptr.device.type == "cpu"
        if self.kw.get("use_cuda_graph"):
            assert len(indptr) == len(self.kw["paged_kv_indptr_buffer"])
            assert len(indices) <= len(self.kw["paged_kv_indices_buffer"])
        ip = indptr.tolist()
        self.plan_args = dict(kw, heads=heads, rows=[(i, i + 1) for i in range(len(ip) - 1)],
                              tables=self._tables(ip, indices.tolist()), last=last.tolist(),
                              masks=[None] * (len(ip) - 1))
        _FakeWrapper.calls.append("plan decode")


class FakePrefill(_FakeWrapper):
    def plan(self, qo, indptr, indices, last, heads, kv_heads, head_dim, page_size, *, causal: bool,
             custom_mask: torch.Tensor | None, **kw: Any) -> None:
        qo_l, ip, lasts = qo.tolist(), indptr.tolist(), last.tolist()
        tables = self._tables(ip, indices.tolist())
        rows = [(qo_l[i], qo_l[i + 1]) for i in range(len(qo_l) - 1)]
        masks: list[torch.Tensor | None] = []
        at = 0
        for (a, b), pages, lp in zip(rows, tables, lasts):
            kv_len = (len(pages) - 1) * page_size + lp
            if custom_mask is not None:
                masks.append(custom_mask[at : at + (b - a) * kv_len].cpu())
                at += (b - a) * kv_len
            else:
                masks.append(attention_mask(b - a, kv_len, "causal") if causal else None)
        assert custom_mask is None or at == custom_mask.numel()
        self.plan_args = dict(kw, heads=heads, rows=rows, tables=tables, last=lasts, masks=masks)
        _FakeWrapper.calls.append(f"plan prefill causal={causal} custom={custom_mask is not None}")


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = install_fake_flashinfer(monkeypatch, FakeDecode, FakePrefill)
    _FakeWrapper.calls = []
    return mod


def _pool_with(seqs: list[tuple[int, int, str, int | None]], seed: int = 0) -> tuple[KVPool, AttentionMetadata, torch.Tensor]:
    """A pool holding random K/V for each (q_len, kv_len, mask, block) entry, their metadata and a q."""
    g = torch.Generator().manual_seed(seed)
    bm = BlockManager(40, PAGE)
    pool = KVPool(2, 40, PAGE, 2, 8)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    tables = []
    for i, (_, kv_len, _, _) in enumerate(seqs):
        bm.append((f"r{i}", "main"), kv_len)
        tables.append(bm.page_table((f"r{i}", "main")))
    meta = AttentionMetadata.build([s[0] for s in seqs], [s[1] for s in seqs], tables,
                                   [s[2] for s in seqs], [s[3] for s in seqs])
    q = torch.randn(meta.num_tokens, 4, 8, generator=g)
    return pool, meta, q


BATCHES = {
    "decode": [(1, 1, "causal", None), (1, 9, "causal", None), (1, 4, "full", None), (1, 17, "block_causal", 3)],
    "causal": [(5, 5, "causal", None), (1, 12, "causal", None), (7, 19, "causal", None)],
    "full": [(4, 10, "full", None), (3, 3, "full", None), (1, 6, "causal", None)],
    "mixed": [(5, 5, "causal", None), (4, 10, "full", None), (6, 14, "block_causal", 4), (1, 3, "causal", None)],
    # a rollout step: each entry appends exactly its last block, so block-causal is full attention
    "rollout": [(6, 12, "block_causal", 6), (4, 16, "block_causal", 4), (3, 7, "full", None)],
}
EXPECT = {"decode": "plan decode", "causal": "plan prefill causal=True custom=False",
          "full": "plan prefill causal=False custom=False", "mixed": "plan prefill causal=True custom=True",
          "rollout": "plan prefill causal=False custom=False"}


@pytest.mark.parametrize("kind", list(BATCHES))
def test_flashinfer_backend_host_side_equals_the_reference(fake_flashinfer: types.ModuleType, kind: str) -> None:
    pool, meta, q = _pool_with(BATCHES[kind])
    backend = fib.FlashInferBackend("cpu")
    backend.prepare(pool, meta)  # heads and scale unknown yet: planned at the first call
    assert _FakeWrapper.calls == []
    for layer in range(2):
        torch.testing.assert_close(backend(q, pool, layer, meta, None), paged_attention(q, pool, layer, meta),
                                   atol=1e-5, rtol=1e-5)
    plan = EXPECT[kind].replace("causal=True custom=True", "causal=False custom=True")
    assert _FakeWrapper.calls[0] == plan and _FakeWrapper.calls.count(plan) == 1
    # the next step plans in prepare(), with the learnt head count and scale
    _FakeWrapper.calls = []
    backend.prepare(pool, meta)
    assert _FakeWrapper.calls == [plan]
    scale = 0.3
    torch.testing.assert_close(backend(q, pool, 0, meta, scale), paged_attention(q, pool, 0, meta, scale),
                               atol=1e-5, rtol=1e-5)
    assert _FakeWrapper.calls.count(plan) == 2  # another scale: planned again once


def test_flashinfer_backend_falls_back_when_planning_fails(
    fake_flashinfer: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: Any, **k: Any) -> None:
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(FakePrefill, "plan", broken)
    pool, meta, q = _pool_with(BATCHES["causal"])
    backend = fib.FlashInferBackend("cpu")
    for _ in range(2):
        backend.prepare(pool, meta)
        torch.testing.assert_close(backend(q, pool, 1, meta, None), paged_attention(q, pool, 1, meta))
    assert ("prefill", False, False) in backend._failed  # (mode, custom mask, long)


def test_select_backend_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fib.select_backend("cpu") is paged_attention
    monkeypatch.setenv(fib.ENV_VAR, "reference")
    assert fib.select_backend("cpu") is paged_attention
    assert fib.backend_name(paged_attention) == "reference"


def test_graph_decode_wrapper_over_padded_buckets(fake_flashinfer: types.ModuleType) -> None:
    """The GPU composition without the capture: GraphRunner + FlashInferGraphDecode buckets."""
    pool, meta, q = _pool_with(BATCHES["decode"], seed=3)
    backend = fib.FlashInferBackend("cpu")
    make = backend.graph_decoder(pool, None)
    assert make is not None
    runner = GraphRunner(pool, (1, 2, 8), make, scratch_page=39, capture=False)
    k = torch.randn(4, 2, 8)
    slots = [s.page_table[(s.kv_len - 1) // PAGE] * PAGE + (s.kv_len - 1) % PAGE for s in meta.seqs]
    out = bound_layer_equals_paged(runner, pool, meta, slots, q, k)
    assert out.shape == (4, 4, 8) and runner.replays == 1
    assert math.isclose(make(1, 8).scale, 1 / math.sqrt(8))


def test_block_causal_in_its_last_block_is_full_attention() -> None:
    from mstar_runtime.kv.attention import SequenceAttention

    for q in range(1, 10):
        for kv in range(q, 25):
            for block in range(1, 7):
                s = SequenceAttention(q, kv, tuple(range(7)), "block_causal", block)
                full = bool(attention_mask(q, kv, "block_causal", block).all())
                assert (fib._effective_mask(s) == "full") == full, (q, kv, block)


def test_long_prefills_plan_and_run_on_the_second_wrapper(
    fake_flashinfer: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of >= LONG_PREFILL_TOKENS queries without a custom mask (BAGEL's image blocks)
    runs on the long-prefill wrapper (FA3 on Hopper by default); a shorter one on the first."""
    monkeypatch.delenv(fib.LONG_PREFILL_ENV, raising=False)
    backend = fib.FlashInferBackend("cpu")
    assert backend._prefill_long is not backend._prefill and backend._prefill_long.kw["backend"] == "auto"
    monkeypatch.setattr(fib, "LONG_PREFILL_TOKENS", 8)
    pool, meta, q = _pool_with(BATCHES["full"])  # 4 + 3 + 1 = 8 queries: long
    backend.prepare(pool, meta)
    torch.testing.assert_close(backend(q, pool, 1, meta, None), paged_attention(q, pool, 1, meta))
    assert backend._prefill_long.plan_args is not None and backend._prefill.plan_args is None
    pool, meta, q = _pool_with(BATCHES["causal"][:1])  # 5 queries: short
    backend.prepare(pool, meta)
    torch.testing.assert_close(backend(q, pool, 1, meta, None), paged_attention(q, pool, 1, meta))
    assert backend._prefill.plan_args is not None
    monkeypatch.setenv(fib.LONG_PREFILL_ENV, "fa2")  # one module: the same wrapper
    one = fib.FlashInferBackend("cpu")
    assert one._prefill_long is one._prefill


def test_prefix_chunks_plan_flashinfer_once_per_piece(fake_flashinfer: types.ModuleType) -> None:
    """A prefill with prefix caching's chunk (engine/chunked.py) on the FlashInfer backend: the
    prefill wrapper is planned once per chunk, before that chunk's layers, with the chunk's
    rows over the pages before it; the K/V written equal the reference backend's chunks."""
    lm = tiny_lm(TinyLM)
    engines = [KVCacheEngine(lm, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS),
               KVCacheEngine(lm, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS,
                             attention_backend=fib.FlashInferBackend("cpu"))]
    tokens = torch.arange(3, 14)  # 11 tokens: chunks of 4 at [0, 4), [4, 8), [8, 11)
    bm = BlockManager(PAGES, PAGE)
    slots = bm.append(("r", "main"), 11)
    kv = KVSlots(0, 11, slots, bm.page_table(("r", "main")), chunk=PAGE)
    outs = [e.run("prefill", [StepEntry("r", None, {"tokens": tokens, "max_new": 2}, kv)]) for e in engines]
    assert resolve(outs[0])[0]["token"].tolist() == resolve(outs[1])[0]["token"].tolist()
    torch.testing.assert_close(engines[1].pool.data, engines[0].pool.data, atol=1e-5, rtol=1e-5)
    layers = engines[0].pool.num_layers
    plan, run = "plan prefill causal=True custom=False", "run FakePrefill"
    # the first chunk plans at its first layer (the head count is learnt there), the others in prepare
    assert _FakeWrapper.calls == ([plan] + [run] * layers) * 3
