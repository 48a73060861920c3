"""A plan's ranks on two "hosts": two torchrun agents on 127.0.0.1 (Gloo over loopback).

Each test starts two real torchrun agents (`--rdzv-backend c10d`, one rendezvous endpoint),
agent 0 with `--local-addr 127.0.0.1` and agent 1 with `127.0.0.2`, so that c10d, which
orders nodes by address, makes agent 0 torchrun node 0 (host 0, rank 0: the conductor and
the API) and agent 1 node 1. They run `python -m mstar_runtime.worker.launch` on the test
family's 2-rank plan (tests/placements/cpu2_hosts2.yaml: the LM on host 1) and 3-rank plan
(cpu3_hosts2.yaml: ranks 0 and 1 on host 0, the flow head on host 1), and check:
- outputs equal to one process on one rank (one-shot files, served walks);
- a clean stop (SIGTERM to rank 0) ends every process with 0;
- killing agent 1 mid-request (its rank stopped in a step first, so the request is surely
  in flight) fails the request within the peer timeout with a message naming the rank and
  host, turns /health to 503, and ends every process of both hosts; a stalled rank fails
  its request once its answer is overdue; killing agent 0 ends host 1's rank; a launch
  that does not match the plan's hosts fails at once on every rank.
Orpheus over two hosts: tests/test_torchrun_orpheus.py. The unit tests at the end need no
torchrun.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_multirank import REQUESTS, _gone

from mstar_runtime.api import MStar
from mstar_runtime.outputs import write_outputs
from mstar_runtime.plan.loader import PlanError, load_plan
from mstar_runtime.serve.io import sample_rate, wire_value
from mstar_runtime.worker import launch
from mstar_runtime.worker.startup import start_workers
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
PEER_TIMEOUT = 5.0  # the bound a lost rank's requests fail within (--peer-timeout)
START_S = 90.0  # two agents importing torch and building the nodes on a loaded 2-core box

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback addresses 127.0.0.2, /proc"),
]


def compile_plan(out: Path, model: str, placement: str) -> Path:
    path = out / f"{model}-{Path(placement).stem}.plan"
    assert mstarc(["compile", str(ROOT / f"models/{model}/{model}.walk"), "--variant", "tiny",
                   "-p", str(ROOT / placement), "-o", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("plans")
    return {n: compile_plan(out, "testfamily", p) for n, p in
            ((1, "placements/cpu.yaml"), (2, "tests/placements/cpu2_hosts2.yaml"),
             (3, "tests/placements/cpu3_hosts2.yaml"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Job:
    """Two torchrun agents, the two hosts, running the launch module on one plan."""

    def __init__(self, tmp: Path, plan: Path, nprocs: tuple[int, int], args: Sequence[str], *,
                 peer_timeout: float = PEER_TIMEOUT, linger: float = 3.0):
        self.tmp, rdzv = tmp, free_port()
        self.logs = [tmp / "agent0.log", tmp / "agent1.log"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.agents: list[subprocess.Popen[bytes]] = []
        for i, n in enumerate(nprocs):
            cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", str(n), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--local-addr", f"127.0.0.{i + 1}",
                   "-m", "mstar_runtime.worker.launch", "--peer-timeout", str(peer_timeout),
                   "--linger", str(linger), "--start-timeout", str(START_S), str(plan), *args]
            with open(self.logs[i], "wb") as log:
                self.agents.append(subprocess.Popen(cmd, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, env=env))
            time.sleep(0.3)  # agent 0 first: it hosts the rendezvous store
        self.seen: set[int] = set()  # every pid of the job ever seen (agents and ranks)
        self.watch()

    def log(self, i: int = 0) -> str:
        return self.logs[i].read_text(errors="replace")

    def watch(self) -> None:
        for a in self.agents:
            self.seen.add(a.pid)
            self.seen.update(children(a.pid))

    def ranks(self, timeout: float = START_S) -> dict[int, int]:
        """{rank: pid}, from rank 0's start line (once every rank is ready)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.watch()
            found = re.search(r"rank 0 \(pid (\d+)\) conducts \d+ ranks over \w+; (.*)", self.log(0))
            if found:
                pids = {0: int(found.group(1))}
                pids.update({int(r): int(p) for r, p in re.findall(r"rank (\d+): host \d+ \([^)]*\) pid (\d+)",
                                                                    found.group(2))})
                self.seen.update(pids.values())
                return pids
            if any(a.poll() is not None for a in self.agents):
                break
            time.sleep(0.1)
        raise AssertionError(f"the job did not start:\n{self.log(0)[-3000:]}\n---\n{self.log(1)[-3000:]}")

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for a in self.agents:
            try:
                a.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [a.poll() for a in self.agents]

    def assert_all_gone(self, within: float = 20.0) -> None:
        self.watch()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not all(_gone(p) for p in self.seen):
            time.sleep(0.1)
        left = sorted(p for p in self.seen if not _gone(p))
        assert not left, f"still running: {left}\n{self.log(0)[-2000:]}\n---\n{self.log(1)[-2000:]}"

    def kill_all(self) -> None:
        """Teardown: SIGKILL, by pid, whatever of this job still runs (after a failed test)."""
        self.watch()
        for pid in self.seen:
            if not _gone(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for a in self.agents:
            a.wait(10)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for job in made:
        job.kill_all()


def http(port: int, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_healthy(job: Job, port: int) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            if http(port, "/health", timeout=2)[0] == 200:
                return
        except (OSError, ValueError):
            pass
        if any(a.poll() is not None for a in job.agents):
            break
        time.sleep(0.2)
    raise AssertionError(f"the server did not come up:\n{job.log(0)[-3000:]}\n---\n{job.log(1)[-3000:]}")


def reference(plan: Path, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each request alone on one rank in this process, as the server runs them one by one."""
    with MStar.from_plan(load_plan(plan, device="cpu")) as m:
        return [m.submit(walk, dict(inputs)).result() for walk, inputs in requests]


def wired(plan: Path, walk: str, outputs: dict[str, Any]) -> dict[str, Any]:
    """Outputs as the native route sends them (`stream: false`)."""
    p = load_plan(plan, device="cpu")
    declared = {o["name"]: o["type"] for o in p.walk(walk)["outputs"]}
    return json.loads(json.dumps({k: wire_value(k, v, declared.get(k), sample_rate(p.config))
                                  for k, v in outputs.items()}))


def serve_and_compare(job: Job, port: int, one_rank: Path,
                      requests: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The requests one by one over HTTP equal one rank's outputs; then a clean stop. The
    served outputs."""
    wait_healthy(job, port)
    pids = job.ranks()
    want = reference(one_rank, requests)
    served = []
    for (walk, inputs), expected in zip(requests, want):
        status, body = http(port, f"/v1/walks/{walk}", {"inputs": inputs, "stream": False})
        assert status == 200, body
        assert body["outputs"] == wired(one_rank, walk, expected), walk
        served.append(body["outputs"])
    os.kill(pids[0], signal.SIGTERM)  # the server's drain, then every rank gets its Shutdown
    assert job.wait(60) == [0, 0], f"{job.log(0)[-3000:]}\n---\n{job.log(1)[-3000:]}"
    job.assert_all_gone()
    return served


# ------------------------------------------------------------------------- same outputs
def test_one_shot_on_two_hosts_writes_what_one_process_writes(plans: dict[int, Path], tmp_path: Path,
                                                              jobs: list[Job]) -> None:
    inputs = {"prompt": "hello world", "max_new": 12}
    job = Job(tmp_path, plans[2], (1, 1), ["--walk", "generate", *[f"--input={k}={v}" for k, v in inputs.items()],
                                           "--out", "out"])
    jobs.append(job)
    assert job.wait(START_S) == [0, 0], f"{job.log(0)[-3000:]}\n---\n{job.log(1)[-3000:]}"
    job.assert_all_gone()
    # the LM is on rank 1, in a worker process (on the other host): its loop is a cohort there
    (expected,) = reference(plans[1], [("generate", inputs)])
    plan = load_plan(plans[1], device="cpu")
    written = write_outputs(tmp_path / "ref", "generate", plan.walk("generate"), expected, plan.config)
    files = [p.name for p in written if p.name != "generate.json"]  # the record has timings
    assert files and sorted(files) == sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != "generate.json")
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    assert "rank 0 (pid" in job.log(0) and "rank 1: host 1" in job.log(0)


def test_three_ranks_on_two_hosts_serve_what_one_rank_computes(plans: dict[int, Path], tmp_path: Path,
                                                              jobs: list[Job]) -> None:
    port = free_port()
    job = Job(tmp_path, plans[3], (2, 1), ["--serve", "--port", str(port)])
    jobs.append(job)
    # every walk of the test family; the LM is on rank 0 (cohort loops), the flow head on host 1
    serve_and_compare(job, port, plans[1], REQUESTS[:5])


# ------------------------------------------------------------------------- failing fast
def _start_served(tmp_path: Path, plans: dict[int, Path], jobs: list[Job], **kw: Any) -> tuple[Job, int, dict[int, int]]:
    port = free_port()
    job = Job(tmp_path, plans[2], (1, 1), ["--serve", "--port", str(port)], **kw)
    jobs.append(job)
    wait_healthy(job, port)
    pids = job.ranks()
    status, _ = http(port, "/v1/walks/generate", {"inputs": {"prompt": "warm", "max_new": 2}, "stream": False})
    assert status == 200
    return job, port, pids


def _request_in_thread(port: int, inputs: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        out["response"] = http(port, "/v1/walks/generate", {"inputs": inputs, "stream": False})
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_killing_the_second_agent_mid_request_fails_it_within_the_bound(plans: dict[int, Path], tmp_path: Path,
                                                                       jobs: list[Job]) -> None:
    job, port, pids = _start_served(tmp_path, plans, jobs)
    # rank 1 (the LM, host 1) stops first, so the request's step is surely in flight there
    os.kill(pids[1], signal.SIGSTOP)
    t, out = _request_in_thread(port, {"prompt": "the request in flight", "max_new": 12})
    time.sleep(1.0)
    assert t.is_alive(), out
    killed = time.monotonic()
    job.agents[1].kill()  # SIGKILL: no goodbye; its rank dies with it (PR_SET_PDEATHSIG)
    t.join(PEER_TIMEOUT + 10)
    status, body = out["response"]
    assert out["at"] - killed < PEER_TIMEOUT, out["at"] - killed
    assert status == 503 and body["error"]["code"] == "engine_unavailable", body
    assert http(port, "/health", timeout=5)[0] == 503
    log = job.log(0)
    # rank 0 finds out on the control connection, or in the step's torch.distributed transfer
    assert re.search(rf"worker rank 1 lost: its process \(pid {pids[1]} on host 1, [^)]*\) (closed its control "
                     r"connection while running|did not (take the inputs|send the outputs) of) lm\.\w+.*; it is "
                     r"gone \(its process ended, or its host went away\)", log), log[-3000:]
    # rank 0 stops after --linger; both hosts end, agent 0 with the failure
    codes = job.wait(30)
    assert codes[0] == 1 and codes[1] == -signal.SIGKILL, codes
    job.assert_all_gone()


def test_a_stalled_rank_fails_its_request_once_its_answer_is_overdue(plans: dict[int, Path], tmp_path: Path,
                                                                     jobs: list[Job]) -> None:
    job, port, pids = _start_served(tmp_path, plans, jobs, peer_timeout=3.0)
    os.kill(pids[1], signal.SIGSTOP)
    stalled = time.monotonic()
    t, out = _request_in_thread(port, {"prompt": "a stalled host", "max_new": 12})
    t.join(20)
    status, body = out["response"]
    assert 3.0 <= out["at"] - stalled < 3.0 + PEER_TIMEOUT, out["at"] - stalled
    assert status == 503, body
    assert "worker rank 1 lost: " in job.log(0) and "did not answer within 3 s while running lm." in job.log(0)
    assert http(port, "/health", timeout=5)[0] == 503
    assert job.agents[0].wait(30) == 1  # rank 0 stops after --linger; its agent fails at once
    # host 1's agent sends the stopped rank SIGTERM once host 0's store is gone (and SIGKILL
    # after torchrun's 30 s); woken up, the rank ends at once, by that signal or because
    # its conductor's connection is gone
    os.kill(pids[1], signal.SIGCONT)
    assert job.agents[1].wait(30) not in (None, 0)
    job.assert_all_gone()


def test_killing_the_first_agent_ends_the_other_host(plans: dict[int, Path], tmp_path: Path,
                                                    jobs: list[Job]) -> None:
    job, _, pids = _start_served(tmp_path, plans, jobs)
    job.agents[0].kill()  # host 0 with the conductor: gone at once
    assert job.wait(30)[1] not in (None, 0)
    # Two ways host 1 learns it first, by timing: its worker sees the control connection end,
    # or its agent loses torchrun's store (which lived on host 0) and ends the worker itself.
    log = job.log(1)
    assert "the conductor's connection ended" in log or "The connection to the C10d store has failed" in log, log
    job.assert_all_gone()
    assert all(_gone(p) for p in pids.values())


def test_a_launch_that_does_not_match_the_plan_fails_on_every_rank(plans: dict[int, Path], tmp_path: Path,
                                                                  jobs: list[Job]) -> None:
    """cpu3_hosts2 wants 2 ranks on host 0 and 1 on host 1; this launch has them the other way.
    Rank 0 refuses the layout and every other rank fails on its word, not by waiting out the
    start timeout (which would say so, and take START_S): the logs show which, at any speed."""
    job = Job(tmp_path, plans[3], (1, 2), ["--walk", "generate", "--input", "prompt=x"])
    jobs.append(job)
    codes = job.wait(START_S)
    assert all(c not in (None, 0) for c in codes), codes
    assert ("mstar-run: error: " in job.log(0) and "rank 0 (torchrun node 0, local rank 0) of a node with 1 "
            "processes, but the plan's host 0 has ranks 0, 1: start --nproc-per-node 2 on it") in job.log(0)
    for rank, local in ((1, 0), (2, 1)):
        assert (f"rank {rank} (torchrun node 1, local rank {local}): rank 0 stopped (exit code 1) before it "
                "started the plan") in job.log(1), job.log(1)
    assert "did not start the plan within" not in job.log(0) + job.log(1)
    job.assert_all_gone()


# ------------------------------------------------------------------------- without torchrun
def test_the_launch_module_needs_torchrun_and_checks_its_options() -> None:
    with pytest.raises(launch.LaunchError, match=r"not started by torchrun \(RANK, WORLD_SIZE"):
        launch.Torchrun.from_env({})
    opts, rest = launch.options(["--peer-timeout", "7", "p.plan", "--serve", "--port", "0", "--linger=0"])
    assert (opts.peer_timeout, opts.linger, opts.start_timeout) == (7.0, 0.0, launch.START_TIMEOUT_S)
    assert rest == ["p.plan", "--serve", "--port", "0"]
    with pytest.raises(launch.LaunchError, match="--peer-timeout must be a positive"):
        launch.options(["--peer-timeout", "0", "p.plan"])


@pytest.mark.parametrize(("change", "says"), [
    ({"RANK": "5"}, r"RANK 5 is not in 0..WORLD_SIZE-1 \(1\)"),  # waited out the start timeout
    ({"LOCAL_RANK": "1"}, r"LOCAL_RANK 1 is not in 0..LOCAL_WORLD_SIZE-1 \(1\)"),
    ({"MASTER_PORT": "99999"}, r"MASTER_PORT 99999 is not a port"),  # a TypeError inside TCPStore
])
def test_torchrun_variables_set_by_hand_are_checked(change: dict[str, str], says: str) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    launch.Torchrun.from_env(env)
    with pytest.raises(launch.LaunchError, match=f"torchrun's variables do not fit: {says}"):
        launch.Torchrun.from_env({**env, **change})


def _torchrun(rank: int, world: int, local_rank: int, local_world: int, node: int, nodes: int) -> launch.Torchrun:
    return launch.Torchrun.from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                                     "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node),
                                     "GROUP_WORLD_SIZE": str(nodes), "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_the_launch_must_match_the_plans_hosts(plans: dict[int, Path]) -> None:
    plan = load_plan(plans[3], device="cpu")  # hosts (0, 1) and (2,)
    assert plan.hosts == ((0, 1), (2,))
    for rank, local, node in ((0, 0, 0), (1, 1, 0)):
        launch.check_layout(plan, _torchrun(rank, 3, local, 2, node, 2))
    launch.check_layout(plan, _torchrun(2, 3, 0, 1, 1, 2))
    with pytest.raises(PlanError, match="the plan has 3 ranks, but torchrun started 4 processes"):
        launch.check_layout(plan, _torchrun(0, 4, 0, 2, 0, 2))
    with pytest.raises(PlanError, match="the plan runs on 2 hosts \\(2 \\+ 1 ranks\\), but torchrun has 3 nodes"):
        launch.check_layout(plan, _torchrun(0, 3, 0, 1, 0, 3))
    with pytest.raises(PlanError, match="rank 2 \\(torchrun node 1, local rank 1\\) of a node with 2 processes"):
        launch.check_layout(plan, _torchrun(2, 3, 1, 2, 1, 2))
    # a plan without hosts takes any layout of the right size
    launch.check_layout(load_plan(plans[1], device="cpu"), _torchrun(0, 1, 0, 1, 0, 1))


def test_gpu_ranks_map_to_their_hosts_devices(plans: dict[int, Path]) -> None:
    plan = dataclasses.replace(load_plan(plans[3], device="cpu"), device="cuda")
    assert [plan.torch_device(r) for r in range(3)] == [torch.device(f"cuda:{i}") for i in (0, 1, 0)]
    # `mstar-run` starts one host's ranks: a GPU plan over two hosts needs torchrun
    with pytest.raises(PlanError, match="the plan runs on 2 hosts; start it on each of them with torchrun"):
        start_workers(plan, "dummy", "cuda")
