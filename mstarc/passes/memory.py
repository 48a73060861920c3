"""memory: bytes per rank (weights, CUDA-graph pool, workspace) and the paged KV pool they leave.

Requires: `place` and `shard-tp` have run.
Ensures:  `model.memory` is a `MemoryIR` with, per rank:
  weights    the sum over the node instances resident there of their per-rank bytes after
             sharding; when `model.checkpoint.tensors` is non-empty each arch tensor found
             there is sized from the checkpoint's dtype and shape instead of the arch's.
             Under the placement's `weights: fp8` the node's FP8 tensors count one byte per
             element and a float32 scale per output row (`shard_tp.stored_bytes`): what the
             node holds once the loader has quantized them.
  graph pool (cuda ranks only) for every graphed node there (an arch, `cuda_graphs` not
             false, a phase whose inputs all have fixed shapes and that reads no other
             context, as the cuda-graphs pass captures them): the largest over its graphed
             phases of B * (rows * act + logits), plus buckets * 4 MiB, where rows is what
             one request adds to the step (`step_tokens`: 1 for a decode, latent_len for a
             denoise block) and B the largest bucket the phase is captured at (max_batch,
             or fewer for a multi-row step: B * rows stays within `graph_max_tokens`). All
             buckets of a node share one pool, captured largest first, so the largest
             bucket's activations are what the pool holds; 4 MiB per bucket covers each
             graph's executable and private allocations. A phase that reads other
             contexts and that a loop runs as its recurrent step (`reading_steps`: the
             decode cohort captures it) counts too; a reading block (rows > 1: the
             cohort's `attend_block`) also holds, per row, its read context gathered in
             float32 with the block at the KV and the query heads and two score tensors:
             2 * 4 * (read + rows) * head_dim * (kv_heads + heads) + 2 * 4 * heads * rows
             * (read + rows), read the longest context it reads.
  workspace  the largest over the rank's arch nodes (a worker runs one step at a time) of
             rows * act + max_batch * logits, plus 256 MiB on a cuda rank with an
             arch node (FlashInfer's 128 MiB float workspace and cuBLAS workspaces).
             rows is the node's `max_prefill_tokens` setting (default 8192, the
             chunked-prefill budget), or max_batch when act is per item (below).
  where, per token (per item of a stateless node), with per-rank sizes after sharding and d
  the node dtype's bytes; an arch whose dims state `activation_elements` (its peak per row,
  e.g. SNAC's decoder for one window of codes) gets act = d * activation_elements instead:
             act    = d * (4 * hidden + heads_r * head_dim + 2 * kv_heads_r * head_dim
                           + 2 * inter_r)        (residual, norm, attention and MLP outputs;
                                                  q, k, v; gate and up)
             inter_r = intermediate / tp, or moe_intermediate * top_k / tp for MoE
                       (top_k from the arch's dims, default 8)
             logits = 4 * vocab / tp             (fp32 logits for sampling)
  KV         bytes per token of each kv node there: 2 * layers * kv_heads_r * head_dim * d;
             pool budget = floor(kv_memory_fraction * (capacity - weights - graph pool
             - workspace)), split so that every kv node of the rank holds the same number
             of tokens, in whole pages; a TP group's ranks all take the smallest page count
             of the group so that page ids agree. Only kv nodes with KV geometry (an arch
             with `kv`) hold a pool. A pool is capped at what can ever be used at once:
             max_batch requests x the sum over the node's KV tags of each tag's longest
             context (its `max_len`, else max_seq_len) (so a CPU rank with 16 GiB does not
             zero 14 GiB of pool for a tiny model). Every context counts: a decoder's
             cross-attention tag as much as its own.
Fails when: weights + graph pool + workspace exceed a rank's memory (E060), or a kv node's
          pool cannot hold one sequence of its `max_seq_len` setting, default 4096 (or, when
          every tag of the node has a `max_len`, of the largest of them), or
          what one step of it holds at once when its phase reads another of its contexts
          (own tag + read tags, each at its longest) (E061);
          both at the device's YAML entry, all ranks checked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mstar_runtime.sizes import MIB, human_bytes
from mstarc import ir as I
from mstarc.diagnostics import DiagnosticSink
from mstarc.passes.cuda_graphs import (
    batch_buckets,
    captured_buckets,
    graphed_phases,
    reading_steps,
    step_tokens,
)
from mstarc.passes.shard_tp import ShardSpec, fp8_tensors, stored_bytes

DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_PREFILL_TOKENS = 8192
DEFAULT_MOE_TOP_K = 8
GRAPH_BYTES_PER_BUCKET = 4 * MIB
CUDA_WORKSPACE_FIXED = 256 * MIB
# safetensors dtypes as mstarc.checkpoint names them, beyond the IR's own
_DTYPE_BYTES = {**I.DTYPE_BYTES, "f64": 8, "i8": 1, "i16": 2, "f8e4m3": 1, "f8e5m2": 1}


@dataclass(frozen=True)
class KVPoolIR:
    node: str
    bytes_per_token: int
    tokens: int
    pages: int
    bytes: int
    max_seq_len: int

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "bytes_per_token": self.bytes_per_token, "tokens": self.tokens,
                "pages": self.pages, "bytes": self.bytes, "max_seq_len": self.max_seq_len}


@dataclass(frozen=True)
class RankMemoryIR:
    rank: int
    capacity_bytes: int
    node_weights: dict[str, int]  # resident node -> its bytes on this rank
    graph_pool_bytes: int
    workspace_bytes: int
    kv_budget_bytes: int
    kv: tuple[KVPoolIR, ...]  # sorted by node

    @property
    def weights_bytes(self) -> int:
        return sum(self.node_weights.values())

    @property
    def free_bytes(self) -> int:
        """What is left after everything above; never negative for a compiled plan."""
        used = self.weights_bytes + self.graph_pool_bytes + self.workspace_bytes + sum(k.bytes for k in self.kv)
        return self.capacity_bytes - used

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "capacity_bytes": self.capacity_bytes, "weights_bytes": self.weights_bytes,
                "node_weights": dict(sorted(self.node_weights.items())), "graph_pool_bytes": self.graph_pool_bytes,
                "workspace_bytes": self.workspace_bytes, "kv_budget_bytes": self.kv_budget_bytes,
                "kv": [k.to_json() for k in self.kv], "free_bytes": self.free_bytes}


@dataclass(frozen=True)
class MemoryIR:
    page_size: int
    ranks: tuple[RankMemoryIR, ...]
    weights_source: dict[str, str]  # node with an arch -> "arch" | "checkpoint" | "mixed"

    def to_json(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "ranks": [r.to_json() for r in self.ranks],
                "weights_source": dict(sorted(self.weights_source.items()))}


def memory(model: I.ModelIR) -> I.ModelIR:
    sink = DiagnosticSink()
    pl, sharding = model.placement, model.sharding
    node_bytes, sources = _node_weight_bytes(model, sharding)
    rows: list[RankMemoryIR] = []
    pages: dict[int, dict[str, int]] = {}  # rank -> kv node -> pages
    too_full: set[int] = set()
    for rank in pl.ranks:
        resident = [model.nodes[n] for n in pl.resident.get(rank.rank, ())]
        weights = {n.name: node_bytes[n.name] for n in resident}
        graph, ws = _graph_pool_and_workspace(model, rank.type == "cuda", resident, sharding, pl.max_batch)
        need = sum(weights.values()) + graph + ws
        if need > rank.memory_bytes:
            too_full.add(rank.rank)
            largest = sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
            sink.error("E060", f"{rank.label} needs {human_bytes(sum(weights.values()))} for weights, "
                       f"{human_bytes(graph)} for the CUDA-graph pool and {human_bytes(ws)} of workspace: "
                       f"{human_bytes(need)} in all; largest nodes: "
                       + ", ".join(f"{n} {human_bytes(b)}" for n, b in largest), rank.span,
                       "use more ranks (or `default_rank: spread`), a higher tp for the largest node, "
                       "or a smaller variant")
        budget = max(0, int(pl.kv_memory_fraction * (rank.memory_bytes - need)))
        kv_bpt = {n.name: _kv_bytes_per_token(n, sharding[n.name]) for n in resident
                  if n.engine == "kv" and n.arch is not None and n.arch.kv is not None}
        per_token = sum(kv_bpt.values())
        pages[rank.rank] = {n: min(budget // (pl.page_size * per_token), _useful_pages(model.nodes[n], pl))
                            for n in sorted(kv_bpt)}
        rows.append(RankMemoryIR(rank.rank, rank.memory_bytes, weights, graph, ws, budget, ()))
    # TP shards of one node must agree on page ids: every rank of the group takes its minimum
    for name, spec in sharding.items():
        held = [p[name] for p in pages.values() if name in p]
        if spec.tp > 1 and held:
            for p in pages.values():
                if name in p:
                    p[name] = min(held)
    needs = {n: _one_step_tokens(model, node) for n, node in model.nodes.items()}
    out: list[RankMemoryIR] = []
    for row, rank in zip(rows, pl.ranks):
        pools = []
        for name, n_pages in pages[row.rank].items():
            node = model.nodes[name]
            bpt = _kv_bytes_per_token(node, sharding[name])
            tokens = n_pages * pl.page_size
            max_seq = _setting(node, "max_seq_len", DEFAULT_MAX_SEQ_LEN)
            pools.append(KVPoolIR(name, bpt, tokens, n_pages, tokens * bpt, max_seq))
            need, parts = needs[name]
            if tokens < need and row.rank not in too_full:
                what = (f"the {need} tokens one step holds at once ({parts})" if parts else
                        f"one sequence of max_seq_len {max_seq}" if need == max_seq else
                        f"its longest context ({need} tokens, the largest max_len of its tags)")
                sink.error("E061", f"{rank.label}: the KV pool of node '{name}' holds {tokens} tokens, fewer than "
                           f"{what} ({bpt} bytes per token)", rank.span,
                           "give the rank more memory or fewer nodes, raise kv_memory_fraction or tp, "
                           "or lower the node's max_seq_len" + (" or its tags' max_len" if parts else ""))
        out.append(dataclasses.replace(row, kv=tuple(pools)))
    sink.check()
    return dataclasses.replace(model, memory=MemoryIR(pl.page_size, tuple(out), sources))


def _read_len(model: I.ModelIR, phase: I.PhaseIR) -> int:
    """The longest context a reading phase attends to besides its own, in tokens (a read
    without a tag may be of any tag of its node: the longest)."""
    lens = [0]
    for r in phase.reads:
        node = model.nodes[r.node]
        lens.append(_tag_len(node, r.tag) if r.tag is not None else max(_tag_len(node, t) for t in node.tags))
    return max(lens)


def _tag_len(node: I.NodeIR, tag: str) -> int:
    """The longest context of one tag: its own `max_len`, else the node's max_seq_len."""
    return node.tag_max_len.get(tag) or _setting(node, "max_seq_len", DEFAULT_MAX_SEQ_LEN)


def _useful_pages(node: I.NodeIR, pl) -> int:
    """Pages beyond max_batch requests, each with all its tags at their longest, are never used.
    Counted per context: a context holds whole pages, so each tag rounds up on its own (a
    4-token context of each of 8 requests needs 8 pages, not the 2 that 32 tokens fill)."""
    per_request = sum(-(-_tag_len(node, t) // pl.page_size) for t in node.tags)
    return pl.max_batch * per_request


def _one_step_tokens(model: I.ModelIR, node: I.NodeIR) -> tuple[int, str]:
    """The most tokens of this node's pool one step must find resident: its own context,
    plus the other contexts of this node its phase `reads` (a decoder's self and cross
    contexts); and a sentence that names them when a step reads more than its own (else
    "": the pool must hold its longest single context). That is one sequence of max_seq_len,
    unless every tag has a `max_len`: then max_seq_len bounds no context, and the longest
    tag's max_len is what one sequence needs (a pool capped at max_batch x the tags' bounds
    may be smaller than max_seq_len and still hold every context)."""
    need, parts = max(_tag_len(node, t) for t in node.tags), ""
    for walk in model.walks.values():
        for c in I.walk_calls(walk):
            phase = node.phases.get(c.phase) if c.node == node.name else None
            if phase is None or not phase.reads:
                continue
            own = node.tag_of(c.tag)
            tags = [own] + [r.resolve(own).split("@", 1)[1] for r in phase.reads if r.node == node.name]
            total = sum(_tag_len(node, t) for t in tags)
            if len(tags) > 1 and total > need:
                need, parts = total, " + ".join(f"{t} {_tag_len(node, t)}" for t in tags)
    return need, parts


def _graph_pool_and_workspace(model: I.ModelIR, cuda: bool, resident: list[I.NodeIR],
                              sharding: dict[str, ShardSpec], max_batch: int) -> tuple[int, int]:
    """The two estimates of the module docstring for one rank."""
    graph = ws = 0
    reading = reading_steps(model) if cuda else {}
    for n in resident:
        if n.arch is None:
            continue
        act, logits = _act_bytes(n, sharding[n.name])
        if cuda:
            phases = tuple((n.phases[p], _read_len(model, n.phases[p])) for p in reading.get(n.name, ()))
            graph += _graph_pool(n, act, logits, max_batch, phases)
        # act is per token (an eager step holds up to max_prefill_tokens of them), or per item
        # when the arch states its peak per row (a batch holds max_batch items)
        per_item = bool(_dims(n).get("activation_elements"))
        rows = max_batch if per_item else _setting(n, "max_prefill_tokens", DEFAULT_PREFILL_TOKENS)
        ws = max(ws, rows * act + max_batch * logits)
    if cuda and any(n.arch is not None for n in resident):
        ws += CUDA_WORKSPACE_FIXED
    return graph, ws


def _setting(node: I.NodeIR, key: str, default: int) -> int:
    v = node.settings.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _node_weight_bytes(model: I.ModelIR, sharding: dict[str, ShardSpec]) -> tuple[dict[str, int], dict[str, str]]:
    """Per node, one rank's weight bytes; from the checkpoint's headers where it has the tensor."""
    ck = model.checkpoint.tensors
    out: dict[str, int] = {}
    sources: dict[str, str] = {}
    for name, node in model.nodes.items():
        spec = sharding[name]
        if node.arch is None or not ck:
            out[name] = spec.bytes_per_rank
            if node.arch is not None:
                sources[name] = "arch"
            continue
        total = found = 0
        fp8 = fp8_tensors(model, name)
        for t in node.arch.tensors:
            dtype, shape = ck.get(t.name, (t.dtype, tuple(t.shape)))
            found += t.name in ck
            numel = 1
            for d in shape:
                numel *= int(d)
            rows = int(shape[0]) if shape else 1
            total += stored_bytes(numel, rows, _DTYPE_BYTES.get(dtype, 2), spec.splits[t.name], t.name in fp8)
        out[name] = total
        sources[name] = "checkpoint" if found == len(node.arch.tensors) else ("arch" if not found else "mixed")
    return out, sources


def _dims(node: I.NodeIR) -> dict[str, int]:
    return dict(node.arch.dims) if node.arch is not None else {}


def _act_bytes(node: I.NodeIR, spec: ShardSpec) -> tuple[int, int]:
    """(activation bytes, fp32 logits bytes) per token on one rank; see the module docstring."""
    dims = _dims(node)
    tp = spec.tp
    d = I.DTYPE_BYTES.get(node.dtype, 2)
    if dims.get("activation_elements"):  # the arch states its peak per row (e.g. a codec's window)
        return d * dims["activation_elements"] // tp, 4 * (dims.get("vocab", 0) // tp)
    kv = node.arch.kv if node.arch is not None else None
    head_dim = kv.head_dim if kv is not None else dims.get("head_dim", 0)
    if dims.get("intermediate"):
        inter = dims["intermediate"] // tp
    else:
        inter = dims.get("moe_intermediate", 0) * dims.get("top_k", DEFAULT_MOE_TOP_K) // tp
    act = d * (4 * dims.get("hidden", 0) + (spec.heads_per_rank or 0) * head_dim
               + 2 * (spec.kv_heads_per_rank or 0) * head_dim + 2 * inter)
    return act, 4 * (dims.get("vocab", 0) // tp)


def _kv_bytes_per_token(node: I.NodeIR, spec: ShardSpec) -> int:
    kv = node.arch.kv
    heads = spec.kv_heads_per_rank or kv.kv_heads
    return 2 * kv.layers * heads * kv.head_dim * I.DTYPE_BYTES.get(node.dtype, 2)


def _graph_pool(node: I.NodeIR, act: int, logits: int, max_batch: int,
                reading: tuple[tuple[I.PhaseIR, int], ...] = ()) -> int:
    """A graphed node's pool: its largest captured step (bucket x rows per request of
    activations, bucket x logits, and for a reading block its gathered read context) and
    each bucket's graph; 0 for a node never captured. `reading`: its captured reading
    phases, each with the longest context it reads (tokens)."""
    buckets = batch_buckets(max_batch)
    largest, n_buckets = 0, 0
    phases = [(ph, None) for ph in graphed_phases(node)] + list(reading)
    for phase, read_len in phases:
        kept = captured_buckets(node, phase, buckets)
        q = step_tokens(node, phase)
        gathered = _block_read_bytes(node, q, read_len) if read_len is not None and q > 1 else 0
        per_row = q * act + logits + gathered
        largest = max(largest, kept[-1] * per_row)
        n_buckets = max(n_buckets, len(kept))
    return largest + n_buckets * GRAPH_BYTES_PER_BUCKET if n_buckets else 0


def _block_read_bytes(node: I.NodeIR, q: int, read_len: int) -> int:
    """What one row of a reading block holds at once in one layer of its captured step (the
    runtime's `attend_block`: the read context gathered with the block, in float32): K and V
    of read_len + q tokens at the KV heads, again at the query heads (SDPA's grouped-query
    expansion), and two [heads, q, keys] float32 score tensors."""
    kv = node.arch.kv if node.arch is not None else None
    if kv is None:
        return 0
    heads = _dims(node).get("heads", kv.kv_heads)
    keys = read_len + q
    return 2 * 4 * keys * kv.head_dim * (kv.kv_heads + heads) + 2 * 4 * heads * q * keys
