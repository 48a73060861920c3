"""schedule: each walk's step program, the tree the conductor interprets per request.

Requires: `verify`, `place`, `streams` and `cuda-graphs` have run (the graph has its
          transfer vertices).
Ensures:  every region's body is emitted in a topological order of the graph's dataflow
          (mstarc/graph.py) within that region: a statement after every statement of the
          same body whose values it reads (a read inside a nested region counts for the
          region; values from the previous loop iteration and stream items do not
          order), each value `transfer` vertex right before the call it feeds, ties in
          source order (a vertex's `order` attribute when a pass set one, else its `pos`;
          transfers of one call by value name, then source rank). Source order is such an
          order, so a program lists its statements as written.
          `model.schedule[walk]` is a JSON-ready dict: the walk's typed inputs (with
          defaults) and outputs (append or set), and `program`, a region tree of ops:
          `seq`, `call` (node, phase, tag, ranks, args, results, the CUDA graph it replays,
          the streams its outputs feed, and `reads`, the other KV contexts it attends to,
          when its phase has any), `parallel` (branches with their rank), `loop`
          (count or max/until, index, carry, accumulated values, whole-loop graph),
          `on_stream` (the buffer it drains), `emit`, `acc`, `fork`, and `transfer`
          (a value copied between ranks, placed right before the step that needs it).
          Every `loop` has a `cohort` mark (computed by `mstarc.cohorts.cohort_mark` on the
          emitted op): null, or `{call, fed, invariant, emits[, accs][, index]}` when the
          loop is a steady-state cohort (`{links: [...]}` of such marks for a chain). The rule, all of which must hold:
            - its body is a `seq` of value transfers into the call (a var it takes, to its
              rank: a carried value first bound on another rank), then `acc`s of carried
              vars the call rebinds, then one `call`, then only `emit`s of mode `append`
              and `acc`s whose value is a var bound by that call (no other transfer, no
              loop, parallel, fork or second call), one acc op per acc of the loop;
            - (the call may run on one rank or on the ranks of its node's
              tensor-parallel group: every rank of the group runs the column step);
            - every argument of the call is a const, or a result of that call named in
              the loop's `carry` (fed back), or the loop's index, or a var bound nowhere
              in the body (invariant);
            - a dynamic loop's `until` is a result of that call;
            - every `feeds` entry of the call names one of its result ports.
          Then `call` is the call's id, `fed` the `[input port, output port]` pairs of the
          fed-back arguments, `invariant` the input ports of consts and invariant vars
          (both sorted by input port), `emits` the `[walk output, output port]` pairs of
          the emits in body order, and `accs` (only when the loop has accs) the
          `[acc name, output port, "in" | "out"]` of its acc ops in body order (before
          the call, or after it), and `index` (only when the call takes the loop's
          index) the input ports bound to it, sorted. Fixed and dynamic loops both qualify.
          A body of several calls (a chain) qualifies by the same rule read per call, where
          every call is a kv call (a non-null tag) on its own node and the first call's
          ranks, no result name is bound twice, an argument may be a result of an earlier
          call (`chained`), a carried argument is fed back from its own call only, an emit
          or an "out" acc follows the call it takes, and `until` is any call's result; its
          mark is `{links: [...]}`, one such mark per call in body order, with `chained`
          (`[input port, link, output port]`, sorted) on a link that takes an earlier one's
          result (docs/plan-format.md, "Cohort loops": chains).
          The program is a pure function of the IR: the same model gives the same bytes.
Fails when: never (everything it needs was checked by earlier passes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import networkx as nx

from mstarc import ir as I
from mstarc.cohorts import cohort_mark
from mstarc.graph import lca_children
from mstarc.routes import emit_modes, routes_json


def schedule(model: I.ModelIR) -> I.ModelIR:
    index = _Index(model)
    programs = {name: _Scheduler(model, walk, index).program() for name, walk in sorted(model.walks.items())}
    return dataclasses.replace(model, schedule=programs)


class _Index:
    """What every walk's scheduler looks up, grouped once for the model (not once per walk)."""

    def __init__(self, model: I.ModelIR):
        flow = model.graph.flow
        self.order: dict[str, int] = {}  # transfer vertex -> its index in the placement's list
        tids = {flow.nodes[v]["ir"]: v for v in flow if flow.nodes[v]["kind"] == "transfer"}
        for i, t in enumerate(model.placement.transfers):
            if t in tids:
                self.order[tids[t]] = i
        self.buffers: dict[str, list] = {}  # walk -> its stream buffers
        for b in model.stream_buffers:
            self.buffers.setdefault(b.walk, []).append(b)
        self.stream_edges: dict[tuple[str, str], list[I.EdgeIR]] = {}  # producer port -> its streams, in order
        for e in model.edges:
            if e.streaming:
                self.stream_edges.setdefault((e.src_node, e.src_port), []).append(e)
        self.graph_of_step: dict[str, str] = {}
        self.graph_of_loop: dict[str, str] = {}
        call_ranks = model.placement.call_ranks
        for g in model.cuda_graphs:
            if g.kind == "loop":
                self.graph_of_loop[g.loop] = g.key
            else:
                for s in g.steps:
                    if call_ranks[s][0] == g.rank:
                        self.graph_of_step[s] = g.key
        self.deps = _lifted_dependencies(flow)


def _lifted_dependencies(flow: nx.MultiDiGraph) -> dict[str, list[tuple[str, str]]]:
    """Per region vertex, the (earlier child, later child) pairs of its body that a value
    orders: the child holding the value's definition and the child holding its reader."""
    deps: dict[str, list[tuple[str, str]]] = {}
    for u, v, d in flow.edges(data=True):
        if d["kind"] not in ("use", "transfer") or d.get("back") or d.get("vkind") not in ("value", "kv"):
            continue
        if flow.nodes[v]["kind"] == "transfer":
            continue  # the transfer's own out-edge orders the reader
        for origin in _origins(flow, d["value"] if d["kind"] == "transfer" else u, v):
            where = lca_children(flow, origin, v)
            if where is not None:
                deps.setdefault(where[0], []).append((where[1], where[2]))
    return deps


def _origins(flow: nx.MultiDiGraph, value: str, reader: str) -> list[str]:
    """The statements before `reader` that define a value vertex (its call, and an `acc` or
    `fork` that renames it). One at or after the reader reaches it only through a loop's
    back edge (a value renamed later in the previous iteration), which does not order."""
    pos = flow.nodes[reader]["pos"]
    return [o for o, _, d in flow.in_edges(value, data=True) if d["kind"] == "def"
            and flow.nodes[o]["kind"] != "walk" and flow.nodes[o].get("pos", pos) < pos]


def operand_json(op: I.Operand) -> dict[str, Any]:
    return {"var": op.name} if isinstance(op, I.Var) else {"const": op.value}


class _Scheduler:
    def __init__(self, model: I.ModelIR, walk: I.WalkIR, index: _Index):
        self.m, self.w, self.index = model, walk, index
        self.flow = model.graph.flow
        self.call_ranks = model.placement.call_ranks
        self.graph_of_step = index.graph_of_step
        self.graph_of_loop = index.graph_of_loop
        self.buffers = {b.edge: b for b in index.buffers.get(walk.name, ())}
        self.stream_edges = index.stream_edges

    def program(self) -> dict[str, Any]:
        modes = emit_modes(self.w)
        return {
            "walk": self.w.name,
            "inputs": [self.input(p) for p in self.w.inputs],
            "outputs": [{"name": p.name, "type": p.type.to_json(), "mode": modes.get(p.name, "set")}
                        for p in self.w.outputs],
            "streams": sorted(b.id for b in self.buffers.values()),
            "program": self.body(self.w.name),
            "routes": routes_json(self.w),
        }

    def input(self, p: I.ParamIR) -> dict[str, Any]:
        out = {"name": p.name, "type": p.type.to_json(), "default": p.default}
        for b in self.buffers.values():
            e = self.m.edge(b.edge)
            if e is not None and e.from_input and e.src_port == p.name:
                out["stream"] = b.id  # the client streams it into this buffer (only then: plans keep their bytes)
        return out

    def order(self, region: str) -> list[str]:
        """The region's body and the value transfers into its calls, topologically sorted."""
        flow = self.flow
        h = nx.DiGraph()
        key: dict[str, tuple] = {}
        for child in flow.nodes[region]["children"]:
            d = flow.nodes[child]
            rank = d.get("order", d["pos"])  # the tie-break: source order unless a pass set another
            key[child] = (rank, 1, "", 0, 0)
            h.add_node(child)
            if d["kind"] != "call":
                continue
            for t, _, e in flow.in_edges(child, data=True):
                td = flow.nodes[t]
                if e["kind"] == "transfer" and td["vkind"] == "value" and t not in key:
                    key[t] = (rank, 0, td["value"], td["src"], self.index.order[t])
                    h.add_edge(t, child)
                    for origin in () if e["back"] else _origins(flow, e["value"], child):  # the copy waits for the value
                        where = lca_children(flow, origin, child)
                        if where is not None and where[0] == region:
                            h.add_edge(where[1], t)
        h.add_edges_from(self.index.deps.get(region, ()))
        return list(nx.lexicographical_topological_sort(h, key=key.__getitem__))

    def body(self, region: str) -> dict[str, Any]:
        out: list[dict[str, Any]] = []
        for v in self.order(region):
            d = self.flow.nodes[v]
            if d["kind"] == "transfer":
                out.append({"op": "transfer", "value": d["value"], "src": d["src"], "dst": d["dst"]})
            else:
                out.append(self.statement(v, d))
        return {"op": "seq", "body": out}

    def statement(self, v: str, d: dict[str, Any]) -> dict[str, Any]:
        r = d["ir"]
        if isinstance(r, I.Call):
            return self.call(r)
        if isinstance(r, I.Parallel):
            return {"op": "parallel", "id": r.id, "branches": [
                {"name": self.flow.nodes[b]["ir"].name, "rank": self._branch_rank(self.flow.nodes[b]["ir"]),
                 "body": self.body(b)} for b in d["children"]]}
        if isinstance(r, I.Loop):
            loop: dict[str, Any] = {
                "op": "loop", "id": r.id, "dynamic": r.dynamic,
                "count": operand_json(r.count) if r.count is not None else None,
                "max": r.max, "until": r.until, "index": r.index, "carry": list(r.carry),
                "acc": [{"name": a.name, "value": operand_json(a.value)} for a in I.loop_accs(r.body)],
                "graph": self.graph_of_loop.get(r.id), "body": self.body(v)}
            loop["cohort"] = cohort_mark(loop)
            return loop
        if isinstance(r, I.OnStream):
            op = {"op": "on_stream", "id": r.id, "stream": self.buffers[r.stream].id, "as": r.name,
                  "body": self.body(v)}
            if r.carry is not None:  # a stream loop (plan feature `stream_loops`)
                op["carry"] = list(r.carry)
            return op
        if isinstance(r, I.Emit):
            return {"op": "emit", "output": r.output, "mode": "append" if r.op == "+=" else "set",
                    "value": operand_json(r.value)}
        if isinstance(r, I.Acc):
            return {"op": "acc", "name": r.name, "value": operand_json(r.value)}
        if isinstance(r, I.Fork):
            return {"op": "fork", "node": r.node, "src": r.src_tag, "dst": r.dst_tag}
        raise AssertionError(f"unknown statement {type(r).__name__}")  # pragma: no cover

    def call(self, c: I.Call) -> dict[str, Any]:
        node = self.m.nodes[c.node]
        phase = node.phases[c.phase]
        results = [[port, name] for port, name in zip(phase.outputs, c.results)]
        feeds = [{"stream": self.buffers[e.id].id, "port": e.src_port, "var": name}
                 for port, name in results for e in self.stream_edges.get((c.node, port), ())
                 if e.id in self.buffers]
        tag = c.tag if c.tag is not None else (node.tags[0] if node.engine == "kv" else None)
        op = {"op": "call", "id": c.id, "node": c.node, "phase": c.phase, "tag": tag,
              "ranks": list(self.call_ranks[c.id]),
              "args": {port: operand_json(op) for port, op in sorted(c.args.items())},
              "results": results, "graph": self.graph_of_step.get(c.id), "feeds": feeds}
        if phase.reads and tag is not None:  # only then: plans without reads keep their bytes
            op["reads"] = [dict(zip(("node", "tag"), r.resolve(tag).split("@", 1))) for r in phase.reads]
        return op

    def _branch_rank(self, branch: I.Branch) -> int | None:
        """The rank a branch runs on, when all its steps run on one (single-rank) group."""
        groups = {self.call_ranks[c.id] for c in I.iter_regions(branch.body) if isinstance(c, I.Call)}
        return next(iter(groups))[0] if len(groups) == 1 and len(next(iter(groups))) == 1 else None

