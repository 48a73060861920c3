"""The IR graph: the model's topology and every walk's dataflow, as networkx multigraphs.

`build(model)` (called at the end of `mstarc.lower`) makes a `GraphIR` (mstarc/ir.py) of two graphs:

`topology`: a vertex per model node (`node:NAME`, `ir=NodeIR`) and per walk (`walk:NAME`,
  `ir=WalkIR`); an edge per declared edge or stream between node vertices (key the edge id,
  `kind` "edge" or "stream", `ir=EdgeIR`), a `calls` edge from a walk to every node it
  calls, and a `transition` edge between walks (key `transitionN`, `order` N in file order,
  `ir=TransitionIR`).

`flow`: every walk's statements and values. Statement vertices have `kind` "walk" (the
  walk itself, id its name), "call" (id the step id), "loop", "parallel", "on_stream"
  (their region ids), "branch", "emit", "acc", "fork" (ids `<walk>.bN`, `.eN`, `.aN`,
  `.fN`); each has `walk`, `pos` (pre-order index in the walk, the walk itself 0), `parent`
  (the enclosing region vertex, None for the walk), `depth` and `ir` (the region object).
  Regions are attributes and edges: a region vertex (walk, loop, branch, on_stream) lists
  its body in `children`, a parallel lists its branches; `contains` edges go from a region
  to each child.
  Value vertices (`kind` "value", id `ORIGIN/NAME`) are one per (defining call, name): the
  value NAME as the call ORIGIN made it, on ORIGIN's ranks. `vkind` says what it is:
  "value" (a call result, `port` its output port), "kv" (the KV context `node@tag` after
  ORIGIN ran on it), "stream" (the items ORIGIN pushes into the streaming edge NAME; for a
  stream from a walk input ORIGIN is the walk),
  "input" (a walk input; ORIGIN is the walk). A `def` edge goes from ORIGIN to the value;
  an `acc` or `fork` statement that renames a value adds its own `def` edge (key "acc" or
  "fork"), and a KV context that a transition keeps enters its target walk with a "keep"
  edge from the source walk's call.
  Use edges go from a value to the statement that reads it, with `kind` "use", `vkind`,
  `seq` (a global discovery order), `back` (true when the value comes from the previous
  iteration of a loop: its origin is at or after the reader in the walk) and `consumer`:
  the name a cross-rank transfer of it gives the reader (a call's id,
  `<walk>:emit:<output>`, `<loop>:count`, `<loop>:until`), or None for reads that move
  nothing (`acc`, `fork`, and `fires` edges from a stream's items to its block). A step
  whose phase `reads` another KV context has a use edge from that context (key
  `read:node@tag`, `read` true): it attends to the context without rewriting it.

Which values reach a read is decided by reaching definitions over the region tree: a loop
body is walked twice so that carried values and KV contexts also reach from the previous
iteration's end; branches start from the values before the `parallel`; a stream block's
chunk comes from every call of the walk that feeds the stream; `acc` and `fork` pass the
definitions of what they collect or copy. `place` adds `transfer` vertices on the use
edges that cross ranks (mstarc/passes/place.py); `schedule` orders each region's body
topologically (mstarc/passes/schedule.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import networkx as nx

from mstarc import ir as I

_Defs = frozenset[str]  # ids of the calls whose result may reach a read

REGION_KINDS = ("walk", "loop", "branch", "on_stream")  # vertices that own a body (`children`)


def build(model: I.ModelIR) -> I.GraphIR:
    return I.GraphIR(_topology(model), _flow(model))


def _topology(model: I.ModelIR) -> nx.MultiDiGraph:
    g = nx.MultiDiGraph()
    for name, node in model.nodes.items():
        g.add_node(f"node:{name}", kind="node", ir=node)
    for name, walk in model.walks.items():
        g.add_node(f"walk:{name}", kind="walk", ir=walk)
    for e in model.edges:
        if e.src_node in model.nodes and e.dst_node in model.nodes:
            g.add_edge(f"node:{e.src_node}", f"node:{e.dst_node}", key=e.id, kind="stream" if e.streaming else "edge",
                       ir=e)
    for name, walk in model.walks.items():
        for c in I.walk_calls(walk):
            if c.node in model.nodes and not g.has_edge(f"walk:{name}", f"node:{c.node}", "calls"):
                g.add_edge(f"walk:{name}", f"node:{c.node}", key="calls", kind="calls")
    for i, t in enumerate(model.transitions):
        if t.src in model.walks and t.dst in model.walks:
            g.add_edge(f"walk:{t.src}", f"walk:{t.dst}", key=f"transition{i}", kind="transition", order=i, ir=t)
    return g


def _flow(model: I.ModelIR) -> nx.MultiDiGraph:
    g = nx.MultiDiGraph()
    ids: dict[int, str] = {}  # id(region object) -> its vertex: emits and accs compare equal by value
    for walk in model.walks.values():
        _Structure(g, walk, ids).run()
    # KV contexts a transition keeps (chat -> draw keep llm@gen) enter the target walk where
    # the source walk left them: one transition deep, from each walk's own final state.
    runs = {w: _Dataflow(model, walk, ids, g).run({}) for w, walk in model.walks.items()}
    into: dict[str, list[I.TransitionIR]] = {}
    for t in model.transitions:
        into.setdefault(t.dst, []).append(t)
    seq = itertools.count()
    for walk in model.walks.values():
        entry: dict[str, _Defs] = {}
        for t in into.get(walk.name, ()):
            if t.src in runs:
                for k in t.keep:
                    defs = runs[t.src].final.get(f"{k.node}@{k.tag}")
                    if defs:
                        key = f"{k.node}@{k.as_tag}"
                        entry[key] = entry.get(key, frozenset()) | defs
        run = _Dataflow(model, walk, ids, g).run(entry) if entry else runs[walk.name]
        run.commit(g, seq)
    return g


class _Structure:
    """Statement vertices and `contains` edges of one walk, in pre-order."""

    def __init__(self, g: nx.MultiDiGraph, walk: I.WalkIR, ids: dict[int, str]):
        self.g, self.w, self.ids = g, walk, ids
        self.pos = itertools.count()
        self.counters: dict[str, int] = {}

    def run(self) -> None:
        name = self.w.name
        self.g.add_node(name, kind="walk", walk=name, pos=next(self.pos), parent=None, depth=0, ir=self.w,
                        children=[])
        self.body(self.w.body, name, 1)

    def _id(self, kind: str) -> str:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        return f"{self.w.name}.{kind}{self.counters[kind]}"

    def body(self, seq: I.Seq, parent: str, depth: int) -> None:
        for r in seq.body:
            if isinstance(r, I.Seq):  # lowering never nests a bare block; flattened if it did
                self.body(r, parent, depth)
            else:
                self.add(r, parent, depth)

    def add(self, r: I.Region, parent: str, depth: int) -> None:
        if isinstance(r, I.Call | I.Loop | I.Parallel | I.OnStream):
            vid = r.id
        else:
            vid = self._id({I.Emit: "e", I.Acc: "a", I.Fork: "f"}[type(r)])
        kind = {I.Call: "call", I.Loop: "loop", I.Parallel: "parallel", I.OnStream: "on_stream", I.Emit: "emit",
                I.Acc: "acc", I.Fork: "fork"}[type(r)]
        self.ids[id(r)] = vid
        attrs: dict[str, Any] = {"kind": kind, "walk": self.w.name, "pos": next(self.pos), "parent": parent,
                                 "depth": depth, "ir": r}
        if kind in ("loop", "on_stream", "parallel"):
            attrs["children"] = []
        self.g.add_node(vid, **attrs)
        self.g.nodes[parent]["children"].append(vid)
        self.g.add_edge(parent, vid, key="contains", kind="contains")
        if isinstance(r, I.Loop | I.OnStream):
            self.body(r.body, vid, depth + 1)
        elif isinstance(r, I.Parallel):
            for b in r.branches:
                bid = self._id("b")
                self.ids[id(b)] = bid
                self.g.add_node(bid, kind="branch", walk=self.w.name, pos=next(self.pos), parent=vid,
                                depth=depth + 1, ir=b, children=[])
                self.g.nodes[vid]["children"].append(bid)
                self.g.add_edge(vid, bid, key="contains", kind="contains")
                self.body(b.body, bid, depth + 2)


class _Run:
    """One reaching-definitions run over a walk: what it would add to the graph, in order."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}  # value vertex -> attrs
        self.defs: dict[tuple[str, str, str], None] = {}  # (origin, value, key), ordered
        self.uses: dict[tuple[str, str, str], dict[str, Any]] = {}  # (value, reader, key) -> attrs
        self.final: dict[str, _Defs] = {}

    def commit(self, g: nx.MultiDiGraph, seq: Iterator[int]) -> None:
        for vid, attrs in self.values.items():
            if vid not in g:
                g.add_node(vid, **attrs)
        for u, v, key in self.defs:
            if not g.has_edge(u, v, key):
                g.add_edge(u, v, key=key, kind="def")
        for (u, v, key), attrs in self.uses.items():
            if not g.has_edge(u, v, key):
                g.add_edge(u, v, key=key, kind="use", seq=next(seq), **attrs)


class _Dataflow:
    """Reaching definitions over one walk's region tree, recorded as value vertices and use edges."""

    def __init__(self, model: I.ModelIR, walk: I.WalkIR, ids: dict[int, str], g: nx.MultiDiGraph):
        self.m, self.w, self.ids, self.g = model, walk, ids, g
        self.r = _Run()
        self.acc_stack: list[dict[str, _Defs]] = []
        self.chunks: dict[str, str] = {}  # chunk name of an enclosing stream block -> edge id
        self.loop_memo: dict[tuple, dict[str, _Defs]] = {}
        self.producers: dict[str, frozenset[str]] | None = None  # streaming edge id -> the calls feeding it
        self.inputs = {p.name for p in walk.inputs}

    def run(self, entry: dict[str, _Defs]) -> _Run:
        for p in self.w.inputs:
            self.value(self.w.name, p.name, "input")
        for key, defs in entry.items():
            for origin in sorted(defs):
                self.value(origin, key, "kv", def_key="keep")
        env = dict(entry)
        self.seq(self.w.body, env)
        self.r.final = env
        return self.r

    # ---- recording
    def value(self, origin: str, name: str, vkind: str, port: str | None = None, def_key: str = "def") -> str:
        vid = f"{origin}/{name}"
        if vid not in self.r.values:
            self.r.values[vid] = {"kind": "value", "walk": self.w.name, "name": name, "origin": origin,
                                  "vkind": vkind, "port": port}
            self.r.defs[(origin, vid, "def")] = None
        if def_key != "def":
            self.r.defs[(origin, vid, def_key)] = None
        return vid

    def rename(self, stmt: str, origin: str, name: str, vkind: str, key: str) -> None:
        """`acc`/`fork`: `name` now also holds what `origin` made; the statement defines it too."""
        vid = self.value(origin, name, vkind)
        self.r.defs[(stmt, vid, key)] = None

    def use(self, name: str, defs: _Defs, reader: str, key: str, consumer: str | None, vkind: str = "value",
            read: bool = False) -> None:
        pos = self.g.nodes[reader]["pos"]
        for origin in sorted(defs):
            vid = self.value(origin, name, vkind)
            edge = (vid, reader, key)
            if edge not in self.r.uses:
                o = self.g.nodes.get(origin)
                back = o is not None and o["walk"] == self.w.name and o["pos"] >= pos
                self.r.uses[edge] = {"vkind": vkind, "consumer": consumer, "back": back}
                if read:
                    self.r.uses[edge]["read"] = True

    def use_operand(self, op: I.Operand | None, env: dict[str, _Defs], reader: str, key: str,
                    consumer: str | None) -> None:
        if not isinstance(op, I.Var):
            return
        if op.name in env:
            if op.name in self.chunks:  # items reach the consumer's stream buffer, not a value
                self.use(self.chunks[op.name], env[op.name], reader, key, consumer, "stream")
            else:
                self.use(op.name, env[op.name], reader, key, consumer)
        elif op.name in self.inputs:  # read from the request: moves nothing
            self.use(op.name, frozenset({self.w.name}), reader, key, None, "input")

    def kv_key(self, c: I.Call) -> str | None:
        node = self.m.nodes.get(c.node)
        if node is None or node.engine != "kv":
            return None
        return f"{c.node}@{c.tag or (node.tags[0] if node.tags else 'main')}"

    # ---- regions
    def seq(self, seq: I.Seq, env: dict[str, _Defs]) -> None:
        for r in seq.body:
            self.region(r, env)

    def region(self, r: I.Region, env: dict[str, _Defs]) -> None:
        if isinstance(r, I.Call):
            self.call(r, env)
        elif isinstance(r, I.Emit):
            self.use_operand(r.value, env, self.ids[id(r)], "emit", f"{self.w.name}:emit:{r.output}")
        elif isinstance(r, I.Acc):
            if isinstance(r.value, I.Var):
                vid = self.ids[id(r)]
                self.use_operand(r.value, env, vid, "acc", None)
                if self.acc_stack:
                    defs = env.get(r.value.name, frozenset())
                    stack = self.acc_stack[-1]
                    stack[r.name] = stack.get(r.name, frozenset()) | defs
                    for origin in sorted(defs):
                        self.rename(vid, origin, r.name, "value", "acc")
        elif isinstance(r, I.Fork):
            src, dst = f"{r.node}@{r.src_tag}", f"{r.node}@{r.dst_tag}"
            if src in env:
                vid = self.ids[id(r)]
                self.use(src, env[src], vid, "fork", None, "kv")
                env[dst] = env[src]
                for origin in sorted(env[src]):
                    self.rename(vid, origin, dst, "kv", "fork")
        elif isinstance(r, I.Loop):
            self.loop(r, env)
        elif isinstance(r, I.Parallel):
            self.parallel(r, env)
        elif isinstance(r, I.OnStream):
            self.on_stream(r, env)
        elif isinstance(r, I.Seq):
            self.seq(r, env)

    def call(self, c: I.Call, env: dict[str, _Defs]) -> None:
        for port, op in c.args.items():
            self.use_operand(op, env, c.id, f"arg:{port}", c.id)
        node = self.m.nodes.get(c.node)
        phase = node.phases.get(c.phase) if node is not None else None
        if phase is not None and node.engine == "kv":
            for r in phase.reads:  # other contexts the step attends to: read, not rewritten
                ctx = r.resolve(node.tag_of(c.tag))
                if ctx in env:
                    self.use(ctx, env[ctx], c.id, f"read:{ctx}", c.id, "kv", read=True)
        key = self.kv_key(c)
        if key is not None:
            if key in env:
                self.use(key, env[key], c.id, "kv", c.id, "kv")
            env[key] = frozenset({c.id})
            self.value(c.id, key, "kv")
        ports = phase.outputs if phase is not None and len(phase.outputs) == len(c.results) else (None,) * len(c.results)
        for name, port in zip(c.results, ports):
            env[name] = frozenset({c.id})
            self.value(c.id, name, "value", port)

    def loop(self, lp: I.Loop, env: dict[str, _Defs]) -> None:
        # The two passes below re-run nested loops, so loops nested d deep would take 2^d
        # passes over the innermost body. A loop's effect is a function of the definitions
        # reaching it (and of the enclosing stream chunks): its reads, already recorded, and
        # the definitions leaving it. So a loop reached again with the same definitions only
        # replays the definitions leaving it.
        key = (lp.id, frozenset(env.items()), frozenset(self.chunks.items()))
        seen = self.loop_memo.get(key)
        if seen is not None:
            env.clear()
            env.update(seen)
            return
        self._loop(lp, env)
        self.loop_memo[key] = dict(env)

    def _loop(self, lp: I.Loop, env: dict[str, _Defs]) -> None:
        self.use_operand(lp.count, env, lp.id, "count", f"{lp.id}:count")
        if lp.until is not None and lp.until in lp.carry and lp.until in env:
            # a carried flag bound before the loop is read before the first iteration
            self.use(lp.until, env[lp.until], lp.id, "until", f"{lp.id}:until")
        self.acc_stack.append({})
        first = dict(env)
        self.seq(lp.body, first)
        # Second pass over the body with the back edge: carried values and KV contexts may
        # come from the previous iteration's end as well as from before the loop.
        carried = [n for n in first if n in lp.carry or "@" in n]
        again = dict(env)
        for n in carried:
            again[n] = env.get(n, frozenset()) | first[n]
        self.seq(lp.body, again)
        if lp.until is not None and lp.until in again:
            self.use(lp.until, again[lp.until], lp.id, "until", f"{lp.id}:until")
        for n in carried:
            env[n] = env.get(n, frozenset()) | again[n]
        env.update(self.acc_stack.pop())

    def parallel(self, par: I.Parallel, env: dict[str, _Defs]) -> None:
        merged: dict[str, _Defs] = {}
        for b in par.branches:
            inner = dict(env)
            self.seq(b.body, inner)
            for n, defs in inner.items():
                if env.get(n) != defs:
                    merged[n] = merged.get(n, frozenset()) | defs
        env.update(merged)

    def stream_producers(self, edge: I.EdgeIR) -> frozenset[str]:
        """The calls of the walk that bind the producer port of a streaming edge (computed for
        all streams at once: a walk may have many stream blocks)."""
        if self.producers is None:
            found: dict[tuple[str, str], set[str]] = {}
            for c in I.walk_calls(self.w):
                node = self.m.nodes.get(c.node)
                phase = node.phases.get(c.phase) if node is not None else None
                if phase is not None:
                    for port in phase.outputs[:len(c.results)]:
                        found.setdefault((c.node, port), set()).add(c.id)
            self.producers = {e.id: frozenset(found.get((e.src_node, e.src_port), ())) for e in self.m.edges
                              if e.streaming and not e.from_input}
            # a stream from an input of this walk: the request itself (the walk vertex) feeds it
            self.producers.update({e.id: frozenset({self.w.name}) for e in self.m.edges
                                   if e.from_input and e.src_node == self.w.name})
        return self.producers.get(edge.id, frozenset())

    def on_stream(self, block: I.OnStream, env: dict[str, _Defs]) -> None:
        edge = self.m.edge(block.stream)
        inner = dict(env)
        if edge is not None and edge.streaming:
            producers = self.stream_producers(edge)
            inner[block.name] = producers
            for origin in sorted(producers):
                port = edge.src_port
                vid = self.value(origin, edge.id, "stream", port)
                if (vid, block.id, "fires") not in self.r.uses:
                    self.r.uses[(vid, block.id, "fires")] = {"vkind": "stream", "consumer": None, "back": False}
        outer = self.chunks.get(block.name)
        self.chunks[block.name] = block.stream
        if block.carry is None:
            self.seq(block.body, inner)
        else:  # a stream loop: a loop over the chunks, its carried values with a back edge
            first = dict(inner)
            self.seq(block.body, first)
            for n in (n for n in first if n in block.carry or "@" in n):
                inner[n] = inner.get(n, frozenset()) | first[n]
            self.seq(block.body, inner)
            for n in block.carry:
                if n in inner:
                    env[n] = env.get(n, frozenset()) | inner[n]
        if outer is None:
            del self.chunks[block.name]
        else:
            self.chunks[block.name] = outer
        # Values bound in a stream block are local to it (a stream loop's carried ones aside);
        # KV contexts it advances are not.
        env.update({n: d for n, d in inner.items() if "@" in n})


# ---- queries the passes share ------------------------------------------------------------


def lca_children(flow: nx.MultiDiGraph, a: str, b: str) -> tuple[str, str, str] | None:
    """(region, x, y): the innermost region holding both statements, and its children x
    (holding a) and y (holding b); None when one holds the other or they are in different walks."""
    na, nb = flow.nodes[a], flow.nodes[b]
    if na["walk"] != nb["walk"]:
        return None
    while na["depth"] > nb["depth"]:
        a, na = na["parent"], flow.nodes[na["parent"]]
    while nb["depth"] > na["depth"]:
        b, nb = nb["parent"], flow.nodes[nb["parent"]]
    if a == b:
        return None
    while na["parent"] != nb["parent"]:
        a, na = na["parent"], flow.nodes[na["parent"]]
        b, nb = nb["parent"], flow.nodes[nb["parent"]]
    return na["parent"], a, b


def dump(graph: I.GraphIR) -> str:
    """The graph as stable text (for --print-after): the topology's edges, then per walk each
    statement (indented by region) with the values it reads, and the values nothing reads."""
    flow, topo = graph.flow, graph.topology
    lines = ["topology:"]
    for u, v, k, d in sorted(topo.edges(keys=True, data=True), key=lambda e: (e[0], e[1], str(e[2]))):
        lines.append(f"  {u} -> {v} [{d['kind']}{'' if k == 'calls' else ' ' + str(k)}]")
    unused: dict[str, list[str]] = {}
    transfers: dict[str, list[str]] = {}
    for v, d in flow.nodes(data=True):
        if d["kind"] == "value" and not _is_read(flow, v):
            unused.setdefault(d["walk"], []).append(v)
        elif d["kind"] == "transfer":
            transfers.setdefault(d["walk"], []).append(v)
    for walk in (n for n, d in flow.nodes(data=True) if d["kind"] == "walk"):
        lines.append(f"walk {walk}:")
        for v in graph.walk_vertices(walk):
            d = flow.nodes[v]
            pad = "  " * (d["depth"] + 1)
            what = f"call {d['ir'].node}.{d['ir'].phase}" if d["kind"] == "call" else d["kind"]
            ranks = f" ranks={list(d['ranks'])}" if "ranks" in d else ""
            lines.append(f"{pad}{v}: {what}{ranks}")
            reads = [(e.get("seq", -1), u, k, e) for u, _, k, e in flow.in_edges(v, keys=True, data=True)
                     if e["kind"] in ("use", "transfer")]
            for _, u, k, e in sorted(reads, key=lambda r: (r[0], r[1], r[2])):
                lines.append(f"{pad}  <- {u} [{k}{', back' if e.get('back') else ''}]")
        for t in transfers.get(walk, ()):
            d = flow.nodes[t]
            src = [u for u, _ in flow.in_edges(t)]
            lines.append(f"  {t}: transfer {d['vkind']} {d['value']} rank {d['src']} -> {d['dst']} "
                         f"(from {', '.join(src)})")
        for v in sorted(unused.get(walk, ())):
            lines.append(f"  unused {v}")
    return "\n".join(lines)


def _is_read(flow: nx.MultiDiGraph, vid: str) -> bool:
    return any(d["kind"] in ("use", "transfer") for _, _, d in flow.out_edges(vid, data=True))
