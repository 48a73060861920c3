"""The host-step benchmark (tools/bench/host_step.py) at a tiny size: its JSON, and the same tokens on both runs.

No timing is asserted (the figures depend on the machine); what is checked is that the one
command works: the walk compiles with its decode loop marked as a cohort, both runs (the plan
as compiled, and without its cohort marks) take every request to exactly the expected tokens,
the cohort run runs cohort steps and the generic one none, and the JSON has the shape the
benchmark promises.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
from support import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "bench" / "host_step.py"


def _bench() -> ModuleType:
    return load_script(SCRIPT, "host_step_bench")


def test_host_step_bench_json_and_same_tokens_on_both_runs(tmp_path: Path) -> None:
    bench = _bench()
    out = tmp_path / "host_step.json"
    threads = torch.get_num_threads()
    returned = bench.main(["--batches", "1,4", "--tokens", "6", "--repeats", "1", "--out", str(out)])
    assert torch.get_num_threads() == threads  # restored for the rest of the session
    rec = json.loads(out.read_text())
    assert set(rec) >= {"results", "meta"}
    assert rec["meta"]["cohort_mark"]["fed"] == [["token", "token"]]
    assert [r["batch"] for r in rec["results"]] == [1, 4]
    for r in rec["results"]:
        for key in ("generic_us", "cohort_us", "ratio"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert r["generic_cohort_steps"] == 0 and r["cohort_cohort_steps"] > 0
        assert r["steps"] >= 1 and r["same_tokens"] is True
        # request 0 of each path: prompt [1, 2, 3] -> 4, 5, ... (one token from the prefill, 6 decodes)
        assert r["sample"]["generic"] == r["sample"]["cohort"] == list(range(4, 11))
    assert returned["results"][-1]["sample"] == rec["results"][-1]["sample"]


def test_both_runs_give_every_request_the_same_tokens(tmp_path: Path) -> None:
    bench = _bench()
    plan = bench.compile_plan(3, tmp_path)
    outs = {}
    for path in ("generic", "cohort"):
        runs = bench.run_once(bench.StepPath(plan, path), 3, 5)
        assert (runs["cohort_steps"] > 0) == (path == "cohort")
        outs[path] = runs["outputs"]
    assert outs["generic"] == outs["cohort"]
    assert [o[0] for o in outs["cohort"]] == [4, 11, 18]  # distinct prompts, distinct tokens
