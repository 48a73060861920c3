"""Long-form transcription's bookkeeping as a stateless node: where each 30 s window starts,
what it is conditioned on, whether its decode falls back to a higher temperature, and the
segments it adds. transformers' `WhisperForConditionalGeneration.generate` long-form loop
(its `generate_with_fallback`, `_need_fallback`, `_retrieve_segment` and
`_prepare_decoder_input_ids`) for one request, the walk's loops doing the iterating
(models/whisper/whisper.walk):

  start(frames, head, timestamps, condition, ...) -> (seek, cond, segs, finished)
      checks the request's long-form settings once; seek 0, no segments yet
  cut(mel, seek, frames, head, segs, cond, temperature)
      -> (window, span, context, ok, attempt, temp, got, stats)
      the window `mel[:, seek : seek + 3000]` (zero-padded to 3000 frames, as transformers
      pads a short last window), `span` its frames of audio, the decoder prompt's head for it
      (`context`), and the fallback loop's starting values (attempt 0 at `temperature`); a
      seek at or past the end (the window loop's speculative iteration after the last, which
      the runtime throws away once it reads `finished`) gives an empty window
  judge(tokens, last, logprobs, logprob, no_speech, attempt, temperature, fallback_temperatures, ...)
      -> (ok, attempt, temp, got, stats)
      one decode attempt judged: its compression ratio (zlib over the token ids, 2 bytes
      each) above `compression_ratio_threshold`, or its mean log-probability (over every
      generated token, <|endoftext|> included) below `logprob_threshold`, asks for the next
      temperature (`temperature`, then `fallback_temperatures`: transformers' tuple); a
      mean log-probability below the threshold with `no_speech` above
      `no_speech_threshold` skips the window instead. `ok` ends the fallback loop: the
      attempt stands, or it was the last temperature. `got` is the attempt's tokens without
      <|endoftext|>, `stats` its [avg_logprob, compression_ratio, no_speech_prob,
      temperature, skipped]
  advance(tokens, stats, seek, span, frames, segs, condition) -> (seek, cond, segs, finished, piece)
      the accepted attempt's segments (split at each pair of timestamps); the next window
      starts at the last complete segment's closing timestamp, or after this window when
      the tokens end on a single timestamp, hold no pair, or the window was skipped.
      `cond`: the next window is conditioned on the text so far (`condition` and this
      window's temperature below 0.5). `piece`: the new segments' tokens.

A threshold of 0 turns its test off (transformers' None). `segs` is the JSON list of the
segments so far, `{seek, start, end, tokens, avg_logprob, compression_ratio, no_speech_prob,
temperature}` each (the transcript node adds their text): the next window's context is built
from it (`[<|startofprev|>]` + the last 223 tokens of the prompt and the segments, a segment
that ends on two timestamps without its last one, + `[<|startoftranscript|>]`).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mstar_models.whisper.features import N_FRAMES
from mstar_models.whisper.tokens import TIME_PRECISION, Layout, layout_of
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import scalar

INPUT_STRIDE = 2  # mel frames per encoder position (the second convolution's stride)
FRAME_SECONDS = 0.01  # seconds per mel frame (hop 160 at 16 kHz)
STATS = ("avg_logprob", "compression_ratio", "no_speech_prob", "temperature")


def compression_ratio(tokens: Sequence[int], vocab: int) -> float:
    """transformers' `_retrieve_compression_ratio`: raw over zlib-compressed bytes of the ids."""
    width = int(math.log2(vocab) / 8) + 1
    raw = b"".join(int(t).to_bytes(width, "little") for t in tokens)
    return len(raw) / len(zlib.compress(raw))


def mean_logprob(logprobs: Sequence[float]) -> float:
    """The float32 sum of the tokens' log-probabilities over their count, summed in order as
    transformers' `_retrieve_avg_logprobs` does."""
    total = np.float32(0.0)
    for v in logprobs:
        total = np.float32(total + np.float32(v))
    return float(total / np.float32(len(logprobs))) if len(logprobs) else 0.0


def temperatures(entry: Mapping[str, Any]) -> list[float]:
    """The attempts' temperatures: `temperature`, then the `fallback_temperatures` in order
    (transformers' tuple `temperature`), checked."""
    first = scalar(entry, "temperature", float, finite=True)
    rest = entry.get("fallback_temperatures")
    if not isinstance(rest, torch.Tensor) or rest.dim() != 1:
        raise node.RequestError("fallback_temperatures must be a 1-D list of temperatures", "fallback_temperatures")
    temps = [first, *(float(t) for t in rest.double().tolist())]
    if first < 0:
        raise node.RequestError(f"temperature must be >= 0, got {first}", "temperature")
    if not all(math.isfinite(t) and t >= 0 for t in temps[1:]):
        raise node.RequestError(f"fallback_temperatures must be finite and >= 0, got {temps[1:]}",
                                "fallback_temperatures")
    return temps


def check_settings(entry: Mapping[str, Any], frames: int, max_attempts: int) -> None:
    """`start`'s checks of a request's long-form settings, as RequestErrors naming the field
    (the live walk's `live.start` and `live.settle` make them too, live.py)."""
    if frames > N_FRAMES and not scalar(entry, "timestamps", bool):
        raise node.RequestError(f"audio of {frames / 100:.2f} s is transcribed 30 s window by window, each "
                                "starting at a timestamp the model wrote: it needs timestamps = true", "timestamps")
    temps = temperatures(entry)
    if len(temps) > max_attempts:
        raise node.RequestError(f"{len(temps)} temperatures in all; at most {max_attempts} attempts are "
                                "decoded per window", "fallback_temperatures")
    ratio = scalar(entry, "compression_ratio_threshold", float, finite=True)
    logprob = scalar(entry, "logprob_threshold", float, finite=True)
    no_speech = scalar(entry, "no_speech_threshold", float, finite=True)
    if ratio < 0:
        raise node.RequestError(f"compression_ratio_threshold must be >= 0 (0: off), got {ratio}",
                                "compression_ratio_threshold")
    if logprob > 0:
        raise node.RequestError(f"logprob_threshold must be <= 0 (0: off), got {logprob}", "logprob_threshold")
    if not 0 <= no_speech <= 1:
        raise node.RequestError(f"no_speech_threshold must lie in [0, 1] (0: off), got {no_speech}",
                                "no_speech_threshold")
    if no_speech and not logprob:
        raise node.RequestError("no_speech_threshold skips a window whose mean log-probability is below "
                                "logprob_threshold: give that too", "no_speech_threshold")


def window_at(mel: torch.Tensor, seek: int, frames: int) -> tuple[torch.Tensor, int]:
    """The 3,000 frames of `mel` at `seek`, zero-padded, and how many of them are audio (`cut`'s
    window; a seek at or past the end gives an empty one)."""
    span = max(0, min(frames - seek, N_FRAMES))
    window = mel.new_zeros(mel.shape[0], N_FRAMES)
    window[:, :span] = mel[:, seek : seek + span]
    return window, span


def window_segments(seq: Sequence[int], seek: int, span: int, tb: int) -> tuple[list[dict[str, Any]], int]:
    """transformers' `_retrieve_segment` for one window: its segments ({start, end, tokens}, in
    seconds of the whole audio) and how many frames the next window starts after this one."""
    is_ts = [t >= tb for t in seq]
    single_end = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(is_ts) - 1) if is_ts[i] and is_ts[i + 1]]
    offset = seek * TIME_PRECISION / INPUT_STRIDE
    if not cuts:
        stamps = [i for i, t in enumerate(is_ts) if t]
        end = float(int(span * FRAME_SECONDS / TIME_PRECISION))
        if stamps and seq[stamps[-1]] != tb:
            end = float(seq[stamps[-1]] - tb)
        return [{"start": offset, "end": offset + end * TIME_PRECISION, "tokens": list(seq)}], span
    if single_end:
        cuts.append(len(seq))
    else:
        cuts[-1] += 1  # the last segment keeps its closing timestamp
    out, last = [], 0
    for i, cut in enumerate(cuts):
        piece = list(seq[last:cut])
        closing = piece[-1] if i < len(cuts) - 1 or single_end else piece[-2]
        out.append({"start": offset + float(piece[0] - tb) * TIME_PRECISION,
                    "end": offset + float(closing - tb) * TIME_PRECISION, "tokens": piece})
        last = cut
    advance = span if single_end else (seq[last - 2] - tb) * INPUT_STRIDE
    return out, advance


def _ids(entry: Mapping[str, Any], port: str) -> list[int]:
    value = entry.get(port)
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise node.RequestError(f"{port} must be a 1-D tensor", port)
    return [int(v) for v in value.tolist()]


def _floats(entry: Mapping[str, Any], port: str) -> list[float]:
    value = entry.get(port)
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise node.RequestError(f"{port} must be a 1-D tensor", port)
    return [float(v) for v in value.float().tolist()]


def _segments(entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    text = entry.get("segs")
    try:
        segs = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        segs = None
    if not isinstance(segs, list):
        raise node.RequestError("segs must be the JSON list of the segments so far", "segs")
    return segs


class Windows(node.StatelessNode):
    """start / cut / judge / advance; see the module docstring."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.layout: Layout = layout_of(spec)
        self.max_text = int(spec.config.get("target_positions", 448))
        self.max_attempts = int(spec.config.get("max_attempts", 1))

    def phase_start(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            frames = scalar(entry, "frames", int)
            check_settings(entry, frames, self.max_attempts)
            out.append({"seek": 0, "cond": scalar(entry, "condition", bool), "segs": "[]", "finished": frames <= 0})
        return out

    def phase_cut(self, batch: node.Batch) -> node.Batch:
        lay = self.layout
        out: node.Batch = []
        for entry in batch:
            mel, seek, frames = entry.get("mel"), scalar(entry, "seek", int), scalar(entry, "frames", int)
            if not isinstance(mel, torch.Tensor) or mel.dim() != 2 or mel.shape[1] != frames:
                raise node.RequestError(f"mel must be [mels, {frames}]", "mel")
            if seek < 0:
                raise node.RequestError(f"seek must be >= 0, got {seek}", "seek")
            # a seek past the end is the speculative window after the last (thrown away): empty
            window, span = window_at(mel, seek, frames)
            head = _ids(entry, "head")
            prompted = len(head) > 1 and head[0] == lay.startofprev
            segs = _segments(entry)
            if scalar(entry, "cond", bool) and (prompted or segs):
                prev = head[1:-1] if prompted else []
                for s in segs:
                    toks = s["tokens"]
                    ends_on_pair = len(toks) > 2 and toks[-2] >= lay.timestamp_begin
                    prev += toks[:-1] if ends_on_pair else toks
                context = [lay.startofprev, *prev[-(self.max_text // 2 - 1):], lay.sot]
            else:
                context = head if prompted else [lay.sot]
            out.append({"window": window, "span": span, "context": torch.tensor(context, dtype=torch.int32),
                        "ok": False, "attempt": 0, "temp": scalar(entry, "temperature", float),
                        "got": torch.zeros(0, dtype=torch.int32), "stats": torch.zeros(len(STATS) + 1)})
        return out

    def phase_judge(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            seq = _ids(entry, "tokens") + _ids(entry, "last")
            logprobs = _floats(entry, "logprobs") + _floats(entry, "logprob")
            no_speech = _floats(entry, "no_speech")[0]
            attempt = scalar(entry, "attempt", int)
            temps = temperatures(entry)
            ratio_max = scalar(entry, "compression_ratio_threshold", float)
            logprob_min = scalar(entry, "logprob_threshold", float)
            no_speech_max = scalar(entry, "no_speech_threshold", float)
            ratio, avg = compression_ratio(seq, self.layout.vocab), mean_logprob(logprobs)
            fallback = bool(ratio_max) and ratio > ratio_max
            fallback = fallback or (bool(logprob_min) and avg < logprob_min)
            skip = bool(no_speech_max) and avg < logprob_min and no_speech > no_speech_max
            fallback = fallback and not skip
            temp = temps[min(attempt, len(temps) - 1)]
            got = seq[:-1] if seq and seq[-1] == self.layout.eot else seq
            nxt = attempt + 1
            out.append({"ok": not fallback or nxt >= len(temps), "attempt": nxt,
                        "temp": temps[min(nxt, len(temps) - 1)], "got": torch.tensor(got, dtype=torch.int32),
                        "stats": torch.tensor([avg, ratio, no_speech, temp, float(skip)])})
        return out

    def phase_advance(self, batch: node.Batch) -> node.Batch:
        tb = self.layout.timestamp_begin
        out: node.Batch = []
        for entry in batch:
            seq, stats = _ids(entry, "tokens"), _floats(entry, "stats")
            seek, span, frames = (scalar(entry, p, int) for p in ("seek", "span", "frames"))
            segs = _segments(entry)
            new: list[dict[str, Any]] = []
            if stats[len(STATS)] > 0.5:  # skipped: no speech
                advance = span
            else:
                new, advance = window_segments(seq, seek, span, tb)
                values = dict(zip(STATS, stats[: len(STATS)], strict=True))
                values["temperature"] = round(values["temperature"], 6)  # the float32 port's 0.2 as 0.2
                for s in new:
                    s.update(seek=seek, **values)
            piece = [t for s in new for t in s["tokens"]]
            seek += advance
            out.append({"seek": seek, "cond": scalar(entry, "condition", bool) and stats[3] < 0.5,
                        "segs": json.dumps(segs + new), "finished": seek >= frames,
                        "piece": torch.tensor(piece, dtype=torch.int32)})
        return out
