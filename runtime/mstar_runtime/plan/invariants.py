"""The cross-section invariants of a parsed plan (step 3 of `load_plan`, plan/loader.py):
`Invariants(parts).run()` lists every violation, each naming its walk and step (or loop),
and `null_cohorts` gives the loops of an older plan their `cohort` key.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from mstar_runtime.plan.planfile import cohort_links, iter_ops
from mstar_runtime.plan.views import PhaseSpec, PlanNode, TransitionSpec

PROGRAM_OPS = ("seq", "call", "parallel", "loop", "on_stream", "emit", "acc", "fork", "transfer")


def _opt(op: Mapping[str, Any], key: str, kind: type) -> Any:
    """`op[key]` if it has type `kind`, else None: invariant checks report, they never raise."""
    value = op.get(key)
    return value if isinstance(value, kind) and not (kind is int and isinstance(value, bool)) else None


class Invariants:
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
        if node.quantized_tensors:
            shapes = {t.name: t.shape for t in node.arch.tensors} if node.arch is not None else {}
            odd = [t for t in node.quantized_tensors if len(shapes.get(t, ())) != 2]
            if odd:
                self.add(f"node '{node.name}' quantizes '{odd[0]}', which is not a 2-D tensor of its arch")
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
        """A non-null cohort mark names calls of the loop's own body and ports of their phases;
        a chain's links name distinct calls, each `chained` input an earlier link's output
        (its shape is the schema's, checked before)."""
        mark = op.get("cohort")
        if mark is None:
            return  # not a cohort, or a plan from before schema 1.1
        where = f"walk '{walk}' loop '{op['id']}'"
        items = op["body"]["body"] if op["body"]["op"] == "seq" else []
        links = cohort_links(mark)
        phases: list[PhaseSpec | None] = []
        accs: list[str] = []
        for k, link in enumerate(links):
            phases.append(self._cohort_link(where, program, op, items, link, phases, k if "links" in mark else None))
            accs += [a[0] for a in link.get("accs") or ()]
        if len({link["call"] for link in links}) != len(links):
            self.add(f"{where}: its cohort names a call twice")
        names = {a["name"] for a in op.get("acc") or ()}
        if names and sorted(accs) != sorted(names):
            self.add(f"{where}: its cohort does not accumulate every acc of the loop ({', '.join(sorted(names))})")

    def _cohort_link(self, where: str, program: Mapping[str, Any], op: Mapping[str, Any], items: list[Any],
                     mark: Mapping[str, Any], earlier: list[PhaseSpec | None], k: int | None) -> PhaseSpec | None:
        """One single-call mark (link `k` of a chain, None: the loop's one call); its phase, or
        None where the call is not found (reported) or names no phase (its own check reports it)."""
        call = next((c for c in items if c["op"] == "call" and c["id"] == mark["call"]), None)
        if call is None:
            self.add(f"{where}: its cohort names call {mark['call'][:40]!r}, which is not a call of the loop's body")
            return None
        node = self.nodes.get(call["node"])
        phase = node.phases.get(call["phase"]) if node is not None else None
        if node is None or phase is None:
            return None
        fn = f"{node.name}.{phase.name}"
        for dst, src in mark["fed"]:
            if dst not in phase.inputs:
                self.add(f"{where}: its cohort feeds input '{dst}', which {fn} does not take")
            if src not in phase.outputs:
                self.add(f"{where}: its cohort feeds back output '{src}', which {fn} does not produce")
        for port in mark["invariant"]:
            if port not in phase.inputs:
                self.add(f"{where}: its cohort holds input '{port}' invariant, which {fn} does not take")
        for port in mark.get("index") or ():
            if port not in phase.inputs:
                self.add(f"{where}: its cohort counts input '{port}' as the index, which {fn} does not take")
        if mark.get("index") and not op.get("index"):
            self.add(f"{where}: its cohort counts an index, and the loop binds none")
        for dst, at, src in mark.get("chained") or ():
            source = earlier[at] if k is not None and at < k else None
            if dst not in phase.inputs:
                self.add(f"{where}: its cohort chains input '{dst}', which {fn} does not take")
            if k is None or at >= k:
                self.add(f"{where}: its cohort chains {fn}'s '{dst}' to link {at}, not an earlier link of the chain")
            elif source is not None and src not in source.outputs:
                self.add(f"{where}: its cohort chains {fn}'s '{dst}' to output '{src}', which link {at} does not produce")
        outputs = [o["name"] for o in program["outputs"]]
        for out, port in mark["emits"]:
            if out not in outputs:
                self.add(f"{where}: its cohort emits '{out}', which is not an output of the walk")
            if port not in phase.outputs:
                self.add(f"{where}: its cohort emits output '{port}', which {fn} does not produce")
        accs = {a["name"] for a in op.get("acc") or ()}
        for name, port, _ in mark.get("accs") or ():
            if name not in accs:
                self.add(f"{where}: its cohort accumulates '{name}', which is not an acc of the loop")
            if port not in phase.outputs:
                self.add(f"{where}: its cohort accumulates output '{port}', which {fn} does not produce")
        return phase

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


def null_cohorts(walks: Mapping[str, Any]) -> None:
    """Every loop without a `cohort` key (a plan from before schema 1.1) gets `None`."""
    for walk in walks.values():
        for op in iter_ops(walk["program"]):
            if op.get("op") == "loop" and "cohort" not in op:
                op["cohort"] = None  # type: ignore[index]  # the body's own dicts, not yet handed out
