"""Parsing a plan body that passed the schema check into the typed parts of `Plan`
(plan/views.py): `parse_body`. Every field it reads is type-checked again on the way, so a
miss is a `PlanError` naming the field's path, never a `KeyError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from mstar_runtime.plan.records import Collective, KVGeometry, ShardSpec, TensorSpec, TensorSplit
from mstar_runtime.plan.views import (
    ENGINES,
    NODE_DTYPES,
    ArchSpec,
    KeepSpec,
    KVPoolSpec,
    PhaseSpec,
    PlanError,
    PlanNode,
    RankMemory,
    RankSpec,
    ReadSpec,
    StreamSpec,
    TransitionSpec,
    WeightFile,
    WeightsSpec,
)

# ------------------------------------------------------------------------------- parsing
_KINDS: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {"int": (int,), "str": (str,), "dict": (dict,), "list": (list,), "bool": (bool,), "num": (int, float)}
)


class _Reader:
    """Typed field access into the body; every miss is a PlanError naming the field's path."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, message: str) -> PlanError:
        return PlanError(self.path, f"malformed plan: {message}")

    def get(self, obj: Any, key: str, kind: str, where: str, *, optional: bool = False) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(f"{where} is not an object")
        value = obj.get(key)
        if value is None:
            if optional:
                return None
            raise self.fail(f"{where} has no '{key}'")
        ok = isinstance(value, _KINDS[kind]) and not (kind in ("int", "num") and isinstance(value, bool))
        if not ok:
            raise self.fail(f"{where}.{key} should be {kind}, got {type(value).__name__}")
        return value

    def ints(self, obj: Any, key: str, where: str) -> tuple[int, ...]:
        values = self.get(obj, key, "list", where)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise self.fail(f"{where}.{key} should be a list of integers")
        return tuple(values)

    def strs(self, obj: Any, key: str, where: str) -> tuple[str, ...]:
        values = self.get(obj, key, "list", where)
        if not all(isinstance(v, str) for v in values):
            raise self.fail(f"{where}.{key} should be a list of strings")
        return tuple(values)


def parse_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body's sections as typed parts (the fields of `Plan`), checking their JSON shape."""
    r = _Reader(path)
    model = r.get(body, "model", "dict", "plan")
    placement = r.get(body, "placement", "dict", "plan")
    memory = r.get(body, "memory", "dict", "plan")
    weights = r.get(body, "weights", "dict", "plan")
    ranks = tuple(
        _parse_rank(r, d, f"placement.ranks[{i}]")
        for i, d in enumerate(r.get(placement, "ranks", "list", "placement"))
    )
    nodes = {name: _parse_node(r, name, d) for name, d in r.get(body, "nodes", "dict", "plan").items()}
    walks = r.get(body, "walks", "dict", "plan")
    for name, w in walks.items():
        r.get(w, "program", "dict", f"walks.{name}")
        r.strs(w, "streams", f"walks.{name}")
        for key in ("inputs", "outputs"):
            for i, port in enumerate(r.get(w, key, "list", f"walks.{name}")):
                r.get(port, "name", "str", f"walks.{name}.{key}[{i}]")
                r.get(port, "type", "dict", f"walks.{name}.{key}[{i}]")
    streams = {}
    for i, d in enumerate(r.get(body, "streams", "list", "plan")):
        s = StreamSpec(
            r.get(d, "id", "str", f"streams[{i}]"),
            r.get(d, "walk", "str", f"streams[{i}]"),
            r.get(d, "policy", "dict", f"streams[{i}]"),
            r.get(d, "capacity", "int", f"streams[{i}]"),
            r.get(d, "producer_rank", "int", f"streams[{i}]"),
            r.get(d, "consumer_rank", "int", f"streams[{i}]"),
            d,
        )
        streams[s.id] = s
    transitions = tuple(
        _parse_transition(r, d, f"transitions[{i}]")
        for i, d in enumerate(r.get(body, "transitions", "list", "plan"))
    )
    files = tuple(
        WeightFile(
            r.get(f, "name", "str", "weights.files[]"),
            r.get(f, "header_sha256", "str", "weights.files[]"),
            r.get(f, "bytes", "int", "weights.files[]"),
        )
        for f in r.get(weights, "files", "list", "weights")
    )
    page_size = r.get(placement, "page_size", "int", "placement")
    mem_page = r.get(memory, "page_size", "int", "memory")
    if page_size < 1 or mem_page != page_size:
        raise r.fail(f"page_size is {page_size} in placement but {mem_page} in memory")
    return {
        "compiler": r.get(body, "compiler", "str", "plan"),
        "model_name": r.get(model, "name", "str", "model"),
        "variant": r.get(model, "variant", "str", "model"),
        "source": r.get(model, "source", "str", "model"),
        "config": MappingProxyType(r.get(model, "config", "dict", "model")),
        "weights": WeightsSpec(
            r.get(weights, "kind", "str", "weights"),
            r.get(weights, "path", "str", "weights", optional=True),
            files,
        ),
        "ranks": ranks,
        "page_size": page_size,
        "max_batch": r.get(placement, "max_batch", "int", "placement"),
        "nodes": MappingProxyType(nodes),
        "walks": MappingProxyType(walks),
        "streams": MappingProxyType(streams),
        "memory": tuple(
            _parse_memory(r, d, f"memory.ranks[{i}]")
            for i, d in enumerate(r.get(memory, "ranks", "list", "memory"))
        ),
        "resident": MappingProxyType(_parse_resident(r, placement)),
        "call_ranks": MappingProxyType(
            {
                step: r.ints(placement["call_ranks"], step, "placement.call_ranks")
                for step in r.get(placement, "call_ranks", "dict", "placement")
            }
        ),
        "_transitions": transitions,
        "hosts": tuple(
            tuple(r.ints(h, "ranks", "placement.hosts[]"))
            for h in r.get(placement, "hosts", "list", "placement", optional=True) or []
        ),
    }


def _parse_rank(r: _Reader, d: Any, where: str) -> RankSpec:
    return RankSpec(
        r.get(d, "rank", "int", where),
        r.get(d, "type", "str", where),
        r.get(d, "name", "str", where),
        r.get(d, "memory_bytes", "int", where),
        d,
    )


def _parse_node(r: _Reader, name: str, d: Any) -> PlanNode:
    where = f"nodes.{name}"
    engine = r.get(d, "engine", "str", where)
    dtype = r.get(d, "dtype", "str", where)
    if engine not in ENGINES:
        raise r.fail(f"{where}.engine is '{engine}'; expected one of: {', '.join(ENGINES)}")
    if dtype not in NODE_DTYPES:
        raise r.fail(f"{where}.dtype is '{dtype}'; expected one of: {', '.join(NODE_DTYPES)}")
    phases = {}
    for pname, p in r.get(d, "phases", "dict", where).items():
        pw = f"{where}.phases.{pname}"
        reads = []
        for i, rd in enumerate(r.get(p, "reads", "list", pw, optional=True) or []):
            reads.append(ReadSpec(r.get(rd, "node", "str", f"{pw}.reads[{i}]"),
                                  r.get(rd, "tag", "str", f"{pw}.reads[{i}]", optional=True)))
        phases[pname] = PhaseSpec(pname, r.strs(p, "inputs", pw), r.strs(p, "outputs", pw), tuple(reads))
    tag_max_len = {tag: r.get(d["tag_max_len"], tag, "int", f"{where}.tag_max_len")
                   for tag in r.get(d, "tag_max_len", "dict", where, optional=True) or {}}
    quantized = r.get(d, "quantized", "dict", where, optional=True)
    arch = None
    a = r.get(d, "arch", "dict", where, optional=True)
    if a is not None:
        aw = f"{where}.arch"
        kv = r.get(a, "kv", "dict", aw, optional=True)
        tensors = []
        for i, t in enumerate(r.get(a, "tensors", "list", aw)):
            if not (
                isinstance(t, list)
                and len(t) == 4
                and isinstance(t[0], str)
                and isinstance(t[1], list)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in t[1])
                and isinstance(t[2], str)
                and isinstance(t[3], str)
            ):
                raise r.fail(f"{aw}.tensors[{i}] should be [name, shape, dtype, shard]")
            tensors.append(TensorSpec(t[0], tuple(t[1]), t[2], t[3]))
        kv_shape = None
        if kv is not None:
            kv_shape = KVGeometry(
                r.get(kv, "layers", "int", f"{aw}.kv"),
                r.get(kv, "kv_heads", "int", f"{aw}.kv"),
                r.get(kv, "head_dim", "int", f"{aw}.kv"),
            )
        arch = ArchSpec(
            r.get(a, "name", "str", aw),
            MappingProxyType(r.get(a, "args", "dict", aw)),
            MappingProxyType(r.get(a, "dims", "dict", aw)),
            kv_shape,
            tuple(tensors),
            a,
        )
    s = r.get(d, "shard", "dict", where, optional=True)
    shard = _parse_shard(r, name, s, r.ints(d, "ranks", where), f"{where}.shard") if s is not None else None
    return PlanNode(
        name,
        engine,
        r.get(d, "impl", "str", where),
        dtype,
        r.strs(d, "tags", where),
        MappingProxyType(r.get(d, "settings", "dict", where)),
        MappingProxyType(phases),
        r.ints(d, "ranks", where),
        arch,
        shard,
        d,
        MappingProxyType(tag_max_len),
        None if quantized is None else r.get(quantized, "format", "str", f"{where}.quantized"),
        () if quantized is None else r.strs(quantized, "tensors", f"{where}.quantized"),
    )


def _parse_shard(r: _Reader, node: str, s: Any, ranks: tuple[int, ...], where: str) -> ShardSpec:
    """The node's `shard`; its ranks are the node's own (the plan's copy in `shard` is not read)."""
    splits = {}
    for tname, sp in r.get(s, "splits", "dict", where).items():
        splits[tname] = TensorSplit(
            r.get(sp, "kind", "str", f"{where}.splits.{tname}"),
            r.get(sp, "dim", "int", f"{where}.splits.{tname}", optional=True),
            r.get(sp, "parts", "int", f"{where}.splits.{tname}"),
        )
    collectives = tuple(
        Collective(r.get(c, "op", "str", f"{where}.collectives[{i}]"), r.get(c, "after", "str", f"{where}.collectives[{i}]"),
                   r.get(c, "count", "int", f"{where}.collectives[{i}]"))
        for i, c in enumerate(r.get(s, "collectives", "list", where))
    )
    return ShardSpec(
        node,
        r.get(s, "tp", "int", where),
        ranks,
        r.get(s, "heads_per_rank", "int", where, optional=True),
        r.get(s, "kv_heads_per_rank", "int", where, optional=True),
        r.get(s, "kv_replicas", "int", where),
        MappingProxyType(splits),
        collectives,
        r.get(s, "bytes_per_rank", "int", where),
    )


def _parse_memory(r: _Reader, d: Any, where: str) -> RankMemory:
    kv = {}
    for i, k in enumerate(r.get(d, "kv", "list", where)):
        kw = f"{where}.kv[{i}]"
        pool = KVPoolSpec(
            r.get(k, "node", "str", kw),
            r.get(d, "rank", "int", where),
            r.get(k, "pages", "int", kw),
            r.get(k, "tokens", "int", kw),
            r.get(k, "bytes_per_token", "int", kw),
            r.get(k, "max_seq_len", "int", kw),
        )
        kv[pool.node] = pool
    return RankMemory(
        r.get(d, "rank", "int", where),
        r.get(d, "capacity_bytes", "int", where),
        r.get(d, "weights_bytes", "int", where),
        r.get(d, "graph_pool_bytes", "int", where),
        r.get(d, "workspace_bytes", "int", where),
        MappingProxyType(kv),
    )


def _parse_resident(r: _Reader, placement: dict[str, Any]) -> dict[int, tuple[str, ...]]:
    resident = placement.get("resident")
    if isinstance(resident, dict):  # {rank: [nodes]} (JSON keys are strings)
        try:
            return {int(k): r.strs(resident, k, "placement.resident") for k in resident}
        except ValueError:
            raise r.fail("placement.resident keys should be rank numbers") from None
    out: dict[int, tuple[str, ...]] = {}
    for i, d in enumerate(r.get(placement, "resident", "list", "placement")):
        out[r.get(d, "rank", "int", f"placement.resident[{i}]")] = r.strs(
            d, "nodes", f"placement.resident[{i}]"
        )
    return out


def _parse_transition(r: _Reader, d: Any, where: str) -> TransitionSpec:
    keep = tuple(
        KeepSpec(
            r.get(k, "node", "str", f"{where}.keep[]"),
            r.get(k, "tag", "str", f"{where}.keep[]"),
            r.get(k, "as", "str", f"{where}.keep[]"),
        )
        for k in r.get(d, "keep", "list", where)
    )
    return TransitionSpec(
        r.get(d, "src", "str", where), r.get(d, "dst", "str", where), r.get(d, "when", "str", where), keep, d
    )
