"""Prefix caching's chunked prefill (engine/chunked.py, `KVPages.reserve`): with the cache on, a
keyed causal prefill runs in pieces that end at absolute multiples of the prefix chunk, and a
hit reuses cached tokens only up to such a multiple; so a miss and a hit run every piece from
the hit's first uncached boundary on with the same rows and the same attention shapes (the
calls are recorded here), which on a GPU is what makes their bits equal. With the cache off
the prefill is one piece, as before. A chunk the page size does not divide is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import run_generate

from mstar_runtime.api import MStar
from mstar_runtime.cli import EngineOptions, run_walk
from mstar_runtime.control.conductor import Conductor
from mstar_runtime.control.scheduler import KVPages, PrefixChunkError
from mstar_runtime.engine.chunked import chunk_spans, plan_pieces
from mstar_runtime.engine.engines import KVSlots
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import SeqPlan
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 16  # the page size of placements/cpu.yaml
SHARED = "You are terse. Answer in one line, and mind it "  # 47 bytes + bos: 3 full pages


class Recorder:
    """The llm node's prefill as the engine runs it: per `forward_hidden` call the absolute
    positions of its rows, and per layer-0 attention the (q_len, kv_len) of each entry."""

    def __init__(self, worker: Worker):
        self.engine = worker.engines["lm"]
        node, backend = self.engine.node, self.engine.backend
        self.pieces: list[tuple[int, int]] = []
        self.attention: list[tuple[tuple[int, int], ...]] = []
        forward = node.forward_hidden

        def forward_hidden(h: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
            if positions.numel() > 1:  # prefill rows (a decode's one row is not recorded)
                self.pieces.append((int(positions[0]), int(positions[-1]) + 1))
            return forward(h, positions, attend)

        def attention(q: torch.Tensor, pool: Any, layer: int, meta: Any, scale: Any) -> torch.Tensor:
            if layer == 0 and meta.num_tokens > 1:
                self.attention.append(tuple((s.q_len, s.kv_len) for s in meta.seqs))
            return backend(q, pool, layer, meta, scale)

        node.forward_hidden = forward_hidden
        self.engine.backend = attention

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[tuple[int, int], ...]]]:
        out = (self.pieces, self.attention)
        self.pieces, self.attention = [], []
        return out


@pytest.fixture
def engine(testfamily_plan: Path) -> Iterator[Any]:
    def make(**kw: Any) -> tuple[Conductor, Recorder]:
        plan = load_plan(testfamily_plan, device="cpu")
        worker = Worker(plan, 0, "cpu", "dummy")
        return Conductor(plan, {0: worker}, **kw), Recorder(worker)

    yield make


def test_chunk_spans_end_at_absolute_multiples() -> None:
    assert chunk_spans(0, 45, 16) == [(0, 16), (16, 32), (32, 45)]
    assert chunk_spans(20, 30, 16) == [(20, 32), (32, 48), (48, 50)]
    assert chunk_spans(32, 1, 16) == [(32, 33)]


def test_pieces_cut_chunked_entries_and_keep_the_others_together() -> None:
    pre = KVSlots(start=0, q_len=40, slots=list(range(40)), page_table=[0, 1, 2], chunk=16)
    dec = KVSlots(start=5, q_len=1, slots=[16 * 3 + 5], page_table=[3])
    dec2 = KVSlots(start=7, q_len=1, slots=[16 * 4 + 7], page_table=[4])
    pieces = plan_pieces([dec, pre, dec2])
    assert pieces is not None
    assert [p.rows for p in pieces] == [((1, 17),), ((17, 33),), ((33, 41),), ((0, 1), (41, 42))]
    assert [[(s.q_len, s.kv_len) for s in p.meta.seqs] for p in pieces] == [[(16, 16)], [(16, 32)], [(8, 40)],
                                                                         [(1, 6), (1, 8)]]
    assert pieces[1].slots == list(range(16, 32)) and pieces[3].slots == [53, 71]
    # one entry in one chunk, or no entry with a chunk: the step runs whole
    assert plan_pieces([KVSlots(start=16, q_len=9, slots=list(range(16, 25)), page_table=[0, 1], chunk=32)]) is None
    assert plan_pieces([dec, dec2]) is None


def test_a_hit_reuses_cached_tokens_up_to_a_chunk_multiple_only() -> None:
    bm = BlockManager(16, 4, prefix_caching=True)
    keys = list(range(100, 114))  # 14 tokens: 3 full pages
    bm.append_cached(("a", "main"), keys, 13)
    bm.commit(("a", "main"))
    assert bm.append_cached(("b", "main"), keys, 13)[0] == 12  # no chunk: every full page
    assert bm.append_cached(("c", "main"), keys, 13, align=8)[0] == 8  # cut back to a multiple of 8
    assert bm.append_cached(("d", "main"), keys, 13, align=16)[0] == 0
    pages = KVPages({"lm": (16, 4)}, prefix_caching=True, prefix_chunk=8)
    pages.managers["lm"].append_cached(("a", "main"), keys, 13)
    pages.commit("lm", ("a", "main"))
    kv = pages.reserve("lm", ("e", "main"), SeqPlan(q_len=14), keys)
    assert (kv.cached, kv.start, kv.q_len, kv.chunk) == (8, 8, 6, 8)
    full = pages.reserve("lm", ("f", "main"), SeqPlan(q_len=14, mask="full"), keys)
    assert full.cached == 8 and full.chunk == 0  # a full mask is never cut (its queries see later keys)
    off = KVPages({"lm": (16, 4)}).reserve("lm", ("g", "main"), SeqPlan(q_len=14), keys)
    assert (off.cached, off.chunk) == (0, 0)


def test_a_miss_and_a_hit_run_the_same_pieces_from_the_first_uncached_boundary(engine: Any) -> None:
    chunk = 2 * PS  # 32: the 48 shared tokens hit up to 32 only
    a, b = SHARED + "Why is the sky blue today?", SHARED + "Who wrote Hamlet, and in which year?"
    n = len(b.encode()) + 1  # bos + bytes
    warm, rec = engine(prefix_caching=True, prefix_chunk=chunk)
    run_generate(warm, a)
    rec.take()
    hit = run_generate(warm, b)
    hit_pieces, hit_attn = rec.take()
    cold, rec2 = engine(prefix_caching=True, prefix_chunk=chunk)
    miss = run_generate(cold, b)
    miss_pieces, miss_attn = rec2.take()
    assert hit.stats.cached_tokens == 32 and miss.stats.cached_tokens == 0
    assert miss_pieces == [(0, 32), (32, 64), (64, n)]
    assert hit_pieces == miss_pieces[1:]  # the same rows from the hit's first uncached boundary on
    assert miss_attn == [((32, 32),), ((32, 64),), ((n - 64, n),)] and hit_attn == miss_attn[1:]
    assert hit.outputs.keys() == miss.outputs.keys()
    for k in ("tokens", "hidden", "audio"):
        assert torch.equal(hit.outputs[k], miss.outputs[k]), k
    # a chunk of one page: the same prompt hits every full shared page
    fine, rec3 = engine(prefix_caching=True, prefix_chunk=PS)
    run_generate(fine, a)
    assert run_generate(fine, b).stats.cached_tokens == 48


def test_with_the_cache_off_a_prefill_is_one_piece(engine: Any) -> None:
    c, rec = engine(prefix_caching=False, prefix_chunk=PS)  # the chunk means nothing without the cache
    prompt = SHARED + "Why is the sky blue today?"
    n = len(prompt.encode()) + 1
    run_generate(c, prompt)
    run_generate(c, prompt)
    assert rec.take() == ([(0, n), (0, n)], [((n, n),), ((n, n),)])


@pytest.mark.parametrize("chunk", [0, 24, -16, True])
def test_a_chunk_the_page_size_does_not_divide_is_refused_naming_the_setting(testfamily_plan: Path,
                                                                             chunk: Any) -> None:
    plan = load_plan(testfamily_plan, device="cpu")
    with pytest.raises(PrefixChunkError, match=r"prefix_chunk \(--prefix-chunk\) must be a positive multiple "
                                               r"of the KV page size .*\(16 tokens\), got"):
        Conductor(plan, {}, prefix_caching=True, prefix_chunk=chunk)
    with pytest.raises(PrefixChunkError, match="prefix_chunk"):
        MStar.from_plan(plan, prefix_caching=True, prefix_chunk=chunk)
    assert Conductor(plan, {}, prefix_caching=False, prefix_chunk=chunk).kv.prefix_chunk == 0  # ignored when off


def test_the_command_line_refuses_a_bad_chunk_in_one_line(testfamily_plan: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    options = EngineOptions(prefix_caching=True, prefix_chunk=24)
    assert run_walk(testfamily_plan, "chat", {"prompt": "hi", "max_new": "2"}, out=tmp_path, options=options) == 1
    err = capsys.readouterr().err
    assert "error: prefix_chunk (--prefix-chunk) must be a positive multiple of the KV page size" in err
    assert "Traceback" not in err
