"""TPDispatch (runtime/mstar_runtime/worker/tp_dispatch.py) with stand-in workers: who answers, what travels as a
reference, when a member's failure is found, and what is forgotten. The real thing over two
Gloo processes is tests/test_tp.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_runtime.engine.engines import StepEntry
from mstar_runtime.ops.node import RequestError
from mstar_runtime.worker.remote import WorkerLost
from mstar_runtime.worker.tp_dispatch import TPDispatch
from mstar_runtime.worker.worker import StepBatch, WorkerStepError


class Leader:
    """Rank 0's in-process worker: a decode that returns token + 1 as a fresh tensor."""

    def __init__(self, fail: Exception | None = None):
        self.fail = fail

    def run_step(self, batch: StepBatch) -> list[dict[str, Any]]:
        if self.fail is not None:
            raise self.fail
        return [{"token": e.inputs["token"] + 1, "done": False} for e in batch.entries]


class Handle:
    def __init__(self, batch: StepBatch, error: Exception | None):
        self.batch, self.error, self.taken = batch, error, False
        self.elapsed_s, self.waited_s = 0.002, 0.001

    def ready(self) -> bool:
        self.taken = True
        return True

    def result(self) -> list[dict[str, Any]]:
        self.taken = True
        if self.error is not None:
            raise self.error
        return [{} for _ in self.batch.entries]


class Member:
    """A worker process's proxy: records what `submit` was asked."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_next: Exception | None = None

    def submit(self, batch: StepBatch, *, refs: Any, replicated: bool, send_outputs: bool) -> Handle:
        self.calls.append({"refs": refs, "replicated": replicated, "send_outputs": send_outputs})
        error, self.fail_next = self.fail_next, None
        return Handle(batch, error)


def _batch(tokens: dict[str, torch.Tensor]) -> StepBatch:
    return StepBatch("llm", "decode", [StepEntry(rid, "main", {"token": t}, None) for rid, t in tokens.items()])


def test_the_members_acknowledge_and_a_fed_back_output_is_a_reference() -> None:
    member = Member()
    tp = TPDispatch({0: Leader(), 1: member})
    out = tp.run((0, 1), _batch({"a": torch.tensor([1]), "b": torch.tensor([5])}))
    assert [o["token"].item() for o in out] == [2, 6]
    assert member.calls[0] == {"refs": [{}, {}], "replicated": True, "send_outputs": False}
    # the walk feeds request a's token back; request b's input is a new value
    tp.run((0, 1), _batch({"a": out[0]["token"], "b": torch.tensor([6])}))
    assert member.calls[1]["refs"] == [{"token": "token"}, {}]
    assert tp.refs_sent == 1
    assert tp.member_step_s == pytest.approx(0.002)  # the first step's answer, taken by the second


def test_a_member_that_failed_a_step_stops_the_run_at_the_next_one() -> None:
    member = Member()
    tp = TPDispatch({0: Leader(), 1: member})
    member.fail_next = WorkerStepError("llm", "decode", "on rank 1: CUDA error")
    tp.run((0, 1), _batch({"a": torch.tensor([1])}))  # the leader's outputs: nothing waits for rank 1
    with pytest.raises(WorkerLost) as e:
        tp.run((0, 1), _batch({"a": torch.tensor([2])}))
    assert e.value.rank == 1
    assert "failed a step of llm.decode that the leader of its tensor-parallel group ran" in str(e.value)
    assert "CUDA error" in str(e.value)


def test_a_leader_error_waits_for_the_members_then_is_raised() -> None:
    member = Member()
    tp = TPDispatch({0: Leader(fail=RequestError("token must be a tensor", "token")), 1: member})
    member.fail_next = RequestError("token must be a tensor", "token")
    with pytest.raises(RequestError, match="token must be a tensor"):
        tp.run((0, 1), _batch({"a": torch.tensor([1])}))
    tp.workers[0].fail = None
    tp.run((0, 1), _batch({"a": torch.tensor([1])}))  # the member's refusal was taken: no WorkerLost


def test_poll_takes_answers_and_forget_drops_references() -> None:
    member = Member()
    tp = TPDispatch({0: Leader(), 1: member})
    out = tp.run((0, 1), _batch({"a": torch.tensor([1])}))
    (handle,) = tp._acks[1]
    tp.poll()
    assert handle.taken and not tp._acks[1]
    tp.forget("a")
    tp.run((0, 1), _batch({"a": out[0]["token"]}))
    assert member.calls[-1]["refs"] == [{}]  # the member dropped its copy with the request
    out = tp.run((0, 1), _batch({"a": torch.tensor([3])}))
    tp.forget("a", "llm", "other")  # another context of the request: this one stays
    tp.run((0, 1), _batch({"a": out[0]["token"]}))
    assert member.calls[-1]["refs"] == [{"token": "token"}]
