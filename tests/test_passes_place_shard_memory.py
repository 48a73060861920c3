"""The place, shard-tp and memory passes: ranks, transfers, split specs, memory numbers, diagnostics.

Models are small `.walk` sources compiled here; placements are YAML strings. Negative tests
pin the exact rendered diagnostic (file:line:col, source line, caret, hint).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mstarc import ir as I
from mstarc.diagnostics import CompileError, SourceCache, render
from mstarc.lower import lower
from mstarc.parser import parse, parse_file
from mstarc.passes.memory import memory
from mstarc.passes.place import TransferIR, place
from mstarc.passes.shard_tp import Collective, TensorSplit, shard_tp
from mstarc.passes.verify import verify
from mstarc.placement import load_placement, parse_placement

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

SPLIT = """\
model m {
  variant real { }
  node enc : stateless = m.Enc {
    in x : f32[4]
    out y : f32[4]
    phase run(x) -> (y)
  }
  node dec : stateless = m.Dec {
    in y : f32[4]
    out z : f32[4]
    phase run(y) -> (z)
  }
  edge enc.y -> dec.y
  walk go(x: f32[4]) -> (z: f32[4]) {
    y = enc.run(x=x)
    z = dec.run(y=y)
    emit z = z
  }
}
"""

# BAGEL's CFG shape: one LLM, three KV contexts, a parallel of three denoise queries per step.
CFG = """\
model m {
  variant real { steps = 4 }
  node llm : kv = m.LLM {
    tags gen, cfg_text, cfg_img
    in prompt : i32[T]
    in x : f32[4]
    out v : f32[4]
    phase prefill(prompt) -> ()
    phase denoise(x) -> (v)
  }
  node flow : stateless = m.Flow {
    in x : f32[4]
    in v : f32[4]
    in v_text : f32[4]
    in v_img : f32[4]
    out x : f32[4]
    phase noise() -> (x)
    phase step(x, v, v_text, v_img) -> (x)
  }
  edge flow.x -> llm.x
  edge llm.v -> flow.v
  edge llm.v -> flow.v_text
  edge llm.v -> flow.v_img
  walk t2i(prompt: i32[T]) -> (image: f32[4]) {
    llm.prefill(prompt=prompt) @gen
    fork llm @gen -> @cfg_img
    x = flow.noise()
    loop n=steps carry x {
      parallel {
        branch cond { v = llm.denoise(x=x) @gen }
        branch uncond_text { v_text = llm.denoise(x=x) @cfg_text }
        branch uncond_img { v_img = llm.denoise(x=x) @cfg_img }
      }
      x = flow.step(x=x, v=v, v_text=v_text, v_img=v_img)
    }
    emit image = x
  }
}
"""

CFG3 = """\
devices: {count: 3, type: cuda, name: H100, memory_gib: 79.1}
models:
  m:
    nodes:
      llm: {ranks: [0, 1, 2], tp: 1}
    walks:
      t2i:
        branches: {cond: 0, uncond_text: 1, uncond_img: 2}
"""


def llm_model(arch_args: str, settings: str = "", engine: str = "kv", dtype: str = "bf16") -> str:
    """A one-node LM model: prefill, then a decode loop that streams tokens out."""
    return f"""\
model m {{
  variant real {{ dtype = "{dtype}" }}
  node llm : {engine} = m.LLM {{
    arch llama({arch_args})
    in prompt : i32[T]
    in token : i32[1]
    out token : i32[1]
    out done : bool
    phase prefill(prompt) -> (token, done)
    phase decode(token) -> (token, done)
{settings}  }}
  walk gen(prompt: i32[T]) -> (tokens: i32[N]) {{
    token, done = llm.prefill(prompt=prompt)
    dynamic_loop max=16 until done carry token, done {{
      token, done = llm.decode(token=token)
      emit tokens += token
    }}
  }}
}}
"""


TINY = "layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256"
# Llama-3.2-3B's shape (Orpheus' backbone); tied embeddings
LLAMA_3B = ("layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, intermediate=8192, vocab=156940, "
            "tie_embeddings=true")
# a 14B-class Llama-like (Qwen2.5-14B's shape): does not fit one 24 GiB GPU in bf16
LLAMA_14B = "layers=48, hidden=5120, heads=40, kv_heads=8, head_dim=128, intermediate=13824, vocab=152064"


def model_of(walk: str, file: str = "m.walk") -> I.ModelIR:
    return verify(lower(parse(walk, file), "real", file))


def compile_to(walk: str, yaml_text: str, until: str = "memory") -> I.ModelIR:
    model = place(model_of(walk), parse_placement(yaml_text, "p.yaml"))
    if until in ("shard", "memory"):
        model = shard_tp(model)
    if until == "memory":
        model = memory(model)
    return model


def errors(walk: str, yaml_text: str, until: str = "memory") -> str:
    with pytest.raises(CompileError) as info:
        compile_to(walk, yaml_text, until)
    sources = SourceCache()
    sources.add("m.walk", walk)
    sources.add("p.yaml", yaml_text)
    return "\n".join(render(d, sources) for d in info.value.diagnostics)


def archs_ready() -> bool:
    try:
        from mstarc.archs import REGISTRY
    except ImportError:
        return False
    return "llama" in REGISTRY


needs_archs = pytest.mark.skipif(not archs_ready(), reason="mstarc.archs.REGISTRY is not there yet")


# ---- place: ranks and transfers ----------------------------------------------------------------


def test_two_rank_split_lists_both_transfers() -> None:
    m = compile_to(SPLIT, "devices: {count: 2, type: cuda, memory_gib: 24}\nmodels: {m: {nodes: {dec: 1}}}\n")
    pl = m.placement
    assert pl.node_ranks == {"enc": (0,), "dec": (1,)}
    assert pl.call_ranks == {"go.s1": (0,), "go.s2": (1,)}
    assert pl.resident == {0: ("enc",), 1: ("dec",)}
    assert pl.transfers == (TransferIR("go", "y", 0, 1, "go.s1", "go.s2"),
                            TransferIR("go", "z", 1, 0, "go.s2", "go:emit:z"))


def test_one_rank_has_no_transfers() -> None:
    m = compile_to(SPLIT, "devices: {count: 1, type: cpu, memory_gib: 1}\n")
    assert m.placement.transfers == () and m.placement.resident == {0: ("dec", "enc")}


def test_cfg_branches_on_three_ranks() -> None:
    pl = compile_to(CFG, CFG3).placement
    assert pl.call_ranks == {"t2i.s1": (0,), "t2i.s2": (0,), "t2i.s3": (0,), "t2i.s4": (1,), "t2i.s5": (2,),
                             "t2i.s6": (0,)}
    assert pl.resident == {0: ("flow", "llm"), 1: ("llm",), 2: ("llm",)}
    T = TransferIR
    assert pl.transfers == (
        T("t2i", "x", 0, 1, "t2i.s2", "t2i.s4"),  # fan-out of the noise to the branches
        T("t2i", "x", 0, 2, "t2i.s2", "t2i.s5"),
        T("t2i", "llm@cfg_img", 0, 2, "t2i.s1", "t2i.s5", "kv"),  # the forked context follows its branch
        T("t2i", "v_text", 1, 0, "t2i.s4", "t2i.s6"),  # fan-in of the guidance velocities
        T("t2i", "v_img", 2, 0, "t2i.s5", "t2i.s6"),
        T("t2i", "x", 0, 1, "t2i.s6", "t2i.s4"),  # the next step's latent (loop back edge)
        T("t2i", "x", 0, 2, "t2i.s6", "t2i.s5"),
    )
    assert pl.to_json()["transfers"][2] == {"walk": "t2i", "value": "llm@cfg_img", "kind": "kv", "src_rank": 0,
                                            "dst_rank": 2, "producer_step": "t2i.s1", "consumer_step": "t2i.s5"}


def test_branch_and_node_overrides() -> None:
    yaml_text = """\
devices: {count: 3, type: cpu, memory_gib: 1}
models:
  m:
    nodes: {llm: 1}
    walks:
      t2i:
        nodes: {flow: 2}
        branches: {uncond_img: 0}
"""
    pl = compile_to(CFG, yaml_text).placement
    assert pl.call_ranks["t2i.s1"] == (1,)  # the node's own rank
    assert pl.call_ranks["t2i.s2"] == pl.call_ranks["t2i.s6"] == (2,)  # (walk, node)
    assert pl.call_ranks["t2i.s5"] == (0,)  # (walk, branch)
    assert pl.resident == {0: ("llm",), 1: ("llm",), 2: ("flow",)}
    # the conductor (beside rank 0) reads the emitted image from flow's rank
    assert TransferIR("t2i", "x", 2, 0, "t2i.s6", "t2i:emit:image") in pl.transfers


def test_stream_transfer_names_the_edge() -> None:
    walk = """\
model m {
  variant real { }
  node src : stateless = m.Src {
    in n : int
    out item : i32[1]
    out done : bool
    phase step(n) -> (item, done)
  }
  node sink : stateless = m.Sink {
    in items : i32[4]
    out pcm : f32[8]
    phase run(items) -> (pcm)
  }
  stream src.item -> sink.items : fixed(size=4)
  walk go(n: int) -> (pcm: f32[S]) {
    dynamic_loop max=64 until done {
      item, done = src.step(n=n)
    }
    on stream src.item -> sink.items as chunk {
      pcm = sink.run(items=chunk)
      emit pcm += pcm
    }
  }
}
"""
    pl = compile_to(walk, "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels: {m: {nodes: {sink: 1}}}\n").placement
    assert pl.transfers == (TransferIR("go", "src.item->sink.items", 0, 1, "go.s1", "go.s2", "stream"),
                            TransferIR("go", "pcm", 1, 0, "go.s2", "go:emit:pcm"))


def test_default_rank_places_unlisted_nodes() -> None:
    pl = compile_to(SPLIT, "devices: {count: 2, type: cpu, memory_gib: 1}\ndefault_rank: 1\n").placement
    assert pl.node_ranks == {"enc": (1,), "dec": (1,)}
    # the conductor runs beside rank 0 and reads the walk's outputs there
    assert pl.transfers == (TransferIR("go", "z", 1, 0, "go.s2", "go:emit:z"),)


def test_to_json_is_plain_and_ordered() -> None:
    j = compile_to(SPLIT, "devices: {count: 2, type: cuda, name: H100, memory_gib: 80, hbm_tb_s: 3.35}\n"
                          "models: {m: {nodes: {dec: 1}}}\n").placement.to_json()
    assert j["ranks"][1] == {"rank": 1, "type": "cuda", "name": "H100", "memory_bytes": 80 * 1024 * MIB,
                             "hbm_bytes_per_s": 3350000000000}
    assert "nodes" not in j  # each node's ranks and tp are in the plan's `nodes` (ranks, shard), once
    assert j["resident"] == [{"rank": 0, "nodes": ["enc"]}, {"rank": 1, "nodes": ["dec"]}]
    assert (j["page_size"], j["max_batch"], j["kv_memory_fraction"]) == (16, 64, 0.9)


# ---- place: diagnostics ------------------------------------------------------------------------------


def test_rank_out_of_range() -> None:
    yaml_text = """\
devices: {count: 2, type: cpu, memory_gib: 1}
default_rank: 5
models:
  m:
    nodes: {dec: {ranks: [1, 2]}}
"""
    assert errors(SPLIT, yaml_text, "place") == """\
p.yaml:2:15: error[E051]: default_rank 5 is out of range
   2 | default_rank: 5
     |               ^
  = hint: known ranks: 0, 1, or `spread`
p.yaml:5:30: error[E051]: node 'dec' is placed on rank 2, but the placement has 2 ranks
   5 |     nodes: {dec: {ranks: [1, 2]}}
     |                              ^
  = hint: known ranks: 0, 1"""


def test_override_ranks_out_of_range() -> None:
    yaml_text = CFG3.replace("uncond_img: 2", "uncond_img: 7").replace("t2i:\n", "t2i:\n        nodes: {flow: 3}\n")
    assert errors(CFG, yaml_text, "place") == """\
p.yaml:8:23: error[E051]: node 'flow' in walk 't2i' is placed on rank 3, but the placement has 3 ranks
   8 |         nodes: {flow: 3}
     |                       ^
  = hint: known ranks: 0, 1, 2
p.yaml:9:57: error[E051]: branch 'uncond_img' of walk 't2i' is placed on rank 7, but the placement has 3 ranks
   9 |         branches: {cond: 0, uncond_text: 1, uncond_img: 7}
     |                                                         ^
  = hint: known ranks: 0, 1, 2"""


def test_unknown_node() -> None:
    yaml_text = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels:\n  m:\n    nodes: {decoder: 1}\n"
    assert errors(SPLIT, yaml_text, "place") == """\
p.yaml:4:13: error[E053]: placement names unknown node 'decoder' of model 'm'
   4 |     nodes: {decoder: 1}
     |             ^^^^^^^
  = hint: known nodes: dec, enc"""


def test_override_of_a_node_the_walk_never_calls() -> None:
    yaml_text = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels:\n  m:\n    walks: {go: {nodes: {vae: 1}}}\n"
    assert errors(SPLIT, yaml_text, "place") == """\
p.yaml:4:26: error[E053]: walk 'go' override names unknown node 'vae'
   4 |     walks: {go: {nodes: {vae: 1}}}
     |                          ^^^
  = hint: known nodes: dec, enc"""
    walk = SPLIT.replace("  walk go", "  walk only_enc(x: f32[4]) -> (y: f32[4]) {\n    y = enc.run(x=x)\n"
                                      "    emit y = y\n  }\n  walk go")
    yaml_text = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels: {m: {walks: {only_enc: {nodes: {dec: 1}}}}}\n"
    assert errors(walk, yaml_text, "place") == """\
p.yaml:2:41: error[E053]: walk 'only_enc' never calls node 'dec'
   2 | models: {m: {walks: {only_enc: {nodes: {dec: 1}}}}}
     |                                         ^^^
  = hint: known nodes called by walk 'only_enc': enc"""


def test_unknown_walk() -> None:
    yaml_text = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels:\n  m:\n    walks:\n      goo: {nodes: {dec: 1}}\n"
    assert errors(SPLIT, yaml_text, "place") == """\
p.yaml:5:7: error[E054]: placement names unknown walk 'goo' of model 'm'
   5 |       goo: {nodes: {dec: 1}}
     |       ^^^
  = hint: known walks: go"""


def test_unknown_branch() -> None:
    assert errors(CFG, CFG3.replace("uncond_text", "cfg_text"), "place") == """\
p.yaml:8:29: error[E054]: walk 't2i' has no branch 'cfg_text'
   8 |         branches: {cond: 0, cfg_text: 1, uncond_img: 2}
     |                             ^^^^^^^^
  = hint: known branches of walk 't2i': cond, uncond_img, uncond_text"""


def test_override_group_must_match_tp() -> None:
    yaml_text = """\
devices: {count: 3, type: cpu, memory_gib: 1}
models:
  m:
    walks:
      t2i:
        branches: {uncond_img: [1, 2]}
"""
    assert errors(CFG, yaml_text, "place") == """\
p.yaml:6:20: error[E052]: branch 'uncond_img' of walk 't2i' runs node 'llm' (tp 1) on 2 ranks
   6 |         branches: {uncond_img: [1, 2]}
     |                    ^^^^^^^^^^
  = hint: map the branch to 1 rank: one tensor-parallel group"""


def test_a_section_for_another_model_is_ignored() -> None:
    yaml_text = "devices: {count: 1, type: cpu, memory_gib: 1}\nmodels: {other: {nodes: {nope: 7}}}\n"
    assert compile_to(SPLIT, yaml_text).placement.node_ranks == {"enc": (0,), "dec": (0,)}


def test_weightless_node_cannot_be_sharded() -> None:
    yaml_text = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels: {m: {nodes: {enc: {ranks: [0, 1]}}}}\n"
    assert errors(SPLIT, yaml_text, "shard") == """\
p.yaml:2:35: error[E052]: node 'enc' has no weights (no arch) to shard, but its tp is 2
   2 | models: {m: {nodes: {enc: {ranks: [0, 1]}}}}
     |                                   ^^^^^^
  = hint: run it at tp 1 (omit tp), or give the node an arch"""


def test_weightless_nodes_need_no_memory() -> None:
    m = compile_to(SPLIT, "devices: {count: 2, type: cuda, memory_gib: 1}\nmodels: {m: {nodes: {dec: 1}}}\n")
    assert [(r.weights_bytes, r.graph_pool_bytes, r.workspace_bytes, r.kv) for r in m.memory.ranks] == [
        (0, 0, 0, ()), (0, 0, 0, ())]
    assert m.sharding["enc"].to_json() == {"tp": 1, "ranks": [0], "heads_per_rank": None, "kv_heads_per_rank": None,
                                           "kv_replicas": 1, "bytes_per_rank": 0, "splits": {}, "collectives": []}


# ---- spread -----------------------------------------------------------------------------------------

SPREAD_MODEL = """\
model m {
  variant real { }
  node big : stateless = m.A {
    arch llama(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
    in x : f32[4]
    out y : f32[4]
    phase run(x) -> (y)
  }
  node mid : stateless = m.B {
    arch llama(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
    in x : f32[4]
    out y : f32[4]
    phase run(x) -> (y)
  }
  node small : stateless = m.C {
    arch llama(layers=1, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
    in x : f32[4]
    out y : f32[4]
    phase run(x) -> (y)
  }
  node glue : stateless = m.D {
    in x : f32[4]
    out y : f32[4]
    phase run(x) -> (y)
  }
  walk go(x: f32[4]) -> (a: f32[4], b: f32[4], c: f32[4], d: f32[4]) {
    a = big.run(x=x)
    b = mid.run(x=x)
    c = small.run(x=x)
    d = glue.run(x=x)
    emit a = a
    emit b = b
    emit c = c
    emit d = d
  }
}
"""


@needs_archs
def test_spread_is_largest_first_onto_the_least_loaded_rank() -> None:
    # per-layer 36,992 params: big 4 layers (180,800 params), mid 2 (106,816), small 1 (69,824)
    yaml_text = "devices: {count: 3, type: cpu, memory_gib: 1}\ndefault_rank: spread\n"
    pl = compile_to(SPREAD_MODEL, yaml_text).placement
    assert pl.node_ranks == {"big": (0,), "mid": (1,), "small": (2,), "glue": (2,)}
    # an explicitly placed node counts towards its rank's load
    yaml_text += "models: {m: {nodes: {big: 1}}}\n"
    pl = compile_to(SPREAD_MODEL, yaml_text).placement
    assert pl.node_ranks == {"big": (1,), "mid": (0,), "small": (2,), "glue": (2,)}
    # two ranks: small joins mid (the lighter rank); then rank 1 (176,640 params) is still lighter than
    # rank 0 (180,800), so the weightless node goes there too
    pl = compile_to(SPREAD_MODEL, "devices: {count: 2, type: cpu, memory_gib: 1}\ndefault_rank: spread\n").placement
    assert pl.node_ranks == {"big": (0,), "mid": (1,), "small": (1,), "glue": (1,)}
    assert pl == compile_to(SPREAD_MODEL, "devices: {count: 2, type: cpu, memory_gib: 1}\n"
                                          "default_rank: spread\n").placement


# ---- shard-tp ---------------------------------------------------------------------------------------

TP2 = "devices: {count: 2, type: cuda, name: H100, memory_gib: 80}\nmodels: {m: {nodes: {llm: {ranks: [0, 1]}}}}\n"


@needs_archs
def test_shard_specs_divide_exactly() -> None:
    spec = compile_to(llm_model(TINY), TP2, "shard").sharding["llm"]
    assert (spec.tp, spec.ranks, spec.heads_per_rank, spec.kv_heads_per_rank, spec.kv_replicas) == (2, (0, 1), 2, 1, 1)
    s = spec.splits
    assert s["model.embed_tokens.weight"] == TensorSplit("vocab", 0, 2)
    assert s["model.layers.0.self_attn.q_proj.weight"] == TensorSplit("col", 0, 2)
    assert s["model.layers.0.self_attn.k_proj.weight"] == TensorSplit("col", 0, 2)
    assert s["model.layers.0.self_attn.o_proj.weight"] == TensorSplit("row", 1, 2)
    assert s["model.layers.1.mlp.up_proj.weight"] == TensorSplit("col", 0, 2)
    assert s["model.layers.1.mlp.down_proj.weight"] == TensorSplit("row", 1, 2)
    assert s["model.layers.1.input_layernorm.weight"] == TensorSplit("replicate", None, 1)
    assert s["lm_head.weight"] == TensorSplit("vocab", 0, 2)
    # per rank, bf16: embed 256*64/2 + 2 layers * (q 2048 + k 1024 + v 1024 + o 2048 + gate/up/down 3 * 4096
    # + 2 norms * 64) + final norm 64 + head 256*64/2 = 57,568 elements
    assert spec.bytes_per_rank == 2 * (8192 + 2 * (2048 + 1024 + 1024 + 2048 + 3 * 4096 + 128) + 64 + 8192)
    assert spec.collectives == (Collective("all_reduce", "model.embed_tokens", 1),
                                Collective("all_reduce", "model.layers.*.self_attn.o_proj", 2),
                                Collective("all_reduce", "model.layers.*.mlp.down_proj", 2),
                                Collective("all_gather", "lm_head", 1))
    assert spec.to_json()["splits"]["lm_head.weight"] == {"kind": "vocab", "dim": 0, "parts": 2}


@needs_archs
def test_kv_heads_are_replicated_when_tp_is_a_multiple() -> None:
    yaml_text = "devices: {count: 4, type: cuda, memory_gib: 80}\nmodels: {m: {nodes: {llm: {ranks: [0, 1, 2, 3]}}}}\n"
    spec = compile_to(llm_model(TINY), yaml_text, "shard").sharding["llm"]
    assert (spec.heads_per_rank, spec.kv_heads_per_rank, spec.kv_replicas) == (1, 1, 2)
    assert spec.splits["model.layers.0.self_attn.k_proj.weight"] == TensorSplit("col", 0, 2)  # one KV head each
    assert spec.splits["model.layers.0.self_attn.q_proj.weight"] == TensorSplit("col", 0, 4)


@needs_archs
def test_tied_head_still_gathers_logits() -> None:
    spec = compile_to(llm_model(TINY + ", tie_embeddings=true"), TP2, "shard").sharding["llm"]
    assert spec.collectives[-1] == Collective("all_gather", "model.embed_tokens (tied head)", 1)


@needs_archs
def test_tp_not_dividing_heads() -> None:
    yaml_text = "devices: {count: 3, type: cuda, memory_gib: 80}\nmodels:\n  m:\n    nodes:\n      llm: {ranks: [0, 1, 2], tp: 3}\n"
    assert errors(llm_model(TINY), yaml_text, "shard") == """\
p.yaml:5:35: error[E052]: tp 3 does not divide heads = 4 of node 'llm'
   5 |       llm: {ranks: [0, 1, 2], tp: 3}
     |                                   ^
  = hint: use a tp that divides 4: 1, 2, 4
p.yaml:5:35: error[E052]: tp 3 does not divide intermediate = 128 of node 'llm'
   5 |       llm: {ranks: [0, 1, 2], tp: 3}
     |                                   ^
  = hint: use a tp that divides 128: 1, 2, 4, 8, 16, 32, 64, 128
p.yaml:5:35: error[E052]: tp 3 does not divide vocab = 256 of node 'llm'
   5 |       llm: {ranks: [0, 1, 2], tp: 3}
     |                                   ^
  = hint: use a tp that divides 256: 1, 2, 4, 8, 16, 32, 64, 128, 256
p.yaml:5:35: error[E052]: tp 3 neither divides kv_heads = 2 of node 'llm' nor is a multiple of it
   5 |       llm: {ranks: [0, 1, 2], tp: 3}
     |                                   ^
  = hint: use a divisor of 2 (1, 2) or a multiple of it"""


@needs_archs
def test_tp_not_dividing_vocab_and_intermediate() -> None:
    arch = "layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=130, vocab=250"
    yaml_text = "devices: {count: 4, type: cuda, memory_gib: 80}\nmodels: {m: {nodes: {llm: {ranks: [0, 1, 2, 3]}}}}\n"
    assert errors(llm_model(arch), yaml_text, "shard") == """\
p.yaml:2:35: error[E052]: tp 4 does not divide intermediate = 130 of node 'llm'
   2 | models: {m: {nodes: {llm: {ranks: [0, 1, 2, 3]}}}}
     |                                   ^^^^^^^^^^^^
  = hint: use a tp that divides 130: 1, 2, 5, 10, 13, 26, 65, 130
p.yaml:2:35: error[E052]: tp 4 does not divide vocab = 250 of node 'llm'
   2 | models: {m: {nodes: {llm: {ranks: [0, 1, 2, 3]}}}}
     |                                   ^^^^^^^^^^^^
  = hint: use a tp that divides 250: 1, 2, 5, 10, 25, 50, 125, 250"""


# ---- memory ---------------------------------------------------------------------------------------


TINY_PARAMS = 256 * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64 + 2 * 64) + 64 + 256 * 64  # 106,816


@needs_archs
def test_memory_on_a_cpu_rank_by_hand() -> None:
    yaml_text = "devices: {count: 1, type: cpu, memory_gib: 1}\nmax_batch: 8\nkv_memory_fraction: 0.5\n"
    m = compile_to(llm_model(TINY, "    max_seq_len = 1024\n"), yaml_text)
    (r,) = m.memory.ranks
    weights = 2 * TINY_PARAMS
    act = 2 * (4 * 64 + 4 * 16 + 2 * 2 * 16 + 2 * 128)  # residual/norm/attn/mlp out, q, k+v, gate+up
    logits = 4 * 256
    workspace = 8192 * act + 8 * logits  # default max_prefill_tokens; no CUDA reserve on a cpu rank
    budget = int(0.5 * (1 * 1024 * MIB - weights - workspace))
    per_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 kv heads, head_dim 16, bf16
    pages = min(budget // (16 * per_token), 8 * 1 * 1024 // 16)  # capped: max_batch x tags x max_seq_len
    assert pages == 512
    assert (r.capacity_bytes, r.weights_bytes, r.graph_pool_bytes, r.workspace_bytes, r.kv_budget_bytes) == (
        1024 * MIB, weights, 0, workspace, budget)
    assert (weights, workspace, budget, budget // (16 * per_token)) == (213632, 10493952, 531517120, 129764)
    (kv,) = r.kv
    assert (kv.node, kv.bytes_per_token, kv.pages, kv.tokens, kv.bytes, kv.max_seq_len) == (
        "llm", per_token, pages, pages * 16, pages * 16 * per_token, 1024)
    assert m.memory.weights_source == {"llm": "arch"}
    assert m.memory.to_json()["ranks"][0]["free_bytes"] == r.capacity_bytes - weights - workspace - kv.bytes


@needs_archs
def test_memory_on_cuda_at_tp2_by_hand() -> None:
    m = compile_to(llm_model(TINY), TP2)
    act = 2 * (4 * 64 + 2 * 16 + 2 * 1 * 16 + 2 * 64)  # heads and intermediate halved per rank
    logits = 4 * 128
    graph = 64 * (act + logits) + 9 * 4 * MIB  # buckets 1 2 4 8 16 24 32 48 64
    workspace = 8192 * act + 64 * logits + 256 * MIB
    per_token = 2 * 2 * 1 * 16 * 2
    weights = m.sharding["llm"].bytes_per_rank
    for r in m.memory.ranks:
        assert (r.weights_bytes, r.graph_pool_bytes, r.workspace_bytes) == (weights, graph, workspace)
        budget = int(0.9 * (80 * 1024 * MIB - weights - graph - workspace))
        useful = 64 * 1 * 4096 // 16  # max_batch x tags x max_seq_len tokens, in pages
        assert r.kv[0].pages == min(budget // (16 * per_token), useful) and r.kv[0].bytes_per_token == per_token


@needs_archs
def test_kv_nodes_of_a_rank_hold_the_same_tokens() -> None:
    walk = llm_model(TINY).replace("  walk gen", """\
  node draft : kv = m.Draft {
    arch llama(layers=1, hidden=64, heads=4, kv_heads=4, head_dim=16, intermediate=128, vocab=256)
    in prompt : i32[T]
    out token : i32[1]
    phase prefill(prompt) -> (token)
  }
  walk guess(prompt: i32[T]) -> (token: i32[1]) {
    token = draft.prefill(prompt=prompt)
    emit token = token
  }
  walk gen""")
    (r,) = compile_to(walk, "devices: {count: 1, type: cpu, memory_gib: 1}\nmax_batch: 1024\n").memory.ranks
    draft, llm = r.kv
    assert (draft.node, llm.node) == ("draft", "llm")
    assert draft.tokens == llm.tokens and (draft.bytes_per_token, llm.bytes_per_token) == (256, 256)
    assert draft.pages == r.kv_budget_bytes // (16 * (256 + 256))


@needs_archs
def test_checkpoint_headers_size_the_weights() -> None:
    m = place(model_of(llm_model(TINY)), parse_placement("devices: {count: 1, type: cpu, memory_gib: 1}\n", "p.yaml"))
    arch = m.nodes["llm"].arch
    # the checkpoint stores everything in f32: twice the arch's bf16 bytes
    ck = I.CheckpointIR("dir", "w", (), {t.name: ("f32", tuple(t.shape)) for t in arch.tensors})
    out = memory(shard_tp(dataclasses.replace(m, checkpoint=ck)))
    assert out.memory.ranks[0].weights_bytes == 4 * TINY_PARAMS
    assert out.memory.weights_source == {"llm": "checkpoint"}


@needs_archs
def test_model_does_not_fit() -> None:
    walk = llm_model(LLAMA_14B)
    spec = load_placement(ROOT / "tests" / "placements" / "gpu24g.yaml", "gpu24g.yaml")
    with pytest.raises(CompileError) as info:
        memory(shard_tp(place(model_of(walk), spec)))
    sources = SourceCache()
    sources.add("gpu24g.yaml", (ROOT / "tests" / "placements" / "gpu24g.yaml").read_text())
    assert "\n".join(render(d, sources) for d in info.value.diagnostics) == """\
gpu24g.yaml:5:5: error[E060]: rank 0 (cuda RTX-24G, 24.0 GiB) needs 27.5 GiB for weights, 79.9 MiB for the \
CUDA-graph pool and 1.1 GiB of workspace: 28.7 GiB in all; largest nodes: llm 27.5 GiB
   5 |   - {rank: 0, type: cuda, name: RTX-24G, memory_gib: 24, hbm_tb_s: 1.0}
     |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  = hint: use more ranks (or `default_rank: spread`), a higher tp for the largest node, or a smaller variant"""


@needs_archs
def test_qwen3_omni_does_not_fit_one_24g_gpu() -> None:
    path = ROOT / "models" / "qwen3_omni" / "qwen3_omni.walk"
    model = verify(lower(parse_file(path, "qwen3_omni.walk"), "real", "qwen3_omni.walk"))
    spec = load_placement(ROOT / "tests" / "placements" / "gpu24g.yaml", "gpu24g.yaml")
    with pytest.raises(CompileError) as info:
        memory(shard_tp(place(model, spec)))
    assert [d.header() for d in info.value.diagnostics] == [
        "gpu24g.yaml:5:5: error[E060]: rank 0 (cuda RTX-24G, 24.0 GiB) needs 65.7 GiB for weights, 114.0 MiB for the "
        "CUDA-graph pool and 693.1 MiB of workspace: 66.5 GiB in all; largest nodes: thinker 56.9 GiB, "
        "talker 6.2 GiB, audio_enc 1.2 GiB"]


def test_sub_gib_sizes_read_in_smaller_units() -> None:
    """A figure under 1 GiB is given in MiB (or KiB, B), never as `0.0 GiB`."""
    got = errors(llm_model(TINY), "devices: {count: 1, type: cuda, memory_gib: 0.1}\n").splitlines()[0]
    assert got == ("p.yaml:1:10: error[E060]: rank 0 (cuda cuda, 102.4 MiB) needs 208.6 KiB for weights, "
                   "36.1 MiB for the CUDA-graph pool and 266.1 MiB of workspace: 302.4 MiB in all; "
                   "largest nodes: llm 208.6 KiB")


@needs_archs
def test_kv_pool_too_small() -> None:
    walk = llm_model(LLAMA_3B, "    max_seq_len = 1048576\n")
    spec = load_placement(ROOT / "tests" / "placements" / "gpu24g.yaml", "gpu24g.yaml")
    with pytest.raises(CompileError) as info:
        memory(shard_tp(place(model_of(walk), spec)))
    # by hand: Llama-3.2-3B with Orpheus' vocab, tied: 3,300,867,072 params in bf16
    weights = 2 * 3_300_867_072
    act = 2 * (4 * 3072 + 24 * 128 + 2 * 8 * 128 + 2 * 8192)
    logits = 4 * 156940
    graph = 64 * (act + logits) + 9 * 4 * MIB
    workspace = 8192 * act + 64 * logits + 256 * MIB
    budget = int(0.9 * (24 * 1024 * MIB - weights - graph - workspace))
    per_token = 2 * 28 * 8 * 128 * 2
    assert budget // (16 * per_token) * 16 == 142992
    (d,) = info.value.diagnostics
    assert d.header() == (
        "gpu24g.yaml:5:5: error[E061]: rank 0 (cuda RTX-24G, 24.0 GiB): the KV pool of node 'llm' holds 142992 "
        "tokens, fewer than one sequence of max_seq_len 1048576 (114688 bytes per token)")
    assert d.hint == ("give the rank more memory or fewer nodes, raise kv_memory_fraction or tp, "
                      "or lower the node's max_seq_len")


# ---- the corpus --------------------------------------------------------------------------------------


def corpus(name: str, placement: str) -> I.ModelIR:
    path = ROOT / "models" / name / f"{name}.walk"
    model = verify(lower(parse_file(path, f"{name}.walk"), "real", f"{name}.walk"))
    return memory(shard_tp(place(model, load_placement(ROOT / "placements" / placement, placement))))


@needs_archs
def test_bagel_cfg_on_three_gpus() -> None:
    m = corpus("bagel", "bagel_cfg3.yaml")
    pl = m.placement
    assert pl.resident[1] == pl.resident[2] == ("llm",)
    kv = [(t.walk, t.value, t.src_rank, t.dst_rank) for t in pl.transfers if t.kind == "kv"]
    # The contexts with pages move: edit's two (prefilled on rank 0), t2i's and draw's @cfg_img
    # (a fork of @gen after the prompt; draw's @gen is chat's, kept by the transition). An
    # empty @cfg_text has nothing to move: t2i's is a fork of an empty @gen (no transition into
    # t2i), draw's the one chat forked before its prompt.
    assert sorted(set(kv)) == [("draw", "llm@cfg_img", 0, 2), ("edit", "llm@cfg_img", 0, 2),
                               ("edit", "llm@cfg_text", 0, 1), ("t2i", "llm@cfg_img", 0, 2)]
    fan_in = {(t.walk, t.value, t.src_rank) for t in pl.transfers if t.dst_rank == 0}
    assert fan_in == {(w, v, r) for w in ("t2i", "edit", "draw") for v, r in (("v_text", 1), ("v_img", 2))}


@needs_archs
def test_qwen3_omni_thinker_at_tp2() -> None:
    m = corpus("qwen3_omni", "qwen3_omni_tp2.yaml")
    spec = m.sharding["thinker"]
    assert (spec.tp, spec.ranks, spec.heads_per_rank, spec.kv_heads_per_rank) == (2, (0, 1), 16, 2)
    arch = m.nodes["thinker"].arch
    whole = sum(t.nbytes for t in arch.tensors if t.shard == "replicate")  # norms, routers
    assert spec.bytes_per_rank == (arch.bytes() - whole) // 2 + whole
    assert m.placement.resident[1] == ("code2wav", "talker", "thinker")
    pools = {r.rank: {k.node: k.pages for k in r.kv} for r in m.memory.ranks}
    assert pools[0]["thinker"] == pools[1]["thinker"]  # one TP group: page ids agree


@needs_archs
def test_a_codec_graph_pool_is_budgeted_per_window() -> None:
    """Orpheus' SNAC node states its peak activation per 28-code window (arch `window = 28`):
    the graph pool on its rank is max_batch windows of it, not a transformer's per-token guess."""
    from mstarc.archs.snac import decode_peak_elements

    walk = (ROOT / "models/orpheus/orpheus.walk").read_text()
    yaml_text = ("devices: {count: 2, type: cuda, name: H200, memory_gib: 139.8}\nmax_batch: 64\n"
                 "models:\n  orpheus:\n    nodes:\n      llm: 0\n      prompt: 0\n      snac: 1\n")
    m = compile_to(walk, yaml_text)
    snac_rank = m.memory.ranks[1]
    per_window = 2 * decode_peak_elements({"vq_strides": [4, 2, 1], "decoder_dim": 1024,
                                           "decoder_rates": [8, 8, 4, 2]}, 28)  # bf16
    assert snac_rank.graph_pool_bytes == 64 * per_window + 9 * 4 * MIB
    assert snac_rank.workspace_bytes == 64 * per_window + 256 * MIB  # a batch of windows, not 8192 "tokens"


@needs_archs
def test_pi05_pool_counts_the_captured_denoise_block_with_its_gathered_prefix() -> None:
    """π0.5's expert step reads the VLM's prefix and is captured as its cohort's graphs: its
    largest bucket (256 rows of a 50-token block) holds the block's activations and, per row,
    the 968-token prefix gathered with the block in float32 (1 KV head, then 8 query heads,
    head_dim 256) and two score tensors; plus 4 MiB for each of its 21 buckets. (Before, the
    pool counted no reading step: 0 B.)"""
    from mstarc.passes.memory import _act_bytes

    path = ROOT / "models" / "pi05" / "pi05.walk"
    model = verify(lower(parse_file(path, "pi05.walk"), "real", "pi05.walk"))
    m = memory(shard_tp(place(model, load_placement(ROOT / "placements" / "h200x1.yaml", "h200x1.yaml"))))
    act, logits = _act_bytes(m.nodes["expert"], m.sharding["expert"])
    assert logits == 0  # the expert has no vocabulary
    keys = 968 + 50
    gathered = 2 * 4 * keys * 256 * (1 + 8) + 2 * 4 * 8 * 50 * keys
    assert gathered == 22_021_376
    # the only captured step of the plan (the vision tower and the VLM take symbolic shapes)
    assert m.memory.ranks[0].graph_pool_bytes == 256 * (50 * act + gathered) + 21 * 4 * MIB
