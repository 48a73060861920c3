"""Tensor parallelism: the TP process groups of a plan, and the collectives sharded nodes call.

Groups. A node placed at tp > 1 (`plan.node(n).shard`, from the compiler's `shard-tp` pass)
runs on each of its TP groups (its ranks cut into runs of `tp`). Each distinct group gets
its own `dist.new_group`, built by `build_groups` in EVERY process of the plan (members or
not, as torch.distributed requires), in the same order, right after the default group
exists: sorted rank tuples, deduplicated, so two nodes on the same ranks share one group.
The TP collectives never use the default group: that one carries `remote.py`'s
point-to-point step transfers, from another thread of rank 0 while a TP step runs, and one
communicator must not be driven by two threads at once (NCCL would deadlock or mix them).

Collectives. What a Megatron-style sharded layer needs, each a no-op (no op at all, the
tensor itself) when `group` is None, i.e. at tp 1:
  `all_reduce(x, group)`            sum in place over the group (row-parallel outputs, a
                                    vocab-split embedding lookup)
  `all_gather_last(x, group, size)` concatenate along the last dim in group-rank order
                                    (a vocab-split head's logits)
Every member ends with the same bytes (a sum is reduced once and then shared, a gather only
copies), which is what lets every rank of a group sample the same token from its logits.
`embed_vocab_parallel(ids, weight, start, group)` is the vocab-split embedding lookup.

Layout. `MegatronLayout.of(spec, owner, heads, kv_heads, vocab, inner)` is a decoder node's
share on its rank, as the compiler's shard-tp pass cuts the checkpoint: q/k/v and gate/up by
output features (heads; the MLP's or every expert's intermediate features), o_proj and
down_proj by input features, the embedding and the head by vocab rows; KV heads split when tp
divides them, and when tp is a multiple of them each rank keeps the one its query heads read
(vLLM's replication). It checks that tp divides the sizes and that a group exists, and
`split_of(name)` says how a parameter is cut (for a node's own seeded init).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mstar_runtime.ops.node import NodeError, NodeSpec
from mstar_runtime.plan.loader import Plan

# torch 2.13 renamed all_gather_into_tensor (which still works, with a FutureWarning)
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_groups(plan: Plan) -> list[tuple[int, ...]]:
    """Every TP group of every node with tp > 1, deduplicated, in a fixed (sorted) order."""
    found: set[tuple[int, ...]] = set()
    for name in sorted(plan.nodes):
        shard = plan.node(name).shard
        if shard is None or shard.tp <= 1:
            continue
        ranks = tuple(shard.ranks)
        found.update(ranks[i : i + shard.tp] for i in range(0, len(ranks), shard.tp))
    return sorted(found)


def has_tp(plan: Plan) -> bool:
    return bool(tp_groups(plan))


def build_groups(plan: Plan, rank: int, timeout: timedelta | None = None) -> dict[str, Any]:
    """Create every TP group of the plan (a collective call: every process of the default
    group must make it, in the same order) and return {node: group} for the nodes of this
    rank that run at tp > 1. Empty (and creates nothing) when the plan has no TP node.
    `timeout`: how long a collective of the group may wait for a member (torch's default,
    30 min for Gloo, when None; a torchrun launch passes its peer timeout)."""
    groups = {ranks: dist.new_group(list(ranks), timeout=timeout) for ranks in tp_groups(plan)}
    out: dict[str, Any] = {}
    for name in plan.resident_nodes(rank):
        shard = plan.node(name).shard
        if shard is None or shard.tp <= 1:
            continue
        i = tuple(shard.ranks).index(rank) // shard.tp * shard.tp
        out[name] = groups[tuple(shard.ranks[i : i + shard.tp])]
    return out


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum `x` over the group, in place; `x` unchanged when `group` is None (tp 1)."""
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def all_gather_last(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[..., n] on each of `size` ranks -> [..., size * n], rank 0's part first; `x` at tp 1."""
    if group is None:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_single(out, x, group=group)  # the group's parts stacked along dim 0
    return out.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def embed_vocab_parallel(ids: torch.Tensor, weight: torch.Tensor, start: int, group: Any) -> torch.Tensor:
    """Embeddings [N, hidden] from this rank's rows [start, start + len(weight)) of a vocab-split
    table: each rank looks up the ids in its rows, zeroes the others, and the all-reduce adds
    one row to zeros (exact). A plain lookup at tp 1 (`group` None)."""
    if group is None:
        return F.embedding(ids, weight)
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    h = F.embedding(local.masked_fill(outside, 0), weight)
    return all_reduce(h.masked_fill(outside[:, None], 0.0), group)


@dataclass(frozen=True)
class MegatronLayout:
    """A decoder node's share on one rank (the module docstring, "Layout")."""

    tp: int
    rank: int
    group: Any  # the node's TP group; None at tp 1 (every collective a no-op)
    heads: int  # query heads held here
    kv_heads: int  # KV heads held here
    kv_parts: int  # how many ways the k/v projections are cut (kv heads when they are replicated)
    vocab: int  # embedding / head rows held here
    vocab_start: int  # the first of them

    @staticmethod
    def of(spec: NodeSpec, owner: str, heads: int, kv_heads: int, vocab: int, inner: tuple[str, int]) -> MegatronLayout:
        """The layout of `spec`'s rank; NodeError naming `owner` when tp does not divide the sizes
        (`inner`: the name and size of the features gate/up are cut by) or no group was made."""
        ways = spec.tp_size
        bad = [f"{what} = {size}" for what, size in (("heads", heads), inner, ("vocab", vocab)) if size % ways]
        if kv_heads % ways and ways % kv_heads:
            bad.append(f"kv_heads = {kv_heads} (nor is tp a multiple of it)")
        if bad:
            raise NodeError(f"node '{spec.name}' ({owner}): tp {ways} does not divide {', '.join(bad)}")
        if ways > 1 and spec.tp_group is None:
            raise NodeError(f"node '{spec.name}' ({owner}): tp {ways} (rank {spec.tp_rank}) needs its TP "
                            "process group (mstar_runtime.ops.tp.build_groups; startup.start_workers makes them)")
        return MegatronLayout(tp=ways, rank=spec.tp_rank, group=spec.tp_group if ways > 1 else None,
                              heads=heads // ways, kv_heads=max(1, kv_heads // ways), kv_parts=min(ways, kv_heads),
                              vocab=vocab // ways, vocab_start=spec.tp_rank * (vocab // ways))

    def split_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, parts, part): how parameter `name` is cut and which part this rank holds; None
        when whole (the router, the norms; everything at tp 1)."""
        if self.tp == 1:
            return None
        module = name.rsplit(".", 2)[-2]
        if module in ("k_proj", "v_proj"):
            return 0, self.kv_parts, self.rank * self.kv_parts // self.tp
        if module in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            return 0, self.tp, self.rank
        if module in ("o_proj", "down_proj"):
            return 1, self.tp, self.rank
        return None
