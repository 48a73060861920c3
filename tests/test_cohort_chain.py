"""Chained cohort marks: a loop whose body is several kv calls (issue 24, section 1).

The compiler marks such a loop with `{"links": [mark, ...]}`, one single-call mark per call
in body order, each with `chained` where it takes an earlier call's result of the same
iteration (docs/plan-format.md, "Cohort loops"); the plan then requires `cohort_chains`.
The runtime loads such plans and, for now, runs the loop on the generic path, iteration by
iteration (docs/runtime.md, "Decode cohorts": chains), so the plan as compiled and without
its marks (`without_cohorts`) give the same outputs, and no cohort forms for the loop.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from support import as_run
from test_cohort_cases import _engine, _run, _same, _with_walks
from test_cohort_mark import compile_walk, loops

from mstar_runtime.control.conductor import FINISHED
from mstar_runtime.plan import loader
from mstar_runtime.plan.loader import PlanError, load_plan, planfile
from mstarc.cli import main as mstarc
from mstarc.cohorts import cohort_mark, why_not
from mstarc.explain import program_lines

MODEL = """\
model m {
  variant tiny { }
  node lm : kv = m.LM {
    arch llama(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, vocab=64)
    in prompt : i32[T]
    in token : i32[1]
    in temperature : float
    out token : i32[1]
    out done : bool
    out hidden : f32[1, 16]
    phase prefill(prompt) -> (token, done, hidden)
    phase decode(token, temperature) -> (token, done, hidden)
  }
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
  walk chain(prompt: str, max_new: int = 8) -> (tokens: i32[N], echoed: i32[M]) {
    ids = prompt.encode(text = prompt)
    token, code, done, h = lm.prefill(tokens = ids, max_new = max_new) @main
    e0, c0, d0, h0 = lm2.prefill(tokens = ids, max_new = max_new_tokens)
    emit tokens += token
    dynamic_loop max = max_new_tokens until done carry token, done {
      token, c, done, hid = lm.decode(token = token) @main
      e, c2, d2, h2 = lm2.decode(token = token)
      emit tokens += token
      emit echoed += e
    }
  }
"""

CHAINS = [("chain", {"prompt": f"chain {i} " * (1 + i % 3), "max_new": m}) for i, m in enumerate([1, 3, 8, 5, 12])]


def test_a_chain_runs_on_the_generic_path_for_now(chain_plan: Path) -> None:
    """The marked chain loads and runs iteration by iteration: no cohort forms for it, and its
    outputs are the unmarked plan's, batched or alone (rows that finish early: max_new 1)."""
    plan = load_plan(chain_plan, device="cpu")
    (loop,) = (op for op in loader.iter_ops(plan.walk("chain")["program"]) if op["op"] == "loop")
    assert [link["call"] for link in loop["cohort"]["links"]] == ["chain.s4", "chain.s5"]
    cohort, generic = _engine(chain_plan, "cohort"), _engine(chain_plan, "generic")
    got, want = _run(cohort, CHAINS), _run(generic, CHAINS)
    assert cohort.stats["cohort_steps"] == 0 and not cohort.cohorts  # the chain stayed generic
    alone = [_run(_engine(chain_plan, "cohort"), [r])[0] for r in CHAINS]
    for c, g, a in zip(got, want, alone, strict=True):
        assert c.state == FINISHED, c.error
        _same(c, g)
        _same(a, g)
    assert [int(c.outputs["echoed"].numel()) for c in got] == [0, 2, 7, 4, 11]


def test_without_cohorts_unmarks_a_chain(chain_plan: Path) -> None:
    bare = as_run(load_plan(chain_plan, device="cpu"), "generic")
    assert all(op["cohort"] is None for op in loader.iter_ops(bare.walk("chain")["program"]) if op["op"] == "loop")


def test_the_shipped_plan_names_the_feature(chain_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cohort_chains" in planfile.read(chain_plan)["requires"]
    assert mstarc(["explain", str(chain_plan)]) == 0
    assert "[cohort chain: chain.s4 fed token<-token | chain.s5 fed none, chained token<-chain.s4.token]" in \
        capsys.readouterr().out


def test_a_wasted_iteration_runs_the_chains_first_call_only(chain_plan: Path) -> None:
    """What a chained cohort must match (docs/runtime.md, "Decode cohorts": chains): the
    generic loop reads iteration i's flag once iteration i+1's first call is back, so a
    stopped row's wasted iteration runs `lm.decode` and never `lm2.decode`: lm2 decodes once a
    valid iteration, lm once more per request."""
    conductor = _engine(chain_plan, "generic")
    got = _run(conductor, CHAINS)
    assert all(h.state == FINISHED for h in got)
    entries = {phase: s["entries"] for phase, s in conductor.workers[0].stats()["nodes"]["lm2"].items()}
    lm = conductor.workers[0].stats()["nodes"]["lm"]["decode"]["entries"]
    valid = sum(int(h.outputs["echoed"].numel()) for h in got)
    assert entries["decode"] == valid and lm == valid + sum(h.stats.wasted_steps for h in got)
    assert sum(h.stats.wasted_steps for h in got) == len(CHAINS)  # each row's flag ended its loop
