"""Plans over 2 and 3 ranks: worker processes (Gloo on the CPU) give exactly the outputs of
one rank, a remote node's errors fail only their requests, and a worker or conductor that
dies ends the run cleanly, leaving no process behind.

The placements put the test family's nodes on different ranks (tests/placements/cpu2.yaml:
the LM on rank 1; cpu3.yaml: prompt and codec on 1, flow on 2), so token ids, hidden states,
latents, stream items, KV forks and the chat -> continue hand-off all cross processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_runtime.control.conductor import FAILED, FINISHED, Conductor
from mstar_runtime.engine.cohort_engine import JoinRow
from mstar_runtime.engine.engines import StepEntry
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.remote import EngineStopped, RemoteWorker, WorkerLost
from mstar_runtime.worker.startup import shutdown_workers, start_workers
from mstar_runtime.worker.wire import pack_values, read_frame, unpack_values, write_frame
from mstar_runtime.worker.worker import StepBatch, Worker
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
PLACEMENTS = {
    1: ROOT / "placements/cpu.yaml",
    2: ROOT / "tests/placements/cpu2.yaml",
    3: ROOT / "tests/placements/cpu3.yaml",
}

# Every walk, run concurrently (the chat turn hands off to `continue` in the same request).
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("generate", {"prompt": "hello world", "max_new": 12}),
    ("generate_fixed", {"prompt": "fixed chunks", "max_new": 11}),
    ("generate_left", {"prompt": "left context, a longer prompt than the inline limit", "max_new": 17}),
    ("flow", {"prompt": "a cat", "negative": "blur", "steps": 3, "scale": 2.5, "seed": 7}),
    ("chat", {"prompt": "hi there", "max_new": 6}),
    ("generate", {"prompt": "a", "max_new": 3}),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("plans")
    paths = {}
    for world, placement in PLACEMENTS.items():
        paths[world] = out / f"tf{world}.plan"
        assert (
            mstarc(
                [
                    "compile",
                    str(ROOT / "models/testfamily/testfamily.walk"),
                    "--variant",
                    "tiny",
                    "-p",
                    str(placement),
                    "-o",
                    str(paths[world]),
                ]
            )
            == 0
        )
    return paths


@pytest.fixture(scope="module")
def reference(plans: dict[int, Path]) -> dict[int | None, list[dict[str, Any]]]:
    """One rank's outputs of REQUESTS, as they run (None) and with a preemption every 7 steps
    (preemption changes who is batched with whom, so the float bits are compared like for
    like). A marked loop runs as a cohort wherever its node is (in a worker process its
    cohort calls are messages), so every plan compares with one rank's cohort run."""
    plan = load_plan(plans[1], device="cpu")
    worker = Worker(plan, 0, "cpu", "dummy")
    out: dict[int | None, list[dict[str, Any]]] = {}
    for every in (None, 7):
        handles = _run(Conductor(plan, {0: worker}, preempt_every=every), REQUESTS)
        assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
        out[every] = [h.outputs for h in handles]
    return out


def _one_rank(plans: dict[int, Path], requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The same requests on one rank, in-process: the exact outputs to expect."""
    plan = load_plan(plans[1], device="cpu")
    return _run(Conductor(plan, {0: Worker(plan, 0, "cpu", "dummy")}), requests)


def _run(conductor: Conductor, requests: list[tuple[str, dict[str, Any]]], on_step: Any = None) -> list[Any]:
    handles = [conductor.submit(w, dict(i)) for w, i in requests]
    conductor.run_until_idle(on_step)
    return handles


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b), (set(a), set(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert type(a[k]) is type(b[k]) and a[k] == b[k], k


def _children() -> list[int]:
    """Processes whose parent is this one (zombies too: a child nobody waited for is a leak)."""
    try:
        import psutil  # type: ignore[import-untyped]

        return [p.pid for p in psutil.Process().children()]
    except ImportError:
        pass
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.append(int(entry))
    return out


def _gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@contextmanager
def _engine(path: Path, **kw: Any) -> Iterator[tuple[Conductor, dict[int, Any]]]:
    plan = load_plan(path, device="cpu")
    workers = start_workers(plan, "dummy", "cpu", **kw)
    try:
        yield Conductor(plan, workers), workers
    finally:
        shutdown_workers(workers)
    assert _children() == []


# ------------------------------------------------------------------------ equal outputs
@pytest.mark.parametrize("world,inline_bytes", [(2, 0), (3, 64)], ids=["2ranks-all-over-gloo", "3ranks"])
def test_outputs_equal_one_rank(
    plans: dict[int, Path], reference: dict[int | None, list[dict[str, Any]]], world: int,
    inline_bytes: int,
) -> None:
    with _engine(plans[world], inline_bytes=inline_bytes) as (conductor, workers):
        assert sorted(workers) == list(range(world))
        assert all(isinstance(workers[r], RemoteWorker) for r in range(1, world))
        # overlap=False: the steps of one rank in its order, so the same batches and float bits
        # (with overlap, work on rank 0 moves ahead of remote steps; tests/test_split.py)
        handles = _run(Conductor(conductor.plan, workers, overlap=False), REQUESTS)
        for h, ref in zip(handles, reference[None]):
            assert h.state == FINISHED, h.error
            _same(ref, h.outputs)
        assert handles[4].walks_done == ["chat", "continue"]
        # Preempted and recomputed requests (their remote KV states freed) still agree.
        again = _run(Conductor(conductor.plan, workers, preempt_every=7, overlap=False), REQUESTS)
        for h, ref in zip(again, reference[7]):
            assert h.state == FINISHED, h.error
            _same(ref, h.outputs)
        assert sum(h.stats.preemptions for h in again) > 0
        for r in range(1, world):
            assert workers[r].heartbeat() < 5.0


# ----------------------------------------------------------------------- remote errors
class _Corrupt:
    """Rank 1's proxy, but a chosen request's decode token is out of the vocabulary (a generic
    step's input, or the fed token its cohort row joins with): the LM's embedding raises an
    IndexError inside the worker process (not a RequestError)."""

    def __init__(self, inner: RemoteWorker, request_id: str):
        self.inner, self.request_id = inner, request_id

    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]:
        if batch.node == "lm" and batch.phase == "decode":
            for e in batch.entries:
                if e.request_id == self.request_id:
                    e.inputs["token"] = torch.tensor([10**6], dtype=torch.int32)
        return self.inner.run_step(batch)

    def cohort_join(self, key: Any, first: int, rows: list[JoinRow], *args: Any) -> None:
        rows = [dataclasses.replace(r, fed={**r.fed, "token": torch.tensor([10**6], dtype=torch.int32)})
                if r.request_id == self.request_id and "token" in r.fed else r for r in rows]
        self.inner.cohort_join(key, first, rows, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_remote_errors_fail_only_their_requests(plans: dict[int, Path]) -> None:
    with _engine(plans[2]) as (conductor, workers):
        plan = conductor.plan
        bad = Conductor(plan, {0: workers[0], 1: _Corrupt(workers[1], "req-0")})
        requests = [("generate", {"prompt": "boom", "max_new": 5}), REQUESTS[3]]
        handles = _run(bad, requests)
        assert handles[0].state == FAILED
        err = handles[0].error
        assert "node 'lm' phase 'decode': on rank 1: IndexError" in err, err
        assert "worker traceback:" in err and "Traceback (most recent call last)" in err, err
        assert handles[1].state == FINISHED, handles[1].error  # flow never decodes: unaffected
        _same(_one_rank(plans, requests)[1].outputs, handles[1].outputs)
        assert bad.broken is None and workers[1].alive()
        # A node's RequestError on rank 1 (a context over max_context) fails that request only,
        # though it shared its prefill batch with a good one.
        requests = [("generate", {"prompt": "x" * 200, "max_new": 4}), REQUESTS[0]]
        handles = _run(conductor, requests)
        assert handles[0].state == FAILED and handles[0].error_field == "tokens", handles[0].error
        assert "exceeds max_context" in handles[0].error
        assert handles[1].state == FINISHED, handles[1].error
        _same(_one_rank(plans, requests)[1].outputs, handles[1].outputs)
        # A value that cannot cross ranks fails its batch here, before anything is sent.
        with pytest.raises(Exception, match="cannot cross ranks"):
            workers[1].run_step(StepBatch("lm", "decode", [StepEntry("r", "main", {"token": [1]})]))
        assert workers[1].heartbeat() < 5.0
        # A frame that is not an allowlisted message is fatal to the worker, and says why.
        workers[1]._in.write(b"\x00\x00\x00\x05hello")
        workers[1]._in.flush()
        with pytest.raises(WorkerLost, match=r"worker rank 1 lost: .*corrupt message"):
            workers[1].heartbeat()
        assert workers[1].proc.returncode == 1
        (h,) = _run(conductor, [REQUESTS[0]])
        assert h.state == FAILED and "corrupt message" in h.error and conductor.broken is not None


class _CorruptJoin:
    """Rank 1's proxy, but a chosen request joins its cohort with an out-of-vocabulary fed
    token: the LM's embedding raises an IndexError inside the worker process's cohort step."""

    def __init__(self, inner: RemoteWorker, request_id: str):
        self.inner, self.request_id = inner, request_id

    def cohort_join(self, key: Any, first: int, rows: list[JoinRow], *rest: Any) -> None:
        rows = [dataclasses.replace(r, fed={k: torch.full_like(torch.as_tensor(v), 10**6) for k, v in r.fed.items()})
                if r.request_id == self.request_id else r for r in rows]
        self.inner.cohort_join(key, first, rows, *rest)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_cohort_step_that_fails_in_a_worker_process_fails_its_rows_and_the_worker_serves_on(
    plans: dict[int, Path],
) -> None:
    with _engine(plans[2]) as (conductor, workers):
        plan = conductor.plan
        bad = Conductor(plan, {0: workers[0], 1: _CorruptJoin(workers[1], "req-0")})
        handles = _run(bad, [("generate_fixed", {"prompt": "boom", "max_new": 20})])
        assert handles[0].state == FAILED
        err = handles[0].error
        assert "on rank 1: IndexError" in err and "worker traceback:" in err, err
        assert bad.broken is None and workers[1].alive() and bad.stats["cohort_steps"] > 0
        # the worker serves on: the next cohort on it (a later conductor reuses its columns) runs
        requests = [("generate_fixed", {"prompt": "after", "max_new": 9})]
        (h,) = _run(Conductor(plan, workers, overlap=False), requests)
        assert h.state == FINISHED, h.error
        _same(_one_rank(plans, requests)[0].outputs, h.outputs)


# ------------------------------------------------------------------------- dying workers
def test_killing_a_worker_ends_the_run(plans: dict[int, Path]) -> None:
    with _engine(plans[3]) as (conductor, workers):
        victim = workers[2].pid
        steps = 0

        def on_step() -> None:
            nonlocal steps
            steps += 1
            if steps == 6:
                os.kill(victim, signal.SIGKILL)

        t0 = time.monotonic()
        handles = _run(conductor, REQUESTS, on_step)
        assert time.monotonic() - t0 < 30
        # a request that completed before the kill keeps its result; every other one fails
        failed = [h for h in handles if h.state != FINISHED]
        assert failed and all(h.state == FAILED for h in failed), [h.state for h in handles]
        for h in failed:
            assert "worker rank 2 lost" in h.error and "SIGKILL" in h.error and str(victim) in h.error, (
                h.error
            )
        assert conductor.broken is not None and "worker rank 2 lost" in conductor.broken
        with pytest.raises(EngineStopped, match="the engine stopped: worker rank 2 lost"):
            conductor.submit("generate", {"prompt": "after"})
        assert not conductor.step()
        # A worker that hangs (stopped) is lost once the answer is overdue, and killed. First
        # take the answer of a step rank 1 may still have in flight (the run stopped without
        # it): stopped between its answer and its output tensors, it would leave this side in
        # torch.distributed's 300 s receive instead of the heartbeat's 1 s.
        workers[1].heartbeat(timeout=10.0)
        os.kill(workers[1].pid, signal.SIGSTOP)
        with pytest.raises(WorkerLost, match=r"worker rank 1 lost: .*did not answer within 1 s.*killed here"):
            workers[1].heartbeat(timeout=1.0)
        assert workers[1].proc.returncode == -signal.SIGKILL
    assert _gone(victim)


def test_a_worker_killed_mid_cohort_fails_its_rows_and_stops_the_run(plans: dict[int, Path]) -> None:
    """cpu2 puts the LM on rank 1: its marked loops are a cohort in that worker process. Killed
    while the cohort has rows, the run stops with WorkerLost (every request fails naming it),
    as a generic step on a dead worker does, and nothing hangs."""
    requests = [("generate_fixed", {"prompt": f"row {i}", "max_new": 40}) for i in range(3)]
    with _engine(plans[2]) as (conductor, workers):
        victim = workers[1].pid
        rows_at_kill: list[int] = []

        def on_step() -> None:
            if not rows_at_kill and conductor.stats["cohort_steps"] >= 4:
                rows_at_kill.append(sum(c.n for c in conductor.cohorts.values()))
                os.kill(victim, signal.SIGKILL)

        t0 = time.monotonic()
        handles = _run(conductor, requests, on_step)
        assert time.monotonic() - t0 < 30
        assert rows_at_kill and rows_at_kill[0] > 0  # killed mid-cohort
        assert all(h.state == FAILED for h in handles), [h.state for h in handles]
        for h in handles:
            assert "worker rank 1 lost" in h.error and "SIGKILL" in h.error, h.error
        assert conductor.broken is not None and "worker rank 1 lost" in conductor.broken
        assert all(c.n == 0 for c in conductor.cohorts.values())
        with pytest.raises(EngineStopped):
            conductor.submit("generate_fixed", {"prompt": "after"})
    assert _gone(victim)


_CONDUCTOR = textwrap.dedent("""
    import json, sys, time
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.startup import start_workers
    workers = start_workers(load_plan(sys.argv[1], device="cpu"), "dummy", "cpu")
    print(json.dumps([w.pid for r, w in workers.items() if r > 0]), flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("world", [2])
def test_workers_die_with_their_conductor(plans: dict[int, Path], world: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-c", _CONDUCTOR, str(plans[world])], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert parent.stdout is not None
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == world - 1 and not any(_gone(p) for p in pids)
    finally:
        parent.kill()  # SIGKILL: no atexit, no goodbye; the workers must notice on their own
        parent.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


# --------------------------------------------------------------------- the wire, in-process
def test_values_and_frames_round_trip(tmp_path: Path) -> None:
    values = {
        "ids": torch.arange(4, dtype=torch.int32),
        "h": torch.randn(3, 5).t(),
        "empty": torch.zeros(0, 2),
        "flag": torch.tensor(True),
        "n": 3,
        "x": 0.5,
        "final": False,
        "text": "é",
        "none": None,
    }
    metas, inline, scalars, tensors = pack_values(values, 16, "input")
    assert [mt.name for mt in metas] == ["h"] and set(inline) == {"ids", "empty", "flag"}
    assert scalars == {"n": 3, "x": 0.5, "final": False, "text": "é", "none": None}
    msg = m.StepRequest(1, "n", "p", [m.StepEntry("r", None, metas, inline, scalars)])
    path = tmp_path / "frames"
    with open(path, "wb") as f:
        write_frame(f, msg)
        write_frame(f, m.Heartbeat(0, 9))
    with open(path, "rb") as f:
        back = read_frame(f)
        assert isinstance(read_frame(f), m.Heartbeat) and read_frame(f) is None
    assert isinstance(back, m.StepRequest)
    e = back.entries[0]
    got = unpack_values(e.inputs, [t.contiguous() for t in tensors], e.inline, e.scalars, torch.device("cpu"))
    assert set(got) == set(values)
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert type(got[k]) is type(v) and got[k] == v, k
    with pytest.raises(TypeError, match="'bad' is a list, which cannot cross ranks"):
        pack_values({"bad": [1, 2]}, 16, "input")
    with pytest.raises(ValueError, match="cannot travel"):
        pack_values({"c": torch.zeros(2, dtype=torch.complex64)}, 16, "input")
