"""The IR: an elaborated model (one config variant) as nodes, edges and walk region trees.

`mstarc.lower` builds a `ModelIR` from the AST, with its networkx graph (`ModelIR.graph`, a
`GraphIR`: the topology and every walk's dataflow, built by `mstarc.graph`); every pass in
`mstarc.passes` is a pure function `ModelIR -> ModelIR` that fills one of the result fields
at the bottom of `ModelIR` and, where it changes the graph, gives it a new one (via
`dataclasses.replace`, never by mutation). Cycles, reachability, values that cross ranks and
step orders come from the graph; the dataclasses below are what its vertices carry. Region
trees mirror the walk primitives: `Seq`, `Parallel`, `Loop` (fixed or dynamic), `OnStream`,
and the leaf statements `Call`, `Emit`, `Acc`, `Fork`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx

# one dtype table, the plan records' (re-exported: the passes read I.DTYPE_BYTES)
from mstar_runtime.plan.records import DTYPE_BYTES  # noqa: F401
from mstarc.diagnostics import Span

if TYPE_CHECKING:
    from mstarc.archs import ArchSpec

ConfigValue = int | float | str | bool | list

SCALAR_KINDS = ("str", "int", "float", "bool", "image")

_NO_SPAN = Span.unknown()


@dataclass(frozen=True)
class ValueType:
    """A port or walk-value type: a scalar kind, or a tensor with dtype and (symbolic) dims."""

    kind: str  # "tensor" or one of SCALAR_KINDS
    dtype: str | None = None
    dims: tuple[int | str, ...] = ()

    def __str__(self) -> str:
        if self.kind != "tensor":
            return self.kind
        return f"{self.dtype}[{', '.join(str(d) for d in self.dims)}]"

    def to_json(self) -> dict[str, Any]:
        if self.kind != "tensor":
            return {"kind": self.kind}
        return {"kind": "tensor", "dtype": self.dtype, "dims": list(self.dims)}

    def compatible(self, other: ValueType) -> bool:
        """Same kind/dtype/rank; concrete dims equal; a symbolic dim matches anything.

        Kind "any" is the type of a value whose definition was already reported as an error:
        it matches everything, so one mistake does not cascade into many diagnostics.
        """
        if self.kind == "any" or other.kind == "any":
            return True
        if self.kind != other.kind or self.dtype != other.dtype:
            return False
        if self.kind != "tensor":
            return True
        if len(self.dims) != len(other.dims):
            return False
        return all(isinstance(a, str) or isinstance(b, str) or a == b for a, b in zip(self.dims, other.dims))


@dataclass(frozen=True)
class PortIR:
    name: str
    direction: str  # "in" | "out"
    type: ValueType
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class ReadIR:
    """A KV context a phase attends to besides its call's own: `reads NODE[@TAG]`."""

    node: str
    tag: str | None  # None: the tag of the call
    span: Span = field(default=_NO_SPAN, compare=False)

    def resolve(self, call_tag: str) -> str:
        """`node@tag` of the context a call on `call_tag` reads."""
        return f"{self.node}@{self.tag if self.tag is not None else call_tag}"


@dataclass(frozen=True)
class PhaseIR:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    span: Span = field(default=_NO_SPAN, compare=False)
    reads: tuple[ReadIR, ...] = ()


@dataclass(frozen=True)
class NodeIR:
    """A GraphNode: one resident instance of a component, shared by every walk that uses it."""

    name: str
    engine: str  # "kv" | "stateless"
    impl: str  # import path under mstar_models, e.g. "mstar_models.orpheus.LlamaBackbone"
    inputs: dict[str, PortIR]
    outputs: dict[str, PortIR]
    phases: dict[str, PhaseIR]
    tags: tuple[str, ...]  # KV contexts of one request (kv nodes); ("main",) by default
    settings: dict[str, ConfigValue]
    arch_name: str | None
    arch_args: dict[str, ConfigValue]
    arch: ArchSpec | None  # noqa: F821 - resolved lazily (TYPE_CHECKING import)
    dtype: str = "bf16"
    span: Span = field(default=_NO_SPAN, compare=False)
    tag_max_len: dict[str, int] = field(default_factory=dict)  # tags with their own bound (`cross(max_len=N)`)
    impl_settings: tuple[str, ...] = ()  # the names in `settings` given as the implementation's arguments

    def tag_of(self, call_tag: str | None) -> str:
        """The KV tag a call uses: its own, else the node's first."""
        return call_tag if call_tag is not None else (self.tags[0] if self.tags else "main")


@dataclass(frozen=True)
class ChunkPolicyIR:
    kind: str  # "fixed" | "sliding" | "left_context"
    params: dict[str, int]
    span: Span = field(default=_NO_SPAN, compare=False)

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.params.items())})"


@dataclass(frozen=True)
class EdgeIR:
    """A GraphEdge (tensor moves when the producer step ends) or, with a policy, a StreamingGraphEdge;
    a streaming edge may start at a walk's input (`from_input`): the client streams it in."""

    src_node: str
    src_port: str
    dst_node: str
    dst_port: str
    policy: ChunkPolicyIR | None = None
    span: Span = field(default=_NO_SPAN, compare=False)
    from_input: bool = False  # a stream whose producer is input `src_port` of walk `src_node`

    @property
    def id(self) -> str:
        return f"{self.src_node}.{self.src_port}->{self.dst_node}.{self.dst_port}"

    @property
    def streaming(self) -> bool:
        return self.policy is not None


# ---- walk regions -----------------------------------------------------------------------


@dataclass(frozen=True)
class Var:
    name: str
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Const:
    value: ConfigValue
    span: Span = field(default=_NO_SPAN, compare=False)


Operand = Var | Const


@dataclass(frozen=True)
class Call:
    id: str  # stable step id, e.g. "tts/s3"
    node: str
    phase: str
    tag: str | None  # None: the node's default tag (kv) or no tag (stateless)
    args: dict[str, Operand]  # input port -> operand
    results: tuple[str, ...]  # value names bound to the phase's outputs, in order (may be empty)
    span: Span = field(default=_NO_SPAN, compare=False)
    tag_span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Seq:
    body: tuple[Region, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Branch:
    name: str
    body: Seq
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Parallel:
    id: str
    branches: tuple[Branch, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Loop:
    """Loop(n) when not dynamic; DynamicLoop(max, until) when dynamic."""

    id: str
    dynamic: bool
    count: Operand | None  # trip count (fixed loops); None when missing (verify reports E040)
    max: int | None  # upper bound: required for dynamic loops and input-dependent counts
    until: str | None  # stop flag (dynamic loops)
    index: str | None
    carry: tuple[str, ...]
    body: Seq
    span: Span = field(default=_NO_SPAN, compare=False)
    clause_spans: dict[str, Span] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class OnStream:
    id: str
    stream: str  # EdgeIR.id of the streaming edge
    name: str  # the chunk's value name inside the body
    body: Seq
    span: Span = field(default=_NO_SPAN, compare=False)
    carry: tuple[str, ...] | None = None  # a stream loop's carried values (None: a block beside the walk)


@dataclass(frozen=True)
class Emit:
    output: str
    op: str  # "+=" appends (and streams) | "=" sets
    value: Operand
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Acc:
    name: str
    value: Operand
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Fork:
    node: str
    src_tag: str
    dst_tag: str
    span: Span = field(default=_NO_SPAN, compare=False)


Region = Call | Seq | Parallel | Loop | OnStream | Emit | Acc | Fork


@dataclass(frozen=True)
class ParamIR:
    name: str
    type: ValueType
    default: ConfigValue | None
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class RouteArgIR:
    """One `slot = value` of a `serves` declaration, unevaluated: a name of the walk or a string."""

    slot: str | None  # None: a positional argument (E081)
    value: str | None  # None: neither a name nor a string (E081)
    literal: bool  # a string rather than a name
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class RouteIR:
    """`serves ROUTE(...)`: an OpenAI route the walk serves (mstarc/routes.py checks it)."""

    route: str
    args: tuple[RouteArgIR, ...]
    span: Span = field(default=_NO_SPAN, compare=False)
    name_span: Span = field(default=_NO_SPAN, compare=False)

    def bind(self) -> dict[str, str]:
        """The slots it binds (as the plan writes them)."""
        return {a.slot: a.value for a in self.args if a.slot is not None and a.value is not None}


@dataclass(frozen=True)
class WalkIR:
    name: str
    inputs: tuple[ParamIR, ...]
    outputs: tuple[ParamIR, ...]
    body: Seq
    span: Span = field(default=_NO_SPAN, compare=False)
    routes: tuple[RouteIR, ...] = ()


@dataclass(frozen=True)
class KeepIR:
    node: str
    tag: str
    as_tag: str
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class TransitionIR:
    src: str
    dst: str
    when: str
    keep: tuple[KeepIR, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class CheckpointIR:
    """Weights given at compile time: a folder (relative path) or random weights ("dummy")."""

    kind: str  # "dummy" | "dir" | "none"
    path: str | None = None  # as given on the command line, relative where possible
    files: tuple[tuple[str, str, int], ...] = ()  # (file name, sha256 of its safetensors header, size)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (dtype, shape)


@dataclass(frozen=True)
class GraphIR:
    """A model's two graphs (`mstarc.graph` builds them and documents their vertices and edges):
    `topology`, the nodes, walks and the edges between them, and `flow`, every walk's dataflow."""

    topology: nx.MultiDiGraph
    flow: nx.MultiDiGraph

    def with_flow(self, flow: nx.MultiDiGraph) -> GraphIR:
        return GraphIR(self.topology, flow)

    def vertex(self, vid: str) -> dict[str, Any]:
        return self.flow.nodes[vid]

    def walk_vertices(self, walk: str) -> list[str]:
        """A walk's statement vertices in pre-order (the walk vertex first)."""
        out: list[str] = []
        stack = [walk]
        while stack:
            v = stack.pop()
            out.append(v)
            stack.extend(reversed(self.flow.nodes[v].get("children", ())))
        return out

    def uses(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """Every use edge that moves data (a `consumer`), in discovery order."""
        edges = [(u, v, k, d) for u, v, k, d in self.flow.edges(keys=True, data=True)
                 if d.get("kind") == "use" and d.get("consumer") is not None]
        edges.sort(key=lambda e: e[3]["seq"])
        return edges


@dataclass(frozen=True)
class ModelIR:
    name: str
    variant: str
    source: str  # display path of the .walk file
    config: dict[str, ConfigValue]
    nodes: dict[str, NodeIR]
    edges: tuple[EdgeIR, ...]
    walks: dict[str, WalkIR]
    transitions: tuple[TransitionIR, ...]
    checkpoint: CheckpointIR = field(default_factory=lambda: CheckpointIR("none"))
    span: Span = field(default=_NO_SPAN, compare=False)
    # the topology and the walks' dataflow (mstarc.graph builds it); built by lower, transformed by place
    graph: GraphIR | None = field(default=None, compare=False, repr=False)
    # ---- filled by passes (None until the pass ran) ----
    verified: bool = False
    warnings: tuple = ()  # Diagnostic warnings found by verify (printed, never fatal)
    placement: Any = None  # mstarc.passes.place.PlacementIR
    sharding: Any = None  # dict[node, mstarc.passes.shard_tp.ShardSpec]
    memory: Any = None  # mstarc.passes.memory.MemoryIR
    stream_buffers: Any = None  # tuple[mstarc.passes.streams.StreamBufferIR, ...]
    cuda_graphs: Any = None  # tuple[mstarc.passes.cuda_graphs.GraphCaptureIR, ...]
    schedule: Any = None  # dict[walk, step program (JSON-ready dict)]

    def edge(self, edge_id: str) -> EdgeIR | None:
        """The first edge with this id (an index built once per ModelIR, not a search)."""
        return self._edges_by_id.get(edge_id)

    @functools.cached_property
    def _edges_by_id(self) -> dict[str, EdgeIR]:  # not a field: `replace` starts a new one
        out: dict[str, EdgeIR] = {}
        for e in self.edges:
            out.setdefault(e.id, e)
        return out


def iter_regions(region: Region):
    """Pre-order traversal of a region tree."""
    yield region
    if isinstance(region, Seq):
        for r in region.body:
            yield from iter_regions(r)
    elif isinstance(region, Parallel):
        for b in region.branches:
            yield from iter_regions(b.body)
    elif isinstance(region, Loop | OnStream):
        yield from iter_regions(region.body)


def loop_accs(region: Region) -> list[Acc]:
    """The `acc` statements that belong to a loop: in its body and branches, not in nested loops."""
    if isinstance(region, Acc):
        return [region]
    if isinstance(region, Seq):
        return [a for r in region.body for a in loop_accs(r)]
    if isinstance(region, Parallel):
        return [a for b in region.branches for a in loop_accs(b.body)]
    return []  # a nested Loop owns its accs; OnStream blocks run beside the loop


def walk_calls(walk: WalkIR) -> list[Call]:
    return [r for r in iter_regions(walk.body) if isinstance(r, Call)]
