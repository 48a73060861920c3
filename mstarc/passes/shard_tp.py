"""shard-tp: gpt-fast-style tensor-parallel sharding specs, one per node.

Requires: `place` has run (each node's TP degree and ranks are known).
Ensures:  `model.sharding[node]` is a `ShardSpec` for every node (tp 1 included, so later
          passes need no special case): heads and KV heads per rank, how each weight is
          cut, the collectives a forward pass needs, and the weight bytes one rank holds.
          The vocabulary is the catalogue's `TensorSpec.shard`:
            col       split dim 0 (q/k/v, gate/up: output features)
            row       split dim 1 (o_proj, down_proj: input features); an all-reduce follows
            vocab     split dim 0 of an embedding (an all-reduce follows the lookup) or of
                      an output head (its logits are all-gathered)
            expert    each expert's gate/up/down split along moe_intermediate; one
                      all-reduce after the layer's expert combine
            replicate whole on every rank (norms, routers, row-layer biases)
          KV heads: when tp does not divide kv_heads but is a multiple of it, each rank keeps
          one KV head (vLLM's replication): k/v projections are then cut into kv_heads parts,
          not tp, and `kv_replicas` = tp / kv_heads ranks hold each head.
          FP8 weights (the placement's `weights: fp8` for the node): each tensor of the arch's
          `fp8` list counts one byte per element of this rank's part plus a float32 scale
          per output row it holds (a row-split tensor keeps all its rows, so all its scales).
Fails when (E059, at the YAML `weights` value): `weights: fp8` for a node whose arch has no
          FP8-able weights (no arch, or one whose implementation does not quantize its layers).
Fails when (E052, at the YAML `tp` value, naming the node, the dimension and its size):
          tp does not divide heads, intermediate, moe_intermediate or vocab; tp neither
          divides nor is a multiple of kv_heads; a split tensor's dimension is not
          divisible; or tp > 1 for a node without weights (no arch).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from mstar_runtime.plan.records import Collective, ShardSpec, TensorSplit
from mstarc import ir as I
from mstarc.archs import TensorSpec
from mstarc.diagnostics import DiagnosticSink, Span
from mstarc.limits import MAX_DEVICES

SHARD_KINDS = ("col", "row", "vocab", "expert", "replicate")
_DIVIDED_DIMS = ("heads", "intermediate", "moe_intermediate", "vocab")
_KV_PROJ = re.compile(r"(^|[._])(k|v|key|value|wk|wv)(_proj)?([._]|$)")
_EMBED = re.compile(r"embed|wte|tok_emb")


def sharding_to_json(sharding: dict[str, ShardSpec]) -> dict[str, Any]:
    return {n: s.to_json() for n, s in sorted(sharding.items())}


def tensor_bytes_per_rank(numel: int, itemsize: int, split: TensorSplit) -> int:
    """One rank's bytes of a tensor; the ceiling keeps an estimate safe if parts do not divide."""
    return -(-numel // split.parts) * itemsize


FP8_SCALE_BYTES = 4  # one float32 scale per output row


def stored_bytes(numel: int, rows: int, itemsize: int, split: TensorSplit, fp8: bool) -> int:
    """One rank's bytes of a tensor of `numel` elements and `rows` output rows (dim 0): in its
    dtype, or as FP8 values plus one float32 scale per row this rank holds."""
    if not fp8:
        return tensor_bytes_per_rank(numel, itemsize, split)
    local_rows = -(-rows // split.parts) if split.dim == 0 else rows
    return tensor_bytes_per_rank(numel, 1, split) + local_rows * FP8_SCALE_BYTES


def fp8_tensors(model: I.ModelIR, name: str) -> frozenset[str]:
    """The tensors of node `name` held as FP8 (its arch's `fp8` list under `weights: fp8`)."""
    node = model.nodes[name]
    if model.placement.node_weights.get(name) != "fp8" or node.arch is None:
        return frozenset()
    return frozenset(node.arch.fp8)


def shard_tp(model: I.ModelIR) -> I.ModelIR:
    sink = DiagnosticSink()
    pl = model.placement
    out: dict[str, ShardSpec] = {}
    for name in pl.node_weights:
        _check_weights_format(model.nodes[name], pl.node_weights[name], pl.weights_spans[name], sink)
    for name, node in model.nodes.items():
        tp = pl.node_tp.get(name, 1)
        span = pl.tp_spans.get(name, pl.ranks[0].span if pl.ranks else Span.unknown())
        spec = _shard_node(node, tp, pl.node_ranks.get(name, (0,)), span, sink, fp8_tensors(model, name))
        if spec is not None:
            out[name] = spec
    sink.check()
    return dataclasses.replace(model, sharding=out)


def _divisors(n: int) -> str:
    """The divisors of n, for a hint: all of them up to 100,000 (trial division up to its
    square root), else only those a placement can use (up to `limits.MAX_DEVICES`)."""
    if n <= 100_000:
        small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
        return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))
    return ", ".join(str(d) for d in range(1, MAX_DEVICES + 1) if n % d == 0) + ", ..."


def _check_weights_format(node: I.NodeIR, fmt: str, span: Span, sink: DiagnosticSink) -> None:
    """E059: `weights: fp8` for a node whose arch lists no FP8-able weights."""
    if node.arch is not None and node.arch.fp8:
        return
    what = f"its arch '{node.arch_name}' has no FP8-able weights" if node.arch is not None else "it has no arch"
    sink.error("E059", f"node '{node.name}' cannot hold {fmt} weights: {what}", span,
               "weights: fp8 applies to a decoder whose layers quantize at load (the llama arch); "
               "leave 'weights' out for this node")


def _shard_node(node: I.NodeIR, tp: int, ranks: tuple[int, ...], span: Span,
                sink: DiagnosticSink, fp8: frozenset[str] = frozenset()) -> ShardSpec | None:
    arch = node.arch
    if arch is None:
        if tp > 1:
            sink.error("E052", f"node '{node.name}' has no weights (no arch) to shard, but its tp is {tp}", span,
                       "run it at tp 1 (omit tp), or give the node an arch")
            return None
        return ShardSpec(node.name, 1, ranks, None, None, 1, {}, (), 0)
    dims = dict(arch.dims)
    kv = arch.kv
    heads, kv_heads = dims.get("heads"), kv.kv_heads if kv is not None else dims.get("kv_heads")
    head_dim = kv.head_dim if kv is not None else dims.get("head_dim")
    errors_before = len(sink.diagnostics)
    if tp > 1:
        for dim in _DIVIDED_DIMS:
            size = dims.get(dim)
            if size and size % tp:
                sink.error("E052", f"tp {tp} does not divide {dim} = {size} of node '{node.name}'", span,
                           f"use a tp that divides {size}: {_divisors(size)}")
        if kv_heads and kv_heads % tp and tp % kv_heads:
            sink.error("E052", f"tp {tp} neither divides kv_heads = {kv_heads} of node '{node.name}' nor is "
                       "a multiple of it", span,
                       f"use a divisor of {kv_heads} ({_divisors(kv_heads)}) or a multiple of it")
    kv_parts = tp if not kv_heads or kv_heads % tp == 0 else kv_heads
    splits: dict[str, TensorSplit] = {}
    bad_sizes: set[tuple[int, int]] = set()
    total = 0
    for t in arch.tensors:
        split = _split(t, tp, dims, kv_parts, kv_heads, head_dim)
        if split.dim is not None and t.shape[split.dim] % split.parts and tp > 1:
            if len(sink.diagnostics) == errors_before and (split.dim, t.shape[split.dim]) not in bad_sizes:
                size = t.shape[split.dim]
                sink.error("E052", f"tp {tp} does not divide dim {split.dim} = {size} of tensor '{t.name}' "
                           f"of node '{node.name}'", span, f"use a tp that divides {size}: {_divisors(size)}")
            bad_sizes.add((split.dim, t.shape[split.dim]))
        splits[t.name] = split
        total += stored_bytes(_numel(t.shape), t.shape[0] if t.shape else 1, I.DTYPE_BYTES.get(t.dtype, 2), split,
                              t.name in fp8)
    if len(sink.diagnostics) > errors_before:
        return None
    replicated_kv = bool(kv_heads) and kv_heads % tp != 0
    return ShardSpec(
        node.name, tp, ranks,
        heads // tp if heads else None,
        (1 if replicated_kv else kv_heads // tp) if kv_heads else None,
        tp // kv_heads if replicated_kv else 1,
        splits, _collectives(arch.tensors, splits, "vocab" in dims) if tp > 1 else (), total)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _split(t: TensorSpec, tp: int, dims: dict[str, int], kv_parts: int, kv_heads: int | None,
           head_dim: int | None) -> TensorSplit:
    kind = t.shard if t.shard in SHARD_KINDS else "replicate"
    if tp == 1 or kind == "replicate" or not t.shape:
        return TensorSplit(kind, None, 1)
    if kind == "row":
        # a row layer's bias is added once, after the all-reduce: it stays whole
        return TensorSplit(kind, 1, tp) if len(t.shape) >= 2 else TensorSplit(kind, None, 1)
    if kind == "expert":
        return TensorSplit(kind, _expert_dim(t, dims), tp) if _expert_dim(t, dims) is not None \
            else TensorSplit(kind, None, 1)
    if kind == "col" and kv_parts != tp and _is_kv_proj(t, kv_heads, head_dim):
        return TensorSplit(kind, 0, kv_parts)
    return TensorSplit(kind, 0, tp)  # col, vocab


def _is_kv_proj(t: TensorSpec, kv_heads: int | None, head_dim: int | None) -> bool:
    """A k/v projection: by name, and by its output size when the catalogue gives the geometry."""
    if not _KV_PROJ.search(t.name):
        return False
    return not (kv_heads and head_dim) or t.shape[0] == kv_heads * head_dim


def _expert_dim(t: TensorSpec, dims: dict[str, int]) -> int | None:
    """The dim of size moe_intermediate (down_proj: the last such), or 2x it for a fused gate_up."""
    inter = dims.get("moe_intermediate")
    if not inter:
        return None
    for size in (inter, 2 * inter):
        found = [i for i, s in enumerate(t.shape) if s == size]
        if found:
            return found[-1] if "down" in t.name else found[0]
    return None


def _module(name: str) -> str:
    return name.removesuffix(".weight").removesuffix(".bias")


def _pattern(module: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in module.split("."))


def _collectives(tensors: tuple[TensorSpec, ...], splits: dict[str, TensorSplit],
                 has_vocab: bool) -> tuple[Collective, ...]:
    """One entry per module pattern, in tensor order; count = distinct module instances."""
    found: dict[tuple[str, str], set[str]] = {}
    for t in tensors:
        s = splits[t.name]
        if s.dim is None:
            continue
        module = _module(t.name)
        if s.kind == "row":
            op = "all_reduce"
        elif s.kind == "expert":
            parts = module.split(".")
            cut = max((i for i, p in enumerate(parts) if p == "experts"), default=len(parts) - 2)
            module, op = ".".join(parts[:cut + 1]), "all_reduce"
        elif s.kind == "vocab":
            op = "all_reduce" if _EMBED.search(module) else "all_gather"
        else:
            continue
        found.setdefault((op, _pattern(module)), set()).add(module)
    embeds = [pat for op, pat in found if op == "all_reduce" and _EMBED.search(pat)]
    if embeds and has_vocab and not any(op == "all_gather" for op, _ in found):
        # a tied head reuses the embedding: its logits still need the all-gather
        found[("all_gather", f"{embeds[0]} (tied head)")] = {embeds[0]}
    return tuple(Collective(op, pat, len(mods)) for (op, pat), mods in found.items())
