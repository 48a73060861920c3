"""Prefix caching end to end on the models that decode: a request whose prompt shares leading
KV blocks with an earlier one computes only the rest, and its outputs equal, bit for bit,
those of the same request as a miss (the test family's LM, Orpheus tiny, BAGEL tiny); a small
pool evicts and never corrupts; preemption stays exact.

With the cache on, a keyed prefill runs in chunks of `prefix_chunk` tokens (engine/chunked.py),
whose float results may differ in their last bits from the one-piece prefill with the cache
off: so the LM's and Orpheus' misses are computed with the cache on too, on an engine that
has nothing cached (`_miss`). BAGEL's prefills do not run through `run_graphed`, so they are
not cut and its hits still equal the cache-off run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support import compile_model, run_generate

from mstar_runtime.api import MStar
from mstar_runtime.control.conductor import FINISHED, Conductor
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.serve.metrics import Metrics
from mstar_runtime.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 16  # the page size of placements/cpu.yaml
SYSTEM = "You are terse. Answer in one line, please. "  # 2 full blocks of 16 with bos
QUESTIONS = ["Why is the sky blue?", "What is a prime?", "Why is the sky blue?", "Who wrote Hamlet?"]


def _conductor(plan_path: Path, cap: int | None = None, **kw: Any) -> Conductor:
    plan = load_plan(plan_path, device="cpu", kv_pages_cap=cap)
    kw.setdefault("prefix_caching", True)  # off by default (not bit-exact on the GPU yet)
    kw.setdefault("prefix_chunk", PS)  # a chunk of one page: every full page can hit (and each prefill runs in pages)
    return Conductor(plan, {0: Worker(plan, 0, "cpu", "dummy")}, **kw)


def _miss(plan_path: Path, walk: str, inputs: dict[str, Any]) -> Any:
    """The request alone on a fresh engine with the cache on (same chunk): a miss, in chunks."""
    c = _conductor(plan_path)
    h = c.submit(walk, dict(inputs))
    c.run_until_idle()
    assert h.state == FINISHED and h.stats.cached_tokens == 0, h.error
    return h


def _one(c: Conductor, prompt: str) -> Any:
    return run_generate(c, prompt, max_new=10)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k  # bits, floats too
        else:
            assert x == y, k


def _computed(c: Conductor) -> int:
    s = c.kv.prefix_stats()
    return s["prefix_query_tokens"] - s["prefix_hit_tokens"]


def test_a_shared_system_prompt_is_computed_once_and_changes_no_bit(testfamily_plan: Path) -> None:
    off = _conductor(testfamily_plan, prefix_caching=False)
    on = _conductor(testfamily_plan)
    prompts = [SYSTEM + q for q in QUESTIONS]
    n = [len(p.encode()) + 1 for p in prompts]  # bos + bytes
    first = _one(on, prompts[0])
    assert first.stats.cached_tokens == 0 and _computed(on) == n[0]
    for i, p in enumerate(prompts):
        miss = _miss(testfamily_plan, "generate", {"prompt": p, "max_new": 10})
        hit = first if i == 0 else _one(on, p)
        _equal(hit.outputs, miss.outputs)
        assert torch.equal(hit.outputs["tokens"], _one(off, p).outputs["tokens"])  # the chunks changed no token here
        if i:
            # the system prompt's full blocks (and, for the repeated question, all but the last token's block)
            assert hit.stats.cached_tokens >= len(SYSTEM) // 16 * 16
    assert _computed(on) < sum(n)  # fewer prefill tokens computed than without the cache
    assert on.kv.prefix_stats()["prefix_cached_pages"] > 0
    assert off.kv.prefix_stats()["prefix_cached_pages"] == 0


def test_walks_with_forks_and_not_kept_queries_stay_exact(testfamily_plan: Path) -> None:
    """The flow walk prefills `cond` and `uncond`, and its denoise steps append not-kept query
    blocks and truncate them every step (new content versions that are never cached); chat
    hands its context over in a transition. Repeated, they hit and equal their miss."""
    on = _conductor(testfamily_plan)
    lead = "Paint this for me: "  # one full block with bos
    requests = [("flow", {"prompt": lead + "a cat", "negative": lead + "blur", "steps": 3, "seed": 7}),
                ("chat", {"prompt": lead + "hi", "max_new": 2})]
    for walk, inputs in requests * 2:
        miss, hit = _miss(testfamily_plan, walk, inputs), on.submit(walk, dict(inputs))
        on.run_until_idle()
        assert hit.state == FINISHED, hit.error
        _equal(hit.outputs, miss.outputs)
    assert on.kv.prefix_stats()["prefix_hit_tokens"] > 0


def test_a_repeated_prompt_computes_only_its_last_block(testfamily_plan: Path) -> None:
    on = _conductor(testfamily_plan)
    prompt = SYSTEM + QUESTIONS[0]
    n = len(prompt.encode()) + 1
    _one(on, prompt)
    before = _computed(on)
    again = _one(on, prompt)
    cached = (n - 1) // 16 * 16
    assert again.stats.cached_tokens == cached
    assert _computed(on) - before == n - cached < n


def test_requests_running_together_share_blocks_and_stay_exact(testfamily_plan: Path) -> None:
    fresh = _conductor(testfamily_plan)  # the batch's first prefill step finds nothing: misses
    on = _conductor(testfamily_plan)
    prompts = [SYSTEM + q for q in QUESTIONS]
    _one(on, prompts[0])  # cached before the batch: the batch's requests all hit it
    batches = []
    for c in (fresh, on):
        handles = [c.submit("generate", {"prompt": p, "max_new": 10}) for p in prompts]
        c.run_until_idle()
        batches.append(handles)
    for miss, hit in zip(*batches):
        assert hit.state == FINISHED and hit.stats.cached_tokens > 0 and miss.stats.cached_tokens == 0
        _equal(hit.outputs, miss.outputs)


def test_a_full_pool_evicts_the_least_recently_used_blocks_and_never_corrupts(testfamily_plan: Path) -> None:
    on = _conductor(testfamily_plan, cap=10)  # 160 tokens: the 2-3 cached blocks of 5 requests cannot all stay
    prompts = [f"{i} " * 20 + "more" for i in range(5)]  # 45 tokens each, distinct from their first block on
    misses = [_miss(testfamily_plan, "generate", {"prompt": p, "max_new": 10}).outputs for p in prompts]
    for p, miss in zip(prompts, misses):
        _equal(_one(on, p).outputs, miss)
    stats = on.kv.prefix_stats()
    assert stats["prefix_evictions"] > 0 and stats["prefix_hit_tokens"] == 0
    bm = next(iter(on.kv.managers.values()))
    assert bm.used_pages == 0 and bm.free_pages == bm.num_pages  # cached pages still count free
    # the newest prompt's blocks survived, the oldest ones were evicted: one hits, the other not
    newest, oldest = _one(on, prompts[-1]), _one(on, prompts[0])
    assert newest.stats.cached_tokens > 0 and oldest.stats.cached_tokens == 0
    _equal(newest.outputs, misses[-1])
    _equal(oldest.outputs, misses[0])


def test_preemption_and_recompute_with_the_cache_stay_exact(testfamily_plan: Path) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    for kw in ({"preempt_every": 3}, {"cap": 12}):  # forced, then by a small pool
        runs = []
        for hits in (False, True):  # the misses: the same batch and schedule, its look-ups finding nothing
            c = _conductor(testfamily_plan, **kw)
            if not hits:
                for bm in c.kv.managers.values():
                    bm.prefix.lookup = lambda hashes: []  # type: ignore[union-attr]
            handles = [c.submit("generate", {"prompt": p, "max_new": 14}) for p in prompts]
            c.run_until_idle()
            assert c.stats["preemptions"] > 0, kw
            assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
            assert (c.kv.prefix_stats()["prefix_hit_tokens"] > 0) == hits
            runs.append(handles)
        for miss, hit in zip(*runs):
            _equal(hit.outputs, miss.outputs)


# ------------------------------------------------------------------------------ Orpheus
@pytest.fixture(scope="module")
def orpheus_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_model(tmp_path_factory.mktemp("orpheus_pc") / "orpheus-tiny.plan", "orpheus")


def test_orpheus_hit_equals_miss(orpheus_plan: Path) -> None:
    inputs = [{"text": "Hello there, this is a rather long sentence spoken by M star today.", "voice": "tara",
               "max_tokens": 40, "seed": 3, "temperature": 0.6, "repetition_penalty": 1.1},
              {"text": "Hello there, this is a rather long sentence spoken by M star tonight.", "voice": "tara",
               "max_tokens": 40, "seed": 4}]
    misses = []
    for i in inputs:  # each alone on a fresh engine with the cache on: misses, in chunks
        with MStar.load(orpheus_plan, prefix_caching=True, prefix_chunk=PS) as m:
            misses.append(m.submit("tts", dict(i)).result())
    with MStar.load(orpheus_plan, prefix_caching=True, prefix_chunk=PS) as m:
        first = m.submit("tts", dict(inputs[0]))
        _equal(first.result(), misses[0])
        for i, miss in zip(inputs, misses):
            h = m.submit("tts", dict(i))
            _equal(h.result(), miss)
            assert h.stats["cached_tokens"] > 0
        stats = m.stats()
        scrape = Metrics("orpheus", snapshot=lambda: (m.stats(), {})).render()[0].decode()
    assert stats["prefix_hit_tokens"] > 0 and stats["prefix_cached_pages"] > 0
    samples = {s.name: s.value for f in text_string_to_metric_families(scrape) for s in f.samples}
    assert samples["mstar_prefix_cache_hits_total"] == stats["prefix_hit_tokens"]
    assert samples["mstar_prefix_cache_queries_total"] == stats["prefix_query_tokens"]
    assert samples["mstar_prefix_cache_blocks"] == stats["prefix_cached_pages"]
    assert samples["mstar_prefix_cache_hit_rate"] == pytest.approx(
        stats["prefix_hit_tokens"] / stats["prefix_query_tokens"])
    assert 0 < samples["mstar_prefix_cache_hit_rate"] < 1


# ------------------------------------------------------------------------------ BAGEL
@pytest.fixture(scope="module")
def bagel_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_model(tmp_path_factory.mktemp("bagel_pc") / "bagel.plan", "bagel")


def _picture(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_bagel_the_same_image_under_several_questions_hits_and_equals_its_miss(bagel_plan: Path) -> None:
    """understand's ViT block (a full-mask block) is found for the same image, not for another;
    the answers, and t2i's and edit's images (forks, CFG twins, not-kept denoise blocks), equal
    their misses bit for bit."""
    src, other = _picture(56, 56, 1), _picture(56, 56, 2)
    requests = [("understand", {"image": src, "question": "what is it?", "max_length": 5}),
                ("understand", {"image": src, "question": "which colour is it?", "max_length": 5}),
                ("understand", {"image": other, "question": "which colour is it?", "max_length": 5}),
                ("t2i", {"prompt": "a red fox sitting on the white snow under a pale winter sky at dawn, photographed", "num_timesteps": 3, "height": 32, "width": 32}),
                ("t2i", {"prompt": "a red fox sitting on the white snow under a pale winter sky at dawn, photographed", "num_timesteps": 3, "height": 32, "width": 32}),
                ("edit", {"source": src, "prompt": "make it blue", "num_timesteps": 3})]
    with MStar.load(bagel_plan, prefix_caching=False) as off:
        misses = [off.submit(w, dict(i)).result(timeout=300) for w, i in requests]
    with MStar.load(bagel_plan, prefix_caching=True, prefix_chunk=PS) as on:
        handles = []
        for (walk, inputs), miss in zip(requests, misses):
            h = on.submit(walk, dict(inputs))
            _equal(h.result(timeout=300), miss)
            handles.append(h)
    cached = [h.stats["cached_tokens"] for h in handles]
    assert cached[0] == 0 and cached[1] >= 16 and cached[1] > cached[2], cached
    assert cached[4] > 0, cached  # the repeated t2i prompt


def test_a_node_giving_more_keys_than_tokens_fails_the_request_naming_it(testfamily_plan: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from mstar_models.testfamily.lm import TinyLM

    monkeypatch.setattr(TinyLM, "prefix_content", classmethod(lambda cls, phase, inputs, spec: [1] * 500))
    on = _conductor(testfamily_plan)
    h = on.submit("generate", {"prompt": "hello", "max_new": 3})
    on.run_until_idle()
    assert h.state == "failed" and "node 'lm' phase 'prefill' gave 500 prefix-cache keys for 6 KV tokens" in h.error
