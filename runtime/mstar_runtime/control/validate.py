"""Request inputs checked against a walk's typed inputs, before anything is queued.

Every problem is a `RequestError` whose `field` names the input, so the CLI, the Python API
and the HTTP server all report it the same way (`input 'voice': expected str, got int`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_runtime.ops.node import RequestError

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32,
                "i64": torch.int64, "u8": torch.uint8, "bool": torch.bool}


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _fail(walk: str, name: str, message: str) -> RequestError:
    return RequestError(f"walk '{walk}', input '{name}': {message}", name)


def coerce(walk: str, name: str, t: Mapping[str, Any], value: Any) -> Any:
    kind = t["kind"]
    if kind == "str":
        if not isinstance(value, str):
            raise _fail(walk, name, f"expected a string, got {type(value).__name__}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(walk, name, f"expected an integer, got {value!r}")
        if not INT64_MIN <= value <= INT64_MAX:  # a node holds it in an int64 (a seed would wrap)
            raise _fail(walk, name, f"{value} is outside the 64-bit integers ({INT64_MIN} to {INT64_MAX})")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(walk, name, f"expected a number, got {value!r}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _fail(walk, name, f"expected true or false, got {value!r}")
        return value
    if kind == "image":
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 3 or value.shape[2] != 3:
            raise _fail(walk, name, "expected an RGB image (a uint8 tensor [H, W, 3], a PIL image, a numpy array or a file path)")
        return value
    # a tensor
    dtype = TORCH_DTYPES[t["dtype"]]
    if isinstance(value, list) and not value:  # [] is the empty tensor of the declared rank ("absent")
        return torch.zeros([d if isinstance(d, int) else 0 for d in t["dims"]], dtype=dtype)
    try:
        tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise _fail(walk, name, f"expected a {t['dtype']} tensor, got {type(value).__name__} ({e})") from None
    dims = t["dims"]
    if tensor.dim() != len(dims):
        raise _fail(walk, name, f"expected {len(dims)} dimension(s) {dims}, got shape {list(tensor.shape)}")
    for i, (want, got) in enumerate(zip(dims, tensor.shape)):
        if isinstance(want, int) and want != got:
            raise _fail(walk, name, f"dimension {i} must be {want}, got {got}")
    if tensor.is_floating_point() != dtype.is_floating_point and dtype != torch.bool:
        raise _fail(walk, name, f"expected {t['dtype']} values, got {str(tensor.dtype).removeprefix('torch.')}")
    return tensor.to(dtype)


def validate_inputs(walk: str, program: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Typed, defaulted inputs of one request; raises RequestError for the first bad field."""
    declared = {p["name"]: p for p in program["inputs"]}
    for name in inputs:
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise _fail(walk, name, f"unknown input (the walk takes: {known})")
    out: dict[str, Any] = {}
    for name, p in declared.items():
        if name in inputs and inputs[name] is not None:
            out[name] = coerce(walk, name, p["type"], inputs[name])
        elif p["default"] is not None:
            out[name] = coerce(walk, name, p["type"], p["default"])
        else:
            raise _fail(walk, name, "missing (it has no default)")
    return out
