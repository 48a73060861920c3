"""Walk outputs as real files: WAV for audio, PNG for images, text, JSON, safetensors for latents.

`write_outputs` picks a format per output from its value and the walk's declared type:

| value | file |
|---|---|
| 1-D float tensor whose name says audio (`audio`, `pcm`, `wav`, `speech`, `waveform`) | `.wav`: 16-bit PCM mono at `plan_config["sample_rate"]` (default 24000), clamped to [-1, 1] |
| declared `image`, or a 3-D uint8 tensor [H, W, C] with C in 1, 3, 4 | `.png` (Pillow) |
| `str` | `.txt` (UTF-8) |
| integer or bool tensor, Python scalar | `.json` (nested lists) |
| any other float tensor (latents, hidden states) | `.safetensors`, the tensor under the output's name |

Files are named `<request_id>.<output>.<ext>`, plus `<request_id>.json`: the request's walk,
state, error, field, finish reason, timings, step counts and the list of files. It is written
for failed requests too, so a batch run leaves one record per request. Request ids come from
clients: they are sanitised for the file system (an id that had to change gets a short hash
so two ids never map to one name).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import wave
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

DEFAULT_SAMPLE_RATE = 24000
_AUDIO_NAME = re.compile(r"(^|[_\-.])(audio|pcm|wav|speech|waveform)($|[_\-.0-9])", re.IGNORECASE)
# no '.': a request's files are <stem>.json and <stem>.<output>.<ext>, so a stem with a dot
# ('x.codes') would name a file of another request's ('x')
_SAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_NAME = 100


def safe_name(text: str, reserved: Collection[str] = ()) -> str:
    """A file-name-safe form of a client-chosen id: no separators, no dot, bounded length; never
    one of `reserved` (a file the run writes itself: a batch's `summary`)."""
    clean = _SAFE.sub("_", text)[:_MAX_NAME] or "request"
    # two ids that sanitise alike ('a/b', 'a_b') must not overwrite each other, nor an id the run's own file
    if clean != text or clean in reserved:
        clean = f"{clean}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
    return clean


def is_audio_name(name: str) -> bool:
    return bool(_AUDIO_NAME.search(name))


def file_kind(name: str, value: Any, declared: Mapping[str, Any] | None) -> str:
    """One of wav, png, txt, json, safetensors for an output value."""
    kind = declared.get("kind") if declared else None
    if isinstance(value, str):
        return "txt"
    if not isinstance(value, torch.Tensor):
        return "json"
    if kind == "image" or (value.dtype == torch.uint8 and value.dim() == 3 and value.shape[2] in (1, 3, 4)):
        return "png"
    if value.is_floating_point():
        return "wav" if value.dim() == 1 and is_audio_name(name) else "safetensors"
    return "json"  # integer, bool and complex-free tensors: token ids, codes, flags


def write_wav(path: Path, samples: torch.Tensor, sample_rate: int) -> None:
    pcm = (samples.detach().to("cpu", torch.float32).clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        # WAV is little-endian whatever the host is
        w.writeframes(pcm.numpy().astype("<i2").tobytes())


def write_png(path: Path, image: torch.Tensor) -> None:
    from PIL import Image  # imported here: only image outputs need Pillow

    array = image.detach().to("cpu")
    if array.dtype != torch.uint8:  # a float image in [0, 1]
        array = (array.float().clamp(0, 1) * 255).round().to(torch.uint8)
    if array.dim() == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    Image.fromarray(array.contiguous().numpy()).save(path, format="PNG")


def write_safetensors(path: Path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import save

    # Written by Python as the other kinds are: safetensors' own save_file creates its file
    # mode 0600 whatever the umask, so a latent would be private where the WAV beside it is not.
    path.write_bytes(save({name: tensor.detach().to("cpu").contiguous()}))


def jsonable(value: Any) -> Any:
    """Tensors as nested lists, non-finite floats as strings (JSON has no NaN)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu")
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def write_output(out_dir: Path, stem: str, name: str, value: Any, declared: Mapping[str, Any] | None,
                 sample_rate: int) -> Path:
    kind = file_kind(name, value, declared)
    path = out_dir / f"{stem}.{safe_name(name)}.{kind}"
    if kind == "wav":
        write_wav(path, value, sample_rate)
    elif kind == "png":
        write_png(path, value)
    elif kind == "safetensors":
        write_safetensors(path, name, value)
    elif kind == "txt":
        path.write_text(value, encoding="utf-8")
    else:
        path.write_text(json.dumps(jsonable(value)) + "\n", encoding="utf-8")
    return path


def output_order(walk_program: Mapping[str, Any], outputs: Mapping[str, Any]) -> list[str]:
    """Declared outputs in the walk's order, then any others (a transition's walk) by name:
    the order of the files, whatever order the outputs were produced in."""
    declared = [o["name"] for o in walk_program.get("outputs", []) if o["name"] in outputs]
    return declared + sorted(set(outputs) - set(declared))


def write_outputs(
    out_dir: str | Path,
    request_id: str,
    walk_program: Mapping[str, Any],
    outputs: Mapping[str, Any],
    plan_config: Mapping[str, Any],
    *,
    summary: Mapping[str, Any] | None = None,
    reserved: Collection[str] = (),
) -> list[Path]:
    """Write every output of one request, then its `<request_id>.json` record; returns the paths
    (output files first, in `output_order`, the record last).

    `summary` is what the record says about the request beyond its files (the API's
    `RequestHandle.summary()`: state, error, field, finish_reason, timings, steps, ...).
    `reserved`: file stems the caller writes itself (`safe_name`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = safe_name(request_id, reserved)
    declared = {o["name"]: o.get("type") for o in walk_program.get("outputs", [])}
    rate = int(plan_config.get("sample_rate", DEFAULT_SAMPLE_RATE))
    paths = [write_output(out, stem, name, outputs[name], declared.get(name), rate)
             for name in output_order(walk_program, outputs)]
    record: dict[str, Any] = {"id": request_id, "walk": walk_program.get("walk")}
    record.update(jsonable(dict(summary or {})))
    record["files"] = [p.name for p in paths]
    meta = out / f"{stem}.json"
    meta.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return [*paths, meta]


__all__ = ["DEFAULT_SAMPLE_RATE", "file_kind", "is_audio_name", "output_order", "safe_name", "write_outputs"]
