"""`mstarc explain` says of every loop whether it runs as a decode cohort, and if not, why.

A marked loop shows its mark (tests/test_cohort_mark.py, tests/test_cohort_chain.py); an
unmarked one shows the first cohort rule it breaks (`mstarc.cohorts.why_not`), so that a
user can tell why the loop runs iteration by iteration on the generic path.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_cohort_mark import MODEL, compile_walk, loops
from test_cohort_mark import WALKS as MARK_WALKS

from mstarc.cli import main
from mstarc.explain import program_lines

WALKS = (
    """plain(prompt: i32[T]) -> (tokens: i32[N]) {
    token, done, h = lm.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=0.7)
      emit tokens += token
    }
  }""",
    # a set-mode emit: the walk output is the last iteration's, not one item per iteration
    """last(prompt: i32[T]) -> (final: i32[1]) {
    token, done, h = lm.prefill(prompt=prompt)
    dynamic_loop max=8 until done carry token, done {
      token, done, hid = lm.decode(token=token, temperature=0.7)
      emit final = token
    }
  }""",
    # a second call, on a stateless node: no chain (a chain's calls are kv calls)
    MARK_WALKS["two_calls"],
)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("explain")
    src = d / "m.walk"
    src.write_text(MODEL % "\n".join(f"  walk {w}" for w in WALKS))
    compile_walk(src, d / "m.plan")
    return d / "m.plan"


def test_explain_says_why_a_loop_is_no_cohort(plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["explain", str(plan)]) == 0
    heads = [line.strip() for line in capsys.readouterr().out.splitlines() if "loop " in line]
    assert heads == [
        "dynamic_loop max=8 until done carry token, done   "  # walk last (explain lists walks by name)
        "[not a cohort: it sets output final (only append-mode emits qualify)]",
        "dynamic_loop max=8 until done carry token, done   [cohort: fed token<-token, invariant temperature]",
        "dynamic_loop max=8 until done carry token, done   "
        "[not a cohort: its call two.s3 is tok.detokenize, a stateless node's (a chain's calls are kv calls)]",
    ]


def test_a_loop_that_qualifies_but_bears_no_mark_is_from_an_older_plan(plan: Path) -> None:
    """A 1.0 plan's loops have no mark (the loader gives them `cohort: null`): explain says
    so rather than name a rule the loop does not break."""
    from mstar_runtime.plan.loader import planfile

    loop = copy.deepcopy(loops(planfile.read(plan))["plain.l1"])
    loop["cohort"] = None
    assert program_lines(loop)[0][1].endswith("   [not a cohort: not marked (a plan from before schema 1.1)]")
