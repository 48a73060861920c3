"""Lazy node outputs and the interpreter's lanes (runtime/mstar_runtime/ops/readback.py, runtime/mstar_runtime/control/interpreter.py).

The test family's LM returns `code` and `done` as `readback.Lazy` values, as Orpheus' backbone
does on the GPU. These tests pin what the lanes promise: a lazy output is resolved only once
the request's next step has been issued (so a GPU never idles while the host waits for it),
effects keep their order, and the outputs equal those of plain (eager) values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_models.testfamily import lm as tinylm
from mstar_runtime.control.conductor import FINISHED, Conductor
from mstar_runtime.control.interpreter import Frame, concat, read_flag
from mstar_runtime.ops import readback
from mstar_runtime.ops.readback import Lazy, Readback, resolve, upload
from mstar_runtime.plan.loader import load_plan, without_cohorts
from mstar_runtime.worker.worker import Worker

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("generate", {"prompt": "hello world", "max_new": 12}),
    ("generate_fixed", {"prompt": "fixed chunks", "max_new": 11}),
    ("generate_left", {"prompt": "left context", "max_new": 17}),
    ("chat", {"prompt": "hi there", "max_new": 6}),
    ("generate", {"prompt": "a", "max_new": 3}),
]


def _run(testfamily_plan: Path, requests: list[tuple[str, dict[str, Any]]], *, unmarked: bool = False) -> list[Any]:
    """The requests on a fresh conductor; `unmarked`: on the plan without its cohort marks
    (`without_cohorts`), so that every loop's LM steps go through the interpreter's lanes."""
    plan = load_plan(testfamily_plan, device="cpu")
    plan = without_cohorts(plan) if unmarked else plan
    conductor = Conductor(plan, {0: Worker(plan, 0, "cpu", "dummy")})
    handles = [conductor.submit(w, dict(i)) for w, i in requests]
    conductor.run_until_idle()
    assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
    return handles


def test_lazy_outputs_resolve_only_after_the_next_step_was_issued(
    testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every lazy value made by LM step n of a request is resolved after that request's step n+1
    was issued, except the last one of each loop (flushed when the loop ends). On the plan
    without its cohort marks: every LM loop of these walks is a cohort otherwise, whose
    outputs come back one step late by construction (tests/test_cohort.py)."""
    issued: dict[str, int] = {}  # request id -> LM steps issued so far
    births: list[tuple[str, int, Lazy]] = []
    resolved_at: dict[int, int] = {}
    real_run = Worker.run_step

    def run_step(self: Worker, batch: Any) -> Any:
        out = real_run(self, batch)
        if batch.node == "lm":
            for entry, o in zip(batch.entries, out):
                issued[entry.request_id] = issued.get(entry.request_id, 0) + 1
                births.extend((entry.request_id, issued[entry.request_id], v)
                              for v in o.values() if isinstance(v, Lazy))
        return out

    real_get = Lazy.get

    def get(self: Lazy) -> Any:
        for rid, _, v in births:
            if v is self and id(self) not in resolved_at:
                resolved_at[id(self)] = issued[rid]
        return real_get(self)

    monkeypatch.setattr(Worker, "run_step", run_step)
    monkeypatch.setattr(Lazy, "get", get)
    handles = _run(testfamily_plan, REQUESTS, unmarked=True)
    assert births and len(resolved_at) > len(births) // 2
    early = [(rid, n) for rid, n, v in births if resolved_at.get(id(v), n + 1) <= n]
    # one loop per walk here (chat hands off to `continue`: two walks), so at most two early ones each
    per_request = {h.id: sum(1 for rid, _ in early if rid == h.id) for h in handles}
    assert all(n <= 2 for n in per_request.values()), per_request
    assert len(early) < len(births) // 4


@pytest.mark.parametrize("unmarked", [False, True], ids=["cohorts", "unmarked"])
def test_lazy_and_plain_outputs_give_the_same_results(testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch,
                                                      unmarked: bool) -> None:
    """As compiled (every decode loop here is a cohort: the lanes carry the prefills) and
    without cohort marks (every LM step goes through them)."""
    lazy = _run(testfamily_plan, REQUESTS, unmarked=unmarked)
    # the same LM, resolving its outputs at once: the interpreter's plain path
    real = tinylm.TinyLM._next_tokens

    def eager(self: Any, last: torch.Tensor, attn: Any) -> Any:
        return [{k: resolve(v) for k, v in o.items()} for o in real(self, last, attn)]

    monkeypatch.setattr(tinylm.TinyLM, "_next_tokens", eager)
    plain = _run(testfamily_plan, REQUESTS, unmarked=unmarked)
    for a, b in zip(lazy, plain):
        assert a.outputs.keys() == b.outputs.keys()
        for k in a.outputs:
            x, y = a.outputs[k], b.outputs[k]
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), k
            else:
                assert x == y, k


def test_effects_keep_their_order_on_a_busy_lane() -> None:
    """A plain effect queued behind a lazy one runs after it, not before."""
    seen: list[str] = []
    frame = Frame(request=None)  # type: ignore[arg-type]
    frame.effect_on_lane(lambda: seen.append("lazy"), lazy=True)
    frame.effect_on_lane(lambda: seen.append("plain"), lazy=False)
    assert seen == []
    frame.flush_lane()
    assert seen == ["lazy", "plain"]
    frame.effect_on_lane(lambda: seen.append("now"), lazy=False)  # an empty lane: at once
    assert seen == ["lazy", "plain", "now"]


def test_lazy_values_resolve_once_and_everywhere() -> None:
    calls: list[int] = []

    def make() -> torch.Tensor:
        calls.append(1)
        return torch.tensor([3, 4])

    value = Lazy(make)
    assert "pending" in repr(value)
    assert torch.equal(resolve(value), torch.tensor([3, 4])) and torch.equal(value.get(), torch.tensor([3, 4]))
    assert calls == [1]
    assert read_flag(Lazy(lambda: True)) is True and read_flag(Lazy(lambda: torch.tensor([False]))) is False
    with pytest.raises(TypeError, match="resolve"):
        bool(Lazy(lambda: False))  # never silently truthy
    assert torch.equal(concat([Lazy(lambda: torch.tensor([1])), torch.tensor([2]), Lazy(lambda: torch.tensor([], dtype=torch.long))]),
                       torch.tensor([1, 2]))


def test_readback_and_upload_on_the_cpu() -> None:
    back = Readback(torch.tensor([[1, 2], [3, 4]]))
    assert back.ready and back.values() == [[1, 2], [3, 4]]
    t = upload([1.5, 2.5], torch.float32, "cpu")
    assert t.dtype == torch.float32 and t.tolist() == [1.5, 2.5]
    assert readback.upload_tensor(torch.ones(2), "cpu").device.type == "cpu"
