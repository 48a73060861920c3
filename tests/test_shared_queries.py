"""Content versions of KV contexts (BlockManager.version) and the engine's reuse of a
not-kept query block across contexts of one request that hold the same tokens (BAGEL's
text-to-image `cfg_img`, a fork of `gen` that neither writes again)."""

from __future__ import annotations

import torch

from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
from mstar_runtime.kv.block_manager import BlockManager
from tests.test_engines import GQALM, PAGE, PORTS, close, seq, spec


def slots(bm: BlockManager, rid: str, n: int, tag: str, keep: bool = True) -> KVSlots:
    key = (rid, tag)
    start = bm.seq_len(key) if key in bm else 0
    content = bm.version(key)
    got = bm.append(key, n)
    return KVSlots(start, n, got, bm.page_table(key), "causal", None, keep, content)


def test_versions_follow_content() -> None:
    bm = BlockManager(16, 4)
    a, b, c = ("r", "a"), ("r", "b"), ("r", "c")
    assert bm.version(a) == 0
    bm.append(a, 6)
    v6 = bm.version(a)
    assert v6 > 0
    bm.fork(a, b)
    assert bm.version(b) == v6  # a fork holds the same tokens, partial page copied or not
    bm.append(a, 3)
    bm.append(b, 3)
    assert bm.version(a) != bm.version(b)  # equal lengths, different tokens
    bm.truncate(a, 6)
    assert bm.version(a) == v6  # a not-kept block appended and truncated leaves it as it was
    bm.truncate(b, 5)
    assert bm.version(b) not in (v6, 0)  # a cut inside an append is content never named before
    bm.fork(a, c)
    bm.free(a)
    assert bm.version(c) == v6 and bm.version(a) == 0
    bm.truncate(c, 0)
    assert bm.version(c) == 0


def test_shared_not_kept_queries_run_once_and_give_each_the_same_outputs() -> None:
    lm = GQALM(spec()).eval()
    eng, bm = KVCacheEngine(lm, 40, PAGE, torch.float32, "cpu", output_ports=PORTS), BlockManager(40, PAGE)
    ctx, other, probe = seq(1, 7), seq(2, 3), seq(3, 5)
    eng.run("prefill", [StepEntry("r", "gen", {"tokens": ctx}, slots(bm, "r", 7, "gen"))])
    for tag in ("img", "text"):  # img: same content as gen, never written after the fork
        copy = bm.fork(("r", "gen"), ("r", tag))
        assert copy is not None  # 7 tokens: a partial last page, copied
        eng.copy_slots(copy)
        eng.fork_state("r", "gen", tag)
    eng.run("prefill", [StepEntry("r", "text", {"tokens": other}, slots(bm, "r", 3, "text"))])

    for _step in range(2):  # twice: the truncation after a not-kept step keeps the versions equal
        entries = [StepEntry("r", tag, {"tokens": probe}, slots(bm, "r", 5, tag, keep=False))
                   for tag in ("gen", "text", "img")]
        before = eng.shared_queries
        out = eng.run("score", entries)
        assert eng.shared_queries - before == 1  # img reused gen's; text holds other tokens
        assert close(out[0]["logits"], lm.dense(torch.cat([ctx, probe]))[7:])
        assert close(out[1]["logits"], lm.dense(torch.cat([ctx, other, probe]))[10:])
        assert torch.equal(out[2]["logits"], out[0]["logits"])
        for e in entries:
            bm.truncate((e.request_id, e.tag), e.kv.start)

    # other inputs, another request, or a kept block: nothing is shared
    entries = [StepEntry("r", "gen", {"tokens": probe}, slots(bm, "r", 5, "gen", keep=False)),
               StepEntry("r", "img", {"tokens": seq(4, 5)}, slots(bm, "r", 5, "img", keep=False))]
    before = eng.shared_queries
    eng.run("score", entries)
    assert eng.shared_queries == before
    for e in entries:
        bm.truncate((e.request_id, e.tag), e.kv.start)
    kept = [StepEntry("r", tag, {"tokens": probe}, slots(bm, "r", 5, tag)) for tag in ("gen", "img")]
    eng.run("prefill", kept)
    assert eng.shared_queries == before
