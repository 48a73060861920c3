"""Orpheus end to end on CPU (tiny, random weights): text -> codes -> streamed SNAC windows -> WAV.

- `mstar-run --walk tts` writes a 24 kHz mono 16-bit WAV whose length is 2048 samples per
  released sliding(28, 7) window of the codes the backbone generated;
- chunks stream out while the backbone is still decoding;
- 16 concurrent requests through the batch CLI give the same audio as each one alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from support import compile_model

from mstar_runtime.api import MStar

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # a shared 2-core box: threaded torch only thrashes


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_model(tmp_path_factory.mktemp("orpheus") / "orpheus-tiny.plan", "orpheus")


def _windows(n_codes: int) -> int:
    return max(0, (n_codes - 28) // 7 + 1)


def _wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def test_one_shot_writes_a_24khz_wav_of_the_generated_frames(plan: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mstar_runtime.cli", str(plan), "--walk", "tts",
                           "--input", "text=Hello there, this is M star speaking.", "--input", "voice=tara",
                           "--input", "max_tokens=100", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    samples = _wav(tmp_path / "tts.audio.wav")
    codes = json.loads((tmp_path / "tts.codes.json").read_text())
    codes = codes["value"] if isinstance(codes, dict) else codes
    assert len(codes) >= 28
    assert len(samples) == 2048 * _windows(len(codes))
    assert np.abs(samples).max() > 0  # real audio, not silence


def test_chunks_stream_while_the_backbone_decodes(plan: Path) -> None:
    with MStar.load(plan) as m:
        h = m.submit("tts", {"text": "Streaming speech, chunk by chunk.", "max_tokens": 90})
        chunks = [v for name, v in h.stream() if name == "audio"]
        out = h.result()
    assert len(chunks) == _windows(len(out["codes"])) >= 2
    assert all(c.shape == (2048,) for c in chunks)
    assert np.array_equal(np.concatenate([c.numpy() for c in chunks]), out["audio"].numpy())


def test_sixteen_concurrent_requests_equal_each_alone(plan: Path, tmp_path: Path) -> None:
    texts = [f"Sentence number {i}, spoken by M star." for i in range(16)]
    voices = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    lines = [{"id": f"r{i}", "walk": "tts", "inputs": {"text": t, "voice": voices[i % 8], "max_tokens": 40 + 3 * i,
                                                     "seed": i, "temperature": 0.6}}
             for i, t in enumerate(texts)]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "mstar_runtime.cli", str(plan), "--requests", str(batch),
                           "--out", str(tmp_path / "batch")], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "batch" / "summary.json").read_text())
    assert summary["finished"] == 16 and summary["failed"] == 0
    with MStar.load(plan) as m:
        for line in lines[::5]:  # each alone, one at a time: 4 of the 16 keep the test short
            alone = m.submit("tts", line["inputs"]).result()["audio"].numpy()
            together = _wav(tmp_path / "batch" / f"{line['id']}.audio.wav")
            expected = np.round(np.clip(alone, -1, 1) * 32767).astype("<i2")
            assert len(together) == len(expected)
            assert np.abs(together.astype(int) - expected.astype(int)).max() <= 1  # int16 rounding
