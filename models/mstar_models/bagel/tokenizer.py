"""BAGEL's tokenizer as a stateless node: text segments, the think system prompts, streamed text.

A text segment is `[<|im_start|>] + tokenize(text) + [<|im_end|>]` (docs/models/bagel.md, Facts:
`<|im_start|>` acts as bos and `<|im_end|>` as eos), as the official
`InterleaveInferencer.update_context_text` builds it. Phases (models/bagel/bagel.walk, node `tok`):

  encode(text) -> (ids)          a text segment (a prompt or a question)
  system(kind) -> (ids)          the official think system prompt as a text segment:
                                 kind "gen" (text-to-image, edit) or "und" (understanding)
  detokenize(tokens) -> (piece)  the text of the newest token of a left-context chunk
  reencode(reasoning) -> (ids)   decoded reasoning encoded again as a segment: the official
                                 think flow re-prefills `gen_text`'s *text*, not its ids

Streamed text: the decode loop's tokens reach `detokenize` through a
`left_context(chunk = 1, left = 4)` stream, so each call sees the new token after up to 4
earlier ones and returns decode(all) minus decode(earlier). Byte-level BPE can split one
character over several tokens: a piece that would end inside a character is held back (the
decoder's U+FFFD) and given with the token that completes it, so the joined pieces equal one
decode of the whole reply. Special tokens (<|im_end|>, <|vision_start|>) decode to nothing.

Tokenizer: the checkpoint's `tokenizer.json` (read with the `tokenizers` library) when the
weights source is a folder that has one; its special tokens must have the ids of the walk's
config (`bos_id`, `eos_id`, `vision_start_id`, `vision_end_id`), else a NodeError names the
first that differs. Otherwise the bundled `tokenizer_tiny.json`
(tools/make_bagel_tiny_tokenizer.py: Qwen2's shape, 296 text ids, the four specials at
296..299), whose special ids are remapped to the config's, so tests and benchmarks with
random weights get well-formed segments at any size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from mstar_models.tokenizers import load_tokenizer
from mstar_runtime.ops import node

BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "tokenizer_tiny.json"
CHECKPOINT_TOKENIZER = "tokenizer.json"
SPECIALS = {"bos_id": "<|im_start|>", "eos_id": "<|im_end|>",
            "vision_start_id": "<|vision_start|>", "vision_end_id": "<|vision_end|>"}
# The official inferencer's system prompts for think mode (ByteDance-Seed/Bagel inferencer.py),
# verbatim: the trailing space before each line break is theirs.
THINK_PROMPTS = {
    "und": "You should first think about the reasoning process in the mind and then provide the user "
           "with the answer. \nThe reasoning process is enclosed within <think> </think> tags, i.e. "
           "<think> reasoning process here </think> answer here",
    "gen": "You should first think about the planning process in the mind and then generate the image. "
           "\nThe planning process is enclosed within <think> </think> tags, i.e. <think> planning "
           "process here </think> image here",
}
REPLACEMENT = "\ufffd"  # what a byte-level decoder gives for an incomplete UTF-8 sequence


class Tokenizer(node.StatelessNode):
    """encode / system / detokenize / reencode; see the module docstring."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.ids = {k: int(spec.config[k]) for k in SPECIALS}
        self.vocab = int(spec.config["vocab"])
        self._use(load_tokenizer(BUNDLED_TOKENIZER), BUNDLED_TOKENIZER, remap=True)

    def on_weights(self, source: str) -> None:
        """Called by the weights loader with the plan's weights source: use the checkpoint's tokenizer."""
        path = Path(source) / CHECKPOINT_TOKENIZER
        if path.is_file():
            self._use(load_tokenizer(path), path, remap=False)

    def _use(self, tok: HFTokenizer, path: Path, remap: bool) -> None:
        own = {k: tok.token_to_id(name) for k, name in SPECIALS.items()}
        if any(v is None for v in own.values()):
            missing = [SPECIALS[k] for k, v in own.items() if v is None]
            raise node.NodeError(f"node '{self.spec.name}': tokenizer '{path}' lacks {', '.join(missing)}")
        if not remap:
            for k, want in self.ids.items():
                if own[k] != want:
                    raise node.NodeError(f"node '{self.spec.name}': tokenizer '{path}' has {SPECIALS[k]} at id "
                                         f"{own[k]}, the plan's config says {k} = {want}")
        # tokenizer id -> model id, for the (bundled) tokenizer whose specials sit elsewhere
        self._to_model = {own[k]: self.ids[k] for k in SPECIALS} if remap else {}
        self._to_tok = {v: k for k, v in self._to_model.items()}
        self.tokenizer, self.tokenizer_path = tok, path

    # ------------------------------------------------------------------ ids
    def segment(self, texts: list[str]) -> list[torch.Tensor]:
        """[bos] + tokens + [eos] of each text, as host int32 tensors (the LLM uploads them)."""
        out = []
        for enc in self.tokenizer.encode_batch(texts, add_special_tokens=False):
            ids = [self._to_model.get(i, i) for i in enc.ids]
            out.append(torch.tensor([self.ids["bos_id"], *ids, self.ids["eos_id"]], dtype=torch.int32))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([self._to_tok.get(i, i) for i in ids], skip_special_tokens=True)

    # ------------------------------------------------------------------ phases
    def phase_encode(self, batch: node.Batch) -> node.Batch:
        return [{"ids": ids} for ids in self.segment([_text(e, "text") for e in batch])]

    def phase_system(self, batch: node.Batch) -> node.Batch:
        kinds = [e.get("kind") for e in batch]
        for k in kinds:
            if k not in THINK_PROMPTS:
                raise node.RequestError(f"kind must be one of {', '.join(sorted(THINK_PROMPTS))}, got {k!r}", "kind")
        return [{"ids": ids} for ids in self.segment([THINK_PROMPTS[k] for k in kinds])]

    def phase_detokenize(self, batch: node.Batch) -> node.Batch:
        return [{"piece": self._piece(e)} for e in batch]

    def phase_reencode(self, batch: node.Batch) -> node.Batch:
        texts = [self.decode(_ids(e, "reasoning", self.vocab)) for e in batch]
        return [{"ids": ids} for ids in self.segment(texts)]

    def _piece(self, entry: dict[str, Any]) -> str:
        ids = _ids(entry, "tokens", self.vocab)
        context = int(entry.get("tokens:context", 0))
        if not 0 <= context < len(ids) or len(ids) - context != 1:
            raise node.RequestError(f"detokenize takes a chunk of one new token after its context, got "
                                    f"{len(ids)} token(s) with context {context}", "tokens")
        before, now = self.decode(ids[:context]), self.decode(ids)
        # A character still incomplete at the end waits for its last byte; one that was held
        # back before (the earlier text ended in U+FFFD) is given now.
        before, now = before.rstrip(REPLACEMENT), now.rstrip(REPLACEMENT)
        return now[len(before):] if now.startswith(before) else now[len(_common(before, now)):]


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _text(entry: dict[str, Any], port: str) -> str:
    text = entry.get(port)
    if not isinstance(text, str):
        raise node.RequestError(f"{port} must be a string, got {type(text).__name__}", port)
    return text


def _ids(entry: dict[str, Any], port: str, vocab: int) -> list[int]:
    value = entry.get(port)
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise node.RequestError(f"{port} must be a 1-D tensor of token ids", port)
    ids = [int(i) for i in value.tolist()]
    if any(not 0 <= i < vocab for i in ids):
        raise node.RequestError(f"{port} holds a token id outside 0..{vocab - 1}", port)
    return ids
