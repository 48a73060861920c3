"""Building nodes from a plan and filling their weights: dummy, the node's own init, safetensors folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support import compile_model

from mstar_runtime.ops.node import KVNode, NodeError
from mstar_runtime.plan.loader import Plan, PlanError, load_plan, planfile
from mstar_runtime.weights import WeightsError, _shard_slices, build_node, load_weights

ROOT = Path(__file__).resolve().parent.parent


def compile_plan(
    out: Path, model: str = "testfamily", placement: str = "cpu", weights: Path | None = None
) -> Path:
    return compile_model(out, model, f"placements/{placement}.yaml", weights=weights)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return load_plan(compile_plan(tmp_path_factory.mktemp("w") / "tf.plan"), kv_pages_cap=4)


def lm(plan: Plan, source: str | Path = "dummy") -> torch.nn.Module:
    module = build_node(plan, "lm", 0, "cpu")
    load_weights(module, plan, "lm", source)
    return module


def states_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def weights(plan: Plan) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for the test family's lm: distinct from what dummy init would give."""
    g = torch.Generator().manual_seed(5)
    return {k: torch.randn(v.shape, generator=g) for k, v in lm(plan, "init").state_dict().items()}


# ------------------------------------------------------------------------------- building
def test_build_node_from_the_plan(plan: Plan) -> None:
    module = build_node(plan, "lm", 0, "cpu")
    assert isinstance(module, KVNode) and not module.training
    assert (
        module.spec.name == "lm"
        and module.spec.dtype == torch.float32
        and module.spec.arch_args["layers"] == 2
    )
    assert all(not p.requires_grad for p in module.parameters())
    with pytest.raises(PlanError, match="node 'lm' is not placed on rank 1"):
        build_node(plan, "lm", 1, "cpu")


@pytest.mark.parametrize(
    "impl,message",
    [
        ("os.path.join", "impl 'os.path.join' is not a class under the 'mstar_models' package"),
        ("mstar_models.testfamily.NoSuchClass", "is not a KVNode subclass"),
        ("mstar_models.no_such_model.Thing", "cannot import 'mstar_models.no_such_model'"),
        ("mstar_models.testfamily.TinyCodec", "is not a KVNode subclass, as a kv node needs"),
    ],
)
def test_impl_must_be_model_code(plan: Plan, tmp_path: Path, impl: str, message: str) -> None:
    body = planfile.read(plan.path)
    body["nodes"]["lm"]["impl"] = impl
    planfile.write(tmp_path / "bad.plan", body)
    bad = load_plan(tmp_path / "bad.plan", kv_pages_cap=4)
    with pytest.raises(PlanError, match=message):
        build_node(bad, "lm", 0, "cpu")


# ---------------------------------------------------------------------------------- dummy
def test_dummy_weights_are_deterministic_and_finite(plan: Plan) -> None:
    a, b, own = lm(plan), lm(plan), lm(plan, "init")
    assert states_equal(a, b)
    assert not states_equal(a, own)  # dummy replaced the constructor's weights; "init" kept them
    sd = a.state_dict()
    assert all(torch.isfinite(t).all() for t in sd.values())
    assert torch.equal(sd["model.norm.weight"], torch.ones_like(sd["model.norm.weight"]))
    assert torch.equal(sd["flow_in.bias"], torch.zeros_like(sd["flow_in.bias"]))
    assert abs(float(sd["model.embed_tokens.weight"].std()) - 0.02) < 0.002
    # each tensor has its own seed: equal shapes do not get equal values
    assert not torch.equal(
        sd["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.q_proj.weight"]
    )


def test_unknown_source(plan: Plan, tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="weights folder '.*nowhere' does not exist"):
        lm(plan, tmp_path / "nowhere")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(WeightsError, match="weights folder '.*a-file' is not a folder"):
        lm(plan, tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds no .safetensors files"):
        lm(plan, tmp_path / "empty")


# ---------------------------------------------------------------------------- safetensors
def test_single_file_loads(plan: Plan, weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
    save_file(weights, str(tmp_path / "model.safetensors"))
    module = lm(plan, tmp_path)
    sd = module.state_dict()
    assert all(torch.equal(sd[k], weights[k]) for k in weights)


def test_sharded_index_loads_and_converts_dtype(
    plan: Plan, weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    names = sorted(weights)
    half = {n: weights[n].to(torch.bfloat16) for n in names[: len(names) // 2]}
    rest = {n: weights[n] for n in names[len(names) // 2 :]}
    save_file(half, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(rest, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in half}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in rest}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    sd = lm(plan, tmp_path).state_dict()
    assert all(torch.equal(sd[n], half[n].float()) for n in half)
    assert all(torch.equal(sd[n], rest[n]) for n in rest)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        pytest.param("model.layers.1.mlp.up_proj.weight", None,
                     "node 'lm': tensor 'model.layers.1.mlp.up_proj.weight' is missing from "
                     "the checkpoint in '.*' \\(files: model.safetensors\\)", id="missing_tensor"),
        pytest.param("flow_out.bias", None, "tensor 'flow_out.bias' is missing",
                     id="missing_glue_tensor_outside_the_arch"),
        pytest.param("model.layers.0.self_attn.k_proj.weight", torch.zeros(8, 32),
                     r"tensor 'model.layers.0.self_attn.k_proj.weight' in 'model.safetensors' "
                     r"has shape \[8, 32\]; the plan expects \[16, 32\]", id="wrong_shape"),
        pytest.param("model.layers.0.self_attn.rotary.inv_freq", torch.zeros(4),
                     "checkpoint tensor 'model.layers.0.self_attn.rotary.inv_freq' in "
                     "'model.safetensors' is not a tensor of this node or of any node", id="extra_tensor"),
    ],
)
def test_checkpoint_that_does_not_fit(plan: Plan, weights: dict[str, torch.Tensor], tmp_path: Path,
                                      name: str, value: torch.Tensor | None, message: str) -> None:
    """A single-file checkpoint with one tensor missing (`value` None), misshapen or extra
    (`value` in its place): the error names it."""
    if value is None:
        del weights[name]
    else:
        weights[name] = value
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=message):
        lm(plan, tmp_path)


def test_missing_shard_file(plan: Plan, weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
    save_file(weights, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in weights}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        WeightsError, match="checkpoint file '.*model-00002-of-00002.safetensors' does not exist"
    ):
        lm(plan, tmp_path)


def test_corrupt_file(plan: Plan, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(WeightsError, match="has a corrupt safetensors header"):
        lm(plan, tmp_path)


def test_a_truncated_file_names_itself(plan: Plan, weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """A whole header over cut-off data (an interrupted download): safetensors refuses the open,
    which reached the user as an internal error with its traceback."""
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"checkpoint file '.*model.safetensors' is truncated or corrupt: "
                                           r".*\(reading tensor '[^']+'\)"):
        lm(plan, tmp_path)


def test_checkpoint_changed_since_compile(weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    compiled = load_plan(compile_plan(tmp_path / "with.plan", weights=folder), kv_pages_cap=4)
    assert compiled.weights.kind == "dir" and [f.name for f in compiled.weights.files] == [
        "model.safetensors"
    ]
    assert torch.equal(lm(compiled, folder).state_dict()["model.norm.weight"], weights["model.norm.weight"])
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})  # a different header
    with pytest.raises(
        WeightsError, match="'model.safetensors' in '.*' differs from the one the plan was compiled"
    ):
        lm(compiled, folder)


def test_weights_error_is_a_node_error() -> None:
    assert issubclass(WeightsError, NodeError)


def test_tensor_parallel_slices(tmp_path: Path) -> None:
    plan = load_plan(
        compile_plan(tmp_path / "tp.plan", "qwen3_omni", "qwen3_omni_tp2"), device="cpu", kv_pages_cap=4
    )
    thinker = plan.node("thinker")
    assert thinker.tp_of(1) == (1, 2)
    splits = thinker.shard.splits  # type: ignore[union-attr]
    col = next(n for n, s in splits.items() if s.kind == "col" and s.parts == 2)
    row = next(n for n, s in splits.items() if s.kind == "row" and s.parts == 2)
    whole = next(n for n, s in splits.items() if s.kind == "replicate")
    assert _shard_slices(plan, "thinker", col, (8, 6), 1, 2) == (slice(4, 8), slice(None))
    assert _shard_slices(plan, "thinker", row, (8, 6), 1, 2) == (slice(None), slice(3, 6))
    assert _shard_slices(plan, "thinker", whole, (8,), 1, 2) == (slice(None),)
