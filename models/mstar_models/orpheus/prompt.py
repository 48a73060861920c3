"""Orpheus' chat template as a stateless node: `build(text, voice) -> (tokens)`.

Layout (docs/models/orpheus.md, Facts, the 3B model's `_format_prompt`):
    [start_of_human] + tokenizer(f"{voice}: {text}").input_ids + [eot, end_of_human, start_of_ai, start_of_speech]
where the tokenizer's ids begin with BOS (128000), as Llama 3's post-processor adds it.

Tokenizer: the checkpoint's own `tokenizer.json` (read with the `tokenizers` library, no
`transformers` needed) when the weights source is a folder that has one; otherwise the
bundled `tokenizer_tiny.json` (tools/make_orpheus_tiny_tokenizer.py: Llama 3's shape, a
512-entry vocabulary), so tests and benchmarks with random weights still get well-formed
prompts. The runtime tells the node its weights source through `on_weights` (see
mstar_runtime.weights), after the node is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mstar_models.tokenizers import load_tokenizer
from mstar_runtime.ops import node

START_OF_HUMAN, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH = 128259, 128260, 128261, 128257
BOS, EOT = 128000, 128009  # Llama 3's <|begin_of_text|> and <|eot_id|>
PREFIX = [START_OF_HUMAN]
SUFFIX = [EOT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "tokenizer_tiny.json"
CHECKPOINT_TOKENIZER = "tokenizer.json"


class PromptBuilder(node.StatelessNode):
    """build(text: str, voice: str) -> (tokens: i32[T]); see the module docstring."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.tokenizer_path = BUNDLED_TOKENIZER
        self.tokenizer = load_tokenizer(BUNDLED_TOKENIZER)

    def on_weights(self, source: str) -> None:
        """Called by the weights loader with the plan's weights source: use the checkpoint's tokenizer."""
        path = Path(source) / CHECKPOINT_TOKENIZER
        if path.is_file():
            self.tokenizer = load_tokenizer(path)
            self.tokenizer_path = path

    def encode(self, texts: list[str], voices: list[str]) -> list[list[int]]:
        """The prompt ids of each (text, voice) pair (already checked)."""
        encodings = self.tokenizer.encode_batch([f"{v}: {t}" for t, v in zip(texts, voices, strict=True)])
        out = []
        for enc in encodings:
            ids = list(enc.ids)
            if not ids or ids[0] != BOS:  # a tokenizer.json without Llama 3's post-processor
                ids.insert(0, BOS)
            out.append(PREFIX + ids + SUFFIX)
        return out

    def phase_build(self, batch: node.Batch) -> node.Batch:
        texts = [_text(entry) for entry in batch]
        voices = [_voice(entry) for entry in batch]
        # host tensors: the backbone checks the ids on the host and uploads them without a
        # stream synchronisation (a pageable copy here would wait for every queued decode step)
        return [{"tokens": torch.tensor(ids, dtype=torch.int32)} for ids in self.encode(texts, voices)]


def _text(entry: dict[str, Any]) -> str:
    text = entry.get("text")
    if not isinstance(text, str):
        raise node.RequestError(f"text must be a string, got {type(text).__name__}", "text")
    if not text.strip():
        raise node.RequestError("text is empty: there is nothing to say", "text")
    return text


def _voice(entry: dict[str, Any]) -> str:
    voice = entry.get("voice")
    if voice not in VOICES:
        raise node.RequestError(f"unknown voice {voice!r}; voices: {', '.join(VOICES)}", "voice")
    return voice
