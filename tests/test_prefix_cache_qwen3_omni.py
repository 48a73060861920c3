"""Prefix caching on the tiny Qwen3-Omni thinker (transformers' tiny checkpoint, as
tests/test_qwen3_omni_walks.py loads it): a chat whose prompt shares leading blocks with an
earlier one (the same image under another question, a repeated audio question, an earlier
turn) computes only the rest, and its outputs equal those with the cache off, bit for bit; its
prefill runs in the prefix chunks, a hit in those of its miss."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from qwen3_omni_lm_support import hf_model
from support import compile_model, saved_checkpoint

from mstar_runtime.api import MStar
from mstar_runtime.engine.chunked import ChunkedRows, chunk_spans

pytest.importorskip("transformers")

GREEDY = {"temperature": 0.0, "top_k": 0}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_checkpoint(hf_model(seed=0), tmp_path_factory, "qwen3_omni_pc_ckpt")


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_model(tmp_path_factory.mktemp("qwen3_omni_pc") / "tiny.plan", "qwen3_omni")


@pytest.fixture(scope="module")
def engines(plan_path: Path, checkpoint: Path) -> Iterator[tuple[MStar, MStar]]:
    with MStar.load(plan_path, weights=checkpoint, prefix_caching=False) as off, \
            MStar.load(plan_path, weights=checkpoint, prefix_caching=True, prefix_chunk=16) as on:
        yield off, on


def picture(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (160, 224, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def clip(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(16000) / 16000
    return 0.3 * torch.sin(2 * torch.pi * (220 + 40 * seed) * t) + 0.05 * torch.randn(t.shape, generator=gen)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


CHATS: list[dict[str, Any]] = [
    {"prompt": "Describe this picture in a few words, please.", "image": picture(2)},
    {"prompt": "Which colours does it have, and why?", "image": picture(2)},  # the same image, another question
    {"prompt": "Which colours does it have, and why?", "image": picture(5)},  # another image: no image block hits
    {"prompt": "What do you hear in this clip, tell me?", "audio": clip(1)},
    {"prompt": "What do you hear in this clip, tell me?", "audio": clip(1)},
    {"prompt": "What do you hear in this clip, tell me?", "audio": clip(3)},
]


def test_chats_that_share_leading_blocks_hit_and_equal_their_miss(engines: tuple[MStar, MStar]) -> None:
    off, on = engines
    cached = []
    for inputs in CHATS:
        miss = off.submit("chat", {**inputs, "max_tokens": 8, **GREEDY}).result(timeout=120)
        h = on.submit("chat", {**inputs, "max_tokens": 8, **GREEDY})
        _equal(h.result(timeout=120), miss)
        cached.append(h.stats["cached_tokens"])
    assert cached[1] > cached[2] and cached[4] > cached[5], cached  # the same media hit further
    assert cached[1] > 0 and cached[4] > 0
    assert on.stats()["prefix_hit_tokens"] == sum(cached)


def test_a_second_turn_reuses_the_first_turns_blocks(engines: tuple[MStar, MStar]) -> None:
    """A conversation's second request holds the first turn's prompt and reply, then a new
    question: the first turn's prompt blocks are found (no special call), outputs unchanged."""
    off, on = engines
    first = {"prompt": "Tell me a short fact about the moon, in one line.", "max_tokens": 8, **GREEDY}
    reply = on.submit("chat", first).result(timeout=120)["text"]
    follow = {**first, "prompt": first["prompt"] + " " + reply + " And one about the sun?"}
    h = on.submit("chat", follow)
    _equal(h.result(timeout=120), off.submit("chat", follow).result(timeout=120))
    assert h.stats["cached_tokens"] > 0


SYSTEM = "You are a friendly voice assistant. Keep every answer short, and speak clearly and slowly."
SPEECH: list[dict[str, Any]] = [
    {"system": SYSTEM, "prompt": "Say hello to everyone."},
    {"system": SYSTEM, "prompt": "Say hello to everyone. Hello everyone! Now say goodbye."},  # a second turn
    {"system": SYSTEM, "prompt": "What was that?", "audio": clip(1)},
    {"system": SYSTEM, "prompt": "What was that?", "audio": clip(3)},  # another clip: only the text before it hits
]


def test_speech_prefills_hit_before_their_first_media_position(engines: tuple[MStar, MStar]) -> None:
    """The speech walk's prefill is keyed up to its first audio or image placeholder (the
    talker's prompt needs the tapped hidden states there): the system prompt and earlier text
    turns are found; text, codes and audio equal the miss's bit for bit."""
    off, on = engines
    cached = []
    for inputs in SPEECH:
        req = {**inputs, "max_tokens": 5, "talker_do_sample": False, "talker_max_frames": 6, **GREEDY}
        miss = off.submit("speech", dict(req)).result(timeout=300)
        h = on.submit("speech", dict(req))
        _equal(h.result(timeout=300), miss)
        cached.append(h.stats["cached_tokens"])
    assert cached[0] == 0 and cached[1] > 0 and cached[3] > 0, cached


def test_the_thinker_prefills_in_chunks_and_a_hit_runs_the_chunks_of_its_miss(
        engines: tuple[MStar, MStar], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cache on the thinker's prefill rows run in chunks of 16 (engine/chunked.py):
    a miss in all of them from position 0, a hit in those from its cached length (a multiple
    of 16) on, as its own miss would; speech too (the tap and the text rows cut alike)."""
    _, on = engines
    pieces: list[list[tuple[int, int]]] = []
    call = ChunkedRows.__call__

    def record(self: ChunkedRows, fn: Any, *rows: torch.Tensor) -> Any:
        pieces.append([(s.q_len, s.kv_len) for p in self.pieces for s in p.meta.seqs])
        return call(self, fn, *rows)

    monkeypatch.setattr(ChunkedRows, "__call__", record)
    talker = {"talker_do_sample": False, "talker_max_frames": 4}
    for walk, extra in (("chat", {}), ("speech", talker)):
        first = {"system": f"{walk.title()}: speak as a ship's captain would, short and loud, all the voyage.",
                 "prompt": "Where are we sailing to?", "max_tokens": 3, **GREEDY, **extra}
        second = {**first, "prompt": "Where are we sailing to, captain, and when will we see the coast again?"}
        pieces.clear()
        miss = on.submit(walk, dict(first))
        miss.result(timeout=300)
        hit = on.submit(walk, dict(second))
        hit.result(timeout=300)
        cached = hit.stats["cached_tokens"]
        assert miss.stats["cached_tokens"] == 0 and cached > 0 and cached % 16 == 0
        assert len(pieces) == 2, pieces
        for got, done in zip(pieces, (0, cached)):
            n = got[-1][1]
            assert got == [(b - a, b) for a, b in chunk_spans(done, n - done, 16)], (walk, got)
