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
    for port in phase.inputs:
        t = node.inputs[port].type
        if t.kind == "str" or t.kind == "image" or any(isinstance(d, str) for d in t.dims):
            return False
    return True


def cuda_graphs(model: I.ModelIR) -> I.ModelIR:
    pl = model.placement
    cuda_ranks = {r.rank for r in pl.ranks if r.type == "cuda"}
    max_batch = int(getattr(pl, "max_batch", 64) or 64)
    steps: dict[tuple[str, str, int], list[str]] = {}
    capturable: dict[str, bool] = {}
    for walk in model.walks.values():
        for c in I.walk_calls(walk):
            node = model.nodes[c.node]
            phase = node.phases[c.phase]
            ranks = pl.call_ranks[c.id]
            ok = (ranks[0] in cuda_ranks and node.arch is not None  # weightless nodes are host-side logic
                  and node.settings.get("cuda_graphs", True) is not False and _fixed_shape(node, phase))
            capturable[c.id] = ok
            if ok:
                for r in ranks:
                    steps.setdefault((c.node, c.phase, r), []).append(c.id)
    buckets = batch_buckets(max_batch)
    captures = [GraphCaptureIR("step", r, n, p, None, tuple(sorted(ids)), buckets)
                for (n, p, r), ids in sorted(steps.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1]))]
    for walk in model.walks.values():
        for loop in (r for r in I.iter_regions(walk.body) if isinstance(r, I.Loop)):
            whole = _whole_loop(loop, capturable, pl.call_ranks)
            if whole is not None:
                captures.append(GraphCaptureIR("loop", whole, None, None, loop.id,
                                               tuple(c.id for c in _calls(loop.body)), buckets))
    captures.sort(key=lambda g: (g.rank, g.kind, g.key))
    return dataclasses.replace(model, cuda_graphs=tuple(captures))


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
