"""The typed, read-only views of a checked plan body (`Plan` and its parts), and the errors
a plan raises: what the conductor, the workers and the weight loader read.

Typed parts (ranks, nodes, KV pools, streams, transitions) are frozen dataclasses; each
also answers `view["field"]` with the body's own JSON field, for code that follows the
plan format (docs/plan-format.md) directly. Walk programs are handed out as the body's
JSON dicts, because the interpreter walks them as JSON; they must not be mutated. Built by
`plan/parse.py` and `load_plan` (plan/loader.py), the only way in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from mstar_runtime.ops.node import NodeSpec, RequestError
from mstar_runtime.plan.records import KVGeometry, ShardSpec, TensorSpec

NODE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
)
DEVICES = ("cpu", "cuda")
ENGINES = ("kv", "stateless")


class PlanError(Exception):
    """A plan that cannot be run here; the message starts with the plan's path."""

    def __init__(self, path: str, message: str, problems: tuple[str, ...] = ()):
        self.path = path
        self.problems = problems or (message,)
        super().__init__(f"{path}: {message}")


class UnknownWalk(RequestError):
    """A request named a walk the plan does not have (a client error, hence a RequestError)."""


# ------------------------------------------------------------------------------ typed views
class _RawView:
    """`view["key"]` reads the body's own JSON field (see the module docstring)."""

    raw: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


@dataclass(frozen=True, eq=False)
class RankSpec(_RawView):
    rank: int
    type: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int
    raw: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True, eq=False)
class ArchSpec(_RawView):
    name: str
    args: Mapping[str, Any]
    dims: Mapping[str, Any]
    kv: KVGeometry | None
    tensors: tuple[TensorSpec, ...]
    raw: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True)
class ReadSpec:
    """A KV context a phase reads besides its own: `node`'s tag `tag` (None: the call's tag)."""

    node: str
    tag: str | None


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reads: tuple[ReadSpec, ...] = ()


@dataclass(frozen=True, eq=False)
class PlanNode(_RawView):
    name: str
    engine: str  # "kv" | "stateless"
    impl: str  # "mstar_models.<model>.<Class>"
    dtype: str  # a key of NODE_DTYPES
    tags: tuple[str, ...]
    settings: Mapping[str, Any]
    phases: Mapping[str, PhaseSpec]
    ranks: tuple[int, ...]
    arch: ArchSpec | None
    shard: ShardSpec | None
    raw: Mapping[str, Any] = field(repr=False)
    # tag -> the most tokens its contexts may hold, for the tags with their own `max_len`
    tag_max_len: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # `quantized` (feature fp8_weights): the format ("fp8_e4m3") and the arch tensors the
    # loader turns into it after filling the weights; None and () for a node without
    weights_format: str | None = None
    quantized_tensors: tuple[str, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return NODE_DTYPES[self.dtype]

    def tp_of(self, rank: int) -> tuple[int, int]:
        """(tp_rank, tp_size) of this node's instance on `rank`."""
        if self.shard is None or self.shard.tp == 1:
            return 0, 1
        return self.shard.group_of(rank)


@dataclass(frozen=True)
class KVPoolSpec:
    node: str
    rank: int
    pages: int
    tokens: int
    bytes_per_token: int
    max_seq_len: int


@dataclass(frozen=True)
class RankMemory:
    rank: int
    capacity_bytes: int
    weights_bytes: int
    graph_pool_bytes: int
    workspace_bytes: int
    kv: Mapping[str, KVPoolSpec]

    def used_bytes(self, kv_pages_cap: int | None = None, *, graphs: bool = True) -> int:
        """Bytes the rank needs: weights, CUDA-graph pool (if `graphs`), workspace and its KV pools."""
        kv = 0
        for pool in self.kv.values():
            pages = pool.pages if kv_pages_cap is None else min(pool.pages, kv_pages_cap)
            kv += pages * (pool.tokens // max(pool.pages, 1)) * pool.bytes_per_token
        return self.weights_bytes + (self.graph_pool_bytes if graphs else 0) + self.workspace_bytes + kv


@dataclass(frozen=True, eq=False)
class StreamSpec(_RawView):
    id: str
    walk: str
    policy: Mapping[str, Any]
    capacity: int
    producer_rank: int
    consumer_rank: int
    raw: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True)
class KeepSpec:
    node: str
    tag: str
    as_tag: str


@dataclass(frozen=True, eq=False)
class TransitionSpec(_RawView):
    src: str
    dst: str
    when: str
    keep: tuple[KeepSpec, ...]
    raw: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True)
class WeightFile:
    name: str
    header_sha256: str
    bytes: int


@dataclass(frozen=True)
class WeightsSpec:
    kind: str  # "dummy" | "dir" | "none"
    path: str | None
    files: tuple[WeightFile, ...]


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True, eq=False)
class Plan:
    """A checked plan. Build it with `load_plan`; every field is read-only."""

    path: str
    device: str  # where this process runs it: "cpu" | "cuda"
    compiler: str
    model_name: str
    variant: str
    source: str
    config: Mapping[str, Any]
    weights: WeightsSpec
    ranks: tuple[RankSpec, ...]
    page_size: int
    max_batch: int
    nodes: Mapping[str, PlanNode]
    walks: Mapping[str, Mapping[str, Any]]
    streams: Mapping[str, StreamSpec]
    memory: tuple[RankMemory, ...]
    resident: Mapping[int, tuple[str, ...]]
    call_ranks: Mapping[str, tuple[int, ...]]
    kv_pages_cap: int | None
    body: Mapping[str, Any] = field(repr=False)
    _transitions: tuple[TransitionSpec, ...] = field(repr=False)
    # each host's ranks, for a plan launched over several hosts (docs/distributed.md); empty: one host
    hosts: tuple[tuple[int, ...], ...] = ()

    # ---- lookups
    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def plan_device_type(self) -> str:
        """The device type the plan was compiled for ("cuda" if any rank is a GPU)."""
        return "cuda" if any(r.type == "cuda" for r in self.ranks) else "cpu"

    def walk(self, name: str) -> Mapping[str, Any]:
        """A walk's step program (JSON: walk, inputs, outputs, streams, program)."""
        try:
            return self.walks[name]
        except KeyError:
            raise UnknownWalk(
                f"unknown walk '{name}'; this plan serves: {', '.join(sorted(self.walks))}", "walk"
            ) from None

    def node(self, name: str) -> PlanNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise PlanError(self.path, f"no node '{name}'; nodes: {', '.join(self.nodes)}") from None

    def node_rank(self, name: str) -> int:
        """The rank of the node's first instance (its first TP group's first rank)."""
        return self.node(name).ranks[0]

    def resident_nodes(self, rank: int) -> tuple[str, ...]:
        return self.resident.get(rank, ())

    def stream(self, stream_id: str) -> StreamSpec:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise PlanError(self.path, f"no stream '{stream_id}'") from None

    def transitions(self, src: str | None = None) -> tuple[TransitionSpec, ...]:
        """The transitions (all, or those leaving walk `src`), in plan order."""
        return tuple(t for t in self._transitions if src is None or t.src == src)

    def kv_pools(self) -> list[tuple[str, int]]:
        """Every (kv node, rank) that holds a KV pool, in rank then node order."""
        return [(node, m.rank) for m in self.memory for node in m.kv]

    def kv_pool(self, node: str, rank: int | None = None) -> KVPoolSpec:
        rank = self.node_rank(node) if rank is None else rank
        pool = self.memory[rank].kv.get(node) if 0 <= rank < len(self.memory) else None
        if pool is None:
            raise PlanError(self.path, f"node '{node}' has no KV pool on rank {rank}")
        return pool

    def kv_pages(self, node: str, rank: int | None = None) -> int:
        """Pages of the node's KV pool on `rank` (default: its first rank), after `kv_pages_cap`."""
        pages = self.kv_pool(node, rank).pages
        return pages if self.kv_pages_cap is None else min(pages, self.kv_pages_cap)

    def torch_device(self, rank: int) -> torch.device:
        """The device worker `rank` runs on in this process (one GPU per rank, by index; on
        a plan with hosts, by its index among its host's ranks)."""
        if self.device != "cuda":
            return torch.device("cpu")
        host = next((h for h in self.hosts if rank in h), None)
        return torch.device(f"cuda:{host.index(rank) if host is not None else rank}")

    def node_spec(
        self,
        name: str,
        *,
        device: torch.device | str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> NodeSpec:
        """The `NodeSpec` a node is built from (and that `KVNode.kv_plan` receives)."""
        node = self.node(name)
        dev = torch.device(device) if device is not None else self.torch_device(node.ranks[0])
        args = node.arch.args if node.arch is not None else MappingProxyType({})
        return NodeSpec(
            name=name,
            engine=node.engine,
            config=self.config,
            arch_args=args,
            settings=node.settings,
            dtype=node.torch_dtype,
            device=dev,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
        )
