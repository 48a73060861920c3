"""Inputs people have at hand (issue 29, section 1): image files, WAV files, safetensors files,
PIL images and numpy arrays, the same way for every model, through `mstar_runtime.media`.

- The decoding itself: which file is which (by its bytes), how an image fits an `image`, a
  [H, W, 3] or a frames [N, H, W, 3] input, a WAV resampled to the walk's rate, and the
  errors (missing, undecodable, a kind that does not fit), each naming the input.
- The Python API: a PIL image, a numpy array and a path give what the tensor gives, on
  BAGEL (an `image` input) and Qwen3-Omni (a u8 [Hi, Wi, 3] and an f32 [A] input).
- The command line: `--input image=@photo.png`, `audio=@clip.wav`, `frames=@frame.png` on
  Qwen3-Omni and V-JEPA 2, and a batch line's "@FILE".
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from mstar_runtime import media
from mstar_runtime.api import MStar
from mstar_runtime.ops.node import RequestError
from mstarc.cli import main as mstarc
from tests.test_cli_run import mstar_run

ROOT = Path(__file__).resolve().parent.parent
IMAGE = {"kind": "image"}
PIXELS = {"kind": "tensor", "dtype": "u8", "dims": ["Hi", "Wi", 3]}
FRAMES = {"kind": "tensor", "dtype": "u8", "dims": ["N", "Hi", "Wi", 3]}
AUDIO = {"kind": "tensor", "dtype": "f32", "dims": ["A"]}
IDS = {"kind": "tensor", "dtype": "i32", "dims": ["N"]}


def picture(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def write_wav(path: Path, samples: np.ndarray, rate: int, channels: int = 1) -> None:
    pcm = (np.clip(samples, -1, 1) * 32767).round().astype("<i2")
    data = np.repeat(pcm[:, None], channels, axis=1).tobytes()
    path.write_bytes(b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt "
                     + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
                     + b"data" + struct.pack("<I", len(data)) + data)


def tone(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.5 * np.sin(2 * math.pi * hz * t)


def rate_16k() -> int:
    return 16000


# ----------------------------------------------------------------------------- the decoding
def test_an_image_file_fits_each_image_input(tmp_path: Path) -> None:
    px = picture(20, 30)
    Image.fromarray(px).save(tmp_path / "a.png")
    Image.fromarray(px).convert("L").save(tmp_path / "grey.png")
    for t, shape in ((IMAGE, (20, 30, 3)), (PIXELS, (20, 30, 3)), (FRAMES, (1, 20, 30, 3))):
        got = media.read_input_file("w", "x", t, tmp_path / "a.png", rate_16k)
        assert got.dtype == torch.uint8 and tuple(got.shape) == shape
        assert np.array_equal(got.reshape(20, 30, 3).numpy(), px)  # PNG is lossless
    grey = media.read_input_file("w", "x", IMAGE, tmp_path / "grey.png", rate_16k)
    assert tuple(grey.shape) == (20, 30, 3)  # converted to RGB


def test_values_at_hand_become_tensors(tmp_path: Path) -> None:
    px = picture(12, 16, 1)
    Image.fromarray(px).save(tmp_path / "b.png")
    for value in (Image.fromarray(px), px, str(tmp_path / "b.png"), tmp_path / "b.png", f"@{tmp_path / 'b.png'}"):
        got = media.to_walk_value("w", "x", IMAGE, value, rate_16k)
        assert torch.equal(got, torch.from_numpy(px)), type(value)
    frames = media.to_walk_value("w", "x", FRAMES, [Image.fromarray(px), tmp_path / "b.png"], rate_16k)
    assert tuple(frames.shape) == (2, 12, 16, 3)
    with pytest.raises(RequestError, match="frames of different sizes") as e:
        media.to_walk_value("w", "x", FRAMES, [Image.fromarray(px), Image.fromarray(picture(8, 8))], rate_16k)
    assert e.value.field == "x"
    samples = tone(0.1, 16000).astype(np.float32)
    assert torch.equal(media.to_walk_value("w", "a", AUDIO, samples, rate_16k), torch.from_numpy(samples))
    # not an image or tensor input, or not a value at hand: unchanged, for the type check to judge
    assert media.to_walk_value("w", "p", {"kind": "str"}, "a.png", rate_16k) == "a.png"
    assert media.to_walk_value("w", "x", IDS, [1, 2], rate_16k) == [1, 2]


def test_a_wav_file_is_resampled_to_the_walks_rate(tmp_path: Path) -> None:
    write_wav(tmp_path / "c.wav", tone(0.5, 48000), 48000, channels=2)
    got = media.read_input_file("w", "audio", AUDIO, tmp_path / "c.wav", rate_16k)
    assert got.dtype == torch.float32 and got.numel() == 8000  # 0.5 s at 16 kHz
    want = torch.from_numpy(tone(0.5, 16000)).float()
    assert (got[200:-200] - want[200:-200]).abs().max() < 2e-3  # the same tone, away from the edges
    asked = []
    media.read_input_file("w", "audio", AUDIO, tmp_path / "c.wav", lambda: asked.append(1) or 24000)
    assert asked == [1]


def test_a_safetensors_file_is_read_whatever_its_name(tmp_path: Path) -> None:
    save_file({"ids": torch.arange(5, dtype=torch.int32)}, str(tmp_path / "ids.bin"))
    got = media.read_input_file("w", "ids", IDS, tmp_path / "ids.bin", rate_16k)
    assert torch.equal(got, torch.arange(5, dtype=torch.int32))
    save_file({"a": torch.zeros(1), "b": torch.ones(1)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(RequestError, match="holds 2 tensors and none is named 'ids'"):
        media.read_input_file("w", "ids", IDS, tmp_path / "two.safetensors", rate_16k)


@pytest.mark.parametrize(("make", "t", "says"), [
    (None, IMAGE, "file '{p}' does not exist"),
    (b"not an image at all", IMAGE, "cannot read '{p}' as an image: not a readable image"),
    (b"RIFF\x10\x00\x00\x00WAVEjunk", AUDIO, "cannot read '{p}' as audio: "),
    ("wav", IMAGE, "'{p}' is a WAV file, but the input is a image"),
    ("wav", IDS, "'{p}' is a WAV file, but the input is a i32[N] tensor"),
    ("png", AUDIO, "would be read as an image, but the input is a f32[A] tensor"),
    ("dir", IMAGE, "cannot read '{p}': "),
])
def test_a_bad_file_is_an_error_naming_the_input(tmp_path: Path, make: Any, t: dict[str, Any], says: str) -> None:
    path = tmp_path / "input.file"
    if make == "wav":
        write_wav(path, tone(0.01, 16000), 16000)
    elif make == "png":
        Image.fromarray(picture(4, 4)).save(path, format="PNG")
    elif make == "dir":
        path.mkdir()
    elif make is not None:
        path.write_bytes(make)
    with pytest.raises(RequestError) as e:
        media.to_walk_value("walk", "field_x", t, str(path), rate_16k)
    assert e.value.field == "field_x"
    assert str(e.value).startswith("walk 'walk', input 'field_x': ")
    assert says.format(p=path) in str(e.value)


# ----------------------------------------------------------------------------- the models
def compile_tiny(model: str, out: Path) -> Path:
    plan = out / f"{model}.plan"
    assert mstarc(["compile", str(ROOT / f"models/{model}/{model}.walk"), "--variant", "tiny",
                   "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    return plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("plans")
    return {m: compile_tiny(m, out) for m in ("bagel", "qwen3_omni", "vjepa2")}


def test_the_api_takes_images_as_people_have_them(plans: dict[str, Path], tmp_path: Path) -> None:
    """BAGEL's `image` input and Qwen3-Omni's u8 [Hi, Wi, 3] one: a PIL image ("Could not infer
    dtype of Image" before), a numpy array and a path give the tensor's answer."""
    px = picture(40, 56, 3)
    Image.fromarray(px).save(tmp_path / "photo.png")
    tensor = torch.from_numpy(px)
    forms = (Image.fromarray(px), px, tmp_path / "photo.png", str(tmp_path / "photo.png"))
    with MStar.load(plans["bagel"]) as m:
        want = m.generate("understand", image=tensor, question="what?", max_length=4)["text"]
        for value in forms:
            assert m.generate("understand", image=value, question="what?", max_length=4)["text"] == want
    with MStar.load(plans["qwen3_omni"]) as m:
        ask = {"prompt": "what is it?", "max_tokens": 3, "temperature": 0.0}
        want = m.generate("chat", image=tensor, **ask)["text"]
        for value in forms:
            assert m.generate("chat", image=value, **ask)["text"] == want


def test_the_api_takes_a_wav_file_at_its_own_rate(plans: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-Omni's audio input reads 16 kHz: a 48 kHz WAV file is resampled to it."""
    write_wav(tmp_path / "clip.wav", tone(0.6, 48000), 48000)
    write_wav(tmp_path / "clip16.wav", tone(0.6, 16000), 16000)
    with MStar.load(plans["qwen3_omni"]) as m:
        assert m.input_rate("chat", "audio") == 16000
        ask = {"prompt": "what do you hear?", "max_tokens": 3, "temperature": 0.0}
        at_rate = media.read_input_file("chat", "audio", AUDIO, tmp_path / "clip.wav", lambda: 16000)
        want = m.generate("chat", audio=at_rate, **ask)["text"]
        assert m.generate("chat", audio=tmp_path / "clip.wav", **ask)["text"] == want
        assert m.generate("chat", audio=at_rate.numpy(), **ask)["text"] == want
        with pytest.raises(RequestError, match="input 'audio': file '.*missing.wav' does not exist") as e:
            m.submit("chat", {"prompt": "x", "audio": tmp_path / "missing.wav"})
        assert e.value.field == "audio"


def test_the_command_line_reads_files_for_every_model(plans: dict[str, Path], tmp_path: Path) -> None:
    Image.fromarray(picture(40, 56, 4)).save(tmp_path / "photo.png")
    Image.fromarray(picture(32, 32, 5)).save(tmp_path / "frame.png")
    write_wav(tmp_path / "clip.wav", tone(0.5, 22050), 22050)
    p = mstar_run(str(plans["qwen3_omni"]), "--walk", "chat", "--input", "prompt=hi", "--input",
                  f"image=@{tmp_path / 'photo.png'}", "--input", f"audio=@{tmp_path / 'clip.wav'}",
                  "--input", "max_tokens=2", "--out", str(tmp_path / "q"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "q" / "chat.text.txt").is_file()
    p = mstar_run(str(plans["vjepa2"]), "--walk", "encode", "--input", f"frames=@{tmp_path / 'frame.png'}",
                  "--out", str(tmp_path / "v"))
    assert p.returncode == 0, p.stderr
    record = json.loads((tmp_path / "v" / "encode.json").read_text())
    assert record["state"] == "finished"
    # a file that does not fit the input: one line naming it, exit 1
    p = mstar_run(str(plans["qwen3_omni"]), "--walk", "chat", "--input", "prompt=hi", "--input",
                  f"image=@{tmp_path / 'clip.wav'}", "--out", str(tmp_path / "bad"))
    assert p.returncode == 1 and "input 'image': " in p.stderr and "is a WAV file" in p.stderr
    assert "Traceback" not in p.stderr
    # a batch line's "@FILE"
    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"id": "look", "walk": "chat", "inputs": {
        "prompt": "hi", "image": f"@{tmp_path / 'photo.png'}", "audio": f"@{tmp_path / 'clip.wav'}",
        "max_tokens": 2}}) + "\n")
    p = mstar_run(str(plans["qwen3_omni"]), "--requests", str(lines), "--out", str(tmp_path / "b"))
    assert p.returncode == 0, p.stderr
