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
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
