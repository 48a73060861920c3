"""Decode cohorts in a worker process, the conductor's side: `RemoteWorker`'s `cohort_*` calls.

The conductor's `control/cohort.py` drives a cohort through the calls of an in-process
`Worker` (open, join, leave, move, shrink, add pages, step); `RemoteCohorts` gives a
`RemoteWorker` the same calls as typed messages (`messages.py`, "decode cohorts"), so a
marked loop of a node in a worker process runs as a cohort there (the worker process's
`Worker` holds the columns and runs the step, runtime/mstar_runtime/worker/process.py):

    open:   CohortOpen frame -> CohortReply (ok: the node offers a column step)
            a chain's: ChainOpen frame (every link's CohortOpen) -> CohortReply
    join:   CohortJoin frame (every joining row) -> dist.send(values) ; worker: CohortReply, or StepRejected
    step:   CohortStep frame ; worker: CohortStepped frame (the packed readback inline,
            or over torch.distributed when it is over the inline limit); a chain's:
            ChainStep frame ; worker: CohortStepped (every link's readback side by side)
    leave, move, shrink, add pages: one frame each, no answer (a chain's rows: each link's);
            a chain's join (its rows' stop flags) and move: ChainJoin, ChainMove

A step goes out like any step (`submit`'s rules: at most one full step in flight, messages
posted meanwhile held until its answer is in); its `CohortResult` fetches the answer when
the conductor reads it, one step late. A join and an open wait for their answer (a step in
flight is finished first): a join that the node refuses is a `RequestError`, as in process.
A TP member's step (`send_outputs=False`, runtime/mstar_runtime/worker/tp_dispatch.py) is
acknowledged as soon as it is launched. Failures are a step's: `WorkerStepError` for a
cohort call the worker failed (it serves on), `WorkerLost` for a worker that is gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from mstar_runtime.engine.cohort_engine import CohortResult, CohortShape, JoinRow
from mstar_runtime.ops.readback import Readback
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.wire import pack_values, recv_tensors, unpack_values
from mstar_runtime.worker.worker import StepBatch, WorkerStepError


class StepHandle(Protocol):
    """What the cohort calls use of `remote.StepHandle` (named here, so that the two modules do
    not import each other)."""

    batch: StepBatch
    cohort: int | None
    send_outputs: bool

    def result(self) -> Any: ...


class RemoteCohorts:
    """The `cohort_*` calls of a `RemoteWorker` (a mixin over its conversation: `_ask`,
    `_post`, `_lock`, `_settle`, `_take_acks`, `_register`, `_lose`; see the module docstring)."""

    _cohort_ids: dict[Any, int]  # the conductor's cohort key -> its id on this worker
    _cohort_names: dict[int, tuple[str, str]]  # id -> (node, phase), for messages

    def cohort_open(self, key: Any, node: str, shape: CohortShape, rows: int, max_pages: int) -> bool:
        """`Worker.cohort_open` in the worker process."""
        return self._ask(self._open(key, node, shape, rows, max_pages), node, "cohort_open", []).ok

    def _open(self, key: Any, node: str, shape: CohortShape, rows: int, max_pages: int) -> m.CohortOpen:
        """The `CohortOpen` of cohort `key`; the same key always gets the same id, so a later
        conductor of the same plan finds the columns (and graphs) it made."""
        cid = self._cohort_ids.setdefault(key, len(self._cohort_ids) + 1)
        self._cohort_names[cid] = (node, shape.phase)
        return m.CohortOpen(0, cid, node, shape.phase, [list(f) for f in shape.fed], list(shape.invariant),
                            list(shape.outputs), rows, max_pages, list(shape.reads), list(shape.index))

    def cohort_chain_open(self, key: Any, links: Sequence[tuple[Any, str, CohortShape, int]], rows: int,
                          imports: Sequence[tuple[int, str, int, str]], flag: tuple[int, str] | None) -> bool:
        """`Worker.cohort_chain_open` in the worker process: every link's `CohortOpen` in one
        `ChainOpen` (a refused link leaves none opened there); the chain is named in
        messages by its first link's node and phase."""
        opens = [self._open(k, node, shape, rows, pages) for k, node, shape, pages in links]
        cid = self._cohort_ids.setdefault(key, len(self._cohort_ids) + 1)
        self._cohort_names[cid] = self._cohort_names[opens[0].cohort]
        msg = m.ChainOpen(0, cid, opens, [m.ChainImport(*i) for i in imports], *(flag or (None, "")))
        return self._ask(msg, links[0][1], "cohort_chain_open", []).ok

    def cohort_chain_join(self, key: Any, first: int, stops: Sequence[bool | torch.Tensor]) -> None:
        """Whether each joined row's flag already said stop, read here: a flag of a node in a
        worker process came back with its step's outputs (an empty tensor says no stop)."""
        said = [bool(s.numel()) and bool(s.reshape(-1)[0]) if isinstance(s, torch.Tensor) else bool(s) for s in stops]
        self._post(m.ChainJoin(self._cohort_ids[key], first, said))

    def cohort_chain_move(self, key: Any, src: int, dst: int) -> None:
        self._post(m.ChainMove(self._cohort_ids[key], src, dst))

    def cohort_chain_step(self, key: Any, n: int) -> CohortResult:
        """One chained step, as `cohort_step`: every link's readback in one answer, its ports `k.port`."""
        handle = self.cohort_submit(key, n, chain=True)
        return CohortResult(n, [], None, None, fetch=handle.result)

    def cohort_join(self, key: Any, first: int, rows: Sequence[JoinRow],
                    refs: Sequence[Mapping[str, str]] | None = None) -> None:
        """All the rows in one `CohortJoin` (their tensors in one buffer after it). `refs` (a
        TP member's), per row: `fed:<port>` -> the output of the request's last replicated
        step this worker kept, which stands in for the value (sent too with `check_refs`). A
        row whose value cannot travel fails the join here, before anything is sent: a
        WorkerStepError whose `request_ids` name it."""
        cid = self._cohort_ids[key]
        node, phase = self._cohort_names[cid]
        what = f"{phase} (cohort join)"
        wire: list[m.CohortJoinRow] = []
        tensors: list[torch.Tensor] = []
        for i, row in enumerate(rows):
            try:
                one, ts = self._join_row(row, dict(refs[i]) if refs else {})
            except (TypeError, ValueError) as e:  # MessageError is a ValueError
                raise self._unsendable(node, what, e, [row]) from e
            wire.append(one)
            tensors.extend(ts)
        msg = m.CohortJoin(0, cid, first, wire)
        try:
            m.encode(msg)  # a value that cannot travel fails the join here, before anything is sent
        except ValueError as e:
            for i, one in enumerate(wire):  # whose value it is
                try:
                    m.encode(m.CohortJoin(0, cid, first + i, [one]))
                except ValueError as row_e:
                    raise self._unsendable(node, what, row_e, [rows[i]]) from row_e
            raise self._unsendable(node, what, e, rows) from e
        self._ask(msg, node, what, tensors)

    def _unsendable(self, node: str, what: str, e: Exception, rows: Sequence[JoinRow]) -> WorkerStepError:
        err = WorkerStepError(node, what, f"cannot send to rank {self.rank}: {e}")
        err.request_ids = [r.request_id for r in rows]  # type: ignore[attr-defined]
        return err

    def _join_row(self, row: JoinRow, refs: dict[str, str]) -> tuple[m.CohortJoinRow, list[torch.Tensor]]:
        values = {**{f"fed:{k}": v for k, v in row.fed.items()}, **{f"inv:{k}": v for k, v in row.invariant.items()}}
        if refs and not self.check_refs:  # a referenced value stays on the worker (no read of the leader's device)
            values = {k: v for k, v in values.items() if k not in refs}
        metas, inline, scalars, tensors = pack_values(values, self.inline_bytes, "cohort input")
        return m.CohortJoinRow(row.request_id, row.tag, [int(p) for p in row.pages], row.length, metas, inline,
                               scalars, refs, row.steps, row.tokens, [[int(p) for p in pages] for pages, _ in row.reads],
                               [int(n) for _, n in row.reads]), tensors

    def cohort_leave(self, key: Any, row: int, request_id: str, tag: str, steps: int) -> None:
        self._post(m.CohortLeave(self._cohort_ids[key], row, request_id, tag, steps))

    def cohort_move(self, key: Any, src: int, dst: int) -> None:
        self._post(m.CohortMove(self._cohort_ids[key], src, dst))

    def cohort_shrink(self, key: Any, n: int) -> None:
        self._post(m.CohortShrink(self._cohort_ids[key], n))

    def cohort_add_pages(self, key: Any, rows: Any, cols: Any, pages: Any) -> None:
        if len(rows):  # most steps start no page: nothing to say
            self._post(m.CohortAddPages(self._cohort_ids[key], [int(r) for r in rows], [int(c) for c in cols],
                                        [int(p) for p in pages]))

    def cohort_step(self, key: Any, n: int) -> CohortResult:
        """One step of rows 0..n-1, sent without waiting; its result fetches the answer."""
        handle = self.cohort_submit(key, n)
        return CohortResult(n, [], None, None, fetch=handle.result)

    def cohort_submit(self, key: Any, n: int, *, send_outputs: bool = True, chain: bool = False) -> StepHandle:
        """Send one cohort step (`chain`: a chained one); the handle's result is its
        `CohortResult` (an empty one for an acknowledgement, `send_outputs=False`)."""
        cid = self._cohort_ids[key]
        node, phase = self._cohort_names[cid]
        with self._lock:
            self._settle()
            if send_outputs:
                self._take_acks()
            self._check_alive()
            step_id = next(self._step_ids)
            step = m.ChainStep if chain else m.CohortStep
            self._send_bytes(m.encode(step(step_id, cid, n, send_outputs)))
            return self._register(StepBatch(node, phase, []), step_id, send_outputs,
                                  cohort=n)

    def _cohort_outputs(self, handle: StepHandle, msg: m.CohortStepped) -> CohortResult:
        """The packed readback of a cohort step's answer (lock held), received if it did not ride inline."""
        n = handle.cohort or 0
        if not handle.send_outputs:  # an acknowledgement: nothing to read
            return CohortResult(n, [], None, None)
        try:
            received = recv_tensors(msg.values, self.rank, self.comm, self.comm)
        except RuntimeError as e:
            self._lose(f"did not send the readback of a {handle.batch.node} cohort step over torch.distributed ({e})")
        values = unpack_values(msg.values, received, msg.inline, {}, torch.device("cpu"))
        layout = [(p.key, p.is_float, p.width) for p in msg.layout]
        ints, floats = (values.get(k) for k in ("ints", "floats"))
        for name, block, is_float in (("ints", ints, False), ("floats", floats, True)):
            width = sum(w for _, f, w in layout if f == is_float)
            shape = tuple(block.shape) if block is not None else (n, 0)
            if (width > 0) != (block is not None) or shape != (n, width):
                self._lose(f"answered a {n}-row cohort step with {name} of shape {shape} for {width} columns")
        return CohortResult(n, layout, Readback(ints.cpu()) if ints is not None else None,
                            Readback(floats.cpu()) if floats is not None else None)
