"""Loops the cohort path serves beyond a dynamic decode (issue 24, section 1), against the generic path
(the same plan without its cohort marks, `support.as_run`).

- A fixed `Loop(n)` of one call (the compiler marks it as it marks a dynamic loop): every
  row runs its own count, leaves without a wasted step, and ends with the generic path's
  tokens, carried flag and stream items.

The walks live here, appended to the test family's model (its nodes, variants and streams),
so that the corpus of shipped walks keeps its plans. Counted in engine steps, never in seconds.
- A loop on another rank than the prefill that wrote its context (the plan's kv transfer,
  as BAGEL's CFG contexts under cfg3): the context is moved to the loop's rank, then the
  row joins that rank's cohort (in-process workers), with one rank's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import as_run

from mstar_runtime.control.conductor import FINISHED, Conductor, Request
from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.plan.planfile import iter_ops
from mstar_runtime.worker.worker import Worker
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parents[1]

FIXED_WALK = """
  // A fixed number of decode steps whatever `done` says; the loop's last `done` is an output.
  walk fixed(prompt: str, n: int = 6) -> (tokens: i32[N], audio: f32[S], last_done: bool) {
    ids = prompt.encode(text = prompt)
    token, code, done, h = lm.prefill(tokens = ids, max_new = 4) @main
    emit tokens += token
    loop n = n max = max_new_tokens carry token, done {
      token, c, done, hid = lm.decode(token = token) @main
      emit tokens += token
    }
    emit last_done = done
    on stream lm.code -> codec.block as b {
      pcm = codec.decode_block(block = b)
      emit audio += pcm
    }
  }
"""

MOVED_WALK = """
  // The decode loops run in a branch the placement maps to rank 1; the prefill stays on rank 0.
  walk moved(prompt: str, max_new: int = 8, n: int = 5) -> (tokens: i32[N], more: i32[M]) {
    ids = prompt.encode(text = prompt)
    token, code, done, h = lm.prefill(tokens = ids, max_new = max_new) @main
    emit tokens += token
    parallel {
      branch dec {
        dynamic_loop max = max_new_tokens until done carry token, done {
          token, c, done, hid = lm.decode(token = token) @main
          emit tokens += token
        }
        loop n = n max = max_new_tokens carry token {
          token, c2, d2, hid2 = lm.decode(token = token) @main
          emit more += token
        }
      }
      branch other { other_ids = prompt.encode(text = prompt) }
    }
  }
"""

MOVED_PLACEMENT = """
placement: cpu2_moved
devices: {count: 2, type: cpu, name: cpu, memory_gib: 4}
kv_memory_fraction: 0.5
page_size: 16
max_batch: 8
default_rank: 0
models:
  testfamily:
    nodes:
      lm: {ranks: [0, 1], tp: 1}
    walks:
      moved:
        branches: {dec: 1}
"""

pytestmark = pytest.mark.usefixtures("one_thread")


def _with_walks(walks: str, out: Path, placement: Path = ROOT / "placements/cpu.yaml") -> Path:
    """The test family's model with `walks` added, compiled to a tiny plan at `out`."""
    text = (ROOT / "models/testfamily/testfamily.walk").read_text()
    end = text.rstrip().rfind("}")
    source = out.with_suffix(".walk")
    source.write_text(text[:end] + walks + "}\n")
    assert mstarc(["compile", str(source), "--variant", "tiny", "-p", str(placement), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def fixed_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_walks(FIXED_WALK, tmp_path_factory.mktemp("cohort-fixed") / "fixed.plan")


def _engine(plan_path: Path, path: str, **kw: Any) -> Conductor:
    """A conductor on a fresh one-rank worker, on the plan as run `path` takes it (`support.RUNS`)."""
    plan = load_plan(plan_path, device="cpu", kv_pages_cap=kw.pop("cap", None))
    return Conductor(as_run(plan, path), {0: Worker(plan, 0, "cpu", "init")}, **kw)


def _run(conductor: Conductor, requests: list[tuple[str, dict[str, Any]]]) -> list[Request]:
    handles = [conductor.submit(walk, dict(inputs)) for walk, inputs in requests]
    conductor.run_until_idle()
    return handles


def _same(got: Request, want: Request) -> None:
    assert (got.state, got.error) == (want.state, want.error)
    assert set(got.outputs) == set(want.outputs)
    for name, x in got.outputs.items():
        y = want.outputs[name]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            if x.is_floating_point():
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)
            else:
                assert torch.equal(x, y), name
        else:
            assert type(x) is type(y) and x == y, (name, x, y)


def _marked(plan: Plan, walk: str) -> set[str]:
    return {op["id"] for op in iter_ops(plan.walk(walk)["program"])
            if op.get("op") == "loop" and op.get("cohort") is not None}


# ---------------------------------------------------------------------------- fixed Loop(n)
COUNTS = [0, 1, 2, 5, 9, 17, 32]  # 32: the loop's max (max_new_tokens)


def test_a_fixed_loop_runs_as_a_cohort_with_each_rows_own_count(fixed_plan: Path) -> None:
    requests = [("fixed", {"prompt": f"fixed {i}", "n": n}) for i, n in enumerate(COUNTS)]
    cohort, generic = _engine(fixed_plan, "cohort"), _engine(fixed_plan, "generic")
    got, want = _run(cohort, requests), _run(generic, requests)
    (loop,) = _marked(cohort.plan, "fixed")
    (co,) = [c for key, c in cohort.cohorts.items() if key[3] == loop]
    assert co.stats["joins"] == len(COUNTS) - 1  # n = 0 runs no iteration, so joins nothing
    assert co.stats["row_steps"] == sum(COUNTS) > co.stats["steps"]  # rows shared steps, none wasted
    assert co.stats["wasted_steps"] == 0 and generic.stats["cohort_steps"] == 0
    hop = int(cohort.plan.node_spec("codec").config["hop"])
    for c, g, n in zip(got, want, COUNTS):
        assert c.state == FINISHED, c.error
        _same(c, g)
        assert c.outputs["tokens"].shape == (n + 1,) and c.outputs["audio"].shape == ((n + 1) * hop,)
        assert c.stats.wasted_steps == g.stats.wasted_steps == 0
        assert c.stats.steps == g.stats.steps


def test_a_fixed_loop_survives_preemption_and_a_small_pool(fixed_plan: Path) -> None:
    requests = [("fixed", {"prompt": f"squeeze {i}", "n": n}) for i, n in enumerate([7, 12, 20, 32, 3])]
    want = _run(_engine(fixed_plan, "generic"), requests)
    for kw in ({"preempt_every": 4}, {"cap": 6}):
        conductor = _engine(fixed_plan, "cohort", **kw)
        got = _run(conductor, requests)
        assert conductor.stats["preemptions"] > 0 and conductor.stats["cohort_steps"] > 0, kw
        for c, g in zip(got, want):
            assert c.state == FINISHED, c.error
            _same(c, g)


def test_a_fixed_loop_count_out_of_range_names_its_input(fixed_plan: Path) -> None:
    (h,) = _run(_engine(fixed_plan, "cohort"), [("fixed", {"prompt": "too many", "n": 33})])
    assert h.state == "failed" and h.error_field == "n" and "outside 0..32" in (h.error or "")


# ---------------------------------------------------------------------------- a context moved first
@pytest.fixture(scope="module")
def moved_plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("cohort-moved")
    placement = out / "cpu2_moved.yaml"
    placement.write_text(MOVED_PLACEMENT)
    return {1: _with_walks(MOVED_WALK, out / "moved1.plan"), 2: _with_walks(MOVED_WALK, out / "moved2.plan", placement)}


MOVED = [("moved", {"prompt": f"move me {i}", "max_new": m, "n": n}) for i, (m, n) in enumerate([(3, 2), (8, 5), (1, 7)])]


def test_a_loop_whose_context_moved_joins_the_cohort_of_its_rank(moved_plans: dict[int, Path]) -> None:
    """The plan moves lm@main from rank 0 into both loops' calls (the first loop might, for all
    the compiler knows, not have written it): it moves once, before the first loop; the second
    loop continues rank 1's copy (the one its last write went to), as a cohort or not."""
    want = _run(_engine(moved_plans[1], "generic"), MOVED)
    plan = load_plan(moved_plans[2], device="cpu")
    consumers = {t["consumer_step"] for t in plan.body["placement"]["transfers"] if t.get("kind") == "kv"}
    assert len(consumers) == 2
    loops = _marked(plan, "moved")
    assert len(loops) == 2  # a transfer into the loop's call keeps its mark
    for path, every in (("cohort", None), ("cohort", 4), ("generic", None)):
        conductor = Conductor(as_run(plan, path), {r: Worker(plan, r, "cpu", "init") for r in (0, 1)},
                              preempt_every=every)
        got = _run(conductor, MOVED)
        on_one = {key[3] for key, c in conductor.cohorts.items() if key[2] == (1,) and c.stats["joins"]}
        assert on_one == (loops if path == "cohort" else set())  # both loops ran as rank 1's cohorts
        attempts = len(MOVED) + conductor.stats["preemptions"]
        assert len(MOVED) <= conductor.stats["kv_moves"] <= attempts  # once per request attempt
        for c, g in zip(got, want):
            assert c.state == FINISHED, c.error
            _same(c, g)


# ---------------------------------------------------------------------------- block rows
def test_block_attention_of_cohort_rows_is_paged_attention_with_a_full_mask() -> None:
    """`decode_attention` with `tokens` > 1 (a row adds a block that sees its whole context and
    itself) computes what `paged_attention` computes for those entries with mask "full"."""
    from mstar_runtime.kv.attention import AttentionMetadata, KVPool, paged_attention
    from mstar_runtime.kv.block_table import decode_attention

    torch.manual_seed(0)
    ps, q_len, heads, kv_heads, dim = 4, 6, 4, 2, 8
    pool = KVPool(1, 32, ps, kv_heads, dim)
    pool.data.normal_()
    tables = [[3, 7, 1, 9], [2, 5, 11, 0], [4, 6, 8, 10]]
    kv_lens = [13, 6, 16]  # each row's context after its block of q_len tokens
    q = torch.randn(len(tables) * q_len, heads, dim)
    table = torch.tensor(tables, dtype=torch.int32)
    got = decode_attention(q, pool, 0, table, torch.tensor(kv_lens), max(kv_lens), None, q_len)
    want = paged_attention(q, pool, 0, AttentionMetadata.build([q_len] * 3, kv_lens, tables, "full"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
