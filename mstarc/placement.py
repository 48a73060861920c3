"""Placement files: a deployer's map of devices, ranks and per-model overrides (docs/placement.md).

`load_placement` reads a `placements/*.yaml` file into a `PlacementSpec`. The YAML is read
only with `yaml.compose` (a node tree, never `yaml.load`), so every value keeps its line
and column and every problem becomes a `Diagnostic` at the offending value: E050 for a
malformed file (bad YAML, unknown or missing key, wrong type), E055 for a bad device, E057
for hosts that do not take the ranks in order, each once. All problems of the file are
collected and raised together as one `CompileError`.

The loader checks only what the file alone can tell. Whether the named nodes, walks and
branches exist, whether ranks are in range and whether the model fits are the `place`,
`shard_tp` and `memory` passes' business; they report at the spans kept here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mstar_runtime.sizes import GIB, human_bytes
from mstarc import limits
from mstarc.diagnostics import CompileError, DiagnosticSink, Span

DEVICE_TYPES = ("cuda", "cpu")
SPREAD = "spread"
DEFAULT_KV_MEMORY_FRACTION = 0.9
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_BATCH = 64
TB = 10**12

_TOP_KEYS = ("placement", "devices", "hosts", "kv_memory_fraction", "page_size", "max_batch", "default_rank",
             "models")
_DEVICE_KEYS = ("rank", "type", "name", "memory_gib", "hbm_tb_s")
_SHORTHAND_KEYS = ("count", "type", "name", "memory_gib", "hbm_tb_s")
_HOSTS_SHORTHAND_KEYS = ("count", "devices")
_HOST_KEYS = ("ranks",)
_MODEL_KEYS = ("nodes", "walks")
_NODE_KEYS = ("rank", "ranks", "tp", "weights")
# `weights:` of a node entry: how its weights are held, if not in the checkpoint's dtype
WEIGHT_FORMATS = ("fp8",)
_WALK_KEYS = ("nodes", "branches")
_NO_SPAN = Span.unknown()
# Bounds of values the plan records (far above any device; keeps every size a 64-bit integer).
MAX_MEMORY_GIB = 1 << 20  # 1 PiB
MAX_HBM_TB_S = 1000
_MAXIMA = {"page_size": 1 << 20, "max_batch": 1 << 16}


@dataclass(frozen=True)
class _Huge:
    """A YAML integer with more digits than Python converts to an int."""

    digits: int

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"


def _short(v: Any) -> str:
    text = str(v) if not isinstance(v, int) or v.bit_length() < 256 else f"an integer of {v.bit_length()} bits"
    return text


@dataclass(frozen=True)
class DeviceSpec:
    """One rank's device. `span` is the device entry (for the `count:` shorthand, the shorthand)."""

    rank: int
    type: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int
    hbm_bytes_per_s: int | None  # None: not given (the benchmarks then have no HBM floor)
    span: Span = field(default=_NO_SPAN, compare=False)

    @property
    def label(self) -> str:
        return f"{self.type} {self.name}, {human_bytes(self.memory_bytes)}"


@dataclass(frozen=True)
class HostSpec:
    """One host of a multi-host placement: its ranks, in the order of its local devices.

    The ranks of host h follow those of host h - 1 (torchrun numbers the processes of its
    nodes that way), so host h's i-th rank runs on that host's device i."""

    host: int
    ranks: tuple[int, ...]
    span: Span = field(default=_NO_SPAN, compare=False)  # the host's entry (the shorthand: `hosts`)


@dataclass(frozen=True)
class RankGroup:
    """Ranks named by a placement entry, with the span of each rank value (for E051)."""

    ranks: tuple[int, ...]
    span: Span = field(default=_NO_SPAN, compare=False)  # the key that names the node/branch
    rank_spans: tuple[Span, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class NodePlacement:
    """`models.<model>.nodes.<node>`: the node's ranks and tensor-parallel degree.

    `ranks` may hold several TP groups (replicas): ranks [0, 1, 2] with tp 1 keeps one
    instance on each rank; ranks [0, 1, 2, 3] with tp 2 two TP groups (0, 1) and (2, 3).
    """

    node: str
    group: RankGroup
    tp: int
    tp_span: Span = field(default=_NO_SPAN, compare=False)  # the tp value, else the ranks value
    # `weights: fp8`: the arch's FP8-able projections held as E4M3 (None: the checkpoint's dtype)
    weights: str | None = None
    weights_span: Span = field(default=_NO_SPAN, compare=False)

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.group.ranks


@dataclass(frozen=True)
class WalkPlacement:
    """`models.<model>.walks.<walk>`: (walk, node) and (walk, branch) rank overrides."""

    walk: str
    nodes: dict[str, RankGroup]
    branches: dict[str, RankGroup]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class ModelPlacement:
    model: str
    nodes: dict[str, NodePlacement]
    walks: dict[str, WalkPlacement]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class PlacementSpec:
    name: str
    file: str  # display name used in spans
    devices: tuple[DeviceSpec, ...]  # sorted by rank; ranks are 0..N-1
    kv_memory_fraction: float
    page_size: int
    max_batch: int
    default_rank: int | str  # a rank, or SPREAD
    models: dict[str, ModelPlacement]
    default_rank_span: Span = field(default=_NO_SPAN, compare=False)
    span: Span = field(default=_NO_SPAN, compare=False)  # the whole document
    # the hosts the ranks run on (docs/distributed.md); empty: one host, as before
    hosts: tuple[HostSpec, ...] = ()

    def host_of(self, rank: int) -> int | None:
        """The host of `rank`; None when the placement names no hosts (or the rank is on none)."""
        for h in self.hosts:
            if rank in h.ranks:
                return h.host
        return None

    def model(self, name: str) -> ModelPlacement:
        """The section for model `name`; an empty one when the file has none."""
        return self.models.get(name) or ModelPlacement(name, {}, {}, self.span)


def load_placement(path: str | Path, display_name: str | None = None) -> PlacementSpec:
    """Read and check a placement file; raises CompileError with every problem found."""
    file = display_name or str(path)
    try:
        text = limits.read_text_capped(path, file, limits.MAX_PLACEMENT_BYTES)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        sink = DiagnosticSink()
        sink.error("E004", f"cannot read placement file '{file}': {reason}", Span(file, 1, 1))
        sink.check()
        raise AssertionError("unreachable") from None  # pragma: no cover
    return parse_placement(text, file)


def parse_placement(text: str, file: str) -> PlacementSpec:
    """`load_placement` for text already in memory (`file` names it in diagnostics)."""
    sink = DiagnosticSink()
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        sink.error("E050", f"malformed YAML: {_yaml_problem(e)}", _mark_span(file, e))
        raise CompileError(sink.diagnostics) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        sink.error("E050", "malformed YAML: lists or mappings nest too deeply", Span(file, 1, 1),
                   "a placement file nests a few levels; see docs/placement.md")
        raise CompileError(sink.diagnostics) from None
    spec = _Reader(file, sink).document(root, Path(file).stem)
    sink.check()
    assert spec is not None
    return spec


# ---- YAML plumbing -------------------------------------------------------------------------


def _yaml_problem(e: yaml.YAMLError) -> str:
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{problem} ({context})" if context else problem


def _mark_span(file: str, e: yaml.YAMLError) -> Span:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return Span(file, 1, 1)
    return Span(file, mark.line + 1, mark.column + 1, mark.line + 1, mark.column + 2)


_SCALARS = yaml.constructor.SafeConstructor()
_TYPE_WORDS = {"tag:yaml.org,2002:map": "a mapping", "tag:yaml.org,2002:seq": "a list",
               "tag:yaml.org,2002:int": "an integer", "tag:yaml.org,2002:float": "a number",
               "tag:yaml.org,2002:bool": "a boolean", "tag:yaml.org,2002:null": "null",
               "tag:yaml.org,2002:str": "a string"}


class _Reader:
    """Turns the composed node tree into a PlacementSpec, reporting into `sink`."""

    def __init__(self, file: str, sink: DiagnosticSink):
        self.file, self.sink = file, sink

    def span(self, node: yaml.Node) -> Span:
        s, e = node.start_mark, node.end_mark
        return Span(self.file, s.line + 1, s.column + 1, e.line + 1, e.column + 1)

    def bad(self, node: yaml.Node, what: str, want: str) -> None:
        got = _TYPE_WORDS.get(node.tag, "a tagged value")
        if isinstance(node, yaml.ScalarNode) and node.tag != "tag:yaml.org,2002:null":
            value = node.value if len(node.value) <= 60 else node.value[:57] + "..."
            got = f"{got} ({value!r})" if node.tag == "tag:yaml.org,2002:str" else f"{got} ({value})"
        self.sink.error("E050", f"{what} must be {want}, got {got}", self.span(node))

    def mapping(self, node: yaml.Node, what: str, allowed: tuple[str, ...] | None,
                required: tuple[str, ...] = ()) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """key -> (key node, value node); unknown, duplicate and missing keys are reported."""
        if not isinstance(node, yaml.MappingNode):
            self.bad(node, what, "a mapping")
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag != "tag:yaml.org,2002:str":
                self.bad(k, f"a key of {what}", "a name")
                continue
            if allowed is not None and k.value not in allowed:
                self.sink.error("E050", f"unknown key '{k.value}' in {what}", self.span(k),
                                f"known keys: {', '.join(allowed)}")
                continue
            if k.value in out:
                self.sink.error("E050", f"key '{k.value}' appears twice in {what}", self.span(k))
                continue
            out[k.value] = (k, v)
        for key in required:
            if key not in out:
                self.sink.error("E050", f"{what} has no '{key}'", self.span(node),
                                f"add `{key}:`; see docs/placement.md")
        return out

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return node
        try:
            return _SCALARS.construct_object(node)
        except (ValueError, yaml.YAMLError):  # an integer of more digits than Python converts
            return _Huge(len(node.value))

    def integer(self, node: yaml.Node, what: str, minimum: int | None = None,
                maximum: int = limits.INT_MAX) -> int | None:
        v = self.scalar(node)
        if isinstance(v, _Huge):
            self.sink.error("E050", f"{what} must be at most {maximum}, got {v}", self.span(node))
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.bad(node, what, "an integer")
            return None
        if minimum is not None and v < minimum:
            self.sink.error("E050", f"{what} must be at least {minimum}, got {_short(v)}", self.span(node))
            return None
        if v > maximum:
            self.sink.error("E050", f"{what} must be at most {maximum}, got {_short(v)}", self.span(node))
            return None
        return v

    def number(self, node: yaml.Node, what: str, code: str = "E050", maximum: float | None = None) -> float | None:
        """A positive int or float, at most `maximum` (else reported with `code`)."""
        v = self.scalar(node)
        if isinstance(v, _Huge):
            self.sink.error(code, f"{what} must be at most {maximum}, got {v}", self.span(node))
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.bad(node, what, "a number")
            return None
        if not v > 0 or v == float("inf"):
            self.sink.error(code, f"{what} must be a positive number, got {_short(v)}", self.span(node))
            return None
        if maximum is not None and v > maximum:
            self.sink.error(code, f"{what} must be at most {maximum}, got {_short(v)}", self.span(node))
            return None
        return v

    def string(self, node: yaml.Node, what: str) -> str | None:
        v = self.scalar(node)
        if not isinstance(v, str) or not v:
            self.bad(node, what, "a non-empty string")
            return None
        return v

    def rank_group(self, key: yaml.Node, node: yaml.Node, what: str) -> RankGroup | None:
        """An int or a non-empty list of distinct ints; range checks are the place pass's."""
        items = node.value if isinstance(node, yaml.SequenceNode) else [node]
        if isinstance(node, yaml.SequenceNode) and not items:
            self.sink.error("E050", f"{what} names no ranks", self.span(node))
            return None
        ranks: list[int] = []
        seen: set[int] = set()
        spans: list[Span] = []
        for item in items:
            r = self.integer(item, f"a rank of {what}")
            if r is None:
                return None
            if r in seen:
                self.sink.error("E050", f"rank {r} is listed twice for {what}", self.span(item))
                return None
            ranks.append(r)
            seen.add(r)
            spans.append(self.span(item))
        return RankGroup(tuple(ranks), self.span(key), tuple(spans))

    # ---- the document
    def document(self, root: yaml.Node | None, stem: str) -> PlacementSpec | None:
        if root is None:
            self.sink.error("E050", "placement file is empty", Span(self.file, 1, 1), "see docs/placement.md")
            return None
        top = self.mapping(root, "the placement file", _TOP_KEYS, ("devices",))
        if top is None:
            return None
        name = stem
        if "placement" in top:
            name = self.string(top["placement"][1], "'placement'") or stem
        devices = self.devices(top["devices"][1]) if "devices" in top else ()
        hosts = self.hosts(top["hosts"][1], len(devices)) if "hosts" in top and devices else ()
        fraction = DEFAULT_KV_MEMORY_FRACTION
        if "kv_memory_fraction" in top:
            node = top["kv_memory_fraction"][1]
            v = self.number(node, "'kv_memory_fraction'")
            if v is not None and v > 1:
                self.sink.error("E050", f"'kv_memory_fraction' is a share of memory, at most 1, got {v}",
                                self.span(node))
            elif v is not None:
                fraction = float(v)
        ints = {"page_size": DEFAULT_PAGE_SIZE, "max_batch": DEFAULT_MAX_BATCH}
        for key in ints:
            if key in top:
                ints[key] = self.integer(top[key][1], f"'{key}'", 1, _MAXIMA[key]) or ints[key]
        default_rank: int | str = 0
        default_span = self.span(root)
        if "default_rank" in top:
            node = top["default_rank"][1]
            default_span = self.span(node)
            v = self.scalar(node)
            if v == SPREAD:
                default_rank = SPREAD
            elif isinstance(v, int) and not isinstance(v, bool) and limits.int_fits(v):
                default_rank = v
            else:
                self.bad(node, "'default_rank'", "a rank or `spread`")
        models: dict[str, ModelPlacement] = {}
        if "models" in top:
            sections = self.mapping(top["models"][1], "'models'", None) or {}
            for model, (k, v) in sections.items():
                section = self.model(model, k, v)
                if section is not None:
                    models[model] = section
        return PlacementSpec(name, self.file, devices, fraction, ints["page_size"], ints["max_batch"],
                             default_rank, models, default_span, self.span(root), hosts)

    def hosts(self, node: yaml.Node, n_ranks: int) -> tuple[HostSpec, ...]:
        """`hosts: {count: H, devices: D}` or `hosts: [{ranks: [...]}, ...]`: every rank on
        one host, host by host in rank order (E057 otherwise)."""
        order = ("hosts take the ranks in order, as torchrun numbers its nodes' processes: "
                 "host 0 ranks 0..k-1, host 1 the next ones, ...")
        if isinstance(node, yaml.MappingNode):
            d = self.mapping(node, "'hosts'", _HOSTS_SHORTHAND_KEYS, _HOSTS_SHORTHAND_KEYS)
            if d is None or len(d) < 2:
                return ()
            count = self.integer(d["count"][1], "'hosts.count'", 1, limits.MAX_DEVICES)
            per = self.integer(d["devices"][1], "'hosts.devices'", 1, limits.MAX_DEVICES)
            if count is None or per is None:
                return ()
            if count * per != n_ranks:
                self.sink.error("E057", f"{count} host{'s' if count > 1 else ''} of {per} device"
                                f"{'s' if per > 1 else ''} make {count * per} rank{'s' if count * per > 1 else ''}, "
                                f"but 'devices' has {n_ranks}", self.span(node),
                                "give as many ranks per host as each host has devices, or list them: "
                                "`hosts: [{ranks: [0, 1]}, {ranks: [2]}]`")
                return ()
            return tuple(HostSpec(h, tuple(range(h * per, (h + 1) * per)), self.span(node)) for h in range(count))
        if not isinstance(node, yaml.SequenceNode):
            self.bad(node, "'hosts'", "a list of {ranks: [...]} or {count: H, devices: D}")
            return ()
        if not node.value:
            self.sink.error("E057", "'hosts' is empty", self.span(node), "list each host's ranks, or leave `hosts` out")
            return ()
        out: list[HostSpec] = []
        due = 0  # the next rank a host must take
        for h, item in enumerate(node.value):
            d = self.mapping(item, f"host {h}", _HOST_KEYS, _HOST_KEYS)
            if d is None or "ranks" not in d:
                return ()
            value = d["ranks"][1]
            if not isinstance(value, yaml.SequenceNode):
                self.bad(value, f"'ranks' of host {h}", "a list of ranks")
                return ()
            g = self.rank_group(d["ranks"][0], value, f"host {h}")
            if g is None:
                return ()
            for r, span in zip(g.ranks, g.rank_spans):
                if r >= n_ranks:
                    self.sink.error("E057", f"host {h} lists rank {r}, but the placement has {n_ranks} "
                                    f"rank{'s' if n_ranks > 1 else ''}", span,
                                    f"known ranks: 0..{n_ranks - 1}")
                    return ()
                if r != due:
                    self.sink.error("E057", f"host {h} lists rank {r} where rank {due} is due", span, order)
                    return ()
                due += 1
            out.append(HostSpec(h, g.ranks, self.span(item)))
        if due != n_ranks:
            left = f"rank {due} is" if due == n_ranks - 1 else f"ranks {due}..{n_ranks - 1} are"
            self.sink.error("E057", f"{left} on no host", self.span(node), "every rank runs on one host: " + order)
            return ()
        return tuple(out)

    def devices(self, node: yaml.Node) -> tuple[DeviceSpec, ...]:
        if isinstance(node, yaml.MappingNode):  # the {count: N, ...} shorthand
            d = self.mapping(node, "'devices'", _SHORTHAND_KEYS, ("count", "type", "memory_gib"))
            if d is None or "count" not in d:
                return ()
            count = self.integer(d["count"][1], "'devices.count'")
            if count is None:
                return ()
            if count < 1:
                self.sink.error("E055", f"'devices.count' must be at least 1, got {count}", self.span(d["count"][1]))
                return ()
            if count > limits.MAX_DEVICES:
                self.sink.error("E055", f"'devices.count' must be at most {limits.MAX_DEVICES}, got {count}",
                                self.span(d["count"][1]), f"a placement has at most {limits.MAX_DEVICES} devices")
                return ()
            one = self.device_fields(d, self.span(node), "the devices")
            return tuple(DeviceSpec(r, *one[1:], span=one[0]) for r in range(count)) if one else ()
        if not isinstance(node, yaml.SequenceNode):
            self.bad(node, "'devices'", "a list of devices or {count: N, type: ..., memory_gib: ...}")
            return ()
        if not node.value:
            self.sink.error("E055", "'devices' is empty", self.span(node), "a placement needs at least one device")
            return ()
        if len(node.value) > limits.MAX_DEVICES:
            self.sink.error("E055", f"'devices' lists {len(node.value)} devices, more than {limits.MAX_DEVICES}",
                            self.span(node), f"a placement has at most {limits.MAX_DEVICES} devices")
            return ()
        out: list[DeviceSpec] = []
        seen: set[int] = set()
        for i, item in enumerate(node.value):
            what = f"device {i + 1}"
            d = self.mapping(item, what, _DEVICE_KEYS, ("rank", "type", "memory_gib"))
            if d is None or "rank" not in d:
                continue
            rank = self.integer(d["rank"][1], f"the rank of {what}")
            one = self.device_fields(d, self.span(item), what)
            if rank is None:
                continue
            rank_span = self.span(d["rank"][1])
            if not 0 <= rank < len(node.value):
                self.sink.error("E055", f"device rank {rank} is out of range", rank_span,
                                f"{len(node.value)} devices take ranks 0..{len(node.value) - 1}, each once")
            elif rank in seen:
                self.sink.error("E055", f"device rank {rank} is defined twice", rank_span,
                                f"{len(node.value)} devices take ranks 0..{len(node.value) - 1}, each once")
            elif one is not None:
                out.append(DeviceSpec(rank, *one[1:], span=one[0]))
            seen.add(rank)
        return tuple(sorted(out, key=lambda dv: dv.rank))

    def device_fields(self, d: dict[str, tuple[yaml.Node, yaml.Node]], span: Span,
                      what: str) -> tuple[Span, str, str, int, int | None] | None:
        """(span, type, name, memory bytes, HBM bytes/s) of a device entry, or None."""
        ok = True
        dtype = None
        if "type" in d:
            node = d["type"][1]
            dtype = self.string(node, f"the type of {what}")
            if dtype is not None and dtype not in DEVICE_TYPES:
                self.sink.error("E055", f"device type must be 'cuda' or 'cpu', not '{dtype}'", self.span(node))
                dtype = None
        ok = ok and dtype is not None
        name = self.string(d["name"][1], f"the name of {what}") if "name" in d else dtype
        memory = self.number(d["memory_gib"][1], f"'memory_gib' of {what}", "E055", MAX_MEMORY_GIB) \
            if "memory_gib" in d else None
        hbm = None
        if "hbm_tb_s" in d:
            hbm = self.number(d["hbm_tb_s"][1], f"'hbm_tb_s' of {what}", "E055", MAX_HBM_TB_S)
            ok = ok and hbm is not None
        # the plan holds whole bytes and bytes/s, at least 1 (plan/check.py): 1e-300 GiB is no memory
        if memory is not None and round(memory * GIB) < 1:
            self.sink.error("E055", f"'memory_gib' of {what} is {_short(memory)}, less than one byte",
                            self.span(d["memory_gib"][1]))
            memory = None
        if hbm is not None and round(hbm * TB) < 1:
            self.sink.error("E055", f"'hbm_tb_s' of {what} is {_short(hbm)}, less than one byte per second",
                            self.span(d["hbm_tb_s"][1]))
            ok = False
        if not ok or name is None or memory is None:
            return None
        return (span, dtype, name, int(round(memory * GIB)), None if hbm is None else int(round(hbm * TB)))

    def model(self, model: str, key: yaml.Node, node: yaml.Node) -> ModelPlacement | None:
        what = f"'models.{model}'"
        d = self.mapping(node, what, _MODEL_KEYS)
        if d is None:
            return None
        nodes: dict[str, NodePlacement] = {}
        if "nodes" in d:
            for name, (k, v) in (self.mapping(d["nodes"][1], f"{what}.nodes", None) or {}).items():
                entry = self.node(name, k, v, f"node '{name}'")
                if entry is not None:
                    nodes[name] = entry
        walks: dict[str, WalkPlacement] = {}
        if "walks" in d:
            for walk, (k, v) in (self.mapping(d["walks"][1], f"{what}.walks", None) or {}).items():
                w = self.mapping(v, f"walk '{walk}'", _WALK_KEYS)
                if w is None:
                    continue
                tables: dict[str, dict[str, RankGroup]] = {"nodes": {}, "branches": {}}
                for table, out in tables.items():
                    if table in w:
                        items = self.mapping(w[table][1], f"'{walk}.{table}'", None) or {}
                        for name, (kk, vv) in items.items():
                            g = self.rank_group(kk, vv, f"'{walk}.{table}.{name}'")
                            if g is not None:
                                out[name] = g
                walks[walk] = WalkPlacement(walk, tables["nodes"], tables["branches"], self.span(k))
        return ModelPlacement(model, nodes, walks, self.span(key))

    def node(self, name: str, key: yaml.Node, node: yaml.Node, what: str) -> NodePlacement | None:
        if isinstance(node, yaml.ScalarNode):  # `llm: 0` is short for {rank: 0}
            g = self.rank_group(key, node, what)
            return NodePlacement(name, g, 1, self.span(node)) if g else None
        d = self.mapping(node, what, _NODE_KEYS)
        if d is None:
            return None
        if ("rank" in d) == ("ranks" in d):
            self.sink.error("E050", f"{what} needs exactly one of 'rank' and 'ranks'", self.span(node),
                            "`{rank: 0}` for one rank, `{ranks: [0, 1], tp: 2}` for a group")
            return None
        rank_key = "rank" if "rank" in d else "ranks"
        value = d[rank_key][1]
        if rank_key == "ranks" and not isinstance(value, yaml.SequenceNode):
            self.bad(value, f"'ranks' of {what}", "a list of ranks")
            return None
        if rank_key == "rank" and not isinstance(value, yaml.ScalarNode):
            self.bad(value, f"'rank' of {what}", "an integer")
            return None
        g = self.rank_group(key, value, what)
        if g is None:
            return None
        tp, tp_span = len(g.ranks), self.span(value)
        if "tp" in d:
            tp_span = self.span(d["tp"][1])
            tp = self.integer(d["tp"][1], f"'tp' of {what}", 1, limits.MAX_DEVICES) or tp
            if len(g.ranks) % tp:
                self.sink.error("E050", f"{what} has {len(g.ranks)} rank{'s' if len(g.ranks) > 1 else ''}, "
                                f"not a multiple of its tp {tp}", tp_span,
                                "list tp ranks per tensor-parallel group (several groups are replicas)")
                return None
        weights, weights_span = None, _NO_SPAN
        if "weights" in d:
            weights_span = self.span(d["weights"][1])
            weights = self.string(d["weights"][1], f"'weights' of {what}")
            if weights is not None and weights not in WEIGHT_FORMATS:
                self.sink.error("E050", f"'weights' of {what} is '{weights}'; the only format is "
                                f"{', '.join(WEIGHT_FORMATS)}", weights_span,
                                "leave 'weights' out to keep the checkpoint's dtype")
                return None
        return NodePlacement(name, g, tp, tp_span, weights, weights_span)
