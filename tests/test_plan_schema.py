"""The plan schema (runtime/mstar_runtime/plan/check.py, issue 29 section 3): a body edited and
re-checksummed is refused by the loader and by `mstarc explain` alike, naming the field."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import compile_model

from mstar_runtime.plan import planfile
from mstar_runtime.plan.check import check_body
from mstar_runtime.plan.loader import PlanError, iter_ops, load_plan
from mstarc.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_model(tmp_path_factory.mktemp("schema") / "tf.plan", "testfamily")


def _first(body: dict, kind: str, pred: Callable[[dict], bool] = lambda op: True) -> dict:
    return next(op for w in body["walks"].values() for op in iter_ops(w["program"]) if op["op"] == kind and pred(op))


def _raw(path: Path, text: str) -> Path:
    raw = text.encode()
    path.write_bytes(planfile._HEADER.pack(planfile.MAGIC, planfile.CONTAINER_VERSION, 0, len(raw),
                                           hashlib.sha256(raw).digest()) + raw)
    return path


EDITS: list[tuple[str, Callable[[dict], Any], str]] = [
    ("bool_major", lambda b: b["schema"].__setitem__("major", True), "schema version"),
    ("neg_fraction", lambda b: b["placement"].__setitem__("kv_memory_fraction", -0.5),
     "placement.kv_memory_fraction is -0.5"),
    ("max_batch_0", lambda b: b["placement"].__setitem__("max_batch", 0), "placement.max_batch is 0"),
    ("device_type", lambda b: b["placement"]["ranks"][0].__setitem__("type", "tpu"), "ranks[0].type is 'tpu'"),
    ("capacity_0", lambda b: b["streams"][0].__setitem__("capacity", 0), "streams[0].capacity is 0"),
    ("fixed_size_0", lambda b: next(s for s in b["streams"] if s["policy"]["kind"] == "fixed")["policy"]
     .__setitem__("size", 0), ".policy.size is 0"),
    ("kv_pages", lambda b: b["memory"]["ranks"][0]["kv"][0].__setitem__("pages", 10 ** 15), "kv[0].pages is"),
    ("args_list", lambda b: _first(b, "call").__setitem__("args", []), ".args should be an object, got a list"),
    ("no_body", lambda b: b["walks"]["generate"]["program"].pop("body"), "program has no 'body'"),
    ("nodes_list", lambda b: b.__setitem__("nodes", []), "nodes should be an object, got a list"),
    ("emit_unknown", lambda b: _first(b, "emit").__setitem__("output", "nope"),
     "emits 'nope', which is not an output of the walk"),
    ("loop_below_0", lambda b: _first(b, "loop", lambda op: not op["dynamic"]).__setitem__("count", {"const": -1}),
     "has count -1"),
]


@pytest.mark.parametrize("name,edit,needle", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_plan_is_refused_by_the_loader_and_explain(
        name: str, edit: Callable[[dict], Any], needle: str, plan: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    body = planfile.read(plan)
    edit(body)
    bad = _raw(tmp_path / f"{name}.plan", json.dumps(body, sort_keys=True))
    with pytest.raises(PlanError) as info:
        load_plan(bad)
    assert needle in str(info.value)
    capsys.readouterr()
    assert main(["explain", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "error[E070]" in err and needle in err and "E090" not in err and "Traceback" not in err, err


def test_nan_is_not_json(plan: Path, tmp_path: Path) -> None:
    text = json.dumps(planfile.read(plan), sort_keys=True)
    text = text.replace('"kv_memory_fraction": 0.9', '"kv_memory_fraction": NaN')
    assert "NaN" in text
    with pytest.raises(PlanError, match="NaN is not JSON"):
        load_plan(_raw(tmp_path / "nan.plan", text))


def test_every_compiled_plan_passes(plan: Path) -> None:
    assert check_body(planfile.read(plan)) == []


@pytest.mark.parametrize("body", [None, [], "x", {"schema": 1}, {"walks": {"w": {"program": {"op": "seq", "body": 3}}}}])
def test_any_shape_gives_problems_never_an_exception(body: Any) -> None:
    assert check_body(body)
