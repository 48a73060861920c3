"""π0.5's prompt as a stateless node: `build(instruction, state) -> (tokens)`.

The text is LeRobot's `Pi05PrepareStateTokenizerProcessorStep` (openpi's
`PaligemmaTokenizer.tokenize` for π0.5): the state, already normalised to [-1, 1], padded
with zeros to `state_dim` (32) and discretised into 256 bins,
`np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1` (so a value below -1 gives -1 and
one at or above 1 gives 255, as there), then

    f"Task: {instruction.strip() with '_' and newlines as spaces}, State: {bins joined by ' '};\\nAction: "

tokenized with a leading BOS (PaliGemma's tokenizer adds it; id 2). LeRobot pads the ids to
200 with a mask; the mask removes the padding from every attention, so the node sends the
unpadded ids and refuses more than `max_prompt` (the reference would truncate silently).

Tokenizer: the checkpoint's `tokenizer.json` when the weights source is a folder that has one
(PaliGemma's, `google/paligemma-3b-pt-224`: LeRobot's processor downloads it separately, so copy
it into the checkpoint folder); otherwise a byte tokenizer (BOS, then id 3 + b for each UTF-8
byte b), which any vocabulary of at least 259 ids holds: the tiny variant and random-weight
benchmarks get prompts of the right shape, not PaliGemma's ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from mstar_runtime.ops import node

BOS = 2  # Gemma's <bos>
BYTE_OFFSET = 3  # the byte tokenizer's id of byte 0 (after <pad>, <eos>, <bos>)
BINS = 256
CHECKPOINT_TOKENIZER = "tokenizer.json"


def discretize(state: np.ndarray) -> np.ndarray:
    """The 256-bin indices of a state in [-1, 1] (the reference's rule, see the module docstring)."""
    return np.digitize(state, bins=np.linspace(-1, 1, BINS + 1)[:-1]) - 1


def prompt_text(instruction: str, state: np.ndarray) -> str:
    """The prompt text of an instruction and a padded state vector."""
    cleaned = instruction.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, discretize(state)))};\nAction: "


class Prompt(node.StatelessNode):
    """build(instruction: str, state: f32[S]) -> (tokens: i32[T]); see the module docstring."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        try:
            self.state_dim = int(spec.settings.get("state_dim", spec.config["action_dim"]))
            self.max_prompt = int(spec.settings.get("max_prompt", spec.config["max_prompt"]))
            self.vocab = int(spec.config["vocab"])
        except KeyError as e:
            raise node.NodeError(f"node '{spec.name}' (Prompt): the model config has no {e}") from None
        if self.vocab < BYTE_OFFSET + 256:
            raise node.NodeError(f"node '{spec.name}' (Prompt): the byte tokenizer needs a vocabulary of at least "
                                 f"{BYTE_OFFSET + 256} ids, the model has {self.vocab}")
        self.tokenizer: Tokenizer | None = None

    def on_weights(self, source: str) -> None:
        """Called by the weights loader with the plan's weights source: use the checkpoint's tokenizer."""
        path = Path(source) / CHECKPOINT_TOKENIZER
        if path.is_file():
            try:
                self.tokenizer = Tokenizer.from_file(str(path))
            except Exception as e:  # the library raises a bare Exception for unreadable or corrupt files
                raise node.NodeError(f"cannot read tokenizer '{path}': {e}") from None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [BOS] + [BYTE_OFFSET + b for b in text.encode("utf-8")]
        ids = list(self.tokenizer.encode(text).ids)
        return ids if ids and ids[0] == BOS else [BOS, *ids]

    def state(self, entry: dict[str, Any]) -> np.ndarray:
        """The request's state, checked and padded with zeros to state_dim (float32)."""
        value = entry.get("state")
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.dtype.is_floating_point:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise node.RequestError(f"state must be a 1-D float array, got {got}", "state")
        if value.numel() > self.state_dim:
            raise node.RequestError(f"state has {value.numel()} values; the model takes at most {self.state_dim}",
                                    "state")
        if not bool(torch.isfinite(value).all()):
            raise node.RequestError("state holds NaN or infinite values", "state")
        padded = np.zeros(self.state_dim, dtype=np.float32)
        padded[: value.numel()] = value.detach().to("cpu", torch.float32).numpy()
        return padded

    def phase_build(self, batch: node.Batch) -> node.Batch:
        out = []
        for entry in batch:
            instruction = entry.get("instruction")
            if not isinstance(instruction, str):
                raise node.RequestError(f"instruction must be a string, got {type(instruction).__name__}",
                                        "instruction")
            if not instruction.strip():
                raise node.RequestError("instruction is empty", "instruction")
            ids = self.encode(prompt_text(instruction, self.state(entry)))
            if len(ids) > self.max_prompt:
                raise node.RequestError(f"the prompt (instruction and state) is {len(ids)} tokens; the model takes at "
                                        f"most {self.max_prompt}", "instruction")
            if max(ids) >= self.vocab:
                raise node.RequestError(f"the tokenizer gave an id >= the vocabulary ({self.vocab})", "instruction")
            # host tensors: the VLM checks the ids on the host before it uploads them
            out.append({"tokens": torch.tensor(ids, dtype=torch.int32)})
        return out
