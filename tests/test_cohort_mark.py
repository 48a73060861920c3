"""The `schedule` pass marks steady-state loops ("decode cohorts"); `load_plan` checks the mark.

The rule is in the Ensures of `mstarc/passes/schedule.py` and in docs/plan-format.md
("Cohort loops"): one call, then append-mode emits of its results; every
argument a const, a carried result of that call, the loop's index (the mark's `index`) or a
value bound outside the loop; accs of the call's results; a dynamic loop's flag is a result of
the call.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mstar_runtime.plan.loader import PlanError, iter_ops, load_plan, planfile
from mstarc.cli import main
from mstarc.cohorts import cohort_mark, why_not

ROOT = Path(__file__).resolve().parent.parent


def compile_walk(source: Path, out: Path, variant: str = "tiny", placement: str = "cpu") -> dict[str, Any]:
    args = ["compile", str(source), "--variant", variant, "-p", str(ROOT / f"placements/{placement}.yaml"),
            "-o", str(out), "--verify-each"]
    assert main(args) == 0
    return planfile.read(out)


def loops(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every loop op of every walk, by loop id."""
    return {op["id"]: op for w in body["walks"].values() for op in iter_ops(w["program"]) if op["op"] == "loop"}


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cohort") / "orpheus.plan"
    compile_walk(ROOT / "models/orpheus/orpheus.walk", out)
    return out


@pytest.fixture(scope="module")
def testfamily(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compile_walk(ROOT / "models/testfamily/testfamily.walk", tmp_path_factory.mktemp("cohort") / "tf.plan")


# ------------------------------------------------------------------------------ the compiler
def test_orpheus_decode_loop_is_a_cohort(orpheus: Path) -> None:
    body = planfile.read(orpheus)
    assert body["schema"] == {"major": 1, "minor": planfile.SCHEMA_MINOR} and planfile.SCHEMA_MINOR >= 1
    (loop,) = loops(body).values()
    assert loop["id"] == "tts.l1"
    assert loop["cohort"] == {"call": "tts.s3", "fed": [["token", "token"]], "invariant": [],
                              "emits": [["codes", "code"]]}
    call = loop["body"]["body"][0]
    assert (call["id"], call["node"], call["phase"]) == ("tts.s3", "llm", "decode")


def test_testfamily_marks_the_plain_decode_loops_only(testfamily: dict[str, Any]) -> None:
    marks = {lid: op["cohort"] for lid, op in loops(testfamily).items()}
    decode = {"fed": [["token", "token"]], "invariant": [], "emits": [["tokens", "token"]]}
    # generate_fixed / generate_left / chat / continue: decode(token=token), carry token, emit tokens += token
    assert marks == {
        "chat.l1": {"call": "chat.s3", **decode},
        "continue.l1": {"call": "continue.s3", **decode},
        "generate_fixed.l1": {"call": "generate_fixed.s3", **decode},
        "generate_left.l1": {"call": "generate_left.s3", **decode},
        # `acc states += hid`: every iteration's `hidden`, kept on the host by the cohort
        "generate.l1": {"call": "generate.s3", **decode, "accs": [["states", "hidden", "out"]]},
        "flow.l1": None,  # `acc traj += x`, `index i`, three calls (two stateless) and a parallel
    }
    ops = loops(testfamily)
    assert why_not(ops["flow.l1"]) == "its call flow.s6 is flow.time, a stateless node's (a chain's calls are kv calls)"
    for lid in ("chat.l1", "continue.l1", "generate_fixed.l1", "generate_left.l1"):
        assert why_not(ops[lid]) is None


def test_marks_are_deterministic(testfamily: dict[str, Any], tmp_path: Path) -> None:
    again = compile_walk(ROOT / "models/testfamily/testfamily.walk", tmp_path / "again.plan")
    assert planfile.dump_body(again) == planfile.dump_body(testfamily)


# the decoding LM node of the test models here and in tests/test_cohort_chain.py
LM_NODE = """\
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
"""

MODEL = """\
model m {
  variant tiny { }
""" + LM_NODE + """\
  node tok : stateless = m.Tok {
    in token : i32[1]
    out piece : str
    phase detokenize(token) -> (piece)
  }
  edge lm.token -> tok.token
%s
}
"""

WALKS = {
    # marked: `temperature` is an input of the walk (invariant), `token` is fed back
    "cohort": """plain(prompt: i32[T], temperature: float = 0.7) -> (tokens: i32[N]) {
    token, done, h = lm.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=temperature)
      emit tokens += token
    }
  }""",
    # a fixed loop with a const argument qualifies too
    "fixed": """fixed(prompt: i32[T]) -> (tokens: i32[N]) {
    token, done, h = lm.prefill(prompt=prompt)
    loop n=4 carry token {
      token, d, hid = lm.decode(token=token, temperature=0.5)
      emit tokens += token
    }
  }""",
    "two_calls": """two(prompt: i32[T]) -> (tokens: i32[N], text: str) {
    token, done, h = lm.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=1.0)
      piece = tok.detokenize(token=token)
      emit tokens += token
      emit text += piece
    }
  }""",
    "acc": """acc(prompt: i32[T]) -> (tokens: i32[N], hidden: f32[M, 16]) {
    token, done, h = lm.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=1.0)
      emit tokens += token
      acc states += hid
    }
    emit hidden = states
  }""",
}


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The hand-written walks compiled as one model: each walk's one loop op, by WALKS key."""
    d = tmp_path_factory.mktemp("hand")
    src = d / "m.walk"
    src.write_text(MODEL % "\n".join(f"  walk {w}" for w in WALKS.values()))
    by_id = loops(compile_walk(src, d / "m.plan"))
    walk_of = {name: w.split("(", 1)[0] for name, w in WALKS.items()}
    return {name: by_id[f"{walk}.l1"] for name, walk in walk_of.items()}


def test_hand_written_cohort_with_an_invariant_port(hand: dict[str, dict[str, Any]]) -> None:
    assert hand["cohort"]["cohort"] == {"call": "plain.s2", "fed": [["token", "token"]],
                                        "invariant": ["temperature"], "emits": [["tokens", "token"]]}
    assert hand["fixed"]["dynamic"] is False
    assert hand["fixed"]["cohort"] == {"call": "fixed.s2", "fed": [["token", "token"]],
                                       "invariant": ["temperature"], "emits": [["tokens", "token"]]}


def test_a_stateless_second_call_is_not_a_cohort_and_an_acc_is_kept(hand: dict[str, dict[str, Any]]) -> None:
    assert hand["two_calls"]["cohort"] is None
    # a chain's calls are kv calls (tests/test_cohort_chain.py): `tok` is stateless
    assert why_not(hand["two_calls"]) == \
        "its call two.s3 is tok.detokenize, a stateless node's (a chain's calls are kv calls)"
    assert hand["acc"]["cohort"] == {"call": "acc.s2", "fed": [["token", "token"]], "invariant": ["temperature"],
                                     "emits": [["tokens", "token"]], "accs": [["states", "hidden", "out"]]}


def test_an_acc_before_the_call_accumulates_what_each_iteration_starts_with(hand: dict[str, Any]) -> None:
    """Whisper's decode loop: `acc fed += token` before `token = decoder.step(token = token)`
    takes the carried token each iteration starts from ("in"); an acc of anything else
    before the call, or of something the call does not bind after it, unmarks the loop."""
    loop = copy.deepcopy(hand["acc"])
    body = loop["body"]["body"]
    acc = next(op for op in body if op["op"] == "acc")
    body.remove(acc)
    body.insert(0, {"op": "acc", "name": "states", "value": {"var": "token"}})
    assert cohort_mark(loop)["accs"] == [["states", "token", "in"]]
    body[0]["value"] = {"var": "h"}  # bound before the loop, never by the call
    assert why_not(loop) == "acc states accumulates h, not a carried result of the loop's call"
    body[0]["value"] = {"var": "hid"}  # a result, but not carried: its value before the call is the last one's
    assert why_not(loop) == "acc states accumulates hid, not a carried result of the loop's call"
    after = copy.deepcopy(hand["acc"])
    next(op for op in after["body"]["body"] if op["op"] == "acc")["value"] = {"const": 1}
    assert why_not(after) == "acc states accumulates a constant, not a result of the loop's call"
    twice = copy.deepcopy(hand["acc"])
    twice["body"]["body"].append({"op": "acc", "name": "states", "value": {"var": "hid"}})
    assert why_not(twice) == "its accumulations are not one acc op each in its body"


def test_each_rule_unmarks(hand: dict[str, dict[str, Any]]) -> None:
    """Edit a qualifying loop op so it breaks one rule at a time: each edit unmarks it."""
    base = hand["cohort"]
    assert cohort_mark(base) == base["cohort"] and why_not(base) is None

    def broken(edit: Any) -> str | None:
        loop = copy.deepcopy(base)
        edit(loop, loop["body"]["body"][0])
        assert cohort_mark(loop) is None
        return why_not(loop)

    indexed = copy.deepcopy(base)  # the index as an argument: a column counted per row
    indexed["index"] = "i"
    assert cohort_mark(indexed) == base["cohort"]  # an index the call does not take changes nothing
    indexed["body"]["body"][0]["args"]["temperature"] = {"var": "i"}
    mark = cohort_mark(indexed)
    assert mark is not None and mark["index"] == ["temperature"] and "temperature" not in mark["invariant"]
    tp = copy.deepcopy(base)
    tp["body"]["body"][0].update(ranks=[0, 1])  # a tensor-parallel group: every rank runs the column step
    assert cohort_mark(tp) == base["cohort"] and why_not(tp) is None
    assert broken(lambda lp, c: lp.update(carry=["done"])) == \
        "argument token=token is rebound in the body but not carried"
    assert broken(lambda lp, c: lp.update(until="stop")) == "its flag stop is not a result of plain.s2"
    assert broken(lambda lp, c: lp["body"]["body"][1].update(mode="set")) == \
        "it sets output tokens (only append-mode emits qualify)"
    assert broken(lambda lp, c: lp["body"]["body"][1].update(value={"const": 1})) == \
        "emit tokens is not a result of plain.s2"
    assert broken(lambda lp, c: lp["body"]["body"].insert(0, {"op": "transfer", "value": "token",
                                                             "src": 0, "dst": 1})) == \
        "its body moves token to rank 1, not an argument of plain.s2 there"
    assert broken(lambda lp, c: lp["body"]["body"].insert(0, {"op": "transfer", "value": "hidden",
                                                             "src": 1, "dst": 0})) == \
        "its body moves hidden to rank 0, not an argument of plain.s2 there"
    assert broken(lambda lp, c: lp["body"]["body"].insert(1, {"op": "transfer", "value": "token",
                                                             "src": 1, "dst": 0})) == \
        "its body has a transfer op besides the call, its emits and accs"
    assert broken(lambda lp, c: lp["body"].update(body=[{"op": "transfer", "value": "token", "src": 1,
                                                         "dst": 0}])) == \
        "its body does not start with a call (it starts with nothing)"
    assert broken(lambda lp, c: c.update(feeds=[{"stream": "s", "port": "nope", "var": "x"}])) == \
        "plain.s2 feeds nope, which is not one of its results"


def test_a_transfer_into_the_call_keeps_the_mark(hand: dict[str, dict[str, Any]]) -> None:
    """A carried argument first bound on another rank is moved to the call's rank before the
    call (schedule puts the transfer in the body): the loop is still a cohort, the same one."""
    loop = copy.deepcopy(hand["cohort"])
    call = loop["body"]["body"][0]
    loop["body"]["body"].insert(0, {"op": "transfer", "value": "token", "src": 1, "dst": call["ranks"][0]})
    assert why_not(loop) is None and cohort_mark(loop) == hand["cohort"]["cohort"]


# -------------------------------------------------------------------------------- the loader
def rewrite(src: Path, dst: Path, edit: Any) -> Path:
    body = planfile.read(src)
    edit(loops(body)["tts.l1"])
    planfile.write(dst, body)
    return dst


def load_error(path: Path) -> str:
    with pytest.raises(PlanError) as info:
        load_plan(path)
    return str(info.value)


def test_loader_keeps_a_valid_mark(orpheus: Path) -> None:
    plan = load_plan(orpheus)
    (loop,) = (op for op in iter_ops(plan.walk("tts")["program"]) if op["op"] == "loop")
    assert loop["cohort"]["call"] == "tts.s3"


@pytest.mark.parametrize("edit,message", [
    (lambda lp: lp["cohort"].update(call="tts.s2"),
     "walk 'tts' loop 'tts.l1': its cohort names call 'tts.s2', which is not a call of the loop's body"),
    (lambda lp: lp["cohort"].update(fed=[["tokn", "token"]]),
     "walk 'tts' loop 'tts.l1': its cohort feeds input 'tokn', which llm.decode does not take"),
    (lambda lp: lp["cohort"].update(fed=[["token", "hidden"]]),
     "walk 'tts' loop 'tts.l1': its cohort feeds back output 'hidden', which llm.decode does not produce"),
    (lambda lp: lp["cohort"].update(invariant=["temperature"]),
     "walk 'tts' loop 'tts.l1': its cohort holds input 'temperature' invariant, which llm.decode does not take"),
    (lambda lp: lp["cohort"].update(emits=[["codes", "pcm"]]),
     "walk 'tts' loop 'tts.l1': its cohort emits output 'pcm', which llm.decode does not produce"),
    (lambda lp: lp["cohort"].update(emits=[["kodes", "code"]]),
     "walk 'tts' loop 'tts.l1': its cohort emits 'kodes', which is not an output of the walk"),
    # the shape of a mark is the plan schema's (plan/check.py), which names the field's path
    (lambda lp: lp["cohort"].update(fed="token"),
     "walks.tts.program.body[3].cohort.fed should be a list, got a string"),
    (lambda lp: lp.update(cohort=["tts.s3"]),
     "walks.tts.program.body[3].cohort should be an object, got a list"),
])
def test_loader_rejects_a_corrupted_mark(orpheus: Path, tmp_path: Path, edit: Any, message: str) -> None:
    bad = rewrite(orpheus, tmp_path / "bad.plan", edit)
    err = load_error(bad)
    assert err == f"{bad}: invalid plan: {message}"


def test_loader_gives_older_plans_a_null_mark(orpheus: Path, tmp_path: Path) -> None:
    def as_1_0(loop: dict[str, Any]) -> None:
        del loop["cohort"]

    old = tmp_path / "old.plan"
    body = planfile.read(orpheus)
    body["schema"]["minor"] = 0
    as_1_0(loops(body)["tts.l1"])
    planfile.write(old, body)
    assert "cohort" not in loops(planfile.read(old))["tts.l1"]
    plan = load_plan(old)
    (loop,) = (op for op in iter_ops(plan.walk("tts")["program"]) if op["op"] == "loop")
    assert "cohort" in loop and loop["cohort"] is None
    # a null mark loads as null, too
    assert load_plan(rewrite(orpheus, tmp_path / "null.plan", lambda lp: lp.update(cohort=None))).walk("tts")
