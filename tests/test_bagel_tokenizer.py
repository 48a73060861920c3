"""BAGEL's Tokenizer node: segments, specials, think prompts, and streamed pieces that join to one decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from mstar_models.bagel.tokenizer import BUNDLED_TOKENIZER, THINK_PROMPTS, Tokenizer
from mstar_runtime.ops.node import NodeError, NodeSpec, RequestError

TINY = {"bos_id": 296, "eos_id": 297, "vision_start_id": 298, "vision_end_id": 299, "vocab": 300}
REAL = {"bos_id": 151644, "eos_id": 151645, "vision_start_id": 151652, "vision_end_id": 151653,
        "vocab": 152064}


def node(config: dict) -> Tokenizer:
    return Tokenizer(NodeSpec("tok", "stateless", config, {}, {}, torch.float32, torch.device("cpu")))


def stream(tok: Tokenizer, ids: list[int], left: int = 4) -> str:
    """What the walk's left_context(chunk = 1, left = 4) stream gives detokenize, joined."""
    pieces = []
    for i in range(len(ids)):
        lo = max(0, i - left)
        chunk = torch.tensor(ids[lo:i + 1], dtype=torch.int32)
        pieces.append(tok.run("detokenize", [{"tokens": chunk, "tokens:context": i - lo}])[0]["piece"])
    return "".join(pieces)


def test_segment_is_bos_text_eos_with_config_ids() -> None:
    for config in (TINY, REAL):
        tok = node(config)
        (ids,) = [o["ids"] for o in tok.run("encode", [{"text": "a red fox"}])]
        assert ids.dtype == torch.int32
        assert ids[0] == config["bos_id"] and ids[-1] == config["eos_id"]
        text = HFTokenizer.from_file(str(BUNDLED_TOKENIZER)).encode("a red fox", add_special_tokens=False).ids
        assert ids[1:-1].tolist() == text  # text ids are the tokenizer's own; only specials move
        assert tok.decode(ids.tolist()) == "a red fox"


def test_think_prompts_are_the_official_text() -> None:
    tok = node(TINY)
    out = tok.run("system", [{"kind": "gen"}, {"kind": "und"}])
    assert tok.decode(out[0]["ids"].tolist()) == THINK_PROMPTS["gen"]
    assert THINK_PROMPTS["gen"].startswith("You should first think about the planning process")
    assert "the answer. \nThe reasoning" in THINK_PROMPTS["und"]
    with pytest.raises(RequestError, match="kind must be one of"):
        tok.run("system", [{"kind": "draw"}])


@pytest.mark.parametrize("text", ["Hello world, a plain reply.", "wörld 猫 and 🦊 split over bytes", "ü"])
def test_streamed_pieces_join_to_one_decode(text: str) -> None:
    tok = node(REAL)
    ids = tok.run("encode", [{"text": text}])[0]["ids"].tolist()[1:]  # a reply ends with <|im_end|>
    assert stream(tok, ids) == text
    # no piece ever carries a replacement character, though single tokens are partial bytes
    assert "\ufffd" not in stream(tok, ids)


def test_reencode_decodes_then_encodes_a_segment() -> None:
    tok = node(TINY)
    ids = tok.run("encode", [{"text": "plan: a fox"}])[0]["ids"]
    again = tok.run("reencode", [{"reasoning": ids[1:-1]}])[0]["ids"]
    assert torch.equal(again, ids)
    with pytest.raises(RequestError, match="outside 0..299"):
        tok.run("reencode", [{"reasoning": torch.tensor([300], dtype=torch.int32)}])


def test_a_checkpoint_tokenizer_must_agree_with_the_config(tmp_path: Path) -> None:
    data = json.loads(BUNDLED_TOKENIZER.read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tok = node(TINY)
    tok.on_weights(str(tmp_path))  # the bundled file's specials are the tiny config's ids
    assert tok.tokenizer_path == tmp_path / "tokenizer.json"
    with pytest.raises(NodeError, match=r"<\|im_start\|> at id 296, the plan's config says bos_id = 151644"):
        node(REAL).on_weights(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(NodeError, match="cannot read tokenizer"):
        node(TINY).on_weights(str(tmp_path))
