"""The pass pipeline: runs the passes in order with --verify-each, --print-after, --time-passes.

`PIPELINE` is the order of the design brief. Each entry's CLI name is the pass's kebab-case
name; `place` is the only pass with an option (the placement). A pass that raises anything
but a user `CompileError` is reported as an internal error that names it. `--print-after
PASS` prints the IR field the pass filled, then the IR graph (`mstarc.graph.dump`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from mstarc import graph
from mstarc import ir as I
from mstarc.diagnostics import CompileError, InternalError
from mstarc.passes.cuda_graphs import cuda_graphs
from mstarc.passes.memory import memory
from mstarc.passes.place import place
from mstarc.passes.schedule import schedule
from mstarc.passes.shard_tp import shard_tp
from mstarc.passes.streams import streams
from mstarc.passes.verify import verify
from mstarc.verifier import check_ir

PIPELINE: tuple[str, ...] = ("verify", "place", "shard-tp", "memory", "streams", "cuda-graphs", "schedule")
# the IR field each pass fills, for --print-after
PASS_FIELDS = {"verify": "verified", "place": "placement", "shard-tp": "sharding", "memory": "memory",
               "streams": "stream_buffers", "cuda-graphs": "cuda_graphs", "schedule": "schedule"}


def _passes(placement: Any) -> dict[str, Callable[[I.ModelIR], I.ModelIR]]:
    return {"verify": verify, "place": lambda m: place(m, placement), "shard-tp": shard_tp,
            "memory": memory, "streams": streams, "cuda-graphs": cuda_graphs, "schedule": schedule}


def run(model: I.ModelIR, placement: Any = None, *, until: str = "schedule", verify_each: bool = False,
        print_after: frozenset[str] = frozenset(), time_passes: bool = False, out: TextIO | None = None) -> I.ModelIR:
    """Run the pipeline up to and including `until` (only `verify` when there is no placement)."""
    out = out if out is not None else sys.stderr  # looked up now, so redirections of stderr apply
    passes = _passes(placement)
    names = PIPELINE[: PIPELINE.index(until) + 1] if placement is not None else ("verify",)
    timings: list[tuple[str, float]] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            model = passes[name](model)
        except CompileError:
            raise
        except Exception as e:  # a bug in the pass, not in the user's input
            raise InternalError(name, f"{type(e).__name__}: {e}") from e
        timings.append((name, time.perf_counter() - t0))
        if verify_each:
            problems = check_ir(model)
            if problems:
                raise InternalError(name, "IR verification failed after it: " + "; ".join(problems))
        if name in print_after:
            out.write(f"// ---- IR after {name} ----\n{dump_field(model, name)}\n")
            out.write(f"// ---- graph after {name} ----\n{graph.dump(model.graph)}\n")
    if time_passes:
        total = sum(t for _, t in timings)
        out.write("pass            time (ms)\n")
        for name, t in timings:
            out.write(f"{name:<15} {t * 1000:9.2f}\n")
        out.write(f"{'total':<15} {total * 1000:9.2f}\n")
    return model


def dump_field(model: I.ModelIR, pass_name: str) -> str:
    """The part of the IR a pass filled, as stable JSON (walk region trees for verify)."""
    field = PASS_FIELDS[pass_name]
    if field == "verified":
        from mstarc.printer import print_regions
        return "\n".join(f"walk {w.name}:\n{print_regions(w.body, 1)}" for w in model.walks.values())
    value = getattr(model, field)
    return json.dumps(_jsonable(value), indent=2, sort_keys=True)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "to_json"):
        return v.to_json()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v
