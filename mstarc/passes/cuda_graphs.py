"""cuda-graphs: which steps are replayed from captured CUDA graphs, and at which batch sizes.

Requires: `place` has run (ranks and their device types are known).
Ensures:  `model.cuda_graphs` lists one `GraphCaptureIR` per captured (node, phase, rank):
          a step is captured when it runs on a cuda rank and every input port of its phase
          has a fixed shape (decode steps, fixed-window codec decodes), so one graph per
          batch bucket can replay it. Buckets are 1, 2, 4, 8 then multiples of 8 up to
          16, then of 16 up to the placement's max_batch (a padded batch replays the
          nearest bucket at or above it; beyond the largest bucket the step runs eagerly).
          A fixed-count `Loop` whose body is only captured calls on one rank with no
          streams, emits or nested loops is captured whole (kind "loop"): e.g. a
          multi-token code-predictor loop becomes one replay per outer step.
          A step whose requests add several rows each (`step_tokens`: the leading dim of
          its fixed inputs, e.g. a denoise block of latent_len tokens) is captured only at
          the buckets of at most `graph_max_tokens` rows in all (node setting, default
          16384, the runtime's cap), at least the smallest; a phase that reads other KV
          contexts (`reads`) is never captured by its shapes (a generic step replays one
          context per entry, so the runtime runs every reading step of the generic path
          eagerly), only as a recurrent step below that is the one call of its loop: its
          buckets are then those of the decode cohort that runs the loop
          (the cohort's graph attends to the read contexts inside the capture;
          engine/cohort_engine.py).
          A KV phase with symbolic input dims is captured too when it is a recurrent loop
          step: a loop calls it with its own outputs of the previous iteration (each carried
          input comes back from the same call through an output port of the same declared
          type, so its shape stays the same for the whole loop) and everything else it takes
          is fixed for the loop (defined outside it) or a scalar. Such a step keeps its size
          per request (e.g. the V-JEPA predictor's rollout `step`, one frame block per
          trajectory), so a batch of entries of the size the node declares (its
          `graph_step_tokens`, engine/graphs.py) replays one graph per bucket, and the
          runtime runs any other batch of it eagerly. (The memory pass's graph-pool estimate
          covers fixed-shape phases only; a recurrent step's graphs live in the pool's
          headroom, bounded by the runtime's tokens-per-graph cap.)
          A node setting `cuda_graphs = false` opts a node out; nodes without weights (no
          `arch`: tokenizers, samplers, schedulers) run on the host and are never captured,
          as the memory pass assumes. CPU ranks capture nothing.
Fails when: never (capture is an optimisation; nothing here is a user error).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mstarc import ir as I

DEFAULT_MAX_GRAPH_TOKENS = 16384  # rows of one captured multi-row step: the runtime's cap (engine/graphs.py)


@dataclass(frozen=True)
class GraphCaptureIR:
    kind: str  # "step" | "loop"
    rank: int
    node: str | None  # for steps
    phase: str | None
    loop: str | None  # the Loop id, for whole-loop captures
    steps: tuple[str, ...]  # the step ids it replays
    buckets: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"loop:{self.loop}@{self.rank}" if self.kind == "loop" else f"{self.node}.{self.phase}@{self.rank}"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "rank": self.rank, "node": self.node, "phase": self.phase,
                "loop": self.loop, "steps": list(self.steps), "buckets": list(self.buckets)}


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    out = [b for b in (1, 2, 4, 8) if b <= max_batch]
    b = 16
    while b <= max_batch:
        out.append(b)
        b += 8 if b < 32 else 16
    if max_batch not in out:
        out.append(max_batch)
    return tuple(sorted(set(out)))


def _fixed_shape(node: I.NodeIR, phase: I.PhaseIR) -> bool:
    if phase.reads:  # a graph replays one context per entry; a step that reads more runs eagerly
        return False
    for port in phase.inputs:
        t = node.inputs[port].type
        if t.kind == "str" or t.kind == "image" or any(isinstance(d, str) for d in t.dims):
            return False
    return True


def step_tokens(node: I.NodeIR, phase: I.PhaseIR) -> int:
    """Rows one request adds to a captured step of `phase`: 1 when the arch states its
    activation per item (a codec's window); else the largest leading dim of the phase's
    tensor inputs (a decode's `i32[1]`: 1; a denoise block's `f32[latent_len, dim]`:
    latent_len), at least 1."""
    if node.arch is not None and node.arch.dims.get("activation_elements"):
        return 1
    lead = [t.dims[0] for p in phase.inputs if p in node.inputs
            for t in (node.inputs[p].type,) if t.kind == "tensor" and t.dims and isinstance(t.dims[0], int)]
    return max([1, *lead])


def graph_max_tokens(node: I.NodeIR) -> int:
    v = node.settings.get("graph_max_tokens", DEFAULT_MAX_GRAPH_TOKENS)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else DEFAULT_MAX_GRAPH_TOKENS


def captured_buckets(node: I.NodeIR, phase: I.PhaseIR, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets a multi-row step is captured at: those of at most `graph_max_tokens`
    rows (bucket x rows per request), at least the smallest."""
    q = step_tokens(node, phase)
    if q <= 1:
        return buckets
    return tuple(b for b in buckets if b * q <= graph_max_tokens(node)) or buckets[:1]


def graphed_phases(node: I.NodeIR) -> list[I.PhaseIR]:
    """The phases the pass captures by their shapes (what the memory pass budgets a pool for)."""
    if node.arch is None or node.settings.get("cuda_graphs", True) is False:
        return []
    return [ph for ph in node.phases.values() if _fixed_shape(node, ph)]


def reading_steps(model: I.ModelIR) -> dict[str, tuple[str, ...]]:
    """Per node, the phases that read other contexts and that a loop runs as its recurrent
    step, which the pass captures (as the decode cohort's graphs) where the node is graphed:
    what the memory pass budgets a pool for besides `graphed_phases`. The call's tag does not
    matter here: the read context's length is its node's longest (the memory pass's)."""
    out: dict[str, set[str]] = {}
    for walk in model.walks.values():
        recurrent = _recurrent_steps(model, walk)
        for c in I.walk_calls(walk):
            node = model.nodes[c.node]
            graphed = node.arch is not None and node.settings.get("cuda_graphs", True) is not False
            if graphed and c.id in recurrent and node.phases[c.phase].reads:
                out.setdefault(c.node, set()).add(c.phase)
    return {n: tuple(sorted(p)) for n, p in sorted(out.items())}


def cuda_graphs(model: I.ModelIR) -> I.ModelIR:
    pl = model.placement
    cuda_ranks = {r.rank for r in pl.ranks if r.type == "cuda"}
    max_batch = int(getattr(pl, "max_batch", 64) or 64)
    steps: dict[tuple[str, str, int], list[str]] = {}
    capturable: dict[str, bool] = {}
    for walk in model.walks.values():
        recurrent = _recurrent_steps(model, walk)
        for c in I.walk_calls(walk):
            node = model.nodes[c.node]
            phase = node.phases[c.phase]
            ranks = pl.call_ranks[c.id]
            graphed = (ranks[0] in cuda_ranks and node.arch is not None  # weightless nodes are host-side logic
                       and node.settings.get("cuda_graphs", True) is not False)
            ok = graphed and _fixed_shape(node, phase)
            capturable[c.id] = ok  # whole-loop captures take fixed-shape steps only
            if ok or (graphed and c.id in recurrent):
                for r in ranks:
                    steps.setdefault((c.node, c.phase, r), []).append(c.id)
    buckets = batch_buckets(max_batch)
    captures = [GraphCaptureIR("step", r, n, p, None, tuple(sorted(ids)),
                               captured_buckets(model.nodes[n], model.nodes[n].phases[p], buckets))
                for (n, p, r), ids in sorted(steps.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1]))]
    for walk in model.walks.values():
        for loop in (r for r in I.iter_regions(walk.body) if isinstance(r, I.Loop)):
            whole = _whole_loop(loop, capturable, pl.call_ranks)
            if whole is not None:
                captures.append(GraphCaptureIR("loop", whole, None, None, loop.id,
                                               tuple(c.id for c in _calls(loop.body)), buckets))
    captures.sort(key=lambda g: (g.rank, g.kind, g.key))
    return dataclasses.replace(model, cuda_graphs=tuple(captures))


def _recurrent_steps(model: I.ModelIR, walk: I.WalkIR) -> set[str]:
    """Ids of the KV calls of `walk` that a loop runs as a recurrent step (module docstring)."""
    out: set[str] = set()
    for loop in (r for r in I.iter_regions(walk.body) if isinstance(r, I.Loop)):
        defined = _defined_in(loop.body) | set(loop.carry) | ({loop.index} if loop.index else set())
        own = _own_calls(loop.body)
        for c in own:
            node = model.nodes[c.node]
            if node.engine != "kv":
                continue
            phase = node.phases[c.phase]
            if phase.reads and len(own) > 1:  # only a cohort (its loop's one call) replays it
                continue
            produced = dict(zip(c.results, phase.outputs))  # value -> the output port that binds it
            fed_back, ok = False, True
            for port in phase.inputs:
                t = node.inputs[port].type
                arg = c.args.get(port)
                if t.kind in ("str", "image"):
                    ok = False
                elif t.kind != "tensor" or not isinstance(arg, I.Var):
                    continue  # a scalar or a constant: no shape
                elif arg.name in loop.carry and arg.name in produced:
                    out_port = node.outputs.get(produced[arg.name])
                    ok = ok and out_port is not None and out_port.type == t
                    fed_back = True
                elif arg.name in defined:
                    ok = False  # made inside the loop by something else: its shape may change
            if ok and fed_back:
                out.add(c.id)
    return out


def _own_calls(region: I.Region) -> list[I.Call]:
    """The calls of a loop body, not those of nested loops (their own loop decides)."""
    if isinstance(region, I.Call):
        return [region]
    if isinstance(region, I.Seq):
        return [c for r in region.body for c in _own_calls(r)]
    if isinstance(region, I.Parallel):
        return [c for b in region.branches for c in _own_calls(b.body)]
    if isinstance(region, I.OnStream):
        return _own_calls(region.body)
    return []


def _defined_in(region: I.Region) -> set[str]:
    """Every value name bound anywhere inside `region`."""
    names: set[str] = set()
    for r in I.iter_regions(region):
        if isinstance(r, I.Call):
            names.update(r.results)
        elif isinstance(r, I.Acc):
            names.add(r.name)
        elif isinstance(r, I.OnStream):
            names.add(r.name)
            names.update(r.carry or ())
        elif isinstance(r, I.Loop):
            names.update(r.carry)
            if r.index:
                names.add(r.index)
    return names


def _calls(region: I.Region) -> list[I.Call]:
    return [r for r in I.iter_regions(region) if isinstance(r, I.Call)]


def _whole_loop(loop: I.Loop, capturable: dict[str, bool], call_ranks) -> int | None:
    """The rank a fixed-count loop can be captured whole on, or None."""
    if loop.dynamic or not isinstance(loop.count, I.Const):
        return None
    calls = []
    for r in loop.body.body:
        if isinstance(r, I.Call):
            calls.append(r)
        elif not isinstance(r, I.Acc):  # a nested region, emit, fork or stream breaks the graph
            return None
    if not calls or not all(capturable.get(c.id) for c in calls):
        return None
    ranks = {call_ranks[c.id] for c in calls}
    if len(ranks) != 1 or len(next(iter(ranks))) != 1:
        return None
    return next(iter(ranks))[0]
