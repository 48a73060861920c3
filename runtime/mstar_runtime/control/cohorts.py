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
(a mark of several calls, `links`) is a cohort of one `Link` per call, stepped in body order
(engine/cohort_chain.py), where every call is on one rank (in the conductor's process or a
worker process, whose chain calls are messages too; not a TP group), reads no other
context, has no context the plan moves, and offers a column step; elsewhere the
interpreter runs it.

`Cohorts` makes each loop's `Cohort` on first use and keeps the issue order of each one's
next step (`order`), which the scheduler weighs against the ready calls. What a cohort or a
row needs of the engine loop goes through `CohortsHost` (the conductor implements it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from mstar_runtime.control.cohort import (
    Cohort,
    CohortHost,
    CohortKey,
    Joining,
    Link,
    PortSpec,
    cohort_shape,
    port_specs,
)
from mstar_runtime.control.interpreter import EnterCohort, WalkTask
from mstar_runtime.control.kv_contexts import KVContexts
from mstar_runtime.control.requests import Request
from mstar_runtime.control.scheduler import Standing
from mstar_runtime.engine.cohort_engine import CohortRead
from mstar_runtime.ops.node import RequestError, SeqPlan
from mstar_runtime.plan.loader import Plan
from mstar_runtime.plan.planfile import cohort_call, cohort_links
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
        cohort = self._chain(key, op) if "links" in op["cohort"] else self._single(key, op, call)
        if cohort is None:
            self._none.add(key)
            return None
        self.by_key[key] = cohort
        return cohort  # its step order is set when its first row joins (enter)

    def _single(self, key: CohortKey, op: dict[str, Any], call: dict[str, Any]) -> Cohort | None:
        """A loop of one call's cohort, or None where it stays generic."""
        node, ranks = key[0], key[2]
        # one rank's worker (in process or a worker process), or a TP group's fan-out, whose
        # members are worker processes
        group = len(ranks) > 1 and all(can_submit(self.workers[r]) for r in ranks[1:])
        worker = TPCohort(self.tp, ranks) if group else self.workers.get(ranks[0])
        read_ops = list(call.get("reads") or ())
        reads = tuple(self._read_spec(r, ranks[0]) for r in read_ops)
        # a context the loop reads that the plan moves between ranks (or keeps on another) is
        # the generic step's to move or report
        names = {f"{r['node']}@{r['tag']}" for r in read_ops}
        elsewhere = None in reads or any(k[2] in names for k in self.contexts.moves)
        if (self.plan.node(node).engine != "kv" or (len(ranks) > 1 and not group) or elsewhere
                or not hasattr(worker, "cohort_open")):
            return None
        ports = self._ports(call, "")
        link = self._link(key, call, op["cohort"], ports, "", self._rows(node), reads)  # type: ignore[arg-type]
        if not worker.cohort_open(key, node, link.shape, link.rows, link.max_pages):
            return None

        def read_rows(request_id: str) -> list[tuple[list[int], int]]:
            return [(s.page_table, s.kv_len) for s in self.contexts.read_slots(ranks[0], request_id, read_ops)]

        link.read_rows = read_rows if read_ops else None
        return Cohort(key, op, ports, worker, [link], link.rows, self.host)

    def _chain(self, key: CohortKey, op: dict[str, Any]) -> Cohort | None:
        """A chain's cohort (engine/cohort_chain.py), or None where it stays generic: only the
        worker of one rank chains (in this process or a worker process; not a TP group), and
        only calls that read no other context, whose contexts the plan does not move, on kv
        nodes that offer a column step, each chained output a port of one value a row."""
        marks = cohort_links(op["cohort"])
        calls = [next(c for c in op["body"]["body"] if c.get("op") == "call" and c.get("id") == m["call"])
                 for m in marks]
        ranks = key[2]
        worker = self.workers.get(ranks[0])
        steps = {c["id"] for c in calls}
        if (len(ranks) > 1 or not hasattr(worker, "cohort_chain_open") or any(c.get("reads") for c in calls)
                or any(self.plan.node(c["node"]).engine != "kv" for c in calls)
                or any(k[1] in steps for k in self.contexts.moves)):
            return None
        ports: dict[str, PortSpec] = {}
        links = []
        rows = self._rows(*(c["node"] for c in calls))  # every link's node holds every row
        for k, (mark, call) in enumerate(zip(marks, calls, strict=True)):
            own = self._ports(call, f"{k}.")
            ports.update(own)
            links.append(self._link((call["node"], call["phase"], ranks, f"{op['id']}/{k}"), call, mark, own,
                                    f"{k}.", rows))
        imports = [(k, port, at, out) for k, mark in enumerate(marks) for port, at, out in mark.get("chained") or ()]
        if any(ports[f"{at}.{out}"].items for _, _, at, out in imports):
            return None  # an item list (a count a row) is no column a later link reads as its input
        until = None
        if op.get("dynamic"):
            at = next(k for k, c in enumerate(calls) for port, name in c["results"] if name == op["until"])
            until = (at, next(port for port, name in calls[at]["results"] if name == op["until"]))
        opened = worker.cohort_chain_open(key, [(lk.key, lk.call["node"], lk.shape, lk.max_pages) for lk in links],
                                          rows, imports, until)
        return Cohort(key, op, ports, worker, links, rows, self.host) if opened else None

    def _ports(self, call: dict[str, Any], prefix: str) -> dict[str, PortSpec]:
        """The PortSpecs of a call's outputs, by prefixed name (`prefix` + port)."""
        info = self.plan.node(call["node"])
        specs = port_specs(info.raw["outputs"], info.phases[call["phase"]].outputs)
        return {prefix + name: spec for name, spec in specs.items()}

    def _rows(self, *nodes: str) -> int:
        """A cohort's rows: the plan's `max_batch`, or less where a node's `max_batch` setting says so."""
        return min(self.plan.max_batch, *(self.row_limits.get(n, self.plan.max_batch) for n in nodes))

    def _link(self, key: CohortKey, call: dict[str, Any], mark: dict[str, Any], ports: dict[str, PortSpec],
              prefix: str, rows: int, reads: tuple[CohortRead, ...] = ()) -> Link:
        """One call's `Link`: its pool's BlockManager on the call's rank, its bounds, its shape."""
        node, phase, rank = call["node"], call["phase"], key[2][0]
        bm = self.contexts.pages.managers[(node, rank)]
        max_len = self.plan.kv_pool(node, rank).max_seq_len
        shape = cohort_shape(mark, call, {p[len(prefix):]: s for p, s in ports.items()}, reads)
        max_pages = -(-max_len // bm.page_size) + 1  # one more: a speculative step after the node's own limit
        cls, spec = self.contexts.node_class(node)

        def kv_plan(inputs: Mapping[str, Any]) -> SeqPlan:
            return cls.kv_plan(phase, {p: tuple(v.shape) for p, v in inputs.items() if isinstance(v, torch.Tensor)},
                               spec)

        return Link(key, call, shape, bm, max_len, max_pages, rows, prefix, kv_plan)

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
        """Whether the row's steps have a context to extend on every link: one of at least a
        token, unless they keep nothing (π0.5's expert); a call the node's kv_plan refuses goes
        generic (the generic step reports it)."""
        for link in cohort.links:
            own = (key[0], link.tag)
            try:
                keep = link.kv_plan(link.inputs(y.inputs)).keep
            except RequestError:
                return False
            if keep and not (own in link.bm and link.bm.seq_len(own) >= 1):
                return False
        return True

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
                for link in cohort.links:
                    j.request.homes[(link.call["node"], link.tag)] = cohort.key[2][0]
            return
