"""The conductor end to end on the test family: outputs equal the dense eager reference,
alone, batched, preempted (forced and by a tiny pool), and every walk primitive behaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_models.testfamily import reference as ref
from mstar_models.testfamily.family import Family
from mstar_runtime.control.conductor import FAILED, FINISHED, Conductor
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker.worker import Worker

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("generate", {"prompt": "hello world", "max_new": 12}),
    ("generate", {"prompt": "a", "max_new": 3}),
    ("generate_fixed", {"prompt": "fixed chunks", "max_new": 11}),
    ("generate_left", {"prompt": "left context", "max_new": 17}),
    ("flow", {"prompt": "a cat", "negative": "blur", "steps": 3, "scale": 2.5, "seed": 7}),
    ("flow", {"prompt": "a dog"}),
    ("chat", {"prompt": "hi there", "max_new": 6}),
    ("generate", {"prompt": "the same prompt twice", "max_new": 9}),
    ("generate", {"prompt": "the same prompt twice", "max_new": 9}),
    ("generate_fixed", {"prompt": "xyz", "max_new": 1}),
]


def _engine(testfamily_plan: Path, **kw: Any) -> tuple[Conductor, Worker]:
    cap = kw.pop("kv_pages_cap", None)
    plan = load_plan(testfamily_plan, device="cpu", kv_pages_cap=cap)
    worker = Worker(plan, 0, "cpu", "dummy")
    return Conductor(plan, {0: worker}, **kw), worker


def _family(worker: Worker) -> Family:
    return Family.from_nodes({name: eng.node for name, eng in worker.engines.items()})


def _run(conductor: Conductor, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    handles = [conductor.submit(w, dict(i)) for w, i in requests]
    conductor.run_until_idle()
    return handles


def _same(a: dict[str, Any], b: dict[str, Any], exact: bool = True) -> None:
    assert set(a) == set(b), (set(a), set(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            y = torch.as_tensor(y)
            assert x.shape == y.shape, (k, x.shape, y.shape)
            if exact or not x.is_floating_point():
                assert torch.equal(x, y.to(x.dtype)), k
            else:
                torch.testing.assert_close(x, y.to(x.dtype), rtol=1e-5, atol=1e-5, msg=k)
        else:
            assert x == y, (k, x, y)


def test_every_walk_equals_the_dense_reference(testfamily_plan: Path) -> None:
    conductor, worker = _engine(testfamily_plan)
    family = _family(worker)
    for walk, inputs in REQUESTS:
        (h,) = _run(conductor, [(walk, inputs)])
        assert h.state == FINISHED, h.error
        expected = ref.run_request(family, walk, inputs)
        assert h.walks_done == [w for w, _ in expected]
        final: dict[str, Any] = {}
        for _, outs in expected:
            final.update(outs)
        _same(h.outputs, final, exact=False)


def test_continuous_batching_equals_each_request_alone(testfamily_plan: Path) -> None:
    conductor, _ = _engine(testfamily_plan)
    alone = [_run(conductor, [r])[0].outputs for r in REQUESTS]
    batched = _run(conductor, REQUESTS)
    assert conductor.stats["batched_entries"] > conductor.stats["steps"]  # steps really were shared
    for h, want in zip(batched, alone):
        assert h.state == FINISHED, h.error
        _same(h.outputs, want, exact=False)  # tokens exact; floats to rounding (batching reorders sums)


@pytest.mark.parametrize("every", [1, 3, 7])
def test_forced_preemption_gives_identical_outputs(testfamily_plan: Path, every: int) -> None:
    conductor, _ = _engine(testfamily_plan)
    alone = [_run(conductor, [r])[0].outputs for r in REQUESTS]
    forced, _ = _engine(testfamily_plan, preempt_every=every)
    handles = _run(forced, REQUESTS)
    assert forced.stats["preemptions"] > 0
    for h, want in zip(handles, alone):
        assert h.state == FINISHED, h.error
        _same(h.outputs, want, exact=False)  # tokens exact; floats to rounding (batching reorders sums)


def test_a_small_pool_preempts_the_newest_and_loses_nothing(testfamily_plan: Path) -> None:
    conductor, _ = _engine(testfamily_plan)
    alone = [_run(conductor, [r])[0].outputs for r in REQUESTS]
    small, _ = _engine(testfamily_plan, kv_pages_cap=10)
    handles = _run(small, REQUESTS)
    assert small.stats["preemptions"] > 0
    for h, want in zip(handles, alone):
        assert h.state == FINISHED, h.error
        _same(h.outputs, want, exact=False)  # tokens exact; floats to rounding (batching reorders sums)
    assert small.kv.used_pages() == 0  # every page came back


def test_a_request_that_can_never_fit_is_refused_alone(testfamily_plan: Path) -> None:
    conductor, _ = _engine(testfamily_plan, kv_pages_cap=2)
    big, small = _run(conductor, [("generate", {"prompt": "x" * 200, "max_new": 4}),
                                  ("generate", {"prompt": "ok", "max_new": 4})])
    assert big.state == FAILED and "can never fit" in big.error
    assert small.state == FINISHED


def test_dynamic_loops_stop_each_request_at_its_own_step(testfamily_plan: Path) -> None:
    conductor, _ = _engine(testfamily_plan)
    lengths = [1, 2, 5, 9, 13]
    handles = _run(conductor, [("generate", {"prompt": "same", "max_new": n}) for n in lengths])
    for h, n in zip(handles, lengths):
        assert h.state == FINISHED
        assert 1 <= h.outputs["tokens"].shape[0] <= n
        assert h.stats.wasted_steps <= 1  # speculation wastes at most one step per request
    assert conductor.stats["wasted_steps"] >= 1


def test_streamed_chunks_arrive_while_decoding_in_policy_order(testfamily_plan: Path) -> None:
    conductor, worker = _engine(testfamily_plan)
    seen: list[tuple[int, str, int]] = []

    class Listener:
        def on_output(self, request, name, value) -> None:
            seen.append((conductor.stats["steps"], name, int(value.shape[0])))

        def on_finish(self, request) -> None:
            seen.append((conductor.stats["steps"], "<end>", 0))

    h = conductor.submit("generate_left", {"prompt": "stream me", "max_new": 20}, listener=Listener())
    conductor.run_until_idle()
    audio_steps = [s for s, name, _ in seen if name == "audio"]
    assert len(audio_steps) >= 2 and audio_steps[0] < seen[-1][0]  # the first chunk came before the end
    family = _family(worker)
    codes = ref.run_request(family, "generate_left", {"prompt": "stream me", "max_new": 20})
    assert h.outputs["audio"].shape == codes[0][1]["audio"].shape


def test_finished_and_cancelled_requests_free_their_pages(testfamily_plan: Path) -> None:
    conductor, _ = _engine(testfamily_plan)
    a = conductor.submit("generate", {"prompt": "one", "max_new": 40})
    b = conductor.submit("generate", {"prompt": "two", "max_new": 40})
    for _ in range(6):
        conductor.step()
    assert conductor.kv.used_pages() > 0
    assert conductor.cancel(b.id)
    assert b.finish_reason == "cancelled"
    conductor.run_until_idle()
    assert a.state == FINISHED and conductor.kv.used_pages() == 0


def test_a_loop_count_out_of_range_fails_the_request_naming_its_input(testfamily_plan: Path) -> None:
    conductor, _ = _engine(testfamily_plan)
    bad, good = _run(conductor, [("flow", {"prompt": "x", "steps": 10_000}), ("flow", {"prompt": "y", "steps": 2})])
    assert bad.state == FAILED and bad.error_field == "steps" and "outside 0.." in bad.error
    assert good.state == FINISHED
