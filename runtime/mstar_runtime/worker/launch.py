"""A plan's ranks as torchrun's processes, on one host or several (docs/distributed.md).

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m mstar_runtime.worker.launch [--peer-timeout S] [--linger S] [--start-timeout S] \\
        PLAN [mstar-run options: --walk W --input k=v --out DIR | --requests F | --serve ...]

torchrun starts one process per rank on each host; torchrun's rank r is the plan's rank r,
on its host's device LOCAL_RANK (a plan with `hosts` must match the launch: as many hosts as
torchrun nodes, each with as many processes as its ranks, in order). Rank 0 hosts the
conductor and the API: it runs `mstar-run` itself (`mstar_runtime.cli.main` with the options
after PLAN), whose `start_workers` this module answers (`startup.set_launcher`) with the
processes torchrun started instead of children of its own. The other ranks serve steps.

Start-up, through torchrun's store (its TCPStore at MASTER_ADDR:MASTER_PORT, keys under
`mstar/<restart count>/`):
1. rank 0 loads the plan (as `mstar-run` does), checks the launch against it, opens its
   control port and writes `start`: the plan's path and digest, weights, device, its port
   and a secret token. If it stops before (a bad option, a plan that does not load), it
   writes the reason instead, and every worker exits with it.
2. each worker reads `start`, connects to the control port (`peer.connect`, a `Hello` with
   the token), loads the same plan and checks its own place in the launch;
3. every rank joins the default group (NCCL on GPUs, Gloo on CPUs) and makes the plan's TP
   groups, each with the peer timeout; each worker builds its nodes and answers
   `WorkerReady` with the digest of the plan it loaded, which must be rank 0's.
Then the workers serve frames from their connection (`process._Server`, the loop of the
one-host worker processes) until rank 0's `Shutdown` (exit 0) or the connection's end
without one (exit 1: the conductor is gone, its requests are lost).

Failing fast. `--peer-timeout` (default 60 s) bounds how long a rank that died or stalled
can hold requests: a step's answer (`answer_timeout`), every collective of the default and
TP groups (their timeout), the control connections' keepalive and user timeout (a host gone
without closing its sockets), and rank 0's heartbeats to idle workers (a watchdog thread,
every quarter of the timeout, at most 5 s). A lost rank ends the run as a lost worker
process does on one host (`WorkerLost`: every request fails with a message naming the rank,
its host and what happened); the server's `/health` answers 503 (`PeerWorker.alive()`),
then after `--linger` seconds (default 10) rank 0 stops the server (SIGTERM to itself: the
usual drain) and exits with 1, so torchrun ends on its host and the other ranks, whose
connections end, exit too. Every process sets PR_SET_PDEATHSIG: a torchrun agent that is
killed takes its ranks with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mstar_runtime.ops import tp
from mstar_runtime.plan.loader import Plan, PlanError, load_plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker import startup
from mstar_runtime.worker.peer import ControlListener, PeerWorker, SocketWriter, connect
from mstar_runtime.worker.process import _die_with_parent, _error_text, _Server, end_group
from mstar_runtime.worker.remote import WorkerLost, _Peers
from mstar_runtime.worker.startup import LocalWorker
from mstar_runtime.worker.wire import plan_digest, write_frame
from mstar_runtime.worker.worker import Worker

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 60.0
LINGER_S = 10.0
START_TIMEOUT_S = 600.0  # rank 0 loading the plan, then every rank its weights
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
PROG = "mstar launch"
CONNECT_S = 30.0  # a worker's attempts to reach rank 0's control port


class LaunchError(Exception):
    """The launch cannot go on (not under torchrun, a launch that does not match the plan): one line."""


@dataclass(frozen=True)
class Torchrun:
    """This process's place in the torchrun job, from the variables torchrun sets."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int  # GROUP_RANK: the host's place among torchrun's nodes
    nodes: int  # GROUP_WORLD_SIZE
    master_addr: str
    master_port: int
    restart: int  # TORCHELASTIC_RESTART_COUNT: keys of an earlier attempt are not read again
    agent_store: bool  # the agent hosts the store (torchrun's default): every rank is a client

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Torchrun:
        missing = [k for k in _ENV if k not in env]
        if missing:
            raise LaunchError(
                f"not started by torchrun ({', '.join(missing)} unset): run `torchrun ... -m "
                "mstar_runtime.worker.launch PLAN ...`, or `mstar-run PLAN` on one host"
            )
        try:
            tr = cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                     int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_RANK"]),
                     int(env.get("GROUP_WORLD_SIZE", "0")) or -1, env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                     int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                     env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True")
        except ValueError as e:
            raise LaunchError(f"a torchrun variable is not a number: {e}") from None
        # torchrun sets them consistently; set by hand they may not be (a rank past the world
        # would wait out the start timeout for a store, a bad port fail inside torch)
        for ok, what in ((0 <= tr.rank < tr.world, f"RANK {tr.rank} is not in 0..WORLD_SIZE-1 ({tr.world})"),
                         (0 <= tr.local_rank < tr.local_world,
                          f"LOCAL_RANK {tr.local_rank} is not in 0..LOCAL_WORLD_SIZE-1 ({tr.local_world})"),
                         (1 <= tr.master_port <= 65535, f"MASTER_PORT {tr.master_port} is not a port (1 to 65535)")):
            if not ok:
                raise LaunchError(f"torchrun's variables do not fit: {what}")
        return tr

    @property
    def where(self) -> str:
        return f"rank {self.rank} (torchrun node {self.node}, local rank {self.local_rank})"

    def device(self, kind: str) -> torch.device:
        return torch.device(f"cuda:{self.local_rank}") if kind == "cuda" else torch.device("cpu")


def check_layout(plan: Plan, tr: Torchrun) -> None:
    """PlanError unless this process's place in the launch is the plan's (module docstring)."""
    if tr.world != plan.num_ranks:
        raise PlanError(plan.path, f"the plan has {plan.num_ranks} ranks, but torchrun started {tr.world} "
                        f"processes: start {plan.num_ranks} in all (--nnodes x --nproc-per-node)")
    if not plan.hosts:
        return
    sizes = " + ".join(str(len(h)) for h in plan.hosts)
    if tr.nodes > 0 and tr.nodes != len(plan.hosts):
        raise PlanError(plan.path, f"the plan runs on {len(plan.hosts)} hosts ({sizes} ranks), but torchrun has "
                        f"{tr.nodes} nodes: start one torchrun per host (--nnodes {len(plan.hosts)})")
    if not 0 <= tr.node < len(plan.hosts):
        raise PlanError(plan.path, f"torchrun node {tr.node} has no host in the plan ({len(plan.hosts)} hosts)")
    host = plan.hosts[tr.node]
    if tr.local_world != len(host) or tr.rank != host[tr.local_rank]:
        raise PlanError(plan.path, f"{tr.where} of a node with {tr.local_world} processes, but the plan's host "
                        f"{tr.node} has ranks {', '.join(map(str, host))}: start --nproc-per-node {len(host)} "
                        f"on it (torchrun numbers its nodes by address, then agent pid: --local-addr orders them)")


def _store(tr: Torchrun, timeout: float) -> dist.Store:
    """torchrun's store, under this attempt's prefix."""
    store = dist.TCPStore(tr.master_addr, tr.master_port, tr.world, is_master=tr.rank == 0 and not tr.agent_store,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(f"mstar/{tr.restart}/", store)


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- rank 0
class RankZero:
    """Rank 0: `mstar-run`'s workers are the ranks torchrun started (`start`), watched."""

    def __init__(self, tr: Torchrun, store: dist.Store, opts: argparse.Namespace, serving: bool):
        self.tr, self.store, self.opts, self.serving = tr, store, opts, serving
        self.started = False
        self.published = False  # `start` is in the store
        self.peers: list[PeerWorker] = []
        self.lost: str | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    # ---- start_workers, under startup.set_launcher
    def start(self, plan: Plan, weights: str | Path, device: str) -> dict[int, Any]:
        if self.started:
            raise RuntimeError("a torchrun launch starts its plan once")
        self.started = True
        timeout, within = self.opts.peer_timeout, self.opts.start_timeout
        check_layout(plan, self.tr)
        token = secrets.token_hex(16)
        listener = ControlListener(token, timeout)
        workers: dict[int, Any] = {}
        try:
            self._publish({"plan": plan.path, "digest": plan_digest(plan), "weights": os.fspath(weights),
                           "device": device, "kv_pages_cap": plan.kv_pages_cap, "token": token,
                           "control": f"{self.tr.master_addr}:{listener.port}", "peer_timeout": timeout,
                           "start_timeout": within})
            conns = listener.accept(range(1, plan.num_ranks), within, self._failed)
            peers = _Peers()
            self.peers = [PeerWorker(plan, *conns[r], answer_timeout=timeout, peers=peers) for r in sorted(conns)]
            peers.remotes = list(self.peers)
            workers.update({w.rank: w for w in self.peers})
            groups = self._join(plan, device, timeout, within)
            startup.own_group()
            local = LocalWorker(plan, 0, self.tr.device(device), weights, tp_groups=groups)
            local.peers = peers
            workers[0] = local
            digest = plan_digest(plan)
            for w in self.peers:
                w.wait_ready(within, digest)
                w.ready = True
        except BaseException:
            for w in self.peers:
                w.close(timeout=1.0)
            startup.shutdown_workers(workers)
            raise
        finally:
            listener.close()
        hosts = ", ".join(f"rank {w.rank}: host {w.node} ({w.host}) pid {w.pid}" for w in self.peers)
        _say(f"rank 0 (pid {os.getpid()}) conducts {plan.num_ranks} ranks over {_backend(device)}; {hosts}")
        self._watchdog = threading.Thread(target=self._watch, name="mstar-launch-watchdog", daemon=True)
        self._watchdog.start()
        return workers

    def _publish(self, info: Mapping[str, Any]) -> None:
        self.store.set("start", json.dumps(dict(info)))
        self.published = True

    def _failed(self, rank: int) -> str | None:
        """What worker `rank` wrote to the store when it failed before connecting, if it did."""
        key = f"failed/{rank}"
        return self.store.get(key).decode("utf-8", "replace") if self.store.check([key]) else None

    def abort(self, why: str) -> None:
        """Tell workers still waiting for `start` that it will not come."""
        try:
            self.store.set("start", json.dumps({"error": why}))
        except Exception as e:  # the store may be gone with its agent; the workers time out then
            log.debug("could not tell the workers: %s", e)

    def _join(self, plan: Plan, device: str, timeout: float, within: float) -> dict[str, Any]:
        """The default group and the TP groups, watching the workers meanwhile: one that fails
        to start says why (its WorkerError) instead of leaving rank 0 waiting for it."""

        def join() -> dict[str, Any]:
            if device == "cuda":
                torch.cuda.set_device(self.tr.device(device))
            dist.init_process_group(_backend(device), store=dist.PrefixStore("pg/", self.store), rank=0,
                                    world_size=plan.num_ranks, timeout=timedelta(seconds=timeout))
            return tp.build_groups(plan, 0, timedelta(seconds=timeout))

        def watch() -> None:
            for w in self.peers:
                if not w._running():
                    w.wait_ready(1.0)  # reads its WorkerError, if it sent one; WorkerLost either way
                    w._lose("closed its control connection before joining the process group")

        return startup.join_watched(join, watch, within, 1)

    # ---- the watchdog
    def _watch(self) -> None:
        interval = min(5.0, max(0.2, self.opts.peer_timeout / 4))
        lost_at: float | None = None
        while not self._stop.wait(interval):
            for w in self.peers:
                if w._closed:
                    continue
                if w.lose_if_gone() or not w.probe(self.opts.peer_timeout):
                    if lost_at is None:
                        lost_at = time.monotonic()
                        self.lost = str(WorkerLost(w.rank, w.lost or "its connection closed"))
                        then = (f"/health answers 503; rank 0 stops in {self.opts.linger:g} s" if self.serving
                                else "its requests fail")
                        _say(f"{self.lost.splitlines()[0]}; {then}")
                    break
            if lost_at is not None and self.serving and time.monotonic() - lost_at >= self.opts.linger:
                _say("stopping: a rank is lost, the plan cannot serve")
                os.kill(os.getpid(), signal.SIGTERM)  # the server's own drain, then exit
                return

    def finish(self) -> None:
        self._stop.set()
        for w in self.peers:
            if w.lost is not None and self.lost is None:
                self.lost = str(WorkerLost(w.rank, w.lost))
            w.close(timeout=1.0)
        if self.lost is None:  # with a lost member the group may take its timeout to end: the exit ends it
            end_group()


def _conduct(tr: Torchrun, opts: argparse.Namespace, rest: list[str]) -> int:
    store = _store(tr, opts.start_timeout)
    conductor = RankZero(tr, store, opts, serving="--serve" in rest)
    startup.set_launcher(conductor.start)
    code: int | str | None = 1
    try:
        from mstar_runtime.cli import main as mstar_run

        code = mstar_run(rest)
    except SystemExit as e:  # usage errors
        code = e.code
    finally:
        startup.set_launcher(None)
        if not conductor.published:
            conductor.abort(f"rank 0 stopped (exit code {code}) before it started the plan; its output says why")
        conductor.finish()
    status = code if isinstance(code, int) else 1
    if conductor.lost is not None:
        _say(f"exiting with 1: {conductor.lost.splitlines()[0]}")
        return status or 1
    return status


# ------------------------------------------------------------------------------- ranks > 0
def _serve_rank(tr: Torchrun, opts: argparse.Namespace) -> int:
    store = _store(tr, opts.start_timeout)
    try:
        store.wait(["start"], timedelta(seconds=opts.start_timeout))
        info = json.loads(store.get("start"))
    except Exception as e:
        _say(f"{tr.where}: rank 0 did not start the plan within {opts.start_timeout:g} s ({e})")
        return 1
    if "error" in info:
        _say(f"{tr.where}: {info['error']}")
        return 1
    return _serve_started(tr, store, info)


def _serve_started(tr: Torchrun, store: dist.Store, info: Mapping[str, Any]) -> int:
    timeout = float(info["peer_timeout"])
    try:
        # the port was open before `start` was written: a refusal means rank 0 gave up
        sock = connect(info["control"], timeout, CONNECT_S)
    except OSError as e:
        why = f"cannot reach rank 0's control port {info['control']}: {e}"
        _say(f"{tr.where}: {why}")
        store.set(f"failed/{tr.rank}", why)
        return 1
    out = SocketWriter(sock)
    inp = sock.makefile("rb")
    write_frame(out, m.Hello(tr.rank, os.getpid(), socket.gethostname(), tr.node, info["token"]))
    watch = _ConductorWatch(sock, tr)
    device = info["device"]
    try:
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # the host's ranks share its cores (see RemoteWorker: oversubscribed OpenMP is 10-100x slower)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tr.local_world))
        plan = load_plan(info["plan"], device=device, kv_pages_cap=info["kv_pages_cap"])
        check_layout(plan, tr)
        if plan_digest(plan) != info["digest"]:
            raise PlanError(plan.path, f"this host's {info['plan']} is not the plan rank 0 loaded: copy the same "
                            "plan file to every host")
        local = tr.device(device)
        if device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(_backend(device), store=dist.PrefixStore("pg/", store), rank=tr.rank,
                                world_size=tr.world, timeout=timedelta(seconds=timeout))
        groups = tp.build_groups(plan, tr.rank, timedelta(seconds=timeout))
        worker = Worker(plan, tr.rank, local, info["weights"], tp_groups=groups)
        write_frame(out, m.WorkerReady(tr.rank, os.getpid(), list(worker.engines), plan_digest(plan)))
        server = _Server(worker, tr.rank, out)
        watch.server = server
        server.serve(inp)  # type: ignore[arg-type]
        worker.release_graphs()  # before the groups end (end_group)
    except (ConnectionError, TimeoutError, BlockingIOError) as e:  # the connection broke: rank 0 or its host is gone
        _say(f"{tr.where}: the conductor's connection ended ({type(e).__name__}: {e}); exiting with 1")
        os._exit(1)  # nothing to tear down politely, and a dead peer's group could hang a teardown
    except Exception as e:
        text = _error_text(e)
        _say(f"{tr.where}: {text}")
        try:
            write_frame(out, m.WorkerError(tr.rank, text, None))
        except OSError:
            pass
        os._exit(1)
    end_group()
    if not server.shut_down:
        _say(f"{tr.where}: the conductor's connection ended without a shutdown (rank 0 or its host is gone); "
             "exiting with 1")
        os._exit(1)
    sock.close()
    return 0


class _ConductorWatch:
    """A worker's thread that ends the process when rank 0's connection ends, wherever the
    main thread is (loading weights, in a collective, in a long step): nobody is left to
    serve. A Shutdown read meanwhile (`server.shut_down`) is a normal end, not a loss."""

    def __init__(self, sock: socket.socket, tr: Torchrun):
        self.sock, self.tr = sock, tr
        self.server: _Server | None = None
        threading.Thread(target=self._run, name="mstar-conductor-watch", daemon=True).start()

    def _done(self) -> bool:
        return self.server is not None and self.server.shut_down

    def _run(self) -> None:
        while not self._done():
            try:
                readable, _, _ = select.select([self.sock], [], [], 0.5)
                if not readable:
                    continue
                if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b"":
                    time.sleep(0.5)  # a frame the main thread has not read yet: look again later
                    continue
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                pass  # reset, timed out, or closed: the conductor is gone
            time.sleep(1.0)  # the main thread may be reading a Shutdown that ended the stream
            if self._done():
                return
            _say(f"{self.tr.where}: the conductor's connection ended (rank 0 or its host is gone); exiting with 1")
            os._exit(1)


# ------------------------------------------------------------------------------- main
def options(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This module's options; everything else is mstar-run's (rank 0 passes it on)."""
    ap = argparse.ArgumentParser(prog="python -m mstar_runtime.worker.launch", add_help=False, allow_abbrev=False)
    ap.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S, metavar="S")
    ap.add_argument("--linger", type=float, default=LINGER_S, metavar="S")
    ap.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S, metavar="S")
    opts, rest = ap.parse_known_args(list(argv))
    for name in ("peer_timeout", "start_timeout"):
        if not getattr(opts, name) > 0:
            raise LaunchError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if opts.linger < 0:
        raise LaunchError("--linger must be >= 0")
    return opts, rest


def main(argv: Sequence[str] | None = None) -> int:
    try:
        tr = Torchrun.from_env(os.environ)
        opts, rest = options(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        _say(f"error: {e}")
        return 2
    # torchrun's agent is the parent: a killed agent takes its ranks with it
    _die_with_parent(os.getppid())
    if tr.rank == 0:
        code = _conduct(tr, opts, rest)
    else:
        code = _serve_rank(tr, opts)
    sys.stderr.flush()
    sys.stdout.flush()
    # NCCL's and Gloo's destructors at interpreter exit may wait on a peer that is gone
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
