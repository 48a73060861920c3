"""Lowering: AST + variant (+ weights folder) -> `ModelIR`, evaluating every expression.

Requires: a parsed `ast.Model`.
Ensures:  every config expression, node setting, `arch` argument, port dim, walk default and
          chunk-policy parameter is a value; each node's `ArchSpec` is computed; walk bodies
          are region trees with stable step ids; `graph` is the model's networkx graph
          (mstarc/graph.py: topology and every walk's dataflow). Names are *not* checked across the model
          here: that is the `verify` pass's job, so lowering keeps unresolved names as `Var`s.
Fails when: a variant is unknown, a config value cannot be evaluated, a type is malformed,
          an architecture is unknown or rejects its arguments, a chunk policy is malformed,
          or a definition is duplicated (all collected, raised together as CompileError).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from mstar_runtime.plan.check import (
    MAX_CHUNK_ITEMS,
    MAX_KV_DIM,
    MAX_LOOP_BOUND,
    NODE_DTYPES,
    POLICY_OPTIONAL,
    POLICY_PARAMS,
    policy_param_min,
)
from mstarc import archs, ast, graph
from mstarc import ir as I
from mstarc.config import CheckpointConfig, EvalError, ValueBudget, evaluate, resolve_variant
from mstarc.diagnostics import DiagnosticSink, Span
from mstarc.settings import NODE_SETTINGS, TAG_ARGS, closest, setting_problem

ENGINES = ("kv", "stateless")
DTYPES = tuple(I.DTYPE_BYTES)


def lower(model: ast.Model, variant: str, source: str, weights: Path | None = None,
          checkpoint: I.CheckpointIR | None = None) -> I.ModelIR:
    sink = DiagnosticSink()
    ckpt_cfg = CheckpointConfig(weights)
    budget = ValueBudget()
    config = resolve_variant(model, variant, ckpt_cfg, sink, budget)
    if config is None:
        sink.check()
    lw = _Lowerer(config or {}, ckpt_cfg, sink, budget, partial=sink.has_errors)
    nodes = lw.nodes(model.nodes)
    edges = lw.edges(model.edges, model.streams, {w.name.name for w in model.walks})
    walks = lw.walks(model.walks)
    transitions = lw.transitions(model.transitions)
    sink.check()
    out = I.ModelIR(name=model.name.name, variant=variant, source=source, config=dict(config or {}),
                    nodes=nodes, edges=edges, walks=walks, transitions=transitions,
                    checkpoint=checkpoint or I.CheckpointIR("none"), span=model.span)
    return dataclasses.replace(out, graph=graph.build(out))


class _Lowerer:
    def __init__(self, config: dict[str, I.ConfigValue], ckpt: CheckpointConfig, sink: DiagnosticSink,
                 budget: ValueBudget | None = None, partial: bool = False):
        self.config, self.ckpt, self.sink = config, ckpt, sink
        # some settings failed (reported where they failed): a use of a missing one says nothing more
        self.partial = partial
        self.budget = budget if budget is not None else ValueBudget()
        self.node_names: set[str] = set()

    # ---- expressions
    def _config_lookup(self, name: str, span: Span) -> I.ConfigValue:
        if name in self.config:
            return self.config[name]
        raise EvalError("E011", "" if self.partial else f"unknown config value '{name}'", span)

    def value(self, expr: ast.Expr) -> I.ConfigValue | None:
        try:
            v = evaluate(expr, self._config_lookup, self.ckpt, self.budget)
            self.budget.charge(v, expr.span)  # recorded in the IR (and the plan) once more
            return v
        except EvalError as e:
            if e.message:  # empty: a failed setting's use, reported where the setting failed
                self.sink.error(e.code, e.message, e.span, e.hint)
            return None

    def constant(self, value: I.ConfigValue, span: Span) -> I.ConfigValue:
        """A config value used as a walk constant: charged to the budget, as the plan repeats it."""
        try:
            self.budget.charge(value, span)
        except EvalError as e:
            self.sink.error(e.code, e.message, e.span, e.hint)
        return value

    def int_value(self, expr: ast.Expr, what: str) -> int | None:
        v = self.value(expr)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.sink.error("E020", f"{what} must be an integer, got {v!r}", expr.span)
            return None
        return v

    def type(self, t: ast.TypeRef) -> I.ValueType:
        name = t.name.name
        if name not in I.SCALAR_KINDS and name not in DTYPES and name in self.config:
            # a config value that names a type: the port's dtype follows the variant
            value = self.config[name]
            if not isinstance(value, str) or value not in I.SCALAR_KINDS + DTYPES:
                names = ", ".join(dict.fromkeys(I.SCALAR_KINDS + DTYPES))
                self.sink.error("E031", f"type '{name}' is the config value {value!r}, which names no type",
                                t.name.span, f"give '{name}' a type name as a string ({names}), or write the "
                                "type itself")
                return I.ValueType("any")
            name = value
        if name in I.SCALAR_KINDS and not (name == "bool" and t.dims is not None):
            if t.dims is not None:
                self.sink.error("E031", f"type '{name}' takes no dimensions", t.span)
            return I.ValueType(name)
        if name not in DTYPES:
            self.sink.error("E031", f"unknown type '{name}'", t.name.span,
                            f"use one of {', '.join(I.SCALAR_KINDS)} or a tensor {'/'.join(DTYPES)}[dims]")
            return I.ValueType("tensor", "f32", ())
        dims: list[int | str] = []
        for d in t.dims or ():
            if isinstance(d, ast.NameRef) and d.name not in self.config:
                dims.append(d.name)  # symbolic: bound per request (T tokens, S samples, ...)
                continue
            v = self.value(d)
            if v is None:
                dims.append("?")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
                self.sink.error("E031", f"a dimension must be a non-negative integer, got {v!r}", d.span)
                dims.append("?")
            else:
                dims.append(v)
        return I.ValueType("tensor", name, tuple(dims))

    # ---- nodes
    def nodes(self, nodes: Iterable[ast.Node]) -> dict[str, I.NodeIR]:
        out: dict[str, I.NodeIR] = {}
        self.node_names = {n.name.name for n in nodes}
        for n in nodes:
            if n.name.name in out:
                self.sink.error("E010", f"node '{n.name.name}' is defined twice", n.name.span)
                continue
            out[n.name.name] = self.node(n)
        return out

    def node(self, n: ast.Node) -> I.NodeIR:
        engine = n.engine.name
        if engine not in ENGINES:
            self.sink.error("E024", f"engine kind must be 'kv' or 'stateless', not '{engine}'", n.engine.span)
        ins: dict[str, I.PortIR] = {}
        outs: dict[str, I.PortIR] = {}
        for p in n.ports:
            table = ins if p.direction == "in" else outs
            if p.name.name in table:
                self.sink.error("E010", f"{p.direction} port '{p.name.name}' of node '{n.name.name}' is defined twice",
                                p.name.span)
                continue
            table[p.name.name] = I.PortIR(p.name.name, p.direction, self.type(p.type), p.span)
        phases: dict[str, I.PhaseIR] = {}
        for ph in n.phases:
            if ph.name.name in phases:
                self.sink.error("E010", f"phase '{ph.name.name}' of node '{n.name.name}' is defined twice", ph.name.span)
                continue
            phases[ph.name.name] = I.PhaseIR(ph.name.name, tuple(i.name for i in ph.inputs),
                                             tuple(o.name for o in ph.outputs), ph.span,
                                             self.reads(n.name.name, ph))
        settings = self.settings(n)
        tags, tag_max_len = self.tags(n, engine)
        dtype = settings.get("dtype", self.config.get("dtype", "bf16"))
        if dtype not in NODE_DTYPES:  # the runtime computes in a float dtype (plan/check.py)
            where = next((s.value.span for s in n.settings if s.name.name == "dtype"), n.span)
            self.sink.error("E031", f"node dtype must be one of {', '.join(NODE_DTYPES)}, not {dtype!r}", where,
                            "the node's compute and weights dtype; ports take any dtype (`in ids : i32[T]`)")
            dtype = "bf16"
        for extra in n.extra_archs:
            self.sink.error("E010", f"node '{n.name.name}' has more than one arch", extra.span)
        arch_name, arch_args, spec = self.arch(n.arch, str(dtype))
        impl = "mstar_models." + ".".join(i.name for i in n.impl)
        impl_settings = self.impl_args(n, settings)
        return I.NodeIR(n.name.name, engine, impl, ins, outs, phases, tags, settings,
                        arch_name, arch_args, spec, str(dtype), n.span, tag_max_len, impl_settings)

    def reads(self, node: str, ph: ast.Phase) -> tuple[I.ReadIR, ...]:
        """A phase's `reads` list, each context once: a second `reads vlm, vlm` is E010. (Two
        entries that name the same context only through the call's tag, `reads vlm@main, vlm`,
        are found at the call that gives the tag: verify's `call_reads`.)"""
        out: list[I.ReadIR] = []
        for r in ph.reads:
            read = I.ReadIR(r.node.name, r.tag.name if r.tag else None, r.span)
            if any((o.node, o.tag) == (read.node, read.tag) for o in out):
                shown = read.node + (f"@{read.tag}" if read.tag else "")
                self.sink.error("E010", f"phase '{node}.{ph.name.name}' reads {shown} twice", r.span,
                                "list each context once")
                continue
            out.append(read)
        return tuple(out)

    def settings(self, n: ast.Node) -> dict[str, I.ConfigValue]:
        """The node body's settings: each one the compiler or the runtime reads (mstarc/settings.py)."""
        out: dict[str, I.ConfigValue] = {}
        for s in n.settings:
            name = s.name.name
            spec = NODE_SETTINGS.get(name)
            if spec is None:
                like = closest(name, list(NODE_SETTINGS))
                self.sink.error("E026", f"node '{n.name.name}' has no setting '{name}'", s.name.span,
                                (f"did you mean '{like}'? " if like else "")
                                + f"settings: {', '.join(NODE_SETTINGS)}; what only the implementation reads "
                                f"goes in its arguments: `= {'.'.join(i.name for i in n.impl)}({name} = ...)`")
                continue
            if name in out:
                self.sink.error("E010", f"setting '{name}' of node '{n.name.name}' is given twice", s.name.span)
                continue
            v = self.value(s.value)
            if v is None:
                continue
            problem = setting_problem(spec, v) if name != "dtype" else None  # dtype: E031 below
            if problem is not None:
                self.sink.error("E026", f"setting '{name}' of node '{n.name.name}' {problem}, got {v!r}", s.value.span)
                continue
            out[name] = v
        return out

    def impl_args(self, n: ast.Node, settings: dict[str, I.ConfigValue]) -> tuple[str, ...]:
        """The implementation's arguments, added to `settings` (the compiler does not read them)."""
        names: list[str] = []
        for a in n.impl_args or ():
            if a.name is None:
                self.sink.error("E026", "implementation arguments must be named (key = value)", a.span)
                continue
            name = a.name.name
            if name in NODE_SETTINGS:
                self.sink.error("E026", f"'{name}' is a setting the compiler or the runtime reads, not an argument "
                                "of the implementation", a.name.span, f"write `{name} = ...` in the node's body")
                continue
            if name in names:
                self.sink.error("E010", f"implementation argument '{name}' is given twice", a.name.span)
                continue
            v = self.value(a.value)
            if v is not None:
                settings[name] = v
                names.append(name)
        return tuple(names)

    def tags(self, n: ast.Node, engine: str) -> tuple[tuple[str, ...], dict[str, int]]:
        if n.tags is None:
            return ("main",), {}
        if engine != "kv":
            self.sink.error("E046", f"node '{n.name.name}' is stateless and cannot have KV tags", n.tags.span,
                            "only kv nodes own KV contexts")
        names = [t.name for t in n.tags.names]
        for i, t in enumerate(n.tags.names):
            if names.index(t.name) != i:
                self.sink.error("E010", f"tag '{t.name}' is listed twice", t.span)
        bounds: dict[str, int] = {}
        for t, args in zip(n.tags.names, n.tags.args or ((),) * len(n.tags.names)):
            given: set[str] = set()
            for a in args:
                key = a.name.name if a.name is not None else None
                spec = TAG_ARGS.get(key or "")
                if spec is None:
                    what = f"'{key}'" if key else "a positional argument"
                    self.sink.error("E026", f"tag '{t.name}' has no setting {what}", a.span,
                                    f"a tag takes {', '.join(f'{k} = N' for k in TAG_ARGS)}")
                    continue
                if key in given:  # `cross(max_len = 8, max_len = 9)`: which one was meant?
                    self.sink.error("E010", f"setting '{key}' of tag '{t.name}' is given twice", a.name.span)
                    continue
                given.add(key)
                v = self.value(a.value)
                problem = setting_problem(spec, v) if v is not None else None
                if problem is not None:
                    self.sink.error("E026", f"{key} of tag '{t.name}' {problem}, got {v!r}", a.value.span)
                elif v is not None:
                    bounds[t.name] = int(v)
        return tuple(dict.fromkeys(names)), bounds

    def arch(self, a: ast.Arch | None, dtype: str):
        if a is None:
            return None, {}, None
        try:
            fn = archs.get_arch(a.name.name)
        except KeyError:
            known = ", ".join(sorted(archs.REGISTRY))
            self.sink.error("E017", f"unknown architecture '{a.name.name}'", a.name.span, f"known: {known}")
            return a.name.name, {}, None
        args: dict[str, I.ConfigValue] = {}
        spans: dict[str, Span] = {}
        for arg in a.args:
            if arg.name is None:
                self.sink.error("E023", "architecture arguments must be named (key=value)", arg.span)
                continue
            v = self.value(arg.value)
            if v is None:
                return a.name.name, args, None
            args[arg.name.name] = v
            spans[arg.name.name] = arg.span
        try:
            spec = fn(args, dtype)
        except archs.ArchError as e:
            span = spans.get(e.arg or "", a.span)
            self.sink.error("E023", f"arch '{a.name.name}': {e}", span)
            return a.name.name, args, None
        kv = spec.kv
        if kv is not None and max(kv.layers, kv.kv_heads, kv.head_dim) > MAX_KV_DIM:  # the plan schema's range
            self.sink.error("E023", f"arch '{a.name.name}': a KV geometry of {kv.layers} layers x {kv.kv_heads} KV "
                            f"heads x {kv.head_dim} is over the bound of {MAX_KV_DIM} in a dimension", a.span)
            return a.name.name, args, None
        return a.name.name, args, spec

    # ---- edges
    def edges(self, edges: Iterable[ast.Edge], streams: Iterable[ast.Stream], walks: set[str]) -> tuple[I.EdgeIR, ...]:
        out: list[I.EdgeIR] = []
        for e in edges:
            out.append(I.EdgeIR(e.src.node.name, e.src.port.name, e.dst.node.name, e.dst.port.name, None, e.span))
        for s in streams:
            policy = self.policy(s.policy)
            src = s.src.node.name
            # `stream WALK.INPUT -> node.port`: the walk's input arrives in chunks from the client
            from_input = src in walks and src not in self.node_names
            if src in walks and src in self.node_names:
                self.sink.error("E010", f"stream {src}.{s.src.port.name} names both node '{src}' and walk '{src}'",
                                s.src.node.span, "rename the node or the walk")
            out.append(I.EdgeIR(src, s.src.port.name, s.dst.node.name, s.dst.port.name, policy, s.span, from_input))
        seen: set[str] = set()
        for e in out:
            if e.id in seen:
                self.sink.error("E010", f"edge {e.id} is declared twice", e.span)
            seen.add(e.id)
        return tuple(out)

    def policy(self, p: ast.Policy) -> I.ChunkPolicyIR:
        kind = p.name.name
        if kind not in POLICY_PARAMS:
            self.sink.error("E044", f"unknown chunk policy '{kind}'", p.name.span,
                            "use fixed(size=K), sliding(window=W, stride=S) or left_context(chunk=C, left=L)")
            return I.ChunkPolicyIR(kind, {}, p.span)
        required = POLICY_PARAMS[kind]
        names = required + POLICY_OPTIONAL.get(kind, ())
        params: dict[str, int] = {}
        for i, arg in enumerate(p.args):
            key = arg.name.name if arg.name else (names[i] if i < len(names) else None)
            if key is None or key not in names:
                what = f"'{arg.name.name}'" if arg.name else f"argument {i + 1}"
                self.sink.error("E044", f"{kind}() has no parameter {what}", arg.span,
                                f"{kind} takes ({', '.join(names)})")
                continue
            if key in params:
                self.sink.error("E044", f"{kind}() parameter '{key}' is given twice", arg.span)
                continue
            v = self.int_value(arg.value, f"{kind}() parameter '{key}'")
            if v is None:
                continue
            min_value = policy_param_min(key)
            if not min_value <= v <= MAX_CHUNK_ITEMS:  # the plan schema's range (plan/check.py)
                self.sink.error("E044", f"{kind}() parameter '{key}' must be in {min_value}..{MAX_CHUNK_ITEMS}, "
                                f"got {v}", arg.span)
                continue
            params[key] = v
        missing = [n for n in required if n not in params and not any(
            (a.name and a.name.name == n) or (a.name is None and i < len(names) and names[i] == n)
            for i, a in enumerate(p.args))]
        if missing:
            self.sink.error("E044", f"{kind}() is missing {', '.join(missing)}", p.span,
                            f"{kind} takes ({', '.join(names)})")
        if kind == "left_context" and {"chunk", "left"} <= params.keys() \
                and params["chunk"] + params["left"] > MAX_CHUNK_ITEMS:  # a chunk's items (plan/check.py)
            self.sink.error("E044", f"left_context() chunk + left is {params['chunk'] + params['left']} items, over "
                            f"the bound of {MAX_CHUNK_ITEMS} for one chunk", p.span)
        if kind == "sliding" and {"window", "stride"} <= params.keys() and params["stride"] > params["window"]:
            self.sink.error("E044", f"sliding() stride {params['stride']} is larger than its window {params['window']}",
                            p.span, "items between windows would never reach the consumer")
        return I.ChunkPolicyIR(kind, params, p.span)

    # ---- walks
    def walks(self, walks: Iterable[ast.Walk]) -> dict[str, I.WalkIR]:
        out: dict[str, I.WalkIR] = {}
        for w in walks:
            if w.name.name in out:
                self.sink.error("E010", f"walk '{w.name.name}' is defined twice", w.name.span)
                continue
            out[w.name.name] = _WalkLowerer(self, w).lower()
        return out

    def params(self, params: Iterable[ast.Param], what: str) -> tuple[I.ParamIR, ...]:
        out: list[I.ParamIR] = []
        seen: set[str] = set()
        for p in params:
            if p.name.name in seen:
                self.sink.error("E010", f"{what} '{p.name.name}' is declared twice", p.name.span)
                continue
            seen.add(p.name.name)
            default = self.value(p.default) if p.default is not None else None
            out.append(I.ParamIR(p.name.name, self.type(p.type), default, p.span))
        return tuple(out)

    def transitions(self, ts: Iterable[ast.Transition]) -> tuple[I.TransitionIR, ...]:
        return tuple(
            I.TransitionIR(t.src.name, t.dst.name, t.when.name,
                           tuple(I.KeepIR(k.node.name, k.tag.name, (k.as_tag or k.tag).name, k.span) for k in t.keep),
                           t.span)
            for t in ts)


class _WalkLowerer:
    """Statements -> regions. Step ids are `<walk>.<kind><n>` in source order: stable across runs."""

    def __init__(self, parent: _Lowerer, walk: ast.Walk):
        self.p, self.walk = parent, walk
        self.counters: dict[str, int] = {}
        self.scope = {p.name.name for p in walk.inputs} | set(_bound_names(walk.body))

    def _id(self, kind: str) -> str:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        return f"{self.walk.name.name}.{kind}{self.counters[kind]}"

    def lower(self) -> I.WalkIR:
        ins = self.p.params(self.walk.inputs, "walk input")
        outs = self.p.params(self.walk.outputs, "walk output")
        return I.WalkIR(self.walk.name.name, ins, outs, self.block(self.walk.body), self.walk.span,
                        tuple(_route(r) for r in self.walk.routes))

    def block(self, b: ast.Block) -> I.Seq:
        return I.Seq(tuple(self.stmt(s) for s in b.stmts), b.span)

    def operand(self, expr: ast.Expr) -> I.Operand:
        if isinstance(expr, ast.NameRef):
            if expr.name in self.scope or expr.name not in self.p.config:
                return I.Var(expr.name, expr.span)  # unknown names are verify's to report
            return I.Const(self.p.constant(self.p.config[expr.name], expr.span), expr.span)
        if _mentions(expr, self.scope):
            self.p.sink.error("E020", "walk values cannot be combined in expressions", expr.span,
                              "pass the values to a node phase that computes the result")
            return I.Const(0, expr.span)
        v = self.p.value(expr)
        return I.Const(v if v is not None else 0, expr.span)

    def stmt(self, s: ast.Stmt) -> I.Region:
        if isinstance(s, ast.CallStmt):
            c = s.call
            args: dict[str, I.Operand] = {}
            for a in c.args:
                if a.name is None:
                    self.p.sink.error("E033", "phase inputs must be named (port=value)", a.span)
                    continue
                if a.name.name in args:
                    self.p.sink.error("E010", f"input '{a.name.name}' is given twice", a.name.span)
                    continue
                args[a.name.name] = self.operand(a.value)
            return I.Call(self._id("s"), c.node.name, c.phase.name, c.tag.name if c.tag else None, args,
                          tuple(t.name for t in s.targets), s.span, c.tag.span if c.tag else s.span)
        if isinstance(s, ast.LoopStmt):
            return self.loop(s)
        if isinstance(s, ast.ParallelStmt):
            pid = self._id("p")
            return I.Parallel(pid, tuple(I.Branch(b.name.name, self.block(b.body), b.span) for b in s.branches), s.span)
        if isinstance(s, ast.OnStream):
            sid = f"{s.src.node.name}.{s.src.port.name}->{s.dst.node.name}.{s.dst.port.name}"
            carry = tuple(c.name for c in s.carry) if s.carry is not None else None
            return I.OnStream(self._id("o"), sid, s.name.name, self.block(s.body), s.span, carry)
        if isinstance(s, ast.Emit):
            return I.Emit(s.name.name, s.op, self.operand(s.value), s.span)
        if isinstance(s, ast.Acc):
            return I.Acc(s.name.name, self.operand(s.value), s.span)
        if isinstance(s, ast.Fork):
            return I.Fork(s.node.name, s.src_tag.name, s.dst_tag.name, s.span)
        raise AssertionError(f"unknown statement {type(s).__name__}")  # pragma: no cover

    def loop(self, s: ast.LoopStmt) -> I.Loop:
        dynamic = s.kind == "dynamic_loop"
        lid = self._id("l")
        count: I.Operand | None = None
        max_: int | None = None
        spans: dict[str, Span] = {}
        for st in s.settings:
            key = st.name.name
            spans[key] = st.span
            if key == "n" and not dynamic:
                count = self.operand(st.value)
                if isinstance(count, I.Const) and isinstance(count.value, int) and count.value > MAX_LOOP_BOUND:
                    self.p.sink.error("E040", f"loop count {count.value} is over the bound of {MAX_LOOP_BOUND} "
                                      "iterations", st.value.span, "a loop runs at most that many times")
            elif key == "max":
                if _mentions(st.value, self.scope):
                    self.p.sink.error("E040", f"{s.kind} max must be a config value (a static bound), not a walk value",
                                      st.value.span, "bound the loop with a config value; pass per-request limits to a node")
                else:
                    max_ = self.p.int_value(st.value, "a loop's max")
                    if max_ is not None and max_ < 0:
                        self.p.sink.error("E040", f"{s.kind} max must be a non-negative integer, got {max_}",
                                          st.value.span, "max is the most iterations the loop may run")
                        max_ = None
                    elif max_ is not None and max_ > MAX_LOOP_BOUND:  # the plan schema's range (plan/check.py)
                        self.p.sink.error("E040", f"{s.kind} max {max_} is over the bound of {MAX_LOOP_BOUND} "
                                          "iterations", st.value.span, "max is the most iterations the loop may run")
                        max_ = None
            else:
                allowed = "max=" if dynamic else "n= and max="
                self.p.sink.error("E042", f"{s.kind} has no setting '{key}'", st.name.span, f"{s.kind} takes {allowed}")
        for clause, items in (("index", s.index), ("until", s.until)):
            if len(items) > 1:
                self.p.sink.error("E042", f"{s.kind} has more than one '{clause}' clause", items[1].span)
            if items:
                spans[clause] = items[0].span
        if s.until and not dynamic:
            self.p.sink.error("E042", "a fixed loop cannot have 'until'", s.until[0].span,
                              "use dynamic_loop max=N until FLAG for a per-request early exit")
        return I.Loop(lid, dynamic, count, max_, s.until[0].name if s.until else None,
                      s.index[0].name if s.index else None, tuple(c.name for c in s.carry),
                      self.block(s.body), s.span, spans)


def _bound_names(block: ast.Block) -> Iterable[str]:
    for s in block.stmts:
        if isinstance(s, ast.CallStmt):
            yield from (t.name for t in s.targets)
        elif isinstance(s, ast.LoopStmt):
            yield from (i.name for i in s.index)
            yield from _bound_names(s.body)
        elif isinstance(s, ast.ParallelStmt):
            for b in s.branches:
                yield from _bound_names(b.body)
        elif isinstance(s, ast.OnStream):
            yield s.name.name
            yield from _bound_names(s.body)
        elif isinstance(s, ast.Acc):
            yield s.name.name


def _mentions(expr: ast.Expr, names: set[str]) -> bool:
    if isinstance(expr, ast.NameRef):
        return expr.name in names
    if isinstance(expr, ast.BinOp):
        return _mentions(expr.left, names) or _mentions(expr.right, names)
    if isinstance(expr, ast.Neg):
        return _mentions(expr.operand, names)
    if isinstance(expr, ast.ListLit):
        return any(_mentions(i, names) for i in expr.items)
    if isinstance(expr, ast.FunCall):
        return any(_mentions(a.value, names) for a in expr.args)
    return False


def _route(r: ast.Route) -> I.RouteIR:
    """A `serves` declaration as written: its values are names of the walk or strings, never
    evaluated as config expressions (a slot's name may shadow a config value)."""
    args = []
    for a in r.args:
        v = a.value
        value = v.name if isinstance(v, ast.NameRef) else v.value if isinstance(v, ast.StrLit) else None
        args.append(I.RouteArgIR(a.name.name if a.name is not None else None, value, isinstance(v, ast.StrLit),
                                 a.span))
    return I.RouteIR(r.name.name, tuple(args), r.span, r.name.span)
