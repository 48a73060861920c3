"""place: which ranks hold each node, where every call runs, and which values cross ranks.

Requires: a verified `ModelIR` and a `PlacementSpec` (mstarc.placement).
Ensures:  `model.placement` is a `PlacementIR`: the ranks' devices; per node its ranks and
          TP degree; per call of every walk the rank group it runs on (`call_ranks`);
          per rank every node instance resident there (`resident`: where its calls
          run, every rank of its own entry, and its default rank if no walk calls it);
          and every value or KV context that a step on one rank hands to a step on
          another (`transfers`). The graph (`model.graph.flow`) gets the same
          transfers as vertices: a use edge whose value lives on ranks that do not hold
          its reader becomes value -> transfer -> reader (kind "transfer", one vertex per
          destination rank, id `<walk>.tN`), and every call vertex its `ranks`.
          Resolution order for a call: the innermost mapped (walk, branch), else the
          (walk, node) override, else the node's first TP group. Unplaced nodes go to
          `default_rank`, or with `spread` largest weights first onto the least-loaded
          rank (ties: lowest rank; equal weights: node name), so the result never
          depends on dict or hash order. An unplaced node whose phases read another
          node's KV context (`reads`) takes that node's ranks and tp instead.
          With `hosts` in the placement: each host's ranks (`hosts`), and every transfer
          between ranks of different hosts with the bytes it carries per step
          (`cross_host`, from the value's port type: symbolic dims stay factors; a KV
          context counts bytes per token).
Fails when: a rank is out of range (E051); an override names a group whose size is not the
          node's tp (E052); the model's section names an unknown node, or a walk override
          a node the walk never calls (E053); it names an unknown walk or branch (E054); a
          step that reads another KV context (`reads`) runs on other ranks than the steps
          that wrote it (E056); a tensor-parallel group (a node's, or one a walk or branch
          override names) has ranks on more than one host (E058).
          Each diagnostic points at the YAML value; all are collected.

Transfers are read off the graph's use edges (mstarc/graph.py), in their discovery order:
a value counts as defined by the call that binds it (a value accumulated with
`acc` in a loop, by the call that bound the accumulated value). A use is a call argument,
a stream chunk (the streaming edge's producer calls are its definitions), or one of the
conductor's reads, which happen beside rank 0 (`CONDUCTOR_RANK`): an `emit` (consumer
`<walk>:emit:<output>`), a loop's request-dependent trip count (`<loop>:count`) and a
dynamic loop's stop flag (`<loop>:until`). A KV context `node@tag` counts as a value
too (kind "kv"): every call on it reads and rewrites it, and `fork` copies it, so a
branch that continues a forked context on another rank shows the pages that must move.
A stream chunk's transfer (kind "stream") names the streaming edge: its items go from the
producer's rank to the stream buffer at the consumer's rank.
A group holds a TP node's outputs on every rank, so only ranks outside the producer's
group receive a copy, sent by the group's first rank. A KV context that a transition
keeps enters the target walk from the source walk's last calls on it (producer steps of
the source walk), so a chat context continued by a CFG branch on another rank moves too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mstar_runtime.sizes import human_bytes
from mstarc import ir as I
from mstarc.diagnostics import DiagnosticSink, Span
from mstarc.placement import SPREAD, NodePlacement, PlacementSpec, RankGroup

SCALAR_BYTES = {"int": 8, "float": 8, "bool": 1}  # what a scalar value costs on the wire, about

CONDUCTOR_RANK = 0
_NO_SPAN = Span.unknown()


@dataclass(frozen=True)
class RankIR:
    rank: int
    type: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int
    hbm_bytes_per_s: int | None
    span: Span = field(default=_NO_SPAN, compare=False)  # the device's YAML entry

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.type} {self.name}, {human_bytes(self.memory_bytes)})"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "type": self.type, "name": self.name, "memory_bytes": self.memory_bytes,
                "hbm_bytes_per_s": self.hbm_bytes_per_s}


@dataclass(frozen=True)
class TransferIR:
    walk: str
    value: str  # a walk value name, "node@tag" for a KV context, the edge id for a stream
    src_rank: int
    dst_rank: int
    producer_step: str
    consumer_step: str  # a call's step id, or a conductor read (see the module docstring)
    kind: str = "value"  # "value" | "kv" | "stream"

    def to_json(self) -> dict[str, Any]:
        return {"walk": self.walk, "value": self.value, "kind": self.kind, "src_rank": self.src_rank,
                "dst_rank": self.dst_rank, "producer_step": self.producer_step, "consumer_step": self.consumer_step}


@dataclass(frozen=True)
class CrossHostIR:
    """A transfer between ranks on different hosts, and what it carries each time it runs:
    `bytes` times every symbolic dim in `per` (a KV context: bytes per token); `bytes` None
    for a value whose size the types do not say (a string, an image, an accumulated list)."""

    transfer: TransferIR
    src_host: int
    dst_host: int
    bytes: int | None
    per: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**self.transfer.to_json(), "src_host": self.src_host, "dst_host": self.dst_host,
                "bytes": self.bytes, "per": list(self.per)}


@dataclass(frozen=True)
class PlacementIR:
    name: str
    ranks: tuple[RankIR, ...]
    kv_memory_fraction: float
    page_size: int
    max_batch: int
    node_ranks: dict[str, tuple[int, ...]]  # every rank of the node's own entry (TP groups in order)
    node_tp: dict[str, int]
    call_ranks: dict[str, tuple[int, ...]]  # step id -> ranks it runs on (one TP group)
    resident: dict[int, tuple[str, ...]]  # rank -> node instances there, sorted; every rank present
    transfers: tuple[TransferIR, ...]
    tp_spans: dict[str, Span] = field(default_factory=dict, compare=False)  # node -> YAML tp/ranks value
    hosts: tuple[tuple[int, ...], ...] = ()  # each host's ranks; empty: one host (no `hosts` key)
    cross_host: tuple[CrossHostIR, ...] = ()
    # node -> its `weights:` format ("fp8"), for the nodes whose entry gives one; the plan
    # records it in the node (`quantized`), not here
    node_weights: dict[str, str] = field(default_factory=dict)
    weights_spans: dict[str, Span] = field(default_factory=dict, compare=False)  # node -> the YAML value

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.hosts:  # only then: plans of placements without hosts keep their bytes
            extra = {"hosts": [{"host": h, "ranks": list(rs)} for h, rs in enumerate(self.hosts)],
                     "cross_host": [x.to_json() for x in self.cross_host]}
        return extra | {
            "name": self.name,
            "kv_memory_fraction": self.kv_memory_fraction,
            "page_size": self.page_size,
            "max_batch": self.max_batch,
            "ranks": [r.to_json() for r in self.ranks],
            "call_ranks": {s: list(r) for s, r in sorted(self.call_ranks.items())},
            "resident": [{"rank": r, "nodes": list(ns)} for r, ns in sorted(self.resident.items())],
            "transfers": [t.to_json() for t in self.transfers],
        }

    def host_of(self, rank: int) -> int | None:
        for h, rs in enumerate(self.hosts):
            if rank in rs:
                return h
        return None


def place(model: I.ModelIR, spec: PlacementSpec) -> I.ModelIR:
    sink = DiagnosticSink()
    ranks = tuple(RankIR(d.rank, d.type, d.name, d.memory_bytes, d.hbm_bytes_per_s, d.span) for d in spec.devices)
    section = spec.model(model.name)
    p = _Placer(model, spec, len(ranks), sink)
    node_ranks, node_tp, tp_spans = p.nodes(section.nodes)
    for name, span in tp_spans.items():  # the placed entries (a reader follows its owner's groups)
        rs, tp = node_ranks[name], node_tp[name]
        for i in range(0, len(rs) if tp > 1 else 0, tp):
            p.one_host(rs[i:i + tp], span, f"node '{name}'")
    call_ranks: dict[str, tuple[int, ...]] = {}
    for wname, wp in section.walks.items():
        if wname not in model.walks:
            sink.error("E054", f"placement names unknown walk '{wname}' of model '{model.name}'", wp.span,
                       _known("walks", model.walks))
    for walk in model.walks.values():
        wp = section.walks.get(walk.name)
        node_over = p.node_overrides(walk, wp.nodes if wp else {}, node_tp)
        branch_over = p.branch_overrides(walk, wp.branches if wp else {})
        resolver = _CallResolver(walk, node_ranks, node_tp, node_over, branch_over, sink)
        resolver.run(model.graph)
        call_ranks.update(resolver.call_ranks)
    sink.check()
    _check_reads(model, call_ranks, {**{d.rank: d.span for d in spec.devices}, **tp_spans}, sink)
    sink.check()
    resident = _resident(model, node_ranks, call_ranks, set(section.nodes), [r.rank for r in ranks])
    transfers, graph, carried = _transfers(model.graph, call_ranks)
    hosts = tuple(h.ranks for h in spec.hosts)
    host = {r: h for h, rs in enumerate(hosts) for r in rs}
    cross = tuple(CrossHostIR(t, host[t.src_rank], host[t.dst_rank], *_carried_bytes(model, carried[t]))
                  for t in transfers if hosts and host[t.src_rank] != host[t.dst_rank])
    weighted = {n: e for n, e in section.nodes.items() if e.weights is not None and n in model.nodes}
    return dataclasses.replace(model, graph=graph, placement=PlacementIR(
        spec.name, ranks, spec.kv_memory_fraction, spec.page_size, spec.max_batch, node_ranks, node_tp,
        call_ranks, resident, transfers, tp_spans, hosts, cross,
        {n: e.weights for n, e in weighted.items()}, {n: e.weights_span for n, e in weighted.items()}))


def _carried_bytes(model: I.ModelIR, value: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(bytes, symbolic dims) of one copy of a value vertex's value (see `CrossHostIR`)."""
    vkind, name = value["vkind"], value["name"]
    if vkind == "kv":
        node = model.nodes.get(name.split("@")[0])
        kv = node.arch.kv if node is not None and node.arch is not None else None
        if kv is None:
            return None, ("token",)
        return 2 * kv.layers * kv.kv_heads * kv.head_dim * I.DTYPE_BYTES.get(node.dtype, 2), ("token",)
    vtype: I.ValueType | None = None
    if vkind == "stream":  # the items one producer step pushes
        edge = next((e for e in model.edges if e.id == name), None)
        if edge is not None and edge.from_input:
            walk = model.walks.get(edge.src_node)
            vtype = next((p.type for p in walk.inputs if p.name == edge.src_port), None) if walk else None
        elif edge is not None and edge.src_node in model.nodes:
            port = model.nodes[edge.src_node].outputs.get(edge.src_port)
            vtype = port.type if port is not None else None
    else:
        origin = model.graph.flow.nodes.get(value["origin"], {})
        call = origin.get("ir")
        node = model.nodes.get(call.node) if isinstance(call, I.Call) else None
        port_name = value.get("port")
        if port_name is None and node is not None and name in call.results and call.phase in node.phases:
            outs = node.phases[call.phase].outputs
            i = call.results.index(name)
            port_name = outs[i] if i < len(outs) else None
        port = node.outputs.get(port_name) if node is not None and port_name is not None else None
        vtype = port.type if port is not None else None
    if vtype is None:
        return None, ()
    if vtype.kind != "tensor":
        return SCALAR_BYTES.get(vtype.kind), ()
    n = I.DTYPE_BYTES.get(vtype.dtype or "", 0)
    per: list[str] = []
    for d in vtype.dims:
        if isinstance(d, int):
            n *= d
        else:
            per.append(d)
    return n, tuple(per)


def _check_reads(model: I.ModelIR, call_ranks: dict[str, tuple[int, ...]], spans: dict, sink: DiagnosticSink) -> None:
    """A step that reads another KV context (`reads`) attends to its pages where they are:
    it must run on exactly the ranks of the steps that wrote it (the same TP group), since
    moving a context's pages before every step is never what a placement means."""
    flow = model.graph.flow
    seen: set[tuple[str, str]] = set()
    for u, v, _, d in model.graph.uses():
        if not d.get("read"):
            continue
        value = flow.nodes[u]
        src, dst = call_ranks.get(value["origin"]), call_ranks.get(v)
        if src is None or dst is None or src == dst or (v, value["name"]) in seen:
            continue
        seen.add((v, value["name"]))
        c = flow.nodes[v]["ir"]
        owner = value["name"].split("@")[0]
        span = spans.get(c.node) or spans.get(owner) or spans.get(dst[0]) or model.span
        sink.error("E056", f"step '{v}' ({c.node}.{c.phase}) reads {value['name']} on ranks {list(dst)}, but "
                   f"'{value['origin']}' wrote it on ranks {list(src)}", span,
                   f"place '{c.node}' on the ranks of '{owner}' (the same tensor-parallel group)")


def _transfers(graph: I.GraphIR, call_ranks: dict[str, tuple[int, ...]]
               ) -> tuple[tuple[TransferIR, ...], I.GraphIR, dict[TransferIR, dict[str, Any]]]:
    """Every use edge whose value lives on ranks that do not hold its reader becomes a path
    value -> transfer vertex -> reader (one transfer per destination rank), in the graph's
    discovery order: walks in source order, each walk's reads as reaching definitions found
    them. A reader on some of the value's ranks keeps its direct edge too. Also returns
    each transfer's value vertex (its attributes), which says what it carries."""
    flow = graph.flow.copy()
    found: dict[TransferIR, list[tuple[str, str, str, dict]]] = {}  # an ordered set, with the edges it splits
    split: list[tuple[str, str, str]] = []
    for u, v, k, d in graph.uses():
        value = flow.nodes[u]
        src, producer = call_ranks.get(value["origin"]), value["origin"]
        if src is None and d["vkind"] == "stream":  # a streamed walk input: its items arrive at the conductor
            src, producer = (CONDUCTOR_RANK,), f"{value['origin']}:input:{value['port']}"
        elif src is None:  # a walk input: the conductor has it
            continue
        reader = flow.nodes[v]
        dst = call_ranks[v] if reader["kind"] == "call" else (CONDUCTOR_RANK,)
        local = False
        for r in dst:
            if r in src:
                local = True
                continue
            t = TransferIR(reader["walk"], value["name"], src[0], r, producer, d["consumer"], d["vkind"])
            found.setdefault(t, []).append((u, v, k, d))
        if not local:
            split.append((u, v, k))
    count: dict[str, int] = {}
    for t, edges in found.items():
        count[t.walk] = count.get(t.walk, 0) + 1
        tid = f"{t.walk}.t{count[t.walk]}"
        flow.add_node(tid, kind="transfer", walk=t.walk, ir=t, value=t.value, vkind=t.kind, src=t.src_rank,
                      dst=t.dst_rank)
        for u, v, k, d in edges:
            if not flow.has_edge(u, tid, "transfer"):
                flow.add_edge(u, tid, key="transfer", kind="transfer", value=u, back=d["back"], vkind=d["vkind"])
            flow.add_edge(tid, v, key=k, kind="transfer", value=u, back=d["back"], vkind=d["vkind"])
    for u, v, k in split:
        flow.remove_edge(u, v, k)
    for cid, ranks in call_ranks.items():
        if cid in flow:
            flow.nodes[cid]["ranks"] = ranks
    carried = {t: graph.flow.nodes[edges[0][0]] for t, edges in found.items()}
    return tuple(found), graph.with_flow(flow), carried


def _resident(model: I.ModelIR, node_ranks: dict[str, tuple[int, ...]],
              call_ranks: dict[str, tuple[int, ...]], explicit: set[str],
              ranks: list[int]) -> dict[int, tuple[str, ...]]:
    """Where its calls run, every rank its own entry names (replicas the deployer asked
    for), and, if no walk calls it, its default rank; a rank's nodes sorted by name."""
    resident: dict[int, set[str]] = {r: set() for r in ranks}
    called: set[str] = set()
    for walk in model.walks.values():
        for c in I.walk_calls(walk):
            called.add(c.node)
            for r in call_ranks[c.id]:
                resident[r].add(c.node)
    for node, rs in node_ranks.items():
        if node in explicit or node not in called:
            for r in rs:
                resident[r].add(node)
    return {r: tuple(sorted(ns)) for r, ns in sorted(resident.items())}


def _known(what: str, names: Iterable[str]) -> str:
    names = sorted(names)
    return f"known {what}: {', '.join(names)}" if names else f"there are no {what}"


class _Placer:
    def __init__(self, model: I.ModelIR, spec: PlacementSpec, n_ranks: int, sink: DiagnosticSink):
        self.m, self.spec, self.n, self.sink = model, spec, n_ranks, sink
        self.host = {r: h.host for h in spec.hosts for r in h.ranks}

    def one_host(self, group: tuple[int, ...], span: Span, what: str) -> bool:
        """E058 unless the tensor-parallel `group` (ranks in range) runs on one host: its
        collectives run in every layer, at the speed of the link between its ranks."""
        hosts = {self.host[r] for r in group if r in self.host}
        if len(hosts) <= 1:
            return True
        where = ", ".join(f"rank {r} on host {self.host[r]}" for r in group if r in self.host)
        self.sink.error("E058", f"the tensor-parallel group {list(group)} of {what} spans hosts ({where})", span,
                        "keep a tp group on one host (its all-reduces run in every layer); replicas "
                        "(tp 1) or pipeline stages may sit on other hosts")
        return False

    def in_range(self, group: RankGroup, what: str) -> bool:
        ok = True
        for r, span in zip(group.ranks, group.rank_spans or (group.span,) * len(group.ranks)):
            if not 0 <= r < self.n:
                ok = False
                self.sink.error("E051", f"{what} is placed on rank {r}, but the placement has "
                                f"{self.n} rank{'s' if self.n != 1 else ''}", span,
                                f"known ranks: {', '.join(str(i) for i in range(self.n))}")
        return ok

    def nodes(self, entries: dict[str, NodePlacement]
              ) -> tuple[dict[str, tuple[int, ...]], dict[str, int], dict[str, Span]]:
        node_ranks: dict[str, tuple[int, ...]] = {}
        node_tp: dict[str, int] = {}
        spans: dict[str, Span] = {}
        for name, e in entries.items():
            if name not in self.m.nodes:
                self.sink.error("E053", f"placement names unknown node '{name}' of model '{self.m.name}'",
                                e.group.span, _known("nodes", self.m.nodes))
                continue
            if self.in_range(e.group, f"node '{name}'"):
                node_ranks[name], node_tp[name], spans[name] = e.ranks, e.tp, e.tp_span
        default = self.spec.default_rank
        if isinstance(default, int) and not 0 <= default < self.n:
            self.sink.error("E051", f"default_rank {default} is out of range", self.spec.default_rank_span,
                            f"known ranks: {', '.join(str(i) for i in range(self.n))}, or `spread`")
            default = 0
        unplaced = [n for n in self.m.nodes if n not in node_ranks and n not in entries]
        # a node whose steps read another's KV context goes where that context is (E056 otherwise)
        follows = {n: o for n in unplaced for o in _read_owners(self.m.nodes[n]) if o != n}
        own = [n for n in unplaced if n not in follows]
        if default == SPREAD:
            node_ranks.update(self.spread(own, node_ranks, node_tp))
        else:
            node_ranks.update({n: (int(default),) for n in own})
        for n in own:
            node_tp[n] = 1
        for n, owner in follows.items():
            leader = owner
            while leader in follows and leader != n:  # a reader of a reader follows the first owner
                leader = follows[leader]
            node_ranks[n] = node_ranks.get(leader, (int(default) if default != SPREAD else 0,))
            node_tp[n] = node_tp.get(leader, 1)
        return ({n: node_ranks[n] for n in self.m.nodes if n in node_ranks},
                {n: node_tp[n] for n in self.m.nodes if n in node_tp}, spans)

    def spread(self, unplaced: list[str], placed: dict[str, tuple[int, ...]],
               tp: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Largest weights first onto the least-loaded rank, counting explicitly placed nodes."""
        load = [0] * self.n
        for node, rs in placed.items():
            for r in rs:
                load[r] += _weight_bytes(self.m.nodes[node]) // tp[node]
        out: dict[str, tuple[int, ...]] = {}
        for node in sorted(unplaced, key=lambda n: (-_weight_bytes(self.m.nodes[n]), n)):
            r = min(range(self.n), key=lambda i: (load[i], i))
            load[r] += _weight_bytes(self.m.nodes[node])
            out[node] = (r,)
        return out

    def node_overrides(self, walk: I.WalkIR, entries: dict[str, RankGroup],
                       node_tp: dict[str, int]) -> dict[str, tuple[int, ...]]:
        called = {c.node for c in I.walk_calls(walk)}
        out: dict[str, tuple[int, ...]] = {}
        for name, g in entries.items():
            if name not in self.m.nodes:
                self.sink.error("E053", f"walk '{walk.name}' override names unknown node '{name}'", g.span,
                                _known("nodes", self.m.nodes))
            elif name not in called:
                self.sink.error("E053", f"walk '{walk.name}' never calls node '{name}'", g.span,
                                _known(f"nodes called by walk '{walk.name}'", called))
            elif self.in_range(g, f"node '{name}' in walk '{walk.name}'"):
                tp = node_tp.get(name, 1)
                if len(g.ranks) != tp:
                    self.sink.error("E052", f"walk '{walk.name}' runs node '{name}' on {len(g.ranks)} "
                                    f"rank{'s' if len(g.ranks) != 1 else ''}, but its tp is {tp}", g.span,
                                    f"name {tp} rank{'s' if tp != 1 else ''}: one tensor-parallel group")
                elif self.one_host(g.ranks, g.span, f"node '{name}' in walk '{walk.name}'"):
                    out[name] = g.ranks
        return out

    def branch_overrides(self, walk: I.WalkIR, entries: dict[str, RankGroup]) -> dict[str, RankGroup]:
        branches = {b.name for r in I.iter_regions(walk.body) if isinstance(r, I.Parallel) for b in r.branches}
        out: dict[str, RankGroup] = {}
        for name, g in entries.items():
            if name not in branches:
                self.sink.error("E054", f"walk '{walk.name}' has no branch '{name}'", g.span,
                                _known(f"branches of walk '{walk.name}'", branches))
            elif self.in_range(g, f"branch '{name}' of walk '{walk.name}'") and \
                    self.one_host(g.ranks, g.span, f"branch '{name}' of walk '{walk.name}'"):
                out[name] = g
        return out


def _read_owners(node: I.NodeIR) -> list[str]:
    """The nodes whose KV contexts this node's phases read, in phase order."""
    return list(dict.fromkeys(r.node for ph in node.phases.values() for r in ph.reads))


def _weight_bytes(node: I.NodeIR) -> int:
    return node.arch.bytes() if node.arch is not None else 0


class _CallResolver:
    """Assigns each call of one walk its rank group (innermost mapped branch wins)."""

    def __init__(self, walk: I.WalkIR, node_ranks: dict[str, tuple[int, ...]], node_tp: dict[str, int],
                 node_over: dict[str, tuple[int, ...]], branch_over: dict[str, RankGroup], sink: DiagnosticSink):
        self.walk, self.node_ranks, self.node_tp = walk, node_ranks, node_tp
        self.node_over, self.branch_over, self.sink = node_over, branch_over, sink
        self.call_ranks: dict[str, tuple[int, ...]] = {}
        self.reported: set[tuple[str, str]] = set()

    def run(self, graph: I.GraphIR) -> None:
        flow = graph.flow
        for v in graph.walk_vertices(self.walk.name):
            d = flow.nodes[v]
            if d["kind"] != "call":
                continue
            branch: tuple[str, RankGroup] | None = None
            up = d["parent"]
            while up is not None and self.branch_over:  # the innermost enclosing branch the placement maps
                ud = flow.nodes[up]
                if ud["kind"] == "branch" and ud["ir"].name in self.branch_over:
                    branch = (ud["ir"].name, self.branch_over[ud["ir"].name])
                    break
                up = ud["parent"]
            self.call(d["ir"], branch)

    def call(self, c: I.Call, branch: tuple[str, RankGroup] | None) -> None:
        tp = self.node_tp.get(c.node, 1)
        if branch is not None:
            name, g = branch
            if len(g.ranks) != tp:
                if (name, c.node) not in self.reported:
                    self.reported.add((name, c.node))
                    self.sink.error("E052", f"branch '{name}' of walk '{self.walk.name}' runs node '{c.node}' "
                                    f"(tp {tp}) on {len(g.ranks)} rank{'s' if len(g.ranks) != 1 else ''}", g.span,
                                    f"map the branch to {tp} rank{'s' if tp != 1 else ''}: one tensor-parallel group")
                return
            self.call_ranks[c.id] = g.ranks
        elif c.node in self.node_over:
            self.call_ranks[c.id] = self.node_over[c.node]
        else:
            self.call_ranks[c.id] = self.node_ranks.get(c.node, (0,))[:tp]
