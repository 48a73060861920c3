"""The plan records the compiler writes and the loader reads back, declared once.

Pure Python (no torch): `mstarc` builds these (the architecture catalogue's `TensorSpec` and
`KVGeometry`, the `shard-tp` pass's `ShardSpec`), `mstarc.plan` writes them into the plan
body with their `to_json`, and `mstar_runtime.plan.loader` checks the body and builds the same
classes from it. A field added here is one field on both sides of the plan format
(docs/plan-format.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Bytes per element of every dtype a weight or a port can have (the .walk language's dtypes).
DTYPE_BYTES: Mapping[str, int] = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "bool": 1}


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor of a node's arch, by its checkpoint name, at full (unsharded) shape."""

    name: str  # the official checkpoint's tensor name, exactly
    shape: tuple[int, ...]
    dtype: str  # "bf16" | "f32" | ...
    shard: str = "replicate"  # its tensor-parallel role (mstarc.archs.SHARD_ROLES)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype, self.shard]


@dataclass(frozen=True)
class KVGeometry:
    """Per-token KV cache shape of a kv node: 2 (K and V) x layers x kv_heads x head_dim
    (all heads; a rank holds `ShardSpec.kv_heads_per_rank` of them)."""

    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def to_json(self) -> dict[str, int]:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}


@dataclass(frozen=True)
class TensorSplit:
    """How one tensor is cut across a TP group."""

    kind: str  # col | row | vocab | expert | replicate (mstarc.passes.shard_tp.SHARD_KINDS)
    dim: int | None  # the dimension that is cut; None: whole on every rank
    parts: int  # equal slices the tensor is cut into; a rank holds one (1 when whole)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dim": self.dim, "parts": self.parts}


@dataclass(frozen=True)
class Collective:
    """A collective one forward pass of a sharded node runs."""

    op: str  # "all_reduce" | "all_gather"
    after: str  # module name pattern, layer/expert numbers as '*', e.g. "model.layers.*.mlp.down_proj"
    count: int  # how many times one forward pass runs it

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "after": self.after, "count": self.count}


@dataclass(frozen=True)
class ShardSpec:
    """A node's tensor-parallel layout (tp 1 included). In the plan it is the node's `shard`;
    `node` is the node's key and `ranks` the node's own `ranks` there."""

    node: str
    tp: int
    ranks: tuple[int, ...]  # the node's ranks from the placement (its TP groups, in order)
    heads_per_rank: int | None
    kv_heads_per_rank: int | None
    kv_replicas: int  # ranks holding each KV head (1 unless tp is a multiple of kv_heads)
    splits: Mapping[str, TensorSplit]  # tensor name -> how it is cut
    collectives: tuple[Collective, ...]  # empty at tp 1
    bytes_per_rank: int  # from the arch's shapes/dtypes (memory re-sizes from a checkpoint)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.ranks[i:i + self.tp] for i in range(0, len(self.ranks), self.tp))

    def group_of(self, rank: int) -> tuple[int, int]:
        """(tp_rank, tp_size) of `rank` inside its TP group."""
        i = self.ranks.index(rank)
        return i % self.tp, self.tp

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "ranks": list(self.ranks), "heads_per_rank": self.heads_per_rank,
                "kv_heads_per_rank": self.kv_heads_per_rank, "kv_replicas": self.kv_replicas,
                "bytes_per_rank": self.bytes_per_rank,
                "splits": {n: s.to_json() for n, s in sorted(self.splits.items())},
                "collectives": [c.to_json() for c in self.collectives]}
