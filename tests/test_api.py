"""The Python API (`MStar`, `RequestHandle`) on the test family, CPU, in-process.

The engine is a background thread, so tests that need a request to be caught mid-flight
(cancel, timeout, close) gate the worker's decode steps on an Event instead of racing it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_runtime.api import EngineClosed, MStar, RequestFailed, RequestHandle
from mstar_runtime.control.scheduler import PrefixChunkError
from mstar_runtime.ops.node import RequestError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def m(testfamily_plan: Path) -> Iterator[MStar]:
    with MStar.load(testfamily_plan) as engine:
        yield engine


@pytest.fixture
def fresh(testfamily_plan: Path) -> Iterator[Callable[..., MStar]]:
    """An MStar of a test's own (for tests that break, gate or close it)."""
    made: list[MStar] = []

    def make(**kwargs: Any) -> MStar:
        made.append(MStar.load(testfamily_plan, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def gate_decodes(engine: MStar, wait_s: float = 10.0) -> threading.Event:
    """Hold every lm.decode step (a generic step or a decode cohort's) until the returned Event
    is set (or `wait_s` passes)."""
    gate = threading.Event()
    worker = engine.conductor.workers[0]
    run_step, cohort_step = worker.run_step, worker.cohort_step

    def gated(batch: Any) -> list[dict[str, Any]]:
        if batch.phase == "decode":
            gate.wait(wait_s)
        return run_step(batch)

    def gated_cohort(key: Any, n: int) -> Any:
        if key[1] == "decode":
            gate.wait(wait_s)
        return cohort_step(key, n)

    worker.run_step = gated  # type: ignore[method-assign]
    worker.cohort_step = gated_cohort  # type: ignore[method-assign]
    return gate


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            ok = torch.allclose(x, y, atol=1e-5, rtol=1e-5) if x.is_floating_point() else torch.equal(x, y)
            if not ok:
                return False
        elif x != y:
            return False
    return True


def concat_stream(chunks: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    by_name: dict[str, list[torch.Tensor]] = {}
    for name, value in chunks:
        by_name.setdefault(name, []).append(value)
    return {k: torch.cat(v) for k, v in by_name.items()}


# ----------------------------------------------------------------------------- basics
def test_submit_result(m: MStar) -> None:
    h = m.submit("generate", {"prompt": "hello", "max_new": 6})
    out = h.result(timeout=30)
    assert set(out) == {"tokens", "hidden", "audio"}
    assert out["tokens"].shape == (6,) and out["tokens"].dtype == torch.int32
    assert out["hidden"].shape == (5, 32)
    assert h.state == "finished" and h.done
    assert h.stats["steps"] > 0 and h.stats["ttft_s"] is not None and h.stats["total_s"] >= h.stats["ttft_s"]
    # defaults filled in; generate() is submit + result
    assert same(m.generate("generate", prompt="hello", max_new=6), out)


def test_outputs_match_a_direct_conductor_run(m: MStar, testfamily_plan: Path) -> None:
    from mstar_runtime.control.conductor import Conductor
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    plan = load_plan(testfamily_plan, device="cpu")
    c = Conductor(plan, {0: Worker(plan, 0, "cpu", "dummy")})
    for walk, inputs in [("generate_left", {"prompt": "abc", "max_new": 9}), ("flow", {"prompt": "cat"})]:
        r = c.submit(walk, inputs)
        c.run_until_idle()
        assert r.state == "finished"
        assert same(m.submit(walk, inputs).result(timeout=30), r.outputs)


def test_stream_yields_chunks_in_order_and_they_concatenate_to_the_output(m: MStar) -> None:
    h = m.submit("generate", {"prompt": "stream me", "max_new": 14})
    chunks = list(h.stream())
    out = h.result()
    names = [n for n, _ in chunks]
    # the decode loop is a cohort: its tokens come in flushes of up to 8 steps (and the prefill's alone)
    assert 2 <= names.count("tokens") <= 14 and names.count("audio") >= 2
    joined = concat_stream(chunks)
    assert torch.equal(joined["tokens"], out["tokens"])
    assert torch.equal(joined["audio"], out["audio"])
    # a second iteration, after the end, replays the same chunks
    assert [n for n, _ in h.stream()] == names


def test_stream_survives_preemption_without_duplicates(fresh: Callable[..., MStar]) -> None:
    engine = fresh(preempt_every=3)
    hs = [engine.submit("generate", {"prompt": f"p{i}", "max_new": 10}) for i in range(3)]
    for h in hs:
        chunks = list(h.stream())
        out = h.result()
        assert torch.equal(concat_stream(chunks)["tokens"], out["tokens"])
        assert len(out["tokens"]) == 10
    assert engine.stats()["preemptions"] > 0


def test_async_result_and_stream(m: MStar) -> None:
    async def main() -> tuple[dict[str, Any], list[tuple[str, Any]], dict[str, Any], list[dict[str, Any]]]:
        h = m.submit("generate", {"prompt": "async", "max_new": 10})
        chunks = [item async for item in h.astream()]
        res = await h.aresult()
        other = m.submit("chat", {"prompt": "hi"})
        many = await asyncio.gather(*(m.submit("generate_fixed", {"prompt": f"g{i}", "max_new": 5}).aresult()
                                      for i in range(4)))
        return res, chunks, await other.aresult(), list(many)

    res, chunks, chat, many = asyncio.run(main())
    assert torch.equal(concat_stream(chunks)["tokens"], res["tokens"])
    assert "handoff" in chat and len(many) == 4 and all(x["tokens"].shape == (5,) for x in many)


def test_async_failure_raises_request_failed(fresh: Callable[..., MStar]) -> None:
    engine = fresh()
    gate = gate_decodes(engine)

    async def main() -> None:
        h = engine.submit("generate", {"prompt": "x", "max_new": 20})
        async for _ in h.astream():  # the prefill's token arrives; decodes are held
            h.cancel()
            gate.set()
        await h.aresult()

    with pytest.raises(RequestFailed) as e:
        asyncio.run(main())
    assert e.value.finish_reason == "cancelled"


def test_a_bad_plan_raises_plan_error_unchanged(tmp_path: Path) -> None:
    from mstar_runtime.plan.loader import PlanError

    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"not a plan at all")
    with pytest.raises(PlanError) as e:
        MStar.load(bad)
    assert str(e.value).startswith(str(bad))


def test_an_idle_engine_sleeps(m: MStar) -> None:
    import time

    m.generate("generate", prompt="wake", max_new=2)
    before = time.process_time()  # CPU time of every thread of this process
    time.sleep(0.5)
    assert time.process_time() - before < 0.1  # a polling engine would burn ~0.5 s here


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("walk", "inputs", "field", "words"),
    [
        ("nope", {"prompt": "x"}, "walk", "unknown walk"),
        ("generate", {}, "prompt", "missing"),
        ("generate", {"prompt": "x", "max_new": "many"}, "max_new", "expected an integer"),
        ("generate", {"prompt": "x", "max_new": 2**63}, "max_new", "outside the 64-bit integers"),  # CLI, batch, API
        ("generate", {"prompt": 3}, "prompt", "expected a string"),
        ("generate", "x", "inputs", "must be a mapping of input name to value"),  # was an AttributeError
        ("generate", {"prompt": "x", "bogus": 1}, "bogus", "unknown input"),
    ],
)
def test_bad_input_raises_request_error_naming_the_field(m: MStar, walk: str, inputs: dict[str, Any],
                                                         field: str, words: str) -> None:
    before = m.stats()["requests"]["submitted"]
    with pytest.raises(RequestError) as e:
        m.submit(walk, inputs)
    assert e.value.field == field and words in str(e.value)
    assert m.stats()["requests"]["submitted"] == before  # nothing was queued


def test_a_prefix_chunk_without_prefix_caching_is_refused(testfamily_plan: Path) -> None:
    """It would be ignored, as mstar-run's --prefix-chunk without --prefix-caching would."""
    with pytest.raises(PrefixChunkError, match=r"prefix_chunk=64 goes with prefix_caching=True"):
        MStar.load(testfamily_plan, prefix_chunk=64)


def test_request_id_in_use_is_refused(fresh: Callable[..., MStar]) -> None:
    engine = fresh()
    gate = gate_decodes(engine)
    h = engine.submit("generate", {"prompt": "x", "max_new": 4}, request_id="mine")
    with pytest.raises(RequestError) as e:
        engine.submit("generate", {"prompt": "y"}, request_id="mine")
    assert e.value.field == "request_id"
    gate.set()
    h.result(timeout=30)
    # once it ended, the id is free again
    assert engine.submit("generate", {"prompt": "y", "max_new": 2}, request_id="mine").result(timeout=30)


# ----------------------------------------------------------------------------- cancel, timeout, close
def first_chunk(h: RequestHandle) -> None:
    next(iter(h.stream()))


def test_cancel_fails_the_handle_and_frees_its_kv_pages(fresh: Callable[..., MStar]) -> None:
    engine = fresh()
    gate = gate_decodes(engine)
    h = engine.submit("generate", {"prompt": "a long prompt to hold pages", "max_new": 30})
    first_chunk(h)  # prefilled: it holds KV pages now, and its first decode is held
    assert engine.stats()["kv_used_pages"] > 0
    assert h.state == "running"
    assert h.cancel() is True
    gate.set()
    with pytest.raises(RequestFailed) as e:
        h.result(timeout=30)
    assert e.value.finish_reason == "cancelled" and h.state == "cancelled"
    assert e.value.request_id == h.id
    st = engine.stats()
    assert st["kv_used_pages"] == 0 and st["cancelled"] == 1 and st["requests"]["active"] == 0
    assert h.cancel() is False  # already over
    engine.close()
    assert engine.conductor.kv.used_pages() == 0 and not engine.conductor.running


def test_timeout(fresh: Callable[..., MStar]) -> None:
    engine = fresh()
    gate_decodes(engine, wait_s=0.2)  # never set: every decode takes 0.2 s
    h = engine.submit("generate", {"prompt": "slow", "max_new": 30}, timeout=0.3)
    with pytest.raises(TimeoutError):  # a client-side wait limit; the request goes on
        h.result(timeout=0.01)
    with pytest.raises(RequestFailed) as e:
        h.result(timeout=30)
    assert e.value.finish_reason == "timeout" and "timed out" in e.value.message
    assert h.state == "failed"
    assert engine.stats()["requests"]["timeout"] == 1


def test_close_with_requests_in_flight_fails_them_cleanly(fresh: Callable[..., MStar]) -> None:
    engine = fresh()
    gate = gate_decodes(engine)
    hs = [engine.submit("generate", {"prompt": f"p{i}", "max_new": 20}) for i in range(12)]
    first_chunk(hs[0])
    threading.Timer(0.1, gate.set).start()  # the held step ends, then the engine sees close()
    engine.close()
    for h in hs:
        with pytest.raises(RequestFailed) as e:
            h.result(timeout=5)
        assert e.value.finish_reason == "shutdown" and "closed" in e.value.message
        assert h.state == "cancelled"
    with pytest.raises(EngineClosed):
        engine.submit("generate", {"prompt": "late"})
    engine.close()  # idempotent
    assert engine.conductor.kv.used_pages() == 0


def test_engine_death_fails_every_pending_handle(fresh: Callable[..., MStar]) -> None:
    engine = fresh()
    gate = gate_decodes(engine)
    h1 = engine.submit("generate", {"prompt": "x", "max_new": 8})
    first_chunk(h1)

    def boom() -> bool:
        raise RuntimeError("boom in the conductor")

    engine.conductor.step = boom  # type: ignore[method-assign]
    gate.set()
    h2 = engine.submit("flow", {"prompt": "y"})
    for h in (h1, h2):
        with pytest.raises(RequestFailed) as e:
            h.result(timeout=10)
        assert "boom in the conductor" in e.value.message
    with pytest.raises(EngineClosed, match="boom"):
        engine.submit("generate", {"prompt": "z"})


def test_done_callback_runs_once_the_request_ends(m: MStar) -> None:
    ended = threading.Event()
    seen: list[str] = []
    h = m.submit("generate", {"prompt": "cb", "max_new": 3})
    h.add_done_callback(lambda handle: (seen.append(handle.state), ended.set()))
    assert ended.wait(30) and seen == ["finished"]
    h.add_done_callback(lambda handle: seen.append("late"))  # already done: runs at once
    assert seen == ["finished", "late"]


# ----------------------------------------------------------------------------- concurrency
def test_concurrent_submits_from_threads_equal_running_each_alone(m: MStar) -> None:
    walks = ["generate", "generate_fixed", "generate_left", "chat", "flow"]
    requests = []
    for i in range(16):
        walk = walks[i % len(walks)]
        inputs: dict[str, Any] = {"prompt": f"request {i} " + "z" * (i % 5)}
        inputs.update({"steps": 1 + i % 3} if walk == "flow" else {"max_new": 2 + i % 6})
        requests.append((walk, inputs))
    alone = [m.submit(w, x).result(timeout=30) for w, x in requests]

    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def client(k: int) -> None:
        try:
            start.wait()
            mine = [(i, m.submit(*requests[i])) for i in range(k, 16, 4)]
            for i, h in mine:
                results[i] = h.result(timeout=60)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 16
    for i in range(16):
        assert same(results[i], alone[i]), requests[i]
    assert m.stats()["mean_batch"] > 1.0  # they really ran together
