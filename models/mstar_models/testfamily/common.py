"""Shared helpers of the test family's nodes: config look-up, seeded weights, the chunk context key."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mstar_runtime.ops import node
from mstar_runtime.ops.ports import config_value

# The runtime passes a stream chunk to its consumer port P as the items tensor `entry[P]` and
# the number of its leading context items (already seen in an earlier chunk) as
# `entry[P + CONTEXT_SUFFIX]`, an int (mstar_runtime.control.interpreter.chunk_inputs). A port name is
# an identifier, so the colon keeps the key from ever clashing with a port, and a walk needs
# no extra syntax to pass it.
CONTEXT_SUFFIX = ":context"


def setting(spec: node.NodeSpec, name: str) -> Any:
    """A size or constant of the node: its `arch` argument if it has one, else the model config."""
    return config_value(spec, name, note=" (neither an arch argument nor config)")


def llama_sizes(spec: node.NodeSpec) -> tuple[int, int, int, int, int, int]:
    """(vocab, hidden, layers, heads, kv_heads, head_dim) of a node on the `llama` arch, as ints."""
    vocab, hidden, layers, heads, kv_heads, head_dim = (
        int(setting(spec, n)) for n in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim"))
    return vocab, hidden, layers, heads, kv_heads, head_dim


def start_reply(entry: Mapping[str, Any], seq: Any, vocab: int, limit: int, limit_name: str) -> torch.Tensor:
    """A prefill entry's `tokens` (1-D, non-empty, ids in [0, vocab), its context within `limit`,
    the setting named `limit_name`) and `max_new` (>= 1), checked as RequestErrors naming the
    port; sets the tag's reply state (`gen_base`, `max_new`) on `seq` and returns the tokens."""
    tokens = entry["tokens"]
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise node.RequestError(f"tokens must be 1-D and non-empty, got shape {tuple(tokens.shape)}", "tokens")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise node.RequestError(f"token ids must lie in [0, {vocab})", "tokens")
    if seq.start + seq.q_len > limit:
        raise node.RequestError(f"context of {seq.start + seq.q_len} tokens exceeds {limit_name} {limit}", "tokens")
    max_new = as_int(entry, "max_new")
    if max_new < 1:
        raise node.RequestError(f"max_new must be >= 1, got {max_new}", "max_new")
    seq.state["gen_base"] = seq.start + seq.q_len - 1
    seq.state["max_new"] = max_new
    return tokens


def seed_and_place_(module: nn.Module, spec: node.NodeSpec) -> None:
    """Fill every parameter from a CPU generator seeded by the class name and the node's `seed`
    setting, then move the module to the node's device and dtype: two builds from one NodeSpec
    have identical weights whatever the global RNG state (a recomputed request, a reference and
    a worker process all agree).

    Linear/conv weights ~ N(0, 1/fan_in), embeddings ~ N(0, 0.1^2), norm weights 1 + N(0, 0.1^2),
    biases ~ N(0, 0.1^2): random enough that every weight matters for the outputs."""
    seed = zlib.crc32(type(module).__name__.encode()) + int(spec.settings.get("seed", 0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm gains, incl. *_layernorm
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                values = 0.1 * torch.randn(p.shape, generator=gen)
            elif "embed" in name:
                # small, so that a tied head does not just repeat the input token: the
                # residual stream is then dominated by what attention and the MLP add
                values = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                values = torch.randn(p.shape, generator=gen) / fan_in**0.5
            p.copy_(values.to(p.dtype))
    module.to(device=spec.device, dtype=spec.dtype)


def chunk_context(entry: dict[str, Any], port: str, items: int) -> int:
    """The context count the runtime gives with a stream chunk (see CONTEXT_SUFFIX)."""
    key = port + CONTEXT_SUFFIX
    if key not in entry:
        raise node.NodeError(
            f"stream chunk for port '{port}' arrived without '{key}': the runtime must pass the chunk's "
            "number of context items next to its tensor"
        )
    context = entry[key]
    if isinstance(context, torch.Tensor):
        context = int(context.item())
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= items:
        raise node.NodeError(f"'{key}' must be an int in [0, {items}], got {context!r}")
    return context


def as_int(entry: dict[str, Any], port: str) -> int:
    value = entry[port]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise node.RequestError(f"input '{port}' must be an integer, got {value!r}", port)
    return value


def as_float(entry: dict[str, Any], port: str) -> float:
    value = entry[port]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise node.RequestError(f"input '{port}' must be a number, got {value!r}", port)
    return float(value)
