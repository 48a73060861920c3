"""Text for the chat route: prompt token counts and generated token ids turned into text.

A plan has no tokenizer of its own; its walks tokenize with a stateless *prompt node* (the
node whose phase first takes the walk's text input, e.g. the test family's
`prompt.encode(text)`, Orpheus' `prompt.build(text, voice)`). `TextCodec` builds a private
copy of that node in the server process (weights loaded from the same source, so a
checkpoint's tokenizer is the one used) and calls it directly:

- `count(inputs)`: the prompt's token count, for `usage.prompt_tokens`;
- `render(ids)`: the text of the token ids generated so far. When the node has a
  detokenize-like phase (`detokenize`, `decode_text`, `detok`, `untokenize`: token ids in,
  a string out), that phase decodes them, and a streamed delta is the new suffix of the
  decoded text (held back while it ends in an incomplete UTF-8 sequence, U+FFFD). Without
  one, each id is rendered as its decimal number, separated by single spaces ("17 42 99"):
  lossless, deterministic and visibly not prose. The test family's byte-level prompt
  node has no such phase, so its chat replies read as ids.

Only stateless nodes with no parameters are copied (a tokenizer, not an encoder): anything
heavier would duplicate weights in memory, and the codec falls back (ids as numbers, prompt
tokens 0). Calls are serialised with a lock; nodes need not be thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from os import PathLike
from typing import Any

import torch

from mstar_runtime.plan.loader import Plan

log = logging.getLogger(__name__)

DETOKENIZE_PHASES = ("detokenize", "decode_text", "detok", "untokenize")


def _first_call_on(program: Mapping[str, Any], var: str) -> Mapping[str, Any] | None:
    """The first `call` op of a walk program that takes input variable `var` as an argument."""
    stack: list[Any] = [program.get("program")]
    while stack:
        op = stack.pop(0)
        if isinstance(op, list):
            stack[:0] = op
            continue
        if not isinstance(op, Mapping):
            continue
        if op.get("op") == "call" and any(a == {"var": var} for a in op.get("args", {}).values()):
            return op
        children = [v for k, v in op.items() if k in ("body", "branches", "then", "else") and v]
        stack[:0] = children
    return None


class TextCodec:
    """Prompt token counts and token-id rendering for one walk (see the module docstring)."""

    def __init__(self, plan: Plan, walk: str, text_input: str, weights: str | PathLike[str]):
        self.node: Any = None
        self.encode_phase: str | None = None
        self.encode_args: dict[str, str] = {}  # port -> walk input
        self.detok_phase: str | None = None
        self._lock = threading.Lock()
        call = _first_call_on(plan.walk(walk), text_input)
        if call is None:
            return
        info = plan.node(call["node"])
        if info.engine != "stateless":
            return
        args = {port: a["var"] for port, a in call["args"].items() if isinstance(a, Mapping) and "var" in a}
        declared = {p["name"] for p in plan.walk(walk)["inputs"]}
        if set(args) != set(call["args"]) or not set(args.values()) <= declared:
            return  # the phase needs values the walk computes first: cannot be called alone
        try:
            node = self._build(plan, call["node"], weights)
        except Exception as e:  # a tokenizer that cannot be copied costs only usage figures
            log.warning("chat walk '%s': cannot build prompt node '%s' in the server (%s); prompt token "
                        "counts are 0 and token ids are rendered as numbers", walk, call["node"], e)
            return
        if node is None:
            return
        self.node, self.encode_phase, self.encode_args = node, call["phase"], args
        for phase in DETOKENIZE_PHASES:
            spec = info.phases.get(phase)
            if spec is not None and len(spec.inputs) == 1 and len(spec.outputs) == 1:
                self.detok_phase = phase
                self._detok_in, self._detok_out = spec.inputs[0], spec.outputs[0]
                break

    @staticmethod
    def _build(plan: Plan, name: str, weights: str | PathLike[str]) -> Any:
        from mstar_runtime.weights import build_node, load_weights

        node = build_node(plan, name, plan.node(name).ranks[0], "cpu")
        if any(True for _ in node.parameters()) or any(True for _ in node.buffers()):
            return None
        load_weights(node, plan, name, str(weights))
        return node

    def count(self, inputs: Mapping[str, Any]) -> int:
        """Prompt tokens of a request (0 when the walk's prompt node could not be copied)."""
        if self.node is None or self.encode_phase is None:
            return 0
        entry = {port: inputs[var] for port, var in self.encode_args.items() if var in inputs}
        try:
            with self._lock:
                out = self.node.run(self.encode_phase, [entry])[0]
        except Exception:  # the walk itself will report a bad prompt, naming the field
            return 0
        tensors = [v for v in out.values() if isinstance(v, torch.Tensor)]
        return int(tensors[0].numel()) if tensors else 0

    def render(self, ids: list[int]) -> str:
        """The text of all ids generated so far."""
        if self.detok_phase is not None:
            tokens = torch.tensor(ids, dtype=torch.int32)
            with self._lock:
                out = self.node.run(self.detok_phase, [{self._detok_in: tokens}])[0]
            text = out.get(self._detok_out)
            if isinstance(text, str):
                return text
        return " ".join(str(i) for i in ids)


class TextStream:
    """Incremental deltas of one reply: `push(ids) -> new text` (see `TextCodec.render`)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.codec.detok_phase is None:  # numbers: no need to re-render the whole reply
            piece = " ".join(str(i) for i in ids)
            delta = piece if not self.sent else " " + piece
            self.sent += delta
            return delta
        text = self.codec.render(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            return ""
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta

    def flush(self) -> str:
        """Whatever was held back, at the end of the reply."""
        if self.codec.detok_phase is None or not self.ids:
            return ""
        text = self.codec.render(self.ids)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta


__all__ = ["TextCodec", "TextStream"]
