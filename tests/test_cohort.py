"""The cohort path (runtime/mstar_runtime/control/cohort.py) against the generic path.

Every test runs one plan with one set of weights twice: as compiled ("cohort": its marked
loops run as decode cohorts) and without its cohort marks ("generic": `support.as_run`,
every loop iteration by iteration, the reference), and compares what the requests end with
and what a listener was sent. Exact: tokens, codes, flags, the walks a request ran, stream
item counts, and Orpheus' audio where no preemption changes its SNAC batches. To 1e-5 (`TOL`): the test
family's floats (the `generate` walk's hidden states, codec audio), because a cohort is
batched with other requests than the generic scheduler would batch it with, and a batch
changes the order of the sums (the same as batched vs alone, tests/test_conductor.py).

The test family runs with its nodes' own seeded init (`weights="init"`): its greedy tokens
then depend on the context. The random `dummy` draw repeats one token forever, so no KV
mistake could change them.

Marked loops (the compiler's `cohort` mark, docs/plan-format.md "Cohort loops"): the test
family's chat, continue, generate (its loop's `acc` kept as the mark says), generate_fixed and
generate_left, and Orpheus' tts; not flow. Everything is counted in engine steps, never in seconds.
Five of these first pinned bugs of the cohort path as strict xfails; they pass since the fixes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import RUNS, as_run

from mstar_runtime.control import conductor as conductor_module
from mstar_runtime.control.cohort import Cohort
from mstar_runtime.control.conductor import CANCELLED, FAILED, FINISHED, Conductor, Request
from mstar_runtime.engine.cohort_engine import JoinRow
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan, load_plan, without_cohorts
from mstar_runtime.plan.planfile import iter_ops
from mstar_runtime.worker.startup import shutdown_workers, start_workers
from mstar_runtime.worker.worker import Worker, WorkerStepError
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parents[1]
TF_WEIGHTS = "init"
TOL = {"atol": 1e-5, "rtol": 1e-5}
MARKED = {"chat", "continue", "generate", "generate_fixed", "generate_left"}

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- helpers
def _compile(walk: Path, placement: Path, out: Path) -> Path:
    assert mstarc(["compile", str(walk), "--variant", "tiny", "-p", str(placement), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def orpheus_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(ROOT / "models/orpheus/orpheus.walk", ROOT / "placements/cpu.yaml",
                    tmp_path_factory.mktemp("cohort-orpheus") / "orpheus-tiny.plan")


@pytest.fixture(scope="module")
def rank_plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("cohort-ranks")
    return {n: _compile(ROOT / "models/testfamily/testfamily.walk", ROOT / f"tests/placements/cpu{n}.yaml",
                        out / f"tf{n}.plan") for n in (2, 3)}


def engine(plan_path: Path, path: str, *, cap: int | None = None, weights: str = TF_WEIGHTS,
           **kw: Any) -> Conductor:
    """A conductor on a fresh one-rank worker (`cap`: KV pages per pool), on the plan as run `path` takes it."""
    plan = load_plan(plan_path, device="cpu", kv_pages_cap=cap)
    return Conductor(as_run(plan, path), {0: Worker(plan, 0, "cpu", weights)}, **kw)


def run(conductor: Conductor, requests: list[tuple[str, dict[str, Any]]], listener: Any = None) -> list[Request]:
    handles = [conductor.submit(walk, dict(inputs), listener=listener) for walk, inputs in requests]
    conductor.run_until_idle()
    return handles


def assert_same(got: Request, want: Request, *, exact: bool = False) -> None:
    """Same end, same walks, same outputs: non-floats exactly, floats to `TOL` unless `exact`."""
    assert (got.state, got.error) == (want.state, want.error)
    assert got.walks_done == want.walks_done
    assert set(got.outputs) == set(want.outputs), (set(got.outputs), set(want.outputs))
    for name, x in got.outputs.items():
        y = want.outputs[name]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, (name, x.shape, y.shape)
            if exact or not x.is_floating_point():
                assert torch.equal(x, y), name
            else:
                torch.testing.assert_close(x, y, **TOL, msg=name)
        else:
            assert type(x) is type(y) and x == y, (name, x, y)


def assert_finished_alike(conductor: Conductor, got: list[Request], want: list[Request],
                          but: Request | None = None) -> None:
    """Every request of `got` but `but` finished as its twin in `want` (`assert_same`), and the
    conductor holds no KV page and no cohort row any more."""
    for h, g in zip(got, want, strict=True):
        if h is not but:
            assert h.state == FINISHED, h.error
            assert_same(h, g)
    assert conductor.kv.used_pages() == 0 and all(co.n == 0 for co in conductor.cohorts.values())


def marked_loops(conductor: Conductor, walks: list[str]) -> set[str]:
    """The ids of the loops of `walks` that the plan marks as cohort loops."""
    return {op["id"] for w in walks for op in iter_ops(conductor.plan.walk(w)["program"])
            if op.get("op") == "loop" and op.get("cohort") is not None}


def joined_loops(conductor: Conductor) -> set[str]:
    return {key[3] for key, cohort in conductor.cohorts.items() if cohort.stats["joins"]}


def row_of(conductor: Conductor, request: Request) -> tuple[Cohort, Any] | None:
    for cohort in conductor.cohorts.values():
        for m in cohort.members:
            if m.request is request:
                return cohort, m
    return None


def step_until_in_loop(conductor: Conductor, request: Request, steps: int = 2, limit: int = 500) -> Cohort:
    """Engine steps until `request` is a cohort row that has had `steps` of its steps applied."""
    for _ in range(limit):
        found = row_of(conductor, request)
        if found is not None and int(found[0].valid[found[1].row]) >= steps:
            return found[0]
        assert conductor.step(), "idle before the request was in its loop"
    raise AssertionError(f"{request.id} never ran {steps} steps in a cohort")


class Recorder:
    """A conductor listener: every appended value it is sent, per (request, walk index, output)."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, int, str], list[torch.Tensor]] = defaultdict(list)

    def on_output(self, request: Request, name: str, value: Any) -> None:
        self.items[(request.id, len(request.walks_done), name)].append(value)

    def on_finish(self, request: Request) -> None:
        pass

    def sent(self, request: Request, name: str) -> list[torch.Tensor]:
        """What was sent of `name` during the request's last walk."""
        return self.items[(request.id, len(request.walks_done) - 1, name)]


def streamed(recorder: Recorder, request: Request, name: str) -> torch.Tensor:
    items = recorder.sent(request, name)
    return torch.cat(items) if items else request.outputs[name][:0]


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> Iterator[list[Any]]:
    """Record the results of every call of `cls.method` (it still runs)."""
    results: list[Any] = []
    real = getattr(cls, method)

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        results.append(out)
        return out

    monkeypatch.setattr(cls, method, spy)
    yield results


def kv_context(conductor: Conductor, key: tuple[str, str]) -> torch.Tensor:
    """The LM's K and V of a context as the BlockManager sees it: [layers, 2, tokens, kv heads, dim]."""
    bm = conductor.kv.managers[("lm", 0)]
    data = conductor.workers[0].engines["lm"].pool.data  # [layers, pages, 2, page size, kv heads, dim]
    pages = torch.tensor(bm.page_table(key), dtype=torch.long)
    x = data[:, pages].transpose(1, 2)
    return x.reshape(x.shape[0], 2, -1, *x.shape[-2:])[:, :, : bm.seq_len(key)].clone()


def snapshot_handoffs(conductor: Conductor) -> dict[str, torch.Tensor]:
    """Record, per request, the KV context its chat turn leaves to `continue` (at the end of chat)."""
    seen: dict[str, torch.Tensor] = {}
    real = conductor._walk_finished

    def walk_finished(req: Request) -> None:
        if req.current_walk == "chat":
            seen[req.id] = kv_context(conductor, (req.id, "main"))
        real(req)

    conductor._walk_finished = walk_finished  # type: ignore[method-assign]
    return seen


# ---------------------------------------------------------------------------- the marked walks
def test_the_plan_marks_exactly_the_decode_loops_with_a_column_step(testfamily_plan: Path) -> None:
    conductor = engine(testfamily_plan, "cohort")
    walks = list(conductor.plan.walks)
    assert {w for w in walks if marked_loops(conductor, [w])} == MARKED


def test_without_cohorts_unmarks_a_copy_and_leaves_the_plan(testfamily_plan: Path) -> None:
    plan = load_plan(testfamily_plan, device="cpu")
    bare = without_cohorts(plan)

    def loops(p: Plan) -> dict[str, bool]:  # loop id -> marked
        return {op["id"]: op["cohort"] is not None for w in p.walks for op in iter_ops(p.walk(w)["program"])
                if op.get("op") == "loop"}

    assert {k.split(".")[0] for k, marked in loops(plan).items() if marked} == MARKED
    assert loops(bare) == dict.fromkeys(loops(plan), False)  # the same loops, none marked
    assert bare.nodes is plan.nodes and bare.path == plan.path  # only the walks differ


@pytest.mark.parametrize("walk,inputs", [
    ("chat", {"prompt": "hi there", "max_new": 6}),  # hands off to `continue`: two marked loops
    ("generate_fixed", {"prompt": "fixed chunks", "max_new": 11}),
    ("generate_left", {"prompt": "left context", "max_new": 17}),
    ("generate", {"prompt": "hello world", "max_new": 12}),  # its loop accumulates every step's hidden
    ("flow", {"prompt": "a cat", "steps": 3}),
])
def test_marked_walks_run_as_cohorts_and_equal_the_unmarked_plan(
    testfamily_plan: Path, walk: str, inputs: dict[str, Any]
) -> None:
    cohort, generic = engine(testfamily_plan, "cohort"), engine(testfamily_plan, "generic")
    (c,) = run(cohort, [(walk, inputs)])
    (g,) = run(generic, [(walk, inputs)])
    assert c.state == FINISHED, c.error
    # alone, both runs batch nothing else: the same tokens, bit for bit; the hidden states
    # `generate` accumulates come from the cohort's attention (`decode_attention`) and the
    # generic step's (`paged_attention`), equal to float32 rounding
    assert_same(c, g, exact=walk != "generate")
    loops = marked_loops(cohort, c.walks_done)
    assert joined_loops(cohort) == loops
    assert (cohort.stats["cohort_steps"] > 0) == bool(loops)
    assert generic.stats["cohort_steps"] == 0 and not generic.cohorts
    if loops:  # every decode token of every marked loop came from a cohort step
        rows = sum(co.stats["row_steps"] for co in cohort.cohorts.values())
        assert rows >= c.outputs["tokens"].shape[0] - 1
        assert all(co.n == 0 for co in cohort.cohorts.values())


# ---------------------------------------------------------------------------- batching
def _mixed(n: int) -> list[tuple[str, dict[str, Any]]]:
    """n requests over the marked walks, different prompt lengths and max_new."""
    walks = ["generate_left", "chat", "generate_fixed", "generate_left", "generate"]
    return [(walks[i % len(walks)], {"prompt": f"request {i} " + "z" * (3 * i % 11), "max_new": 2 + (5 * i) % 23})
            for i in range(n)]


def test_batched_requests_equal_each_alone(testfamily_plan: Path) -> None:
    """20 requests at once, 12 of them in one loop: rows join and leave at different steps,
    and the requests a full cohort (8 rows) cannot take run that loop on the generic path."""
    requests = _mixed(8) + [("generate_left", {"prompt": f"in one loop {i}" + "w" * i, "max_new": 16 + i})
                            for i in range(10)]
    alone_engine = engine(testfamily_plan, "cohort")
    alone = [run(alone_engine, [r])[0] for r in requests]
    cohort = engine(testfamily_plan, "cohort", max_running=24)
    together = run(cohort, requests)
    generic = run(engine(testfamily_plan, "generic", max_running=24), requests)
    for c, a, g in zip(together, alone, generic):
        assert c.state == FINISHED, c.error
        assert_same(c, a)
        assert_same(c, g)
    for key, co in cohort.cohorts.items():
        # the rows really shared steps (where more than one request ran the loop at once)
        assert co.stats["row_steps"] > co.stats["steps"] or key[3] == "generate.l1", key
    left = [co for key, co in cohort.cohorts.items() if key[3] in marked_loops(cohort, ["generate_left"])]
    assert len(left) == 1 and left[0].rows == 8
    assert left[0].stats["joins"] < sum(w == "generate_left" for w, _ in requests)  # some ran generic


class JoinSpy:
    """A one-rank worker that records the request ids of each cohort join call; it refuses a
    call holding a request of `refuse` (a RequestError, as a node's join: naming the row when
    `named`, else no row) and fails one holding a request of `fail` (a WorkerStepError naming it)."""

    def __init__(self, inner: Worker, named: bool = True):
        self.inner, self.named = inner, named
        self.calls: list[list[str]] = []
        self.refuse: set[str] = set()
        self.fail: set[str] = set()

    def cohort_join(self, key: Any, first: int, rows: list[JoinRow]) -> None:
        ids = [r.request_id for r in rows]
        self.calls.append(ids)
        for rid in ids:
            if rid in self.refuse:
                err = RequestError("a row this node's join refuses")
                if self.named:
                    err.request_ids = [rid]  # type: ignore[attr-defined]
                raise err
            if rid in self.fail:
                err = WorkerStepError(key[0], key[1], "the join failed")
                err.request_ids = [rid]  # type: ignore[attr-defined]
                raise err
        self.inner.cohort_join(key, first, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


ONE_LOOP = [("generate_left", {"prompt": f"joins together {i}", "max_new": 6 + i}) for i in range(6)]


def _spied(plan_path: Path, named: bool = True) -> tuple[Conductor, JoinSpy]:
    plan = load_plan(plan_path, device="cpu")
    spy = JoinSpy(Worker(plan, 0, "cpu", TF_WEIGHTS), named)
    return Conductor(plan, {0: spy}), spy  # type: ignore[dict-item]


def test_requests_prefilled_together_join_their_cohort_in_one_call(testfamily_plan: Path) -> None:
    want = run(engine(testfamily_plan, "generic"), ONE_LOOP)
    conductor, spy = _spied(testfamily_plan)
    got = run(conductor, ONE_LOOP)
    assert_finished_alike(conductor, got, want)
    assert sorted(rid for call in spy.calls for rid in call) == sorted(h.id for h in got)  # each joined once
    assert max(len(call) for call in spy.calls) > 1  # the prefill batch's rows joined together
    assert sum(co.stats["joins"] for co in conductor.cohorts.values()) == len(ONE_LOOP)


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_row_the_join_refuses_runs_generic_and_the_others_join_without_it(testfamily_plan: Path,
                                                                             named: bool) -> None:
    """Unnamed: the refusal does not say whose row it is; the rows are asked one by one."""
    want = run(engine(testfamily_plan, "generic"), ONE_LOOP)
    conductor, spy = _spied(testfamily_plan, named)
    got = [conductor.submit(walk, dict(inputs)) for walk, inputs in ONE_LOOP]
    bad = got[2].id
    spy.refuse.add(bad)
    conductor.run_until_idle()
    assert_finished_alike(conductor, got, want)  # the refused request ran its loop generic, to the same end
    joined = [rid for call in spy.calls if bad not in call for rid in call]
    assert sorted(joined) == sorted(h.id for h in got if h.id != bad)
    assert sum(co.stats["joins"] for co in conductor.cohorts.values()) == len(ONE_LOOP) - 1
    if named:  # one retry, without it
        first = next(call for call in spy.calls if bad in call)
        assert len(first) > 1 and [rid for rid in first if rid != bad] in spy.calls


def test_a_row_the_worker_fails_to_join_fails_alone(testfamily_plan: Path) -> None:
    want = run(engine(testfamily_plan, "generic"), ONE_LOOP)
    conductor, spy = _spied(testfamily_plan)
    got = [conductor.submit(walk, dict(inputs)) for walk, inputs in ONE_LOOP]
    spy.fail.add(got[3].id)
    conductor.run_until_idle()
    assert got[3].state == FAILED and "the join failed" in got[3].error
    assert_finished_alike(conductor, got, want, but=got[3])


def test_each_dynamic_loop_stops_at_its_own_step(testfamily_plan: Path) -> None:
    lengths = [2, 3, 5, 8, 13, 21, 32]  # 32 is the loop's max (max_new_tokens)
    requests = [("generate_fixed", {"prompt": "the same prompt", "max_new": n}) for n in lengths]
    requests.append(("chat", {"prompt": "past the bound", "max_new": 40}))  # the loop's `max` ends it
    cohort, generic = engine(testfamily_plan, "cohort"), engine(testfamily_plan, "generic")
    got, want = run(cohort, requests), run(generic, requests)
    hop = int(cohort.plan.node_spec("codec").config["hop"])
    for c, g, n in zip(got, want, lengths):
        assert_same(c, g)
        assert c.outputs["tokens"].shape == (n,) and c.outputs["audio"].shape == (n * hop,)
        assert c.stats.wasted_steps == g.stats.wasted_steps == 1  # the one speculative step after `done`
    chat = got[-1]
    assert_same(chat, want[-1])
    assert chat.outputs["tokens"].shape == (33,)  # prefill + 32 iterations, `done` never raised
    assert chat.outputs["handoff"] is False and chat.walks_done == ["chat"]
    assert chat.stats.wasted_steps <= 1


def test_eos_stops_its_row_and_is_no_stream_item(testfamily_plan: Path) -> None:
    prompt = "stop me early"
    (probe,) = run(engine(testfamily_plan, "generic"), [("generate_left", {"prompt": prompt, "max_new": 24})])
    tokens = probe.outputs["tokens"].tolist()
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])  # a token first made at step k
    requests = [("generate_left", {"prompt": prompt, "max_new": 24}),
                ("generate_fixed", {"prompt": "a neighbour", "max_new": 20}),
                ("chat", {"prompt": "and another", "max_new": 9})]
    runs = {}
    for path in RUNS:
        conductor = engine(testfamily_plan, path)
        conductor.workers[0].engines["lm"].node.eos = tokens[k]  # both runs read the node's eos
        runs[path] = (conductor, run(conductor, requests))
    (cohort, got), (_, want) = runs["cohort"], runs["generic"]
    assert cohort.stats["cohort_steps"] > 0
    for c, g in zip(got, want):
        assert_same(c, g)
    hop = int(cohort.plan.node_spec("codec").config["hop"])
    assert got[0].outputs["tokens"].tolist() == tokens[: k + 1]
    assert got[0].outputs["audio"].shape == (k * hop,)  # eos pushed no code


# ---------------------------------------------------------------------------- preemption
PREEMPT = [
    ("chat", {"prompt": "hi there", "max_new": 6}),
    ("generate_fixed", {"prompt": "fixed chunks", "max_new": 11}),
    ("generate_left", {"prompt": "left context", "max_new": 17}),
    ("chat", {"prompt": "one token", "max_new": 1}),
    ("generate_left", {"prompt": "a longer prompt than the others", "max_new": 23}),
    ("generate", {"prompt": "unmarked", "max_new": 7}),
]


@pytest.mark.parametrize("every", [1, 3, 7])
def test_forced_preemption_gives_identical_outputs(
    testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    want = run(engine(testfamily_plan, "generic"), PREEMPT)
    with counting(monkeypatch, Cohort, "remove") as removed:
        cohort = engine(testfamily_plan, "cohort", preempt_every=every)
        got = run(cohort, PREEMPT)
    assert cohort.stats["preemptions"] > 0 and cohort.stats["cohort_steps"] > 0
    assert any(removed)  # a preemption took a request out of its cohort mid-loop
    assert_finished_alike(cohort, got, want)


@pytest.mark.parametrize("every", [1, 7])
def test_forced_preemption_on_the_per_iteration_path_gives_identical_outputs(testfamily_plan: Path,
                                                                              every: int) -> None:
    """The path a loop takes when no cohort runs it (the plan without its marks: every decode
    a plain batched call through ops/column_call.py, its state joined and left each step):
    preempted and recomputed, the requests finish as they do unpreempted."""
    want = run(engine(testfamily_plan, "generic"), PREEMPT)
    generic = engine(testfamily_plan, "generic", preempt_every=every)
    got = run(generic, PREEMPT)
    assert generic.stats["preemptions"] > 0 and generic.stats["cohort_steps"] == 0
    assert_finished_alike(generic, got, want)


def _long(n: int) -> list[tuple[str, dict[str, Any]]]:
    walks = ["chat", "generate_fixed", "generate_left"]
    return [(walks[i % 3], {"prompt": f"prompt number {i} " + "q" * (3 * i), "max_new": 30}) for i in range(n)]


def test_a_cohort_step_out_of_pages_preempts_and_loses_nothing(
    testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _long(6)
    want = run(engine(testfamily_plan, "generic"), requests)
    with counting(monkeypatch, Conductor, "free_pages") as preempted:
        small = engine(testfamily_plan, "cohort", cap=10)  # 10 pages of 16 tokens for ~6 x 50 tokens
        got = run(small, requests)
    assert preempted and all(preempted)  # cohort steps ran out of pages, and each freed some
    assert small.stats["preemptions"] > 0
    assert_finished_alike(small, got, want)


def test_a_row_that_outgrows_the_pool_alone_fails_and_the_others_finish(
    testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [("chat", {"prompt": "0123456789", "max_new": 30}),  # 11 + 30 tokens > 2 pages of 16
                ("chat", {"prompt": "ok", "max_new": 3})]
    runs = {}
    with counting(monkeypatch, Conductor, "free_pages") as preempted:
        for path in RUNS:
            runs[path] = run(engine(testfamily_plan, path, cap=2), requests)
    assert preempted  # on the cohort path it is a cohort step that runs out
    for path, (big, small) in runs.items():
        assert big.state == FAILED and "can never fit" in big.error, (path, big.error)
        assert small.state == FINISHED, (path, small.error)
    assert_same(runs["cohort"][1], runs["generic"][1])


# ---------------------------------------------------------------------------- streams
def _windows(n_codes: int) -> int:
    return max(0, (n_codes - 28) // 7 + 1)  # Orpheus' sliding(28, 7)


ORPHEUS = [
    ("tts", {"text": "Streaming speech, chunk by chunk.", "max_tokens": 70}),
    ("tts", {"text": "Hi", "voice": "leo", "max_tokens": 50, "seed": 3}),
    ("tts", {"text": "Another one", "max_tokens": 60, "seed": 5, "repetition_penalty": 1.0}),
]


@pytest.mark.parametrize("every", [None, 5], ids=["as-is", "preempt-every-5"])
def test_orpheus_codes_and_audio_equal_the_generic_path_and_stream_once(
    orpheus_plan: Path, every: int | None
) -> None:
    plan = load_plan(orpheus_plan, device="cpu")
    worker = Worker(plan, 0, "cpu", "dummy")
    runs = {}
    for path in RUNS:
        conductor = Conductor(as_run(plan, path), {0: worker}, preempt_every=every)
        recorder = Recorder()
        runs[path] = (conductor, run(conductor, ORPHEUS, recorder), recorder)
    (cohort, got, heard), (generic, want, _) = runs["cohort"], runs["generic"]
    assert cohort.stats["cohort_steps"] > 0 and generic.stats["cohort_steps"] == 0
    if every:
        assert cohort.stats["preemptions"] > 0
    for c, g in zip(got, want):
        assert c.state == FINISHED, c.error
        # preemption changes which windows share a SNAC batch (on either path): audio to TOL then
        assert_same(c, g, exact=every is None)
        n = c.outputs["codes"].shape[0]
        assert n >= 28
        audio = heard.sent(c, "audio")
        assert len(audio) == _windows(n) and all(a.shape == (2048,) for a in audio)  # each window once
        torch.testing.assert_close(torch.cat(audio), c.outputs["audio"], **TOL)
        assert torch.equal(streamed(heard, c, "codes"), c.outputs["codes"])  # every code once, in order


def test_test_family_stream_chunks_arrive_once_after_preemption(testfamily_plan: Path) -> None:
    """The `on stream` blocks' audio (one emit per chunk) reaches a listener once per chunk."""
    requests = [(w, {"prompt": f"p{i}" + "y" * (2 * i), "max_new": 12 + 3 * i})
                for i, w in enumerate(["generate_fixed", "generate_left"] * 3)]
    runs = {}
    for path in RUNS:
        recorder = Recorder()
        conductor = engine(testfamily_plan, path, preempt_every=3)
        runs[path] = (conductor, run(conductor, requests, recorder), recorder)
    (cohort, got, heard), (_, want, heard_generic) = runs["cohort"], runs["generic"]
    assert cohort.stats["preemptions"] > 0 and cohort.stats["cohort_steps"] > 0
    for c, g in zip(got, want):
        assert_same(c, g)
        assert len(heard.sent(c, "audio")) == len(heard_generic.sent(g, "audio"))
        torch.testing.assert_close(streamed(heard, c, "audio"), c.outputs["audio"], **TOL)


def test_streamed_tokens_reach_a_listener_once_after_preemption(testfamily_plan: Path) -> None:
    requests = [(w, {"prompt": f"p{i}" + "y" * (2 * i), "max_new": 12 + 3 * i})
                for i, w in enumerate(["generate_fixed", "generate_left"] * 3)]
    recorder = Recorder()
    conductor = engine(testfamily_plan, "cohort", preempt_every=3)
    handles = run(conductor, requests, recorder)
    assert conductor.stats["preemptions"] > 0
    for h in handles:
        assert h.state == FINISHED, h.error
        assert streamed(recorder, h, "tokens").tolist() == h.outputs["tokens"].tolist(), h.id


# ---------------------------------------------------------------------------- cancel, timeout
CONCURRENT = [
    ("generate_fixed", {"prompt": "p0", "max_new": 20}),
    ("generate_left", {"prompt": "p1 yy", "max_new": 21}),
    ("chat", {"prompt": "p2 yyyy", "max_new": 22}),
    ("generate_fixed", {"prompt": "p3 yyyyyy", "max_new": 23}),
]


def test_cancel_mid_loop_stops_the_row_and_the_others_go_on(testfamily_plan: Path) -> None:
    want = run(engine(testfamily_plan, "generic"), CONCURRENT)
    conductor = engine(testfamily_plan, "cohort")
    handles = [conductor.submit(w, dict(i)) for w, i in CONCURRENT]
    target = handles[1]
    step_until_in_loop(conductor, target, steps=3)
    assert conductor.cancel(target.id)
    assert target.state == CANCELLED and target.finish_reason == "cancelled"
    assert row_of(conductor, target) is None  # its row is gone at once
    conductor.run_until_idle()
    assert_finished_alike(conductor, handles, want, but=target)


def test_a_timeout_mid_loop_fails_the_row_and_the_others_go_on(
    testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]  # the conductor's clock, moved by hand: independent of the machine's speed
    monkeypatch.setattr(conductor_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    want = run(engine(testfamily_plan, "generic"), CONCURRENT)
    conductor = engine(testfamily_plan, "cohort")
    handles = [conductor.submit(w, dict(i), timeout=5.0 if k == 2 else None)
               for k, (w, i) in enumerate(CONCURRENT)]
    target = handles[2]
    step_until_in_loop(conductor, target, steps=3)
    now[0] += 6.0
    conductor.run_until_idle()
    assert target.state == FAILED and target.finish_reason == "timeout"
    assert "timed out after 5.0 s" in target.error
    assert_finished_alike(conductor, handles, want, but=target)


# ---------------------------------------------------------------------------- transitions
def test_chat_hands_the_same_kv_context_to_continue_as_the_generic_path(testfamily_plan: Path) -> None:
    requests = [("chat", {"prompt": "hi there", "max_new": 6}),
                ("chat", {"prompt": "a longer first turn", "max_new": 19}),
                ("chat", {"prompt": "one", "max_new": 1}),
                ("continue", {"text": " alone", "max_new": 5})]
    runs = {}
    for path in RUNS:
        conductor = engine(testfamily_plan, path)
        handoffs = snapshot_handoffs(conductor)
        runs[path] = (conductor, run(conductor, requests), handoffs)
    (cohort, got, kv_c), (_, want, kv_g) = runs["cohort"], runs["generic"]
    assert joined_loops(cohort) == marked_loops(cohort, ["chat", "continue"])
    for c, g in zip(got, want):
        assert c.state == FINISHED, c.error
        assert_same(c, g)
    assert [h.walks_done for h in got] == [["chat", "continue"]] * 3 + [["continue"]]
    assert set(kv_c) == set(kv_g) == {h.id for h in got[:3]}
    for rid in kv_c:  # the context `keep lm@main as cont` carries: same tokens, same K/V
        assert kv_c[rid].shape == kv_g[rid].shape
        torch.testing.assert_close(kv_c[rid], kv_g[rid], **TOL)


def test_a_cohort_step_short_of_pages_leaves_the_kv_context_the_generic_path_leaves(testfamily_plan: Path) -> None:
    # three rows of the same length start their second page at the same step; the pool has one spare page
    requests = [("chat", {"prompt": p, "max_new": 20}) for p in ("abc", "def", "ghi")]
    runs = {}
    for path in RUNS:
        conductor = engine(testfamily_plan, path, cap=4)
        handoffs = snapshot_handoffs(conductor)
        runs[path] = (run(conductor, requests), handoffs)
    (got, kv_c), (want, kv_g) = runs["cohort"], runs["generic"]
    for rid in kv_g:
        torch.testing.assert_close(kv_c[rid], kv_g[rid], **TOL)
    for c, g in zip(got, want):
        assert_same(c, g)


# ---------------------------------------------------------------------------- max_new = 1
def test_a_loop_whose_prefill_already_said_stop_applies_nothing(testfamily_plan: Path) -> None:
    """max_new = 1: the prefill's `done` is true when the row joins; it leaves with nothing of
    the loop applied (no token, no code, its KV truncated: continue sees the same context)."""
    requests = [("chat", {"prompt": "one", "max_new": 1}), ("generate_fixed", {"prompt": "xyz", "max_new": 1}),
                ("generate_left", {"prompt": "left", "max_new": 1}),
                ("generate_left", {"prompt": "long", "max_new": 9})]
    cohort, generic = engine(testfamily_plan, "cohort"), engine(testfamily_plan, "generic")
    got, want = run(cohort, requests), run(generic, requests)
    hop = int(cohort.plan.node_spec("codec").config["hop"])
    assert joined_loops(cohort) == marked_loops(cohort, ["chat", "continue", "generate_fixed", "generate_left"])
    for c, g in zip(got, want):
        assert c.state == FINISHED, c.error
        assert_same(c, g)
    assert got[0].walks_done == ["chat", "continue"]  # continue takes chat's max_new = 1 too
    assert got[0].outputs["tokens"].shape == (1,)
    for h in got[1:3]:
        assert h.outputs["tokens"].shape == (1,) and h.outputs["audio"].shape == (hop,)


def test_a_loop_whose_prefill_already_said_stop_wastes_one_step(testfamily_plan: Path) -> None:
    (h,) = run(engine(testfamily_plan, "cohort"), [("generate_fixed", {"prompt": "xyz", "max_new": 1})])
    assert h.state == FINISHED and h.stats.wasted_steps <= 1


def test_request_stats_count_the_cohort_steps(testfamily_plan: Path) -> None:
    request = ("generate_fixed", {"prompt": "count me", "max_new": 9})
    (c,) = run(engine(testfamily_plan, "cohort"), [request])
    (g,) = run(engine(testfamily_plan, "generic"), [request])
    assert c.stats.wasted_steps == g.stats.wasted_steps == 1
    assert c.stats.steps == g.stats.steps


def test_a_row_that_reaches_max_seq_len_leaves_like_a_generic_one(tmp_path: Path) -> None:
    # the test family with max_context = max_seq_len = 48: TinyLM raises `done` at the pool's limit
    text = (ROOT / "models/testfamily/testfamily.walk").read_text()
    assert "    max_context = 96\n" in text
    text = text.replace("    max_context = 96\n", "    max_context = 48\n")
    at = text.index("    max_batch = max_batch\n", text.index("node lm : kv"))
    walk = tmp_path / "testfamily.walk"
    walk.write_text(text[:at] + "    max_seq_len = max_context\n" + text[at:])
    plan = _compile(walk, ROOT / "placements/cpu.yaml", tmp_path / "tf48.plan")
    assert load_plan(plan, device="cpu").kv_pool("lm", 0).max_seq_len == 48
    requests = [("chat", {"prompt": "a", "max_new": 30}), ("generate_fixed", {"prompt": "x" * 30, "max_new": 30})]
    want = run(engine(plan, "generic"), requests)
    assert want[1].outputs["tokens"].shape[0] < 30  # it stopped at the context limit
    got = run(engine(plan, "cohort"), requests)
    for c, g in zip(got, want):
        assert_same(c, g)


# ---------------------------------------------------------------------------- several ranks
RANKS = [
    ("chat", {"prompt": "hi there", "max_new": 6}),
    ("generate_fixed", {"prompt": "fixed chunks", "max_new": 11}),
    ("generate_left", {"prompt": "left context, a longer prompt than the inline limit", "max_new": 17}),
    ("generate", {"prompt": "a", "max_new": 3}),
    ("generate_fixed", {"prompt": "xyz", "max_new": 1}),
    ("flow", {"prompt": "a cat", "negative": "blur", "steps": 3, "seed": 7}),
]


@pytest.mark.parametrize("world", [2, 3], ids=["2ranks-lm-on-rank-1", "3ranks-lm-on-rank-0"])
def test_several_ranks_equal_one_rank_on_the_cohort_path(
    testfamily_plan: Path, rank_plans: dict[int, Path], world: int
) -> None:
    """cpu3 keeps the LM on rank 0, cpu2 puts it on a worker process (its cohort calls are
    messages, worker/remote_cohort.py): either way its loops are cohorts, and the outputs are
    one rank's cohort bits."""
    one = {every: run(engine(testfamily_plan, "cohort", preempt_every=every), RANKS) for every in (None, 5)}
    plan = load_plan(rank_plans[world], device="cpu")
    workers = start_workers(plan, TF_WEIGHTS, "cpu")
    try:
        for every in (None, 5):
            conductor = Conductor(plan, workers, overlap=False, preempt_every=every)
            got = run(conductor, RANKS)
            assert conductor.stats["cohort_steps"] > 0
            if every:
                assert conductor.stats["preemptions"] > 0
            for h, ref in zip(got, one[every]):
                assert h.state == FINISHED, h.error
                assert_same(h, ref, exact=True)
    finally:
        shutdown_workers(workers)


def test_several_ranks_equal_one_rank_on_the_per_iteration_path(testfamily_plan: Path,
                                                                 rank_plans: dict[int, Path]) -> None:
    """The LM on a worker process (cpu2) with its plan's loops unmarked: each decode is a plain
    step message, run there through ops/column_call.py; the outputs are one rank's."""
    one = run(engine(testfamily_plan, "generic"), RANKS)
    plan = load_plan(rank_plans[2], device="cpu")
    workers = start_workers(plan, TF_WEIGHTS, "cpu")
    try:
        conductor = Conductor(without_cohorts(plan), workers, overlap=False)
        got = run(conductor, RANKS)
        assert conductor.stats["cohort_steps"] == 0
        for h, ref in zip(got, one):
            assert h.state == FINISHED, h.error
            assert_same(h, ref, exact=True)
    finally:
        shutdown_workers(workers)
