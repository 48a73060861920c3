"""A worker process: `python -m mstar_runtime.worker.remote --plan P --rank R ...` (rank > 0).

It joins the plan's process group, builds its rank's nodes (`Worker`) and serves the
conductor's messages from stdin until EOF or `Shutdown`: the worker side of the protocol in
`runtime/mstar_runtime/worker/remote.py`'s module docstring. Its stdout is the control channel (fd 1 points at
stderr for everything else); a fatal error is sent as a `WorkerError` before it exits.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import IO, Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist

from mstar_runtime.engine import engines
from mstar_runtime.engine.cohort_engine import CohortShape, JoinRow
from mstar_runtime.ops import tp
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.wire import (
    FRAME,
    INLINE_BYTES,
    READBACK_INLINE_BYTES,
    ProtocolError,
    comm_device,
    copy_from_wire,
    pack_values,
    plan_digest,
    read_frame,
    readback_values,
    recv_tensors,
    send_tensors,
    unpack_values,
    write_frame,
)
from mstar_runtime.worker.worker import StepBatch, Worker, WorkerStepError

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 300.0  # a step that takes longer than this means a hung worker
COHORT_MESSAGES = (m.CohortOpen, m.CohortJoin, m.CohortStep, m.CohortLeave, m.CohortMove, m.CohortShrink,
                   m.CohortAddPages, m.ChainOpen, m.ChainJoin, m.ChainMove, m.ChainStep)


def _die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL this process when its parent dies, even if the control pipe lingers (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the stdin EOF still ends the worker
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl took effect: nobody is left to serve


class _Server:
    """The worker process's loop: frames from stdin, answers on the saved stdout."""

    def __init__(self, worker: Worker, rank: int, out: IO[bytes]):
        self.worker, self.rank, self.out = worker, rank, out
        self.device = worker.device
        self.comm = comm_device(worker.device)
        self.waited = 0.0  # reading messages since the last answer (StepResult.waited_s)
        self.shut_down = False  # `serve` ended on a Shutdown (not at the end of its input)
        # (node, request_id, tag) -> tensor outputs of its last replicated (TP) step
        self.kept: dict[tuple[str, str, str | None], dict[str, torch.Tensor]] = {}
        self.cohort_nodes: dict[int, str] = {}  # cohort id -> its node (for a join's refs)

    def serve(self, inp: BinaryIO) -> int:
        while True:
            t0 = time.perf_counter()
            msg = read_frame(inp)
            self.waited += time.perf_counter() - t0
            if msg is None or isinstance(msg, m.Shutdown):
                self.shut_down = msg is not None
                return 0
            if isinstance(msg, m.StepRequest):
                self._step(msg)
            elif isinstance(msg, m.ForkKV):
                copy = copy_from_wire(msg.copy) if msg.copy is not None else None
                self.worker.fork(msg.node, msg.request_id, msg.src_tag, msg.dst_tag, copy)
            elif isinstance(msg, m.CopySlots):
                self.worker.copy_slots(msg.node, copy_from_wire(msg.copy))
            elif isinstance(msg, m.ImportKV):
                received = recv_tensors(msg.values, 0, self.comm, self.device)
                values = unpack_values(msg.values, received, msg.inline, msg.scalars, self.device)
                self.worker.import_kv(msg.node, msg.request_id, msg.tag, msg.pages, values)
            elif isinstance(msg, m.ExportKV):
                self._export(msg)
            elif isinstance(msg, m.DropTag):
                self.worker.drop_tag(msg.node, msg.request_id, msg.tag)
                self.kept.pop((msg.node, msg.request_id, msg.tag), None)
            elif isinstance(msg, m.FreeRequest):
                self.worker.free(msg.request_id)
                for key in [k for k in self.kept if k[1] == msg.request_id]:
                    del self.kept[key]
            elif isinstance(msg, m.Heartbeat):
                write_frame(self.out, m.Heartbeat(self.rank, msg.seq))
            elif isinstance(msg, COHORT_MESSAGES):
                self._cohort(msg)
            else:
                raise ProtocolError(f"a worker does not take '{msg.type}' messages")

    def _step(self, msg: m.StepRequest) -> None:
        t0 = time.perf_counter()
        # Receive first, whatever happens next: the conductor has already sent the buffer.
        metas = [meta for e in msg.entries for meta in e.inputs]
        received = iter(recv_tensors(metas, 0, self.comm, self.device))
        entries = [
            engines.StepEntry(
                e.request_id,
                e.tag,
                unpack_values(e.inputs, [next(received) for _ in e.inputs], e.inline, e.scalars, self.device),
                e.kv,
            )
            for e in msg.entries
        ]
        try:
            for wire, entry in zip(msg.entries, entries):
                if wire.refs:
                    entry.inputs.update(self._kept_inputs(msg.node, wire, entry.inputs))
            outputs = self.worker.run_step(StepBatch(msg.node, msg.phase, entries))
            if msg.replicated:
                for e, o in zip(msg.entries, outputs):
                    self.kept[(msg.node, e.request_id, e.tag)] = {
                        k: v for k, v in o.items() if isinstance(v, torch.Tensor)
                    }
            if not msg.send_outputs:
                # a TP member: the leader answers for the group; nothing here waits for the device
                write_frame(self.out, m.StepResult(msg.step_id, self.rank, [], time.perf_counter() - t0, self.waited))
                self.waited = 0.0
                return
            if self.device.type == "cuda":
                # answer once the outputs exist: the conductor, which may take the answer while
                # it runs rank 0's steps, then waits for the transfer only (module docstring)
                torch.cuda.synchronize(self.device)
            packed = [pack_values(o, INLINE_BYTES, "output") for o in outputs]
            result = m.StepResult(
                msg.step_id,
                self.rank,
                [
                    m.ResultEntry(e.request_id, e.tag, metas, inline, scalars)
                    for e, (metas, inline, scalars, _) in zip(msg.entries, packed)
                ],
                time.perf_counter() - t0,
                self.waited,
            )
            self.waited = 0.0
            data = m.encode(result)  # encode here, so a value that cannot travel is this step's error
        except RequestError as e:
            ids = getattr(e, "request_ids", None) or [x.request_id for x in entries]
            write_frame(self.out, m.StepRejected(msg.step_id, self.rank, str(e), e.field, list(ids)))
            return
        except Exception as e:
            write_frame(self.out, m.WorkerError(self.rank, _error_text(e), msg.step_id))
            return
        self.out.write(FRAME.pack(len(data)) + data)
        self.out.flush()
        send_tensors([t for p in packed for t in p[3]], 0, self.comm)

    # ------------------------------------------------------------------ decode cohorts
    def _cohort(self, msg: Any) -> None:
        """A decode cohort's message (runtime/mstar_runtime/worker/remote_cohort.py): open and
        join are answered (`CohortReply`), a step by its readback; the rest are not."""
        w, cid = self.worker, msg.cohort
        if isinstance(msg, (m.CohortStep, m.ChainStep)):
            self._cohort_step(msg)
        elif isinstance(msg, m.CohortOpen):
            shape = self._shape(msg)
            self._reply(msg.step_id, [],
                        lambda: w.cohort_open(cid, msg.node, shape, msg.rows, msg.max_pages))
        elif isinstance(msg, m.ChainOpen):
            self._chain_open(msg)
        elif isinstance(msg, m.ChainJoin):
            w.cohort_chain_join(cid, msg.first, msg.stops)
        elif isinstance(msg, m.ChainMove):
            w.cohort_chain_move(cid, msg.src, msg.dst)
        elif isinstance(msg, m.CohortJoin):
            received = recv_tensors([v for r in msg.rows for v in r.values], 0, self.comm, self.device)  # first
            rows, at = [], 0
            for r in msg.rows:
                values = unpack_values(r.values, received[at: at + len(r.values)], r.inline, r.scalars, self.device)
                at += len(r.values)
                if r.refs:
                    values.update(self._kept_inputs(self.cohort_nodes.get(cid, "?"), r, values))
                rows.append(JoinRow(r.request_id, r.tag,
                                    {k.removeprefix("fed:"): v for k, v in values.items() if k.startswith("fed:")},
                                    {k.removeprefix("inv:"): v for k, v in values.items() if k.startswith("inv:")},
                                    r.pages, r.length, r.steps, r.tokens,
                                    list(zip(r.read_pages, r.read_lens, strict=True))))
            self._reply(msg.step_id, [r.request_id for r in msg.rows], lambda: w.cohort_join(cid, msg.first, rows))
        elif isinstance(msg, m.CohortLeave):
            w.cohort_leave(cid, msg.row, msg.request_id, msg.tag, msg.steps)
        elif isinstance(msg, m.CohortMove):
            w.cohort_move(cid, msg.src, msg.dst)
        elif isinstance(msg, m.CohortShrink):
            w.cohort_shrink(cid, msg.n)
        else:
            w.cohort_add_pages(cid, np.array(msg.rows, dtype=np.int64), np.array(msg.cols, dtype=np.int64),
                               np.array(msg.pages, dtype=np.int64))

    def _shape(self, msg: m.CohortOpen) -> CohortShape:
        """The cohort's shape as the message gives it (its node kept for a join's refs)."""
        self.cohort_nodes[msg.cohort] = msg.node
        return CohortShape(msg.phase, tuple((a, b) for a, b in msg.fed), tuple(msg.invariant), tuple(msg.outputs),
                           tuple(msg.reads), tuple(msg.index))

    def _chain_open(self, msg: m.ChainOpen) -> None:
        rows = {link.rows for link in msg.links}
        if len(rows) != 1:
            raise ProtocolError(f"chain {msg.cohort}'s links have rows {sorted(rows)}, not one count")
        links = [(link.cohort, link.node, self._shape(link), link.max_pages) for link in msg.links]
        imports = [(i.link, i.port, i.source, i.output) for i in msg.imports]
        flag = (msg.flag_link, msg.flag_port) if msg.flag_link is not None else None
        self._reply(msg.step_id, [], lambda: self.worker.cohort_chain_open(msg.cohort, links, rows.pop(), imports, flag))

    def _reply(self, step_id: int, request_ids: list[str], call: Any) -> None:
        """Run an answered cohort call: `CohortReply` (ok: what it returned, None counting as
        True), `StepRejected` for a node's RequestError (naming the requests it names, else
        `request_ids`), `WorkerError` for anything else."""
        try:
            ok = call()
        except RequestError as e:
            ids = getattr(e, "request_ids", None) or request_ids
            write_frame(self.out, m.StepRejected(step_id, self.rank, str(e), e.field, list(ids)))
            return
        except Exception as e:
            write_frame(self.out, m.WorkerError(self.rank, _error_text(e), step_id))
            return
        write_frame(self.out, m.CohortReply(step_id, self.rank, ok is not False))

    def _cohort_step(self, msg: m.CohortStep | m.ChainStep) -> None:
        t0 = time.perf_counter()
        tensors: list[torch.Tensor] = []
        try:
            step = self.worker.cohort_chain_step if isinstance(msg, m.ChainStep) else self.worker.cohort_step
            result = step(msg.cohort, msg.n)
            layout: list[m.PackedPort] = []
            metas: list[m.TensorMeta] = []
            inline: dict[str, torch.Tensor] = {}
            if msg.send_outputs:  # a TP member's acknowledgement waits for nothing
                layout, values = readback_values(result)
                metas, inline, _, tensors = pack_values(values, READBACK_INLINE_BYTES, "cohort readback")
            data = m.encode(m.CohortStepped(msg.step_id, self.rank, layout, metas, inline,
                                            time.perf_counter() - t0, self.waited))
        except Exception as e:
            write_frame(self.out, m.WorkerError(self.rank, _error_text(e), msg.step_id))
            return
        self.waited = 0.0
        self.out.write(FRAME.pack(len(data)) + data)
        self.out.flush()
        send_tensors(tensors, 0, self.comm)

    def _export(self, msg: m.ExportKV) -> None:
        """Answer `ExportKV`: the `KVExported` frame, then its values' buffer; a refusal (a node
        state that cannot travel) is a `WorkerError` without a step, and this worker serves on."""
        try:
            values = self.worker.export_kv(msg.node, msg.request_id, msg.tag, msg.pages)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the values exist before the answer (as a step's)
            metas, inline, scalars, tensors = pack_values(values, INLINE_BYTES, "KV context value")
            data = m.encode(m.KVExported(self.rank, metas, inline, scalars))
        except Exception as e:
            write_frame(self.out, m.WorkerError(self.rank, _error_text(e)))
            return
        self.out.write(FRAME.pack(len(data)) + data)
        self.out.flush()
        send_tensors(tensors, 0, self.comm)

    def _kept_inputs(self, node: str, wire: m.StepEntry | m.CohortJoinRow, sent: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The inputs `wire.refs` names, from this rank's own outputs of the request's last
        replicated step. A value sent as well (the conductor's `check_refs`) must be equal."""
        kept = self.kept.get((node, wire.request_id, wire.tag), {})
        out: dict[str, torch.Tensor] = {}
        for name, source in wire.refs.items():
            if source not in kept:
                raise ProtocolError(
                    f"input '{name}' of request {wire.request_id} refers to output '{source}' of its "
                    f"last replicated '{node}' step, which rank {self.rank} does not hold"
                )
            value = kept[source]
            if name in sent and not torch.equal(sent[name].to(value.device), value):
                raise RuntimeError(
                    f"rank {self.rank}'s own '{source}' of request {wire.request_id} differs from the "
                    f"group leader's ({_brief(value)} here, {_brief(sent[name])} there): the ranks of a "
                    "tensor-parallel group must compute the same outputs"
                )
            out[name] = value
        return out


def _brief(t: torch.Tensor, n: int = 4) -> str:
    """A tensor for a message: its shape and first values."""
    head = t.reshape(-1)[:n].tolist()
    return f"{list(t.shape)} {head}{' ...' if t.numel() > n else ''}"


def _error_text(e: BaseException) -> str:
    """The error, then the traceback: the first line is what a client sees first."""
    cause = e.__cause__ if isinstance(e, WorkerStepError) and e.__cause__ is not None else e
    tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)).rstrip()
    head = str(e) if isinstance(e, WorkerStepError) else f"{type(e).__name__}: {e}"
    return f"{head}\nworker traceback:\n{tb}"


def worker_main(argv: Sequence[str] | None = None) -> int:
    """`python -m mstar_runtime.worker.remote --plan P --rank R --world N --init-method tcp://H:P ...`"""
    ap = argparse.ArgumentParser(prog="python -m mstar_runtime.worker.remote", description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--weights", default="dummy")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--kv-pages-cap", type=int, default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=ANSWER_TIMEOUT_S)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    _die_with_parent(args.parent_pid)
    # The control channel is the original stdout; fd 1 becomes stderr for everything else
    # (prints, C libraries), so only frames ever reach the conductor's pipe.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    rank = args.rank
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=args.init_method,
        rank=rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        plan = load_plan(args.plan, device=args.device, kv_pages_cap=args.kv_pages_cap)
        groups = tp.build_groups(plan, rank)  # collective: as rank 0 does in _join_group
        worker = Worker(plan, rank, plan.torch_device(rank), args.weights, tp_groups=groups)
        write_frame(out, m.WorkerReady(rank, os.getpid(), list(worker.engines), plan_digest(plan)))
        _Server(worker, rank, out).serve(inp)
        worker.release_graphs()  # before the groups end (end_group)
    except BrokenPipeError:
        os._exit(1)  # the conductor is gone: nobody to tell, nothing to tear down politely
    except Exception as e:
        text = _error_text(e)
        print(text, file=sys.stderr, flush=True)
        try:
            write_frame(out, m.WorkerError(rank, text, None))
        except OSError:
            pass
        # Skip the group's teardown: a peer may be gone, and the conductor kills what is left.
        os._exit(1)
    end_group()
    if args.device == "cuda":
        # nothing is left to tear down politely, and NCCL's destructors at interpreter exit
        # may wait as destroy_process_group does (end_group)
        sys.stderr.flush()
        os._exit(0)
    return 0


END_GROUP_TIMEOUT_S = 10.0


def end_group(timeout: float = END_GROUP_TIMEOUT_S) -> None:
    """End this process's torch.distributed groups; never raises, never waits longer than
    `timeout` (then logs and leaves them). NCCL groups are aborted, not destroyed:
    `destroy_process_group` waits for work recorded in captured CUDA graphs that never
    completes (pytorch/pytorch#115388), which hung a tensor-parallel run's exit on two H200s;
    an abort is local. Gloo groups are destroyed."""

    def end() -> None:
        try:
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if dist.get_backend() == "nccl" and abort is not None:
                abort()
            else:
                dist.destroy_process_group()
        except Exception as e:  # a group with a dead peer may complain; it is gone either way
            log.debug("ending the process group: %s", e)

    if not dist.is_initialized():
        return
    t = threading.Thread(target=end, name="mstar-end-group", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("the torch.distributed group did not end within %.0f s; left as it is", timeout)
