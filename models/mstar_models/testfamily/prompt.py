"""TinyPrompt: a byte-level tokenizer (stateless, no weights): [bos] + (byte + byte_offset).

Its text is the whole prompt: the chat route renders a conversation with a chat template
before it reaches `text` (`server_chat_template`; mstar_runtime/serve/chat_template.py), the
checkpoint's when there is one, else the bundled `chat_template_tiny.json`
(`<|role|>content` lines, then `<|assistant|>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from mstar_models.testfamily.common import setting
from mstar_runtime.ops import node


def encode_text(text: str, bos: int, byte_offset: int) -> list[int]:
    return [bos] + [b + byte_offset for b in text.encode("utf-8")]


class TinyPrompt(node.StatelessNode):
    """encode(text: str) -> (tokens: i32[T]), T = 1 + the text's UTF-8 length."""

    server_chat_template: ClassVar[bool] = True  # the module docstring
    bundled_chat_template: ClassVar[Path] = Path(__file__).resolve().parent / "chat_template_tiny.json"

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.bos, self.byte_offset = int(setting(spec, "bos")), int(setting(spec, "byte_offset"))
        vocab = int(setting(spec, "vocab"))
        if self.byte_offset + 255 >= vocab:
            raise node.NodeError(
                f"node '{spec.name}': byte_offset {self.byte_offset} + 255 does not fit vocab {vocab}"
            )

    def phase_encode(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            text = entry["text"]
            if not isinstance(text, str):
                raise node.RequestError(f"text must be a string, got {type(text).__name__}", "text")
            ids = encode_text(text, self.bos, self.byte_offset)
            out.append({"tokens": torch.tensor(ids, dtype=torch.int32, device=self.spec.device)})
        return out
