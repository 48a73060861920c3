"""Starting and ending the whole set of workers of a plan: rank 0 in process, the others as processes.

`start_workers` joins this process to the plan's default group as rank 0 (Gloo on CPU,
NCCL on GPU; then the plan's tensor-parallel groups, `ops.tp.build_groups`), starts a
`remote.RemoteWorker` process per rank > 0, and makes rank 0's `LocalWorker`: the
in-process `Worker`, which checks before each step that its peer processes still run (a
worker that dies ends the run at the next step, on any rank). `shutdown_workers` closes
them and ends the group this module made. Never from a thread that dies before the
workers should: on Linux a worker gets SIGKILL when the thread that started it ends.

Several hosts: under torchrun (`launch.py`) the ranks are torchrun's processes, not children
of rank 0. `set_launcher` makes `start_workers` hand the plan to the launcher, which returns
rank 0's `LocalWorker` and a `PeerWorker` (`peer.py`) per other rank; `own_group` tells
this module that the launcher made the default group.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mstar_runtime.ops import tp
from mstar_runtime.plan.loader import Plan, PlanError
from mstar_runtime.worker.process import ANSWER_TIMEOUT_S, end_group
from mstar_runtime.worker.remote import START_TIMEOUT_S, RemoteWorker, WorkerLost, _Peers
from mstar_runtime.worker.wire import INLINE_BYTES, plan_digest
from mstar_runtime.worker.worker import StepBatch, Worker, WorkerStepError

log = logging.getLogger(__name__)


class LocalWorker(Worker):
    """Rank 0's in-process worker, checking its peer processes before each step."""

    peers: _Peers | None = None
    LOSS_GRACE_S = 2.0  # how long a failed step looks for a peer's loss that explains it

    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]:
        if self.peers is None:
            return super().run_step(batch)
        self.peers.check()
        try:
            return super().run_step(batch)
        except WorkerStepError:
            # A collective of a tensor-parallel node fails when a member of its group died;
            # say that (WorkerLost: the run stops), not the transport's error in the forward.
            shard = self.plan.node(batch.node).shard
            self.peers.check(within=self.LOSS_GRACE_S if shard is not None and shard.tp > 1 else 0.0)
            raise


_OWN_GROUP = False  # True while this module owns the default process group
_LEAVE_IF_LOST = False  # a launcher's group: not ended after a worker was lost (`own_group`)
# Set by a launcher that started this process's ranks itself (`mstar_runtime.worker.launch`,
# rank 0 of a torchrun job): `start_workers` then hands it the plan instead of starting
# processes, and it returns the workers; None for the one-host launch.
Launcher = Callable[[Plan, "str | Path", str], dict[int, Any]]
_LAUNCHER: Launcher | None = None


def set_launcher(launcher: Launcher | None) -> None:
    """Install (or remove, with None) the launcher `start_workers` defers to (see `_LAUNCHER`)."""
    global _LAUNCHER
    _LAUNCHER = launcher


def own_group() -> None:
    """A launcher made this process's default group: `shutdown_workers` ends it, unless a
    worker was lost: a group with a stalled member can take its whole timeout to end, and
    the launcher's process exits right after (so the group ends with it)."""
    global _OWN_GROUP, _LEAVE_IF_LOST
    _OWN_GROUP = dist.is_initialized()
    _LEAVE_IF_LOST = True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_workers(
    plan: Plan,
    weights: str | Path = "dummy",
    device: str | None = None,
    *,
    answer_timeout: float = ANSWER_TIMEOUT_S,
    start_timeout: float = START_TIMEOUT_S,
    inline_bytes: int = INLINE_BYTES,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[int, Any]:
    """Rank 0 in this process, ranks 1..N-1 as worker processes; returns {rank: worker}.

    A one-rank plan starts no process and no process group. Otherwise this process joins a
    fresh default group as rank 0 (Gloo on CPU, NCCL on GPU) over a free port of 127.0.0.1,
    then every process makes the plan's TP groups (`mstar_runtime.ops.tp`). Rank 0's nodes are
    built while the worker processes start, unless the plan has a TP node: its nodes then
    wait for their groups.
    Any failure stops what was started and raises (WorkerLost names the rank).

    Under a launcher (`set_launcher`: a torchrun job, whose ranks torchrun started on their
    hosts) the launcher makes the workers instead. Without one, a GPU plan over several
    hosts is refused: this host has the GPUs of one of them."""
    device = device or plan.device
    if device != plan.device:
        raise ValueError(
            f"the plan was loaded for '{plan.device}', not '{device}': load_plan(..., device=...)"
        )
    if _LAUNCHER is not None:
        return _LAUNCHER(plan, weights, device)
    if len(plan.hosts) > 1 and device == "cuda":
        raise PlanError(
            plan.path,
            f"the plan runs on {len(plan.hosts)} hosts; start it on each of them with torchrun "
            "(python -m mstar_runtime.worker.launch, docs/distributed.md), or run it on the CPU "
            "of this one with --device cpu",
        )
    if plan.num_ranks == 1:
        return {0: Worker(plan, 0, plan.torch_device(0), weights)}
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process; "
            "call shutdown_workers() on the workers that made it first"
        )
    init = f"tcp://127.0.0.1:{_free_port()}"
    peers = _Peers()
    peers.remotes = [
        RemoteWorker(
            plan,
            r,
            init,
            weights=weights,
            device=device,
            answer_timeout=answer_timeout,
            inline_bytes=inline_bytes,
            threads=threads,
            env=env,
            peers=peers,
        )
        for r in range(1, plan.num_ranks)
    ]
    remotes = peers.remotes
    workers: dict[int, Any] = {w.rank: w for w in remotes}
    try:
        if not tp.has_tp(plan):
            # rank 0's nodes are built while the worker processes import torch and build theirs
            workers[0] = LocalWorker(plan, 0, plan.torch_device(0), weights)
        # a TP node needs its group at build time, and the groups need the default group
        groups = _join_group(remotes, init, plan, device, start_timeout, answer_timeout)
        if 0 not in workers:
            workers[0] = LocalWorker(plan, 0, plan.torch_device(0), weights, tp_groups=groups)
        workers[0].peers = peers
        digest = plan_digest(plan)
        for w in remotes:
            w.wait_ready(start_timeout, digest)
    except BaseException:
        for w in remotes:
            w.close(timeout=1.0)  # a start that failed: no point in waiting long for the others
        shutdown_workers(workers)
        raise
    return workers


def _join_group(
    remotes: Sequence[RemoteWorker],
    init: str,
    plan: Plan,
    device: str,
    start_timeout: float,
    op_timeout: float,
) -> dict[str, Any]:
    """init_process_group as rank 0, then the plan's TP groups (`tp.build_groups`, which the
    workers make in the same order), watching the children: one that dies before joining
    would otherwise leave us waiting for the whole store timeout. Returns rank 0's
    {node: TP group}."""

    def join() -> dict[str, Any]:
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=init,
            rank=0,
            world_size=plan.num_ranks,
            timeout=timedelta(seconds=max(start_timeout, op_timeout)),
        )
        return tp.build_groups(plan, 0)

    def watch() -> None:
        for w in remotes:
            if w.proc.poll() is not None:
                w._lose("exited before joining the process group")

    def joined() -> None:
        global _OWN_GROUP
        _OWN_GROUP = dist.is_initialized()  # also when only the TP groups failed: shutdown ends it

    return join_watched(join, watch, start_timeout, remotes[0].rank, joined)


def join_watched(join: Callable[[], dict[str, Any]], watch: Callable[[], None], within: float, rank: int,
                 joined: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run `join` (rank 0 forming the process group and the TP groups) in a thread while
    `watch` looks at the workers every 0.1 s: it raises `WorkerLost` for one that died
    before joining, which would otherwise leave us waiting for the whole store timeout.
    `joined` runs once the thread has ended, before what it raised is raised here; past
    `within` seconds, `WorkerLost` (naming `rank`) is raised without it. `join`'s result."""
    failure: list[BaseException] = []
    groups: dict[str, Any] = {}

    def run() -> None:
        try:
            groups.update(join())
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)

    t = threading.Thread(target=run, name="mstar-init-group", daemon=True)
    t.start()
    deadline = time.monotonic() + within
    while t.is_alive():
        t.join(0.1)
        watch()
        if time.monotonic() > deadline:
            raise WorkerLost(rank, f"the process group did not form within {within:.0f} s")
    joined()
    if failure:
        raise failure[0]
    return groups


def shutdown_workers(workers: Mapping[int, Any]) -> None:
    """Close every worker process, then this process's group. Never raises."""
    global _OWN_GROUP
    lost = any(isinstance(w, RemoteWorker) and (w.lost is not None or not w._running()) for w in workers.values())
    if lost and _LEAVE_IF_LOST:
        _OWN_GROUP = False
    for w in workers.values():
        if isinstance(w, RemoteWorker):
            w.close()
        elif isinstance(w, Worker) and _OWN_GROUP:
            try:
                w.release_graphs()  # before the groups end (end_group)
            except Exception as e:  # a device in a bad state: the teardown goes on
                log.warning("rank %d: releasing its CUDA graphs failed: %s", w.rank, e)
    if _OWN_GROUP:
        end_group()
    _OWN_GROUP = False
