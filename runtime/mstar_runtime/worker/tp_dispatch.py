"""One step of a tensor-parallel node, run on every rank of its group, from the conductor.

Every rank of a TP group runs the same step over its shard; the collectives inside the
node (`runtime/mstar_runtime/ops/tp.py`) join them, and every rank ends with the same outputs (the logits are
gathered, each rank samples the same token with the same seeds). So the conductor needs the
outputs of one rank only, the group's *leader* (its first rank), and the others need to be
told only what to run:

- the members (worker processes, `RemoteWorker.submit`) get the step first, so that their
  input transfers never wait behind a collective the leader has already entered; they
  answer with an acknowledgement as soon as the step is launched (`send_outputs=False`):
  nobody waits for a member's device, and no outputs travel back;
- the leader runs it (on rank 0 in this process, or a worker process answering in full);
- the members' acknowledgements are taken when they have arrived (`poll`, every engine
  loop) and waited for only when a member is `AHEAD` steps behind: its host may lag its
  leader's by a step (a member's step can wait for its device, whose collectives wait for
  the leader's device), and the leader's host must not wait for that. A member that failed
  a step its leader ran has diverged from it (its KV context, its sampler state): that is a
  `WorkerLost`, which stops the run;
- an input that is an output of the request's previous step on the same node (a decode's
  `token`, fed back by the walk) does not travel: each member kept its own copy, equal to
  the leader's, and the step names it (`refs`). Sending it would mean reading it back to the
  host first, a device wait in every decode step. `RemoteWorker.check_refs` sends the value
  as well, and the member compares the two (tests).

If the leader fails the step, the members' answers are waited for (they ran or refused the
same step) before the error goes on to the conductor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mstar_runtime.engine.cohort_engine import JoinRow
from mstar_runtime.engine.engines import StepEntry
from mstar_runtime.ops.node import RequestError
from mstar_runtime.worker.remote import WorkerLost, can_submit
from mstar_runtime.worker.worker import StepBatch, WorkerStepError

Key = tuple[str, str, str | None]  # (node, request_id, tag)
AHEAD = 2  # a new step waits for a member's acknowledgements until fewer than this are out


class TPDispatch:
    """The conductor's side of tensor-parallel steps: who answers, what a member kept."""

    def __init__(self, workers: Mapping[int, Any]):
        self.workers = workers
        self._acks: dict[int, deque[Any]] = {}  # rank -> StepHandles of its member steps not yet checked
        self._latest: dict[Key, dict[str, torch.Tensor]] = {}  # the leader's tensor outputs, per context
        self.refs_sent = 0  # inputs that stayed on the members' devices (stats)
        # seconds this process spent on the members (taking their last answers and sending the
        # step: what a slow member costs the leader), and the members' own time in their steps
        self.member_wait_s = 0.0
        self.member_step_s = 0.0
        self.member_read_s = 0.0  # the members' time reading messages (idle, or decoding a step)

    def run(self, ranks: tuple[int, ...], batch: StepBatch) -> list[dict[str, Any]]:
        """Run `batch` on every rank of the group `ranks`; the leader's outputs, one dict per
        entry. Raises what the leader's `run_step` raises, and `WorkerLost` for a member that
        failed an earlier step."""
        t0 = time.perf_counter()
        self._check(ranks)
        leader = ranks[0]
        refs = [self._refs(batch.node, e) for e in batch.entries]
        handles = {}
        for r in ranks:
            if can_submit(self.workers[r]):
                handles[r] = self.workers[r].submit(batch, refs=refs, replicated=True, send_outputs=r == leader)
        self.refs_sent += sum(len(r) for r in refs) * len(handles)
        self.member_wait_s += time.perf_counter() - t0
        try:
            if leader in handles:
                outputs = handles.pop(leader).result()
            else:
                outputs = self.workers[leader].run_step(batch)
        except BaseException:
            for h in handles.values():
                try:
                    h.result()
                except Exception:  # noqa: S110 - the leader's error is the one to report
                    pass
            raise
        for r, h in handles.items():
            self._acks.setdefault(r, deque()).append(h)
        for e, out in zip(batch.entries, outputs):
            self._latest[(batch.node, e.request_id, e.tag)] = {
                k: v for k, v in out.items() if isinstance(v, torch.Tensor)
            }
        return outputs

    def poll(self) -> None:
        """Take the members' acknowledgements that have arrived; never waits. Raises
        `WorkerLost` for a member that failed a step."""
        for r, q in self._acks.items():
            while q and q[0].ready():
                self._take(r, q.popleft())

    def forget(self, request_id: str, node: str | None = None, tag: str | None = None) -> None:
        """A request ended (every context) or one context was dropped: its kept outputs go
        (the workers drop theirs on the FreeRequest / DropTag message)."""
        for key in [k for k in self._latest if k[1] == request_id and (node is None or k[0] == node and k[2] == tag)]:
            del self._latest[key]

    def _refs(self, node: str, entry: StepEntry) -> dict[str, str]:
        latest = self._latest.get((node, entry.request_id, entry.tag))
        if not latest:
            return {}
        return {name: out for name, value in entry.inputs.items() for out, v in latest.items() if v is value}

    def _check(self, ranks: tuple[int, ...]) -> None:
        """Take the acknowledgements that have arrived, and wait for the oldest ones while a
        member is `AHEAD` steps behind."""
        for r in ranks:
            q = self._acks.get(r)
            while q and (len(q) >= AHEAD or q[0].ready()):
                self._take(r, q.popleft())

    def _take(self, rank: int, h: Any) -> None:
        try:
            h.result()
        except (RequestError, WorkerStepError) as e:
            raise WorkerLost(
                rank,
                f"failed a step of {h.batch.node}.{h.batch.phase} that the leader of its "
                f"tensor-parallel group ran, so their states differ; the run stops: {e}",
            ) from e
        self.member_step_s += h.elapsed_s
        self.member_read_s += h.waited_s


class TPCohort:
    """A decode cohort of a tensor-parallel node (control/cohort.py drives it as one worker):
    every `cohort_*` call goes to every rank of the group, in the same order, so each rank's
    columns hold the same rows; each rank's step runs its shard, whose collectives join the
    group, and every rank samples the same tokens (the logits are gathered), which it feeds
    back into its own columns. The leader's readback is the step's result; the members'
    steps are acknowledged as soon as they are launched and checked like `TPDispatch.run`'s
    (a member that failed one has diverged: `WorkerLost`).

    A join's values (the prefill's fed-back outputs, the loop-invariant inputs) go to each
    rank (a worker process receives them over the wire, torch.distributed for large ones);
    what differs per rank (the shard's own node state) each rank's join reads itself. The
    members get each call first (their frames are in the pipe before the leader's step
    enters a collective). A worker in this process can only be the group's leader."""

    def __init__(self, dispatch: TPDispatch, ranks: tuple[int, ...]):
        self.dispatch, self.ranks = dispatch, ranks
        self.leader = dispatch.workers[ranks[0]]
        self.members = [dispatch.workers[r] for r in ranks[1:]]

    def _all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(w, method)(*args) for w in (*self.members, self.leader)]

    def cohort_open(self, key: Any, node: str, shape: Any, rows: int, max_pages: int) -> bool:
        return all(self._all("cohort_open", key, node, shape, rows, max_pages))

    def cohort_join(self, key: Any, first: int, rows: Sequence[JoinRow]) -> None:
        """Every rank joins the rows; the first refusal (a `RequestError`, the same on every
        rank: the state it reads is the group's) is raised once all have been asked, so no
        rank is left with an answer unread. A fed value that is an output of the request's
        last step of the node (its prefill's token) is a reference for the members, as in
        `TPDispatch.run`: each uses its own copy, and the leader's device is not read."""
        refs = [self._refs(key[0], r) for r in rows]
        self.dispatch.refs_sent += sum(len(r) for r in refs) * len(self.members)
        errors = []
        for w in (*self.members, self.leader):
            try:
                if w is self.leader:
                    w.cohort_join(key, first, rows)
                else:
                    w.cohort_join(key, first, rows, refs)
            except (RequestError, WorkerStepError) as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _refs(self, node: str, row: JoinRow) -> dict[str, str]:
        """`fed:<port>` -> the output of the row's request's last step of `node` that the value is."""
        latest = self.dispatch._latest.get((node, row.request_id, row.tag)) or {}
        return {f"fed:{port}": out for port, v in row.fed.items() for out, lv in latest.items() if lv is v}

    def cohort_leave(self, key: Any, row: int, request_id: str, tag: str, steps: int) -> None:
        self._all("cohort_leave", key, row, request_id, tag, steps)

    def cohort_move(self, key: Any, src: int, dst: int) -> None:
        self._all("cohort_move", key, src, dst)

    def cohort_shrink(self, key: Any, n: int) -> None:
        self._all("cohort_shrink", key, n)

    def cohort_add_pages(self, key: Any, rows: Any, cols: Any, pages: Any) -> None:
        self._all("cohort_add_pages", key, rows, cols, pages)

    def cohort_step(self, key: Any, n: int) -> Any:
        """The step on every rank (members first, acknowledged only); the leader's result.
        With `check_refs` set on a member (tests), it answers in full and its outputs must
        equal the leader's (the same tokens sampled, so the same values fed back)."""
        t0 = time.perf_counter()
        self.dispatch._check(self.ranks)
        checked = [bool(getattr(w, "check_refs", False)) for w in self.members]
        handles = [(r, w.cohort_submit(key, n, send_outputs=check))
                   for r, w, check in zip(self.ranks[1:], self.members, checked)]
        self.dispatch.member_wait_s += time.perf_counter() - t0
        result = self.leader.cohort_step(key, n)
        for (r, h), check in zip(handles, checked):
            if check:
                self._compare(r, h.result(), result)
            else:
                self.dispatch._acks.setdefault(r, deque()).append(h)
        return result

    def _compare(self, rank: int, mine: Any, leader: Any) -> None:
        ours, theirs = mine.arrays(), leader.arrays()
        for k, a in theirs.items():
            if k not in ours or not np.array_equal(ours[k], a):
                raise WorkerLost(rank, f"its cohort step's '{k}' differs from the leader's "
                                 f"({ours.get(k)} here, {a} there): the ranks of a tensor-parallel group "
                                 "must compute the same outputs")
