"""Readers a node uses on its NodeSpec and its batch entries: config values, the `max_seq_len`
setting as the compiler reads it, and checked scalar ports."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from mstar_runtime.ops.node import NodeError, NodeSpec, RequestError

DEFAULT_MAX_SEQ_LEN = 4096  # the compiler's memory-pass default for `max_seq_len`
MISSING: Any = object()  # `config_value`'s default when a value is required


def config_value(
    spec: NodeSpec,
    name: str,
    default: Any = MISSING,
    *,
    keys: tuple[str, ...] = (),
    owner: str = "",
    note: str = "",
) -> Any:
    """A size or constant: the node's `arch` argument `name`, else the model config under `name`
    or one of `keys` (node-specific spellings), else `default`. Without a default a missing value
    is a NodeError naming the node, its class `owner` when given, and ending in `note`."""
    if name in spec.arch_args:
        return spec.arch_args[name]
    for key in (*keys, name):
        if key in spec.config:
            return spec.config[key]
    if default is MISSING:
        where = f"node '{spec.name}' ({owner})" if owner else f"node '{spec.name}'"
        raise NodeError(f"{where}: config value '{name}' is missing{note}")
    return default


def arch_values(spec: NodeSpec, names: tuple[str, ...], arch: str) -> dict[str, Any]:
    """The node's `arch` arguments `names`, every one required: a NodeError names all that its
    arch line lacks (as arguments of the arch `arch`)."""
    missing = [n for n in names if n not in spec.arch_args]
    if missing:
        raise NodeError(f"node '{spec.name}': its arch line lacks {', '.join(missing)} ({arch} arguments)")
    return {n: spec.arch_args[n] for n in names}


def setting_value(spec: NodeSpec, name: str, default: Any, config_prefix: str = "") -> Any:
    """A node setting `name` (the `.walk`'s), else the model config's `config_prefix + name`, else `default`."""
    if name in spec.settings:
        return spec.settings[name]
    return spec.config.get(config_prefix + name, default)


def one_rank(spec: NodeSpec, owner: str = "") -> None:
    """Refuse a tensor-parallel placement of a node that does not shard: a NodeError naming the
    node (and its class `owner`, when given) and the tp it was placed with."""
    if spec.tp_size != 1:
        where = f"node '{spec.name}' ({owner})" if owner else f"node '{spec.name}'"
        raise NodeError(f"{where} does not shard; place it with tp=1, not {spec.tp_size}")


def max_seq_len(spec: NodeSpec) -> int:
    """The `max_seq_len` setting, read as the compiler reads it (a positive int, else the default)."""
    value = spec.settings.get("max_seq_len", DEFAULT_MAX_SEQ_LEN)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else DEFAULT_MAX_SEQ_LEN


def decode_token(entry: Mapping[str, Any], state: Mapping[str, Any], prefilled: str, port: str = "token"
                 ) -> torch.Tensor:
    """A decode step's fed-back token: one integer id of shape [1] at `port` (`fed_token`'s
    check), on a KV context whose state holds `prefilled` (what the node's prefill sets); a
    RequestError naming the port otherwise."""
    token = entry.get(port)
    fed_token({port: token}, port)  # an absent token is refused as a NoneType
    if prefilled not in state:
        raise RequestError("decode on a KV context that was never prefilled", port)
    return token


def fed_token(inputs: Mapping[str, Any], port: str = "token") -> None:
    """A column step's `join` check of a decode's fed-back token, where `inputs` holds it (a
    plain batched call: ops/column_call.py passes the whole entry; a cohort's rows pass only
    their invariant inputs, the token being the loop's own output): one integer id of shape
    [1], else a RequestError naming the port. Its range is the node's to check, if it must."""
    if port not in inputs:
        return
    token = inputs[port]
    if not isinstance(token, torch.Tensor) or tuple(token.shape) != (1,) or token.dtype.is_floating_point \
            or token.dtype == torch.bool:
        got = f"{token.dtype} of shape {tuple(token.shape)}" if isinstance(token, torch.Tensor) \
            else type(token).__name__
        raise RequestError(f"{port} must be one integer token id of shape [1], got {got}", port)


def scalar(
    entry: Mapping[str, Any],
    port: str,
    kind: type,
    default: Any = None,
    *,
    finite: bool = False,
    required: bool = False,
) -> Any:
    """A scalar port's value (a Python number, or a one-element tensor; a bool or int for `kind`
    bool), checked as a RequestError naming the port; a bool is refused as a number. `finite`
    also refuses an infinite or NaN float; `required` refuses an absent (or None) value as
    missing, where otherwise it fails the type check."""
    value = entry.get(port, default)
    if required and value is None:
        raise RequestError(f"input '{port}' is missing", port)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if kind is bool:
        if not isinstance(value, bool | int):
            raise RequestError(f"input '{port}' must be a bool, got {value!r}", port)
        return bool(value)
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or (finite and kind is float and not math.isfinite(value)):
        want = "an integer" if kind is int else "a finite number" if finite else "a number"
        raise RequestError(f"input '{port}' must be {want}, got {value!r}", port)
    return kind(value)
