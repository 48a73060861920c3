"""The window gather (`window_gather`, scheduler.py): a codec window call that is not full waits
a bounded number of engine steps for other requests' windows to join it.

Counted in engine steps, never wall time: each test records, for every codec call the
scheduler picks, its rows and how many times each of its calls had been passed over (the
steps that ran while it waited), on the test family's `generate` walk (a sliding window of 8
codes every 4 decode steps) and tiny Orpheus (SNAC every 7). Requests arrive `gap` engine
steps apart, as over HTTP, so their windows are released at different steps.

Bit-identity: what the gather changes is only which windows share a codec call, never the
LM's steps, so tokens, codes and hidden states are bit-identical on and off. A codec's own
floats may differ in the last bits between a window decoded alone and in a batch of two (CPU
GEMMs pick kernels by row count; the conductor's docstring says the same of any change of
batch), so audio is compared bitwise where the batches are the same (one request: nothing is
held) and within float tolerance otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import compile_model

from mstar_runtime import cli
from mstar_runtime.api import MStar
from mstar_runtime.cli import main
from mstar_runtime.control.conductor import FINISHED, Conductor
from mstar_runtime.control.interpreter import Frame, StepCall
from mstar_runtime.control.scheduler import (
    MAX_WAIT,
    Scheduler,
    Standing,
    WindowGatherError,
    check_window_gather,
    window_phases,
)
from mstar_runtime.engine_options import EngineOptions, start_engine
from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.worker.worker import Worker

TWO = [("hello world", 10), ("a cat sat", 20)]  # r0 stops decoding while r1 still decodes

Log = list[tuple[list[str], list[int]]]  # per codec call: its requests, each call's times passed over


@pytest.fixture(scope="module")
def family(testfamily_plan: Path) -> tuple[Plan, Worker]:
    plan = load_plan(testfamily_plan, device="cpu")
    return plan, Worker(plan, 0, "cpu", "dummy")


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, Worker]:
    plan = load_plan(compile_model(tmp_path_factory.mktemp("orpheus") / "orpheus-tiny.plan", "orpheus"),
                     device="cpu")
    return plan, Worker(plan, 0, "cpu", "dummy")


def _recorded(c: Conductor, node: str) -> Log:
    """Every group of `node` the scheduler picks: its requests and its calls' pass counts."""
    log: Log = []
    pick = c.scheduler.next_group

    def next_group(*args: Any, **kw: Any) -> Any:
        passed = dict(c.scheduler._passed)
        picked = pick(*args, **kw)
        if picked is not None and picked[0][0] == node:
            log.append(([x.request_id for x in picked[1]], [passed.get(x.seq, 0) for x in picked[1]]))
        return picked

    c.scheduler.next_group = next_group  # type: ignore[method-assign]
    return log


def _run(engine: tuple[Plan, Worker], gather: int, gap: int, requests: list[tuple[str, dict[str, Any]]],
         node: str = "codec") -> tuple[Log, list[Any]]:
    """Submit `requests` `gap` engine steps apart, run to the end: the codec calls, the requests."""
    plan, worker = engine
    c = Conductor(plan, {0: worker}, window_gather=gather)
    log = _recorded(c, node)
    handles = []
    for i, (walk, inputs) in enumerate(requests):
        handles.append(c.submit(walk, dict(inputs), request_id=f"r{i}"))
        for _ in range(gap):
            c.step()
    c.run_until_idle()
    assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
    return log, handles


def _generate(specs: list[tuple[str, int]]) -> list[tuple[str, dict[str, Any]]]:
    return [("generate", {"prompt": p, "max_new": n}) for p, n in specs]


def _same_outputs(a: list[Any], b: list[Any], audio: str | None = "audio") -> None:
    """Every output bit-identical, but `audio` (a codec's output) within float tolerance."""
    for x, y in zip(a, b, strict=True):
        assert set(x.outputs) == set(y.outputs)
        for k, v in x.outputs.items():
            if k == audio:
                torch.testing.assert_close(v, y.outputs[k], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(v, y.outputs[k]), k


# ------------------------------------------------------------------ through the conductor
def test_windows_reached_within_the_bound_run_as_one_call(family: tuple[Plan, Worker]) -> None:
    """r1's first window comes 2 steps after r0's: off, two calls of one row; with a bound of 2
    steps or more, one call of both (r0's waited 2 steps, r1's none)."""
    off, alone = _run(family, 0, 2, _generate(TWO))
    assert [rows for rows, _ in off[:2]] == [["r0"], ["r1"]]
    for gather in (2, 3, MAX_WAIT):
        on, together = _run(family, gather, 2, _generate(TWO))
        assert on[0] == (["r0", "r1"], [2, 0])
        assert len(on) == len(off) - 1 and sum(len(r) for r, _ in on) == sum(len(r) for r, _ in off)
        _same_outputs(alone, together)


def test_a_window_is_never_held_past_the_bound(family: tuple[Plan, Worker]) -> None:
    """r1's first window comes 8 steps after r0's: with any bound below that, r0's window runs
    alone once it has waited exactly the bound (off: one step, passed over by the larger decode
    batch as before); no call ever waits longer; a bound of 8 joins the two."""
    off, _ = _run(family, 0, 9, _generate(TWO))
    assert off[0] == (["r0"], [1])
    for gather in (2, 3, 5):
        on, _ = _run(family, gather, 9, _generate(TWO))
        assert on[0] == (["r0"], [gather])
        assert max(max(p) for _, p in on) == gather
    on, _ = _run(family, MAX_WAIT, 9, _generate(TWO))
    assert on[0] == (["r0", "r1"], [MAX_WAIT, 0])


def test_nothing_is_held_when_no_other_request_runs(family: tuple[Plan, Worker]) -> None:
    """One request alone: its windows run as soon as they are released, on or off, and so its
    outputs (audio too: the same batches) are bit-identical; so are r1's last windows, once r0
    has ended."""
    off, alone = _run(family, 0, 0, _generate(TWO[1:]))
    on, held = _run(family, MAX_WAIT, 0, _generate(TWO[1:]))
    assert on == off and all(p == [0] for _, p in on)
    _same_outputs(alone, held, audio=None)
    on, _ = _run(family, MAX_WAIT, 2, _generate(TWO))
    assert on[1:] == [(["r1"], [0])] * (len(on) - 1)


def test_every_chunk_policy_keeps_its_outputs(family: tuple[Plan, Worker]) -> None:
    """The three chunked walks, requests 3 steps apart: fewer codec calls with the gather, and
    the same tokens and hidden states (bitwise) and audio."""
    requests = [(walk, {"prompt": f"prompt {i} of {walk}", "max_new": 6 + 5 * i})
                for i, walk in enumerate(["generate", "generate_fixed", "generate_left", "generate", "generate_left"])]
    off, alone = _run(family, 0, 3, requests)
    on, together = _run(family, 4, 3, requests)
    assert len(on) < len(off)
    assert sorted(r for rows, _ in on for r in rows) == sorted(r for rows, _ in off for r in rows)
    assert max(max(p) for _, p in on) <= MAX_WAIT
    _same_outputs(alone, together)


def test_orpheus_snac_windows_gather(orpheus: tuple[Plan, Worker]) -> None:
    """Tiny Orpheus, two requests 10 steps apart: off, SNAC runs 10 calls; with a bound of 4
    steps, 9 (two windows 2 steps apart share one); the codes are bit-identical, the audio equal
    to float tolerance."""
    requests = [("tts", {"text": f"hello number {i}", "max_tokens": n, "seed": i}) for i, n in enumerate((50, 80))]
    off, alone = _run(orpheus, 0, 10, requests, node="snac")
    on, together = _run(orpheus, 4, 10, requests, node="snac")
    assert (len(off), len(on)) == (10, 9)
    # the bound, or what the larger decode batch makes a window wait anyway (up to MAX_WAIT)
    assert max(max(p) for _, p in on) <= max(4, max(max(p) for _, p in off))
    _same_outputs(alone, together)


# ------------------------------------------------------------------ the scheduler alone
def _call(seq: int, request: str, node: str = "codec", phase: str = "decode_window") -> StepCall:
    op = {"op": "call", "id": f"w.{node}.{phase}", "node": node, "phase": phase, "tag": None,
          "ranks": [0], "args": {}, "results": [], "feeds": [], "graph": None}
    return StepCall(op, request, None, {}, Frame(None), seq=seq)  # type: ignore[arg-type]


WINDOWS = frozenset({("codec", "decode_window")})
COHORT = ("lm", "decode", (0,), "w.l1")


def test_scheduler_holds_a_window_group_only_while_something_else_runs() -> None:
    """A window group bigger than the decode cohort is held while a running request has no
    window in it; with a step in flight and nothing else to run the scheduler waits (None) and
    counts nothing; with nothing else at all, or when full, it runs at once."""
    s = Scheduler(max_batch=8, gather=3, windows=WINDOWS)
    ready = [_call(1, "a"), _call(2, "b")]
    standing = {COHORT: Standing(COHORT, 1, 3)}
    assert s.next_group(ready, standing=standing, running=["a", "b", "c"])[0] == COHORT
    assert s.next_group(ready, standing=standing, running=["a", "b"])[0][0] == "codec"  # no one else
    s = Scheduler(max_batch=8, gather=3, windows=WINDOWS)
    assert s.next_group(ready, standing=standing, running=["a", "b", "c"])[0] == COHORT
    assert s.next_group(ready, busy=[1], running=["a", "b", "c"]) is None and s._passed == {1: 1, 2: 1}
    assert s.next_group(ready, running=["a", "b", "c"])[0][0] == "codec"  # nothing in flight
    s = Scheduler(max_batch=8, node_limits={"codec": 2}, gather=3, windows=WINDOWS)
    assert s.next_group(ready, standing=standing, running=["a", "b", "c"])[0][0] == "codec"  # full


def test_scheduler_lets_a_held_group_go_after_the_bound() -> None:
    s = Scheduler(max_batch=8, gather=2, windows=WINDOWS)
    ready = [_call(1, "a"), _call(2, "b")]
    for i in range(2):
        standing = {COHORT: Standing(COHORT, 1, 10 + i)}
        assert s.next_group(ready, standing=standing, running=["a", "b", "c"])[0] == COHORT
    standing = {COHORT: Standing(COHORT, 1, 20)}
    assert s.next_group(ready, standing=standing, running=["a", "b", "c"]) == (("codec", "decode_window", (0,)),
                                                                                ready)


def test_window_phases_are_the_stateless_phases_a_chunked_stream_feeds(
        family: tuple[Plan, Worker], orpheus: tuple[Plan, Worker]) -> None:
    """The codec's three phases and SNAC's decode; never a prompt builder, a flow step or an LM."""
    assert window_phases(family[0]) == {("codec", "decode_window"), ("codec", "decode_block"),
                                        ("codec", "decode_frames")}
    assert window_phases(orpheus[0]) == {("snac", "decode")}


# ------------------------------------------------------------------ the setting
@pytest.mark.parametrize("bad", [-1, MAX_WAIT + 1, True, 1.5, "3", None])
def test_bad_values_are_refused_naming_the_setting(family: tuple[Plan, Worker], bad: Any) -> None:
    plan, worker = family
    with pytest.raises(WindowGatherError, match=r"window_gather \(--window-gather\) must be an int from 0"):
        Conductor(plan, {0: worker}, window_gather=bad)
    with pytest.raises(ValueError, match="window_gather"):
        MStar.from_plan(plan, window_gather=bad)  # before any worker starts
    assert check_window_gather(MAX_WAIT) == MAX_WAIT and check_window_gather(0) == 0


def test_the_flag_and_its_variable_reach_the_engine_options(testfamily_plan: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`--window-gather` / `MSTAR_WINDOW_GATHER` and `--prefix-chunk` / `MSTAR_PREFIX_CHUNK`
    become `EngineOptions`' fields (the walk itself is not run)."""
    seen: list[EngineOptions] = []
    monkeypatch.setattr(cli, "run_walk", lambda *args, options, **kw: seen.append(options) or 0)
    walk = [str(testfamily_plan), "--walk", "generate", "--input", "prompt=hi"]
    assert main([*walk, "--window-gather", "3", "--prefix-caching", "--prefix-chunk", "48"]) == 0
    monkeypatch.setenv("MSTAR_WINDOW_GATHER", "5")
    monkeypatch.setenv("MSTAR_PREFIX_CHUNK", "64")
    monkeypatch.setenv("MSTAR_PREFIX_CACHING", "1")
    assert main(walk) == 0
    assert [(o.window_gather, o.prefix_caching, o.prefix_chunk) for o in seen] == [(3, True, 48), (5, True, 64)]


def test_the_cli_flag_reaches_the_conductor(testfamily_plan: Path, family: tuple[Plan, Worker],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(testfamily_plan), "--walk", "generate", "--input", "prompt=hi", "--window-gather", "9"])
    assert e.value.code == 2
    assert "--window-gather" in capsys.readouterr().err
    with start_engine(family[0], EngineOptions(window_gather=3)) as m:
        assert m._conductor.scheduler.gather == 3
        assert m.submit("generate", {"prompt": "hi", "max_new": 9}).result()["audio"].numel() > 0
