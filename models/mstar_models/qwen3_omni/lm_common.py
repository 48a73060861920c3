"""Helpers the Qwen3-Omni language-model nodes share: config look-up, input checks, sampling settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_runtime.ops.node import NodeError, NodeSpec, RequestError
from mstar_runtime.ops.sampler import SamplingParams

DEFAULT_MAX_SEQ_LEN = 4096  # the compiler's memory-pass default for `max_seq_len`
_MISSING = object()


def config_value(spec: NodeSpec, name: str, default: Any = _MISSING, *, keys: tuple[str, ...] = ()) -> Any:
    """A size or constant: the node's `arch` argument `name`, else the model config under `name`
    or one of `keys` (node-specific spellings, e.g. `talker_experts_per_token`), else `default`."""
    if name in spec.arch_args:
        return spec.arch_args[name]
    for key in (*keys, name):
        if key in spec.config:
            return spec.config[key]
    if default is _MISSING:
        raise NodeError(f"node '{spec.name}': config value '{name}' is missing")
    return default


def max_seq_len(spec: NodeSpec) -> int:
    """The `max_seq_len` setting, read as the compiler reads it (a positive int, else the default)."""
    value = spec.settings.get("max_seq_len", DEFAULT_MAX_SEQ_LEN)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else DEFAULT_MAX_SEQ_LEN


def scalar(entry: Mapping[str, Any], port: str, kind: type, default: Any = _MISSING) -> Any:
    """A scalar port's value (a Python number or bool, or a one-element tensor), checked."""
    value = entry.get(port, default)
    if value is _MISSING or value is None:
        raise RequestError(f"input '{port}' is missing", port)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if kind is bool:
        if not isinstance(value, bool | int):
            raise RequestError(f"input '{port}' must be a bool, got {value!r}", port)
        return bool(value)
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise RequestError(f"input '{port}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", port)
    return kind(value)


def sampling_params(entry: Mapping[str, Any], *, greedy: bool = False, repetition: bool = False) -> SamplingParams:
    """The request's sampling settings from its ports (temperature 0 or `greedy`: argmax)."""
    seed = entry.get("seed")
    return SamplingParams(
        temperature=0.0 if greedy else scalar(entry, "temperature", float),
        top_k=scalar(entry, "top_k", int, 0),
        top_p=scalar(entry, "top_p", float, 1.0),
        repetition_penalty=scalar(entry, "repetition_penalty", float) if repetition else 1.0,
        seed=None if seed is None else scalar(entry, "seed", int),
    )


def token_ids(entry: Mapping[str, Any], port: str, vocab: int) -> torch.Tensor:
    """A 1-D, non-empty integer id tensor whose values lie in [0, vocab)."""
    ids = entry.get(port)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        raise RequestError(f"{port} must be a 1-D, non-empty tensor of token ids", port)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise RequestError(f"{port} must hold integer token ids, got {ids.dtype}", port)
    lo, hi = ids.aminmax()
    if int(lo) < 0 or int(hi) >= vocab:
        raise RequestError(f"{port} ids must lie in [0, {vocab}), got [{int(lo)}, {int(hi)}]", port)
    return ids


def rows(entry: Mapping[str, Any], port: str, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [n, width] port (n may be 0; a missing port is empty), in the node's dtype and device."""
    value = entry.get(port)
    if value is None:
        return torch.zeros(0, width, dtype=dtype, device=device)
    if not isinstance(value, torch.Tensor):
        raise RequestError(f"{port} must be a tensor, got {type(value).__name__}", port)
    if value.numel() == 0:
        return torch.zeros(0, width, dtype=dtype, device=device)
    if value.dim() != 2 or value.shape[1] != width:
        raise RequestError(f"{port} must be [n, {width}], got {list(value.shape)}", port)
    return value.to(device=device, dtype=dtype)


def grids(entry: Mapping[str, Any], port: str) -> list[tuple[int, int, int]]:
    """A [K, 3] grid port as (t, h, w) tuples (K may be 0; a missing port is empty)."""
    value = entry.get(port)
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
        return []
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != 3:
        raise RequestError(f"{port} must be a [K, 3] tensor of (t, h, w), got {getattr(value, 'shape', value)}", port)
    out = [tuple(int(v) for v in row) for row in value.tolist()]
    if any(min(g) < 1 for g in out):
        raise RequestError(f"{port} rows must be positive, got {out}", port)
    return out  # type: ignore[return-value]
