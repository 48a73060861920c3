"""Text for the chat route: prompt token counts and generated token ids turned into text.

A plan has no tokenizer of its own; its walks tokenize with a stateless *prompt node* (the
node whose phase first takes the walk's text input, e.g. the test family's
`prompt.encode(text)`, Orpheus' `prompt.build(text, voice)`). `TextCodec` builds a private
copy of that node in the server process (weights loaded from the same source, so a
checkpoint's tokenizer is the one used) and calls it directly:

- `count(inputs)`: the prompt's token count, for `usage.prompt_tokens`; a value the node
  refuses (an unknown voice) is a `RequestError` here, before the request is queued;
- `render(ids)`: the text of the token ids generated so far. When the node has a
  detokenize-like phase (`detokenize`, `decode_text`, `detok`, `untokenize`: token ids in,
  a string out), that phase decodes them, and a streamed delta is the new suffix of the
  decoded text (held back while it ends in an incomplete UTF-8 sequence, U+FFFD). Without
  one, each id is rendered as its decimal number, separated by single spaces ("17 42 99"):
  lossless, deterministic and visibly not prose. The test family's byte-level prompt
  node has no such phase, so its chat replies read as ids.

Streaming (`TextStream`). When the node holds a `tokenizers.Tokenizer` (its `tokenizer`
attribute) whose decode gives exactly the detokenize phase's text, a reply streams through
the library's own incremental decoder (`tokenizers.decoders.DecodeStream`): each token is
decoded once, with a few tokens of context, rather than the whole reply again per token.
"Exactly" is checked when the codec is built, on a probe that has accents, CJK, an emoji
split over several byte-level tokens and a special token (which also settles whether the
phase skips special tokens); a node whose ids are not the tokenizer's (BAGEL relabels its
specials) or whose phase means something else fails the probe and keeps the phase path.

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

from mstar_runtime.control.validate import validate_inputs
from mstar_runtime.media import first_call_on
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan

log = logging.getLogger(__name__)

DETOKENIZE_PHASES = ("detokenize", "decode_text", "detok", "untokenize")
# What the streaming decoder must render as the detokenize phase does: accents, CJK, and an
# emoji that byte-level BPE splits over several tokens (the held-back-bytes case)
PROBE_TEXT = "Hello, wörld: naïve café — 你好世界 🎉👍🏽 done."


class TextCodec:
    """Prompt token counts and token-id rendering for one walk (see the module docstring)."""

    def __init__(self, plan: Plan, walk: str, text_input: str, weights: str | PathLike[str]):
        self.node: Any = None
        self.encode_phase: str | None = None
        self.encode_args: dict[str, str] = {}  # port -> walk input
        self.detok_phase: str | None = None
        self.tokenizer: Any = None  # a tokenizers.Tokenizer equal to the detokenize phase (streams with it)
        self.skip_special = True  # whether the phase drops special tokens, as the probe found
        self._lock = threading.Lock()
        self.walk, self.program = walk, plan.walk(walk)
        call = first_call_on(plan.walk(walk), text_input)
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
        if self.detok_phase is not None:
            self.tokenizer, self.skip_special = self._stream_tokenizer()

    @staticmethod
    def _build(plan: Plan, name: str, weights: str | PathLike[str]) -> Any:
        from mstar_runtime.weights import build_node, load_weights

        node = build_node(plan, name, plan.node(name).ranks[0], "cpu")
        if any(True for _ in node.parameters()) or any(True for _ in node.buffers()):
            return None
        load_weights(node, plan, name, str(weights))
        return node

    def count(self, inputs: Mapping[str, Any]) -> int:
        """Prompt tokens of a request (0 when the walk's prompt node could not be copied).
        Raises the node's `RequestError`, naming the walk input, when it refuses the request's
        values (an unknown voice): the walk would fail the same way, but only after waiting its
        turn behind the engine's queue. The node sees the inputs typed and defaulted as the
        engine passes them; inputs the engine itself would refuse are left to it."""
        if self.node is None or self.encode_phase is None:
            return 0
        try:
            values = validate_inputs(self.walk, self.program, inputs)
        except RequestError:  # `MStar.submit` refuses it, naming the field
            return 0
        entry = {port: values[var] for port, var in self.encode_args.items()}
        try:
            with self._lock:
                out = self.node.run(self.encode_phase, [entry])[0]
        except RequestError as e:
            raise RequestError(str(e), self.encode_args.get(e.field or "", e.field)) from None
        except Exception:  # anything else is the walk's to report
            return 0
        tensors = [v for v in out.values() if isinstance(v, torch.Tensor)]
        return int(tensors[0].numel()) if tensors else 0

    def render(self, ids: list[int]) -> str:
        """The text of all ids generated so far."""
        if self.detok_phase is not None:
            text = self._phase_text(ids)
            if text is not None:
                return text
        return " ".join(str(i) for i in ids)

    def _phase_text(self, ids: list[int]) -> str | None:
        tokens = torch.tensor(ids, dtype=torch.int32)
        with self._lock:
            out = self.node.run(self.detok_phase, [{self._detok_in: tokens}])[0]
        text = out.get(self._detok_out)
        return text if isinstance(text, str) else None

    def _stream_tokenizer(self) -> tuple[Any, bool]:
        """(the node's tokenizer, whether to skip special tokens) when streaming with it gives
        the detokenize phase's text on the probe (module docstring); else (None, True)."""
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - tokenizers comes with the runtime extra
            return None, True
        tok = getattr(self.node, "tokenizer", None)
        if not isinstance(tok, Tokenizer):
            return None, True
        try:
            ids = tok.encode(PROBE_TEXT, add_special_tokens=False).ids
            special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
            if special:  # one special token inside the reply: does the phase drop it?
                ids = ids[: len(ids) // 2] + [special[0]] + ids[len(ids) // 2:]
            want = self._phase_text(ids)
        except Exception as e:  # the phase does not take a whole reply (BAGEL's wants a context chunk)
            log.info("detokenize phase of '%s' does not decode a whole reply (%s): no streaming decoder", self.node, e)
            return None, True
        for skip in (True, False):
            if want is not None and _stream_decode(tok, ids, skip) == want:
                return tok, skip
        return None, True


def _stream_decode(tok: Any, ids: list[int], skip_special: bool) -> str | None:
    """`ids` through a fresh `DecodeStream`, pieces joined, plus what it still holds back at
    the end (as `TextStream.flush` gives it); None if the decoder refuses them."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=skip_special)
    try:
        text = "".join(piece for i in ids if (piece := stream.step(tok, i)) is not None)
    except Exception:  # its own consistency check ("invalid prefix") failed
        return None
    full = tok.decode(ids, skip_special_tokens=skip_special)
    return text + full[len(text):] if full.startswith(text) else None


class TextStream:
    """Incremental deltas of one reply: `push(ids) -> new text`, `flush()` at its end (see
    `TextCodec.render`, and the module docstring for the streaming decoder)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.sent = ""
        self._decoder: Any = None
        if codec.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self._decoder = DecodeStream(skip_special_tokens=codec.skip_special)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.codec.detok_phase is None:  # numbers: no need to re-render the whole reply
            piece = " ".join(str(i) for i in ids)
            delta = piece if not self.sent else " " + piece
            self.sent += delta
            return delta
        if self._decoder is not None:
            delta = self._step(ids)
            if delta is not None:
                self.sent += delta
                return delta
        text = self.codec.render(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            return ""
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta

    def _step(self, ids: list[int]) -> str | None:
        """The streaming decoder's text for `ids`, or None once it has failed (the phase path
        then renders the whole reply, as for a node without a tokenizer)."""
        pieces: list[str] = []
        try:
            for i in ids:
                piece = self._decoder.step(self.codec.tokenizer, i)
                if piece is not None:
                    pieces.append(piece)
        except Exception as e:  # its "invalid prefix" check: give up on it for this reply
            log.warning("streaming decoder failed (%s); this reply is decoded whole from here on", e)
            self._decoder = None
            return None
        return "".join(pieces)

    def flush(self) -> str:
        """Whatever was held back, at the end of the reply."""
        if self.codec.detok_phase is None or not self.ids:
            return ""
        if self._decoder is not None:  # one whole decode, for the bytes the decoder still holds
            text = self.codec.tokenizer.decode(self.ids, skip_special_tokens=self.codec.skip_special)
        else:
            text = self.codec.render(self.ids)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta


__all__ = ["TextCodec", "TextStream"]
