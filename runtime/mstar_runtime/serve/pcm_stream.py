"""Audio that arrives in pieces of a request body, as float32 mono samples: the body of the
native route's streamed input (`serve.live`).

- `audio/wav` (also `audio/x-wav`, `audio/wave`): a WAV stream: the RIFF header with its
  `fmt ` chunk, then the `data` chunk read to the end of the body (a streaming writer leaves
  its size at 0 or 0xFFFFFFFF, so the size is not trusted); 16-bit integer or 32-bit float
  PCM, any channel count (averaged to mono), a rate of `MIN_RATE` to `MAX_RATE` Hz.
- `audio/pcm`, `audio/l16` or `application/octet-stream`: raw little-endian mono samples,
  `s16le` (the default) or `f32le`, at the rate the route's `rate` parameter gives.

`PcmStream.push(data)` returns the samples the bytes so far complete (a sample cut between
two pieces waits for the next), `close()` checks that the body did not end inside a header or
a sample. Each problem is a ValueError saying what is wrong; `rate` is known once the header
is read (`ready`).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from mstar_runtime.media import MAX_RATE, MIN_RATE

WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
RAW_TYPES = frozenset({"audio/pcm", "audio/l16", "application/octet-stream"})
RAW_FORMATS = {"s16le": ("<i2", 2.0**15), "f32le": ("<f4", None)}
MAX_HEADER = 1 << 16  # a WAV header (chunks before `data`) longer than this is refused, not buffered
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


class PcmStream:
    """A body's audio, piece by piece (module docstring)."""

    def __init__(self, content_type: str, fmt: str | None = None, rate: int | None = None):
        self.wav = content_type in WAV_TYPES
        if not self.wav and content_type not in RAW_TYPES:
            raise ValueError(f"Content-Type {content_type or '(none)'} is not read; send audio/wav or raw "
                             f"samples as one of {', '.join(sorted(RAW_TYPES))}")
        if self.wav and (fmt is not None or rate is not None):
            raise ValueError("format and rate are for raw samples: a WAV stream's header gives them")
        self.rate: int | None = None
        self.channels = 1
        self._held = b""  # bytes not decoded yet: the header so far, or a sample cut between pieces
        if not self.wav:
            name = fmt or "s16le"
            if name not in RAW_FORMATS:
                raise ValueError(f"format {name!r} is not read; one of {', '.join(RAW_FORMATS)}")
            self.kind, self.scale = RAW_FORMATS[name]
            self.rate = 16000 if rate is None else rate
            if not MIN_RATE <= self.rate <= MAX_RATE:
                raise ValueError(f"rate is {self.rate} Hz; {MIN_RATE} to {MAX_RATE} Hz are read")

    @property
    def ready(self) -> bool:
        return self.rate is not None

    def push(self, data: bytes) -> torch.Tensor:
        self._held += data
        if not self.ready and not self._header():
            return torch.zeros(0)
        width = np.dtype(self.kind).itemsize * self.channels
        cut = len(self._held) - len(self._held) % width
        raw, self._held = self._held[:cut], self._held[cut:]
        values = np.frombuffer(raw, dtype=np.dtype(self.kind)).astype(np.float64)
        if self.scale:
            values = values / self.scale
        mono = values.reshape(-1, self.channels).mean(axis=1)
        if not np.isfinite(mono).all():
            raise ValueError("the audio holds NaN or infinite samples")
        return torch.from_numpy(np.clip(mono, -1.0, 1.0).astype(np.float32))

    def close(self) -> None:
        if not self.ready:
            raise ValueError("the body ended inside the WAV header (no data chunk)" if self._held
                             else "the body is empty: no audio")
        if self._held:
            raise ValueError(f"the body ends inside a sample ({len(self._held)} bytes left over)")

    def _header(self) -> bool:
        """Parse the WAV header once it is all there: True, with the data's first bytes held."""
        data = self._held
        if len(data) >= 12 and (data[:4] != b"RIFF" or data[8:12] != b"WAVE"):
            raise ValueError("not a WAV stream (no RIFF/WAVE header)")
        at, fmt = 12, None
        while at + 8 <= len(data):
            cid, size = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
            if cid == b"data":
                if fmt is None:
                    raise ValueError("the WAV data chunk comes before its fmt chunk")
                self._format(fmt)
                self._held = data[at + 8:]
                return True
            if at + 8 + size > len(data):
                break  # this chunk is still arriving
            if cid == b"fmt ":
                fmt = data[at + 8:at + 8 + size]
            at += 8 + size + (size & 1)
        if len(data) > MAX_HEADER:
            raise ValueError(f"no WAV data chunk in the first {MAX_HEADER} bytes")
        return False

    def _format(self, body: bytes) -> None:
        if len(body) < 16:
            raise ValueError("the WAV fmt chunk is truncated")
        code, channels, rate, _, align, bits = struct.unpack("<HHIIHH", body[:16])
        if code == _EXTENSIBLE and len(body) >= 26:
            code = struct.unpack("<H", body[24:26])[0]
        kind = {(_PCM, 16): ("<i2", 2.0**15), (_FLOAT, 32): ("<f4", None)}.get((code, bits))
        if kind is None:
            raise ValueError(f"the WAV holds {bits}-bit audio of format code {code}; a stream is read as "
                             "16-bit integer or 32-bit float PCM")
        if channels < 1 or align != channels * bits // 8:
            raise ValueError(f"the WAV fmt chunk is inconsistent ({channels} channels, {bits} bits, block {align})")
        if not MIN_RATE <= rate <= MAX_RATE:
            raise ValueError(f"the WAV sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} Hz are read")
        self.kind, self.scale = kind
        self.channels, self.rate = channels, rate


__all__ = ["RAW_FORMATS", "RAW_TYPES", "WAV_TYPES", "PcmStream"]
