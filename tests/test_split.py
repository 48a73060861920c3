"""Orpheus split across two ranks, and remote steps that do not block the conductor.

tests/placements/cpu2_split.yaml keeps the backbone (and the prompt builder) on rank 0 with
the conductor and puts the SNAC decoder on rank 1, a worker process (Gloo): every released
window of codes crosses to rank 1 and its PCM comes back. The conductor sends each SNAC step
without waiting (`RemoteWorker.submit`) and runs the backbone's next decode meanwhile.

- Concurrent requests (different texts, voices, seeds, lengths) give exactly the codes and
  audio of one rank: they decode in lockstep, so every window is released at the same step
  for all of them and the batches are the same whatever the timing.
- The test family with remote nodes (cpu2: the LM on rank 1; cpu3: two workers in flight at
  once) overlaps too: tokens exactly those of one rank, floats to rounding (work on rank 0
  moving ahead changes who is batched with whom), also under preemption and a tiny KV pool.
- A remote step that fails while in flight fails only its requests; a request cancelled
  while its step is in flight ends at once; a worker killed while a step is in flight ends
  the run with `WorkerLost`, leaving no process behind.
- The protocol: held messages, a heartbeat or a second submit finishing the step in flight.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import compile_walk
from test_multirank import REQUESTS as TF_REQUESTS
from test_multirank import _children, _gone, _run

from mstar_runtime.api import MStar
from mstar_runtime.control.conductor import CANCELLED, FAILED, FINISHED, Conductor
from mstar_runtime.control.interpreter import StepCall
from mstar_runtime.control.scheduler import Scheduler
from mstar_runtime.engine.cohort_engine import JoinRow
from mstar_runtime.engine.engines import StepEntry
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker import messages as m
from mstar_runtime.worker.remote import EngineStopped, RemoteWorker, StepHandle, WorkerLost
from mstar_runtime.worker.startup import shutdown_workers, start_workers
from mstar_runtime.worker.worker import StepBatch, Worker, WorkerStepError

ROOT = Path(__file__).resolve().parent.parent

# Four requests (the tiny backbone's max_batch): they prefill together and decode in lockstep.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("tts", {"text": "Hello there, this is M star.", "voice": "tara", "max_tokens": 70, "seed": 1}),
    ("tts", {"text": "A second sentence, a little longer than the first.", "voice": "leo",
             "max_tokens": 84, "seed": 7, "temperature": 0.8}),
    ("tts", {"text": "Short.", "voice": "mia", "max_tokens": 42, "seed": 3}),
    ("tts", {"text": "The last one ends in between.", "voice": "zac", "max_tokens": 63, "seed": 12,
             "top_p": 0.9}),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("split")
    orpheus, tf = "models/orpheus/orpheus.walk", "models/testfamily/testfamily.walk"
    return {
        "one": compile_walk(out / "orpheus1.plan", orpheus, "placements/cpu.yaml"),
        "split": compile_walk(out / "orpheus-split.plan", orpheus, "tests/placements/cpu2_split.yaml"),
        "tf1": compile_walk(out / "tf1.plan", tf, "placements/cpu.yaml"),
        "tf2": compile_walk(out / "tf2.plan", tf, "tests/placements/cpu2.yaml"),
        "tf3": compile_walk(out / "tf3.plan", tf, "tests/placements/cpu3.yaml"),
    }


def _one_rank(path: Path, requests: list[tuple[str, dict[str, Any]]], **kw: Any) -> list[Any]:
    cap = kw.pop("kv_pages_cap", None)
    plan = load_plan(path, device="cpu", kv_pages_cap=cap)
    handles = _run(Conductor(plan, {0: Worker(plan, 0, "cpu", "dummy")}, **kw), requests)
    assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
    return handles


@pytest.fixture(scope="module")
def reference(plans: dict[str, Path]) -> list[dict[str, Any]]:
    """REQUESTS on one rank, together: the exact outputs to expect."""
    return [h.outputs for h in _one_rank(plans["one"], REQUESTS)]


@contextmanager
def _workers(path: Path, **kw: Any) -> Iterator[dict[int, Any]]:
    plan = load_plan(path, device="cpu", kv_pages_cap=kw.pop("kv_pages_cap", None))
    workers = start_workers(plan, "dummy", "cpu", **kw)
    try:
        yield workers
    finally:
        shutdown_workers(workers)
    assert _children() == []


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b), (set(a), set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _close(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Tokens and every other integer exactly, floats to rounding."""
    assert set(a) == set(b), (set(a), set(b))
    for k in a:
        if not isinstance(a[k], torch.Tensor):
            assert a[k] == b[k], k
        elif a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


def _windows(n_codes: int) -> int:
    return max(0, (n_codes - 28) // 7 + 1)


# ---------------------------------------------------------------------- the split, exact
def test_split_gives_the_codes_and_audio_of_one_rank(plans: dict[str, Path], reference: list[dict[str, Any]]) -> None:
    with _workers(plans["split"]) as workers:
        assert isinstance(workers[1], RemoteWorker) and workers[1].nodes == ["snac"]
        assert set(workers[0].engines) == {"llm", "prompt"}
        conductor = Conductor(load_plan(plans["split"], device="cpu"), workers)
        handles = _run(conductor, REQUESTS)
        for h, want in zip(handles, reference):
            assert h.state == FINISHED, h.error
            _equal(want, h.outputs)
            assert h.outputs["audio"].numel() == 2048 * _windows(h.outputs["codes"].numel()) > 0
        st = conductor.stats
        # every SNAC step went to rank 1 without waiting, and backbone steps ran meanwhile
        local_steps = workers[0].stats()["steps"]
        assert st["remote_steps"] == st["steps"] - local_steps >= _windows(84), st
        assert st["overlapped_steps"] > 0, st
        assert conductor.idle and not conductor._inflight
        # the synchronous path (every remote step waited for) gives the same bytes
        sync = Conductor(conductor.plan, workers, overlap=False)
        for h, want in zip(_run(sync, REQUESTS), reference):
            assert h.state == FINISHED, h.error
            _equal(want, h.outputs)
        assert sync.stats["remote_steps"] == sync.stats["overlapped_steps"] == 0


def test_split_through_the_api_reports_the_overlap(plans: dict[str, Path]) -> None:
    inputs = dict(REQUESTS[1][1])
    (alone,) = _one_rank(plans["one"], [("tts", inputs)])
    with MStar.load(plans["split"]) as engine:
        h = engine.submit("tts", inputs)
        chunks = [v for name, v in h.stream() if name == "audio"]
        out = h.result()
        stats = engine.stats()
    _equal(alone.outputs, out)
    assert len(chunks) == _windows(out["codes"].numel()) >= 2
    assert stats["remote_steps"] >= len(chunks) and stats["overlapped_steps"] > 0, stats
    assert stats["remote_wait_seconds"] >= 0.0
    assert _children() == []


# ----------------------------------------------------------- the test family, overlapped
@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_remote_steps_give_the_tokens_of_one_rank(plans: dict[str, Path], world: int) -> None:
    expected = {every: _one_rank(plans["tf1"], TF_REQUESTS, preempt_every=every) for every in (None, 7)}
    overlapped = 0
    with _workers(plans[f"tf{world}"]) as workers:
        plan = load_plan(plans[f"tf{world}"], device="cpu")
        for every, want in expected.items():
            conductor = Conductor(plan, workers, preempt_every=every)
            handles = _run(conductor, TF_REQUESTS)
            for h, ref in zip(handles, want):
                assert h.state == FINISHED, h.error
                _close(ref.outputs, h.outputs)
            assert handles[4].walks_done == ["chat", "continue"]
            assert conductor.stats["remote_steps"] > 0 and conductor.kv.used_pages() == 0
            assert conductor.stats["preemptions"] > 0 if every else True
            overlapped += conductor.stats["overlapped_steps"]
    if world == 2:  # the LM's steps on rank 1 are long enough for rank 0's codec and flow steps
        assert overlapped > 0  # (cpu3's remote steps are short: whether they overlap is timing)


def test_a_tiny_pool_preempts_only_after_the_steps_in_flight(plans: dict[str, Path]) -> None:
    """Out of pages with a step in flight: the conductor takes every answer first, then
    preempts (never a request whose step is still running elsewhere). On cpu3 the LM and its
    pool are on rank 0 while codec and flow steps run on ranks 1 and 2."""
    want = _one_rank(plans["tf1"], TF_REQUESTS)
    with _workers(plans["tf3"], kv_pages_cap=6) as workers:
        plan = load_plan(plans["tf3"], device="cpu", kv_pages_cap=6)
        conductor = Conductor(plan, workers)
        handles = _run(conductor, TF_REQUESTS)
        for h, ref in zip(handles, want):
            assert h.state == FINISHED, h.error
            _close(ref.outputs, h.outputs)
        assert conductor.stats["preemptions"] > 0 and conductor.stats["remote_steps"] > 0
        assert conductor.kv.used_pages() == 0


# ---------------------------------------------------------------- failures while in flight
class _Proxy:
    """Rank 1's proxy that still sends without waiting (it has `submit`), changing a step."""

    def __init__(self, inner: RemoteWorker):
        self.inner = inner
        self.submitted = 0

    def change(self, batch: StepBatch) -> None:
        raise NotImplementedError

    def submit(self, batch: StepBatch) -> StepHandle:
        self.change(batch)
        self.submitted += 1
        return self.inner.submit(batch)

    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]:
        return self.submit(batch).result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _BadWindow(_Proxy):
    """A chosen request's SNAC window has a code outside the codebook from its 3rd window on:
    the node rejects it (a RequestError, on rank 1, while the backbone decodes on rank 0)."""

    def __init__(self, inner: RemoteWorker, request_id: str):
        super().__init__(inner)
        self.request_id, self.seen = request_id, 0

    def change(self, batch: StepBatch) -> None:
        for e in batch.entries:
            if e.request_id == self.request_id:
                self.seen += 1
                if self.seen >= 3:
                    e.inputs["codes"] = e.inputs["codes"].clone()
                    e.inputs["codes"][5] = 10**6


class _BadToken(_Proxy):
    """A chosen request's decode token is out of the LM's vocabulary: an IndexError inside the
    worker process (not a RequestError), so the whole remote batch fails."""

    def __init__(self, inner: RemoteWorker, request_id: str):
        super().__init__(inner)
        self.request_id = request_id

    def change(self, batch: StepBatch) -> None:
        if batch.node == "lm" and batch.phase == "decode":
            for e in batch.entries:
                if e.request_id == self.request_id:
                    e.inputs["token"] = torch.tensor([10**6], dtype=torch.int32)

    def cohort_join(self, key: Any, first: int, rows: list[JoinRow], *args: Any) -> None:
        """The same token for a decode that runs as a cohort row: the one it joins with."""
        rows = [dataclasses.replace(r, fed={**r.fed, "token": torch.tensor([10**6], dtype=torch.int32)})
                if r.request_id == self.request_id and "token" in r.fed else r for r in rows]
        self.inner.cohort_join(key, first, rows, *args)


def test_a_remote_step_that_fails_in_flight_fails_only_its_requests(
    plans: dict[str, Path], reference: list[dict[str, Any]]
) -> None:
    with _workers(plans["split"]) as workers:
        plan = load_plan(plans["split"], device="cpu")
        bad = _BadWindow(workers[1], "req-1")
        conductor = Conductor(plan, {0: workers[0], 1: bad})
        handles = _run(conductor, REQUESTS)
        assert handles[1].state == FAILED and handles[1].error_field == "codes", handles[1].error
        assert "codes must lie in [0, 4096)" in handles[1].error
        for i in (0, 2, 3):  # the batch was rerun one by one: only the culprit failed
            assert handles[i].state == FINISHED, handles[i].error
            _close(reference[i], handles[i].outputs)
        assert conductor.broken is None and conductor.stats["overlapped_steps"] > 0
        assert workers[1].heartbeat() < 5.0
    with _workers(plans["tf2"]) as workers:
        plan = load_plan(plans["tf2"], device="cpu")
        conductor = Conductor(plan, {0: workers[0], 1: _BadToken(workers[1], "req-0")})
        requests = [("generate", {"prompt": "boom", "max_new": 5}), TF_REQUESTS[3]]
        handles = _run(conductor, requests)
        assert handles[0].state == FAILED
        assert "node 'lm' phase 'decode': on rank 1: IndexError" in handles[0].error, handles[0].error
        assert handles[1].state == FINISHED, handles[1].error  # flow never decodes: unaffected
        _close(_one_rank(plans["tf1"], requests[1:])[0].outputs, handles[1].outputs)
        assert conductor.broken is None and workers[1].alive()
        assert conductor.kv.used_pages() == 0


def test_a_request_cancelled_while_its_step_is_in_flight_ends_at_once(plans: dict[str, Path]) -> None:
    requests = TF_REQUESTS[:3]
    want = _one_rank(plans["tf1"], requests)
    with _workers(plans["tf2"]) as workers:
        conductor = Conductor(load_plan(plans["tf2"], device="cpu"), workers)
        handles = [conductor.submit(w, dict(i)) for w, i in requests]
        victim = handles[0]
        caught: list[int] = []

        def on_step() -> None:
            if not caught and any(e.request_id == victim.id for f in conductor._inflight.values()
                                  for _, e in f.entries):
                caught.append(int(conductor.stats["steps"]))
                assert conductor.cancel(victim.id)
                assert victim.state == CANCELLED and victim.done  # at once, not at the answer

        conductor.run_until_idle(on_step)
        assert caught, "the victim never had a step in flight"
        for h, ref in zip(handles[1:], want[1:]):
            assert h.state == FINISHED, h.error
            _close(ref.outputs, h.outputs)
        assert conductor.kv.used_pages() == 0 and conductor.idle
        assert workers[1].heartbeat() < 5.0  # the FreeRequest sent after the step was taken


class _KillInFlight(_Proxy):
    """SIGKILL the worker right after its `after`-th step was sent, while it runs."""

    def __init__(self, inner: RemoteWorker, after: int):
        super().__init__(inner)
        self.after = after

    def change(self, batch: StepBatch) -> None:
        pass

    def submit(self, batch: StepBatch) -> StepHandle:
        handle = super().submit(batch)
        if self.submitted == self.after:
            os.kill(self.inner.pid, signal.SIGKILL)
        return handle


def test_a_worker_killed_while_its_step_is_in_flight_ends_the_run(plans: dict[str, Path]) -> None:
    with _workers(plans["split"]) as workers:
        plan = load_plan(plans["split"], device="cpu")
        victim = workers[1].pid
        conductor = Conductor(plan, {0: workers[0], 1: _KillInFlight(workers[1], after=3)})
        t0 = time.monotonic()
        handles = _run(conductor, REQUESTS)
        assert time.monotonic() - t0 < 30
        assert all(h.state == FAILED for h in handles), [h.state for h in handles]
        for h in handles:
            assert "worker rank 1 lost" in h.error and "SIGKILL" in h.error and str(victim) in h.error, h.error
        assert conductor.broken is not None and "worker rank 1 lost" in conductor.broken
        assert conductor.idle and not conductor._inflight
        with pytest.raises(EngineStopped, match="the engine stopped: worker rank 1 lost"):
            conductor.submit("tts", {"text": "after"})
        assert not conductor.step()
    assert _gone(victim)


def _on_gpus(tmp_path: Path, placement: str) -> tuple[list[list[Any]], Conductor]:
    """Orpheus' REQUESTS (dummy weights) on one GPU, then under `placement`: each run's handles,
    all finished, and the second run's conductor."""
    outputs = []
    for name, where in (("one", "placements/h200x1.yaml"), ("other", placement)):
        plan = load_plan(compile_walk(tmp_path / f"{name}.plan", "models/orpheus/orpheus.walk", where), device="cuda",
                         kv_pages_cap=256)
        workers = start_workers(plan, "dummy", "cuda")
        try:
            conductor = Conductor(plan, workers)
            outputs.append(_run(conductor, REQUESTS))
        finally:
            shutdown_workers(workers)
        assert all(h.state == FINISHED for h in outputs[-1]), [h.error for h in outputs[-1]]
    return outputs, conductor


def _same_codes_and_audio(outputs: list[list[Any]]) -> None:
    for a, b in zip(*outputs, strict=True):
        assert a.outputs["codes"].numel() >= 28
        _close({k: v.cpu() for k, v in a.outputs.items()}, {k: v.cpu() for k, v in b.outputs.items()})


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_split_on_two_gpus_gives_the_codes_and_audio_of_one(tmp_path: Path) -> None:
    """placements/h200x2_split.yaml: the windows cross to GPU 1 over NCCL and the PCM comes
    back while the backbone decodes on GPU 0; the codes are those of one GPU, the audio too
    (to rounding: SNAC's kernels on another device)."""
    outputs, conductor = _on_gpus(tmp_path, "placements/h200x2_split.yaml")
    assert conductor.stats["remote_steps"] > 0
    _same_codes_and_audio(outputs)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_cohort_in_a_worker_process_on_a_gpu_gives_the_codes_of_one(tmp_path: Path) -> None:
    """tests/placements/gpu2_llm_rank1.yaml: the backbone's decode loop is a cohort in the
    worker process on GPU 1 (its steps graphed per bucket there, the readback coming back in
    each answer); the codes are those of one GPU, the audio too (to rounding)."""
    outputs, conductor = _on_gpus(tmp_path, "tests/placements/gpu2_llm_rank1.yaml")
    assert conductor.stats["cohort_steps"] > 0
    assert [c.key[2] for c in conductor.cohorts.values()] == [(1,)]
    _same_codes_and_audio(outputs)


# ------------------------------------------------------------------------- the protocol
def test_submit_poll_heartbeat_and_held_messages(plans: dict[str, Path]) -> None:
    codes = [torch.randint(0, 4096, (28,), dtype=torch.int32, generator=torch.Generator().manual_seed(s))
             for s in (1, 2)]
    batch = StepBatch("snac", "decode", [StepEntry(f"r{i}", None, {"codes": c}) for i, c in enumerate(codes)])
    with _workers(plans["split"]) as workers:
        w = workers[1]
        want = w.run_step(batch)
        assert [o["pcm"].shape for o in want] == [(2048,), (2048,)]

        def same(got: list[dict[str, Any]]) -> None:
            assert all(torch.equal(a["pcm"], b["pcm"]) for a, b in zip(want, got))

        h = w.submit(batch)
        assert h.rank == 1 and not h.done
        w._post(m.FreeRequest("nobody"))  # held: written only after the step's answer is in
        assert len(w._held) == 1
        assert w.heartbeat() < 5.0  # finishes the step first (its handle keeps the answer)
        assert h.done and not w._held
        same(h.result())
        h = w.submit(batch)
        deadline = time.monotonic() + 10
        while not h.ready():  # polling never waits for the worker
            assert time.monotonic() < deadline
            time.sleep(0.005)
        same(h.result())
        first, second = w.submit(batch), w.submit(batch)  # one in flight: the first is finished
        assert first.done
        same(first.result())
        same(second.result())
        # a worker hung with a step in flight is found in the heartbeat's time, not the step's
        # (300 s): the case a full CI run once hit, when a SIGSTOP caught a step in flight
        h = w.submit(batch)
        os.kill(w.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match=r"worker rank 1 lost: .*did not answer within 1 s while running "
                                             r"snac\.decode.*killed here"):
            w.heartbeat(timeout=1.0)
        assert time.monotonic() - t0 < 10 and h.done
        with pytest.raises(WorkerLost):
            h.result()


def test_acknowledged_steps_pipeline_keep_outputs_and_answer_in_order(plans: dict[str, Path]) -> None:
    """A TP member's steps (`send_outputs=False`): several in flight at once, answered in
    order without outputs; with `replicated`, the worker keeps its outputs and a later step
    takes an input from them (`refs`); a full step, a post or a heartbeat keep the order."""
    codes = [torch.randint(0, 4096, (28,), dtype=torch.int32, generator=torch.Generator().manual_seed(s))
             for s in (1, 2)]
    batch = StepBatch("snac", "decode", [StepEntry(f"r{i}", "t", {"codes": c}) for i, c in enumerate(codes)])
    with _workers(plans["split"]) as workers:
        w = workers[1]
        want = w.run_step(batch)
        acks = [w.submit(batch, replicated=True, send_outputs=False) for _ in range(3)]
        assert len(w._acks) == 3 and w._inflight is None  # none waited for the one before
        w._post(m.FreeRequest("nobody"))  # no full step in flight: written at once, after the steps
        assert not w._held
        assert acks[2].result() == [{}, {}]  # the older answers are read on the way
        assert all(a.done for a in acks) and not w._acks
        # the worker kept each entry's pcm: a step whose `codes` input names it gets that tensor,
        # and with check_refs the value sent as well must equal it (it does not: rejected)
        w.check_refs = True
        ref = w.submit(batch, refs=[{"codes": "pcm"}] * 2, send_outputs=False)
        with pytest.raises(WorkerStepError, match=r"rank 1's own 'pcm' of request r0 differs from the group "
                                                  r"leader's \(\[2048\] \[.*\.\.\. here, \[28\] \[.*\.\.\. there\)"):
            ref.result()
        w.check_refs = False
        h = w.submit(batch, replicated=True, send_outputs=False)
        full = w.submit(batch)  # a full step first takes the acknowledgements in flight
        assert h.done and not w._acks
        assert all(torch.equal(a["pcm"], b["pcm"]) for a, b in zip(want, full.result()))
        w.submit(batch, send_outputs=False)
        assert w.heartbeat() < 5.0 and not w._acks


def test_the_scheduler_leaves_out_busy_ranks_and_keeps_their_pass_counts() -> None:
    def call(node: str, rank: int, seq: int) -> StepCall:
        return StepCall({"node": node, "phase": "p", "ranks": [rank]}, SimpleNamespace(), None, {},
                        SimpleNamespace(), seq=seq)  # type: ignore[arg-type]

    s = Scheduler(max_batch=8, max_wait=2)
    remote = [call("snac", 1, 0), call("snac", 1, 1)]
    local = [call("llm", 0, 2)]
    assert s.next_group(remote + local, busy={1}) == (("llm", "p", (0,)), local)
    assert s.next_group(remote + local, busy={1})[0][0] == "llm"
    assert s._passed == {}  # waiting for a busy rank is not being passed over
    assert s.next_group(remote, busy={1}) is None
    assert s.next_group(remote + local)[0][0] == "snac"  # free again: the bigger group
    s = Scheduler(max_batch=8, max_wait=1)
    assert s.next_group(remote + local)[0][0] == "snac"  # the llm call is passed over once
    more = [call("snac", 1, 3), call("snac", 1, 4)]
    assert s.next_group(local + more, busy={0}) == (("snac", "p", (1,)), more)
    assert s._passed == {2: 1}  # it waited for its rank meanwhile: its count stands
    assert s.next_group(local + [call("snac", 1, 5), call("snac", 1, 6)])[0][0] == "llm"  # its turn
