"""KVCacheEngine / StatelessEngine / Worker: paged, batched steps equal dense single-sequence forwards."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StatelessEngine, StepEntry
from mstar_runtime.kv.attention import dense_attention
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import (
    AttentionContext,
    Batch,
    KVGeometry,
    KVNode,
    NodeError,
    NodeSpec,
    RequestError,
    SeqPlan,
    StatelessNode,
)
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker.worker import StepBatch, Worker, WorkerStepError

ROOT = Path(__file__).resolve().parent.parent
PAGE = 4
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 61, 32, 4, 2, 8, 2
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def spec(name: str = "lm", engine: str = "kv") -> NodeSpec:
    return NodeSpec(name, engine, {}, {}, {}, torch.float32, torch.device("cpu"))


class GQALM(KVNode):
    """A 2-layer GQA transformer LM with RoPE. Phases: prefill(tokens) and decode(token) ->
    logits of every new position; score(tokens): the same, attending but not kept; bad: wrong outputs."""

    def __init__(self, spec: NodeSpec):
        super().__init__(spec)
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.qkv = nn.ParameterList(
            nn.Parameter(torch.randn(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g) / HIDDEN**0.5)
            for _ in range(LAYERS)
        )
        self.out = nn.ParameterList(
            nn.Parameter(torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g) / HIDDEN**0.5)
            for _ in range(LAYERS)
        )

    @property
    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(LAYERS, KV_HEADS, HEAD_DIM)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: NodeSpec) -> SeqPlan:
        if phase == "decode":
            return SeqPlan(1)
        return SeqPlan(shapes["tokens"][0], keep=phase != "score")

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.embed[ids]
        n = h.shape[0]
        inv = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        ang = positions.float()[:, None] * inv[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]

        def rope(x: torch.Tensor) -> torch.Tensor:
            a, b = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

        for layer in range(LAYERS):
            q, k, v = (h @ self.qkv[layer]).split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
            )
            q, k = rope(q.view(n, HEADS, HEAD_DIM)), rope(k.view(n, KV_HEADS, HEAD_DIM))
            o = attend(layer, q, k, v.view(n, KV_HEADS, HEAD_DIM))
            h = torch.tanh(h + o.reshape(n, -1) @ self.out[layer])
        return h @ self.embed.T

    def _step(self, batch: Batch, attn: AttentionContext, port: str) -> Batch:
        ids = torch.cat([e[port].reshape(-1) for e in batch])
        logits = self.forward(ids, attn.positions(), attn.attend)
        for s in attn.seqs:
            s.state["steps"] = s.state.get("steps", 0) + 1
        return [{"logits": part} for part in attn.split(logits)]

    def phase_prefill(self, batch: Batch, attn: AttentionContext) -> Batch:
        return self._step(batch, attn, "tokens")

    def phase_score(self, batch: Batch, attn: AttentionContext) -> Batch:
        return self._step(batch, attn, "tokens")

    def phase_decode(self, batch: Batch, attn: AttentionContext) -> Batch:
        return self._step(batch, attn, "token")

    def phase_bad(self, batch: Batch, attn: AttentionContext) -> Batch:
        return [{"nope": 1}] * len(batch)

    def phase_short(self, batch: Batch, attn: AttentionContext) -> Batch:
        return [{"logits": None}][: len(batch) - 1]

    def dense(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of every position of one whole sequence, with dense causal attention."""
        return self.forward(
            ids, torch.arange(len(ids)), lambda _l, q, k, v: dense_attention(q, k, v, "causal")
        )


PORTS = {
    "prefill": ("logits",),
    "decode": ("logits",),
    "score": ("logits",),
    "bad": ("logits",),
    "short": ("logits",),
}


@pytest.fixture(scope="module")
def lm() -> GQALM:
    return GQALM(spec()).eval()


def engine(lm: GQALM, pages: int = 40) -> KVCacheEngine:
    return KVCacheEngine(lm, pages, PAGE, torch.float32, "cpu", output_ports=PORTS)


def reserve(bm: BlockManager, rid: str, n: int, tag: str = "main", keep: bool = True) -> KVSlots:
    key = (rid, tag)
    start = bm.seq_len(key) if key in bm else 0
    slots = bm.append(key, n)
    return KVSlots(start, n, slots, bm.page_table(key), keep=keep)


def seq(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ KV engine
def test_prefill_then_decodes_equal_a_dense_forward(lm: GQALM) -> None:
    ids = seq(1, 14)
    eng, bm = engine(lm), BlockManager(40, PAGE)
    got = eng.run("prefill", [StepEntry("r", "main", {"tokens": ids[:6]}, reserve(bm, "r", 6))])[0]["logits"]
    rows = [got]
    for t in range(6, 14):  # crosses two page boundaries
        out = eng.run("decode", [StepEntry("r", "main", {"token": ids[t : t + 1]}, reserve(bm, "r", 1))])
        rows.append(out[0]["logits"])
    assert close(torch.cat(rows), lm.dense(ids))
    assert eng.state("r", "main")["steps"] == 9


def test_mixed_batch_equals_each_alone(lm: GQALM) -> None:
    prompts = {"a": seq(2, 7), "b": seq(3, 13)}
    history = {"c": seq(4, 5), "d": seq(5, 8), "e": seq(6, 1)}
    nxt = {"c": seq(7, 1), "d": seq(8, 1), "e": seq(9, 1)}

    # One call: 2 prefill chunks and 3 single-token decodes (of contexts prefilled earlier).
    eng, bm = engine(lm), BlockManager(40, PAGE)
    eng.run(
        "prefill", [StepEntry(r, "main", {"tokens": t}, reserve(bm, r, len(t))) for r, t in history.items()]
    )
    mixed = [StepEntry(r, "main", {"tokens": t}, reserve(bm, r, len(t))) for r, t in prompts.items()]
    mixed += [StepEntry(r, "main", {"tokens": t}, reserve(bm, r, 1)) for r, t in nxt.items()]
    together = {e.request_id: o["logits"] for e, o in zip(mixed, eng.run("prefill", mixed))}

    for rid in [*prompts, *nxt]:
        alone, abm = engine(lm), BlockManager(40, PAGE)
        if rid in history:
            alone.run(
                "prefill",
                [StepEntry(rid, "main", {"tokens": history[rid]}, reserve(abm, rid, len(history[rid])))],
            )
            ref = alone.run("decode", [StepEntry(rid, "main", {"token": nxt[rid]}, reserve(abm, rid, 1))])[0][
                "logits"
            ]
            dense = lm.dense(torch.cat([history[rid], nxt[rid]]))[-1:]
        else:
            t = prompts[rid]
            ref = alone.run("prefill", [StepEntry(rid, "main", {"tokens": t}, reserve(abm, rid, len(t)))])[0][
                "logits"
            ]
            dense = lm.dense(t)
        assert close(together[rid], ref) and close(ref, dense), rid


def test_keep_false_leaves_the_context_untouched(lm: GQALM) -> None:
    ids, probe, after = seq(10, 6), seq(11, 3), seq(12, 1)
    eng, bm = engine(lm), BlockManager(40, PAGE)
    eng.run("prefill", [StepEntry("r", "main", {"tokens": ids}, reserve(bm, "r", 6))])
    kept = bm.page_table(("r", "main"))
    before = eng.pool.data[:, kept].clone()
    kv = reserve(bm, "r", 3, keep=False)
    scored = eng.run("score", [StepEntry("r", "main", {"tokens": probe}, kv)])[0]["logits"]
    # the queries saw the context and each other (causally) ...
    assert close(scored, lm.dense(torch.cat([ids, probe]))[6:])
    # ... and once the conductor truncates, the context is as before and decoding goes on from it
    assert bm.truncate(("r", "main"), kv.start) is None
    assert bm.seq_len(("r", "main")) == 6 and bm.page_table(("r", "main")) == kept[:2]
    slots = [kept[p // PAGE] * PAGE + p % PAGE for p in range(6)]
    for p in range(6):
        page, off = divmod(slots[p], PAGE)
        assert torch.equal(eng.pool.data[:, page, :, off], before[:, kept.index(page), :, off])
    out = eng.run("decode", [StepEntry("r", "main", {"token": after}, reserve(bm, "r", 1))])[0]["logits"]
    assert close(out, lm.dense(torch.cat([ids, after]))[-1:])


def test_fork_state_and_copy_on_write(lm: GQALM) -> None:
    ids, t1, t2 = seq(13, 6), seq(14, 1), seq(15, 1)
    eng, bm = engine(lm), BlockManager(40, PAGE)
    eng.run("prefill", [StepEntry("r", "a", {"tokens": ids}, reserve(bm, "r", 6, "a"))])
    copy = bm.fork(("r", "a"), ("r", "b"))
    assert copy is not None and len(copy.src) == 6 % PAGE  # the partial last page is copied
    eng.copy_slots(copy)
    eng.fork_state("r", "a", "b")
    assert eng.state("r", "b") == {"steps": 1}
    # both tags decode from the same context, in one batch, with different tokens
    out = eng.run(
        "decode",
        [
            StepEntry("r", "a", {"token": t1}, reserve(bm, "r", 1, "a")),
            StepEntry("r", "b", {"token": t2}, reserve(bm, "r", 1, "b")),
        ],
    )
    assert close(out[0]["logits"], lm.dense(torch.cat([ids, t1]))[-1:])
    assert close(out[1]["logits"], lm.dense(torch.cat([ids, t2]))[-1:])
    eng.run("decode", [StepEntry("r", "b", {"token": t1}, reserve(bm, "r", 1, "b"))])
    assert eng.state("r", "a") == {"steps": 2} and eng.state("r", "b") == {"steps": 3}  # deep copies
    # forking into an existing tag replaces its state; from a tag without state, drops it
    eng.fork_state("r", "a", "b")
    assert eng.state("r", "b") == {"steps": 2}
    eng.fork_state("r", "none", "b")
    assert not eng.has_state("r", "b")
    eng.free("r")
    assert eng.num_states == 0
    eng.free("r")  # a no-op the second time


def test_bad_outputs_and_bad_slots_are_node_errors(lm: GQALM) -> None:
    eng, bm = engine(lm), BlockManager(40, PAGE)
    entries = [StepEntry("r", "main", {"tokens": seq(16, 3)}, reserve(bm, "r", 3))]
    with pytest.raises(
        NodeError, match=r"node 'lm' phase 'bad': output 0 lacks port\(s\) logits \(it has: nope\)"
    ):
        eng.run("bad", entries)
    two = entries + [StepEntry("s", "main", {"tokens": seq(17, 2)}, reserve(bm, "s", 2))]
    with pytest.raises(
        NodeError, match="node 'lm' phase 'short' returned 1 outputs for a batch of 2 entries"
    ):
        eng.run("short", two)
    with pytest.raises(NodeError, match="node 'lm' has no phase 'nope'"):
        eng.run("nope", entries)
    kv = entries[0].kv
    assert kv is not None
    wrong = KVSlots(kv.start, kv.q_len, [kv.slots[0], kv.slots[2], kv.slots[1]], kv.page_table)
    with pytest.raises(
        NodeError, match="request 'r' tag 'main': slot .* is not where its page table puts it"
    ):
        eng.run("prefill", [StepEntry("r", "main", entries[0].inputs, wrong)])
    with pytest.raises(NodeError, match="needs KV slots"):
        eng.run("prefill", [StepEntry("r", "main", entries[0].inputs, None)])
    with pytest.raises(NodeError, match="block_size is required"):
        eng.run(
            "prefill",
            [
                StepEntry(
                    "r",
                    "main",
                    entries[0].inputs,
                    KVSlots(kv.start, kv.q_len, kv.slots, kv.page_table, mask="block_causal"),
                )
            ],
        )


def test_pluggable_attention_backend(lm: GQALM) -> None:
    calls: list[str] = []

    class Backend:
        def prepare(self, pool: Any, meta: Any) -> None:
            calls.append(f"prepare {len(meta.seqs)}")

        def __call__(
            self, q: torch.Tensor, pool: Any, layer: int, meta: Any, scale: float | None
        ) -> torch.Tensor:
            from mstar_runtime.kv.attention import paged_attention

            calls.append(f"layer {layer}")
            return paged_attention(q, pool, layer, meta, scale)

    eng = KVCacheEngine(lm, 8, PAGE, torch.float32, "cpu", attention_backend=Backend())
    ids = seq(18, 5)
    out = eng.run("prefill", [StepEntry("r", None, {"tokens": ids}, reserve(BlockManager(8, PAGE), "r", 5))])
    assert calls == ["prepare 1", "layer 0", "layer 1"] and close(out[0]["logits"], lm.dense(ids))
    assert eng.has_state("r", "main")  # a None tag is the conductor's default tag


# ------------------------------------------------------------------------ stateless engine
class Proj(StatelessNode):
    def __init__(self, spec: NodeSpec):
        super().__init__(spec)
        self.w = nn.Parameter(torch.randn(6, 3, generator=torch.Generator().manual_seed(1)))
        self.calls = 0

    def phase_embed(self, batch: Batch) -> Batch:
        self.calls += 1
        x = torch.stack([e["x"] for e in batch])  # one forward for the whole batch
        return [{"y": row, "norm": float(row.norm())} for row in torch.tanh(x @ self.w)]


def test_stateless_engine_batches() -> None:
    node = Proj(spec("proj", "stateless"))
    eng = StatelessEngine(node, {"embed": ("y",)})
    xs = [torch.randn(6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    batched = eng.run("embed", [StepEntry(f"r{i}", None, {"x": x}) for i, x in enumerate(xs)])
    assert node.calls == 1 and len(batched) == 3
    for x, out in zip(xs, batched):
        assert close(out["y"], eng.run("embed", [StepEntry("s", None, {"x": x})])[0]["y"])
    assert eng.run("embed", []) == []
    with pytest.raises(NodeError, match="stateless, but request 'r' came with KV slots"):
        eng.run("embed", [StepEntry("r", None, {"x": xs[0]}, KVSlots(0, 1, [0], [0]))])


# -------------------------------------------------------------------------------- worker
@pytest.fixture(scope="module")
def family_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mstarc.cli import main

    out = tmp_path_factory.mktemp("worker") / "testfamily.plan"
    assert (
        main(
            [
                "compile",
                str(ROOT / "models/testfamily/testfamily.walk"),
                "--variant",
                "tiny",
                "-p",
                str(ROOT / "placements/cpu.yaml"),
                "-o",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_worker_runs_resident_nodes(family_plan: Path) -> None:
    plan = load_plan(family_plan, kv_pages_cap=16)
    worker = Worker(plan, 0, "cpu", "dummy")
    assert set(worker.engines) == set(plan.resident_nodes(0))
    lm = worker.engines["lm"]
    assert isinstance(lm, KVCacheEngine) and lm.pool.num_pages == 16 and lm.page_size == plan.page_size
    bm = BlockManager(16, plan.page_size)
    (enc,) = worker.run_step(StepBatch("prompt", "encode", [StepEntry("r", None, {"text": "hi there"})]))
    tokens = enc["tokens"]
    entry = StepEntry("r", "cond", {"tokens": tokens, "max_new": 4}, reserve(bm, "r", len(tokens), "cond"))
    (out,) = worker.run_step(StepBatch("lm", "prefill", [entry]))
    assert set(plan.node("lm").phases["prefill"].outputs) <= set(out)
    # fork the context to another tag and decode both in one batch: the same token gives the same result
    copy = bm.fork(("r", "cond"), ("r", "uncond"))
    worker.fork("lm", "r", "cond", "uncond", copy)
    step = [
        StepEntry("r", tag, {"token": out["token"]}, reserve(bm, "r", 1, tag)) for tag in ("cond", "uncond")
    ]
    a, b = worker.run_step(StepBatch("lm", "decode", step))
    assert torch.equal(a["token"], b["token"]) and torch.allclose(a["hidden"], b["hidden"], atol=1e-6)
    stats = worker.stats()
    assert stats["nodes"]["lm"]["decode"] == {
        "steps": 1,
        "entries": 2,
        "failures": 0,
        "seconds": stats["nodes"]["lm"]["decode"]["seconds"],
    }
    assert stats["steps"] == 3 and stats["kv"]["lm"]["states"] == 2
    worker.free("r")
    assert worker.stats()["kv"]["lm"]["states"] == 0


def test_worker_errors(family_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = load_plan(family_plan, kv_pages_cap=8)
    worker = Worker(plan, 0, "cpu", "init")
    bm = BlockManager(8, plan.page_size)
    # a request the node rejects: RequestError, unchanged, with the batch's request ids
    entries = [
        StepEntry(r, "cond", {"token": torch.tensor([3], dtype=torch.int32)}, reserve(bm, r, 1, "cond"))
        for r in ("x", "y")
    ]
    with pytest.raises(RequestError, match="never prefilled") as info:
        worker.run_step(StepBatch("lm", "decode", entries))
    assert info.value.request_ids == ["x", "y"]  # type: ignore[attr-defined]
    # a bug inside a node: WorkerStepError naming node and phase
    codec = worker.engines["codec"].node

    def boom(batch: Batch) -> Batch:
        raise ValueError("kaboom")

    monkeypatch.setattr(codec, "phase_decode_window", boom)
    with pytest.raises(
        WorkerStepError, match="node 'codec' phase 'decode_window': ValueError: kaboom"
    ) as err:
        worker.run_step(
            StepBatch("codec", "decode_window", [StepEntry("x", None, {"window": torch.zeros(8)})])
        )
    assert err.value.node == "codec" and err.value.phase == "decode_window"
    with pytest.raises(WorkerStepError, match="not resident on rank 0"):
        worker.run_step(StepBatch("talker", "decode", []))
    with pytest.raises(WorkerStepError, match="is not a kv node"):
        worker.fork("codec", "x", "a", "b", None)
    assert worker.stats()["nodes"]["lm"]["decode"]["failures"] == 1


def test_attention_scale_is_a_node_attribute(lm: GQALM) -> None:
    class Scaled(GQALM):
        attention_scale = 0.5 / math.sqrt(HEAD_DIM)

    node = Scaled(spec()).eval()
    ids = seq(19, 4)
    out = engine(node).run(
        "prefill", [StepEntry("r", "main", {"tokens": ids}, reserve(BlockManager(40, PAGE), "r", 4))]
    )
    assert not close(out[0]["logits"], lm.dense(ids))
    scaled = node.forward(
        ids,
        torch.arange(4),
        lambda _l, q, k, v: dense_attention(q, k, v, "causal", scale=Scaled.attention_scale),
    )
    assert close(out[0]["logits"], scaled)
