"""Whisper's log-mel features as a stateless node: `extract(audio) -> (mel, frames)`.

What `WhisperFeatureExtractor` computes (16 kHz, 30 s windows), written out here:

1. the waveform (float32) is zero-padded to `n_samples` = 480,000 samples when it is
   shorter (`WhisperFeatureExtractor`'s default call); longer audio is taken whole
   (its long-form call, `truncation=False, padding="longest"`);
2. a short-time Fourier transform: a periodic Hann window of `n_fft` = 400 samples, hop 160,
   centred frames (the signal reflect-padded by n_fft / 2 at both ends), so samples / 160 + 1
   frames of which the last is dropped (3,000 for a window); power = |STFT|^2 over the 201 frequency bins;
3. a mel filterbank [201, mels] of triangular filters on the Slaney mel scale (linear below
   1 kHz, logarithmic above) from 0 to 8 kHz, each scaled to unit area (Slaney norm),
   computed in float64 and used in float32;
4. log10 of max(mel power, 1e-10), floored at (the whole audio's maximum - 8), then (x + 4) / 4.

Output: `mel` float32 [mels, frames] per request and `frames` (3000, or samples // 160 for
audio over 30 s); the windows node (windows.py) cuts the 30 s windows out of it. An audio
input must be a non-empty 1-D float tensor of at most `max_audio_seconds` (config) of samples.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar_runtime.ops import node

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * WINDOW_SECONDS
N_FRAMES = N_SAMPLES // HOP  # 3000


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """The Slaney mel scale: 3 mels per 200 Hz below 1 kHz, then logarithmic (27 mels per ln 6.4)."""
    f = np.asarray(f, dtype=np.float64)
    mel = 3.0 * f / 200.0
    log_part = 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(f >= 1000.0, log_part, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    hz = 200.0 * m / 3.0
    log_part = 1000.0 * np.exp(np.log(6.4) * (m - 15.0) / 27.0)
    return np.where(m >= 15.0, log_part, hz)


def mel_filters(mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE, f_max: float = 8000.0) -> np.ndarray:
    """The [n_fft // 2 + 1, mels] float64 filterbank of step 3 of the module docstring."""
    bins = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(f_max)), mels + 2))
    widths = np.diff(edges)
    dist = edges[None, :] - bins[:, None]  # [bins, mels + 2]
    rising = -dist[:, :-2] / widths[:-1]
    falling = dist[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    return bank * (2.0 / (edges[2:] - edges[:-2]))[None, :]


def log_mel(audio: torch.Tensor, filters: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Waveforms [B, samples] float32 -> log-mel [B, mels, samples // 160] (steps 2 and 4)."""
    spec = torch.stft(audio, N_FFT, HOP, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = filters.T @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    floor = logs.amax(dim=(-2, -1), keepdim=True) - 8.0
    return (torch.maximum(logs, floor) + 4.0) / 4.0


class LogMel(node.StatelessNode):
    """extract(audio: f32[S]) -> (mel: f32[mels, F], frames: int); see the module docstring."""

    sampling_rate = SAMPLE_RATE  # what `mstar_runtime.media` resamples an audio file to for this walk

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        mels = spec.config.get("mels")
        if not isinstance(mels, int) or isinstance(mels, bool) or mels < 1:
            raise node.NodeError(f"node '{spec.name}': the config value mels must be a positive int, got {mels!r}")
        self.mels = mels
        seconds = spec.config.get("max_audio_seconds", WINDOW_SECONDS)
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < WINDOW_SECONDS:
            raise node.NodeError(f"node '{spec.name}': max_audio_seconds must be a number >= {WINDOW_SECONDS}, "
                                 f"got {seconds!r}")
        self.max_samples = int(seconds * SAMPLE_RATE)
        self.register_buffer("filters", torch.from_numpy(mel_filters(mels)).to(torch.float32), persistent=False)
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.to(device=spec.device)

    def phase_extract(self, batch: node.Batch) -> node.Batch:
        dev = self.filters.device
        short = torch.zeros(len(batch), N_SAMPLES, dtype=torch.float32, device=dev)
        long: dict[int, torch.Tensor] = {}
        for i, entry in enumerate(batch):
            audio = entry.get("audio")
            if not isinstance(audio, torch.Tensor) or audio.dim() != 1 or not audio.is_floating_point():
                raise node.RequestError("audio must be a 1-D float tensor of 16 kHz samples", "audio")
            if audio.numel() == 0:
                raise node.RequestError("audio is empty: there is nothing to transcribe", "audio")
            if audio.numel() > self.max_samples:
                raise node.RequestError(f"audio of {audio.numel()} samples ({audio.numel() / SAMPLE_RATE:.2f} s) is "
                                        f"longer than the {self.max_samples / SAMPLE_RATE:g} s this model takes "
                                        f"({self.max_samples} samples)", "audio")
            if not bool(torch.isfinite(audio).all()):
                raise node.RequestError("audio holds NaN or infinite samples", "audio")
            if audio.numel() > N_SAMPLES:
                long[i] = audio.to(device=dev, dtype=torch.float32)
            else:
                short[i, : audio.numel()] = audio.to(short)
        shorts = [i for i in range(len(batch)) if i not in long]
        mels: list[torch.Tensor] = [short[0]] * len(batch)
        if shorts:
            for i, m in zip(shorts, log_mel(short[shorts], self.filters, self.window).unbind(0), strict=True):
                mels[i] = m
        for i, audio in long.items():  # each its own length: one transform each
            mels[i] = log_mel(audio[None], self.filters, self.window)[0]
        return [{"mel": m, "frames": int(m.shape[1])} for m in mels]
