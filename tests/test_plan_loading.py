"""Loading a plan: real plans load; corrupt, foreign, inconsistent or unrunnable ones are clean PlanErrors."""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from support import compile_model

from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan import loader as plan_module
from mstar_runtime.plan.loader import Plan, PlanError, UnknownWalk, iter_ops, load_plan, planfile
from mstar_runtime.sizes import human_bytes

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("orpheus", "bagel", "vjepa2", "qwen3_omni", "testfamily")


def compile_plan(out: Path, model: str = "orpheus", placement: str = "cpu", variant: str = "tiny") -> Path:
    return compile_model(out, model, f"placements/{placement}.yaml", variant=variant)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plans")
    out = {m: compile_plan(d / f"{m}.plan", m) for m in MODELS}
    out["cuda"] = compile_plan(d / "cuda.plan", "orpheus", "h200x1")
    return out


def rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """A plan whose body was changed by `edit(body)` and re-encoded with a valid checksum."""
    body = planfile.read(src)
    edit(body)
    planfile.write(dst, body)
    return dst


def load_error(path: Path, **kw: Any) -> str:
    with pytest.raises(PlanError) as info:
        load_plan(path, **kw)
    assert str(info.value).startswith(f"{path}: ")
    return str(info.value)


# ------------------------------------------------------------------------------ good plans
@pytest.mark.parametrize("model", MODELS)
def test_every_tiny_model_plan_loads(plans: dict[str, Path], model: str) -> None:
    plan = load_plan(plans[model])
    assert plan.model_name == model and plan.variant == "tiny" and plan.device == "cpu"
    for name, walk in plan.walks.items():
        assert plan.walk(name) is walk
        for op in iter_ops(walk["program"]):
            if op["op"] == "call":
                assert op["phase"] in plan.node(op["node"]).phases
    for node, rank in plan.kv_pools():
        assert plan.kv_pages(node, rank) >= 1
        assert plan.node(node).arch is not None and plan.node(node).arch.kv is not None


def test_orpheus_plan_view(plans: dict[str, Path]) -> None:
    plan = load_plan(plans["orpheus"], kv_pages_cap=10)
    assert isinstance(plan, Plan) and plan.num_ranks == 1 and plan.page_size == 16
    llm = plan.node("llm")
    assert llm.engine == "kv" and llm["impl"] == llm.impl == "mstar_models.orpheus.LlamaBackbone"
    assert plan.node_rank("llm") == 0 and plan.resident_nodes(0) == ("llm", "prompt", "snac")
    assert plan.kv_pools() == [("llm", 0)] and plan.kv_pages("llm") == 10
    assert plan.kv_pool("llm").pages > 10  # the cap applies to kv_pages, the plan keeps its own number
    spec = plan.node_spec("llm")
    assert spec.dtype == torch.float32 and spec.engine == "kv" and spec.arch_args["layers"] == 2
    assert spec.config["vocab"] == plan.config["vocab"]
    (sid,) = plan.walk("tts")["streams"]
    assert plan.stream(sid).policy == {"kind": "sliding", "stride": 7, "window": 28}
    assert plan.stream(sid)["capacity"] == plan.stream(sid).capacity
    assert plan.transitions() == () and plan.transitions("tts") == ()
    with pytest.raises(UnknownWalk, match="unknown walk 'chat'; this plan serves: tts") as info:
        plan.walk("chat")
    assert isinstance(info.value, RequestError) and info.value.field == "walk"
    with pytest.raises(PlanError, match="no node 'nope'"):
        plan.node("nope")


def test_read_only_views(plans: dict[str, Path]) -> None:
    plan = load_plan(plans["testfamily"])
    with pytest.raises(TypeError):
        plan.nodes["x"] = None  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.page_size = 1  # type: ignore[misc]
    assert {t.src for t in plan.transitions()} <= set(plan.walks)


# --------------------------------------------------------------------------- corrupt files
def test_missing_file(tmp_path: Path) -> None:
    assert "cannot read plan" in load_error(tmp_path / "none.plan")


def test_truncated_plans(plans: dict[str, Path], tmp_path: Path) -> None:
    data = plans["orpheus"].read_bytes()
    bad = tmp_path / "cut.plan"
    for n in (0, 7, planfile.HEADER_BYTES - 1, planfile.HEADER_BYTES, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:n])
        msg = load_error(bad)
        assert "shorter than" in msg or "truncated" in msg, msg


def test_bit_flips_anywhere_are_plan_errors(plans: dict[str, Path], tmp_path: Path) -> None:
    data = plans["orpheus"].read_bytes()
    bad = tmp_path / "flip.plan"
    rng = random.Random(1234)
    positions = list(range(planfile.HEADER_BYTES)) + rng.sample(range(planfile.HEADER_BYTES, len(data)), 150)
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        bad.write_bytes(bytes(flipped))
        with pytest.raises(PlanError):
            load_plan(bad)
    flipped = bytearray(data)
    flipped[-5] ^= 0x10
    bad.write_bytes(bytes(flipped))
    assert "checksum mismatch" in load_error(bad)


def test_wrong_magic_and_versions(plans: dict[str, Path], tmp_path: Path) -> None:
    data = plans["orpheus"].read_bytes()
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"NOTAPLAN" + data[8:])
    assert "bad magic" in load_error(bad)
    bad.write_bytes(data[:8] + struct.pack("<H", 9) + data[10:])
    assert "container version 9 is not supported" in load_error(bad)
    newer = rewrite(plans["orpheus"], tmp_path / "v2.plan", lambda b: b["schema"].update(major=2))
    assert "schema version 2.x is not supported" in load_error(newer)
    minor = rewrite(plans["orpheus"], tmp_path / "minor.plan", lambda b: b["schema"].update(minor=7))
    assert load_plan(minor).model_name == "orpheus"  # a newer minor only adds fields


def test_malformed_bodies_name_the_field(plans: dict[str, Path], tmp_path: Path) -> None:
    def no_engine(b: dict) -> None:
        del b["nodes"]["llm"]["engine"]

    msg = load_error(rewrite(plans["orpheus"], tmp_path / "a.plan", no_engine))
    assert "invalid plan: nodes.llm has no 'engine'" in msg

    def bad_pages(b: dict) -> None:
        b["memory"]["ranks"][0]["kv"][0]["pages"] = "many"

    assert "memory.ranks[0].kv[0].pages should be an integer, got a string" in load_error(
        rewrite(plans["orpheus"], tmp_path / "b.plan", bad_pages)
    )

    def bad_dtype(b: dict) -> None:
        b["nodes"]["snac"]["dtype"] = "f8"

    assert "nodes.snac.dtype is 'f8'" in load_error(rewrite(plans["orpheus"], tmp_path / "c.plan", bad_dtype))


def _mutations(body: Any, path: tuple = ()) -> list[tuple]:
    """Every (container path, key) in the body, to delete or retype one at a time."""
    out = []
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for k, v in items:
        out.append(path + (k,))
        out.extend(_mutations(v, path + (k,)))
    return out


def test_random_body_mutations_never_escape_as_other_exceptions(
    plans: dict[str, Path], tmp_path: Path
) -> None:
    body = planfile.read(plans["testfamily"])
    paths = _mutations(body)
    rng = random.Random(7)
    bad = tmp_path / "mut.plan"
    for path in rng.sample(paths, 400):
        mutated = planfile.decode(planfile.encode(body))
        parent = mutated
        for k in path[:-1]:
            parent = parent[k]
        replacement = rng.choice([None, "x", -1, 3.5, [], {}, True])
        if isinstance(parent, dict) and rng.random() < 0.5:
            del parent[path[-1]]
        else:
            parent[path[-1]] = replacement
        try:
            bad.write_bytes(planfile.encode(mutated))
        except planfile.PlanFileError:
            continue
        try:
            load_plan(bad)
        except PlanError:
            pass


# ------------------------------------------------------------------------------ invariants
def _first_call(body: dict, walk: str, node: str | None = None) -> dict:
    for op in iter_ops(body["walks"][walk]["program"]):
        if op["op"] == "call" and (node is None or op["node"] == node):
            return op
    raise AssertionError("no call")


def test_unknown_node_names_the_walk_and_step(plans: dict[str, Path], tmp_path: Path) -> None:
    path = rewrite(
        plans["orpheus"], tmp_path / "n.plan", lambda b: _first_call(b, "tts", "llm").update(node="llmx")
    )
    assert "invalid plan: walk 'tts' step 'tts.s2' calls unknown node 'llmx'" in load_error(path)


def test_unknown_phase_and_bad_ranks(plans: dict[str, Path], tmp_path: Path) -> None:
    def edit(b: dict) -> None:
        _first_call(b, "tts", "llm").update(phase="warmup")
        _first_call(b, "tts", "snac").update(ranks=[3])

    msg = load_error(rewrite(plans["orpheus"], tmp_path / "p.plan", edit))
    assert "2 problems" in msg
    assert "walk 'tts' step 'tts.s2' calls unknown phase llm.'warmup'; phases: decode, prefill" in msg
    assert "walk 'tts' step 'tts.s4' (snac.decode) runs on ranks [3], out of range 0..0" in msg


def test_unknown_stream_tag_and_transition(plans: dict[str, Path], tmp_path: Path) -> None:
    def edit(b: dict) -> None:
        for op in iter_ops(b["walks"]["tts"]["program"]):
            if op["op"] == "on_stream":
                op["stream"] = "tts:nowhere"
        _first_call(b, "tts", "llm")["tag"] = "cfg"
        b["transitions"].append({"src": "tts", "dst": "sing", "when": "done", "keep": []})

    msg = load_error(rewrite(plans["orpheus"], tmp_path / "s.plan", edit))
    assert "walk 'tts' on_stream 'tts.o1' reads unknown stream 'tts:nowhere'" in msg
    assert "walk 'tts' step 'tts.s2' uses KV tag 'cfg' of 'llm', which has tags: main" in msg
    assert "transition tts -> sing names unknown walk 'sing'" in msg


def test_kv_node_needs_geometry_and_pages(plans: dict[str, Path], tmp_path: Path) -> None:
    def edit(b: dict) -> None:
        b["memory"]["ranks"][0]["kv"] = []
        b["nodes"]["llm"]["arch"]["kv"] = None

    msg = load_error(rewrite(plans["orpheus"], tmp_path / "k.plan", edit))
    assert "kv node 'llm' has no KV geometry (arch.kv)" in msg
    assert "kv node 'llm' has no KV pages on rank 0" in msg


# ---------------------------------------------------------------------------- hardware fit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_plan_needs_explicit_cpu(plans: dict[str, Path]) -> None:
    msg = load_error(plans["cuda"])
    assert "compiled for 1 CUDA rank(s) (H200), but this machine has no CUDA GPU" in msg
    assert "device='cpu'" in msg
    assert "no CUDA GPU" in load_error(plans["cuda"], device="cuda")
    plan = load_plan(plans["cuda"], device="cpu", kv_pages_cap=8)
    assert plan.device == "cpu" and plan.plan_device_type == "cuda" and plan.kv_pages("llm") == 8
    assert plan.torch_device(0) == torch.device("cpu")


def test_plan_larger_than_host_memory_is_refused(
    plans: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = load_plan(plans["cuda"], device="cpu")
    mem = plan.memory[0]
    kv_bytes = mem.used_bytes(graphs=False) - mem.used_bytes(1, graphs=False)
    assert kv_bytes > 0
    # A host just too small for the whole KV pool: refused, with the way out in the message.
    monkeypatch.setattr(plan_module, "_host_memory_bytes", lambda: mem.used_bytes(graphs=False) - 1)
    msg = load_error(plans["cuda"], device="cpu")
    assert "running on the CPU needs" in msg and "kv_pages_cap" in msg
    # the sizes are written as the compiler writes them (mstar_runtime.sizes): sub-GiB in MiB
    need = mem.used_bytes(graphs=False)
    assert f"needs {human_bytes(need)} (weights" in msg and f"has {human_bytes(need - 1)};" in msg
    assert load_plan(plans["cuda"], device="cpu", kv_pages_cap=1).kv_pages("llm") == 1


def test_unknown_device_and_bad_cap(plans: dict[str, Path]) -> None:
    assert "unknown device 'tpu'" in load_error(plans["orpheus"], device="tpu")
    assert "kv_pages_cap must be >= 1" in load_error(plans["orpheus"], kv_pages_cap=0)


def test_the_loader_reads_back_the_compilers_own_plan_records(tmp_path: Path) -> None:
    """One declaration (runtime/mstar_runtime/plan/records.py): the loaded plan holds the
    compiler's ShardSpec, TensorSpec and KVGeometry classes, equal to what the passes made;
    `tp` is in the plan once per node (its `shard`), no longer also in `placement.nodes`."""
    from types import SimpleNamespace

    from mstar_runtime.plan import records
    from mstarc import pipeline
    from mstarc.archs import KVGeometry, TensorSpec
    from mstarc.cli import _frontend
    from mstarc.passes.shard_tp import ShardSpec
    from mstarc.plan import build_plan

    assert (ShardSpec, TensorSpec, KVGeometry) == (records.ShardSpec, records.TensorSpec, records.KVGeometry)
    args = SimpleNamespace(model=str(ROOT / "models/orpheus/orpheus.walk"), variant="tiny", weights=None,
                           placement=str(ROOT / "tests/placements/cpu2_tp2.yaml"))
    model, digest, spec = _frontend(args)
    model = pipeline.run(model, spec)
    body = build_plan(model, digest)
    planfile.write(tmp_path / "tp2.plan", body)
    plan = load_plan(tmp_path / "tp2.plan", device="cpu")
    assert model.sharding["llm"].tp == 2 and model.sharding["llm"].collectives  # really sharded
    for name, node in plan.nodes.items():
        assert node.shard == model.sharding[name], name  # every field, collectives included
        assert node.arch is None or node.arch.tensors == model.nodes[name].arch.tensors
        assert node.arch is None or node.arch.kv == model.nodes[name].arch.kv

    def tp_keys(obj: Any, path: str = "") -> list[str]:
        if isinstance(obj, dict):
            return [p for k, v in obj.items() for p in ([f"{path}.{k}"] if k == "tp" else []) + tp_keys(v, f"{path}.{k}")]
        return [p for i, v in enumerate(obj) for p in tp_keys(v, f"{path}[{i}]")] if isinstance(obj, list) else []

    assert sorted(tp_keys(body)) == sorted(f".nodes.{n}.shard.tp" for n in body["nodes"])
    assert "nodes" not in body["placement"]


@pytest.mark.parametrize(("op", "key"), [("seq", "body"), ("parallel", "branches")])
def test_a_program_list_that_is_null_is_a_plan_error(plans: dict[str, Path], tmp_path: Path, op: str,
                                                      key: str) -> None:
    """A `seq` without its `body` list (or a `parallel` without `branches`) was accepted by
    the invariants and then broke the walk over the program with a TypeError."""
    def edit(body: dict) -> None:
        program = body["walks"][next(iter(body["walks"]))]["program"]
        program["body"].append({"op": op, key: None})

    msg = load_error(rewrite(plans["testfamily"], tmp_path / "null.plan", edit))
    assert f".{key} should be a list, got null" in msg
