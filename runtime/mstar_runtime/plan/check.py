"""The plan body's schema: the type and range of every value and the references between
sections, checked before anything reads the body (docs/plan-format.md).

A plan's checksum only says the file is intact, not that the compiler wrote what it holds: a
body edited and re-checksummed must not reach the runtime (a loop bound below zero, a NaN
memory fraction, a stream of capacity 0, a `max_batch` of 0 that would leave a request
waiting forever, an emit to an output no walk declares). `check_body` is run by `load_plan`
(before the typed views are built), by `mstarc explain` and `mstarc diff` (before they render
a body) and by `mstarc compile` on the body it built (a problem there is a compiler bug).
It returns every problem as a sentence naming the field's path; it never raises, however the
body is shaped.

The schema is data (`BODY` below, built from `Int`, `Str`, `Obj`, ...); the ranges it
uses are the compiler's own limits, defined here once: the compiler imports them
(`mstarc/lower.py`, `mstarc/passes/streams.py`). Every name one section gives another
resolves too (`_names`: nodes, ports, phases, tags, ranks, walks, streams, edges), so that
`mstarc explain` can render any body that passes; the loader's `_Invariants` add what needs
its typed views (TP groups, residency of each call's node, stream endpoints).

Imports neither torch nor the compiler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

INT_MAX = (1 << 63) - 1
MAX_DEVICES = 1024  # ranks of a plan (mstarc/limits.py MAX_DEVICES)
MAX_PAGE_SIZE = 1 << 20  # tokens of a KV page (placement `page_size`)
MAX_BATCH = 1 << 16  # requests in one step (placement `max_batch`)
MAX_KV_PAGES = 1 << 32  # pages of one KV pool: 2^32 pages of one token is far past any device
MAX_CHUNK_ITEMS = 1 << 20  # items of one chunk of a chunk policy (a policy parameter)
MAX_STREAM_ITEMS = 1 << 24  # items a stream buffer holds (its capacity)
MAX_LOOP_BOUND = 1 << 31  # iterations of one loop
MAX_CHAIN_LINKS = 64  # calls of one chained cohort mark (a loop body's calls)
MAX_KV_DIM = 1 << 20  # layers, KV heads or head dim of a KV geometry
NODE_DTYPES = ("bf16", "f16", "f32")  # a node's compute and weights dtype (the loader's NODE_DTYPES)
# chunk policies: required parameters, optional ones, the smallest value of each
POLICY_PARAMS: Mapping[str, tuple[str, ...]] = {"fixed": ("size",), "sliding": ("window", "stride"),
                                                 "left_context": ("chunk", "left")}
POLICY_OPTIONAL: Mapping[str, tuple[str, ...]] = {"left_context": ("first",)}


def policy_param_min(name: str) -> int:
    """The smallest value of a chunk policy parameter (`left` may be 0: no left context)."""
    return 0 if name == "left" else 1


MAX_PROBLEMS = 50  # a hostile body may break everywhere; the first problems say enough


# ------------------------------------------------------------------------------ the schema
class Spec:
    """One JSON value's allowed shape; `check` appends problems, never raises."""

    def check(self, v: Any, path: str, out: _Out) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Spec):
    lo: int = 0
    hi: int = INT_MAX

    def check(self, v: Any, path: str, out: _Out) -> None:
        if isinstance(v, bool) or not isinstance(v, int):
            out.add(path, f"should be an integer, got {_kind(v)}")
        elif not self.lo <= v <= self.hi:
            out.add(path, f"is {v}, outside {self.lo}..{self.hi}")


@dataclass(frozen=True)
class Num(Spec):
    lo: float
    hi: float
    lo_open: bool = False  # lo itself excluded

    def check(self, v: Any, path: str, out: _Out) -> None:
        if isinstance(v, bool) or not isinstance(v, int | float):
            out.add(path, f"should be a number, got {_kind(v)}")
        elif not math.isfinite(v) or not self.lo <= v <= self.hi or (self.lo_open and v == self.lo):
            out.add(path, f"is {v}, outside {'(' if self.lo_open else '['}{self.lo}, {self.hi}]")


@dataclass(frozen=True)
class Str(Spec):
    choices: tuple[str, ...] = ()

    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, str):
            out.add(path, f"should be a string, got {_kind(v)}")
        elif self.choices and v not in self.choices:
            out.add(path, f"is {v[:40]!r}; expected one of: {', '.join(self.choices)}")


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, bool):
            out.add(path, f"should be true or false, got {_kind(v)}")


@dataclass(frozen=True)
class AnyJSON(Spec):
    def check(self, v: Any, path: str, out: _Out) -> None:
        pass


@dataclass(frozen=True)
class Opt(Spec):
    """`spec` or null."""

    spec: Spec

    def check(self, v: Any, path: str, out: _Out) -> None:
        if v is not None:
            self.spec.check(v, path, out)


@dataclass(frozen=True)
class List(Spec):
    item: Spec
    min_len: int = 0
    max_len: int | None = None

    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, list):
            out.add(path, f"should be a list, got {_kind(v)}")
            return
        if len(v) < self.min_len or (self.max_len is not None and len(v) > self.max_len):
            out.add(path, f"has {len(v)} items; expected {self.min_len}..{self.max_len or 'any'}")
        for i, x in enumerate(v):
            self.item.check(x, f"{path}[{i}]", out)


@dataclass(frozen=True)
class Tuple(Spec):
    items: tuple[Spec, ...]

    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, list) or len(v) != len(self.items):
            out.add(path, f"should be a list of {len(self.items)} items, got {_kind(v)}")
            return
        for i, (x, s) in enumerate(zip(v, self.items)):
            s.check(x, f"{path}[{i}]", out)


@dataclass(frozen=True)
class Map(Spec):
    """An object with any keys, each value `value`."""

    value: Spec

    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, dict):
            out.add(path, f"should be an object, got {_kind(v)}")
            return
        for k, x in v.items():
            self.value.check(x, _key(path, k), out)


@dataclass(frozen=True)
class Obj(Spec):
    """An object with these keys (more are allowed: fields are added within a major version)."""

    required: Mapping[str, Spec]
    optional: Mapping[str, Spec] = field(default_factory=dict)

    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, dict):
            out.add(path, f"should be an object, got {_kind(v)}")
            return
        for k, s in self.required.items():
            if k not in v:
                out.add(path, f"has no '{k}'")
            else:
                s.check(v[k], _key(path, k), out)
        for k, s in self.optional.items():
            if k in v:
                s.check(v[k], _key(path, k), out)


@dataclass(frozen=True)
class Tagged(Spec):
    """An object whose `tag` field picks its shape (a program op by its `op`)."""

    tag: str
    shapes: Callable[[], Mapping[str, Spec]]  # late: the shapes refer to this spec

    def check(self, v: Any, path: str, out: _Out) -> None:
        shapes = self.shapes()
        kind = v.get(self.tag) if isinstance(v, dict) else None
        if not isinstance(kind, str) or kind not in shapes:
            out.add(path, f"should be an object whose '{self.tag}' is one of: {', '.join(shapes)}"
                    + (f"; got {str(kind)[:40]!r}" if isinstance(v, dict) else f", got {_kind(v)}"))
            return
        shapes[kind].check(v, path, out)


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


class _Out:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{path or 'the body'} {message}")

    def say(self, sentence: str) -> None:
        """A problem whose sentence names its place itself (a walk's step, a node)."""
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(sentence)


# ---- the plan body (docs/plan-format.md)
NAME = Str()
RANK = Int(0, MAX_DEVICES - 1)
RANKS = List(RANK, 1)


@dataclass(frozen=True)
class Operand(Spec):
    def check(self, v: Any, path: str, out: _Out) -> None:
        if not (isinstance(v, dict) and len(v) == 1 and ("const" in v or isinstance(v.get("var"), str))):
            out.add(path, "should be {\"var\": name} or {\"const\": value}")


VALUE = Operand()
@dataclass(frozen=True)
class Dim(Spec):
    """A tensor dimension: a size or a symbol."""

    def check(self, v: Any, path: str, out: _Out) -> None:
        if not isinstance(v, str):
            Int(0, INT_MAX).check(v, path, out)


SCALAR_KINDS = ("str", "int", "float", "bool", "image", "any")  # the scalar kinds of a port (mstarc/ir.py)
TYPE = Tagged("kind", lambda: {"tensor": Obj({"dtype": Str(), "dims": List(Dim())}),
                               **{k: Obj({}) for k in SCALAR_KINDS}})
POLICY = Tagged("kind", lambda: {kind: Obj({p: Int(policy_param_min(p), MAX_CHUNK_ITEMS) for p in req},
                                           {p: Int(policy_param_min(p), MAX_CHUNK_ITEMS)
                                            for p in POLICY_OPTIONAL.get(kind, ())})
                                 for kind, req in POLICY_PARAMS.items()})


_MARK = {"call": NAME, "fed": List(Tuple((NAME, NAME))), "invariant": List(NAME), "emits": List(Tuple((NAME, NAME)))}
_MARK_OPTIONAL = {"accs": List(Tuple((NAME, NAME, Str(("in", "out"))))), "index": List(NAME)}
# a link of a chained mark: a single-call mark, plus the inputs it takes from an earlier link
# of the same iteration ([input port, link, output port])
_LINK = Obj(_MARK, {**_MARK_OPTIONAL, "chained": List(Tuple((NAME, Int(0, MAX_CHAIN_LINKS - 1), NAME)))})


@dataclass(frozen=True)
class CohortMark(Spec):
    """A loop's cohort mark: one call's (`call`, `fed`, ...), or a chain's (`links`, two or
    more of them; docs/plan-format.md, "Cohort loops")."""

    def check(self, v: Any, path: str, out: _Out) -> None:
        if isinstance(v, dict) and "links" in v:
            Obj({"links": List(_LINK, 2, MAX_CHAIN_LINKS)}).check(v, path, out)
        else:
            Obj(_MARK, _MARK_OPTIONAL).check(v, path, out)


def _ops() -> Mapping[str, Spec]:
    return {
        "seq": Obj({"body": List(OP)}),
        "call": Obj({"id": NAME, "node": NAME, "phase": NAME, "tag": Opt(NAME), "ranks": RANKS,
                     "args": Map(VALUE), "results": List(Tuple((NAME, NAME)))},
                    {"graph": Opt(NAME), "reads": List(Obj({"node": NAME, "tag": Opt(NAME)})),
                     "feeds": List(Obj({"stream": NAME, "port": NAME, "var": NAME}))}),
        "loop": Obj({"id": NAME, "dynamic": Bool(), "count": Opt(VALUE), "max": Opt(Int(0, MAX_LOOP_BOUND)),
                     "until": Opt(NAME), "index": Opt(NAME), "carry": List(NAME), "body": OP},
                    {"acc": List(Obj({"name": NAME, "value": VALUE})), "graph": Opt(NAME),
                     "cohort": Opt(CohortMark())}),
        "parallel": Obj({"id": NAME, "branches": List(Obj({"name": NAME, "body": OP}, {"rank": Opt(RANK)}), 1)}),
        "on_stream": Obj({"id": NAME, "stream": NAME, "as": NAME, "body": OP}, {"carry": List(NAME)}),
        "emit": Obj({"output": NAME, "mode": Str(("append", "set")), "value": VALUE}),
        "acc": Obj({"name": NAME, "value": VALUE}),
        "fork": Obj({"node": NAME, "src": NAME, "dst": NAME}),
        "transfer": Obj({"value": NAME, "src": RANK, "dst": RANK}),
    }


OP = Tagged("op", _ops)
PORT_IN = Obj({"name": NAME, "type": TYPE}, {"default": AnyJSON(), "stream": Opt(NAME)})
PORT_OUT = Obj({"name": NAME, "type": TYPE, "mode": Str(("append", "set"))})
NODE = Obj({
    "engine": Str(("kv", "stateless")), "impl": NAME, "dtype": Str(NODE_DTYPES), "tags": List(NAME),
    "settings": Map(AnyJSON()), "inputs": Map(TYPE), "outputs": Map(TYPE),
    "phases": Map(Obj({"inputs": List(NAME), "outputs": List(NAME)},
                      {"reads": List(Obj({"node": NAME, "tag": Opt(NAME)}))})),
    "ranks": RANKS,
    "arch": Opt(Obj({"name": NAME, "args": Map(AnyJSON()), "dims": Map(AnyJSON()), "params": Int(), "bytes": Int(),
                     "tensors": List(Tuple((NAME, List(Int()), NAME, Opt(NAME))))},
                    {"kv": Opt(Obj({"layers": Int(1, MAX_KV_DIM), "kv_heads": Int(1, MAX_KV_DIM),
                                    "head_dim": Int(1, MAX_KV_DIM)}))})),
    "shard": Opt(Obj({"tp": Int(1, MAX_DEVICES), "ranks": RANKS,
                      "splits": Map(Obj({"kind": Str(("col", "row", "vocab", "expert", "replicate")),
                                         "dim": Opt(Int(0, 64)), "parts": Int(1, MAX_DEVICES)}))},
                     {"kv_heads_per_rank": Opt(Int(1, MAX_KV_DIM)), "heads_per_rank": Opt(Int(1, MAX_KV_DIM)),
                      "kv_replicas": Int(1, MAX_DEVICES), "bytes_per_rank": Int(),
                      "collectives": List(Obj({"op": Str(("all_reduce", "all_gather")), "after": Str(),
                                               "count": Int()}))})),
}, {"tag_max_len": Map(Int(1, INT_MAX)),
    # feature fp8_weights: the arch tensors the loader turns into FP8 (docs/plan-format.md)
    "quantized": Obj({"format": Str(("fp8_e4m3",)), "scales": Str(("per_output_channel",)),
                      "activations": Str(("per_token",)), "tensors": List(NAME, 1)})})
KV_POOL = Obj({"node": NAME, "pages": Int(1, MAX_KV_PAGES), "tokens": Int(1), "bytes_per_token": Int(1),
               "max_seq_len": Int(1), "bytes": Int(1)})
BODY = Obj({
    "schema": Obj({"major": Int(1, 1), "minor": Int(0, 1 << 16)}),
    "compiler": Str(),
    "model": Obj({"name": NAME, "variant": NAME, "source": Str(), "source_sha256": Str(), "config": Map(AnyJSON())}),
    "weights": Obj({"kind": Str(("none", "dummy", "dir")), "path": Opt(Str()),
                    "files": List(Obj({"name": NAME, "header_sha256": Str(), "bytes": Int()}))}),
    "placement": Obj({
        "name": Str(),
        "ranks": List(Obj({"rank": RANK, "type": Str(("cpu", "cuda")), "name": Str(), "memory_bytes": Int(1)},
                          {"hbm_bytes_per_s": Opt(Int(1))}), 1, MAX_DEVICES),
        "call_ranks": Map(RANKS),
        "resident": List(Obj({"rank": RANK, "nodes": List(NAME)})),
        "page_size": Int(1, MAX_PAGE_SIZE), "max_batch": Int(1, MAX_BATCH),
        "kv_memory_fraction": Num(0.0, 1.0, lo_open=True),
    }, {"hosts": List(Obj({"host": Int(0, MAX_DEVICES - 1), "ranks": RANKS})),
        "transfers": List(Obj({"walk": NAME, "value": NAME, "src_rank": RANK, "dst_rank": RANK})),
        "cross_host": List(Obj({"walk": NAME, "value": NAME, "kind": Str(), "src_rank": RANK, "dst_rank": RANK,
                                "src_host": Int(0), "dst_host": Int(0), "producer_step": NAME,
                                "consumer_step": NAME, "bytes": Opt(Int()), "per": List(Str())}))}),
    "nodes": Map(NODE),
    "edges": List(Obj({"id": NAME, "src": Tuple((NAME, NAME)), "dst": Tuple((NAME, NAME)), "policy": Opt(POLICY)})),
    "memory": Obj({"page_size": Int(1, MAX_PAGE_SIZE),
                   "ranks": List(Obj({"rank": RANK, "capacity_bytes": Int(1), "weights_bytes": Int(),
                                      "graph_pool_bytes": Int(), "workspace_bytes": Int(), "kv": List(KV_POOL)},
                                     {"node_weights": Map(Int()), "kv_budget_bytes": Int(), "free_bytes": Int()}))}),
    "streams": List(Obj({"id": NAME, "walk": NAME, "policy": POLICY, "chunk_items": Int(1, MAX_CHUNK_ITEMS),
                         "capacity": Int(1, MAX_STREAM_ITEMS), "producer_rank": RANK, "consumer_rank": RANK},
                        {"edge": NAME, "block": NAME, "item_type": TYPE})),
    "cuda_graphs": List(Obj({"key": NAME, "kind": Str(("step", "loop")), "rank": RANK, "steps": List(NAME),
                             "buckets": List(Int(1, MAX_BATCH))})),
    "walks": Map(Obj({"inputs": List(PORT_IN), "outputs": List(PORT_OUT), "streams": List(NAME), "program": OP},
                     {"routes": List(Obj({"route": NAME, "bind": Map(Str())})), "walk": NAME})),
    "transitions": List(Obj({"src": NAME, "dst": NAME, "when": NAME,
                             "keep": List(Obj({"node": NAME, "tag": NAME, "as": NAME}))})),
}, {"requires": List(NAME)})


# ------------------------------------------------------------------------------ checking
def check_body(body: Any) -> list[str]:
    """Every problem of the body, as `path message` sentences (at most `MAX_PROBLEMS`); empty
    when the body is one the compiler could have written."""
    out = _Out()
    try:
        BODY.check(body, "", out)
        if not out.problems:
            _references(body, out)
    except RecursionError:  # deeper than the JSON reader lets through (untrusted.MAX_JSON_DEPTH)
        out.add("", "nests too deeply")
    return out.problems


def _ops_of(region: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Pre-order ops of a program the schema has checked (iterative)."""
    stack = [region]
    while stack:
        op = stack.pop()
        yield op
        kind = op["op"]
        if kind == "seq":
            stack.extend(reversed(op["body"]))
        elif kind == "parallel":
            stack.extend(reversed([b["body"] for b in op["branches"]]))
        elif kind in ("loop", "on_stream"):
            stack.append(op["body"])


def _references(body: Mapping[str, Any], out: _Out) -> None:
    """What the schema cannot say: values that must agree across sections."""
    pl, mem = body["placement"], body["memory"]
    if mem["page_size"] != pl["page_size"]:
        out.add("memory.page_size", f"is {mem['page_size']}, the placement's page_size {pl['page_size']}")
    capacity = {r["rank"]: r["memory_bytes"] for r in pl["ranks"]}
    for i, m in enumerate(mem["ranks"]):
        where = f"memory.ranks[{i}]"
        if m["rank"] in capacity and m["capacity_bytes"] > capacity[m["rank"]]:
            out.add(where, f"claims {m['capacity_bytes']} bytes; rank {m['rank']} has {capacity[m['rank']]}")
        used = m["weights_bytes"] + m["graph_pool_bytes"] + m["workspace_bytes"]
        for j, k in enumerate(m["kv"]):
            kw = f"{where}.kv[{j}]"
            if k["tokens"] != k["pages"] * pl["page_size"] or k["bytes"] != k["tokens"] * k["bytes_per_token"]:
                out.add(kw, f"holds {k['pages']} pages, {k['tokens']} tokens, {k['bytes']} bytes: not "
                        f"pages x page_size {pl['page_size']} tokens of {k['bytes_per_token']} bytes")
            used += k["bytes"]
        if used > m["capacity_bytes"]:
            out.add(where, f"needs {used} bytes (weights, CUDA-graph pool, workspace, KV pools), over its "
                    f"capacity of {m['capacity_bytes']}")
    for i, s in enumerate(body["streams"]):
        if s["capacity"] < s["chunk_items"]:
            out.add(f"streams[{i}].capacity", f"is {s['capacity']}, less than a chunk of {s['chunk_items']} items")
    _names(body, out)
    for name, walk in body["walks"].items():
        _walk(name, walk, out)


def _names(body: Mapping[str, Any], out: _Out) -> None:
    """Every name one section gives another resolves: nodes, their ports, phases and tags,
    ranks, walks, streams and edges (what `mstarc explain` looks up as it renders a body).
    Worded as the loader's `_Invariants`, which repeat some of these on the typed views."""
    nodes, walks = body["nodes"], body["walks"]
    n_ranks = len(body["placement"]["ranks"])
    span = f"out of range 0..{n_ranks - 1}"
    stream_ids = {s["id"] for s in body["streams"]}
    edge_ids = {e["id"] for e in body["edges"]}

    def bad_ranks(listed: list[int]) -> bool:
        return any(not 0 <= r < n_ranks for r in listed)

    for r in body["placement"]["resident"]:
        if bad_ranks([r["rank"]]):
            out.say(f"placement.resident names rank {r['rank']}, {span}")
        for n in r["nodes"]:
            if n not in nodes:
                out.say(f"rank {r['rank']} hosts unknown node {n[:40]!r}")
    for name, n in nodes.items():
        for rank in n["ranks"]:
            if bad_ranks([rank]):
                out.say(f"node '{name}' is placed on rank {rank}, {span}")
        for ph, p in n["phases"].items():
            for port in p["inputs"]:
                if port not in n["inputs"]:
                    out.say(f"phase {name}.{ph} reads unknown input {port[:40]!r}")
            for port in p["outputs"]:
                if port not in n["outputs"]:
                    out.say(f"phase {name}.{ph} writes unknown output {port[:40]!r}")
    for m in body["memory"]["ranks"]:
        if bad_ranks([m["rank"]]):
            out.say(f"memory names rank {m['rank']}, {span}")
        for k in m["kv"]:
            if k["node"] not in nodes:
                out.say(f"memory of rank {m['rank']} holds a KV pool of unknown node {k['node'][:40]!r}")
    for e in body["edges"]:
        (sn, sp), (dn, dp) = e["src"], e["dst"]
        from_input = sn in walks and any(p["name"] == sp for p in walks[sn]["inputs"])
        if not from_input and (sn not in nodes or sp not in nodes[sn]["outputs"]):
            out.say(f"edge {e['id'][:80]!r} starts at {sn[:40]}.{sp[:40]}, not an output of a node or an input "
                    "of a walk")
        if dn not in nodes or dp not in nodes[dn]["inputs"]:
            out.say(f"edge {e['id'][:80]!r} ends at {dn[:40]}.{dp[:40]}, not an input of a node")
    for s in body["streams"]:
        if s["walk"] not in walks:
            out.say(f"stream {s['id'][:80]!r} belongs to unknown walk {s['walk'][:40]!r}")
        if "edge" in s and s["edge"] not in edge_ids:
            out.say(f"stream {s['id'][:80]!r} follows unknown edge {s['edge'][:80]!r}")
        if bad_ranks([s["producer_rank"], s["consumer_rank"]]):
            out.say(f"stream {s['id'][:80]!r} has a rank {span}")
    for t in body["transitions"]:
        for w in (t["src"], t["dst"]):
            if w not in walks:
                out.say(f"transition {t['src'][:40]} -> {t['dst'][:40]} names unknown walk {w[:40]!r}")
        for k in t["keep"]:
            if k["node"] not in nodes:
                out.say(f"transition {t['src'][:40]} -> {t['dst'][:40]} keeps a context of unknown node "
                        f"{k['node'][:40]!r}")
    for name, walk in walks.items():
        for op in _ops_of(walk["program"]):
            kind = op["op"]
            if kind == "call":
                _call_names(f"walk '{name}' step {op['id'][:40]!r}", op, nodes, n_ranks, out)
            elif kind == "on_stream" and op["stream"] not in stream_ids:
                out.say(f"walk '{name}' on_stream {op['id'][:40]!r} reads unknown stream {op['stream'][:80]!r}")
            elif kind == "fork" and op["node"] not in nodes:
                out.say(f"walk '{name}' forks {op['node'][:40]!r}, which is not a node")
            elif kind == "transfer" and bad_ranks([op["src"], op["dst"]]):
                out.say(f"walk '{name}' transfers {op['value'][:40]!r} between ranks {span}")


def _call_names(step: str, op: Mapping[str, Any], nodes: Mapping[str, Any], n_ranks: int, out: _Out) -> None:
    node = nodes.get(op["node"])
    if node is None:
        out.say(f"{step} calls unknown node {op['node'][:40]!r}")
        return
    name = op["node"]
    if op["phase"] not in node["phases"]:
        out.say(f"{step} calls unknown phase {name}.{op['phase'][:40]!r}; phases: {', '.join(node['phases']) or '(none)'}")
    tag = op["tag"]
    if node["engine"] == "kv" and tag not in node["tags"]:
        out.say(f"{step} uses KV tag {tag if tag is None else tag[:40]!r} of '{name}', which has tags: "
                f"{', '.join(node['tags'])}")
    elif node["engine"] == "stateless" and tag is not None:
        out.say(f"{step} gives a KV tag to stateless node '{name}'")
    if any(not 0 <= r < n_ranks for r in op["ranks"]):
        out.say(f"{step} ({name}.{op['phase'][:40]}) runs on ranks {op['ranks']!r}, out of range 0..{n_ranks - 1}")


def _walk(name: str, walk: Mapping[str, Any], out: _Out) -> None:
    if walk.get("walk", name) != name:  # the name a finished request's record gives (outputs.py)
        out.add(f"walks.{name}.walk", f"names walk {walk['walk']!r}, not {name!r}")
    outputs = {p["name"]: p["mode"] for p in walk["outputs"]}
    for op in _ops_of(walk["program"]):
        kind, where = op["op"], f"walks.{name}"
        if kind == "emit":
            mode = outputs.get(op["output"])
            if mode is None:
                out.add(where, f"emits '{op['output']}', which is not an output of the walk "
                        f"({', '.join(outputs) or 'none'})")
            elif mode != op["mode"]:
                out.add(where, f"emits '{op['output']}' with mode {op['mode']}; the output's mode is {mode}")
        elif kind == "loop":
            lw = f"{where} loop '{op['id']}'"
            count = op["count"]
            if op["dynamic"] and (op["max"] is None or op["until"] is None):
                out.add(lw, "is dynamic without a max and an until flag")
            elif not op["dynamic"] and count is None:
                out.add(lw, "has no count")
            elif not op["dynamic"] and "const" in count:
                c = count["const"]
                if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_LOOP_BOUND:
                    out.add(lw, f"has count {str(c)[:40]}; a loop runs 0..{MAX_LOOP_BOUND} times")
            elif not op["dynamic"] and op["max"] is None:
                out.add(lw, f"has count '{count['var']}' from the request but no max")
