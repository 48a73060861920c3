"""A loaded plan: the typed, read-only view of a plan body that the conductor and workers use.

`load_plan` is the only way in. It checks, in this order and before any tensor exists:

1. the container (magic, version, size, checksum) and the schema version, through
   `planfile.read` (its `PlanFileError` becomes a `PlanError`), then the plan's `requires`:
   every feature it names must be one this runtime implements (`SUPPORTED_FEATURES`;
   docs/plan-format.md, "Required features"), else a `PlanError` naming the feature;
2. the body's schema (`plan/check.py`, shared with `mstarc`): every value's type and range
   and the references between sections the compiler guarantees (a loop bound below zero, a
   stream of capacity 0, a `max_batch` of 0, an emit to an undeclared output, a KV pool
   larger than its rank: a `PlanError` naming the field, never a `KeyError`);
3. invariants across sections: every `call` of every walk program names an existing node
   and phase, a KV tag of that node, ranks in range on which the node is resident; every
   `on_stream` names a stream of the plan; every kv node has KV geometry and pages on each
   of its ranks; transitions name walks; a loop's `cohort` mark, when not null, names
   calls of the loop's own body and ports of their phases (a chain's `chained` inputs an
   earlier link's outputs); a call's `reads` (contexts
   it attends to besides its own) match its phase's, name KV tags of kv nodes with a pool on
   the call's ranks, and never the call's own context; a tag's `max_len` is a positive int
   of a tag of the node; a walk input with a `stream` names a stream of that walk whose edge
   starts at the input. All violations are reported together, each naming the walk and step
   (or loop);
4. hardware fit: the device ("cpu" or "cuda") the plan runs on exists, with enough GPUs
   of enough memory for the plan's ranks. A CUDA plan runs on the CPU only when
   `device="cpu"` is asked for explicitly.

A plan of an older minor schema (before 1.1) has no `cohort` on its loops: loading gives
every such loop `"cohort": None`, so readers of a loaded plan may use `op["cohort"]`; one
before 1.3 has no `routes` on its walks (it declares no OpenAI route): each gets `[]`. Whether
a walk fits the routes it declares is the server's check (`plan/routes.py`, at its load).
`without_cohorts` gives a loaded plan's copy with every mark null (a reference that runs each
loop iteration by iteration, for tests and benchmarks).

Typed parts (ranks, nodes, KV pools, streams, transitions) are frozen dataclasses; each
also answers `view["field"]` with the body's own JSON field, for code that follows the
plan format (docs/plan-format.md) directly. Walk programs are handed out as the body's
JSON dicts, because the interpreter walks them as JSON; they must not be mutated.

The parts, each its own module: the views and `PlanError` (plan/views.py), the typed parse
of step 2's body (plan/parse.py), the invariants of step 3 (plan/invariants.py); this module
runs them in order, checks the hardware and is the import path of all of them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from mstar_runtime.plan import check, planfile
from mstar_runtime.plan.invariants import PROGRAM_OPS, Invariants, null_cohorts
from mstar_runtime.plan.parse import parse_body
from mstar_runtime.plan.planfile import iter_ops
from mstar_runtime.plan.views import (
    DEVICES,
    ENGINES,
    NODE_DTYPES,
    ArchSpec,
    KeepSpec,
    KVPoolSpec,
    PhaseSpec,
    Plan,
    PlanError,
    PlanNode,
    RankMemory,
    RankSpec,
    ReadSpec,
    StreamSpec,
    TransitionSpec,
    UnknownWalk,
    WeightFile,
    WeightsSpec,
)
from mstar_runtime.sizes import human_bytes

# What other modules import from here (the loader's import path is the plan's public one):
__all__ = ["DEVICES", "ENGINES", "NODE_DTYPES", "PROGRAM_OPS", "SUPPORTED_FEATURES", "ArchSpec", "KVPoolSpec",
           "KeepSpec", "PhaseSpec", "Plan", "PlanError", "PlanNode", "RankMemory", "RankSpec", "ReadSpec",
           "StreamSpec", "TransitionSpec", "UnknownWalk", "WeightFile", "WeightsSpec", "iter_ops", "load_plan",
           "planfile", "without_cohorts"]

_MAX_PROBLEMS = 20  # a broken plan usually breaks in many places; the first few say enough


# ------------------------------------------------------------------------------- loading
def load_plan(
    path: str | os.PathLike[str], *, device: str | None = None, kv_pages_cap: int | None = None
) -> Plan:
    """Read and check a plan file (see the module docstring for the checks and their order).

    `kv_pages_cap` caps every KV pool (tests that force preemption with ~10 pages; a GPU
    plan tried on the CPU); the conductor and the workers both read the capped count.
    """
    where = os.fspath(path)
    try:
        body = planfile.read(where)
    except planfile.PlanFileError as e:
        raise PlanError(where, str(e).removeprefix(f"{where}: ")) from None
    if kv_pages_cap is not None and kv_pages_cap < 1:
        raise PlanError(where, f"kv_pages_cap must be >= 1, got {kv_pages_cap}")
    _check_requires(where, body)
    _raise_problems(where, check.check_body(body))
    parts = parse_body(where, body)
    _raise_problems(where, Invariants(parts).run())
    null_cohorts(parts["walks"])
    for walk in parts["walks"].values():
        walk.setdefault("routes", [])
    resolved = _hardware_fit(where, parts, device, kv_pages_cap)
    return Plan(path=where, device=resolved, kv_pages_cap=kv_pages_cap, body=body, **parts)


def without_cohorts(plan: Plan) -> Plan:
    """A copy of `plan` whose loops carry no cohort mark, as a plan from before schema 1.1
    reads: every loop runs in the interpreter, iteration by iteration (the generic path). The
    per-iteration reference that tests and tools/bench compare decode cohorts with; serving
    never calls it. `plan`'s own walk programs are left as they are (they are never mutated)."""
    walks = copy.deepcopy(dict(plan.walks))
    for walk in walks.values():
        for op in iter_ops(walk["program"]):
            if op.get("op") == "loop":
                op["cohort"] = None  # type: ignore[index]  # the copy's own dicts
    return dataclasses.replace(plan, walks=walks)


def _raise_problems(path: str, problems: list[str]) -> None:
    """A PlanError listing the problems (the first `_MAX_PROBLEMS`), if there are any."""
    if not problems:
        return
    shown = problems[:_MAX_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    head = shown[0] if len(problems) == 1 else f"{len(problems)} problems:\n  " + "\n  ".join(shown) + more
    raise PlanError(path, f"invalid plan: {head}", tuple(problems))


# Plan features beyond schema 1.1 this runtime implements (docs/plan-format.md, "Required
# features"); a plan that requires another one computes something else when its fields are
# ignored, so it is refused before anything else is read.
SUPPORTED_FEATURES: frozenset[str] = frozenset({"kv_reads", "input_streams", "stream_loops", "cohort_accs",
                                                  "cohort_index", "cohort_chains", "fp8_weights"})


def _check_requires(path: str, body: Mapping[str, Any]) -> None:
    required = body.get("requires", [])
    if not isinstance(required, list) or not all(isinstance(f, str) for f in required):
        raise PlanError(path, "malformed plan: `requires` must be a list of feature names")
    missing = [f for f in required if f not in SUPPORTED_FEATURES]
    if missing:
        raise PlanError(path, f"this plan requires {', '.join(missing)}, which this runtime does not implement "
                        f"(it implements: {', '.join(sorted(SUPPORTED_FEATURES)) or 'none'}; docs/plan-format.md, "
                        "Required features); compile the model without those constructs")


def _hardware_fit(path: str, parts: Mapping[str, Any], device: str | None, cap: int | None) -> str:
    ranks: tuple[RankSpec, ...] = parts["ranks"]
    memory: tuple[RankMemory, ...] = parts["memory"]
    cuda_plan = any(r.type == "cuda" for r in ranks)
    if device is not None and device not in DEVICES:
        raise PlanError(path, f"unknown device '{device}'; use one of: {', '.join(DEVICES)}")
    wanted = device or ("cuda" if cuda_plan else "cpu")
    if wanted == "cpu":
        # Every rank of a CPU run shares this host's memory; KV pools are allocated whole.
        need = sum(m.used_bytes(cap, graphs=False) for m in memory)
        have = _host_memory_bytes()
        if have is not None and need > have:
            raise PlanError(
                path,
                f"running on the CPU needs {human_bytes(need)} (weights, KV pools, workspace) but this "
                f"machine has {human_bytes(have)}; cap the KV pools (load_plan(..., kv_pages_cap=N)) or "
                "compile for a placement with less memory",
            )
        return "cpu"
    if not torch.cuda.is_available():
        if device is None:
            raise PlanError(
                path,
                f"the plan was compiled for {len(ranks)} CUDA rank(s) ({ranks[0].name}), but "
                "this machine has no CUDA GPU; run it on the CPU with device='cpu' "
                "(mstar-run --device cpu) or compile it for placements/cpu.yaml",
            )
        raise PlanError(path, "device 'cuda' was asked for, but this machine has no CUDA GPU")
    count = torch.cuda.device_count()
    # a plan over several hosts is checked as one of them: GPU i holds each host's i-th rank
    hosts: tuple[tuple[int, ...], ...] = parts["hosts"] or (tuple(r.rank for r in ranks),)
    need_gpus = max(len(h) for h in hosts)
    if count < need_gpus:
        raise PlanError(
            path,
            f"the plan needs {need_gpus} GPU(s){' per host' if len(hosts) > 1 else ''}, one per rank; this "
            f"machine has {count}; compile it for a placement with fewer ranks",
        )
    for mem in memory:
        gpu = next((h.index(mem.rank) for h in hosts if mem.rank in h), mem.rank)
        props = torch.cuda.get_device_properties(gpu)
        need = mem.used_bytes(cap)
        if props.total_memory < need:
            raise PlanError(
                path,
                f"rank {mem.rank} needs {human_bytes(need)} (weights, KV pool, CUDA graphs, "
                f"workspace) but GPU {gpu} ({props.name}) has {human_bytes(props.total_memory)}; "
                "compile it for a placement that matches this GPU",
            )
    return "cuda"


def _host_memory_bytes() -> int | None:
    """Physical memory of this host, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
