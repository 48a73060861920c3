"""The V-JEPA 2-AC rollout step's CUDA-graph path and the CEM's per-row attention, on the CPU.

- `GraphRunner` for fixed-block steps (every entry adds Q > 1 tokens over its whole context):
  the padded host arrays (qo_indptr, pad entries over the scratch page, pages/offsets of the
  new tokens), which batches it accepts, the cap on tokens per graph; then the predictor
  itself (a tiny size, float32, weights with std 0.2 so that a wrong key or row shows) with
  `capture=False`: single-trajectory rollouts of several requests in batches that pad to
  buckets 1, 2 and 4, one beyond the largest bucket (eager) and one with a multi-row entry
  (eager), each step equal to the plain engine's unpadded eager step, and the pad entries
  wrote the scratch page only.
- The CEM's rows: `row_layout` (one attention entry per trajectory: its block's queries, the
  history's and its own blocks' slots as keys) against positions written out by hand; the
  one-token page views FlashInfer reads them through (`token_views` / `token_view_index`);
  `FlashInferRowPrefill` and `FlashInferGraphPrefill` against a fake `flashinfer` module
  that computes attention from the arrays it is given (an independent reading of FlashInfer's
  paged conventions), both through the node and alone; the engine's backend no longer plans a
  whole-step custom mask for a multi-row step (the 400 x 258-token "negative dimension").
- The compiled plan: the predictor's `step` is a captured step on a GPU placement.
The real kernels and the captured replays: tests/test_gpu_vjepa2_graphs.py on the device.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from support import KVDriver, bound_layer_equals_paged
from support import fake_flashinfer as install_fake_flashinfer

from mstar_models.vjepa2.predictor import ACPredictor, RowEntry, row_attention_reference, row_layout
from mstar_runtime.engine.engines import KVCacheEngine
from mstar_runtime.engine.graphs import (
    DEFAULT_MAX_GRAPH_TOKENS,
    GraphRunner,
    ReferenceBucketDecode,
    pad_step,
    sees_whole_context,
)
from mstar_runtime.kv import flashinfer_backend as fib
from mstar_runtime.kv.attention import (
    AttentionMetadata,
    KVPool,
    SequenceAttention,
    attention_mask,
)
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import AttentionContext, NodeError, NodeSpec

ROOT = Path(__file__).resolve().parent.parent
PAGE, PAGES, BUCKETS = 4, 160, (1, 2, 4)
TPF, ENC = 4, 64  # tokens per frame, encoder dim
PER = TPF + 2  # tokens per step: action, state, frame tokens
PORTS = {"prefill": ("frame", "state"), "step": ("frame", "state")}


# ------------------------------------------------------------------------------ the node
def predictor(seed: int = 2, max_steps: int = 8) -> ACPredictor:
    spec = NodeSpec(name="predictor", engine="kv", config={"tokens_per_frame": TPF, "max_steps": max_steps},
                    arch_args={"enc_dim": ENC, "dim": 64, "heads": 2, "depth": 2, "mlp": 128},
                    settings={"max_steps": max_steps, "normalize_reps": True}, dtype=torch.float32,
                    device=torch.device("cpu"))
    node = ACPredictor(spec).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in node.named_parameters():
            gain = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05) + gain)
    return node


def _context(g: torch.Generator, frames: int) -> dict[str, torch.Tensor]:
    return {"frames": torch.nn.functional.layer_norm(torch.randn(frames, TPF, ENC, generator=g), (ENC,)),
            "states": torch.rand(frames, 7, generator=g)}


# ------------------------------------------------------------------------------ the runner alone
def test_padded_fixed_block_arrays() -> None:
    """Q = 6 tokens per entry, page size 4: a pad entry has 6 queries over 6 tokens of the scratch
    page (two copies, 2 in the last), writes its 6 tokens there; qo_indptr is fixed per bucket."""
    meta = AttentionMetadata.build([6, 6], [12, 6], [[3, 7, 8], [2, 5]], "block_causal", [6, 6])
    slots = [7 * 4 + 2, 7 * 4 + 3, 8 * 4, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3] + [2 * 4 + i for i in range(4)] + [20, 21]
    step = pad_step(meta, slots, 4, 4, scratch_page=9, pin=False, tokens=6)
    assert step.qo_indptr.tolist() == [0, 6, 12, 18, 24] and step.qo_indptr.dtype == torch.int32
    assert step.indptr.tolist() == [0, 3, 5, 7, 9]
    assert step.indices.tolist() == [3, 7, 8, 2, 5, 9, 9, 9, 9]
    assert step.last_page_len.tolist() == [4, 2, 2, 2]
    assert step.pages.tolist() == [7, 7, 8, 8, 8, 8, 2, 2, 2, 2, 5, 5] + [9] * 12
    assert step.offsets.tolist() == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1] + [0, 1, 2, 3, 0, 1] * 2
    assert step.real == 2 and step.tokens == 6 and step.bucket == 4
    pads = step.meta.seqs[2:]
    assert [(s.q_len, s.kv_len, s.page_table, s.mask) for s in pads] == [(6, 6, (9, 9), "full")] * 2
    with pytest.raises(ValueError, match="every entry must add 6"):
        pad_step(AttentionMetadata.build([5], [5], [[1, 2]]), list(range(6)), 1, 4, 9, False, 6)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_step(meta, slots[:-1], 4, 4, 9, False, 6)
    empty = pad_step(AttentionMetadata(()), [], 2, 4, 9, False, 6, allow_empty=True)
    assert empty.real == 0 and empty.indices.tolist() == [9] * 4


def test_sees_whole_context_agrees_with_the_backend() -> None:
    for q in range(1, 9):
        for kv in range(q, 20):
            for mask, block in (("causal", None), ("full", None), ("block_causal", 3), ("block_causal", 6)):
                s = SequenceAttention(q, kv, tuple(range(6)), mask, block)  # type: ignore[arg-type]
                assert sees_whole_context(s) == (fib._effective_mask(s) == "full" or q == 1), (q, kv, mask, block)
                m = attention_mask(q, kv, mask, block)  # type: ignore[arg-type]
                assert sees_whole_context(s) == (m is None or bool(m.all()))


def test_fixed_block_acceptance_and_token_cap() -> None:
    pool = KVPool(1, 10, PAGE, 1, 8)
    ref = lambda b, m: ReferenceBucketDecode(pool, None)  # noqa: E731
    runner = GraphRunner(pool, (1, 2, 4, 8), ref, scratch_page=9, capture=False, tokens=6)
    assert runner.buckets == [1, 2, 4, 8]  # 8 x 6 tokens is under the default cap
    rollout = AttentionMetadata.build([6, 6], [12, 6], [[0, 1, 2], [3, 4]], "block_causal", [6, 6])
    assert runner.accepts(rollout, 2)
    assert not runner.accepts(rollout, 3)  # an entry adding no tokens is in the batch
    assert runner.accepts(AttentionMetadata.build([6], [9], [[0, 1, 2]], "full"), 1)
    assert not runner.accepts(AttentionMetadata.build([6], [6], [[0, 1]], "causal"), 1)  # masked within
    assert not runner.accepts(AttentionMetadata.build([6], [9], [[0, 1, 2]], "block_causal", [3]), 1)  # 2 blocks
    assert not runner.accepts(AttentionMetadata.build([12], [12], [[0, 1, 2]], "full"), 1)  # two rows' worth
    assert not runner.accepts(AttentionMetadata.build([1], [9], [[0, 1, 2]]), 1)  # a decode entry
    assert not runner.accepts(AttentionMetadata.build([6] * 9, [6] * 9, [[0, 1]] * 9, "full"), 9)  # > 8
    capped = GraphRunner(pool, (1, 2, 4, 8, 16), ref, scratch_page=9, capture=False, tokens=6, max_tokens=30)
    assert capped.buckets == [1, 2, 4]  # 4 x 6 <= 30 < 8 x 6
    assert GraphRunner(pool, (4, 8), ref, scratch_page=9, capture=False, tokens=6, max_tokens=5).buckets == [4]
    assert GraphRunner(pool, (1, 512), ref, scratch_page=9, capture=False, tokens=258).buckets == [1]
    assert 48 * 258 <= DEFAULT_MAX_GRAPH_TOKENS < 64 * 258  # the real predictor: buckets up to 48
    attn = AttentionContext([], lambda *a: a[1], pool.device)
    bound = runner.bind(attn, rollout, list(range(12)))
    with pytest.raises(NodeError, match=r"one row per entry token \(2 entries x 6 tokens = 12 rows\)"):
        bound(lambda x: x, torch.zeros(2, 3))


# ------------------------------------------------------------------------------ the node, padded
@pytest.fixture
def drivers() -> tuple[KVDriver, KVDriver]:
    plain, graphed = predictor(), predictor()
    a = KVCacheEngine(plain, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS)
    b = KVCacheEngine(graphed, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS,
                      graphs={"step": BUCKETS}, capture_graphs=False)
    return KVDriver(a, PAGES, PAGE), KVDriver(b, PAGES, PAGE)


def test_padded_rollout_steps_equal_the_unpadded_eager_steps(drivers: tuple[KVDriver, KVDriver]) -> None:
    plain, graphed = drivers
    runner = graphed.engine.graph_runners["step"]
    assert runner.tokens == PER and runner.buckets == list(BUCKETS) and not runner.capture
    assert "prefill" not in graphed.engine.graph_runners
    assert graphed.engine.pool.num_pages == PAGES + 1  # the scratch page
    g = torch.Generator().manual_seed(3)
    n, horizon = 6, 5
    ctx = {f"r{i}": _context(g, 1 + i % 3) for i in range(n)}  # 1 to 3 context frames: different starts
    actions = {r: torch.randn(1, 3 + horizon, 7, generator=g) * 0.3 for r in ctx}
    carry: dict[str, dict[str, torch.Tensor]] = {}
    for d in drivers:
        outs = d.step("prefill", [(r, {**c, "actions": actions[r]}) for r, c in ctx.items()])
        carry = {r: dict(o) for r, o in zip(ctx, outs)}
    # batches of 3 (bucket 4), 1 (1), 2 (2), 6 (beyond 4: eager), 4 (4); each request steps horizon times
    groups = [[0, 1, 2], [3], [4, 5], list(range(6)), [0, 1, 3, 4], [2, 5], [5], [0, 1, 2, 3], [4]]
    graphed_steps = 0
    for group in groups:
        items = [(f"r{i}", {"frame": carry[f"r{i}"]["frame"], "state": carry[f"r{i}"]["state"],
                            "actions": actions[f"r{i}"]}) for i in group]
        a, b = plain.step("step", items), graphed.step("step", items)
        graphed_steps += len(group) <= max(BUCKETS)
        for i, x, y in zip(group, a, b):
            assert x["frame"].shape == (1, TPF, ENC)
            torch.testing.assert_close(y["frame"], x["frame"], atol=1e-5, rtol=0)
            torch.testing.assert_close(y["state"], x["state"], atol=0, rtol=0)
            carry[f"r{i}"] = x
    assert runner.replays == graphed_steps and runner.failed is None
    assert sorted(runner._state) == list(BUCKETS)  # every bucket's static buffers made at the first step
    assert runner._state[4].inputs[0].shape == (4 * PER, 64)  # bucket x Q rows
    # pad entries wrote the scratch page only: every real page holds exactly what the plain engine wrote
    real = graphed.engine.pool.data[:, :PAGES]
    torch.testing.assert_close(real, plain.engine.pool.data, atol=1e-5, rtol=0)
    assert torch.equal(real == 0, plain.engine.pool.data == 0)
    assert graphed.engine.pool.data[:, PAGES].abs().sum() > 0  # ... and they did write it


def test_a_multi_row_entry_runs_eagerly_beside_single_rows(drivers: tuple[KVDriver, KVDriver]) -> None:
    """A CEM-like entry (3 trajectories sharing a context) in the same step as a single one:
    the runner declines the batch; the rows attend per row, the single one through the same split."""
    plain, graphed = drivers
    runner = graphed.engine.graph_runners["step"]
    g = torch.Generator().manual_seed(4)
    ctx = _context(g, 2)
    hist = torch.randn(1, 1, 7, generator=g).expand(3, -1, -1)
    rows = torch.cat([hist, torch.randn(3, 3, 7, generator=g)], dim=1) * 0.3
    single = torch.randn(1, 4, 7, generator=g) * 0.3
    carry = {}
    for d in drivers:
        outs = d.step("prefill", [("rows", {**ctx, "actions": rows}), ("one", {**ctx, "actions": single})])
        carry = {"rows": outs[0], "one": outs[1]}
    for _ in range(3):
        items = [(r, {"frame": carry[r]["frame"], "state": carry[r]["state"], "actions": a})
                 for r, a in (("rows", rows), ("one", single))]
        a, b = plain.step("step", items), graphed.step("step", items)
        for x, y in zip(a, b):
            torch.testing.assert_close(y["frame"], x["frame"], atol=1e-5, rtol=0)
        assert a[0]["frame"].shape == (3, TPF, ENC)
        carry = {"rows": a[0], "one": a[1]}
    assert runner.replays == 0


# ------------------------------------------------------------------------------ the CEM's rows
def test_row_layout_splits_rows_into_entries() -> None:
    """Two engine entries: 2 rows after one step over a 1-block history, and 3 rows at their
    first step without history; per = 3, page size 4, page tables out of order."""
    per = 3
    a = RowEntry(start=3 + 2 * per, hist=3, done=1, rows=2, page_table=[5, 1, 7, 2, 9])
    b = RowEntry(start=0, hist=0, done=0, rows=3, page_table=[4, 8, 6])
    lay = row_layout([a, b], per, 4, "cpu")
    assert lay.qo_indptr == [0, 3, 6, 9, 12, 15] and lay.kv_indptr == [0, 9, 18, 21, 24, 27]
    assert lay.groups == [(0, 2, 9), (2, 3, 3)]

    def slot(table: list[int], pos: int) -> int:
        return table[pos // 4] * 4 + pos % 4

    hist = [0, 1, 2]
    row0 = hist + [3, 4, 5] + [9, 10, 11]  # step 0 block of row 0 at 3.., step 1 block at 3 + 2*3 = 9..
    row1 = hist + [6, 7, 8] + [12, 13, 14]
    want_a = [slot(a.page_table, p) for p in row0 + row1]  # type: ignore[arg-type]
    want_b = [slot(b.page_table, p) for p in range(9)]  # type: ignore[arg-type]
    assert lay.visible.tolist() == want_a + want_b
    assert lay.new_slots.tolist() == [slot(a.page_table, p) for p in range(9, 15)] + want_b  # type: ignore[arg-type]


def test_token_views_read_every_slot() -> None:
    g = torch.Generator().manual_seed(1)
    pool = KVPool(3, 5, 4, 2, 8)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    slots = torch.arange(5 * 4)
    idx = fib.token_view_index(slots, 4)
    assert idx.dtype == torch.int32
    for layer in range(3):
        k, v = fib.token_views(pool, layer)
        assert k.shape == v.shape == ((2 * 5 - 1) * 4, 1, 2, 8) and k.stride() == v.stride()
        pages, offsets = slots // 4, slots % 4
        assert torch.equal(k[idx.long(), 0], pool.data[layer, pages, 0, offsets])
        assert torch.equal(v[idx.long(), 0], pool.data[layer, pages, 1, offsets])


# ------------------------------------------------------------------------------ a fake flashinfer
class _FakePrefill:
    """Records plan() arguments as host lists; run() computes attention from them (paged KV as a
    combined [P, 2, ps, H, D] tensor or a (K, V) tuple of [P, ps, H, D], any page size)."""

    calls: list[str] = []

    def __init__(self, workspace: torch.Tensor, layout: str, **kw: Any):
        assert layout == "NHD" and kw.get("backend") in ("fa2", "auto")  # short and long prefills
        self.kw, self.p = kw, None

    def plan(self, qo, kv_indptr, indices, last, heads, kv_heads, head_dim, page_size, *, causal: bool,
             custom_mask: torch.Tensor | None = None, **kw: Any) -> None:
        assert qo.device.type == kv_indptr.device.type == last.device.type == "cpu"  # lengths read on the host
        assert qo.dtype == kv_indptr.dtype == indices.dtype == last.dtype == torch.int32
        if self.kw.get("use_cuda_graph"):
            assert len(qo) == len(self.kw["qo_indptr_buf"]) == len(kv_indptr)
            assert len(last) == len(self.kw["paged_kv_last_page_len_buf"])
            assert len(indices) <= len(self.kw["paged_kv_indices_buf"])
        ip = kv_indptr.tolist()
        self.p = dict(kw, heads=heads, page_size=page_size, causal=causal, qo=qo.tolist(), last=last.tolist(),
                      tables=[indices.tolist()[ip[i]:ip[i + 1]] for i in range(len(ip) - 1)])
        _FakePrefill.calls.append(f"plan causal={causal} custom={custom_mask is not None} page_size={page_size}")

    def run(self, q: torch.Tensor, kv: Any) -> torch.Tensor:
        p = self.p
        assert p is not None and q.dtype == p["q_data_type"] and q.shape[1] == p["heads"]
        k_all, v_all = kv if isinstance(kv, tuple) else (kv[:, 0], kv[:, 1])
        assert k_all.shape[1] == p["page_size"]
        out = torch.empty_like(q)
        for i, (pages, last) in enumerate(zip(p["tables"], p["last"])):
            a, b = p["qo"][i], p["qo"][i + 1]
            n = (len(pages) - 1) * p["page_size"] + last
            k = k_all[pages].reshape(-1, *k_all.shape[2:])[:n].float()
            v = v_all[pages].reshape(-1, *v_all.shape[2:])[:n].float()
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * p["sm_scale"]
            if p["causal"]:
                s = s.masked_fill(~attention_mask(b - a, n, "causal").view(1, b - a, n), float("-inf"))
            out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        _FakePrefill.calls.append("run")
        return out


class _FakeDecode:
    def __init__(self, *a: Any, **kw: Any):
        pass


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = install_fake_flashinfer(monkeypatch, _FakeDecode, _FakePrefill)
    monkeypatch.delenv(fib.ENV_VAR, raising=False)
    _FakePrefill.calls = []
    return mod


def test_graph_prefill_over_padded_buckets(fake_flashinfer: types.ModuleType) -> None:
    """The GPU composition without the capture: GraphRunner(Q = 6) + FlashInferGraphPrefill buckets
    equal the reference over the same writes, pad entries included in the plan."""
    g = torch.Generator().manual_seed(5)
    pool = KVPool(2, 40, PAGE, 2, 8)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    bm = BlockManager(39, PAGE)
    tables, slots = [], []
    for i, hist in enumerate((0, 6, 18)):  # three rollouts at different steps
        bm.append((f"r{i}", "main"), hist)
        slots += bm.append((f"r{i}", "main"), 6)
        tables.append(bm.page_table((f"r{i}", "main")))
    meta = AttentionMetadata.build([6] * 3, [6, 12, 24], tables, "block_causal", [6] * 3)
    backend = fib.FlashInferBackend("cpu")
    make = fib.graph_prefill(backend, pool, None, 6)
    assert make is not None and fib.graph_prefill(object(), pool, None, 6) is None
    runner = GraphRunner(pool, (1, 2, 4), make, scratch_page=39, capture=False, tokens=6)
    q, k = torch.randn(18, 4, 8, generator=g), torch.randn(18, 2, 8, generator=g)
    bound_layer_equals_paged(runner, pool, meta, slots, q, k)
    assert _FakePrefill.calls == ["plan causal=False custom=False page_size=4", "run"]
    assert runner._state[4].attention.wrapper.kw["use_cuda_graph"]  # type: ignore[attr-defined]


def test_cem_rows_through_flashinfer_equal_the_reference(fake_flashinfer: types.ModuleType) -> None:
    """Multi-row steps through the node: FlashInferRowPrefill (fake kernels, pages of one token)
    against the gathered-keys reference, the same rows and history."""
    engines = {}
    for kind in ("auto", "reference"):
        node = predictor(seed=7)
        node.row_attention = kind
        engines[kind] = KVDriver(KVCacheEngine(node, PAGES, PAGE, torch.float32, "cpu", output_ports=PORTS), PAGES, PAGE)
    g = torch.Generator().manual_seed(8)
    ctx = _context(g, 2)
    hist = torch.randn(1, 1, 7, generator=g)
    acts = {"a": torch.cat([hist.expand(5, -1, -1), torch.randn(5, 3, 7, generator=g)], dim=1) * 0.3,
            "b": torch.cat([hist.expand(2, -1, -1), torch.randn(2, 3, 7, generator=g)], dim=1) * 0.3}
    carry: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for kind, d in engines.items():
        outs = d.step("prefill", [(r, {**ctx, "actions": a}) for r, a in acts.items()])
        carry[kind] = dict(zip(acts, outs))
    for _ in range(3):
        got = {}
        for kind, d in engines.items():
            items = [(r, {"frame": carry[kind][r]["frame"], "state": carry[kind][r]["state"], "actions": a})
                     for r, a in acts.items()]
            got[kind] = d.step("step", items)
            carry[kind] = dict(zip(acts, got[kind]))
        for x, y in zip(got["auto"], got["reference"]):
            torch.testing.assert_close(x["frame"], y["frame"], atol=1e-5, rtol=0)
    kernel = engines["auto"].node._row_kernels[id(engines["auto"].engine.pool)]
    assert isinstance(kernel, fib.FlashInferRowPrefill) and kernel.plans == 3
    assert _FakePrefill.calls.count("plan causal=False custom=False page_size=1") == 3
    assert _FakePrefill.calls.count("run") == 3 * 2  # once per layer per step
    assert engines["reference"].node._row_kernels == {}


def test_row_prefill_alone_equals_the_reference(fake_flashinfer: types.ModuleType) -> None:
    g = torch.Generator().manual_seed(9)
    pool = KVPool(2, 30, PAGE, 2, 8)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    entries = [RowEntry(start=2 * 5 * 3, hist=2 * 5, done=2, rows=3, page_table=list(range(29, -1, -1))),
               RowEntry(start=0, hist=0, done=0, rows=4, page_table=list(range(1, 30, 2)))]
    lay = row_layout(entries, 5, PAGE, "cpu")
    q = torch.randn(lay.qo_indptr[-1], 2, 8, generator=g)
    kernel = fib.row_prefill(pool)
    assert kernel is not None
    kernel.plan(lay.qo_indptr, lay.kv_indptr, lay.visible, 2, None)
    for layer in range(2):
        torch.testing.assert_close(kernel.run(q, layer), row_attention_reference(q, pool, layer, lay, 2, 8),
                                   atol=1e-5, rtol=1e-5)


def test_row_prefill_is_not_used_where_flashinfer_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(1, 4, PAGE, 1, 8)
    assert fib.row_prefill(pool) is None  # a CPU pool
    monkeypatch.setattr(fib, "unsupported", lambda pool: None)
    monkeypatch.setenv(fib.ENV_VAR, "reference")
    assert fib.row_prefill(pool) is None


def test_a_cem_step_no_longer_plans_a_whole_step_custom_mask(fake_flashinfer: types.ModuleType) -> None:
    """400 samples x 258 tokens as one block-causal entry needed a 10^10-bit custom mask (the
    "negative dimension" plan failure); the node declares its multi-row entries "full" (it
    attends per row itself), so the engine's backend plans a plain prefill, and a single row
    stays block-causal (its block is the last: full attention, graphable)."""
    spec = predictor().spec
    cem = ACPredictor.kv_plan("step", {"frame": (1, 4, 64), "state": (1, 7), "actions": (400, 3, 7)}, spec)
    one = ACPredictor.kv_plan("step", {"frame": (1, 4, 64), "state": (1, 7), "actions": (1, 3, 7)}, spec)
    assert (cem.q_len, cem.mask) == (400 * PER, "full")
    assert (one.q_len, one.mask, one.block_size) == (PER, "block_causal", PER)
    pool = KVPool(1, 40, PAGE, 2, 8)
    backend = fib.FlashInferBackend("cpu")
    backend._learnt[id(pool)] = (2, 0.35)  # as after an earlier eager step of this pool
    meta = AttentionMetadata.build([4 * PER], [4 * PER], [list(range(6))], cem.mask)
    backend.prepare(pool, meta)
    assert _FakePrefill.calls == ["plan causal=False custom=False page_size=4"]


# ------------------------------------------------------------------------------ the plan
def test_the_gpu_plan_captures_the_rollout_step(tmp_path: Path) -> None:
    from mstar_runtime.engine.graphs import graph_buckets
    from mstar_runtime.plan import planfile
    from mstarc.cli import main as mstarc

    out = tmp_path / "v.plan"
    assert mstarc(["compile", str(ROOT / "models/vjepa2/vjepa2.walk"), "-p", str(ROOT / "placements/h200x1.yaml"),
                   "-o", str(out)]) == 0
    graphs = planfile.read(out)["cuda_graphs"]
    assert [g["key"] for g in graphs] == ["predictor.step@0"]  # the prefill (shape per request) is not
    assert len(graphs[0]["steps"]) == 2  # the rollout walk's step and the plan walk's inner loop
    assert graph_buckets(graphs, "predictor", 0)["step"][:4] == (1, 2, 4, 8)
    assert predictor().graph_step_tokens == {"step": PER}
