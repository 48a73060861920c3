"""KV reservations under preemption: a step's slots, forks and moves that need pages a full pool lacks.

Whatever takes KV pages (a step's reservation, a fork, a move of a context to another rank,
a cohort row's next page) runs here: on `OutOfPages` the newest request holding pages is
preempted and the action retried; never a request with a step in flight (every answer in
flight is taken first, `StepRunner.quiesce`); a request that alone holds pages and still
does not fit fails ("it can never fit"). A kv node's `max_prefill_tokens` setting bounds the
new tokens of one of its steps (`KVContexts.token_budget`): the calls past it wait for the
next step, the first always runs. A tag with its own bound (`tag_max_len`) fails the request
that would take one of its contexts past it, naming the node and tag, before any page is
reserved. A context the plan moves to a call's rank is copied there first (`move_in`).

Prefix caching (`KVPages.prefix_caching`): a call whose node gives its tokens' content keys
(`KVNode.prefix_content`) shares the cached pages of its leading full blocks, up to a multiple
of the prefix chunk (`KVPages.prefix_chunk`), and its step computes the rest only (at least one
token, so that the step has logits to sample from), a causal one in chunks (engine/chunked.py);
`RequestStats.cached_tokens` counts what a request found. The blocks it writes become
findable once its step has finished (`StepRunner`, `KVPages.commit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mstar_runtime.control.cohort import Cohort
from mstar_runtime.control.interpreter import ForkKV, StepCall, chunk_inputs
from mstar_runtime.control.kv_contexts import KVContexts
from mstar_runtime.control.requests import RUNNING, Request, port_input
from mstar_runtime.control.scheduler import GroupKey
from mstar_runtime.control.steps import StepRunner
from mstar_runtime.engine.engines import KVSlots, StepEntry
from mstar_runtime.kv.block_manager import OutOfPages
from mstar_runtime.ops.node import NodeError, RequestError
from mstar_runtime.plan.loader import Plan
from mstar_runtime.worker.remote import WorkerLost
from mstar_runtime.worker.worker import WorkerStepError

_OVER_BUDGET = object()  # `_reserve_one`: the call waits for a step with room for its tokens


class ReservationHost(Protocol):
    """What preempting needs of the engine loop (the conductor implements it)."""

    running: list[Request]
    pending: dict[StepCall, None]
    stats: dict[str, float]

    def request_of(self, call: StepCall) -> Request | None: ...
    def preempt(self, req: Request, forced: bool = False) -> None: ...
    def fail(self, req: Request, message: str, field_name: str | None = None) -> None: ...
    def stop(self, error: Exception) -> None: ...


class Reservations:
    """Takes KV pages for requests, preempting as a full pool needs (module docstring)."""

    def __init__(self, plan: Plan, contexts: KVContexts, steps: StepRunner, host: ReservationHost):
        self.plan, self.contexts, self.steps, self.host = plan, contexts, steps, host
        self.kv = contexts.pages

    def free_pages(self, cohort: Cohort) -> bool:
        """A cohort needs a page and the pool is full: preempt (or fail) as a generic step would.
        False when nothing can be freed."""
        if self.steps.inflight:  # never preempt a request with a step in flight: take them all first
            self.steps.quiesce()
            return True
        victim = self.contexts.newest_holder(self.host.running)
        if victim is None:
            return False
        if len(self.contexts.holders(self.host.running)) == 1:
            node, rank = cohort.short_pool  # the pool the step could not get a page of (a chain's link's)
            self.host.fail(victim, f"request needs more KV pages for node '{node}' than its pool holds "
                      f"({self.kv.capacity_tokens((node, rank))} tokens); it can never fit")
            return True
        self.host.preempt(victim)
        return True

    def fork(self, req: Request, f: ForkKV) -> bool:
        """Fork a KV context; when the pool is full, preempt the newest request and retry.

        Returns False when `req` itself was preempted or failed (its task is gone)."""
        return self._or_preempt(req, lambda: self.contexts.fork(req, f),
                                f"forking KV context {f.node}@{f.src} needs a page the pool does not have")

    def _or_preempt(self, req: Request, action: Callable[[], None], why: str,
                    still: Callable[[], bool] = lambda: True) -> bool:
        """Run `action`, which takes KV pages; while a pool is full, preempt the newest request
        and retry. False when `req` itself was preempted or failed, or `still()` turned false
        while the answers in flight were taken."""
        while True:
            try:
                action()
                return True
            except OutOfPages:
                if self.steps.inflight:  # never preempt a request with a step in flight: take them all first
                    self.steps.quiesce()
                    if req.state != RUNNING or not still():  # an answer ended or preempted it
                        return False
                    continue
                victim = self.contexts.newest_holder(self.host.running)
                if victim is None or (victim is req and len(self.contexts.holders(self.host.running)) == 1):
                    self.host.fail(req, f"{why}; the request can never fit")
                    return False
                self.host.preempt(victim)
                if victim is req:
                    return False

    def move_in(self, req: Request, node: str, tag: str, step: str, rank: int, still: Callable[[], bool]) -> bool:
        """Before the first step `step` (a call's id) of `req` on `rank`: if the plan moves its KV
        context `node@tag` there (a transfer of kind "kv" into this step), copy the context from
        its source rank, once per request and walk (kv_contexts.py). False when the request
        failed or was preempted meanwhile, or `still()` turned false while answers in flight
        were taken."""
        key = (req.current_walk, step, f"{node}@{tag}", rank)
        src = self.contexts.move_source(req, key)
        if src is None:
            return True
        info = self.plan.node(node)
        if info.shard is not None and info.shard.tp > 1:
            self.host.fail(req, f"KV context {node}@{tag} would move from rank {src} to rank {rank} (step {key[1]}), "
                      "and contexts of a tensor-parallel node cannot move between ranks")
            return False
        try:
            ok = self._or_preempt(req, lambda: self.contexts.move(req, node, tag, src, rank),
                                  f"moving KV context {node}@{tag} to rank {rank} needs pages its pool does not have",
                                  still)
        except (NodeError, WorkerStepError) as e:
            self.host.fail(req, f"moving KV context {node}@{tag} from rank {src} to rank {rank}: {e}")
            return False
        except WorkerLost as e:
            self.host.stop(e)
            return False
        if ok:
            req.moved.add(key)
            req.homes[(node, tag)] = rank
            self.host.stats["kv_moves"] += 1
        return ok

    def reserve(self, key: GroupKey, calls: list[StepCall]) -> list[tuple[StepCall, StepEntry]]:
        """The calls' KV slots (the entries of a step); a full pool preempts the newest request."""
        node, phase, ranks = key
        is_kv = self.plan.node(node)["engine"] == "kv"
        budget = self.contexts.token_budget(node) if is_kv else None
        used = 0
        entries: list[tuple[StepCall, StepEntry]] = []
        for call in calls:
            req = self.host.request_of(call)
            if req is None or req.done or call not in self.host.pending:
                continue
            inputs = chunk_inputs(call.inputs)
            kv: KVSlots | None = None
            if is_kv:
                room = None if budget is None or not entries else budget - used
                kv = self._reserve_one(node, phase, ranks[0], req, call, inputs, room)
                if kv is _OVER_BUDGET:  # this call and the rest wait for the next step
                    break
                if kv is None:
                    continue
                used += kv.q_len
            entries.append((call, StepEntry(req.id, call.tag, inputs, kv)))
        # a later entry's reservation may have preempted an earlier entry's request
        return [(c, e) for c, e in entries if c in self.host.pending and not self.host.request_of(c).done]  # type: ignore[union-attr]

    def _reserve_one(self, node: str, phase: str, rank: int, req: Request, call: StepCall, inputs: dict[str, Any],
                     room: int | None = None) -> Any:
        """The call's KV slots; None when it failed (or lost its request); `_OVER_BUDGET` when
        its tokens do not fit the `room` left in this step's token budget. A context the plan
        moves to `rank` for this call is copied there first (`move_in`)."""
        if self.contexts.moves and not self.move_in(req, node, call.tag or "main", str(call.op.get("id")), rank,
                                                    lambda: call in self.host.pending):
            return None
        cls, spec = self.contexts.node_class(node)
        shapes = {p: tuple(v.shape) for p, v in inputs.items() if isinstance(v, torch.Tensor)}
        try:
            plan = cls.kv_plan(phase, shapes, spec)
        except RequestError as e:
            self.host.fail(req, str(e), port_input(req, call, e.field))
            return None
        keys = None
        if self.kv.prefix_caching and plan.keep:
            try:
                keys = cls.prefix_content(phase, inputs, spec)
            except RequestError as e:
                self.host.fail(req, str(e), port_input(req, call, e.field))
                return None
            if keys is not None and len(keys) > plan.q_len:
                self.host.fail(req, f"node '{node}' phase '{phase}' gave {len(keys)} prefix-cache keys for "
                                    f"{plan.q_len} KV tokens (prefix_content: at most one per token)")
                return None
        if room is not None and plan.q_len > room:
            return _OVER_BUDGET
        key = (req.id, call.tag or "main")
        limit = self.plan.node(node).tag_max_len.get(key[1])
        if limit is not None:
            bm = self.kv.managers[(node, rank)]
            after = (bm.seq_len(key) if key in bm else 0) + plan.q_len
            if after > limit:
                self.host.fail(req, f"the KV context {node}@{key[1]} would hold {after} tokens, more than the "
                           f"max_len of {limit} of its tag '{key[1]}' (step {call.op.get('id', '?')})")
                return None
        while True:
            try:
                kv = self.kv.reserve((node, rank), key, plan, keys)
            except OutOfPages:
                if self.steps.inflight:  # never preempt a request with a step in flight: take them all first
                    self.steps.quiesce()
                    if req.state != RUNNING or call not in self.host.pending:
                        return None
                    continue
                victim = self.contexts.newest_holder(self.host.running)
                if victim is None or victim is req and len(self.contexts.holders(self.host.running)) == 1:
                    self.host.fail(req, f"request needs more KV pages for node '{node}' than its pool holds "
                               f"({self.kv.capacity_tokens((node, rank))} tokens); it can never fit")
                    return None
                self.host.preempt(victim)
                if victim is req:
                    return None
                continue
            call.frame.log_kv(node, key, kv.start - kv.cached)
            req.stats.cached_tokens += kv.cached
            req.homes[(node, key[1])] = rank
            reads = call.op.get("reads")
            if reads:
                kv = dataclasses.replace(kv, reads=self.contexts.read_slots(rank, req.id, reads))
            return kv
