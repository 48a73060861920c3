"""A loaded plan: the typed, read-only view of a plan body that the conductor and workers use.

`load_plan` is the only way in. It checks, in this order and before any tensor exists:

1. the container (magic, version, size, checksum) and the schema version, through
   `planfile.read` (its `PlanFileError` becomes a `PlanError`), then the plan's `requires`:
   every feature it names must be one this runtime implements (`SUPPORTED_FEATURES`;
   docs/plan-format.md, "Required features"), else a `PlanError` naming the feature;
2. the body's schema (`plan/check.py`, shared with `mstarc`): every value's type and range
   and the references between sections the compiler guarantees (a loop bound below zero, a
   stream of capacity 0, a `max_batch` of 0, an emit to an undeclared output, a KV pool
   larger than its rank: a `PlanError` naming the field, never a `KeyError`);
3. invariants across sections: every `call` of every walk program names an existing node
   and phase, a KV tag of that node, ranks in range on which the node is resident; every
   `on_stream` names a stream of the plan; every kv node has KV geometry and pages on each
   of its ranks; transitions name walks; a loop's `cohort` mark, when not null, names a
   call of the loop's own body and ports of that call's phase; a call's `reads` (contexts
   it attends to besides its own) match its phase's, name KV tags of kv nodes with a pool on
   the call's ranks, and never the call's own context; a tag's `max_len` is a positive int
   of a tag of the node; a walk input with a `stream` names a stream of that walk whose edge
   starts at the input. All violations are reported together, each naming the walk and step
   (or loop);
4. hardware fit: the device ("cpu" or "cuda") the plan runs on exists, with enough GPUs
   of enough memory for the plan's ranks. A CUDA plan runs on the CPU only when
   `device="cpu"` is asked for explicitly.

A plan of an older minor schema (before 1.1) has no `cohort` on its loops: loading gives
every such loop `"cohort": None`, so readers of a loaded plan may use `op["cohort"]`.

Typed parts (ranks, nodes, KV pools, streams, transitions) are frozen dataclasses; each
also answers `view["field"]` with the body's own JSON field, for code that follows the
plan format (docs/plan-format.md) directly. Walk programs are handed out as the body's
JSON dicts, because the interpreter walks them as JSON; they must not be mutated.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from mstar_runtime.ops.node import NodeSpec, RequestError
from mstar_runtime.plan import check, planfile
from mstar_runtime.plan.planfile import iter_ops  # noqa: F401 - re-exported: the loader's callers use it
from mstar_runtime.plan.records import Collective, KVGeometry, ShardSpec, TensorSpec, TensorSplit

NODE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
)
DEVICES = ("cpu", "cuda")
ENGINES = ("kv", "stateless")
PROGRAM_OPS = ("seq", "call", "parallel", "loop", "on_stream", "emit", "acc", "fork", "transfer")
_MAX_PROBLEMS = 20  # a broken plan usually breaks in many places; the first few say enough


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


# ------------------------------------------------------------------------------- parsing
_KINDS: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {"int": (int,), "str": (str,), "dict": (dict,), "list": (list,), "bool": (bool,), "num": (int, float)}
)


class _Reader:
    """Typed field access into the body; every miss is a PlanError naming the field's path."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, message: str) -> PlanError:
        return PlanError(self.path, f"malformed plan: {message}")

    def get(self, obj: Any, key: str, kind: str, where: str, *, optional: bool = False) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(f"{where} is not an object")
        value = obj.get(key)
        if value is None:
            if optional:
                return None
            raise self.fail(f"{where} has no '{key}'")
        ok = isinstance(value, _KINDS[kind]) and not (kind in ("int", "num") and isinstance(value, bool))
        if not ok:
            raise self.fail(f"{where}.{key} should be {kind}, got {type(value).__name__}")
        return value

    def ints(self, obj: Any, key: str, where: str) -> tuple[int, ...]:
        values = self.get(obj, key, "list", where)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise self.fail(f"{where}.{key} should be a list of integers")
        return tuple(values)

    def strs(self, obj: Any, key: str, where: str) -> tuple[str, ...]:
        values = self.get(obj, key, "list", where)
        if not all(isinstance(v, str) for v in values):
            raise self.fail(f"{where}.{key} should be a list of strings")
        return tuple(values)


def _parse_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body's sections as typed parts (the fields of `Plan`), checking their JSON shape."""
    r = _Reader(path)
    model = r.get(body, "model", "dict", "plan")
    placement = r.get(body, "placement", "dict", "plan")
    memory = r.get(body, "memory", "dict", "plan")
    weights = r.get(body, "weights", "dict", "plan")
    ranks = tuple(
        _parse_rank(r, d, f"placement.ranks[{i}]")
        for i, d in enumerate(r.get(placement, "ranks", "list", "placement"))
    )
    nodes = {name: _parse_node(r, name, d) for name, d in r.get(body, "nodes", "dict", "plan").items()}
    walks = r.get(body, "walks", "dict", "plan")
    for name, w in walks.items():
        r.get(w, "program", "dict", f"walks.{name}")
        r.strs(w, "streams", f"walks.{name}")
        for key in ("inputs", "outputs"):
            for i, port in enumerate(r.get(w, key, "list", f"walks.{name}")):
                r.get(port, "name", "str", f"walks.{name}.{key}[{i}]")
                r.get(port, "type", "dict", f"walks.{name}.{key}[{i}]")
    streams = {}
    for i, d in enumerate(r.get(body, "streams", "list", "plan")):
        s = StreamSpec(
            r.get(d, "id", "str", f"streams[{i}]"),
            r.get(d, "walk", "str", f"streams[{i}]"),
            r.get(d, "policy", "dict", f"streams[{i}]"),
            r.get(d, "capacity", "int", f"streams[{i}]"),
            r.get(d, "producer_rank", "int", f"streams[{i}]"),
            r.get(d, "consumer_rank", "int", f"streams[{i}]"),
            d,
        )
        streams[s.id] = s
    transitions = tuple(
        _parse_transition(r, d, f"transitions[{i}]")
        for i, d in enumerate(r.get(body, "transitions", "list", "plan"))
    )
    files = tuple(
        WeightFile(
            r.get(f, "name", "str", "weights.files[]"),
            r.get(f, "header_sha256", "str", "weights.files[]"),
            r.get(f, "bytes", "int", "weights.files[]"),
        )
        for f in r.get(weights, "files", "list", "weights")
    )
    page_size = r.get(placement, "page_size", "int", "placement")
    mem_page = r.get(memory, "page_size", "int", "memory")
    if page_size < 1 or mem_page != page_size:
        raise r.fail(f"page_size is {page_size} in placement but {mem_page} in memory")
    return {
        "compiler": r.get(body, "compiler", "str", "plan"),
        "model_name": r.get(model, "name", "str", "model"),
        "variant": r.get(model, "variant", "str", "model"),
        "source": r.get(model, "source", "str", "model"),
        "config": MappingProxyType(r.get(model, "config", "dict", "model")),
        "weights": WeightsSpec(
            r.get(weights, "kind", "str", "weights"),
            r.get(weights, "path", "str", "weights", optional=True),
            files,
        ),
        "ranks": ranks,
        "page_size": page_size,
        "max_batch": r.get(placement, "max_batch", "int", "placement"),
        "nodes": MappingProxyType(nodes),
        "walks": MappingProxyType(walks),
        "streams": MappingProxyType(streams),
        "memory": tuple(
            _parse_memory(r, d, f"memory.ranks[{i}]")
            for i, d in enumerate(r.get(memory, "ranks", "list", "memory"))
        ),
        "resident": MappingProxyType(_parse_resident(r, placement)),
        "call_ranks": MappingProxyType(
            {
                step: r.ints(placement["call_ranks"], step, "placement.call_ranks")
                for step in r.get(placement, "call_ranks", "dict", "placement")
            }
        ),
        "_transitions": transitions,
        "hosts": tuple(
            tuple(r.ints(h, "ranks", "placement.hosts[]"))
            for h in r.get(placement, "hosts", "list", "placement", optional=True) or []
        ),
    }


def _parse_rank(r: _Reader, d: Any, where: str) -> RankSpec:
    return RankSpec(
        r.get(d, "rank", "int", where),
        r.get(d, "type", "str", where),
        r.get(d, "name", "str", where),
        r.get(d, "memory_bytes", "int", where),
        d,
    )


def _parse_node(r: _Reader, name: str, d: Any) -> PlanNode:
    where = f"nodes.{name}"
    engine = r.get(d, "engine", "str", where)
    dtype = r.get(d, "dtype", "str", where)
    if engine not in ENGINES:
        raise r.fail(f"{where}.engine is '{engine}'; expected one of: {', '.join(ENGINES)}")
    if dtype not in NODE_DTYPES:
        raise r.fail(f"{where}.dtype is '{dtype}'; expected one of: {', '.join(NODE_DTYPES)}")
    phases = {}
    for pname, p in r.get(d, "phases", "dict", where).items():
        pw = f"{where}.phases.{pname}"
        reads = []
        for i, rd in enumerate(r.get(p, "reads", "list", pw, optional=True) or []):
            reads.append(ReadSpec(r.get(rd, "node", "str", f"{pw}.reads[{i}]"),
                                  r.get(rd, "tag", "str", f"{pw}.reads[{i}]", optional=True)))
        phases[pname] = PhaseSpec(pname, r.strs(p, "inputs", pw), r.strs(p, "outputs", pw), tuple(reads))
    tag_max_len = {tag: r.get(d["tag_max_len"], tag, "int", f"{where}.tag_max_len")
                   for tag in r.get(d, "tag_max_len", "dict", where, optional=True) or {}}
    arch = None
    a = r.get(d, "arch", "dict", where, optional=True)
    if a is not None:
        aw = f"{where}.arch"
        kv = r.get(a, "kv", "dict", aw, optional=True)
        tensors = []
        for i, t in enumerate(r.get(a, "tensors", "list", aw)):
            if not (
                isinstance(t, list)
                and len(t) == 4
                and isinstance(t[0], str)
                and isinstance(t[1], list)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in t[1])
                and isinstance(t[2], str)
                and isinstance(t[3], str)
            ):
                raise r.fail(f"{aw}.tensors[{i}] should be [name, shape, dtype, shard]")
            tensors.append(TensorSpec(t[0], tuple(t[1]), t[2], t[3]))
        kv_shape = None
        if kv is not None:
            kv_shape = KVGeometry(
                r.get(kv, "layers", "int", f"{aw}.kv"),
                r.get(kv, "kv_heads", "int", f"{aw}.kv"),
                r.get(kv, "head_dim", "int", f"{aw}.kv"),
            )
        arch = ArchSpec(
            r.get(a, "name", "str", aw),
            MappingProxyType(r.get(a, "args", "dict", aw)),
            MappingProxyType(r.get(a, "dims", "dict", aw)),
            kv_shape,
            tuple(tensors),
            a,
        )
    s = r.get(d, "shard", "dict", where, optional=True)
    shard = _parse_shard(r, name, s, r.ints(d, "ranks", where), f"{where}.shard") if s is not None else None
    return PlanNode(
        name,
        engine,
        r.get(d, "impl", "str", where),
        dtype,
        r.strs(d, "tags", where),
        MappingProxyType(r.get(d, "settings", "dict", where)),
        MappingProxyType(phases),
        r.ints(d, "ranks", where),
        arch,
        shard,
        d,
        MappingProxyType(tag_max_len),
    )


def _parse_shard(r: _Reader, node: str, s: Any, ranks: tuple[int, ...], where: str) -> ShardSpec:
    """The node's `shard`; its ranks are the node's own (the plan's copy in `shard` is not read)."""
    splits = {}
    for tname, sp in r.get(s, "splits", "dict", where).items():
        splits[tname] = TensorSplit(
            r.get(sp, "kind", "str", f"{where}.splits.{tname}"),
            r.get(sp, "dim", "int", f"{where}.splits.{tname}", optional=True),
            r.get(sp, "parts", "int", f"{where}.splits.{tname}"),
        )
    collectives = tuple(
        Collective(r.get(c, "op", "str", f"{where}.collectives[{i}]"), r.get(c, "after", "str", f"{where}.collectives[{i}]"),
                   r.get(c, "count", "int", f"{where}.collectives[{i}]"))
        for i, c in enumerate(r.get(s, "collectives", "list", where))
    )
    return ShardSpec(
        node,
        r.get(s, "tp", "int", where),
        ranks,
        r.get(s, "heads_per_rank", "int", where, optional=True),
        r.get(s, "kv_heads_per_rank", "int", where, optional=True),
        r.get(s, "kv_replicas", "int", where),
        MappingProxyType(splits),
        collectives,
        r.get(s, "bytes_per_rank", "int", where),
    )


def _parse_memory(r: _Reader, d: Any, where: str) -> RankMemory:
    kv = {}
    for i, k in enumerate(r.get(d, "kv", "list", where)):
        kw = f"{where}.kv[{i}]"
        pool = KVPoolSpec(
            r.get(k, "node", "str", kw),
            r.get(d, "rank", "int", where),
            r.get(k, "pages", "int", kw),
            r.get(k, "tokens", "int", kw),
            r.get(k, "bytes_per_token", "int", kw),
            r.get(k, "max_seq_len", "int", kw),
        )
        kv[pool.node] = pool
    return RankMemory(
        r.get(d, "rank", "int", where),
        r.get(d, "capacity_bytes", "int", where),
        r.get(d, "weights_bytes", "int", where),
        r.get(d, "graph_pool_bytes", "int", where),
        r.get(d, "workspace_bytes", "int", where),
        MappingProxyType(kv),
    )


def _parse_resident(r: _Reader, placement: dict[str, Any]) -> dict[int, tuple[str, ...]]:
    resident = placement.get("resident")
    if isinstance(resident, dict):  # {rank: [nodes]} (JSON keys are strings)
        try:
            return {int(k): r.strs(resident, k, "placement.resident") for k in resident}
        except ValueError:
            raise r.fail("placement.resident keys should be rank numbers") from None
    out: dict[int, tuple[str, ...]] = {}
    for i, d in enumerate(r.get(placement, "resident", "list", "placement")):
        out[r.get(d, "rank", "int", f"placement.resident[{i}]")] = r.strs(
            d, "nodes", f"placement.resident[{i}]"
        )
    return out


def _parse_transition(r: _Reader, d: Any, where: str) -> TransitionSpec:
    keep = tuple(
        KeepSpec(
            r.get(k, "node", "str", f"{where}.keep[]"),
            r.get(k, "tag", "str", f"{where}.keep[]"),
            r.get(k, "as", "str", f"{where}.keep[]"),
        )
        for k in r.get(d, "keep", "list", where)
    )
    return TransitionSpec(
        r.get(d, "src", "str", where), r.get(d, "dst", "str", where), r.get(d, "when", "str", where), keep, d
    )


# ---------------------------------------------------------------------------- invariants
def _opt(op: Mapping[str, Any], key: str, kind: type) -> Any:
    """`op[key]` if it has type `kind`, else None: invariant checks report, they never raise."""
    value = op.get(key)
    return value if isinstance(value, kind) and not (kind is int and isinstance(value, bool)) else None


class _Invariants:
    """Cross-section checks; collects every violation so one run of the loader shows them all."""

    def __init__(self, parts: Mapping[str, Any]):
        self.p = parts
        self.nodes: Mapping[str, PlanNode] = parts["nodes"]
        self.n_ranks = len(parts["ranks"])
        self.problems: list[str] = []

    def add(self, message: str) -> None:
        self.problems.append(message)

    def rank_ok(self, rank: Any) -> bool:
        return isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < self.n_ranks

    def resident(self, node: str, rank: int) -> bool:
        return node in self.p["resident"].get(rank, ())

    def run(self) -> list[str]:
        p = self.p
        ranks = [r.rank for r in p["ranks"]]
        if ranks != list(range(self.n_ranks)) or not ranks:
            self.add(f"placement ranks should be 0..{self.n_ranks - 1} in order, got {ranks}")
        if [m.rank for m in p["memory"]] != ranks:
            self.add("memory should have one entry per rank, in rank order")
        for rank, names in p["resident"].items():
            if not self.rank_ok(rank):
                self.add(f"placement.resident names rank {rank}, out of range 0..{self.n_ranks - 1}")
            for n in names:
                if n not in self.nodes:
                    self.add(f"rank {rank} hosts unknown node '{n}'")
        for node in self.nodes.values():
            self.node(node)
        for name, walk in p["walks"].items():
            for op in self.ops(name, walk["program"]):
                self.op(name, walk, op)
            self.stream_inputs(name, walk)
        for s in p["streams"].values():
            if s.walk not in p["walks"]:
                self.add(f"stream '{s.id}' belongs to unknown walk '{s.walk}'")
            if not (self.rank_ok(s.producer_rank) and self.rank_ok(s.consumer_rank)):
                self.add(f"stream '{s.id}' has a rank out of range 0..{self.n_ranks - 1}")
        for t in p["_transitions"]:
            self.transition(t)
        return self.problems

    def ops(self, walk: str, region: Any) -> Iterator[Mapping[str, Any]]:
        """Pre-order ops, reporting (and skipping) malformed regions instead of raising."""
        kind = region.get("op") if isinstance(region, dict) else None
        if not isinstance(kind, str) or kind not in PROGRAM_OPS:
            self.add(f"walk '{walk}': a program region is not a known op ({str(kind)[:40]!r})")
            return
        yield region
        children: list[Any] = []
        listed = {"seq": "body", "parallel": "branches"}.get(kind)
        if listed is not None and not isinstance(region.get(listed), list):
            # a missing or null list would pass here and break every later walk over the program
            self.add(f"walk '{walk}': a '{kind}' op's '{listed}' should be a list")
        if kind == "seq":
            children = _opt(region, "body", list) or []
        elif kind == "parallel":
            children = [
                b.get("body") if isinstance(b, dict) else None for b in _opt(region, "branches", list) or []
            ]
        elif kind in ("loop", "on_stream"):
            children = [region.get("body")]
        for child in children:
            yield from self.ops(walk, child)

    def node(self, node: PlanNode) -> None:
        if not node.ranks:
            self.add(f"node '{node.name}' is placed on no rank")
        for rank in node.ranks:
            if not self.rank_ok(rank):
                self.add(f"node '{node.name}' is placed on rank {rank}, out of range 0..{self.n_ranks - 1}")
            elif not self.resident(node.name, rank):
                self.add(f"node '{node.name}' is placed on rank {rank} but is not resident there")
        if node.engine != "kv":
            return
        if node.arch is None or node.arch.kv is None:
            self.add(f"kv node '{node.name}' has no KV geometry (arch.kv)")
        if not node.tags:
            self.add(f"kv node '{node.name}' has no KV tags")
        for tag, n in node.tag_max_len.items():
            if tag not in node.tags or n < 1:
                self.add(f"kv node '{node.name}' bounds tag '{tag}' to max_len {n}; a bound is a positive int "
                         f"of one of its tags ({', '.join(node.tags)})")
        for phase in node.phases.values():
            for rd in phase.reads:
                owner = self.nodes.get(rd.node)
                if owner is None or owner.engine != "kv":
                    self.add(f"phase {node.name}.{phase.name} reads {rd.node!r}, which is not a kv node")
                elif rd.tag is not None and rd.tag not in owner.tags:
                    self.add(f"phase {node.name}.{phase.name} reads {rd.node}@{rd.tag}; "
                             f"tags: {', '.join(owner.tags)}")
        for rank in node.ranks:
            if self.rank_ok(rank) and rank < len(self.p["memory"]):
                pool = self.p["memory"][rank].kv.get(node.name)
                if pool is None or pool.pages < 1:
                    self.add(f"kv node '{node.name}' has no KV pages on rank {rank}")

    def op(self, walk: str, program: Mapping[str, Any], op: Mapping[str, Any]) -> None:
        kind = op["op"]
        if kind == "call":
            self.call(walk, op)
        elif kind == "on_stream":
            sid = _opt(op, "stream", str)
            if sid not in self.p["streams"] or sid not in program["streams"]:
                self.add(f"walk '{walk}' on_stream '{op.get('id', '?')}' reads unknown stream {sid!r}")
        elif kind == "fork":
            node = self.nodes.get(_opt(op, "node", str) or "")
            if node is None or node.engine != "kv":
                self.add(f"walk '{walk}' forks {op.get('node')!r}, which is not a kv node")
            elif op.get("src") not in node.tags or op.get("dst") not in node.tags:
                self.add(
                    f"walk '{walk}' forks {node.name}@{op.get('src')} -> @{op.get('dst')}; "
                    f"tags: {', '.join(node.tags)}"
                )
        elif kind == "transfer":
            if not (self.rank_ok(op.get("src")) and self.rank_ok(op.get("dst"))):
                self.add(
                    f"walk '{walk}' transfers {op.get('value')!r} between ranks "
                    f"{op.get('src')!r} -> {op.get('dst')!r}, out of range 0..{self.n_ranks - 1}"
                )
        elif kind == "loop":
            self.cohort(walk, program, op)
        elif kind == "parallel":
            for b in _opt(op, "branches", list) or []:
                rank = b.get("rank") if isinstance(b, dict) else None
                if rank is not None and not self.rank_ok(rank):
                    self.add(f"walk '{walk}' parallel '{op.get('id', '?')}' puts a branch on rank {rank!r}")

    def call(self, walk: str, op: Mapping[str, Any]) -> None:
        step = f"walk '{walk}' step '{_opt(op, 'id', str) or '?'}'"
        node = self.nodes.get(_opt(op, "node", str) or "")
        if node is None:
            self.add(f"{step} calls unknown node {op.get('node')!r}")
            return
        phase = node.phases.get(_opt(op, "phase", str) or "")
        if phase is None:
            self.add(
                f"{step} calls unknown phase {node.name}.{op.get('phase')!r}; "
                f"phases: {', '.join(node.phases) or '(none)'}"
            )
        tag = op.get("tag")
        if node.engine == "kv" and tag not in node.tags:
            self.add(f"{step} uses KV tag {tag!r} of '{node.name}', which has tags: {', '.join(node.tags)}")
        if node.engine == "stateless" and tag is not None:
            self.add(f"{step} gives a KV tag to stateless node '{node.name}'")
        ranks = _opt(op, "ranks", list)
        ranks_ok = bool(ranks) and all(self.rank_ok(x) for x in ranks)
        if not ranks_ok:
            self.add(
                f"{step} ({node.name}.{op.get('phase')}) runs on ranks {op.get('ranks')!r}, "
                f"out of range 0..{self.n_ranks - 1}"
            )
        else:
            for x in ranks:
                if not self.resident(node.name, x):
                    self.add(f"{step} runs '{node.name}' on rank {x}, where it is not resident")
        if phase is None:
            return
        self.reads(step, node, phase, op, ranks if ranks_ok else [])
        args = _opt(op, "args", dict)
        if args is None:
            self.add(f"{step} has no argument map")
        elif extra := sorted(set(args) - set(phase.inputs)):
            self.add(f"{step} passes {', '.join(extra)} that {node.name}.{phase.name} does not take")
        results = _opt(op, "results", list)
        if results is None:
            self.add(f"{step} has no result list")
            return
        for res in results:
            if not (
                isinstance(res, list)
                and len(res) == 2
                and res[0] in phase.outputs
                and isinstance(res[1], str)
            ):
                self.add(f"{step} binds {res!r}, not [output port of {node.name}.{phase.name}, name]")

    def reads(self, step: str, node: PlanNode, phase: PhaseSpec, op: Mapping[str, Any], ranks: list[int]) -> None:
        """A call's `reads`: one resolved {node, tag} per read of its phase, of a context (not its
        own) whose node has a KV pool on every rank the call runs on."""
        reads = op.get("reads", [])
        fn = f"{node.name}.{phase.name}"
        if not isinstance(reads, list) or len(reads) != len(phase.reads):
            self.add(f"{step} reads {reads!r}; {fn} reads "
                     + (", ".join(f"{r.node}@{r.tag or '<its tag>'}" for r in phase.reads) or "nothing"))
            return
        for rd, want in zip(reads, phase.reads):
            owner = self.nodes.get(rd.get("node")) if isinstance(rd, dict) else None
            tag = rd.get("tag") if isinstance(rd, dict) else None
            if owner is None or owner.name != want.node or not isinstance(tag, str) or tag not in owner.tags \
                    or (want.tag is not None and tag != want.tag) or (want.tag is None and tag != op.get("tag")):
                self.add(f"{step} reads {rd!r}, not the context {want.node}@{want.tag or op.get('tag')} {fn} reads")
                continue
            if (owner.name, tag) == (node.name, op.get("tag")):
                self.add(f"{step} reads its own context {owner.name}@{tag}")
            for x in ranks:
                if x < len(self.p["memory"]) and owner.name not in self.p["memory"][x].kv:
                    self.add(f"{step} reads {owner.name}@{tag} on rank {x}, where '{owner.name}' has no KV pool")

    def stream_inputs(self, walk: str, program: Mapping[str, Any]) -> None:
        """A walk input the client streams in names a stream of this walk whose edge starts at it."""
        for port in program["inputs"]:
            sid = port.get("stream")
            if sid is None:
                continue
            spec = self.p["streams"].get(sid) if isinstance(sid, str) else None
            edge = spec.raw.get("edge") if spec is not None else None
            if spec is None or sid not in program["streams"] or spec.walk != walk or not (
                isinstance(edge, str) and edge.startswith(f"{walk}.{port['name']}->")
            ):
                self.add(f"walk '{walk}' streams input '{port['name']}' into {sid!r}, which is not a stream of "
                         f"the walk that starts at that input")

    def cohort(self, walk: str, program: Mapping[str, Any], op: Mapping[str, Any]) -> None:
        """A non-null cohort mark names a call of the loop's own body and ports of its phase
        (its shape is the schema's, checked before)."""
        mark = op.get("cohort")
        if mark is None:
            return  # not a cohort, or a plan from before schema 1.1
        where = f"walk '{walk}' loop '{op['id']}'"
        items = op["body"]["body"] if op["body"]["op"] == "seq" else []
        call = next((c for c in items if c["op"] == "call" and c["id"] == mark["call"]), None)
        if call is None:
            self.add(f"{where}: its cohort names call {mark['call'][:40]!r}, which is not a call of the loop's body")
            return
        node = self.nodes.get(call["node"])
        phase = node.phases.get(call["phase"]) if node is not None else None
        if node is None or phase is None:
            return  # the call's own check reports it
        fn = f"{node.name}.{phase.name}"
        for dst, src in mark["fed"]:
            if dst not in phase.inputs:
                self.add(f"{where}: its cohort feeds input '{dst}', which {fn} does not take")
            if src not in phase.outputs:
                self.add(f"{where}: its cohort feeds back output '{src}', which {fn} does not produce")
        for port in mark["invariant"]:
            if port not in phase.inputs:
                self.add(f"{where}: its cohort holds input '{port}' invariant, which {fn} does not take")
        outputs = [o["name"] for o in program["outputs"]]
        for out, port in mark["emits"]:
            if out not in outputs:
                self.add(f"{where}: its cohort emits '{out}', which is not an output of the walk")
            if port not in phase.outputs:
                self.add(f"{where}: its cohort emits output '{port}', which {fn} does not produce")

    def transition(self, t: TransitionSpec) -> None:
        for w in (t.src, t.dst):
            if w not in self.p["walks"]:
                self.add(f"transition {t.src} -> {t.dst} names unknown walk '{w}'")
        for k in t.keep:
            node = self.nodes.get(k.node)
            if node is None or node.engine != "kv":
                self.add(f"transition {t.src} -> {t.dst} keeps '{k.node}@{k.tag}', not a kv node")
            elif k.tag not in node.tags or k.as_tag not in node.tags:
                self.add(
                    f"transition {t.src} -> {t.dst} keeps {k.node}@{k.tag} as @{k.as_tag}; "
                    f"tags: {', '.join(node.tags)}"
                )


def _null_cohorts(walks: Mapping[str, Any]) -> None:
    """Every loop without a `cohort` key (a plan from before schema 1.1) gets `None`."""
    for walk in walks.values():
        for op in iter_ops(walk["program"]):
            if op.get("op") == "loop" and "cohort" not in op:
                op["cohort"] = None  # type: ignore[index]  # the body's own dicts, not yet handed out


# ------------------------------------------------------------------------------- loading
def load_plan(
    path: str | os.PathLike[str], *, device: str | None = None, kv_pages_cap: int | None = None
) -> Plan:
    """Read and check a plan file (see the module docstring for the checks and their order).

    `kv_pages_cap` caps every KV pool (tests that force preemption with ~10 pages; a GPU
    plan tried on the CPU); the conductor and the workers both read the capped count.
    """
    where = os.fspath(path)
    try:
        body = planfile.read(where)
    except planfile.PlanFileError as e:
        raise PlanError(where, str(e).removeprefix(f"{where}: ")) from None
    if kv_pages_cap is not None and kv_pages_cap < 1:
        raise PlanError(where, f"kv_pages_cap must be >= 1, got {kv_pages_cap}")
    _check_requires(where, body)
    _raise_problems(where, check.check_body(body))
    parts = _parse_body(where, body)
    _raise_problems(where, _Invariants(parts).run())
    _null_cohorts(parts["walks"])
    resolved = _hardware_fit(where, parts, device, kv_pages_cap)
    return Plan(path=where, device=resolved, kv_pages_cap=kv_pages_cap, body=body, **parts)


def _raise_problems(path: str, problems: list[str]) -> None:
    """A PlanError listing the problems (the first `_MAX_PROBLEMS`), if there are any."""
    if not problems:
        return
    shown = problems[:_MAX_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    head = shown[0] if len(problems) == 1 else f"{len(problems)} problems:\n  " + "\n  ".join(shown) + more
    raise PlanError(path, f"invalid plan: {head}", tuple(problems))


# Plan features beyond schema 1.1 this runtime implements (docs/plan-format.md, "Required
# features"); a plan that requires another one computes something else when its fields are
# ignored, so it is refused before anything else is read.
SUPPORTED_FEATURES: frozenset[str] = frozenset({"kv_reads", "input_streams"})


def _check_requires(path: str, body: Mapping[str, Any]) -> None:
    required = body.get("requires", [])
    if not isinstance(required, list) or not all(isinstance(f, str) for f in required):
        raise PlanError(path, "malformed plan: `requires` must be a list of feature names")
    missing = [f for f in required if f not in SUPPORTED_FEATURES]
    if missing:
        raise PlanError(path, f"this plan requires {', '.join(missing)}, which this runtime does not implement "
                        f"(it implements: {', '.join(sorted(SUPPORTED_FEATURES)) or 'none'}; docs/plan-format.md, "
                        "Required features); compile the model without those constructs")


def _hardware_fit(path: str, parts: Mapping[str, Any], device: str | None, cap: int | None) -> str:
    ranks: tuple[RankSpec, ...] = parts["ranks"]
    memory: tuple[RankMemory, ...] = parts["memory"]
    cuda_plan = any(r.type == "cuda" for r in ranks)
    if device is not None and device not in DEVICES:
        raise PlanError(path, f"unknown device '{device}'; use one of: {', '.join(DEVICES)}")
    wanted = device or ("cuda" if cuda_plan else "cpu")
    if wanted == "cpu":
        # Every rank of a CPU run shares this host's memory; KV pools are allocated whole.
        need = sum(m.used_bytes(cap, graphs=False) for m in memory)
        have = _host_memory_bytes()
        if have is not None and need > have:
            raise PlanError(
                path,
                f"running on the CPU needs {need / 2**30:.1f} GiB (weights, KV pools, workspace) but this "
                f"machine has {have / 2**30:.1f} GiB; cap the KV pools (load_plan(..., kv_pages_cap=N)) or "
                "compile for a placement with less memory",
            )
        return "cpu"
    if not torch.cuda.is_available():
        if device is None:
            raise PlanError(
                path,
                f"the plan was compiled for {len(ranks)} CUDA rank(s) ({ranks[0].name}), but "
                "this machine has no CUDA GPU; run it on the CPU with device='cpu' "
                "(mstar-run --device cpu) or compile it for placements/cpu.yaml",
            )
        raise PlanError(path, "device 'cuda' was asked for, but this machine has no CUDA GPU")
    count = torch.cuda.device_count()
    # a plan over several hosts is checked as one of them: GPU i holds each host's i-th rank
    hosts: tuple[tuple[int, ...], ...] = parts["hosts"] or (tuple(r.rank for r in ranks),)
    need_gpus = max(len(h) for h in hosts)
    if count < need_gpus:
        raise PlanError(
            path,
            f"the plan needs {need_gpus} GPU(s){' per host' if len(hosts) > 1 else ''}, one per rank; this "
            f"machine has {count}; compile it for a placement with fewer ranks",
        )
    for mem in memory:
        gpu = next((h.index(mem.rank) for h in hosts if mem.rank in h), mem.rank)
        props = torch.cuda.get_device_properties(gpu)
        need = mem.used_bytes(cap)
        if props.total_memory < need:
            raise PlanError(
                path,
                f"rank {mem.rank} needs {need / 2**30:.1f} GiB (weights, KV pool, CUDA graphs, "
                f"workspace) but GPU {gpu} ({props.name}) has {props.total_memory / 2**30:.1f} "
                "GiB; compile it for a placement that matches this GPU",
            )
    return "cuda"


def _host_memory_bytes() -> int | None:
    """Physical memory of this host, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
