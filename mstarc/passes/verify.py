"""verify: the model's names resolve, ports type-check, loops are bounded, walks are typed.

Requires: a lowered `ModelIR` (every expression evaluated).
Ensures:  every call names a known node, phase, tag and input ports, with every phase input
          given once and values of matching types; every value is bound before use; every
          value that crosses from one node to another follows a declared edge; every loop
          has a bound (Loop: n, DynamicLoop: max and a stop flag bound in its body); every
          stream block names a streaming edge that the walk feeds; every walk output is
          produced; transitions name real walks, flags and KV tags. Sets `verified`.
          From the graph (`model.graph`, mstarc/graph.py): no stream block feeds its own
          stream, directly or through other blocks (a cycle of the dataflow graph); every
          stream block is fired by a producer (a block with no `fires` edge is E047);
          transitions form no cycle (depth-first search of the topology's transition
          edges, E048); a node no walk `calls` is warning E019; a walk input, an `acc` or a
          stateless step whose values nothing reads is warning E037. Each walk's `serves`
          declarations fit their routes (mstarc/routes.py: E080-E083).
Fails when: any of the above does not hold (all diagnostics of the model, collected).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import networkx as nx

from mstarc import ir as I
from mstarc.diagnostics import DiagnosticSink, Span, spell_cycle
from mstarc.routes import check_routes

INT = I.ValueType("int")
BOOL = I.ValueType("bool")
ANY = I.ValueType("any")  # a value whose producer was already reported: matches everything


@dataclass(frozen=True)
class ValueInfo:
    type: I.ValueType
    producer: tuple[str, str] | None  # (node, out port) that produced it, None for inputs/constants
    stream: str | None = None  # set for an on-stream chunk: the streaming edge id
    streamed: str | None = None  # set for a walk input that arrives as a stream: that stream's id


def verify(model: I.ModelIR) -> I.ModelIR:
    sink = DiagnosticSink()
    _check_nodes(model, sink)
    _check_edges(model, sink)
    edges = _value_edges(model)
    for walk in model.walks.values():
        _WalkChecker(model, walk, sink, edges).run()
    _check_transitions(model, sink)
    _check_transition_cycles(model, sink)
    _check_usage(model, sink)
    _check_flow(model, sink)
    check_routes(model, sink)
    sink.check()
    warnings = tuple(d for d in sink.diagnostics if d.severity == "warning")
    return dataclasses.replace(model, verified=True, warnings=warnings)


def _check_nodes(model: I.ModelIR, sink: DiagnosticSink) -> None:
    for node in model.nodes.values():
        for ph in node.phases.values():
            for r in ph.reads:
                _check_read(model, node, ph, r, sink)
            for port in ph.inputs:
                if port not in node.inputs:
                    sink.error("E013", f"phase '{node.name}.{ph.name}' reads unknown input port '{port}'", ph.span,
                               _known("input ports", node.inputs))
            for port in ph.outputs:
                if port not in node.outputs:
                    sink.error("E013", f"phase '{node.name}.{ph.name}' writes unknown output port '{port}'", ph.span,
                               _known("output ports", node.outputs))


def _check_read(model: I.ModelIR, node: I.NodeIR, ph: I.PhaseIR, r: I.ReadIR, sink: DiagnosticSink) -> None:
    """`phase f(...) -> (...) reads OWNER[@TAG]`: a kv phase attending to another KV context,
    whose pages must have its own layout (the same layers, KV heads, head dim and dtype)."""
    where = f"phase '{node.name}.{ph.name}'"
    if node.engine != "kv":
        sink.error("E039", f"{where} reads KV contexts, but '{node.name}' is stateless", r.span,
                   "only a kv node's steps attend to KV contexts")
        return
    owner = model.nodes.get(r.node)
    if owner is None:
        sink.error("E012", f"{where} reads unknown node '{r.node}'", r.span, _known("nodes", model.nodes))
        return
    if owner.engine != "kv":
        sink.error("E039", f"{where} reads '{r.node}', which is stateless and holds no KV context", r.span)
        return
    if r.tag is not None and r.tag not in owner.tags:
        sink.error("E016", f"node '{r.node}' has no KV tag '{r.tag}'", r.span, _known("tags", owner.tags))
    if r.node == node.name and r.tag is None:
        sink.error("E039", f"{where} reads its own context", r.span,
                   f"a step attends to its own context anyway; name another tag: `reads {r.node}@TAG`")
    mine, theirs = _kv_layout(node), _kv_layout(owner)
    if mine is None or theirs is None:
        missing = node.name if mine is None else r.node
        sink.error("E039", f"{where} reads {r.node}'s context, but '{missing}' has no KV layout (an arch with KV)",
                   r.span, "give both nodes an `arch` whose KV geometry the compiler knows")
    elif mine != theirs:
        sink.error("E039", f"{where} reads {r.node}'s context, laid out as {_layout_text(theirs)}, but "
                   f"'{node.name}' attends as {_layout_text(mine)}", r.span,
                   "a reader attends layer by layer to the owner's pages: layers, KV heads, head dim and "
                   "dtype must agree")


def _read_text(r: I.ReadIR) -> str:
    return r.node + (f"@{r.tag}" if r.tag is not None else "")


def _kv_layout(node: I.NodeIR) -> tuple[int, int, int, str] | None:
    kv = node.arch.kv if node.arch is not None else None
    return (kv.layers, kv.kv_heads, kv.head_dim, node.dtype) if kv is not None else None


def _layout_text(layout: tuple[int, int, int, str]) -> str:
    layers, heads, head_dim, dtype = layout
    return f"{layers} layers x {heads} KV heads x {head_dim} ({dtype})"


def _known(what: str, names) -> str:
    names = sorted(names)
    return f"known {what}: {', '.join(names)}" if names else f"there are no {what}"


def _check_edges(model: I.ModelIR, sink: DiagnosticSink) -> None:
    for e in model.edges:
        if e.from_input:
            _check_input_stream(model, e, sink)
            continue
        src, dst = model.nodes.get(e.src_node), model.nodes.get(e.dst_node)
        for name, node in ((e.src_node, src), (e.dst_node, dst)):
            if node is None:
                sink.error("E012", f"edge {e.id} names unknown node '{name}'", e.span, _known("nodes", model.nodes))
        if src is None or dst is None:
            continue
        sp, dp = src.outputs.get(e.src_port), dst.inputs.get(e.dst_port)
        if sp is None:
            sink.error("E013", f"node '{src.name}' has no output port '{e.src_port}'", e.span, _known("output ports", src.outputs))
        if dp is None:
            sink.error("E013", f"node '{dst.name}' has no input port '{e.dst_port}'", e.span, _known("input ports", dst.inputs))
        if sp and dp and e.policy is None and not sp.type.compatible(dp.type):
            sink.error("E030", f"edge {e.id} joins {sp.type} to {dp.type}", e.span,
                       "producer and consumer ports need the same dtype, rank and dims")
        if sp and dp and e.policy is not None:
            _check_stream_types(e, sp.type, dp.type, sink)


def _check_input_stream(model: I.ModelIR, e: I.EdgeIR, sink: DiagnosticSink) -> None:
    """`stream WALK.INPUT -> node.port`: a tensor input of the walk, its first dim counting
    items as a producer port's does, into an input port of a node."""
    walk = model.walks[e.src_node]
    param = next((p for p in walk.inputs if p.name == e.src_port), None)
    if param is None:
        sink.error("E013", f"walk '{walk.name}' has no input '{e.src_port}'", e.span,
                   _known("inputs", [p.name for p in walk.inputs]))
    dst = model.nodes.get(e.dst_node)
    if dst is None:
        sink.error("E012", f"edge {e.id} names unknown node '{e.dst_node}'", e.span, _known("nodes", model.nodes))
        return
    dp = dst.inputs.get(e.dst_port)
    if dp is None:
        sink.error("E013", f"node '{dst.name}' has no input port '{e.dst_port}'", e.span, _known("input ports", dst.inputs))
    if param is not None and dp is not None:
        _check_stream_types(e, param.type, dp.type, sink)


def chunk_length(policy: I.ChunkPolicyIR) -> int | None:
    """The most items one chunk of this policy holds (None for a malformed policy)."""
    p = policy.params
    try:
        return {"fixed": lambda: p["size"], "sliding": lambda: p["window"],
                "left_context": lambda: max(p["chunk"] + p["left"], p.get("first", 0))}[policy.kind]()
    except KeyError:
        return None


def _check_stream_types(e: I.EdgeIR, src: I.ValueType, dst: I.ValueType, sink: DiagnosticSink) -> None:
    """A stream carries items: the producer's port is [n, *item] per step, the consumer's [chunk, *item]."""
    ok = src.kind == dst.kind == "tensor" and src.dtype == dst.dtype and len(src.dims) == len(dst.dims) >= 1 \
        and I.ValueType("tensor", src.dtype, src.dims[1:]).compatible(I.ValueType("tensor", dst.dtype, dst.dims[1:]))
    if not ok:
        sink.error("E030", f"stream {e.id} joins {src} to {dst}", e.span,
                   "a stream's ports need the same dtype and item dims; the first dim counts items")
        return
    need = chunk_length(e.policy) if e.policy else None
    lead = dst.dims[0]
    if need is not None and isinstance(lead, int) and lead != need:
        sink.error("E030", f"stream {e.id} delivers chunks of up to {need} items, but {e.dst_node}.{e.dst_port} "
                   f"takes {lead}", e.span, f"make the consumer's first dim {need} or symbolic")


def _value_edges(model: I.ModelIR) -> set[tuple[str, str, str, str]]:
    """The (src node, port, dst node, port) of every declared value edge."""
    return {(e.src_node, e.src_port, e.dst_node, e.dst_port) for e in model.edges if not e.streaming}


class _WalkChecker:
    def __init__(self, model: I.ModelIR, walk: I.WalkIR, sink: DiagnosticSink,
                 value_edges: set[tuple[str, str, str, str]]):
        self.m, self.w, self.sink = model, walk, sink
        self.outputs = {p.name: p for p in walk.outputs}
        self.emitted: set[str] = set()
        self.all_bound = {r for c in I.iter_regions(walk.body) if isinstance(c, I.Call) for r in c.results}
        self.loops: list[str] = []  # ids of the loops being checked, innermost last
        self.acc_values: dict[tuple[str, str], ValueInfo] = {}
        self.value_edges = value_edges
        self.input_names = {p.name for p in walk.inputs}

    def run(self) -> None:
        for p in self.w.inputs:
            if p.default is not None and not _default_fits(p.default, p.type):
                self.sink.error("E030", f"default of input '{p.name}' is {p.default!r}, which is not a {p.type}", p.span,
                                "an empty list [] is the empty tensor; other tensor defaults need the declared rank")
        env = self.inputs_env()
        self.top = {id(r) for r in self.w.body.body}  # the statements of the walk's body itself
        self.seq(self.w.body, env, loop_depth=0)
        for out in self.w.outputs:
            if out.name not in self.emitted:
                self.sink.error("E036", f"walk '{self.w.name}' never produces its output '{out.name}'", out.span,
                                f"add `emit {out.name} = VALUE` or `emit {out.name} += VALUE`")

    def inputs_env(self) -> dict[str, ValueInfo]:
        streamed = {e.src_port: e.id for e in self.m.edges if e.from_input and e.src_node == self.w.name}
        return {p.name: ValueInfo(p.type, None, streamed=streamed.get(p.name)) for p in self.w.inputs}

    # ---- values
    def use(self, op: I.Operand, env: dict[str, ValueInfo]) -> ValueInfo | None:
        if isinstance(op, I.Const):
            return None
        if op.name in env:
            info = env[op.name]
            if info.streamed is not None:
                self.sink.error("E047", f"input '{op.name}' arrives as stream {info.streamed}; it has no value "
                                "of its own", op.span, f"read its chunks in an `on stream {info.streamed.replace('->', ' -> ')}` block")
                return None
            return info
        if op.name in self.all_bound or op.name in self.input_names:
            self.sink.error("E034", f"value '{op.name}' is used before it is bound here", op.span,
                            "a value bound in a loop body or stream block is local to it unless carried or accumulated")
        else:
            self.sink.error("E011", f"unknown name '{op.name}'", op.span, "not a walk input, a bound value or a config value")
        return None

    def seq(self, seq: I.Seq, env: dict[str, ValueInfo], loop_depth: int) -> None:
        for r in seq.body:
            self.region(r, env, loop_depth)

    def region(self, r: I.Region, env: dict[str, ValueInfo], loop_depth: int) -> None:
        if isinstance(r, I.Call):
            self.call(r, env)
        elif isinstance(r, I.Loop):
            self.loop(r, env, loop_depth)
        elif isinstance(r, I.Parallel):
            self.parallel(r, env, loop_depth)
        elif isinstance(r, I.OnStream):
            self.on_stream(r, env, loop_depth)
        elif isinstance(r, I.Emit):
            self.emit(r, env)
        elif isinstance(r, I.Acc):
            if loop_depth == 0:
                self.sink.error("E049", f"`acc {r.name}` is outside a loop", r.span, "accumulate inside a loop body")
            info = self.use(r.value, env)
            if info is not None and self.loops:
                self.acc_values[(self.loops[-1], r.name)] = info
        elif isinstance(r, I.Fork):
            self.fork(r)
        elif isinstance(r, I.Seq):
            self.seq(r, env, loop_depth)

    def node_and_tag(self, node_name: str, tag: str | None, span: Span, tag_span: Span) -> I.NodeIR | None:
        node = self.m.nodes.get(node_name)
        if node is None:
            self.sink.error("E012", f"unknown node '{node_name}'", span, _known("nodes", self.m.nodes))
            return None
        if tag is not None:
            if node.engine != "kv":
                self.sink.error("E046", f"node '{node_name}' is stateless; '@{tag}' names a KV context", tag_span,
                                "only kv nodes have KV tags")
            elif tag not in node.tags:
                self.sink.error("E016", f"node '{node_name}' has no KV tag '{tag}'", tag_span, _known("tags", node.tags))
        return node

    def call(self, c: I.Call, env: dict[str, ValueInfo]) -> None:
        # The arguments are read before the results are bound: `x = a.f(x = x)` passes the old
        # `x`, which is type-checked (and edge-checked) like any other value.
        self.call_args(c, env)
        for name in c.results:  # bound even when the call is wrong, so errors do not cascade
            env[name] = ValueInfo(ANY, None)
        node = self.m.nodes.get(c.node)
        phase = node.phases.get(c.phase) if node is not None else None
        if node is None or phase is None:
            return
        if c.results and len(c.results) != len(phase.outputs):
            return
        for name, port in zip(c.results, phase.outputs):
            if port in node.outputs:  # an unknown port was reported with the phase; its value stays ANY
                env[name] = ValueInfo(node.outputs[port].type, (node.name, port))

    def call_args(self, c: I.Call, env: dict[str, ValueInfo]) -> None:
        node = self.node_and_tag(c.node, c.tag, c.span, c.tag_span)
        if node is None:
            for op in c.args.values():
                self.use(op, env)
            return
        phase = node.phases.get(c.phase)
        if phase is None:
            self.sink.error("E014", f"node '{c.node}' has no phase '{c.phase}'", c.span, _known("phases", node.phases))
            return
        for port, op in c.args.items():
            if port not in phase.inputs:
                self.sink.error("E013", f"phase '{c.node}.{c.phase}' has no input '{port}'", op.span,
                                _known("inputs", phase.inputs))
                continue
            self.check_arg(c, node, port, op, env)
        self.call_reads(c, node, phase)
        missing = [p for p in phase.inputs if p not in c.args]
        if missing:
            self.sink.error("E033", f"call to '{c.node}.{c.phase}' is missing input{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(missing)}", c.span, "every input port of a phase must be given")
        if c.results and len(c.results) != len(phase.outputs):
            self.sink.error("E032", f"'{c.node}.{c.phase}' has {len(phase.outputs)} output"
                            f"{'s' if len(phase.outputs) != 1 else ''} ({', '.join(phase.outputs)}), "
                            f"but {len(c.results)} name{'s are' if len(c.results) != 1 else ' is'} bound", c.span)

    def call_reads(self, c: I.Call, node: I.NodeIR, phase: I.PhaseIR) -> None:
        """A phase's `reads NODE` takes the call's tag: it must be one of NODE's, and another context."""
        if node.engine != "kv":
            return
        tag = node.tag_of(c.tag)
        seen: dict[str, I.ReadIR] = {}
        for r in phase.reads:
            owner = self.m.nodes.get(r.node)
            if owner is None or owner.engine != "kv":
                continue  # reported with the phase
            key = r.resolve(tag)
            if key in seen:  # `reads vlm@main, vlm` called @main: one context listed twice
                self.sink.error("E010", f"'{c.node}.{c.phase}' @{tag} reads {key} twice (`reads "
                                f"{_read_text(seen[key])}, {_read_text(r)}`)", c.tag_span,
                                f"list {key} once in the phase's reads")
                continue
            seen[key] = r
            if r.tag is None and tag not in owner.tags:
                self.sink.error("E016", f"'{c.node}.{c.phase}' @{tag} reads {r.node}@{tag}, but '{r.node}' has no "
                                f"KV tag '{tag}'", c.tag_span, _known("tags", owner.tags))
            elif r.resolve(tag) == f"{c.node}@{tag}" and r.tag is not None:
                self.sink.error("E039", f"'{c.node}.{c.phase}' @{tag} reads its own context {c.node}@{tag}", c.tag_span,
                                "call it on another tag, or read another one")

    def check_arg(self, c: I.Call, node: I.NodeIR, port: str, op: I.Operand, env) -> None:
        want = node.inputs[port].type
        if isinstance(op, I.Const):
            if not _const_fits(op.value, want):
                self.sink.error("E030", f"input '{port}' of '{c.node}.{c.phase}' is {want}, got constant "
                                f"{_shown(op.value)}", op.span)
            return
        info = self.use(op, env)
        if info is None:
            return
        if info.stream is not None:
            edge = self.m.edge(info.stream)
            if edge and (edge.dst_node, edge.dst_port) != (c.node, port):
                self.sink.error("E047", f"chunk '{op.name}' of stream {info.stream} must feed {edge.dst_node}.{edge.dst_port}",
                                op.span)
            return
        if not info.type.compatible(want):
            self.sink.error("E030", f"input '{port}' of '{c.node}.{c.phase}' is {want}, but '{op.name}' is {info.type}",
                            op.span)
        if info.producer and info.producer[0] != c.node:
            src_node, src_port = info.producer
            if (src_node, src_port, c.node, port) not in self.value_edges:
                self.sink.error("E035", f"'{op.name}' flows from {src_node}.{src_port} to {c.node}.{port} "
                                "but no edge declares it", op.span,
                                f"declare `edge {src_node}.{src_port} -> {c.node}.{port}`")

    def loop(self, lp: I.Loop, env: dict[str, ValueInfo], depth: int) -> None:
        kind = "dynamic_loop" if lp.dynamic else "loop"
        if lp.dynamic:
            if lp.max is None:
                self.sink.error("E040", "dynamic_loop has no bound", lp.span, "add max=N: every loop must be bounded")
            if lp.until is None:
                self.sink.error("E041", "dynamic_loop has no stop flag", lp.span, "add `until FLAG` (a bool bound in the body)")
        elif lp.count is None:
            self.sink.error("E040", "loop has no bound", lp.span, "add n=N: a Loop has a fixed trip count")
        elif isinstance(lp.count, I.Var):
            info = self.use(lp.count, env)
            if info is not None and info.type not in (INT, ANY):
                self.sink.error("E040", f"loop count '{lp.count.name}' is {info.type}, not int", lp.count.span)
            elif info is not None and lp.max is None:
                self.sink.error("E040", f"loop count '{lp.count.name}' comes from the request but the loop has no max",
                                lp.count.span, "add max=N so that the loop stays bounded")
        elif isinstance(lp.count, I.Const) and (isinstance(lp.count.value, bool) or not isinstance(lp.count.value, int)
                                                 or lp.count.value < 0):
            self.sink.error("E040", f"loop count must be a non-negative integer, got {_shown(lp.count.value)}",
                            lp.count.span)
        for name in lp.carry:
            if name not in env:
                self.sink.error("E034", f"carried value '{name}' is not bound before the {kind}", lp.span)
        inner = dict(env)
        if lp.index:
            inner[lp.index] = ValueInfo(INT, None)
        outer = set(env)
        assigned = {n for r in I.iter_regions(lp.body) if isinstance(r, I.Call) for n in r.results}
        for r in I.iter_regions(lp.body):
            if isinstance(r, I.Call):
                for n in r.results:
                    if n in outer and n not in lp.carry:
                        self.sink.error("E043", f"'{n}' is bound before the {kind} and assigned in its body without carry",
                                        r.span, f"add `carry {n}` to the {kind}, or use a new name")
        self.loops.append(lp.id)
        self.seq(lp.body, inner, depth + 1)
        self.loops.pop()
        if lp.dynamic and lp.until is not None:
            flag = inner.get(lp.until)
            if lp.until not in assigned:
                self.sink.error("E041", f"stop flag '{lp.until}' is not bound in the dynamic_loop body",
                                lp.clause_spans.get("until", lp.span))
            elif flag is not None and not _is_bool(flag.type):
                self.sink.error("E041", f"stop flag '{lp.until}' is {flag.type}, not bool", lp.clause_spans.get("until", lp.span))
        for name in lp.carry:  # carried values keep their (checked) type after the loop
            if name in inner and name in env:
                env[name] = inner[name]
        for r in I.loop_accs(lp.body):
            info = self.acc_values.get((lp.id, r.name))
            if info is not None:  # the accumulated value keeps its producer: the edge rule still applies
                t = info.type
                acc_type = I.ValueType("tensor", t.dtype, ("N",) + t.dims[1:]) if t.kind == "tensor" else t
                env[r.name] = ValueInfo(acc_type, info.producer)

    def parallel(self, par: I.Parallel, env: dict[str, ValueInfo], depth: int) -> None:
        names: set[str] = set()
        bound_by: dict[str, str] = {}
        merged: dict[str, ValueInfo] = {}
        for b in par.branches:
            if b.name in names:
                self.sink.error("E010", f"branch '{b.name}' appears twice", b.span)
            names.add(b.name)
            inner = dict(env)
            self.seq(b.body, inner, depth)
            for n, v in inner.items():
                if n in env and env[n] is v:
                    continue
                if n in bound_by:
                    self.sink.error("E045", f"'{n}' is bound in branches '{bound_by[n]}' and '{b.name}'", b.span,
                                    "each branch must bind distinct names")
                bound_by[n] = b.name
                merged[n] = v
        env.update(merged)

    def on_stream(self, block: I.OnStream, env: dict[str, ValueInfo], depth: int) -> None:
        edge = self.m.edge(block.stream)
        # the block starts with the walk (runtime/mstar_runtime/control/interpreter.py): it sees the walk's inputs only
        inner = self.inputs_env()
        if edge is not None and edge.from_input and edge.src_node != self.w.name:
            self.sink.error("E047", f"stream {edge.id} carries an input of walk '{edge.src_node}'; walk "
                            f"'{self.w.name}' cannot drain it", block.span,
                            f"drain it in walk '{edge.src_node}', or declare a stream from an input of "
                            f"'{self.w.name}'")
        if edge is None or not edge.streaming:
            known = [e.id for e in self.m.edges if e.streaming]
            self.sink.error("E047", f"no stream {block.stream} is declared", block.span, _known("streams", known))
            inner[block.name] = ValueInfo(ANY, None)
            self.seq(block.body, inner, depth)  # still check the body (and count its emits)
            return
        node = self.m.nodes.get(edge.dst_node)
        port = node.inputs.get(edge.dst_port) if node else None
        chunk = ValueInfo(port.type if port else I.ValueType("tensor", "f32", ("N",)), None, edge.id)
        if block.carry is not None:
            self.stream_loop(block, edge, chunk, env, depth)
            return
        inner[block.name] = chunk
        self.seq(block.body, inner, depth)

    def stream_loop(self, block: I.OnStream, edge: I.EdgeIR, chunk: ValueInfo, env: dict[str, ValueInfo],
                    depth: int) -> None:
        """`on stream ... carry NAMES`: the block runs in line, once per chunk, a loop over the
        chunks: it sees what the walk bound before it, and rebinds the carried values."""
        if not edge.from_input:
            self.sink.error("E047", f"stream {edge.id} is fed by a node: a block that carries values runs in "
                            "line and would hold up its producer", block.span,
                            "carry only over a stream from a walk input; drop `carry` to run the block beside the walk")
        if id(block) not in self.top:
            self.sink.error("E047", "a block that carries values must be a statement of the walk's body itself, "
                            "not inside a loop, branch or stream block", block.span,
                            "a stream is drained once: move the block to the walk's body")
        for name in block.carry or ():
            if name not in env:
                self.sink.error("E034", f"carried value '{name}' is not bound before the stream block", block.span)
        outer = set(env)
        for r in I.iter_regions(block.body):
            if isinstance(r, I.Call):
                for n in r.results:
                    if n in outer and n not in block.carry:
                        self.sink.error("E043", f"'{n}' is bound before the stream block and assigned in its body "
                                        "without carry", r.span, f"add `carry {n}` to the block, or use a new name")
        inner = dict(env)
        inner[block.name] = chunk
        self.seq(block.body, inner, depth)
        for name in block.carry or ():  # carried values keep their (checked) type after the block
            if name in inner and name in env:
                env[name] = inner[name]

    def emit(self, e: I.Emit, env: dict[str, ValueInfo]) -> None:
        out = self.outputs.get(e.output)
        if out is None:
            self.sink.error("E011", f"walk '{self.w.name}' has no output '{e.output}'", e.span, _known("outputs", self.outputs))
        info = self.use(e.value, env)
        self.emitted.add(e.output)
        if out is not None and isinstance(e.value, I.Const) and not _const_fits(e.value.value, out.type):
            self.sink.error("E030", f"output '{e.output}' is {out.type}, got constant {_shown(e.value.value)}", e.span)
            return
        if out is None or info is None:
            return
        t = info.type
        ok = t.dtype == out.type.dtype and t.kind == out.type.kind if e.op == "+=" else t.compatible(out.type)
        if not ok:
            self.sink.error("E030", f"output '{e.output}' is {out.type}, but '{e.value.name}' is {t}", e.span)

    def fork(self, f: I.Fork) -> None:
        node = self.node_and_tag(f.node, f.src_tag, f.span, f.span)
        if node is not None and node.engine == "kv":
            self.node_and_tag(f.node, f.dst_tag, f.span, f.span)


def _shown(value: I.ConfigValue) -> str:
    """A constant in a message: its repr, shortened (a list constant may be long)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(t: I.ValueType) -> bool:
    """A flag's type; ANY (a value whose producer was already reported) passes, so one error
    is not reported twice."""
    return t == ANY or t.kind == "bool" or (t.kind == "tensor" and t.dtype == "bool")


def _default_fits(value: I.ConfigValue, t: I.ValueType) -> bool:
    if t.kind == "tensor" and isinstance(value, list):
        return value == [] or _rank(value) == len(t.dims)
    if t.kind == "image":
        return False  # an image cannot be written as a literal
    return _const_fits(value, t)


def _rank(value: I.ConfigValue) -> int:
    return 1 + _rank(value[0]) if isinstance(value, list) and value else (1 if isinstance(value, list) else 0)


def _const_fits(value: I.ConfigValue, t: I.ValueType) -> bool:
    if t.kind == "str":
        return isinstance(value, str)
    if t.kind == "bool" or (t.kind == "tensor" and t.dtype == "bool"):
        return isinstance(value, bool)
    if t.kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if t.kind == "float" or (t.kind == "tensor" and t.dtype in ("bf16", "f16", "f32")):
        return isinstance(value, int | float | list) and not isinstance(value, bool)
    if t.kind == "tensor":
        return isinstance(value, int | list) and not isinstance(value, bool)
    return False


def _check_transitions(model: I.ModelIR, sink: DiagnosticSink) -> None:
    for t in model.transitions:
        for name in (t.src, t.dst):
            if name not in model.walks:
                sink.error("E018", f"transition names unknown walk '{name}'", t.span, _known("walks", model.walks))
        src = model.walks.get(t.src)
        if src is not None:
            flag = next((p for p in src.outputs if p.name == t.when), None)
            if flag is None or not _is_bool(flag.type):
                sink.error("E048", f"transition flag '{t.when}' must be a bool output of walk '{t.src}'", t.span)
        for k in t.keep:
            node = model.nodes.get(k.node)
            if node is None or node.engine != "kv":
                sink.error("E048", f"transition keeps '{k.node}@{k.tag}', but '{k.node}' is not a kv node", k.span)
                continue
            for tag in (k.tag, k.as_tag):
                if tag not in node.tags:
                    sink.error("E016", f"node '{k.node}' has no KV tag '{tag}'", k.span, _known("tags", node.tags))


def _check_transition_cycles(model: I.ModelIR, sink: DiagnosticSink) -> None:
    """A request's chain of walks is finite: no walk can be reached again through transitions.

    A transition's flag is computed per request (a node's output, or a constant), so the
    compiler cannot tell that a cycle ends: every cycle is refused, including `w -> w`. A
    depth-first search of the topology graph's transition edges from each walk in source
    order, transitions in file order; each transition that closes a cycle (a back edge) is
    reported, with the cycle spelled out."""
    topo = model.graph.topology
    out = {w: sorted(((v.removeprefix("walk:"), d) for _, v, d in topo.out_edges(f"walk:{w}", data=True)
                      if d["kind"] == "transition"), key=lambda e: e[1]["order"]) for w in model.walks}
    done: set[str] = set()
    for root in model.walks:
        if root in done:
            continue
        path, on_path = [root], {root: 0}  # walk -> its index in `path`
        stack = [iter(out[root])]
        while stack:
            for dst, d in stack[-1]:
                if dst in on_path:
                    cycle = path[on_path[dst]:] + [dst]
                    sink.error("E048", f"transitions can repeat walks forever: {spell_cycle(cycle)}", d["ir"].span,
                               "a request's walks must not repeat; repeat steps inside one walk with "
                               "`dynamic_loop max = N until FLAG`")
                    continue
                if dst in done:
                    continue
                on_path[dst] = len(path)
                path.append(dst)
                stack.append(iter(out[dst]))
                break
            else:
                stack.pop()
                del on_path[path[-1]]
                done.add(path.pop())


def _check_usage(model: I.ModelIR, sink: DiagnosticSink) -> None:
    """Model nodes no walk reaches through a `calls` edge of the topology graph."""
    topo = model.graph.topology
    for name, node in model.nodes.items():
        if not any(d["kind"] == "calls" for _, _, d in topo.in_edges(f"node:{name}", data=True)):
            sink.warning("E019", f"node '{name}' is not used by any walk", node.span)


def _check_flow(model: I.ModelIR, sink: DiagnosticSink) -> None:
    """What the dataflow graph shows: stream blocks nothing fires, streams that feed
    themselves, and values nothing reads."""
    flow = model.graph.flow
    for v, d in flow.nodes(data=True):
        if d["kind"] != "on_stream":
            continue
        block = d["ir"]
        edge = model.edge(block.stream)
        if edge is not None and not (edge.from_input and edge.src_node != d["walk"]) and not any(
                e["kind"] == "use" for _, _, e in flow.in_edges(v, data=True)):
            sink.error("E047", f"stream {block.stream} is never fed in walk '{d['walk']}'", block.span,
                       "a call in this walk must bind the stream's producer port")
    _check_stream_cycles(model, flow, sink)
    _check_reads_written(model, flow, sink)
    if not sink.has_errors:  # an error often is why a value looks unread (`x = a.f(x = q)`)
        _check_unused(model, flow, sink)


def _check_stream_cycles(model: I.ModelIR, flow: nx.MultiDiGraph, sink: DiagnosticSink) -> None:
    """A stream block that feeds, directly or through other blocks, the stream it drains.

    In the graph of a walk's `contains` edges, value definitions and reads (not from the
    previous loop iteration, not of KV contexts, whose blocks run beside the walk), every
    edge goes forward in the source, except the items of a stream, which go from their
    producer to the block wherever it is written. So a cycle is a chain of streams: the
    block runs when it has pushed items itself, and after the walk's streams closed."""
    if not any(_in_block(flow, flow.nodes[u]["origin"]) for u, v, d in flow.edges(data=True)
               if d["kind"] == "use" and flow.nodes[v]["kind"] == "on_stream"):
        return  # a cycle needs a producer inside a block: the only edges that go back are stream items
    h = nx.DiGraph()
    for u, v, d in flow.edges(data=True):
        if d["kind"] == "contains" or d["kind"] == "def" or (
                d["kind"] == "use" and not d["back"] and d["vkind"] in ("value", "stream")):
            if flow.nodes[u]["walk"] == flow.nodes[v]["walk"]:
                h.add_edge(u, v)
    for scc in nx.strongly_connected_components(h):
        if len(scc) < 2:
            continue
        blocks = sorted((v for v in scc if flow.nodes[v]["kind"] == "on_stream"), key=lambda v: flow.nodes[v]["pos"])
        if not blocks:  # pragma: no cover - every other edge goes forward in the source
            continue
        cycle = [u for u, _ in nx.find_cycle(h.subgraph(scc), source=blocks[0])]
        streams = [flow.nodes[v]["ir"].stream for v in cycle if flow.nodes[v]["kind"] == "on_stream"]
        first = flow.nodes[blocks[0]]["ir"]
        what = (f"stream {streams[0]} is fed from its own block" if len(streams) == 1 else
                "stream blocks feed each other's streams: " + spell_cycle(streams + streams[:1]))
        sink.error("E047", what, first.span, "call a stream's producer from the walk's main body, not from a block "
                   "that the stream (or a stream it feeds) fires")


def _check_reads_written(model: I.ModelIR, flow: nx.MultiDiGraph, sink: DiagnosticSink) -> None:
    """Every context a step reads is written by a step before it (or kept by a transition):
    a read with no `read` edge into the call would attend to nothing. A write counts only
    when it is sure to come first: not a later step of the reader's own loop body (its
    `read` edge is a back edge, so the first iteration would attend to nothing), and not a
    step inside an `on stream` block that does not hold the reader (the block runs beside
    the rest of the walk, so the read may come before any chunk arrived)."""
    for v, d in flow.nodes(data=True):
        if d["kind"] != "call":
            continue
        c = d["ir"]
        node = model.nodes.get(c.node)
        phase = node.phases.get(c.phase) if node is not None else None
        if phase is None or not phase.reads or node.engine != "kv":
            continue
        writes: dict[str, list[tuple[str, bool]]] = {}  # read key -> (writer vertex, back) of its edges
        for u, _, k, e in flow.in_edges(v, keys=True, data=True):
            if k.startswith("read:"):
                writes.setdefault(k, []).append((flow.nodes[u]["origin"], bool(e.get("back"))))
        own = node.tag_of(c.tag)
        for r in phase.reads:
            key = r.resolve(own)
            owner = model.nodes.get(r.node)
            if owner is None or owner.engine != "kv" or key.split("@", 1)[1] not in owner.tags \
                    or key == f"{c.node}@{own}":
                continue  # reported as E012, E039 or E016
            found = writes.get(f"read:{key}", [])
            if not found and _written_before_fired(model, flow, v, key):
                continue
            if not found:
                sink.error("E039", f"'{c.node}.{c.phase}' reads {key}, which no step of walk '{d['walk']}' writes "
                           "before it", c.span, f"call {r.node} on that tag first (a prefill), or keep the context "
                           "from another walk with a transition")
                continue
            beside = [w for w, back in found if not back and not _ordered_before(flow, w, v)]
            if any(not back and _ordered_before(flow, w, v) for w, back in found):
                continue
            if beside:
                sink.error("E039", f"'{c.node}.{c.phase}' reads {key}, which only an `on stream` block writes "
                           f"before it; the block runs beside the rest of walk '{d['walk']}', so the read may come "
                           "before the context holds anything", c.span,
                           f"write {key} in the main body before the read, or read it inside that block")
            else:
                sink.error("E039", f"'{c.node}.{c.phase}' reads {key}, which only a later step of its loop body "
                           "writes: the first iteration would read an empty context", c.span,
                           f"write {key} before the loop, or move the write before the read in the body")


def _written_before_fired(model: I.ModelIR, flow: nx.MultiDiGraph, reader: str, key: str) -> bool:
    """A reader inside an `on stream` block whose context the walk's main body writes before
    the block's first chunk exists: a step that writes `key` and comes before the block's
    first producer step, in a region that holds that producer (so it runs first). The block
    runs beside the walk wherever it is written, so this holds also for a block written above
    the write, which the reaching definitions (in source order) do not see."""
    block = _enclosing_block(flow, reader)
    if block is None:
        return False
    producers = [flow.nodes[u]["origin"] for u, _, k in flow.in_edges(block, keys=True) if k == "fires"]
    producers = [p for p in producers if p in flow and flow.nodes[p]["kind"] == "call"]
    if not producers:
        return False
    first = min(producers, key=lambda p: flow.nodes[p]["pos"])
    holders = set()
    up = flow.nodes[first].get("parent")
    while up is not None:
        holders.add(up)
        up = flow.nodes[up]["parent"]
    for _, d in flow.nodes(data=True):
        if d["kind"] != "call" or d["walk"] != flow.nodes[reader]["walk"] or d["pos"] > flow.nodes[first]["pos"]:
            continue
        c = d["ir"]
        node = model.nodes.get(c.node)
        if node is None or node.engine != "kv" or f"{c.node}@{node.tag_of(c.tag)}" != key:
            continue
        if d["parent"] in holders:
            return True
    return False


def _ordered_before(flow: nx.MultiDiGraph, writer: str, reader: str) -> bool:
    """A (non-back) write reaches the reader in order: it is in another walk (a context a
    transition kept), or not inside an `on stream` block, or inside a block that also
    holds the reader (the block's steps run in order for each chunk)."""
    if writer not in flow or flow.nodes[writer]["walk"] != flow.nodes[reader]["walk"]:
        return True
    block = _enclosing_block(flow, writer)
    if block is None:
        return True
    up = flow.nodes[reader].get("parent")
    while up is not None:
        if up == block:
            return True
        up = flow.nodes[up]["parent"]
    return False


def _enclosing_block(flow: nx.MultiDiGraph, vid: str) -> str | None:
    """The innermost `on stream` block holding statement `vid`, or None."""
    up = flow.nodes[vid].get("parent")
    while up is not None:
        if flow.nodes[up]["kind"] == "on_stream":
            return up
        up = flow.nodes[up]["parent"]
    return None


def _in_block(flow: nx.MultiDiGraph, vid: str) -> bool:
    up = flow.nodes[vid].get("parent") if vid in flow else None
    while up is not None:
        if flow.nodes[up]["kind"] == "on_stream":
            return True
        up = flow.nodes[up]["parent"]
    return False


def _check_unused(model: I.ModelIR, flow: nx.MultiDiGraph, sink: DiagnosticSink) -> None:
    """Warnings (E037) for values nothing reads where that is wasted work, not a result a
    phase happens to return: a walk input, an accumulated value, or every result of a
    stateless step (which has no other effect)."""
    def read(vid: str) -> bool:
        return any(e["kind"] == "use" for _, _, e in flow.out_edges(vid, data=True))

    carried = {(t.src, p.name) for t in model.transitions if t.dst in model.walks
               for p in model.walks[t.dst].inputs}  # inputs a transition hands on
    carried |= {(e.src_node, e.src_port) for e in model.edges if e.from_input}  # read through their stream
    for v, d in flow.nodes(data=True):
        kind = d["kind"]
        if kind == "walk":
            for p in d["ir"].inputs:
                vid = f"{v}/{p.name}"
                if vid in flow and not read(vid) and (v, p.name) not in carried:
                    sink.warning("E037", f"input '{p.name}' of walk '{v}' is never used", p.span,
                                 "remove it, or pass it to the phase that needs it")
        elif kind == "acc":
            made = [u for _, u, k in flow.out_edges(v, keys=True) if k == "acc"]
            if made and not any(read(u) for u in made):
                sink.warning("E037", f"accumulated value '{d['ir'].name}' is never used", d["ir"].span,
                             "emit it or pass it to a phase, or remove the acc")
        elif kind == "call":
            c = d["ir"]
            node = model.nodes.get(c.node)
            if node is None or node.engine != "stateless" or c.phase not in node.phases:
                continue
            made = [u for _, u, k in flow.out_edges(v, keys=True) if k == "def"]
            if not any(read(u) for u in made):
                sink.warning("E037", f"no result of '{c.node}.{c.phase}' is used", c.span,
                             "a stateless step has no other effect: use a result or remove the call")
