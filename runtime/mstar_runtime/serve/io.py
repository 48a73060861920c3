"""Walk values on the wire: audio as WAV or 16-bit PCM, images as PNG, tensors as JSON lists.

Audio is 16-bit little-endian mono PCM at the plan's `sample_rate` (default 24000), clamped to
[-1, 1] exactly as `outputs.write_wav` writes files. A streamed WAV cannot know its length
when its header goes out, so its RIFF and data sizes are 0xFFFFFFFF ("until the end of the
stream"), which players and `wave`-style readers accept; a complete WAV has exact sizes.

Images come in as base64 (optionally a `data:image/...;base64,` URL) or file bytes, and go
in to a walk as the RGB uint8 `[H, W, 3]` tensor the `image` type means. An image output
goes out as PNG: uint8 as is, floats clamped to [0, 1]; `[H, W]`, `[H, W, C]` or `[C, H, W]`.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
from collections.abc import Mapping
from typing import Any

import torch

from mstar_runtime.media import decode_image  # shared with the CLI and the API
from mstar_runtime.outputs import DEFAULT_SAMPLE_RATE, is_audio_name, jsonable

STREAMING_SIZE = 0xFFFFFFFF
_INT = re.compile(r"^[+-]?[0-9]+$")


def form_value(kind: str | None, text: str) -> Any:
    """A multipart form field's text as a walk input of `kind` ("int", "float", "bool") wants it,
    where it reads as one; otherwise the text as sent, which the input's check then refuses by name."""
    stripped = text.strip()
    if kind == "int" and _INT.match(stripped):
        return int(stripped)
    if kind == "float":
        try:
            return float(stripped)
        except ValueError:
            return text
    if kind == "bool" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    return text


def sample_rate(config: Mapping[str, Any]) -> int:
    rate = config.get("sample_rate", DEFAULT_SAMPLE_RATE)
    return int(rate) if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0 else DEFAULT_SAMPLE_RATE


def pcm16(samples: Any) -> bytes:
    """Float samples as 16-bit little-endian PCM bytes (what `write_wav` would store)."""
    if not isinstance(samples, torch.Tensor) or samples.numel() == 0:
        return b""
    flat = samples.detach().to("cpu", torch.float32).reshape(-1)
    pcm = (flat.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return pcm.numpy().astype("<i2").tobytes()


def wav_header(rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header; `data_bytes=None` for a stream of unknown length."""
    if data_bytes is None:
        riff, data = STREAMING_SIZE, STREAMING_SIZE
    else:
        riff, data = 36 + data_bytes, data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def png_bytes(image: torch.Tensor) -> bytes:
    from PIL import Image

    array = image.detach().to("cpu")
    if array.dim() == 3 and array.shape[0] in (1, 3, 4) and array.shape[2] not in (1, 3, 4):
        array = array.permute(1, 2, 0)  # CHW, as vision code often leaves it
    if array.dtype != torch.uint8:
        array = (array.float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
    if array.dim() == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.dim() not in (2, 3):
        raise ValueError(f"an image must be [H, W], [H, W, C] or [C, H, W], got shape {list(image.shape)}")
    buf = io.BytesIO()
    Image.fromarray(array.contiguous().numpy()).save(buf, format="PNG")
    return buf.getvalue()


def decode_image_text(text: str) -> torch.Tensor:
    """A base64 image or a `data:image/...;base64,` URL (never a URL to fetch)."""
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or ";base64" not in head:
            raise ValueError("a data URL must be base64: data:image/png;base64,...")
    elif "://" in text:
        raise ValueError("images must be inline (base64 or a data: URL); this server fetches no URLs")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64") from None
    return decode_image(raw)


def is_image_output(name: str, declared: Mapping[str, Any] | None) -> bool:
    kind = (declared or {}).get("kind")
    return kind == "image" or name in ("image", "images", "pixels", "picture")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def wire_value(name: str, value: Any, declared: Mapping[str, Any] | None, rate: int) -> Any:
    """An output value as JSON for the native route: audio as base64 PCM, images as base64
    PNG (both as `{"encoding", "data", ...}`), tensors as lists, non-finite floats as strings."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 1 and is_audio_name(name):
        return {"encoding": "pcm_s16le_base64", "sample_rate": rate, "samples": int(value.numel()),
                "data": b64(pcm16(value))}
    if isinstance(value, torch.Tensor) and is_image_output(name, declared) and value.dim() in (2, 3):
        return {"encoding": "png_base64", "data": b64(png_bytes(value))}
    return jsonable(value)


__all__ = ["b64", "decode_image", "decode_image_text", "is_image_output", "pcm16", "png_bytes", "sample_rate",
           "wav_header", "wire_value"]
