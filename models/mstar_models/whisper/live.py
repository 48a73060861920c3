"""Live transcription's bookkeeping as a stateless node: audio that the client streams in
(the walk `transcribe_live`, models/whisper/whisper.walk), transcribed window by window as
the audio for each window arrives, with final segments equal to `transcribe`'s on the whole
audio.

  start(language, timestamps, condition, temperature, fallback_temperatures, ...thresholds)
      -> (heard, seek, cond, segs, checks, asked)
      checks the long-form settings (`windows.check_settings`) and starts with nothing heard;
      `asked` is the prompt's language token (or -1: detect), the value the windows carry
  hear(samples, heard, seek, timestamps) -> (heard, ready, idle)
      one chunk of the stream appended to the audio heard so far; `ready` is 1 (and `idle`
      false) when the 30 s window at `seek` has all its audio, else 0
  note(window, seek, cond, segs, next, next_cond, next_segs, text, checks, heard, frames)
      -> (seek, cond, segs, checks, idle, finished, line)
      after a window's decode: the window's record added to `checks` (its seek, the segments
      and `cond` before it, a digest of its features), the walk's values moved on to the next
      window's, `idle` whether that window still lacks audio, `finished` whether it starts at
      or past `frames`, and `line`, the window's partial transcript (one JSON line)
  ids(segs) -> (tokens)
      the segments' token ids, in order (`transcribe`'s `tokens`, whole)
  settle(mel, frames, checks, seek, cond, segs, asked, language, ...settings) -> (seek, cond, segs, asked, finished)
      once the stream has closed, with the features of the whole audio: the windows decoded
      while it streamed stand if their features are the whole audio's (digests equal);
      from the first that differs on, the walk decodes again

Why the check. `transcribe` decodes windows of the log-mel of the whole audio, and that
log-mel is floored at the whole audio's maximum less 8 (features.py): audio louder than
anything before it changes the features of every earlier window that holds a value under
the new floor. A live window is cut from the features of the audio heard so far, so its
features are the whole audio's exactly when the loudest part had been heard (and the
short-time transform of the frames it covers needs no sample past those heard: `hear` waits
for them). The decode is a function of the window's features, its prompt (the segments
before it, `cond`) and the language, so a window whose digest matches decoded what
`transcribe` decodes there; one that does not is decoded again, with every window after it.

Partial lines: `{"start": s, "end": e, "text": t}` per window (seconds of the whole audio):
the window's text as decoded. A line replaces whatever the lines before it said from `start`
on, so a window decoded again after the stream closed revises the text from there.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from mstar_models.whisper.features import HOP, N_FFT, N_FRAMES, SAMPLE_RATE, WINDOW_SECONDS
from mstar_models.whisper.windows import FRAME_SECONDS, check_settings, window_at
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import scalar


def samples_for(seek: int) -> int:
    """Samples of audio the full window at `seek` reads: its last frame is centred on sample
    HOP * (seek + 2999) and reaches N_FFT / 2 samples either side (features.py's centred STFT)."""
    return HOP * (seek + N_FRAMES - 1) + N_FFT // 2


def digest(window: torch.Tensor) -> str:
    """A window's features, bit for bit, as a short hex string."""
    return hashlib.sha256(window.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()[:32]


def _samples(entry: dict[str, Any], port: str) -> torch.Tensor:
    value = entry.get(port)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
        raise node.RequestError("audio must be a 1-D float tensor of 16 kHz samples", "audio")
    return value


def _json_list(entry: dict[str, Any], port: str) -> list[Any]:
    text = entry.get(port)
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if not isinstance(value, list):
        raise node.RequestError(f"{port} must be a JSON list", port)
    return value


class Live(node.StatelessNode):
    """start / hear / note / settle; see the module docstring."""

    sampling_rate = SAMPLE_RATE  # what a client's audio is resampled to for this walk (mstar_runtime.media)

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.max_attempts = int(spec.config.get("max_attempts", 1))
        self.max_samples = int(spec.config.get("max_audio_seconds", WINDOW_SECONDS) * SAMPLE_RATE)

    def phase_start(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            check_settings(entry, 0, self.max_attempts)  # the audio's length is checked as it arrives
            out.append({"heard": torch.zeros(0), "seek": 0, "cond": scalar(entry, "condition", bool),
                        "segs": "[]", "checks": "[]", "asked": entry.get("language")})
        return out

    def phase_hear(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            part, heard = _samples(entry, "samples"), _samples(entry, "heard")
            if heard.numel() + part.numel() > self.max_samples:
                raise node.RequestError(f"audio of more than {self.max_samples} samples "
                                        f"({self.max_samples / SAMPLE_RATE:g} s) is more than this model takes",
                                        "audio")
            if not bool(torch.isfinite(part).all()):
                raise node.RequestError("audio holds NaN or infinite samples", "audio")
            heard = torch.cat([heard, part.to(heard.device, torch.float32)])
            # `transcribe`'s rule: more than 3,000 frames (a few samples past 30 s are one window still)
            if heard.numel() // HOP > N_FRAMES and not scalar(entry, "timestamps", bool):
                raise node.RequestError("audio over 30 s is transcribed 30 s window by window, each starting at a "
                                        "timestamp the model wrote: it needs timestamps = true", "timestamps")
            ready = heard.numel() >= samples_for(scalar(entry, "seek", int))
            out.append({"heard": heard, "ready": int(ready), "idle": not ready})
        return out

    def phase_note(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            seek, nxt = scalar(entry, "seek", int), scalar(entry, "next", int)
            checks = _json_list(entry, "checks")
            before, after = _json_list(entry, "segs"), _json_list(entry, "next_segs")
            window = entry.get("window")
            if not isinstance(window, torch.Tensor) or window.dim() != 2:
                raise node.RequestError("window must be the window's features [mels, 3000]", "window")
            checks.append({"seek": seek, "segs": len(before), "cond": scalar(entry, "cond", bool),
                           "digest": digest(window)})
            new = after[len(before):]
            end = new[-1]["end"] if new else nxt * FRAME_SECONDS
            line = {"start": round(seek * FRAME_SECONDS, 2), "end": round(end, 2), "text": entry.get("text", "")}
            heard = _samples(entry, "heard")
            out.append({"seek": nxt, "cond": scalar(entry, "next_cond", bool), "segs": json.dumps(after),
                        "checks": json.dumps(checks), "idle": heard.numel() < samples_for(nxt),
                        "finished": nxt >= scalar(entry, "frames", int), "line": json.dumps(line) + "\n"})
        return out

    def phase_ids(self, batch: node.Batch) -> node.Batch:
        return [{"tokens": torch.tensor([t for s in _json_list(e, "segs") for t in s["tokens"]], dtype=torch.int32)}
                for e in batch]

    def phase_settle(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            mel, frames = entry.get("mel"), scalar(entry, "frames", int)
            if not isinstance(mel, torch.Tensor) or mel.dim() != 2 or mel.shape[1] != frames:
                raise node.RequestError(f"mel must be [mels, {frames}]", "mel")
            check_settings(entry, frames, self.max_attempts)
            seek, cond, segs, asked = (scalar(entry, "seek", int), scalar(entry, "cond", bool),
                                       _json_list(entry, "segs"), entry.get("asked"))
            for i, c in enumerate(_json_list(entry, "checks")):
                if digest(window_at(mel, c["seek"], frames)[0]) != c["digest"]:
                    seek, cond, segs = c["seek"], c["cond"], segs[: c["segs"]]
                    if i == 0:  # the first window detects the language: again
                        asked = entry.get("language")
                    break
            out.append({"seek": seek, "cond": cond, "segs": json.dumps(segs), "asked": asked,
                        "finished": seek >= frames})
        return out


__all__ = ["Live", "digest", "samples_for"]
