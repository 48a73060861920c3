"""The IR verifier: structural invariants that must hold after every pass (`--verify-each`).

Separate from the passes (tinygrad's discipline): a pass that breaks an invariant is a
compiler bug, reported as `InternalError` naming that pass, never as a user diagnostic.
Each check only looks at the fields that have been filled so far.
"""

from __future__ import annotations

import networkx as nx

from mstar_runtime.plan.planfile import cohort_links, iter_ops
from mstarc import ir as I


def check_graph(model: I.ModelIR) -> list[str]:
    """The graph's invariants: a vertex per call; without the reads of the previous loop
    iteration and of KV contexts the dataflow is acyclic once verified; after `place` no
    read crosses ranks except through a transfer vertex, one per listed transfer."""
    g = model.graph
    if g is None:
        return ["the IR has no graph"]
    flow, errs = g.flow, []
    for walk in model.walks.values():
        for c in I.walk_calls(walk):
            if c.id not in flow or flow.nodes[c.id]["kind"] != "call":
                errs.append(f"call {c.id} has no vertex in the graph")
    if model.verified:
        forward = nx.DiGraph((u, v) for u, v, d in flow.edges(data=True) if d["kind"] in ("contains", "def") or (
            d["kind"] == "use" and not d["back"] and d["vkind"] in ("value", "stream")
            and flow.nodes[u]["walk"] == flow.nodes[v]["walk"]))
        if not nx.is_directed_acyclic_graph(forward):
            errs.append(f"the dataflow has a cycle: {nx.find_cycle(forward)}")
    pl = model.placement
    if pl is not None:
        for u, v, _, _ in g.uses():
            src = pl.call_ranks.get(flow.nodes[u]["origin"])
            dst = pl.call_ranks.get(v, (0,)) if flow.nodes[v]["kind"] == "call" else (0,)
            if src is not None and not set(src) & set(dst):
                errs.append(f"{u} reaches {v} across ranks {src} -> {dst} without a transfer")
        n = sum(1 for _, d in flow.nodes(data=True) if d["kind"] == "transfer")
        if n != len(pl.transfers):
            errs.append(f"the graph has {n} transfer vertices, the placement lists {len(pl.transfers)} transfers")
    return errs


def check_ir(model: I.ModelIR) -> list[str]:
    """Every violated invariant, as a sentence. Empty when the IR is well formed."""
    errs: list[str] = check_graph(model)
    call_ids: list[str] = []
    for walk in model.walks.values():
        for c in I.walk_calls(walk):
            call_ids.append(c.id)
            if model.verified and (c.node not in model.nodes or c.phase not in model.nodes[c.node].phases):
                errs.append(f"call {c.id} names {c.node}.{c.phase}, which does not exist")
    if len(call_ids) != len(set(call_ids)):
        errs.append("step ids are not unique")
    pl = model.placement
    if pl is not None:
        n = len(pl.ranks)
        for cid in call_ids:
            ranks = pl.call_ranks.get(cid)
            if not ranks or any(not 0 <= r < n for r in ranks):
                errs.append(f"call {cid} has no valid ranks ({ranks})")
        for t in pl.transfers:
            if t.src_rank == t.dst_rank:
                errs.append(f"transfer of {t.value} in {t.walk} goes from rank {t.src_rank} to itself")
    if model.sharding is not None:
        for name in model.nodes:
            if name not in model.sharding:
                errs.append(f"node {name} has no shard spec")
    if model.memory is not None and pl is not None:
        ranks = {r.rank for r in model.memory.ranks}
        if ranks != set(range(len(pl.ranks))):
            errs.append(f"memory covers ranks {sorted(ranks)}, placement has {len(pl.ranks)}")
    if model.stream_buffers is not None:
        have = {b.block for b in model.stream_buffers}
        for walk in model.walks.values():
            for r in I.iter_regions(walk.body):
                if isinstance(r, I.OnStream) and r.id not in have:
                    errs.append(f"stream block {r.id} has no buffer")
    if model.cuda_graphs is not None:
        ids = set(call_ids)
        for g in model.cuda_graphs:
            if any(s not in ids for s in g.steps) or list(g.buckets) != sorted(set(g.buckets)):
                errs.append(f"CUDA graph {g.key} names unknown steps or unsorted buckets")
    if model.schedule is not None:
        if set(model.schedule) != set(model.walks):
            errs.append("schedule does not cover every walk")
        scheduled = {op["id"] for prog in model.schedule.values() for op in iter_ops(prog["program"]) if op["op"] == "call"}
        if scheduled != set(call_ids):
            errs.append("schedule steps differ from the walks' calls")
        for prog in model.schedule.values():
            for op in iter_ops(prog["program"]):
                if op["op"] != "loop":
                    continue
                if "cohort" not in op:
                    errs.append(f"loop {op['id']} has no cohort mark")
                elif op["cohort"] is not None:
                    calls = {c.get("id") for c in op["body"]["body"] if c["op"] == "call"}
                    errs += [f"loop {op['id']} is marked a cohort of {link['call']}, not one of its calls"
                             for link in cohort_links(op["cohort"]) if link["call"] not in calls]
    return errs
