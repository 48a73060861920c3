"""The decode cohorts of one conductor: which marked loops run as cohorts, who joins them, their steps.

A loop the compiler marked as a cohort (`cohort` on the loop op) runs, where its node offers
a column step, as a decode cohort (control/cohort.py, docs/runtime.md "Decode cohorts"): the
task yields `EnterCohort`, becomes a row, and is resumed only when it leaves; the scheduler
sees the cohort as one standing group of its rows, and a cohort step replaces the
reservation and the batched step for its rows. The node may be in a worker process (its
cohort calls are messages, worker/remote_cohort.py) or at tp > 1 (every rank of its group
runs each call, `tp_dispatch.TPCohort`). A marked loop stays in the interpreter (iteration
by iteration: the generic path) only where no cohort can run it: its node is not a kv node
or opens no column step (`cohort_open`), its TP group is not all worker processes, or the
plan moves a context its call reads between ranks (the generic step moves it). A loop whose
call reads other contexts is otherwise a cohort whose rows carry their read tables. A chain
(a mark of several calls, `links`) never gets here: the interpreter runs it itself for now.

`Cohorts` makes each loop's `Cohort` on first use and keeps the issue order of each one's
next step (`order`), which the scheduler weighs against the ready calls. What a cohort or a
row needs of the engine loop goes through `CohortsHost` (the conductor implements it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from mstar_runtime.control.cohort import Cohort, CohortHost, CohortKey, Joining, cohort_shape, port_specs
from mstar_runtime.control.interpreter import EnterCohort, WalkTask
from mstar_runtime.control.kv_contexts import KVContexts
from mstar_runtime.control.requests import Request
from mstar_runtime.control.scheduler import Standing
from mstar_runtime.engine.cohort_engine import CohortRead
from mstar_runtime.ops.node import RequestError, SeqPlan
from mstar_runtime.plan.loader import Plan
from mstar_runtime.plan.planfile import cohort_call
from mstar_runtime.worker.remote import WorkerLost, can_submit
from mstar_runtime.worker.tp_dispatch import TPCohort, TPDispatch
from mstar_runtime.worker.worker import WorkerStepError


class CohortsHost(CohortHost, Protocol):
    """What joining a cohort needs of the engine loop, besides what its rows need (`CohortHost`)."""

    def stop(self, error: Exception) -> None:
        """A worker process was lost: every request fails and the engine stops."""

    def move_in(self, req: Request, node: str, tag: str, step: str, rank: int, still: Callable[[], bool]) -> bool:
        """Copy a context the plan moves to `rank` before step `step`; False when `req` is gone meanwhile."""

    def resume(self, task: WalkTask, value: Any = None) -> None:
        """Resume `task` with `value` at the next drive."""


class Cohorts:
    """The cohorts of one conductor's marked loops (module docstring)."""

    def __init__(self, plan: Plan, workers: Mapping[int, Any], tp: TPDispatch, contexts: KVContexts,
                 row_limits: Mapping[str, int], seq: itertools.count, host: CohortsHost):
        """`row_limits`: a node's `max_batch` setting, where it has one; `seq`: the conductor's
        issue-order counter (shared with its step calls)."""
        self.plan, self.workers, self.tp, self.contexts = plan, workers, tp, contexts
        self.row_limits, self.seq, self.host = row_limits, seq, host
        self.by_key: dict[CohortKey, Cohort] = {}
        self._none: set[CohortKey] = set()  # marked loops that stay generic
        self.order: dict[CohortKey, int] = {}  # the issue order of each cohort's next step
        self._fresh: set[CohortKey] = set()  # cohorts that just stepped: their next step's order is set later
        # tasks that entered a marked loop since the last `join_entered`, each with its issue order then
        self._entering: list[tuple[WalkTask, EnterCohort, int]] = []

    def standing(self) -> dict[CohortKey, Standing]:
        """The cohorts with rows, as the scheduler weighs them (after `renumber`)."""
        return {k: Standing(k, c.n, self.order[k]) for k, c in self.by_key.items() if c.n}

    def renumber(self) -> None:
        """The cohorts that stepped last are newer than the calls that step released (a SNAC window, say)."""
        for key in self._fresh:
            self.order[key] = next(self.seq)
        self._fresh.clear()

    def stepped(self, key: CohortKey) -> None:
        """A cohort step ran: its next step is ordered at the next `renumber`."""
        self._fresh.add(key)

    def remove(self, req: Request) -> None:
        """Drop the request's rows (it ended or was preempted)."""
        for cohort in self.by_key.values():
            cohort.remove(req)

    def _cohort_for(self, op: dict[str, Any]) -> Cohort | None:
        """The cohort of a marked loop, made on first use; None where the loop stays generic
        (module docstring: a node without a column step, a read context the plan moves, ...).
        Raises `WorkerStepError` and `WorkerLost` from opening its columns on a worker process."""
        call = cohort_call(op)
        node, phase, ranks = call["node"], call["phase"], tuple(call["ranks"])
        key: CohortKey = (node, phase, ranks, op["id"])
        cohort = self.by_key.get(key)
        if cohort is not None or key in self._none:
            return cohort
        # one rank's worker (in process or a worker process), or a TP group's fan-out, whose
        # members are worker processes
        group = len(ranks) > 1 and all(can_submit(self.workers[r]) for r in ranks[1:])
        worker = TPCohort(self.tp, ranks) if group else self.workers.get(ranks[0])
        info = self.plan.node(node)
        read_ops = list(call.get("reads") or ())
        reads = tuple(self._read_spec(r, ranks[0]) for r in read_ops)
        # a context the loop reads that the plan moves between ranks (or keeps on another) is
        # the generic step's to move or report
        names = {f"{r['node']}@{r['tag']}" for r in read_ops}
        elsewhere = None in reads or any(k[2] in names for k in self.contexts.moves)
        if (info.engine != "kv" or (len(ranks) > 1 and not group) or elsewhere
                or not hasattr(worker, "cohort_open")):
            self._none.add(key)
            return None
        bm = self.contexts.pages.managers[(node, ranks[0])]
        max_len = self.plan.kv_pool(node, ranks[0]).max_seq_len
        rows = min(self.plan.max_batch, self.row_limits.get(node, self.plan.max_batch))
        ports = port_specs(info.raw["outputs"], info.phases[phase].outputs)
        shape = cohort_shape(op, ports, reads)  # type: ignore[arg-type]  # None is not among them (above)
        max_pages = -(-max_len // bm.page_size) + 1  # one more: a speculative step after the node's own limit
        if not worker.cohort_open(key, node, shape, rows, max_pages):
            self._none.add(key)
            return None
        cls, spec = self.contexts.node_class(node)

        def kv_plan(inputs: Mapping[str, Any]) -> SeqPlan:
            return cls.kv_plan(phase, {p: tuple(v.shape) for p, v in inputs.items() if isinstance(v, torch.Tensor)},
                               spec)

        def read_rows(request_id: str) -> list[tuple[list[int], int]]:
            return [(s.page_table, s.kv_len) for s in self.contexts.read_slots(ranks[0], request_id, read_ops)]

        cohort = self.by_key[key] = Cohort(key, op, ports, worker, bm, rows, max_len, max_pages, self.host,
                                           kv_plan=kv_plan, read_rows=read_rows if read_ops else None)
        return cohort  # its step order is set when its first row joins (enter)

    def _read_spec(self, read: dict[str, Any], rank: int) -> CohortRead | None:
        """A context the loop's call reads, with the most pages it can span (its tag's
        `max_len`, else its node's pool bound); None when its node has no pool on `rank`."""
        node, tag = read["node"], read["tag"]
        bm = self.contexts.pages.managers.get((node, rank))
        if bm is None:
            return None
        most = self.plan.node(node).tag_max_len.get(tag) or self.plan.kv_pool(node, rank).max_seq_len
        return CohortRead(node, tag, -(-most // bm.page_size))

    def enter(self, task: WalkTask, y: EnterCohort) -> None:
        """The task enters its marked loop: it joins with the others that entered since the
        last `join_entered` (rows that join together are written in one worker call)."""
        self._entering.append((task, y, next(self.seq)))

    @property
    def entering(self) -> bool:
        """Whether tasks wait for `join_entered`."""
        return bool(self._entering)

    def join_entered(self) -> None:
        """Make each entered task a row of its loop's cohort, or resume it at once with None
        (generic); those of one cohort join in one call, in the order they entered."""
        entering, self._entering = self._entering, []
        groups: dict[CohortKey, list[Joining]] = {}
        try:
            for task, y, seq in entering:
                req: Request = task.request  # type: ignore[assignment]  # the conductor's tasks run for its Requests
                if req.done or task not in req.tasks:  # failed or preempted since it entered
                    continue
                try:
                    cohort, tag = self._admit(req, task, y, groups)
                except WorkerStepError as e:  # a worker process failed the open: this request fails
                    self.host.fail(req, str(e))
                    continue
                if cohort is None:
                    continue
                group = groups.setdefault(cohort.key, [])
                if cohort.n == 0 and not group:  # an idle cohort's next step is as old as this request's arrival
                    self.order[cohort.key] = seq
                group.append(Joining(req, task, y, tag))
            for key, group in groups.items():
                self._join(self.by_key[key], group)
        except WorkerLost as e:
            self.host.stop(e)

    def _admit(self, req: Request, task: WalkTask, y: EnterCohort,
               groups: Mapping[CohortKey, list[Joining]]) -> tuple[Cohort | None, str]:
        """The cohort the task joins and its context's tag; None (the task resumed, or gone)
        where it runs the loop generic. Raises `WorkerStepError` and `WorkerLost` from
        opening the cohort."""
        cohort = self._cohort_for(y.op)
        call = cohort_call(y.op)
        tag = call.get("tag") or "main"
        # a context the plan moves to the loop's rank is copied there first, as before a generic step
        if (cohort is not None and self.contexts.moves
                and not self.host.move_in(req, call["node"], tag, str(call.get("id")), tuple(call["ranks"])[0],
                                          lambda: not req.done and task in req.tasks)):
            return None, tag  # the request failed or was preempted meanwhile: its task is gone
        if (cohort is None or cohort.n + len(groups.get(cohort.key, ())) >= cohort.rows
                or not self._extends(cohort, (req.id, tag), y)):
            self.host.resume(task)
            return None, tag
        return cohort, tag

    @staticmethod
    def _extends(cohort: Cohort, key: tuple[str, str], y: EnterCohort) -> bool:
        """Whether the row's steps have a context to extend: one of at least a token, unless
        they keep nothing (π0.5's expert); a call the node's kv_plan refuses goes generic (the
        generic step reports it)."""
        try:
            keep = cohort.kv_plan(y.inputs).keep
        except RequestError:
            return False
        return not keep or (key in cohort.bm and cohort.bm.seq_len(key) >= 1)

    def _join(self, cohort: Cohort, group: list[Joining]) -> None:
        """Join the group in one call; a row the cohort refuses (`RequestError`: the generic
        loop runs it, and reports any real input error itself) or the worker fails to take
        (`WorkerStepError`: that request fails) leaves, and the others join without it. An
        error that names no row of the group is retried row by row (a join writes nothing
        before its checks pass), so that it reaches only the row it is about."""
        while group:
            try:
                cohort.join(group)
            except (RequestError, WorkerStepError) as e:
                named = set(getattr(e, "request_ids", None) or ())
                bad = [j for j in group if j.request.id in named]
                if not bad and len(group) > 1:
                    for j in group:
                        self._join(cohort, [j])
                    return
                for j in bad or group:
                    if isinstance(e, RequestError):
                        self.host.resume(j.task)
                    else:
                        self.host.fail(j.request, str(e))
                group = [j for j in group if j not in bad] if bad else []
                continue
            for j in group:
                j.request.homes[(cohort.key[0], j.tag)] = cohort.key[2][0]
            return
