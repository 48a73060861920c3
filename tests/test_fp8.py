"""FP8 (E4M3) weights: the layer library's quantization and GEMM, the placement's `weights: fp8`, the plan, the loader, and Orpheus' parity.

Bounds. E4M3 keeps 3 mantissa bits: a value in the normal range rounds to within half a step,
2^-4 of its power of two, so |w - dq(q(w))| <= 2^-4 |w|; below 2^-6 (the smallest normal, in
scaled units) the step is the subnormal one, 2^-9, so the error is at most 2^-10 there. A
row's largest |value| maps to 448 exactly. A product of two such values is off by at most
(1 + 2^-4)^2 - 1 < 0.13 of |x w|, so a dot product by at most 0.13 sum_k |x_k w_k| (plus the
subnormal terms): `test_fp8_linear_is_within_the_format_bound_of_the_float_product`.

Parity (tiny Orpheus in bf16 on the plan's dummy weights, the FP8 model against the bf16 one,
64 greedy tokens teacher-forced: `tools/bench/orpheus.py`'s `fp8_parity`). Measured on this
CPU over three prompts: max |logit error| 0.020-0.027 of the largest |logit| (bf16 against
float32 on the same weights: 0.004, so FP8 costs ~6x bf16's own rounding, as a format with a
16x coarser step whose errors partly average out in the GEMMs should), greedy agreement
97-98 %. Thresholds: 0.06 (twice the worst measured, room for other seeds and BLAS orders)
and 90 %. The control pins that the logit figure can fail: doubling one projection's scales
in every layer (a wrong scale) gives 0.11-0.12. Greedy agreement alone would not catch it (97 %
there too): with random weights and a tied head, the logits are dominated by the current
token's own embedding, so the argmax moves little; the logit error is the figure to read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import compile_walk, load_script

from mstar_models.layers import fp8
from mstar_models.layers.linear import FusedRows, RowParallel, Weight
from mstar_models.layers.mlp import GatedMLP
from mstar_models.orpheus import LlamaBackbone
from mstar_runtime.plan import loader
from mstar_runtime.plan.loader import PlanError, load_plan
from mstar_runtime.plan.planfile import read as read_body
from mstar_runtime.weights import WeightsError, load_weights, quantize_node
from mstarc.diagnostics import CompileError, SourceCache, render
from mstarc.lower import lower
from mstarc.parser import parse
from mstarc.passes.memory import memory
from mstarc.passes.place import place
from mstarc.passes.shard_tp import shard_tp
from mstarc.passes.verify import verify
from mstarc.placement import parse_placement

ROOT = Path(__file__).resolve().parent.parent
WALK = ROOT / "models/orpheus/orpheus.walk"
FP8_CPU = """\
devices:
  - {rank: 0, type: cpu, name: cpu, memory_gib: 16}
max_batch: 8
models:
  orpheus:
    nodes:
      llm: {rank: 0, weights: fp8}
"""
MAX_LOGIT_ERROR_REL, MIN_AGREEMENT = 0.06, 0.90  # see the module docstring


def _bench():
    return load_script(ROOT / "tools/bench/orpheus.py", "bench_orpheus_fp8")


# ------------------------------------------------------------------------------ the format
def test_quantize_round_trip_is_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-4, 2, 64)[:, None]  # rows 6 decades apart
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 1e3  # an outlier: only its own row's scale grows
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (64, 1)
    assert scale.dtype == torch.float32
    back = fp8.dequantize_rows(q, scale)
    assert torch.equal(back[3], torch.zeros(96))
    # per element: half a step of E4M3, relative in the normal range, the subnormal step below it
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert bool(((back - w).abs() <= bound).all())
    # each row's largest |value| is 448 steps of its scale, exactly
    assert torch.equal(q.float().abs().amax(-1)[torch.arange(64) != 3], torch.full((63,), fp8.FP8_MAX))
    # the error is real (the format is coarse) and no larger than 3 % rms in the normal range
    rel = (back - w).norm() / w.norm()
    assert 1e-3 < float(rel) < 0.03


def test_fp8_linear_is_the_dequantized_product() -> None:
    """The CPU path: the per-token-quantized activations by the dequantized weight in float32."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 7, 64, generator=gen), torch.randn(48, 64, generator=gen) * 0.02
    q, scale = fp8.quantize_rows(w)
    xq, xs = fp8.quantize_rows(x.reshape(14, 64))
    want = ((xq.float() * xs) @ (q.float() * scale).t()).reshape(2, 7, 48)
    assert torch.allclose(fp8.fp8_linear(x, q, scale), want, rtol=1e-6, atol=1e-7)
    bias = torch.randn(48, generator=gen)
    assert torch.allclose(fp8.fp8_linear(x, q, scale, bias), want + bias, rtol=1e-6, atol=1e-6)
    assert fp8.fp8_linear(x[:, :0], q, scale).shape == (2, 0, 48)


def test_fp8_linear_is_within_the_format_bound_of_the_float_product() -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 128, generator=gen), torch.randn(80, 128, generator=gen) * 0.02
    x[4, 10] = 40.0  # an activation outlier: per token, only row 4 is coarser for it
    q, scale = fp8.quantize_rows(w)
    y, ref = fp8.fp8_linear(x, q, scale), x @ w.t()
    xs = fp8.quantize_rows(x)[1]
    # 0.13 of sum |x w| per output, plus the subnormal terms of both operands
    bound = 0.13 * (x.abs() @ w.abs().t()) + 2.0**-9 * (xs * w.abs().sum(-1) + x.abs().sum(-1, keepdim=True) * scale.t())
    assert bool(((y - ref).abs() <= bound).all())
    others = torch.arange(9) != 4
    rel = (y - ref)[others].norm() / ref[others].norm()
    assert float(rel) < 0.05
    # per tensor, row 4's outlier would coarsen every row: per token, the other rows keep their error
    rel_alone = (fp8.fp8_linear(x[others], q, scale) - ref[others]).norm() / ref[others].norm()
    assert torch.isclose(rel, rel_alone, rtol=1e-5)


def test_fused_and_row_parallel_weights_quantize_under_their_names() -> None:
    mlp = GatedMLP(64, 96)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mlp.fused.copy_(torch.randn(192, 64, generator=gen) * 0.02)
        mlp.down_proj.weight.copy_(torch.randn(64, 96, generator=gen) * 0.02)
    x = torch.randn(5, 64, generator=gen)
    before = mlp(x)
    names = list(mlp.state_dict())
    mlp.quantize_fp8_()
    assert list(mlp.state_dict()) == names  # the checkpoint's names, now E4M3
    assert all(t.dtype == torch.float8_e4m3fn for t in mlp.state_dict().values())
    assert mlp.gate_proj.weight.data_ptr() == mlp.fused.data_ptr()  # the parts still view the fused rows
    assert mlp.up_proj.weight.data_ptr() == mlp.fused[96:].data_ptr()
    assert mlp.scale_of().shape == (192, 1) and mlp.down_proj.weight_scale.shape == (64, 1)
    gate, up = mlp.project(x)
    assert torch.equal(torch.cat([gate, up], -1), fp8.fp8_linear(x, mlp.fused, mlp.scale_of()))
    # a part called alone runs the FP8 GEMM on its rows and their scales
    assert torch.allclose(mlp.up_proj(x), up, rtol=1e-6, atol=1e-7)
    assert mlp.up_proj.weight_scale.data_ptr() == mlp.scale_of()[96:].data_ptr()
    # two GEMMs, four roundings (x, gate/up, the gated product, down) of ~2-3 % rms each
    rel = (mlp(x) - before).norm() / before.norm()
    assert 1e-3 < float(rel) < 0.10
    # a conversion (to_empty, .to(device)) re-points the parts at the E4M3 storage
    mlp._apply(lambda t: t.clone())
    assert mlp.gate_proj.weight.dtype == torch.float8_e4m3fn
    assert mlp.gate_proj.weight.data_ptr() == mlp.fused.data_ptr()
    assert mlp.up_proj.weight_scale.data_ptr() == mlp.scale_of()[96:].data_ptr()
    assert isinstance(RowParallel(4, 16), FusedRows) is False  # a RowParallel is a Weight: quantize_fp8_ of its own


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()],
                         ids=["to-bf16", "half", "float"])
def test_a_dtype_conversion_after_quantizing_keeps_the_fp8_weights_and_scales(
        convert: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
    """E4M3 weights cast to bf16, or float32 scales cast to bf16 or fp16 (small ones go subnormal),
    would change every output row (by 1-3 % here) or, on a GPU, fail the FP8 GEMM: a conversion
    moves them and keeps their dtypes, so the module gives the same outputs; what is not FP8
    (a bias) converts as asked."""
    mlp = GatedMLP(64, 96)
    biased = Weight(torch.randn(32, 64) * 1e-3, torch.randn(32))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        mlp.fused.copy_(torch.randn(192, 64, generator=gen) * 1e-3)
        mlp.down_proj.weight.copy_(torch.randn(64, 96, generator=gen) * 1e-3)
    mlp.quantize_fp8_()
    biased.quantize_fp8_()
    x = torch.randn(5, 64, generator=gen)
    before, scales, bias_before = mlp(x), mlp.scale_of().clone(), biased(x)
    convert(mlp)
    convert(biased)
    e4m3 = [mlp.fused, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, biased.weight]
    assert all(t.dtype == torch.float8_e4m3fn for t in e4m3)
    assert all(t.dtype == torch.float32 for t in (mlp.scale_of(), mlp.down_proj.weight_scale, biased.weight_scale))
    assert torch.equal(mlp.scale_of(), scales) and mlp.gate_proj.weight.data_ptr() == mlp.fused.data_ptr()
    assert torch.equal(mlp(x), before)
    assert biased.bias.dtype == convert(torch.nn.Linear(1, 1)).weight.dtype  # the bias converts
    torch.testing.assert_close(biased(x), bias_before, atol=1e-2, rtol=1e-2)  # the bias's own rounding


# ------------------------------------------------------------------------------ the compiler
def _model(yaml_text: str):
    text = WALK.read_text()
    model = place(verify(lower(parse(text, "orpheus.walk"), "tiny", "orpheus.walk")),
                  parse_placement(yaml_text, "p.yaml"))
    return memory(shard_tp(model))


def _errors(yaml_text: str) -> str:
    with pytest.raises(CompileError) as info:
        _model(yaml_text)
    sources = SourceCache()
    sources.add("orpheus.walk", WALK.read_text())
    sources.add("p.yaml", yaml_text)
    return "\n".join(render(d, sources) for d in info.value.diagnostics)


def test_weights_fp8_on_a_node_without_fp8_layers_is_e059() -> None:
    text = FP8_CPU.replace("      llm: {rank: 0, weights: fp8}\n",
                           "      snac: {rank: 0, weights: fp8}\n      prompt: {rank: 0, weights: fp8}\n")
    assert _errors(text) == """\
p.yaml:7:32: error[E059]: node 'snac' cannot hold fp8 weights: its arch 'snac_decoder' has no FP8-able weights
   7 |       snac: {rank: 0, weights: fp8}
     |                                ^^^
  = hint: weights: fp8 applies to a decoder whose layers quantize at load (the llama arch); leave 'weights' out for this node
p.yaml:8:34: error[E059]: node 'prompt' cannot hold fp8 weights: it has no arch
   8 |       prompt: {rank: 0, weights: fp8}
     |                                  ^^^
  = hint: weights: fp8 applies to a decoder whose layers quantize at load (the llama arch); leave 'weights' out for this node"""


def test_an_unknown_weights_format_is_e050() -> None:
    assert _errors(FP8_CPU.replace("weights: fp8", "weights: int4")) == """\
p.yaml:7:31: error[E050]: 'weights' of node 'llm' is 'int4'; the only format is fp8
   7 |       llm: {rank: 0, weights: int4}
     |                               ^^^^
  = hint: leave 'weights' out to keep the checkpoint's dtype"""


def test_the_memory_pass_counts_one_byte_per_fp8_weight_and_a_scale_per_row() -> None:
    base, quant = _model(FP8_CPU.replace(", weights: fp8", "")), _model(FP8_CPU)
    arch = quant.nodes["llm"].arch
    assert len(arch.fp8) == 2 * 7 and not any("embed" in n or "norm" in n for n in arch.fp8)
    shapes = {t.name: t.shape for t in arch.tensors}
    itemsize = 4  # the tiny variant is float32
    saved = sum(shapes[n][0] * shapes[n][1] * (itemsize - 1) - 4 * shapes[n][0] for n in arch.fp8)
    assert base.sharding["llm"].bytes_per_rank - quant.sharding["llm"].bytes_per_rank == saved
    weights = lambda m: m.memory.ranks[0].node_weights["llm"]  # noqa: E731
    assert weights(base) - weights(quant) == saved
    assert quant.memory.ranks[0].kv[0].pages >= base.memory.ranks[0].kv[0].pages


def test_at_tp2_a_row_split_weight_keeps_all_its_scales() -> None:
    text = FP8_CPU.replace("devices:\n  - {rank: 0, type: cpu, name: cpu, memory_gib: 16}",
                           "devices: {count: 2, type: cpu, memory_gib: 8}").replace(
        "{rank: 0, weights: fp8}", "{ranks: [0, 1], tp: 2, weights: fp8}")
    quant, base = _model(text), _model(text.replace(", weights: fp8", ""))
    shapes = {t.name: t.shape for t in quant.nodes["llm"].arch.tensors}
    splits = quant.sharding["llm"].splits
    saved = 0
    for n in quant.nodes["llm"].arch.fp8:
        rows, cols = shapes[n]
        local_rows = rows // 2 if splits[n].dim == 0 else rows  # o_proj / down_proj: split by columns
        saved += rows * cols // 2 * 3 - 4 * local_rows
    assert {splits[n].kind for n in quant.nodes["llm"].arch.fp8} == {"col", "row"}
    assert base.sharding["llm"].bytes_per_rank - quant.sharding["llm"].bytes_per_rank == saved


# ------------------------------------------------------------------------------ plan and loader
@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fp8")
    (d / "fp8.yaml").write_text(FP8_CPU)
    return {"bf16": compile_walk(d / "base.plan", WALK, "placements/cpu.yaml", variant="tiny"),
            "fp8": compile_walk(d / "fp8.plan", WALK, d / "fp8.yaml", variant="tiny")}


def test_the_plan_records_the_quantized_tensors_and_requires_the_feature(plans: dict[str, Path]) -> None:
    body = read_body(plans["fp8"])
    assert body["requires"] == ["fp8_weights"]
    q = body["nodes"]["llm"]["quantized"]
    assert q["format"] == "fp8_e4m3" and q["scales"] == "per_output_channel" and q["activations"] == "per_token"
    assert q["tensors"] == sorted(f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert "quantized" not in body["nodes"]["snac"]
    base = read_body(plans["bf16"])
    assert "requires" not in base and "quantized" not in base["nodes"]["llm"]
    plan = load_plan(plans["fp8"])
    assert plan.node("llm").weights_format == "fp8_e4m3" and plan.node("llm").quantized_tensors == tuple(q["tensors"])


def test_a_runtime_without_the_feature_refuses_the_plan(plans: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "SUPPORTED_FEATURES", loader.SUPPORTED_FEATURES - {"fp8_weights"})
    with pytest.raises(PlanError, match="this plan requires fp8_weights, which this runtime does not implement"):
        load_plan(plans["fp8"])


def _llm(plan_path: Path, dtype: torch.dtype = torch.bfloat16) -> tuple[LlamaBackbone, object]:
    plan = load_plan(plan_path)
    spec = plan.node_spec("llm", device="cpu")
    node = LlamaBackbone(dataclasses.replace(spec, dtype=dtype, settings={**spec.settings, "audio_only": False}))
    return node.eval(), plan


def test_the_loader_quantizes_after_filling(plans: dict[str, Path]) -> None:
    ref, plan = _llm(plans["bf16"])
    load_weights(ref, plan, "llm", "dummy")
    node, qplan = _llm(plans["fp8"])
    load_weights(node, qplan, "llm", "dummy")
    state = node.state_dict()
    fp8_names = {n for n, t in state.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_names == set(qplan.node("llm").quantized_tensors)
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings (and the tied head) stay
    w = ref.state_dict()["model.layers.1.mlp.down_proj.weight"].float()
    back = fp8.dequantize_rows(state["model.layers.1.mlp.down_proj.weight"], node.model.layers[1].mlp.down_proj.weight_scale)
    assert bool(((back - w).abs() <= w.abs() * 2.0**-4 + 1e-7).all())  # the same weights, quantized


def test_the_loader_refuses_a_class_that_cannot_quantize(plans: dict[str, Path]) -> None:
    with pytest.raises(WeightsError, match=r"node 'x' \(Linear\) cannot hold FP8 weights: its class has no "
                                           "quantize_weights"):
        quantize_node(torch.nn.Linear(4, 4), "x", "fp8_e4m3", ["weight"])
    node, plan = _llm(plans["fp8"])
    with pytest.raises(WeightsError, match=r"quantized 14 tensors to FP8 where the plan names 13 \(first "
                                           "difference: 'model.layers.0.mlp.down_proj.weight'\\)"):
        quantize_node(node, "llm", "fp8_e4m3", plan.node("llm").quantized_tensors[1:])


# ------------------------------------------------------------------------------ Orpheus parity
def test_tiny_orpheus_fp8_against_bf16_on_the_same_weights(plans: dict[str, Path]) -> None:
    bench = _bench()
    ref, plan = _llm(plans["bf16"])
    load_weights(ref, plan, "llm", "dummy")
    quant, qplan = _llm(plans["fp8"])
    load_weights(quant, qplan, "llm", "dummy")
    prompt = torch.randint(0, 128000, (24,), generator=torch.Generator().manual_seed(5))
    fig = bench.fp8_parity(ref, quant, prompt, 64)
    assert fig["tokens"] == 64 and fig["max_logit_error"] > 0  # FP8 is not bf16
    assert fig["max_logit_error_rel"] <= MAX_LOGIT_ERROR_REL, fig
    assert fig["greedy_agreement"] >= MIN_AGREEMENT, fig
    # the control: down_proj's scales doubled in every layer (a wrong scale) fail the logit bound
    with torch.no_grad():
        for layer in quant.model.layers:
            layer.mlp.down_proj.weight_scale.mul_(2.0)
    off = bench.fp8_parity(ref, quant, prompt, 64)
    assert off["max_logit_error_rel"] > 1.5 * MAX_LOGIT_ERROR_REL, off


def test_the_other_llama_built_nodes_run_with_fp8_weights(tmp_path: Path) -> None:
    """The VLA's two llama nodes and the ASR's encoder and decoder (the layer library's Decoder):
    `weights: fp8` on all of them compiles, loads and runs end to end; the VLA's actions stay
    near bf16's (the ASR's text ids, argmaxes of random weights' near-ties, are not compared)."""
    from mstar_runtime.control.conductor import Conductor
    from mstar_runtime.worker.worker import Worker

    head = "devices:\n  - {rank: 0, type: cpu, name: cpu, memory_gib: 16}\nmax_batch: 8\nmodels:\n"
    cases = (("vla", "act", {"prompt": torch.arange(40, dtype=torch.int32), "seed": 3}, ("vlm", "expert")),
             ("asr", "transcribe", {"audio": torch.randn(2000, generator=torch.Generator().manual_seed(0))},
              ("encoder", "decoder")))
    for model, walk, inputs, nodes in cases:
        outs = []
        for fmt in ("", ", weights: fp8"):
            yaml_path = tmp_path / f"{model}{len(fmt)}.yaml"
            yaml_path.write_text(head + f"  {model}:\n    nodes:\n"
                                 + "".join(f"      {n}: {{rank: 0{fmt}}}\n" for n in nodes))
            plan = load_plan(compile_walk(tmp_path / f"{model}{len(fmt)}.plan", ROOT / f"models/{model}/{model}.walk",
                                          yaml_path, variant="tiny"))
            assert all(bool(plan.node(n).quantized_tensors) == bool(fmt) for n in nodes)
            conductor = Conductor(plan, {0: Worker(plan, 0, torch.device("cpu"), "dummy")})
            req = conductor.submit(walk, inputs)
            conductor.run_until_idle()
            assert req.state == "finished", req.error
            outs.append(req.outputs)
        if model == "vla":
            ref, got = outs[0]["actions"], outs[1]["actions"]
            rel = float((got - ref).abs().max() / ref.abs().max())
            assert 0 < rel < MAX_LOGIT_ERROR_REL, rel
        else:
            assert outs[1]["text"].numel() > 0
