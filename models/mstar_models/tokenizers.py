"""Reading a Hugging Face `tokenizer.json` for a node, one way for every model."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from mstar_runtime.ops import node


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer in `path`; a NodeError naming the file when it cannot be read or parsed."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for unreadable or corrupt files
        raise node.NodeError(f"cannot read tokenizer '{path}': {e}") from None
