"""schedule: each walk's step program, the tree the conductor interprets per request.

Requires: `verify`, `place`, `streams` and `cuda-graphs` have run.
Ensures:  `model.schedule[walk]` is a JSON-ready dict: the walk's typed inputs (with
          defaults) and outputs (append or set), and `program`, a region tree of ops:
          `seq`, `call` (node, phase, tag, ranks, args, results, the CUDA graph it replays,
          the streams its outputs feed), `parallel` (branches with their rank), `loop`
          (count or max/until, index, carry, accumulated values, whole-loop graph),
          `on_stream` (the buffer it drains), `emit`, `acc`, `fork`, and `transfer`
          (a value copied between ranks, placed right before the step that needs it).
          Every `loop` has a `cohort` mark (computed by `mstarc.cohorts.cohort_mark` on the
          emitted op): null, or `{call, fed, invariant, emits}` when the loop is a
          steady-state cohort. The rule, all of which must hold:
            - its `acc` is empty and its `index` is null;
            - its body is a `seq` whose first op is one `call`, and every other op is an
              `emit` of mode `append` whose value is a var bound by that call (no
              transfer, loop, parallel, fork, acc or second call);
            - the call runs on one rank;
            - every argument of the call is a const, or a result of that call named in
              the loop's `carry` (fed back), or a var bound nowhere in the body (invariant);
            - a dynamic loop's `until` is a result of that call;
            - every `feeds` entry of the call names one of its result ports.
          Then `call` is the call's id, `fed` the `[input port, output port]` pairs of the
          fed-back arguments, `invariant` the input ports of consts and invariant vars
          (both sorted by input port), `emits` the `[walk output, output port]` pairs of
          the emits in body order. Fixed and dynamic loops both qualify.
          The program is a pure function of the IR: the same model gives the same bytes.
Fails when: never (everything it needs was checked by earlier passes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mstarc import ir as I
from mstarc.cohorts import cohort_mark


def schedule(model: I.ModelIR) -> I.ModelIR:
    index = _Index(model)
    programs = {name: _Scheduler(model, walk, index).program() for name, walk in sorted(model.walks.items())}
    return dataclasses.replace(model, schedule=programs)


class _Index:
    """What every walk's scheduler looks up, grouped once for the model (not once per walk)."""

    def __init__(self, model: I.ModelIR):
        self.transfers: dict[str, list] = {}  # walk -> its value transfers, in placement order
        for t in model.placement.transfers:
            if t.kind == "value":  # value moves before a call; kv/stream moves are listed in the placement
                self.transfers.setdefault(t.walk, []).append(t)
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


def operand_json(op: I.Operand) -> dict[str, Any]:
    return {"var": op.name} if isinstance(op, I.Var) else {"const": op.value}


class _Scheduler:
    def __init__(self, model: I.ModelIR, walk: I.WalkIR, index: _Index):
        self.m, self.w = model, walk
        self.call_ranks = model.placement.call_ranks
        self.transfers_by_consumer: dict[str, list] = {}
        for t in index.transfers.get(walk.name, ()):
            self.transfers_by_consumer.setdefault(t.consumer_step, []).append(t)
        self.graph_of_step = index.graph_of_step
        self.graph_of_loop = index.graph_of_loop
        self.buffers = {b.edge: b for b in index.buffers.get(walk.name, ())}
        self.stream_edges = index.stream_edges

    def program(self) -> dict[str, Any]:
        modes = _emit_modes(self.w)
        return {
            "walk": self.w.name,
            "inputs": [{"name": p.name, "type": p.type.to_json(), "default": p.default} for p in self.w.inputs],
            "outputs": [{"name": p.name, "type": p.type.to_json(), "mode": modes.get(p.name, "set")}
                        for p in self.w.outputs],
            "streams": sorted(b.id for b in self.buffers.values()),
            "program": self.region(self.w.body),
        }

    def region(self, r: I.Region) -> dict[str, Any]:
        if isinstance(r, I.Seq):
            body: list[dict[str, Any]] = []
            for item in r.body:
                if isinstance(item, I.Call):
                    body.extend(self.transfers(item.id))
                body.append(self.region(item))
            return {"op": "seq", "body": body}
        if isinstance(r, I.Call):
            return self.call(r)
        if isinstance(r, I.Parallel):
            return {"op": "parallel", "id": r.id, "branches": [
                {"name": b.name, "rank": self._branch_rank(b), "body": self.region(b.body)} for b in r.branches]}
        if isinstance(r, I.Loop):
            loop: dict[str, Any] = {
                "op": "loop", "id": r.id, "dynamic": r.dynamic,
                "count": operand_json(r.count) if r.count is not None else None,
                "max": r.max, "until": r.until, "index": r.index, "carry": list(r.carry),
                "acc": [{"name": a.name, "value": operand_json(a.value)} for a in I.loop_accs(r.body)],
                "graph": self.graph_of_loop.get(r.id), "body": self.region(r.body)}
            loop["cohort"] = cohort_mark(loop)
            return loop
        if isinstance(r, I.OnStream):
            return {"op": "on_stream", "id": r.id, "stream": self.buffers[r.stream].id, "as": r.name,
                    "body": self.region(r.body)}
        if isinstance(r, I.Emit):
            return {"op": "emit", "output": r.output, "mode": "append" if r.op == "+=" else "set",
                    "value": operand_json(r.value)}
        if isinstance(r, I.Acc):
            return {"op": "acc", "name": r.name, "value": operand_json(r.value)}
        if isinstance(r, I.Fork):
            return {"op": "fork", "node": r.node, "src": r.src_tag, "dst": r.dst_tag}
        raise AssertionError(f"unknown region {type(r).__name__}")  # pragma: no cover

    def call(self, c: I.Call) -> dict[str, Any]:
        node = self.m.nodes[c.node]
        phase = node.phases[c.phase]
        results = [[port, name] for port, name in zip(phase.outputs, c.results)]
        feeds = [{"stream": self.buffers[e.id].id, "port": e.src_port, "var": name}
                 for port, name in results for e in self.stream_edges.get((c.node, port), ())
                 if e.id in self.buffers]
        tag = c.tag if c.tag is not None else (node.tags[0] if node.engine == "kv" else None)
        return {"op": "call", "id": c.id, "node": c.node, "phase": c.phase, "tag": tag,
                "ranks": list(self.call_ranks[c.id]),
                "args": {port: operand_json(op) for port, op in sorted(c.args.items())},
                "results": results, "graph": self.graph_of_step.get(c.id), "feeds": feeds}

    def _branch_rank(self, branch: I.Branch) -> int | None:
        """The rank a branch runs on, when all its steps run on one (single-rank) group."""
        groups = {self.call_ranks[c.id] for c in I.iter_regions(branch.body) if isinstance(c, I.Call)}
        return next(iter(groups))[0] if len(groups) == 1 and len(next(iter(groups))) == 1 else None

    def transfers(self, step: str) -> list[dict[str, Any]]:
        return [{"op": "transfer", "value": t.value, "src": t.src_rank, "dst": t.dst_rank}
                for t in sorted(self.transfers_by_consumer.get(step, []), key=lambda t: (t.value, t.src_rank))]


def _emit_modes(walk: I.WalkIR) -> dict[str, str]:
    """Each output's mode, from its first emit in pre-order ("set" when it has none)."""
    modes: dict[str, str] = {}
    for r in I.iter_regions(walk.body):
        if isinstance(r, I.Emit) and r.output not in modes:
            modes[r.output] = "append" if r.op == "+=" else "set"
    return modes
