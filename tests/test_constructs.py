"""The constructs of issue 16, section 2, in the two example models models/vla/vla.walk and
models/asr/asr.walk, and what each pass makes of them. The corpus (tests/test_corpus.py)
compiles both on every placement and pins their text explanation; here, the other explain
formats of the same plans, and the passes' results one by one:

- a KV context written by one node and read by another (`phase ... reads vlm`: VLA);
- a step that reads two contexts of its node (a decoder's own and its cross-attention tag,
  `tags text, cross(max_len = N)`), which the memory pass sizes together;
- a walk input streamed in by the client (`stream transcribe.audio -> encoder.samples`);
- port dtypes named by a config value (`act[F, hidden]`), implementation arguments, node
  settings the compiler does not read rejected (E026);
- the CUDA-graph pool of captured multi-row steps, sized from rows per request x bucket.
Negative cases of the front end are in tests/negative/constructs.walk.txt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mstar_runtime.plan.planfile import iter_ops
from mstarc import ir as I
from mstarc import pipeline
from mstarc.cli import main
from mstarc.diagnostics import CompileError
from mstarc.lower import lower
from mstarc.parser import parse
from mstarc.passes.cuda_graphs import DEFAULT_MAX_GRAPH_TOKENS
from mstarc.passes.memory import GRAPH_BYTES_PER_BUCKET, _act_bytes
from mstarc.placement import parse_placement
from mstarc.plan import build_plan

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("asr", "vla")
PLACEMENTS = sorted(p.stem for p in (ROOT / "placements").glob("*.yaml"))
PAIRS = [(name, p) for name in EXAMPLES for p in PLACEMENTS]
# what each example's markdown explanation shows of its construct
SHOWN = {"vla": "reads vlm@main", "asr": "on stream transcribe.audio->encoder.samples as chunk"}
CPU = "devices: {count: 1, type: cpu, memory_gib: 16}\n"


def walk_path(name: str) -> Path:
    return ROOT / "models" / name / f"{name}.walk"


def model(name: str, variant: str = "real") -> I.ModelIR:
    path = walk_path(name)
    return lower(parse(path.read_text(), f"{name}.walk"), variant, f"{name}.walk")


def compiled(m: I.ModelIR, yaml: str) -> I.ModelIR:
    return pipeline.run(m, parse_placement(yaml, "p.yaml"), verify_each=True)


def ops(m: I.ModelIR, walk: str, kind: str = "call") -> list[dict]:
    return [op for op in iter_ops(m.schedule[walk]["program"]) if op["op"] == kind]


def errors(src: str, yaml: str | None = None) -> list[str]:
    m = lower(parse(src, "m.walk"), "real", "m.walk")
    with pytest.raises(CompileError) as e:
        pipeline.run(m, parse_placement(yaml, "p.yaml") if yaml else None)
    return [f"{d.code}: {d.message}" for d in e.value.diagnostics if d.severity == "error"]


@pytest.mark.parametrize("name,placement", PAIRS, ids=[f"{n}-{p}" for n, p in PAIRS])
def test_every_explain_format_renders(name: str, placement: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The markdown and dot templates (StrictUndefined: a field they name that the plan lacks
    fails) and the JSON dump of plans that read another context and stream an input in, on
    every placement; the text format is the corpus's golden."""
    variant = "tiny" if placement == "cpu" else "real"
    plan = tmp_path / "plan.bin"
    assert main(["compile", str(walk_path(name)), "--variant", variant, "-p",
                 str(ROOT / "placements" / f"{placement}.yaml"), "-o", str(plan)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    shown: dict[str, str] = {}
    for fmt in ("markdown", "dot", "json"):
        assert main(["explain", str(plan), "--format", fmt]) == 0
        shown[fmt] = capsys.readouterr().out
    requires = json.loads(shown["json"])["requires"]
    assert f"(requires {', '.join(requires)})" in shown["markdown"] and SHOWN[name] in shown["markdown"]
    assert shown["dot"].startswith(f'digraph "{name}" {{') and all(
        f'"{node}@' in shown["dot"] for node in json.loads(shown["json"])["nodes"])


# ---- a context written by one node, read by another -----------------------------------------


def test_action_expert_reads_the_vlm_context() -> None:
    m = compiled(model("vla"), CPU)
    denoise = next(op for op in ops(m, "act") if op["phase"] == "denoise")
    assert denoise["reads"] == [{"node": "vlm", "tag": "main"}] and denoise["tag"] == "main"
    assert "reads" not in next(op for op in ops(m, "act") if op["phase"] == "prefill")
    # the read is a use edge of the prefill's context into every denoise step
    flow = m.graph.flow
    assert flow.get_edge_data("act.s1/vlm@main", denoise["id"])["read:vlm@main"]["read"] is True
    # its own weights, counted apart from the VLM's
    weights = m.memory.ranks[0].node_weights
    assert weights["expert"] > 0 and weights["vlm"] > weights["expert"]
    body = build_plan(m, "0" * 64)
    assert body["requires"] == ["kv_reads"]
    assert body["nodes"]["expert"]["phases"]["denoise"]["reads"] == [{"node": "vlm", "tag": None}]
    # a step that reads another context is never captured, nor part of a cohort
    gpu = compiled(model("vla"), "devices: {count: 1, type: cuda, memory_gib: 80}\n")
    assert not any(g.node == "expert" for g in gpu.cuda_graphs)


def test_spread_places_the_reader_with_its_context() -> None:
    m = compiled(model("vla"), "devices: {count: 4, type: cuda, memory_gib: 80}\ndefault_rank: spread\n")
    assert m.placement.node_ranks["expert"] == m.placement.node_ranks["vlm"]
    assert not any(t.kind == "kv" for t in m.placement.transfers)


def test_reader_on_other_ranks_is_e056() -> None:
    src = walk_path("vla").read_text()
    got = errors(src, "devices: {count: 2, type: cuda, memory_gib: 80}\nmodels: {vla: {nodes: {expert: 1}}}\n")
    assert got == ["E056: step 'act.s4' (expert.denoise) reads vlm@main on ranks [1], but 'act.s1' wrote it "
                   "on ranks [0]"]


# ---- a step that reads two contexts ------------------------------------------------------


def test_decoder_pool_counts_both_contexts() -> None:
    m = compiled(model("asr"), "devices: {count: 1, type: cuda, memory_gib: 80}\nmax_batch: 8\n")
    pool = next(k for k in m.memory.ranks[0].kv if k.node == "decoder")
    # the pool is capped at max_batch requests x (text 448 + cross 1500) tokens, each context in
    # whole pages of 16 (1500 -> 1504)
    assert pool.tokens == 8 * (448 + 1504) and pool.max_seq_len == 448
    step = next(op for op in ops(m, "transcribe") if op["phase"] == "step")
    assert step["reads"] == [{"node": "decoder", "tag": "cross"}] and step["tag"] == "text"
    assert build_plan(m, "0" * 64)["nodes"]["decoder"]["tag_max_len"] == {"cross": 1500}


def test_pool_smaller_than_both_contexts_is_e061() -> None:
    src = walk_path("asr").read_text().replace("max_source = 1500", "max_source = 150000")
    got = errors(src, "devices: {count: 1, type: cuda, memory_gib: 24}\n")
    assert len(got) == 1 and got[0].startswith("E061: rank 0 (cuda cuda, 24.0 GiB): the KV pool of node 'decoder'")
    assert "fewer than the 150448 tokens one step holds at once (text 448 + cross 150000)" in got[0]


BOUNDED = """model bounded {
  variant real { }
  node lm : kv = testfamily.TinyLM {
    arch llama(layers = 1, hidden = 64, heads = 4, kv_heads = 4, head_dim = 16, intermediate = 64, vocab = 32)
    tags a(max_len = 64), b(max_len = 32)
    in prompt : i32[T]
    out token : i32[1]
    phase prefill(prompt) -> (token)
  }
  walk go(prompt: i32[T]) -> (token: i32[1]) {
    token = lm.prefill(prompt = prompt) @a
    lm.prefill(prompt = prompt) @b
    emit token = token
  }
}
"""


def test_a_pool_whose_every_tag_is_bounded_needs_only_the_longest_tag() -> None:
    # max_batch 1: the pool is capped at 64 + 32 tokens, far below max_seq_len's default 4096,
    # which bounds none of the node's contexts: no E061
    m = compiled(lower(parse(BOUNDED, "m.walk"), "real", "m.walk"), CPU + "max_batch: 1\n")
    (pool,) = m.memory.ranks[0].kv
    assert pool.tokens == 96
    # a pool that cannot hold the longest bounded context is still refused, naming it
    big = BOUNDED.replace("max_len = 64", "max_len = 1000000000")
    got = errors(big, "devices: {count: 1, type: cpu, memory_gib: 1}\n")
    assert len(got) == 1 and "fewer than its longest context (1000000000 tokens, the largest max_len of its " \
        "tags)" in got[0], got


# ---- an input streamed from the client ---------------------------------------------------


def test_streamed_input_has_a_buffer_at_the_conductor() -> None:
    m = compiled(model("asr"), "devices: {count: 2, type: cpu, memory_gib: 16}\nmodels: {asr: {nodes: {encoder: 1}}}\n")
    (buf,) = m.stream_buffers
    assert (buf.edge, buf.producer_rank, buf.consumer_rank) == ("transcribe.audio->encoder.samples", 0, 1)
    assert buf.item_type == I.ValueType("tensor", "f32", ()) and buf.chunk_items == 16000
    program = m.schedule["transcribe"]
    assert program["inputs"][0]["stream"] == buf.id and buf.id in program["streams"]
    stream_moves = [t for t in m.placement.transfers if t.kind == "stream"]
    assert [(t.src_rank, t.dst_rank, t.producer_step) for t in stream_moves] == [(0, 1, "transcribe:input:audio")]
    assert build_plan(m, "0" * 64)["requires"] == ["kv_reads", "input_streams"]


# ---- settings and types --------------------------------------------------------------------


def test_port_dtype_follows_the_variant() -> None:
    assert str(model("asr").nodes["encoder"].outputs["states"].type) == "bf16[F, 1280]"
    assert str(model("asr", "tiny").nodes["encoder"].outputs["states"].type) == "f32[F, 64]"


def test_implementation_arguments_are_settings_of_the_plan() -> None:
    m = model("asr")
    assert m.nodes["encoder"].settings == {"mel_bins": 128} and m.nodes["encoder"].impl_settings == ("mel_bins",)
    vj = lower(parse((ROOT / "models/vjepa2/vjepa2.walk").read_text(), "v.walk"), "real", "v.walk")
    assert vj.nodes["predictor"].settings == {"max_steps": 32, "normalize_reps": True, "max_batch": 512}


def test_unknown_setting_is_rejected_with_a_suggestion() -> None:
    src = ("model m { variant real { }\n  node a : stateless = t.A { in x : f32[2] out y : f32[2] phase f(x) -> (y)\n"
           "  stream_capacty = 8 }\n  walk w(x: f32[2]) -> (y: f32[2]) { y = a.f(x=x) emit y = y } }\n")
    with pytest.raises(CompileError) as e:
        lower(parse(src, "m.walk"), "real", "m.walk")
    (d,) = e.value.diagnostics
    assert (d.code, d.message) == ("E026", "node 'a' has no setting 'stream_capacty'")
    assert d.hint.startswith("did you mean 'stream_capacity'?") and "= t.A(stream_capacty = ...)" in d.hint


# ---- the CUDA-graph pool of multi-row steps --------------------------------------------------

BLOCK = """\
model m {
  variant real { rows = 1024 }
  node lm : kv = t.LM {
    arch llama(layers = 2, hidden = 64, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, vocab = 32)
    in x : f32[rows, 8]
    in token : i32[1]
    out v : f32[rows, 8]
    out token : i32[1]
    phase denoise(x) -> (v)
    phase decode(token) -> (token)
  }
  walk w(x: f32[rows, 8], t: i32[1]) -> (v: f32[rows, 8], u: i32[1]) {
    v = lm.denoise(x = x)
    u = lm.decode(token = t)
    emit v = v
    emit u = u
  }
}
"""
GPU = "devices: {count: 1, type: cuda, memory_gib: 80}\nmax_batch: 64\n"


def _pool(m: I.ModelIR) -> int:
    return m.memory.ranks[0].graph_pool_bytes


def test_multi_row_step_is_captured_within_the_token_cap() -> None:
    m = compiled(lower(parse(BLOCK, "m.walk"), "real", "m.walk"), GPU)
    buckets = {g.phase: g.buckets for g in m.cuda_graphs}
    assert buckets["decode"][-1] == 64
    assert buckets["denoise"] == tuple(b for b in buckets["decode"] if b * 1024 <= DEFAULT_MAX_GRAPH_TOKENS)
    capped = compiled(lower(parse(BLOCK.replace("phase decode(token) -> (token)\n",
                                                "phase decode(token) -> (token)\n    graph_max_tokens = 2048\n"),
                                  "m.walk"), "real", "m.walk"), GPU)
    assert {g.phase: g.buckets for g in capped.cuda_graphs}["denoise"] == (1, 2)


def test_graph_pool_is_rows_per_request_times_bucket() -> None:
    """The pool holds the largest captured step: 16 requests x 1024 rows of the denoise
    block (the token cap keeps 16 of the 64 buckets' requests), not 64 requests x 1 row;
    a model with one-row steps keeps the old estimate, max_batch x (act + logits)."""
    big = compiled(lower(parse(BLOCK, "m.walk"), "real", "m.walk"), GPU)
    one = compiled(lower(parse(BLOCK.replace("rows = 1024", "rows = 1"), "m.walk"), "real", "m.walk"), GPU)
    node = big.nodes["lm"]
    act, logits = _act_bytes(node, big.sharding["lm"])
    graphs = len(next(g for g in big.cuda_graphs if g.phase == "decode").buckets) * GRAPH_BYTES_PER_BUCKET
    assert _pool(one) == 64 * (act + logits) + graphs
    assert _pool(big) == 16 * (1024 * act + logits) + graphs
