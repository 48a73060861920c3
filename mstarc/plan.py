"""Plan building: a fully compiled `ModelIR` -> the plan body (schema 1), and back to bytes.

The body is plain JSON data in a fixed shape (docs/plan-format.md). Everything in it is
derived from the `.walk` source, the placement and the checkpoint headers: no timestamps,
no paths (only the file names of the `.walk` file and the weights folder), no host names, so
compiling twice gives the same bytes on any machine and from any working directory.
Weights are referenced by path and header hash, never embedded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import PurePath
from typing import Any

from mstar_runtime.plan import planfile
from mstarc import __version__
from mstarc import ir as I
from mstarc.passes.shard_tp import fp8_tensors


def build_plan(model: I.ModelIR, source_sha256: str) -> dict[str, Any]:
    for field in ("placement", "sharding", "memory", "stream_buffers", "cuda_graphs", "schedule"):
        if getattr(model, field) is None:
            raise ValueError(f"cannot build a plan before the pass that fills '{field}' has run")
    body = {
        "schema": {"major": planfile.SCHEMA_MAJOR, "minor": planfile.SCHEMA_MINOR},
        "compiler": f"mstarc {__version__}",
        "model": {"name": model.name, "variant": model.variant, "source": portable_name(model.source),
                  "source_sha256": source_sha256, "config": model.config},
        "weights": _weights(model.checkpoint),
        "placement": model.placement.to_json(),
        "nodes": {name: _node(model, node) for name, node in sorted(model.nodes.items())},
        "edges": [_edge(e) for e in model.edges],
        "memory": model.memory.to_json(),
        "streams": [b.to_json() for b in model.stream_buffers],
        "cuda_graphs": [g.to_json() for g in model.cuda_graphs],
        "walks": model.schedule,
        "transitions": [{"src": t.src, "dst": t.dst, "when": t.when,
                         "keep": [{"node": k.node, "tag": k.tag, "as": k.as_tag} for k in t.keep]}
                        for t in model.transitions],
    }
    needs = requires(model, body["walks"])
    if needs:  # only then: a plan without them keeps its bytes
        body["requires"] = needs
    return body


def requires(model: I.ModelIR, walks: Any = None) -> list[str]:
    """The features beyond schema 1.1 the plan uses, which a runtime must implement to run it
    (docs/plan-format.md): `kv_reads` (a call attends to other KV contexts),
    `input_streams` (a walk input arrives in chunks through a stream), `stream_loops` (an
    `on_stream` op with `carry` runs in line, a loop over the chunks), `cohort_accs` (a
    cohort-marked loop accumulates values: its mark's `accs`, in the step programs `walks`),
    `cohort_index` (a cohort-marked loop's call takes the loop's index: its mark's `index`),
    `cohort_chains` (a cohort-marked loop of several calls: its mark's `links`; a runtime
    that read only the single-call fields would step the first call alone)
    and `fp8_weights` (a node's `quantized`: weights the loader turns into FP8, which a
    runtime that ignored it would run in bf16 with memory sized for FP8)."""
    out = []
    if any(ph.reads for n in model.nodes.values() for ph in n.phases.values()):
        out.append("kv_reads")
    if any(e.from_input for e in model.edges):
        out.append("input_streams")
    if any(isinstance(r, I.OnStream) and r.carry is not None
           for w in model.walks.values() for r in I.iter_regions(w.body)):
        out.append("stream_loops")
    for key in ("accs", "index", "links"):
        if walks is not None and _marks(walks, key):
            out.append("cohort_chains" if key == "links" else f"cohort_{key}")
    if model.placement is not None and any(v == "fp8" for v in model.placement.node_weights.values()):
        out.append("fp8_weights")
    return out


def _marks(value: Any, key: str) -> bool:
    """Whether a loop op anywhere in `value` (step programs) has a cohort mark with `key`;
    iterative, as a program may nest deeper than Python's recursion limit."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            mark = v.get("cohort") if v.get("op") == "loop" else None
            if mark and any(link.get(key) for link in [mark, *(mark.get("links") or ())]):
                return True
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def portable_name(path: str | None) -> str | None:
    """The last component of a file or folder path: what a plan keeps of the `.walk` file and
    the weights folder. A path relative to the working directory (or an absolute one) would
    make the plan's bytes depend on where `mstarc` ran (docs/plan-format.md)."""
    if path is None:
        return None
    return PurePath(os.path.abspath(path)).name


def _weights(ck: I.CheckpointIR) -> dict[str, Any]:
    return {"kind": ck.kind, "path": portable_name(ck.path),
            "files": [{"name": n, "header_sha256": h, "bytes": s} for n, h, s in ck.files]}


def _node(model: I.ModelIR, node: I.NodeIR) -> dict[str, Any]:
    arch = None
    if node.arch is not None:
        tensors = [t.to_json() for t in node.arch.tensors]
        digest = hashlib.sha256(planfile.dump_body({"t": tensors})).hexdigest()
        kv = node.arch.kv
        arch = {"name": node.arch_name, "args": node.arch_args, "dims": dict(sorted(node.arch.dims.items())),
                "kv": kv.to_json() if kv else None,
                "params": node.arch.param_count(), "bytes": node.arch.bytes(),
                "tensors_sha256": digest, "tensors": tensors}
    shard = model.sharding.get(node.name)
    return {
        "engine": node.engine, "impl": node.impl, "dtype": node.dtype, "tags": list(node.tags),
        "settings": node.settings,
        "inputs": {p: port.type.to_json() for p, port in sorted(node.inputs.items())},
        "outputs": {p: port.type.to_json() for p, port in sorted(node.outputs.items())},
        "phases": {n: _phase(ph) for n, ph in sorted(node.phases.items())},
        "ranks": list(model.placement.node_ranks.get(node.name, ())),
        "arch": arch,
        "shard": shard.to_json() if shard is not None else None,
    } | ({"tag_max_len": dict(sorted(node.tag_max_len.items()))} if node.tag_max_len else {}) | _quantized(model, node)


def _quantized(model: I.ModelIR, node: I.NodeIR) -> dict[str, Any]:
    """`quantized` of a node under the placement's `weights: fp8` (only then: other plans keep their bytes)."""
    names = fp8_tensors(model, node.name)
    if not names:
        return {}
    return {"quantized": {"format": "fp8_e4m3", "scales": "per_output_channel", "activations": "per_token",
                          "tensors": sorted(names)}}


def _phase(ph: I.PhaseIR) -> dict[str, Any]:
    out: dict[str, Any] = {"inputs": list(ph.inputs), "outputs": list(ph.outputs)}
    if ph.reads:
        out["reads"] = [{"node": r.node, "tag": r.tag} for r in ph.reads]  # tag null: the call's
    return out


def _edge(e: I.EdgeIR) -> dict[str, Any]:
    return {"id": e.id, "src": [e.src_node, e.src_port], "dst": [e.dst_node, e.dst_port],
            "policy": {"kind": e.policy.kind, **e.policy.params} if e.policy else None}
