"""Whisper's prompt and transcript as stateless nodes (tokenizer work, no weights).

`Prompt.build(language, task, timestamps, prompt) -> (head, language, tail)`: the decoder
prompt of transformers' `generate` split around the language token, which the decoder's
`detect` phase fills in when none is given:

    head = [<|startofprev|>, prompt tokens...] (only with a prompt) + [<|startoftranscript|>]
    language = [the language's token], or [-1]: detect it
    tail = [<|transcribe|> or <|translate|>] + [<|notimestamps|>] (only without timestamps)

The prompt text is tokenized as transformers' `get_prompt_ids` does (" " + text.strip(),
no special tokens) and keeps its last `max_text // 2 - 1` tokens (223), as openai-whisper
does with the previous text. `language` is a code ("en"), a name ("english", any case) or
"" (detect).

`Transcript.finish(segments, lang) -> (text, language, segments)`: the windows node's
segments (windows.py) with their `id` and `text` added, the text of all their tokens
(special tokens and timestamps dropped), and the language's name ("english", as OpenAI's
verbose_json gives it).
`Transcript.detokenize(tokens) -> (text)`: the text alone, the same way (the server streams
a transcript's text with it, in its own copy of the node).

Tokenizer: tokens.py (the checkpoint's `tokenizer.json`, else the byte-level fallback).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from tokenizers import Tokenizer

from mstar_models.whisper.tokens import (
    LANGUAGE_BY_NAME,
    LANGUAGE_CODES,
    LANGUAGE_NAMES,
    Layout,
    byte_tokenizer,
    checkpoint_tokenizer,
    layout_of,
)
from mstar_runtime.ops import node

TASKS = ("transcribe", "translate")


class _Tokenized(node.StatelessNode):
    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.layout: Layout = layout_of(spec)
        self.tokenizer: Tokenizer = byte_tokenizer(self.layout)
        self.max_text = int(spec.config.get("target_positions", 448))

    def on_weights(self, source: str) -> None:
        """Called by the weights loader with the plan's weights source: use the checkpoint's tokenizer."""
        tok = checkpoint_tokenizer(source)
        if tok is not None:
            self.tokenizer = tok


def language_code(value: Any, layout: Layout) -> str:
    """A request's language as a code of this vocabulary ("" for detect); a RequestError otherwise."""
    if not isinstance(value, str):
        raise node.RequestError(f"language must be a string, got {type(value).__name__}", "language")
    lang = value.strip().lower()
    if not lang:
        return ""
    code = LANGUAGE_BY_NAME.get(lang, lang)
    if code not in LANGUAGE_CODES[: layout.languages]:
        raise node.RequestError(f"unknown language {value!r}: give an ISO-639-1 code such as 'en' or a name such as "
                                "'english', or leave it empty to detect it", "language")
    return code


class Prompt(_Tokenized):
    """build(language: str, task: str, timestamps: bool, prompt: str) -> (head, language, tail)."""

    def phase_build(self, batch: node.Batch) -> node.Batch:
        lay = self.layout
        out: node.Batch = []
        for entry in batch:
            code = language_code(entry.get("language", ""), lay)
            task = entry.get("task")
            if task not in TASKS:
                raise node.RequestError(f"task must be one of {', '.join(TASKS)}, got {task!r}", "task")
            timestamps = entry.get("timestamps")
            if not isinstance(timestamps, bool):
                raise node.RequestError(f"timestamps must be a bool, got {type(timestamps).__name__}", "timestamps")
            text = entry.get("prompt", "")
            if not isinstance(text, str):
                raise node.RequestError(f"prompt must be a string, got {type(text).__name__}", "prompt")
            head = [lay.sot]
            if text.strip():
                ids = self.tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids
                head = [lay.startofprev, *ids[-(self.max_text // 2 - 1):], lay.sot]
            tail = [lay.task_token(task)] + ([] if timestamps else [lay.notimestamps])
            # host tensors: the decoder checks them on the host and uploads them without a wait
            out.append({"head": torch.tensor(head, dtype=torch.int32),
                        "language": torch.tensor([lay.language_token(code) if code else -1], dtype=torch.int32),
                        "tail": torch.tensor(tail, dtype=torch.int32)})
        return out


class Transcript(_Tokenized):
    """finish(segments: str, lang: i32[1]) -> (text, language, segments);
    detokenize(tokens: i32[N]) -> (text: str)."""

    def phase_finish(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            try:
                segs = json.loads(entry.get("segments") or "")
            except (TypeError, ValueError):
                segs = None
            if not isinstance(segs, list) or not all(isinstance(s, dict) and "tokens" in s for s in segs):
                raise node.RequestError("segments must be the windows node's JSON list of segments", "segments")
            lang = entry.get("lang")
            code = self.layout.language_of(int(lang.reshape(-1)[0])) if isinstance(lang, torch.Tensor) else ""
            for i, s in enumerate(segs):
                s["id"], s["text"] = i, self.text_of(s["tokens"])
            text = self.text_of([t for s in segs for t in s["tokens"]])
            out.append({"text": text, "language": LANGUAGE_NAMES.get(code, ""),
                        "segments": json.dumps(segs, ensure_ascii=False)})
        return out

    def text_of(self, ids: list[int]) -> str:
        """The text of token ids: special tokens and timestamps dropped."""
        return self.tokenizer.decode([t for t in ids if 0 <= t < self.layout.eot], skip_special_tokens=True)

    def phase_detokenize(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            tokens = entry.get("tokens")
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
                raise node.RequestError("tokens must be a 1-D tensor of token ids", "tokens")
            out.append({"text": self.text_of([int(t) for t in tokens.tolist()])})
        return out
