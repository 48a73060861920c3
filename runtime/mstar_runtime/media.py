"""Images and audio as walk inputs: the one decoding path of the command line (`--input
NAME=@FILE`, a batch line's `"@FILE"`), the Python API (`MStar.submit`) and the server's
image and WAV decoding.

What a walk input takes, by its declared type (`to_walk_value`):

- an `image` input, a uint8 tensor `[H, W, 3]` (Qwen3-Omni's `image`) or `[N, H, W, 3]`
  (V-JEPA 2's frames: one image is one frame, a list of images of one size is N frames):
  a PIL image (converted to RGB), a numpy array, a torch tensor, or a file path (PNG, JPEG
  or another format Pillow reads; a `.safetensors` file too);
- a float tensor `[A]` (an audio input: Qwen3-Omni's `audio`): samples as a numpy array or
  tensor (at the walk's rate: the caller's), or a path to a WAV file, decoded to mono and
  resampled to the rate the walk reads (`input_rate`);
- any tensor: a numpy array, or a path to a `.safetensors` file (the tensor named as the
  input, or its only one).

A path is a `str` or `os.PathLike`; on the command line and in batch lines it is written
`@FILE` (a leading `@` is dropped in the API too). What a file holds is read from its
bytes, not its name: a WAV header, a safetensors header, else an image. Problems are a
`RequestError` naming the input: a missing, unreadable or undecodable file, a file whose
kind does not fit the input (`'clip.wav' is audio, but input 'image' takes an image`).
Files are read as regular files only, at most `MAX_FILE_BYTES` (`untrusted.read_file`).

Images (`decode_image`): at most `MAX_IMAGE_PIXELS` pixels (a decompression-bomb guard).
Audio (`decode_wav`, `resample`): a WAV file of integer PCM (8, 16, 24 or 32 bits) or IEEE
float (32 or 64 bits), plain or WAVE_FORMAT_EXTENSIBLE, any number of channels (averaged to
mono), at 4 to 384 kHz. Other rates than the walk's are resampled by a band-limited
interpolation: a Kaiser-windowed sinc low-pass at 0.99 of the lower Nyquist frequency, 16
zero crossings each side, every output phase's taps normalised to unit sum (so a constant
stays constant). A data size of 0xFFFFFFFF or past the end of the file (a
streamed WAV's header) means "to the end".

Imports no server code: the command line and the API use it without the `serve` extra.
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar_runtime import untrusted
from mstar_runtime.ops.node import RequestError

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decompression-bomb guard for images from a client or a file
MAX_FILE_BYTES = 1 << 32  # an input file read whole: 4 GiB
DEFAULT_INPUT_RATE = 16000  # an audio input's rate when its node names none (Whisper-style encoders')
WAV, SAFETENSORS, IMAGE = "audio", "tensors", "an image"


# ----------------------------------------------------------------------------- images in
def decode_image(data: bytes) -> torch.Tensor:
    """File bytes (PNG, JPEG, ...) as an RGB uint8 [H, W, 3] tensor; ValueError if unreadable."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"the image is {img.width}x{img.height}; at most {MAX_IMAGE_PIXELS} pixels")
            rgb = img.convert("RGB")
    except UnidentifiedImageError:  # its text is a repr of the buffer ("<_io.BytesIO object at 0x...>")
        raise ValueError("not a readable image (PNG, JPEG, or another format Pillow reads)") from None
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a readable image: {e}") from None
    import numpy as np

    return torch.from_numpy(np.array(rgb, dtype=np.uint8))



# ----------------------------------------------------------------------------- audio in
MIN_RATE, MAX_RATE = 4000, 384000
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
ZERO_CROSSINGS = 16  # of the interpolating sinc, each side
ROLLOFF = 0.99  # the low-pass edge, as a fraction of the lower Nyquist frequency
KAISER_BETA = 8.6  # about 80 dB stop-band attenuation


def decode_wav(data: bytes) -> tuple[torch.Tensor, int]:
    """A WAV file as float32 mono samples in [-1, 1] and its sample rate (module docstring);
    ValueError, saying what is wrong, for anything else."""
    import numpy as np

    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a WAV file (no RIFF/WAVE header)")
    fmt: tuple[int, int, int, int, int] | None = None
    at = 12
    while at + 8 <= len(data):
        cid, size = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
        body = data[at + 8:at + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                raise ValueError("the WAV fmt chunk is truncated")
            code, channels, rate, _, align, bits = struct.unpack("<HHIIHH", body[:16])
            if code == _EXTENSIBLE and len(body) >= 26:
                code = struct.unpack("<H", body[24:26])[0]  # the sub-format GUID's first two bytes
            fmt = (code, channels, rate, align, bits)
        elif cid == b"data":
            if fmt is None:
                raise ValueError("the WAV data chunk comes before its fmt chunk")
            break
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    else:
        raise ValueError("the WAV file has no data chunk")
    code, channels, rate, align, bits = fmt
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"the WAV sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} Hz are read")
    if channels < 1 or align != channels * ((bits + 7) // 8):
        raise ValueError(f"the WAV fmt chunk is inconsistent ({channels} channels, {bits} bits, block {align})")
    kinds = {(_PCM, 8): "u1", (_PCM, 16): "<i2", (_PCM, 24): "i3", (_PCM, 32): "<i4", (_FLOAT, 32): "<f4",
             (_FLOAT, 64): "<f8"}
    kind = kinds.get((code, bits))
    if kind is None:
        what = {_PCM: "integer PCM", _FLOAT: "float"}.get(code, f"format code {code}")
        raise ValueError(f"the WAV holds {bits}-bit {what} audio; 8/16/24/32-bit PCM or 32/64-bit float are read")
    raw = body[: len(body) - len(body) % align]  # a streamed header's size runs past the end: to the end
    if kind == "i3":  # no numpy dtype: sign-extend three little-endian bytes
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
        samples = ints.astype(np.float64) / 2.0**23
    else:
        arr = np.frombuffer(raw, dtype=np.dtype(kind)).astype(np.float64)
        scale = {"u1": 128.0, "<i2": 2.0**15, "<i4": 2.0**31}.get(kind)
        samples = (arr - 128.0) / 128.0 if kind == "u1" else arr / scale if scale else arr
    mono = samples.reshape(-1, channels).mean(axis=1)
    if mono.size == 0:
        raise ValueError("the WAV holds no samples")
    if not np.isfinite(mono).all():
        raise ValueError("the WAV holds NaN or infinite samples")
    return torch.from_numpy(np.clip(mono, -1.0, 1.0).astype(np.float32)), int(rate)


def resample(x: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    """1-D samples at `orig` Hz as samples at `new` Hz (module docstring): ceil(len * new / orig)
    of them, output sample m at input time m * orig / new. Memory is the input, the output and
    one block of BLOCK_ENTRIES taps, whatever the two rates (a rational up / down filter bank
    would hold up x down taps: 5 GB for 44,101 Hz to 16 kHz)."""
    if orig == new or x.numel() == 0:
        return x
    g = math.gcd(orig, new)
    up, down = new // g, orig // g
    cutoff = ROLLOFF * min(1.0, up / down) / 2  # cycles per input sample
    width = math.ceil(ZERO_CROSSINGS / (2 * cutoff))
    span = 2 * width + 2  # input offsets -width .. width + 1 around an output's input index
    n_out = -(-x.numel() * up // down)
    padded = torch.nn.functional.pad(x.to(torch.float32), (width, width + 2))  # input n is padded[n + width]
    out = torch.empty(n_out, dtype=torch.float32)
    # output m = k * up + i (phase i) sits at input index k * down + (i * down) // up plus the
    # fraction ((i * down) % up) / up: one phase's outputs are a strided window of the input
    # times that phase's taps; the taps are computed for a block of phases at a time
    block = max(1, BLOCK_ENTRIES // span)
    for first in range(0, min(up, n_out), block):
        phases = torch.arange(first, min(first + block, up, n_out), dtype=torch.int64)
        taps = _taps(phases * down % up, up, width, cutoff).to(torch.float32)  # float32: several times faster
        for i, w in zip(phases.tolist(), taps, strict=True):
            count = -(-(n_out - i) // up)
            start = i * down // up
            windows = padded[start:start + (count - 1) * down + span].unfold(0, span, down)  # [count, span], a view
            out[i::up] = windows @ w
    return out


BLOCK_ENTRIES = 1 << 20  # taps the resampler holds at once (8 MB in float64)


def _taps(numer: torch.Tensor, up: int, width: int, cutoff: float) -> torch.Tensor:
    """The Kaiser-windowed sinc of output samples whose input time is an input index plus
    numer / up: [n, 2 * width + 2] weights over offsets -width .. width + 1 from that index
    (zero beyond `width` of the time), each row normalised to unit sum."""
    t = torch.arange(-width, width + 2, dtype=torch.float64)[None, :] - (numer.to(torch.float64) / up)[:, None]
    window = torch.special.i0(KAISER_BETA * (1 - (t / width) ** 2).clamp(min=0).sqrt())
    taps = torch.where(t.abs() <= width, 2 * cutoff * torch.sinc(2 * cutoff * t) * window, 0.0)
    return taps / taps.sum(dim=1, keepdim=True)



# ----------------------------------------------------------------------------- the rate a walk reads
def node_input_rate(node: Any) -> int:
    """The sample rate a node reads its audio at: its `sampling_rate`, or its `features`'
    (Qwen3-Omni's processor: from the checkpoint's preprocessor_config.json), else
    DEFAULT_INPUT_RATE."""
    for source in (node, getattr(node, "features", None)):
        rate = getattr(source, "sampling_rate", None)
        if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0:
            return rate
    return DEFAULT_INPUT_RATE


def first_call_on(program: Mapping[str, Any], var: str) -> Mapping[str, Any] | None:
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
        stack[:0] = [v for k, v in op.items() if k in ("body", "branches", "then", "else") and v]
    return None


def input_rate(plan: Any, walk: str, name: str, weights: str | os.PathLike[str] = "dummy") -> int:
    """The sample rate walk input `name` is read at: that of the node its first call passes it
    to, or for a streamed input the node its stream feeds (`node_input_rate`), from a copy
    built on the CPU when the node is a parameter-free stateless one (a processor), else
    DEFAULT_INPUT_RATE. The server's chat route reads the same rule off its own copy of the
    prompt node."""
    from mstar_runtime.weights import build_node, load_weights

    program = plan.walk(walk)
    call = first_call_on(program, name)
    sid = next((p.get("stream") for p in program["inputs"] if p["name"] == name), None)
    # a stream id is `<walk>:<walk>.<input>-><node>.<port>`
    target = call["node"] if call is not None else sid.split("->", 1)[1].split(".", 1)[0] if sid else None
    if target is None or plan.node(target).engine != "stateless":
        return DEFAULT_INPUT_RATE
    node = build_node(plan, target, plan.node(target).ranks[0], "cpu")
    if any(True for _ in node.parameters()) or any(True for _ in node.buffers()):
        return DEFAULT_INPUT_RATE
    load_weights(node, plan, target, str(weights))
    return node_input_rate(node)


class InputRates:
    """`input_rate` of each (walk, input) of one plan, computed when first asked (it builds a
    node copy) and kept."""

    def __init__(self, plan: Any, weights: str | os.PathLike[str] = "dummy"):
        self.plan, self.weights = plan, weights
        self._rates: dict[tuple[str, str], int] = {}

    def __call__(self, walk: str, name: str) -> int:
        key = (walk, name)
        if key not in self._rates:
            self._rates[key] = input_rate(self.plan, walk, name, self.weights)
        return self._rates[key]


# ----------------------------------------------------------------------------- walk inputs
def _bad(walk: str, name: str, message: str) -> RequestError:
    return RequestError(f"walk '{walk}', input '{name}': {message}", name)


def _describe(t: Mapping[str, Any]) -> str:
    if t["kind"] != "tensor":
        return t["kind"]
    return f"{t['dtype']}[{', '.join(str(d) for d in t['dims'])}] tensor"


def _is_image_type(t: Mapping[str, Any]) -> bool:
    """An `image`, or a uint8 tensor of RGB pixels: [H, W, 3] or frames [N, H, W, 3]."""
    if t["kind"] == "image":
        return True
    dims = t.get("dims") or []
    return t["kind"] == "tensor" and t.get("dtype") == "u8" and len(dims) in (3, 4) and dims[-1] == 3


def _is_audio_type(t: Mapping[str, Any]) -> bool:
    return t["kind"] == "tensor" and t.get("dtype") in ("f32", "f16", "bf16") and len(t.get("dims") or []) == 1


def _sniff(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return WAV
    if len(data) >= 10:  # safetensors: an 8-byte little-endian header length, then a JSON object
        n = struct.unpack("<Q", data[:8])[0]
        if 2 <= n <= len(data) - 8 and data[8:9] == b"{":
            return SAFETENSORS
    return IMAGE


def read_input_file(walk: str, name: str, t: Mapping[str, Any], path: str | os.PathLike[str],
                    rate: Callable[[], int]) -> torch.Tensor:
    """Input `name`'s value from the file `path` (module docstring); `rate()` gives the walk's
    audio rate and is called only for a WAV file."""
    path = Path(path)
    try:
        data = untrusted.read_file(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise _bad(walk, name, f"file '{path}' does not exist") from None
    except untrusted.FileTooLarge as e:
        raise _bad(walk, name, f"file '{path}' is {e.size} bytes; at most {e.cap} are read") from None
    except OSError as e:
        raise _bad(walk, name, f"cannot read '{path}': {e.strerror or e}") from None
    kind = _sniff(data)
    if kind == SAFETENSORS:
        return _safetensors(walk, name, path, data)
    if kind == WAV:
        if not _is_audio_type(t):
            raise _bad(walk, name, f"'{path}' is a WAV file, but the input is a {_describe(t)} (audio goes to "
                                   "a float [A] input)")
        try:
            samples, got = decode_wav(data)
        except ValueError as e:
            raise _bad(walk, name, f"cannot read '{path}' as audio: {e}") from None
        return resample(samples, got, rate())
    if not _is_image_type(t):
        raise _bad(walk, name, f"'{path}' is neither a WAV nor a safetensors file, so it would be read as an "
                               f"image, but the input is a {_describe(t)}")
    try:
        image = decode_image(data)
    except ValueError as e:
        raise _bad(walk, name, f"cannot read '{path}' as an image: {e}") from None
    return _fit_image(t, image)


def _safetensors(walk: str, name: str, path: Path, data: bytes) -> torch.Tensor:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise _bad(walk, name, f"cannot read '{path}' as safetensors: {e}") from None
    if name in tensors:
        return tensors[name]
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    raise _bad(walk, name, f"'{path}' holds {len(tensors)} tensors and none is named '{name}'")


def _fit_image(t: Mapping[str, Any], image: torch.Tensor) -> torch.Tensor:
    """One RGB image [H, W, 3] as the input's rank: a frames input [N, H, W, 3] gets one frame."""
    dims = t.get("dims") or []
    return image.unsqueeze(0) if t["kind"] == "tensor" and len(dims) == 4 else image


def _is_path(value: Any) -> bool:
    return isinstance(value, str | os.PathLike)


def _path(value: str | os.PathLike[str]) -> str:
    text = os.fspath(value)
    return text[1:] if isinstance(text, str) and text.startswith("@") else text


def to_walk_value(walk: str, name: str, t: Mapping[str, Any], value: Any, rate: Callable[[], int]) -> Any:
    """A value a caller has at hand as the input's value (module docstring): a path read as a
    file, a PIL image or a numpy array as a tensor. Anything else is returned unchanged, for
    the walk's type check (`validate.coerce`) to judge."""
    if t["kind"] not in ("image", "tensor"):
        return value
    if _is_path(value):
        return read_input_file(walk, name, t, _path(value), rate)
    if _is_pil(value):
        return _fit_image(t, _from_pil(walk, name, value))
    if _is_numpy(value):
        return _from_numpy(value)
    if (isinstance(value, list | tuple) and value and _is_image_type(t) and len(t.get("dims") or []) == 4
            and all(_is_path(v) or _is_pil(v) for v in value)):
        frames = [read_input_file(walk, name, {**t, "dims": t["dims"][1:]}, _path(v), rate) if _is_path(v)
                  else _from_pil(walk, name, v) for v in value]
        sizes = {tuple(f.shape) for f in frames}
        if len(sizes) > 1:
            raise _bad(walk, name, f"frames of different sizes ({', '.join(f'{w}x{h}' for h, w, _ in sorted(sizes))})")
        return torch.stack(frames)
    return value


def to_walk_values(walk: str, program: Mapping[str, Any], inputs: Mapping[str, Any],
                   rate: Callable[[str], int]) -> dict[str, Any]:
    """`to_walk_value` for every declared input of `inputs` (others pass, for the type check to
    name); `rate(name)` gives an audio input's rate."""
    declared = {p["name"]: p["type"] for p in program["inputs"]}
    return {k: to_walk_value(walk, k, declared[k], v, lambda k=k: rate(k)) if k in declared else v
            for k, v in inputs.items()}


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is in the runtime extra
        return False
    return isinstance(value, Image.Image)


def _from_pil(walk: str, name: str, image: Any) -> torch.Tensor:
    import numpy as np

    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise _bad(walk, name, f"the image is {image.width}x{image.height}; at most {MAX_IMAGE_PIXELS} pixels")
    return torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8))


def _is_numpy(value: Any) -> bool:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is in the runtime extra
        return False
    return isinstance(value, np.ndarray | np.generic)


def _from_numpy(value: Any) -> Any:
    import numpy as np

    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "USV":  # not numbers: the type check names it
        return value
    try:
        return torch.from_numpy(np.array(array, copy=True))  # own, writable, contiguous memory
    except TypeError:  # a dtype torch has no match for (uint16, complex256): the type check names it
        return value


__all__ = ["DEFAULT_INPUT_RATE", "InputRates", "MAX_FILE_BYTES", "MAX_IMAGE_PIXELS", "decode_image", "decode_wav", "first_call_on",
           "input_rate", "node_input_rate", "read_input_file", "resample", "to_walk_value", "to_walk_values"]
