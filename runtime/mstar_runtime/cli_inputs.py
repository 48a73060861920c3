"""`mstar-run`'s walk inputs from text: `--input NAME=VALUE` pairs and a batch line's JSON values,
parsed by the walk's declared input types, then validated as every entry point validates
(`control.validate.validate_inputs`).

    cli_inputs(plan, "tts", {"prompt": "hi", "seed": "3"})   # {"prompt": "hi", "seed": 3}

A text becomes the input's type: str as it is, int and float (finite) and bool by their
spelling, an image from a file (`@photo.png`, the `@` optional), a tensor from `@FILE` (an
image, a WAV file resampled to the rate the plan's weights want, a safetensors file) or a
JSON list nested at most `MAX_TENSOR_JSON_DEPTH` deep. A value that does not parse is a
`RequestError` naming the walk and the input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from os import PathLike
from typing import Any

import torch

from mstar_runtime import media, untrusted
from mstar_runtime.control.validate import TORCH_DTYPES, validate_inputs
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan

MAX_TENSOR_JSON_DEPTH = 64  # a tensor written as JSON nests once per dimension; torch takes at most 64


def _bad(walk: str, name: str, message: str) -> RequestError:
    return RequestError(f"walk '{walk}', input '{name}': {message}", name)


def no_rate() -> int:
    """The audio rate of a caller that knows no plan's: the default one."""
    return media.DEFAULT_INPUT_RATE


def _parse_bool(walk: str, name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise _bad(walk, name, f"expected true or false, got '{text}'")


def parse_text(walk: str, name: str, t: Mapping[str, Any], text: str, rate: Callable[[], int] = no_rate) -> Any:
    """A `--input` value parsed by the input's declared type (validation comes after). An image
    input's text is a file (`@photo.png`, the `@` optional); a tensor's is `@FILE` (an image,
    a WAV file, a safetensors file: `media.read_input_file`, which calls `rate()` for a WAV
    file's target rate) or a JSON list."""
    kind = t["kind"]
    if kind == "str":
        return text
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise _bad(walk, name, f"expected an integer, got '{text}'") from None
    if kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise _bad(walk, name, f"expected a number, got '{text}'") from None
        if not math.isfinite(value):  # as the server's routes take floats: finite ones
            raise _bad(walk, name, f"expected a finite number, got '{text}'")
        return value
    if kind == "bool":
        return _parse_bool(walk, name, text)
    if kind == "image":
        return media.read_input_file(walk, name, t, text.removeprefix("@"), rate)
    if text.startswith("@"):
        return media.read_input_file(walk, name, t, text[1:], rate)
    try:
        data = untrusted.loads_json(text, MAX_TENSOR_JSON_DEPTH)
    except ValueError as e:  # malformed, or nested deeper than any tensor
        reason = f" ({e})" if isinstance(e, untrusted.JSONTooDeep) else ""
        raise _bad(walk, name, f"expected a JSON list or @FILE (safetensors, image, WAV) for a {t['dtype']} tensor, "
                               f"got '{text[:60]}'{reason}") from None
    try:
        tensor = torch.tensor(data, dtype=TORCH_DTYPES[t["dtype"]])
    except (TypeError, ValueError, RuntimeError) as e:
        raise _bad(walk, name, f"not a {t['dtype']} tensor: {e}") from None
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # 1e999, or 1e39 in f32
        raise _bad(walk, name, f"not a {t['dtype']} tensor: an element is infinite or beyond the dtype's range")
    return tensor


def parse_json_value(walk: str, name: str, t: Mapping[str, Any] | None, value: Any,
                     rate: Callable[[], int] = no_rate) -> Any:
    """A batch line's input: JSON values pass through (the walk's types check them); a string
    for an image or tensor input is a file reference, read as `--input` would."""
    if t is not None and t["kind"] in ("image", "tensor") and isinstance(value, str):
        return parse_text(walk, name, t, value, rate)
    return value


def split_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """`--input NAME=VALUE` pairs as {name: text}; ValueError naming the first malformed one, or
    a name given twice (the first value would be dropped without a word)."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--input expects NAME=VALUE, got '{pair}'")
        if name in out:
            raise ValueError(f"--input gives '{name}' twice ('{name}={out[name]}' and '{pair}')")
        out[name] = text
    return out


def cli_inputs(plan: Plan, walk: str, texts: Mapping[str, str], weights: str | PathLike[str] = "dummy",
               ) -> dict[str, Any]:
    """`--input` values ({name: text}), parsed by the walk's declared input types and validated.
    `weights`: the plan's weights, for the rate a WAV file is resampled to (`media.input_rate`)."""
    program = plan.walk(walk)
    declared = {p["name"]: p["type"] for p in program["inputs"]}
    rates = media.InputRates(plan, weights)
    # an undeclared name stays a string: validate_inputs names it as unknown
    raw = {name: parse_text(walk, name, declared[name], text, lambda name=name: rates(walk, name))
           if name in declared else text for name, text in texts.items()}
    return validate_inputs(walk, program, raw)
