"""The data the architecture catalogue returns: tensor specs, KV geometry, the arch spec.

This module owns the contract between `mstarc.archs` and its users (lowering, the memory
and shard-tp passes, the runtime's loader via the plan): every tensor a node's checkpoint
holds, by its official name, with shape, dtype and tensor-parallel role. Pure Python: the
compiler must not need torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The records the plan carries to the runtime's loader, declared once (runtime/mstar_runtime/plan/records.py)
from mstar_runtime.plan.records import DTYPE_BYTES, KVGeometry, TensorSpec  # noqa: F401 - re-exported

# Weights are floating point; the integer dtypes only exist for ports.
WEIGHT_DTYPES = ("bf16", "f16", "f32")
# Tensor-parallel roles. "col": split dim 0 (q/k/v, gate/up, and the bias of such a layer);
# "row": split dim 1 (o_proj, down_proj; its bias is added once, after the all-reduce, so it
# is replicated); "vocab": split dim 0 of an embedding or LM head; "expert": a whole MoE
# expert's tensor (expert parallelism places it, or TP splits its own col/row dims);
# "replicate": every rank holds all of it (norms, routers, convolutions, small glue).
SHARD_ROLES = ("col", "row", "vocab", "expert", "replicate")


class ArchError(Exception):
    """An `arch` line's arguments are wrong. The message names the argument; `.arg` holds
    its name (None when no single argument is at fault, e.g. the weights dtype)."""

    def __init__(self, message: str, arg: str | None = None):
        super().__init__(message)
        self.arg = arg


@dataclass(frozen=True)
class ArchSpec:
    tensors: tuple[TensorSpec, ...]
    # What tensor parallelism must divide: those present of heads, kv_heads, head_dim,
    # hidden, intermediate, vocab, layers, experts, moe_intermediate. Optionally
    # `activation_elements`: the peak activation elements of one batch row (an arch that is
    # not a token-wise transformer, e.g. a codec decoding a window), for the memory pass.
    dims: Mapping[str, int] = field(hash=False)
    kv: KVGeometry | None  # None for stateless archs
    # The 2-D weights a node of this arch can hold as FP8 (a placement's `weights: fp8`): the
    # decoder layers' projections its implementation quantizes at load; empty: none (the
    # compiler refuses `weights: fp8` for it, E059)
    fp8: tuple[str, ...] = field(default=(), hash=False)

    def param_count(self) -> int:
        return sum(t.numel for t in self.tensors)

    def bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor_map(self) -> dict[str, TensorSpec]:
        """Tensors by name (for a loader checking a checkpoint's names and shapes)."""
        return {t.name: t for t in self.tensors}


# (keyword args of the `arch` line, weights dtype) -> spec
ArchFn = Callable[[Mapping[str, Any], str], ArchSpec]
