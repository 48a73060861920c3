"""Helpers the Qwen3-Omni language-model nodes share: attention sizes, input checks.

(Their sampling settings are read by `mstar_runtime.sampling.read_sampling`, from the
`SamplingPorts` each node declares.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_runtime.ops import node
from mstar_runtime.ops.ports import config_value


def attention_sizes(
    spec: node.NodeSpec, owner: str, shards: str = "does not shard", *, sharded: bool = False
) -> tuple[int, int, int, int, int]:
    """(hidden, layers, heads, kv_heads, head_dim) of a decoder node `owner`, the full (unsharded)
    sizes, checked: heads a multiple of kv_heads, head_dim even, and tp=1 unless the node is
    `sharded` (`shards` says why not otherwise)."""
    if spec.tp_size != 1 and not sharded:
        raise node.NodeError(f"node '{spec.name}' ({owner}) {shards}; place it with tp=1")
    hidden, layers = int(config_value(spec, "hidden")), int(config_value(spec, "layers"))
    heads, kv_heads = int(config_value(spec, "heads")), int(config_value(spec, "kv_heads"))
    head_dim = int(config_value(spec, "head_dim"))
    if heads % kv_heads or head_dim % 2:
        raise node.NodeError(f"node '{spec.name}': heads ({heads}) must be a multiple of kv_heads "
                             f"({kv_heads}) and head_dim ({head_dim}) even")
    return hidden, layers, heads, kv_heads, head_dim


def token_ids(entry: Mapping[str, Any], port: str, vocab: int) -> torch.Tensor:
    """A 1-D, non-empty integer id tensor whose values lie in [0, vocab)."""
    ids = entry.get(port)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        raise node.RequestError(f"{port} must be a 1-D, non-empty tensor of token ids", port)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise node.RequestError(f"{port} must hold integer token ids, got {ids.dtype}", port)
    lo, hi = ids.aminmax()
    if int(lo) < 0 or int(hi) >= vocab:
        raise node.RequestError(f"{port} ids must lie in [0, {vocab}), got [{int(lo)}, {int(hi)}]", port)
    return ids


def rows(entry: Mapping[str, Any], port: str, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [n, width] port (n may be 0; a missing port is empty), in the node's dtype and device."""
    value = entry.get(port)
    if value is None:
        return torch.zeros(0, width, dtype=dtype, device=device)
    if not isinstance(value, torch.Tensor):
        raise node.RequestError(f"{port} must be a tensor, got {type(value).__name__}", port)
    if value.numel() == 0:
        return torch.zeros(0, width, dtype=dtype, device=device)
    if value.dim() != 2 or value.shape[1] != width:
        raise node.RequestError(f"{port} must be [n, {width}], got {list(value.shape)}", port)
    return value.to(device=device, dtype=dtype)


def grids(entry: Mapping[str, Any], port: str) -> list[tuple[int, int, int]]:
    """A [K, 3] grid port as (t, h, w) tuples (K may be 0; a missing port is empty)."""
    value = entry.get(port)
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
        return []
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != 3:
        raise node.RequestError(f"{port} must be a [K, 3] tensor of (t, h, w), got {getattr(value, 'shape', value)}",
                                port)
    out = [tuple(int(v) for v in row) for row in value.tolist()]
    if any(min(g) < 1 for g in out):
        raise node.RequestError(f"{port} rows must be positive, got {out}", port)
    return out  # type: ignore[return-value]
