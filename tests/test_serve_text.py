"""The chat route's text decoding (runtime/mstar_runtime/serve/text.py): replies stream through
the `tokenizers` library's `DecodeStream` where it gives the detokenize phase's text, and
through the phase otherwise.

Qwen3-Omni's processor holds a `tokenizers.Tokenizer` whose decode is its `detokenize`
phase: its replies take the streaming decoder, and every delta sequence joins to the text
the phase gives for the whole reply (random ids, any split into pushes, invalid UTF-8
included). BAGEL's `detokenize` decodes one new token after a context chunk, so it fails
the probe and keeps the phase path.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.serve.text import TextCodec, TextStream
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_plan(tmp: Path, model: str) -> Plan:
    out = tmp / f"{model}.plan"
    assert mstarc(["compile", str(ROOT / f"models/{model}/{model}.walk"), "--variant", "tiny",
                   "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(out)]) == 0
    return load_plan(out, device="cpu")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    return TextCodec(tiny_plan(tmp_path_factory.mktemp("qwen"), "qwen3_omni"), "chat", "prompt", "dummy")


def stream(codec: TextCodec, ids: list[int], sizes: list[int]) -> list[str]:
    s = TextStream(codec)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(s.push(ids[i:i + n]))
        i, k = i + n, k + 1
    out.append(s.flush())
    return out


def test_qwen_streams_through_decode_stream(qwen: TextCodec, monkeypatch: pytest.MonkeyPatch) -> None:
    assert qwen.detok_phase == "detokenize" and qwen.tokenizer is not None and qwen.skip_special
    text = "Grüße, 世界! 🎉👍🏽 done"
    ids = qwen.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text) // 2  # byte-level: the CJK and emoji characters span several tokens
    calls = []
    run = qwen.node.run
    monkeypatch.setattr(qwen.node, "run", lambda *a, **k: calls.append(a) or run(*a, **k))
    pieces = stream(qwen, ids, [1])
    assert calls == []  # no phase call per token: the library's decoder did it all
    assert "".join(pieces) == text
    assert "" in pieces and not any("\ufffd" in p for p in pieces)  # split characters held back, never broken


def test_streamed_text_equals_the_phase_on_any_ids(qwen: TextCodec) -> None:
    rng = random.Random(11)
    vocab = qwen.tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        want = qwen.render(ids)  # the detokenize phase on the whole reply
        sizes = [rng.randint(1, 4) for _ in range(3)]
        assert "".join(stream(qwen, ids, sizes)) == want, ids


def test_phase_path_when_the_decoder_fails(qwen: TextCodec, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "naïve café 你好"
    ids = qwen.tokenizer.encode(text, add_special_tokens=False).ids
    s = TextStream(qwen)
    first = s.push(ids[:3])

    class Broken:
        def step(self, tokenizer: object, token: int) -> str:
            raise Exception("invalid prefix")

    s._decoder = Broken()
    rest = [s.push([i]) for i in ids[3:]]
    assert s._decoder is None and first + "".join(rest) + s.flush() == text


def test_bagel_keeps_the_phase_path(tmp_path: Path) -> None:
    codec = TextCodec(tiny_plan(tmp_path, "bagel"), "chat", "prompt", "dummy")
    assert codec.detok_phase == "detokenize" and codec.tokenizer is None  # its phase wants a context chunk
