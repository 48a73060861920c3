"""Chained cohort marks: a loop whose body is several kv calls (issue 24, section 1).

The compiler marks such a loop with `{"links": [mark, ...]}`, one single-call mark per call
in body order, each with `chained` where it takes an earlier call's result of the same
iteration (docs/plan-format.md, "Cohort loops"); the plan then requires `cohort_chains`.
The runtime runs such a loop as one cohort whose rows are aligned across one column set per
call (engine/cohort_chain.py; docs/runtime.md, "Decode cohorts": chains), in the conductor's
process or in a worker process (its calls typed messages); elsewhere (a TP group) the
interpreter runs it. Either way the plan as compiled and without its marks
(`without_cohorts`) give the same outputs: batched or alone, rows joining at different
steps, finishing at once, cancelled, preempted, on a small pool.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import as_run
from test_cohort_cases import MOVED_PLACEMENT, _engine, _run, _same, _with_walks
from test_cohort_mark import LM_NODE, compile_walk, loops

from mstar_runtime.control.cohort import Cohort
from mstar_runtime.control.conductor import CANCELLED, FINISHED, Conductor
from mstar_runtime.ops.readback import Lazy
from mstar_runtime.plan import loader
from mstar_runtime.plan.loader import PlanError, load_plan, planfile
from mstar_runtime.worker.remote import RemoteWorker
from mstar_runtime.worker.startup import shutdown_workers, start_workers
from mstar_runtime.worker.tp_dispatch import TPCohort
from mstar_runtime.worker.worker import Worker
from mstarc.cli import main as mstarc
from mstarc.cohorts import cohort_mark, why_not
from mstarc.explain import program_lines

MODEL = """\
model m {
  variant tiny { }
""" + LM_NODE + """\
  node talk : kv = m.LM {
    arch llama(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, vocab=64)
    in prompt : i32[T]
    in text : i32[1]
    out code : i32[1]
    out finished : bool
    phase prefill(prompt) -> (code, finished)
    phase frame(text) -> (code, finished)
  }
  edge lm.token -> talk.text
  edge talk.code -> lm.token
%s
}
"""

WALKS = {
    # thinker step, then a frame of the token it just sampled (Qwen3-Omni's speech loop)
    "chain": """chain(prompt: i32[T], temperature: float = 0.7) -> (tokens: i32[N], codes: i32[M]) {
    token, done, h = lm.prefill(prompt=prompt)
    c0, f0 = talk.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=temperature)
      code, finished = talk.frame(text=token)
      emit tokens += token
      emit codes += code
    }
  }""",
    # the flag is the second call's; accs before, between and after the calls
    "accs": """accs(prompt: i32[T]) -> (a: i32[N], b: i32[M], c: i32[K]) {
    token, done, h = lm.prefill(prompt=prompt)
    code, finished = talk.prefill(prompt=prompt)
    dynamic_loop max=8 until finished carry token, done, code, finished {
      acc before += token
      token, done, hid = lm.decode(token=token, temperature=1.0)
      acc between += code
      code, finished = talk.frame(text=token)
      acc after += code
    }
    emit a = before
    emit b = between
    emit c = after
  }""",
    # the first call takes the second's carried result: fed back across links
    "across": """across(prompt: i32[T]) -> (tokens: i32[N]) {
    t0, done, h = lm.prefill(prompt=prompt)
    code, f0 = talk.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry code, done {
      token, done, hid = lm.decode(token=code, temperature=1.0)
      code, finished = talk.frame(text=token)
      emit tokens += token
    }
  }""",
    # one node twice a step
    "twice": """twice(prompt: i32[T]) -> (tokens: i32[N]) {
    token, done, h = lm.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=1.0)
      t2, d2, h2 = lm.decode(token=token, temperature=0.5)
      emit tokens += t2
    }
  }""",
}

CHAIN = {"links": [
    {"call": "chain.s3", "fed": [["token", "token"]], "invariant": ["temperature"], "emits": [["tokens", "token"]]},
    {"call": "chain.s4", "fed": [], "invariant": [], "emits": [["codes", "code"]], "chained": [["text", 0, "token"]]},
]}


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The walks compiled as one model: the plan body, and each walk's one loop op by WALKS key."""
    d = tmp_path_factory.mktemp("chain")
    src = d / "m.walk"
    src.write_text(MODEL % "\n".join(f"  walk {w}" for w in WALKS.values()))
    body = compile_walk(src, d / "m.plan")
    by_id = loops(body)
    return body, {name: by_id[f"{w.split('(', 1)[0]}.l1"] for name, w in WALKS.items()}


# ------------------------------------------------------------------------------ the compiler
def test_a_body_of_two_kv_calls_is_a_chain(hand: tuple[dict[str, Any], dict[str, Any]]) -> None:
    body, ops = hand
    assert ops["chain"]["cohort"] == CHAIN and why_not(ops["chain"]) is None
    assert body["requires"] == ["cohort_accs", "cohort_chains"]  # `accs` in a link counts too
    (line,) = [text for _, text in program_lines(ops["chain"]) if text.startswith("dynamic_loop")]
    assert line.endswith("[cohort chain: chain.s3 fed token<-token, invariant temperature | "
                         "chain.s4 fed none, chained text<-chain.s3.token]")


def test_a_chains_flag_and_accs_may_be_any_links(hand: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """`before` accumulates the token each iteration starts with (link 0, "in"); `between` the
    code it starts with (link 1's, "in": the frame has not run yet); `after` the new code."""
    mark = hand[1]["accs"]["cohort"]
    assert mark == {"links": [
        {"call": "accs.s3", "fed": [["token", "token"]], "invariant": ["temperature"], "emits": [],
         "accs": [["before", "token", "in"]]},
        {"call": "accs.s4", "fed": [], "invariant": [], "emits": [],
         "accs": [["between", "code", "in"], ["after", "code", "out"]], "chained": [["text", 0, "token"]]},
    ]}


def test_what_is_no_chain_says_why(hand: tuple[dict[str, Any], dict[str, Any]]) -> None:
    ops = hand[1]
    assert ops["across"]["cohort"] is None and why_not(ops["across"]) == (
        "argument token=code of across.s3 is fed back from across.s4, a later call "
        "(a chain feeds a call back only its own results)")
    assert ops["twice"]["cohort"] is None and why_not(ops["twice"]) == \
        "its calls twice.s2 and twice.s3 are both on node lm (a chain's calls are on distinct nodes)"

    def broken(edit: Any) -> str | None:
        loop = copy.deepcopy(ops["chain"])
        edit(loop["body"]["body"])
        assert cohort_mark(loop) is None
        return why_not(loop)

    assert broken(lambda b: b[1].update(ranks=[1])) == "its call chain.s4 runs on ranks [1], not on chain.s3's [0]"
    assert broken(lambda b: b[1].update(results=[["code", "token"], ["finished", "finished"]])) == \
        "its calls chain.s3 and chain.s4 both bind token"
    assert broken(lambda b: b.insert(1, b.pop(3))) == "emit codes is not a result of chain.s3"  # before its call
    assert broken(lambda b: b.insert(1, {"op": "fork", "node": "lm", "src": "main", "dst": "x"})) == \
        "its body has a fork op besides its calls, its emits and accs"
    assert broken(lambda b: b[1].update(tag=None)) == \
        "its call chain.s4 is talk.frame, a stateless node's (a chain's calls are kv calls)"


def test_a_chain_on_the_corpus_is_qwen3_omnis_speech_loop(tmp_path: Path) -> None:
    body = compile_walk(Path(__file__).resolve().parents[1] / "models/qwen3_omni/qwen3_omni.walk", tmp_path / "q.plan")
    mark = loops(body)["speech.l1"]["cohort"]
    assert [link["call"] for link in mark["links"]] == ["speech.s7", "speech.s8"]
    assert mark["links"][1]["chained"] == [["text", 0, "item"]]  # the thinker step's item, this iteration's
    assert "cohort_chains" in body["requires"]


# -------------------------------------------------------------------------------- the loader
def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    body = planfile.read(src)
    edit(loops(body)["chain.l1"]["cohort"])
    planfile.write(dst, body)
    return dst


@pytest.fixture(scope="module")
def chain_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test family with a second kv node and a loop of a decode and that node's decode of
    the token just sampled, compiled for the CPU."""
    return _with_walks(FAMILY_CHAIN, tmp_path_factory.mktemp("chain-family") / "chain.plan")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["links"][1].update(chained=[["token", 1, "token"]]),
     "its cohort chains lm2.decode's 'token' to link 1, not an earlier link of the chain"),
    (lambda m: m["links"][1].update(chained=[["token", 0, "pcm"]]),
     "its cohort chains lm2.decode's 'token' to output 'pcm', which link 0 does not produce"),
    (lambda m: m["links"][1].update(chained=[["tokn", 0, "token"]]),
     "its cohort chains input 'tokn', which lm2.decode does not take"),
    (lambda m: m["links"][1].update(call="chain.s4"), "its cohort names a call twice"),
    (lambda m: m["links"].pop(), "walks.chain.program.body[4].cohort.links has 1 items; expected 2..64"),
])
def test_loader_rejects_a_corrupted_chain(chain_plan: Path, tmp_path: Path, edit: Any, message: str) -> None:
    bad = _rewrite(chain_plan, tmp_path / "bad.plan", edit)
    with pytest.raises(PlanError) as info:
        load_plan(bad)
    where = "" if message.startswith("walks.") else "walk 'chain' loop 'chain.l1': "
    assert str(info.value) == f"{bad}: invalid plan: {where}{message}"


def test_a_runtime_without_the_feature_refuses_a_chain(chain_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that knew only single-call marks would step the first call alone: it must refuse."""
    monkeypatch.setattr(loader, "SUPPORTED_FEATURES", loader.SUPPORTED_FEATURES - {"cohort_chains"})
    with pytest.raises(PlanError, match="this plan requires cohort_chains, which this runtime does not implement"):
        load_plan(chain_plan)


# -------------------------------------------------------------------------------- the runtime
FAMILY_CHAIN = """
  // A second LM that decodes, each step, the token the first one just sampled.
  node lm2 : kv = testfamily.TinyLM {
    arch llama(layers = layers, hidden = hidden, heads = heads, kv_heads = kv_heads,
               head_dim = head_dim, intermediate = intermediate, vocab = vocab,
               tie_embeddings = tie_embeddings)
    in tokens : i32[T]
    in max_new : int
    in token : i32[1]
    out token : i32[1]
    out code : i32[K]
    out done : bool
    out hidden : f32[1, hidden]
    phase prefill(tokens, max_new) -> (token, code, done, hidden)
    phase decode(token) -> (token, code, done, hidden)
    max_batch = max_batch
  }
  edge prompt.tokens -> lm2.tokens
  edge lm.token -> lm2.token
  // After the loop lm2 decodes once more on the context the loop left it (its wasted
  // iteration's token truncated, as the generic path leaves it).
  walk chain(prompt: str, max_new: int = 8) -> (tokens: i32[N], echoed: i32[M], hidden: f32[H, hidden]) {
    ids = prompt.encode(text = prompt)
    token, code, done, h = lm.prefill(tokens = ids, max_new = max_new) @main
    e0, c0, d0, h0 = lm2.prefill(tokens = ids, max_new = max_new_tokens)
    emit tokens += token
    dynamic_loop max = max_new_tokens until done carry token, done {
      token, c, done, hid = lm.decode(token = token) @main
      e, c2, d2, h2 = lm2.decode(token = token)
      emit tokens += token
      emit echoed += e
      acc states += h2
    }
    last, lc, ld, lh = lm2.decode(token = token)
    emit echoed += last
    emit hidden = states
  }
  // The flag is the second call's, and an acc takes the value a carried result of the second
  // call has as each iteration starts (before the first call).
  walk chain_flag(prompt: str, max_new: int = 8) -> (tokens: i32[N], echoed: i32[M], starts: i32[K]) {
    ids = prompt.encode(text = prompt)
    token, code, d0, h = lm.prefill(tokens = ids, max_new = max_new_tokens) @main
    e, c0, d2, h0 = lm2.prefill(tokens = ids, max_new = max_new)
    emit tokens += token
    dynamic_loop max = max_new_tokens until d2 carry token, e, d2 {
      acc begun += e
      token, c, done, hid = lm.decode(token = token) @main
      e, c2, d2, h2 = lm2.decode(token = token)
      emit tokens += token
      emit echoed += e
    }
    emit starts = begun
  }
  // lm2 starts on a context of its own prompt (a longer one fills its pool first).
  walk chain_wide(prompt: str, other: str, max_new: int = 8) -> (tokens: i32[N], echoed: i32[M]) {
    ids = prompt.encode(text = prompt)
    wide = prompt.encode(text = other)
    token, code, done, h = lm.prefill(tokens = ids, max_new = max_new) @main
    e0, c0, d0, h0 = lm2.prefill(tokens = wide, max_new = max_new_tokens)
    dynamic_loop max = max_new_tokens until done carry token, done {
      token, c, done, hid = lm.decode(token = token) @main
      e, c2, d2, h2 = lm2.decode(token = token)
      emit tokens += token
      emit echoed += e
    }
  }
"""

CHAINS = [("chain", {"prompt": f"chain {i} " * (1 + i % 3), "max_new": m}) for i, m in enumerate([1, 3, 8, 5, 12])]


def _chain_cohort(conductor: Conductor) -> Cohort:
    (cohort,) = [c for key, c in conductor.cohorts.items() if key[3] == "chain.l1"]
    assert cohort.chain and [link.call["node"] for link in cohort.links] == ["lm", "lm2"]
    return cohort


def _lm2_decodes(conductor: Conductor) -> int:
    """Entries of lm2's plain `decode` calls (not its cohort steps)."""
    return int(conductor.workers[0].stats()["nodes"]["lm2"].get("decode", {}).get("entries", 0))


def test_a_chain_runs_as_one_cohort_with_the_generic_paths_outputs(chain_plan: Path) -> None:
    """Both calls a step, batched or alone, rows of one max_new finishing at once (their first
    step a wasted one), equal the unmarked plan; lm2 runs no plain decode in the loop."""
    plan = load_plan(chain_plan, device="cpu")
    (loop,) = (op for op in loader.iter_ops(plan.walk("chain")["program"]) if op["op"] == "loop")
    assert [link["call"] for link in loop["cohort"]["links"]] == ["chain.s4", "chain.s5"]
    cohort, generic = _engine(chain_plan, "cohort"), _engine(chain_plan, "generic")
    got, want = _run(cohort, CHAINS), _run(generic, CHAINS)
    chain = _chain_cohort(cohort)
    assert chain.stats["joins"] == len(CHAINS) and chain.stats["row_steps"] > chain.stats["steps"]
    assert chain.stats["wasted_steps"] == len(CHAINS) and generic.stats["cohort_steps"] == 0
    assert _lm2_decodes(cohort) == len(CHAINS)  # the one after each loop
    nodes = cohort.workers[0].stats()["nodes"]  # each link's steps counted as a cohort's
    assert nodes["lm"]["decode:cohort"]["steps"] == nodes["lm2"]["decode:cohort"]["steps"] == chain.stats["steps"]
    alone = [_run(_engine(chain_plan, "cohort"), [r])[0] for r in CHAINS]
    for c, g, a in zip(got, want, alone, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)
        _same(a, g)
        assert c.stats.steps == g.stats.steps and c.stats.wasted_steps == g.stats.wasted_steps == 1
    assert [int(c.outputs["echoed"].numel()) for c in got] == [1, 3, 8, 5, 12]
    assert cohort.kv.used_pages() == 0 and chain.n == 0


def test_a_chain_whose_flag_is_its_second_calls(chain_plan: Path) -> None:
    requests = [("chain_flag", {"prompt": f"flag {i}", "max_new": m}) for i, m in enumerate([1, 2, 6, 11])]
    plan = load_plan(chain_plan, device="cpu")
    (loop,) = (op for op in loader.iter_ops(plan.walk("chain_flag")["program"]) if op["op"] == "loop")
    assert loop["cohort"]["links"][1]["accs"] == [["begun", "token", "in"]]
    cohort, generic = _engine(chain_plan, "cohort"), _engine(chain_plan, "generic")
    got, want = _run(cohort, requests), _run(generic, requests)
    (chain,) = [c for key, c in cohort.cohorts.items() if key[3] == "chain_flag.l1"]
    assert chain.stats["joins"] == len(requests) and chain.until_port == "1.done"
    for c, g in zip(got, want, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)
    assert [int(c.outputs["echoed"].numel()) for c in got] == [0, 1, 5, 10]  # max_new - 1: the prefill's one first
    assert [int(c.outputs["starts"].numel()) for c in got] == [0, 1, 5, 10]


def test_a_row_joins_a_chain_on_its_unread_prefill_flag(chain_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose prefill's flag said stop joins beside rows that go on, every flag unread at
    join (the join copies each one's device value into `stopped`, so the later link holds
    that row on its first step), and leaves once that step is launched, with the generic
    path's outputs. The max_new = 1 row's flag, a host True from the node, is handed to the
    join as the device-backed `Lazy` a column prefill gives (ops/column_call.py `rows_of`)."""
    requests = [("chain_flag", {"prompt": f"flag {i}", "max_new": m}) for i, m in enumerate([4, 1, 6])]
    want = _run(_engine(chain_plan, "generic"), requests)
    conductor = _engine(chain_plan, "cohort")
    real = Cohort._join_links
    seen: list[tuple[list[Lazy], list[bool]]] = []

    def join_links(self: Cohort, first: int, rows: Any, members: Any) -> None:
        for m in members:
            if m.pending_flag is True:
                m.pending_flag = Lazy(lambda: True, torch.ones((), dtype=torch.long))
        flags = [m.pending_flag for m in members]
        assert all(isinstance(f, Lazy) and not f.resolved for f in flags)
        real(self, first, rows, members)
        assert not any(f.resolved for f in flags)  # the host read none of them at join
        stopped = conductor.workers[0]._chains[self.key].stopped
        seen.append((flags, stopped[first : first + len(members)].tolist()))

    monkeypatch.setattr(Cohort, "_join_links", join_links)
    got = _run(conductor, requests)
    assert seen and all(f.resolved for flags, _ in seen for f in flags)  # read once a step was launched
    assert [s for _, stopped in seen for s in stopped] == [False, True, False]
    for c, g in zip(got, want, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)
        assert c.stats.steps == g.stats.steps and c.stats.wasted_steps == g.stats.wasted_steps
    assert [int(c.outputs["echoed"].numel()) for c in got] == [3, 0, 5]


def test_rows_join_a_chain_at_different_steps(chain_plan: Path) -> None:
    want = _run(_engine(chain_plan, "generic"), CHAINS)
    conductor = _engine(chain_plan, "cohort")
    handles = []
    for r in CHAINS:  # each request arrives two engine steps after the one before
        handles.append(conductor.submit(*r))
        for _ in range(2):
            conductor.step()
    conductor.run_until_idle()
    assert _chain_cohort(conductor).stats["joins"] == len(CHAINS)
    for h, g in zip(handles, want, strict=True):
        assert h.state == FINISHED, h.error
        _same(h, g)


def test_a_cancelled_row_leaves_every_link_and_the_others_go_on(chain_plan: Path) -> None:
    want = _run(_engine(chain_plan, "generic"), CHAINS)
    conductor = _engine(chain_plan, "cohort")
    handles = [conductor.submit(*r) for r in CHAINS]
    target = handles[4]  # twelve tokens
    for _ in range(200):
        chain = next((c for key, c in conductor.cohorts.items() if key[3] == "chain.l1"), None)
        if chain is not None and any(m.request is target for m in chain.members) and chain.stats["steps"] >= 4:
            break
        assert conductor.step()
    assert conductor.cancel(target.id) and target.state == CANCELLED
    assert all(m.request is not target for m in _chain_cohort(conductor).members)
    conductor.run_until_idle()
    for h, g in zip(handles, want, strict=True):
        if h is not target:
            assert h.state == FINISHED, h.error
            _same(h, g)
    assert conductor.kv.used_pages() == 0


@pytest.mark.parametrize("kw", [{"preempt_every": 1}, {"preempt_every": 3}, {"cap": 6}])
def test_a_chain_survives_preemption_and_a_small_pool(chain_plan: Path, kw: dict[str, int]) -> None:
    requests = [("chain", {"prompt": f"squeeze {i} " + "q" * (4 * i), "max_new": m}) for i, m in enumerate([7, 20, 30, 12])]
    want = _run(_engine(chain_plan, "generic"), requests)
    conductor = _engine(chain_plan, "cohort", **kw)
    got = _run(conductor, requests)
    assert conductor.stats["preemptions"] > 0 and _chain_cohort(conductor).stats["steps"] > 0, kw
    for c, g in zip(got, want, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)


def test_a_row_that_outgrows_a_later_links_pool_fails_naming_that_node(chain_plan: Path) -> None:
    """Two pages of 16 tokens a pool: lm's context fits (3 + 20 tokens), lm2's does not (21 + 20)."""
    requests = [("chain_wide", {"prompt": "ok", "other": "q" * 20, "max_new": 20}),
                ("chain_wide", {"prompt": "ok", "other": "", "max_new": 3})]
    for path in ("cohort", "generic"):
        conductor = _engine(chain_plan, path, cap=2)
        big, small = _run(conductor, requests)
        assert big.state == "failed" and "node 'lm2'" in (big.error or "") and "can never fit" in big.error, \
            (path, big.error)
        assert small.state == FINISHED, (path, small.error)
        assert (conductor.stats["cohort_steps"] > 0) == (path == "cohort")


def test_a_chain_stays_generic_where_no_chained_cohort_runs_it(chain_plan: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that has no chained columns (a TP group's fan-out, a proxy of a worker that
    offers none), or a link whose node offers no column step: the loop runs iteration by
    iteration, as the unmarked plan runs it."""
    assert not hasattr(TPCohort, "cohort_chain_open") and hasattr(RemoteWorker, "cohort_chain_open")
    want = _run(_engine(chain_plan, "generic"), CHAINS)
    real = Worker.cohort_open
    # lm2's columns are refused as a node's without a column step refuses them (TinyLM runs its
    # plain decode from its column step, so the node itself must keep offering it)
    monkeypatch.setattr(Worker, "cohort_open", lambda self, key, node, *a: node != "lm2" and real(self, key, node, *a))
    no_link = _engine(chain_plan, "cohort")
    got = {"no column step": _run(no_link, CHAINS)}
    # lm's link opened before lm2's was refused: its columns are dropped again
    assert not no_link.workers[0]._cohorts and not no_link.workers[0]._chains
    monkeypatch.undo()
    monkeypatch.delattr(Worker, "cohort_chain_open")
    no_chain = _engine(chain_plan, "cohort")
    got["no chained columns"] = _run(no_chain, CHAINS)
    for conductor, (why, handles) in zip((no_link, no_chain), got.items(), strict=True):
        assert conductor.stats["cohort_steps"] == 0, why
        assert _lm2_decodes(conductor) == sum(int(h.outputs["echoed"].numel()) for h in handles), why
        for c, g in zip(handles, want, strict=True):
            assert c.state == FINISHED, (why, c.error)
            _same(c, g)


def test_without_cohorts_unmarks_a_chain(chain_plan: Path) -> None:
    bare = as_run(load_plan(chain_plan, device="cpu"), "generic")
    assert all(op["cohort"] is None for op in loader.iter_ops(bare.walk("chain")["program"]) if op["op"] == "loop")


def test_the_shipped_plan_names_the_feature(chain_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cohort_chains" in planfile.read(chain_plan)["requires"]
    assert mstarc(["explain", str(chain_plan)]) == 0
    assert ("[cohort chain: chain.s4 fed token<-token | chain.s5 fed none, acc states<-hidden (out), "
            "chained token<-chain.s4.token]") in \
        capsys.readouterr().out


def test_a_wasted_iteration_runs_the_chains_first_call_only(chain_plan: Path) -> None:
    """What a chained cohort must match (docs/runtime.md, "Decode cohorts": chains): the
    generic loop reads iteration i's flag once iteration i+1's first call is back, so a
    stopped row's wasted iteration runs `lm.decode` and never `lm2.decode`: lm2 decodes once a
    valid iteration (and once after the loop), lm once more per request."""
    conductor = _engine(chain_plan, "generic")
    got = _run(conductor, CHAINS)
    assert all(h.state == FINISHED for h in got)
    entries = {phase: s["entries"] for phase, s in conductor.workers[0].stats()["nodes"]["lm2"].items()}
    lm = conductor.workers[0].stats()["nodes"]["lm"]["decode"]["entries"]
    valid = sum(int(h.outputs["echoed"].numel()) for h in got) - len(got)  # less the decode after each loop
    assert entries["decode"] == valid + len(got) and lm == valid + sum(h.stats.wasted_steps for h in got)
    assert sum(h.stats.wasted_steps for h in got) == len(CHAINS)  # each row's flag ended its loop


MOVED_CHAIN = """
  walk moved(prompt: str, max_new: int = 8) -> (tokens: i32[N], echoed: i32[M]) {
    ids = prompt.encode(text = prompt)
    token, code, done, h = lm.prefill(tokens = ids, max_new = max_new) @main
    e0, c0, d0, h0 = lm2.prefill(tokens = ids, max_new = max_new_tokens)
    parallel {
      branch dec {
        dynamic_loop max = max_new_tokens until done carry token, done {
          token, c, done, hid = lm.decode(token = token) @main
          e, c2, d2, h2 = lm2.decode(token = token)
          emit tokens += token
          emit echoed += e
        }
      }
      branch other { other_ids = prompt.encode(text = prompt) }
    }
  }
"""


def test_a_chain_whose_contexts_moved_stays_generic(tmp_path: Path) -> None:
    """The loop on rank 1, the prefills on rank 0: the plan moves both contexts into the chain's
    calls, which the generic steps do; the chain runs no cohort, and gives one rank's outputs."""
    placement = tmp_path / "cpu2_moved.yaml"
    placement.write_text(MOVED_PLACEMENT.replace("      lm: {ranks: [0, 1], tp: 1}",
                                                 "      lm: {ranks: [0, 1], tp: 1}\n      lm2: {ranks: [0, 1], tp: 1}"))
    one = _with_walks(FAMILY_CHAIN.split("  // After the loop")[0] + MOVED_CHAIN, tmp_path / "one.plan")
    two = _with_walks(FAMILY_CHAIN.split("  // After the loop")[0] + MOVED_CHAIN, tmp_path / "two.plan", placement)
    plan = load_plan(two, device="cpu")
    (loop,) = (op for op in loader.iter_ops(plan.walk("moved")["program"]) if op["op"] == "loop")
    assert "links" in loop["cohort"] and loop["body"]["body"][-4]["ranks"] == [1]  # marked, on rank 1
    requests = [("moved", {"prompt": f"move me {i}", "max_new": m}) for i, m in enumerate([3, 8, 1])]
    want = _run(_engine(one, "generic"), requests)
    conductor = Conductor(plan, {r: Worker(plan, r, "cpu", "init") for r in (0, 1)})
    got = _run(conductor, requests)
    assert conductor.stats["kv_moves"] >= len(requests) and conductor.stats["cohort_steps"] == 0
    for c, g in zip(got, want, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)


# -------------------------------------------------------------------------------- a worker process
REMOTE_PLACEMENT = """\
placement: cpu2_chain
devices: {count: 2, type: cpu, name: cpu, memory_gib: 4}
kv_memory_fraction: 0.9
page_size: 16
max_batch: 8
default_rank: 0
models:
  testfamily:
    nodes:
      lm: 1
      lm2: 1
"""
REMOTE = CHAINS + [("chain_flag", {"prompt": f"flag {i}", "max_new": m}) for i, m in enumerate([1, 2, 6, 11])]


@pytest.fixture(scope="module")
def remote_chain(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The chain plan with both LMs on rank 1, a worker process (the prompt node on rank 0),
    its workers started once for the module's conductors."""
    d = tmp_path_factory.mktemp("chain-remote")
    (d / "cpu2_chain.yaml").write_text(REMOTE_PLACEMENT)
    plan = load_plan(_with_walks(FAMILY_CHAIN, d / "remote.plan", d / "cpu2_chain.yaml"), device="cpu")
    workers = start_workers(plan, "init", "cpu")
    try:
        yield plan, workers
    finally:
        shutdown_workers(workers)


@pytest.mark.parametrize("kw", [{}, {"overlap": False, "preempt_every": 3}], ids=["overlap", "preempted"])
def test_a_chain_in_a_worker_process_equals_the_generic_path(chain_plan: Path, remote_chain: Any,
                                                             kw: dict[str, Any]) -> None:
    """Both LMs in a worker process: the chain's calls travel as typed messages (ChainOpen,
    each link's CohortJoin and a ChainJoin, ChainStep answered by one packed readback of both
    links, ChainMove, each link's leave), batched, a flag of either link, rows finishing at
    once and at their first step, preempted; the outputs are one rank's generic ones."""
    plan, workers = remote_chain
    want = _run(_engine(chain_plan, "generic", preempt_every=kw.get("preempt_every")), REMOTE)
    conductor = Conductor(plan, workers, **kw)
    got = _run(conductor, REMOTE)
    chain = _chain_cohort(conductor)
    assert isinstance(chain.worker, RemoteWorker) and chain.key[2] == (1,)
    assert chain.stats["row_steps"] > chain.stats["steps"] > 0 and chain.stats["wasted_steps"] >= len(CHAINS)
    if kw.get("preempt_every"):
        assert conductor.stats["preemptions"] > 0
    for c, g in zip(got, want, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)
        assert c.stats.steps == g.stats.steps or kw.get("preempt_every")  # a replay counts its steps again
    assert conductor.kv.used_pages() == 0 and chain.n == 0


def test_a_chain_in_a_worker_process_takes_late_joins_and_a_cancel(chain_plan: Path, remote_chain: Any) -> None:
    plan, workers = remote_chain
    want = _run(_engine(chain_plan, "generic"), CHAINS)
    conductor = Conductor(plan, workers)
    handles = []
    for r in CHAINS:  # each request arrives two engine steps after the one before
        handles.append(conductor.submit(*r))
        for _ in range(2):
            conductor.step()
    target = handles[4]  # twelve tokens, the last to join
    for _ in range(400):
        chain = next((c for key, c in conductor.cohorts.items() if key[3] == "chain.l1"), None)
        if chain is not None and any(m.request is target for m in chain.members) and chain.stats["steps"] >= 8:
            break
        assert conductor.step()
    assert conductor.cancel(target.id) and target.state == CANCELLED
    conductor.run_until_idle()
    assert _chain_cohort(conductor).stats["joins"] == len(CHAINS)
    for h, g in zip(handles[:4], want[:4], strict=True):
        assert h.state == FINISHED, h.error
        _same(h, g)
    assert conductor.kv.used_pages() == 0


# -------------------------------------------------------------------------------- the worker's half
def test_a_padded_chain_step_equals_an_eager_one() -> None:
    """`ChainColumns` over two TinyLMs (b decodes a's token of the same step, read from a's
    device buffer), once eager over exactly n rows and once padded to batch buckets as a graphed
    step is (`CohortGraphs`, run eagerly on the CPU): pad rows of a's buffer are b's pad rows,
    the real rows give the same tokens and hidden states as rows join, leave and cross buckets;
    a row marked stopped leaves b's node columns as they were for one step, in both runs."""
    from test_cohort_graphs import BUCKETS, CONFIG, PAGE, PAGES, PORTS, ROWS

    from mstar_models.testfamily import TinyLM
    from mstar_models.testfamily.family import node_spec
    from mstar_runtime.engine.cohort_chain import ChainColumns
    from mstar_runtime.engine.cohort_engine import (
        CohortColumns,
        CohortGraphs,
        CohortShape,
        ReferenceCohortDecode,
    )
    from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
    from mstar_runtime.kv.attention import paged_attention
    from mstar_runtime.kv.block_manager import BlockManager

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    lms = {"a": TinyLM(node_spec("lm", CONFIG, cpu, torch.float32)).eval(),
           "b": TinyLM(node_spec("lm", CONFIG, cpu, torch.float32, seed=1)).eval()}
    shapes = {"a": CohortShape("decode", (("token", "token"),), (), PORTS["decode"]),
              "b": CohortShape("decode", (), (), PORTS["decode"])}
    runs = ("eager", "padded")
    engines = {(run, n): KVCacheEngine(lm, PAGES, PAGE, torch.float32, cpu, attention_backend=paged_attention,
                                       output_ports=PORTS, graphs={"decode": BUCKETS}, capture_graphs=False)
               for run in runs for n, lm in lms.items()}
    blocks = {key: BlockManager(PAGES, PAGE) for key in engines}
    columns = {}
    for (run, n), e in engines.items():
        graphs = (CohortGraphs(list(BUCKETS), PAGES, lambda b, m, e=e: ReferenceCohortDecode(e.pool, None), capture=False)
                  if run == "padded" else None)
        columns[(run, n)] = CohortColumns(e.pool, lms[n].cohort_phase("decode"), shapes[n], ROWS, 4096 // PAGE + 1, cpu,
                                          scale=None, node=n, q_heads=8, graphs=graphs)
    chains = {run: ChainColumns([columns[(run, "a")], columns[(run, "b")]], ["0.", "1."], [(1, "token", 0, "token")],
                                (0, "done")) for run in runs}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(16, 272, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g) for _ in range(7)]
    rows: list[int] = []

    def join(i: int) -> None:
        for (run, n), c in columns.items():
            key, bm = (f"r{i}", "main"), blocks[(run, n)]
            entry = StepEntry(f"r{i}", None, {"tokens": prompts[i], "max_new": 4000},
                              KVSlots(0, len(prompts[i]), bm.append(key, len(prompts[i])), bm.page_table(key)))
            token = engines[(run, n)].run("prefill", [entry])[0]["token"]
            c.join(len(rows), engines[(run, n)].state(f"r{i}", None), {"token": token} if n == "a" else {}, {},
                   bm.page_table(key), bm.seq_len(key))
        for chain in chains.values():
            chain.join(len(rows), [False])
        rows.append(i)

    def leave(row: int) -> None:
        last = len(rows) - 1
        for chain in chains.values():
            for c in chain.links:
                if row != last:
                    c.move(last, row)
                c.n = last
            if row != last:
                chain.move(last, row)
        rows[row] = rows[last]
        rows.pop()

    def grow(n: int) -> None:  # a page for each row whose next token starts one
        for (run, name), c in columns.items():
            bm = blocks[(run, name)]
            need = [r for r in range(n) if c.host_lens[r] % PAGE == 0]
            pages = [bm.add_page((f"r{rows[r]}", "main")) for r in need]
            c.add_pages(np.array(need, dtype=np.int64), c.host_lens[need] // PAGE, np.array(pages, dtype=np.int64))

    plan = [("join", 0), ("step", 3), ("join", 1), ("join", 2), ("step", 6), ("join", 3), ("join", 4),
            ("leave", 1), ("step", 4), ("join", 5), ("join", 6), ("step", 5), ("leave", 0), ("step", 3)]
    for what, arg in plan:
        if what in ("join", "leave"):
            (join if what == "join" else leave)(arg)
            continue
        for _ in range(arg):
            n = len(rows)
            grow(n)
            out = {run: chain.step(n).arrays() for run, chain in chains.items()}
            for key in ("0.token", "1.token"):
                assert np.array_equal(out["eager"][key], out["padded"][key]), key
            for key in ("0.hidden", "1.hidden"):
                torch.testing.assert_close(torch.from_numpy(out["padded"][key]), torch.from_numpy(out["eager"][key]),
                                           atol=1e-5, rtol=1e-5)
    assert columns[("padded", "b")].graphs.replays > 0
    # a row stopped while the others go on: b's node columns of that row are put back after
    # b's step (eagerly, and inside the padded step, as inside its graph), the others' kept;
    # the step's own flag (a's `done`) stops no row, so the next step holds none
    n = len(rows)
    for run, chain in chains.items():
        b = columns[(run, "b")]
        b.cols["max_new"][:n] = torch.arange(n)
        chain.stopped[:n] = False
        chain.stopped[1] = True

        def bumping(batch: Any, real: Any = b.cphase.step) -> dict[str, torch.Tensor]:  # a step that moves a node column
            batch.cols["max_new"].add_(100)
            return real(batch)

        b.cphase = dataclasses.replace(b.cphase, step=bumping)
        grow(n)
        first = chain.step(n).arrays()
        assert b.cols["max_new"][:n].tolist() == [100 + r if r != 1 else 1 for r in range(n)], run
        assert not first["0.done"].any() and not chain.stopped[:n].any(), run
        grow(n)
        chain.step(n)
        assert b.cols["max_new"][:n].tolist() == [200 + r if r != 1 else 101 for r in range(n)], run
