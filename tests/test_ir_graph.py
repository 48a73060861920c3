"""The networkx IR graph (mstarc/graph.py) and the passes that read and transform it.

Small `.walk` sources compiled here: the dataflow the builder records (values, reads, loop
back edges, stream items), what `verify` finds on it (stream cycles, blocks nothing fires,
unread values), the transfer vertices `place` inserts, the topological order `schedule`
emits, the graph invariants `--verify-each` checks, and `--print-after` printing the graph.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import networkx as nx
import pytest

from mstarc import graph as G
from mstarc import ir as I
from mstarc import pipeline
from mstarc.cli import main
from mstarc.diagnostics import CompileError
from mstarc.lower import lower
from mstarc.parser import parse
from mstarc.placement import parse_placement
from mstarc.verifier import check_ir

ROOT = Path(__file__).resolve().parents[1]

SPLIT = """\
model m {
  variant real { }
  node enc : stateless = m.Enc { in x : f32[4] out y : f32[4] phase run(x) -> (y) }
  node dec : stateless = m.Dec { in y : f32[4] out z : f32[4] phase run(y) -> (z) }
  node lm : kv = m.LM {
    in z : f32[4]
    in t : i32[1]
    out t : i32[1]
    out done : bool
    phase start(z) -> (t, done)
    phase step(t) -> (t, done)
  }
  edge enc.y -> dec.y
  edge dec.z -> lm.z
  walk go(x: f32[4]) -> (z: f32[4], toks: i32[N]) {
    y = enc.run(x=x)
    z = dec.run(y=y)
    t, done = lm.start(z=z)
    dynamic_loop max=8 until done carry t, done {
      t, done = lm.step(t=t)
      emit toks += t
    }
    emit z = z
  }
}
"""
TWO_RANKS = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels: {m: {nodes: {dec: 1}}}\n"


def lowered(src: str) -> I.ModelIR:
    return lower(parse(src, "m.walk"), "real", "m.walk")


def compiled(src: str, yaml: str, until: str = "schedule") -> I.ModelIR:
    return pipeline.run(lowered(src), parse_placement(yaml, "p.yaml"), until=until, verify_each=True)


def codes(src: str) -> list[tuple[str, str, str]]:
    try:
        model = pipeline.run(lowered(src), None)
    except CompileError as e:
        return sorted((d.severity, d.code, d.message) for d in e.diagnostics)
    return sorted((d.severity, d.code, d.message) for d in model.warnings)


# ---- the dataflow the builder records ---------------------------------------------------------


def test_values_reads_and_loop_back_edges() -> None:
    flow = lowered(SPLIT).graph.flow
    assert flow.nodes["go.s1"]["kind"] == "call" and flow.nodes["go.l1"]["kind"] == "loop"
    assert flow.nodes["go.s4"]["parent"] == "go.l1" and flow.nodes["go"]["children"][:3] == ["go.s1", "go.s2", "go.s3"]
    reads = {(u, k): d["back"] for u, _, k, d in flow.in_edges("go.s4", keys=True, data=True) if d["kind"] == "use"}
    # the first iteration reads the start step's token and context, later ones the step's own
    assert reads == {("go.s3/t", "arg:t"): False, ("go.s4/t", "arg:t"): True,
                     ("go.s3/lm@main", "kv"): False, ("go.s4/lm@main", "kv"): True}
    # the carried flag is read before the first iteration and after each
    until = {u for u, _, k in flow.in_edges("go.l1", keys=True) if k == "until"}
    assert until == {"go.s3/done", "go.s4/done"}
    # a value vertex per (defining call, name), with the port it came from
    assert flow.nodes["go.s1/y"] == {"kind": "value", "walk": "go", "name": "y", "origin": "go.s1",
                                     "vkind": "value", "port": "y"}
    assert flow.has_edge("go.s1", "go.s1/y", "def") and flow.has_edge("go/x", "go.s1", "arg:x")


def test_reaching_definitions_through_parallel_acc_and_fork() -> None:
    src = """\
model m {
  variant real { }
  node f : stateless = m.F { in x : f32[2] out x : f32[2] phase a(x) -> (x) phase b(x) -> (x) }
  node lm : kv = m.LM { tags one, two in x : f32[2] out x : f32[2] phase p(x) -> (x) }
  walk w(x: f32[2]) -> (y: f32[N], z: f32[2]) {
    parallel {
      branch l { u = f.a(x=x) }
      branch r { v = f.b(x=x) }
    }
    loop n=3 carry u {
      u = f.a(x=u)
      acc all += u
    }
    q = lm.p(x=v) @one
    fork lm @one -> @two
    r = lm.p(x=q) @two
    emit y = all
    emit z = r
  }
}
"""
    g = lowered(src).graph
    flow = g.flow
    branches = flow.nodes["w.p1"]["children"]
    assert [flow.nodes[b]["ir"].name for b in branches] == ["l", "r"]
    # the acc'd value is the loop call's u, collected by the acc statement
    assert flow.has_edge("w.s3/all", "w.e1", "emit") and flow.has_edge("w.a1", "w.s3/all", "acc")
    # the forked context reaches the call on @two from the call on @one
    assert flow.has_edge("w.s4/lm@two", "w.s5", "kv") and flow.has_edge("w.f1", "w.s4/lm@two", "fork")
    assert g.walk_vertices("w")[:4] == ["w", "w.p1", "w.b1", "w.s1"]


def test_topology_graph() -> None:
    topo = lowered(SPLIT).graph.topology
    assert topo.has_edge("node:enc", "node:dec", "enc.y->dec.y")
    assert {v for _, v in topo.out_edges("walk:go")} == {"node:enc", "node:dec", "node:lm"}


# ---- verify on the graph ---------------------------------------------------------------------

STREAMS = """\
model m {
  variant real { }
  node a : stateless = m.A { in x : i32[N] out c : i32[1] phase f(x) -> (c) }
  node b : stateless = m.B { in x : i32[N] out d : i32[1] phase f(x) -> (d) }
  stream a.c -> b.x : fixed(2)
  stream b.d -> a.x : fixed(2)
  walk w(x: i32[1]) -> (out: i32[N]) {
    c = a.f(x=x)
    on stream a.c -> b.x as ch { d = b.f(x=ch) emit out += d }
    on stream b.d -> a.x as dh { e = a.f(x=dh) emit out += e }
  }
}
"""


def test_streams_that_feed_each_other_are_a_cycle() -> None:
    assert codes(STREAMS) == [("error", "E047", "stream blocks feed each other's streams: "
                                                "a.c->b.x -> b.d->a.x -> a.c->b.x")]


def test_a_chain_of_streams_is_not_a_cycle() -> None:
    chain = STREAMS.replace("    on stream b.d -> a.x as dh { e = a.f(x=dh) emit out += e }\n", "")
    chain = chain.replace("  stream b.d -> a.x : fixed(2)\n", "")
    assert codes(chain) == []


def test_unused_inputs_accs_and_dead_steps_warn() -> None:
    src = """\
model m {
  variant real { }
  node f : stateless = m.F { in x : f32[2] out x : f32[2] out y : f32[2] phase a(x) -> (x, y) }
  walk w(x: f32[2], spare: int = 0) -> (z: f32[2]) {
    p, q = f.a(x=x)
    r, s = f.a(x=x)
    loop n=2 { k, l = f.a(x=x) acc ks += k }
    emit z = p
  }
}
"""
    assert codes(src) == [("warning", "E037", "accumulated value 'ks' is never used"),
                          ("warning", "E037", "input 'spare' of walk 'w' is never used"),
                          ("warning", "E037", "no result of 'f.a' is used")]


def test_inputs_a_transition_hands_on_are_used() -> None:
    src = """\
model m {
  variant real { }
  node f : stateless = m.F { in x : f32[2] out x : f32[2] out go : bool phase a(x) -> (x, go) }
  walk w(x: f32[2], prompt: str = "") -> (z: f32[2], go: bool) { z, g = f.a(x=x) emit z = z emit go = g }
  walk v(x: f32[2], prompt: str = "") -> (z: f32[2]) { z, g = f.a(x=x) emit z = z }
  transition w -> v when go
}
"""
    assert codes(src) == [("warning", "E037", "input 'prompt' of walk 'v' is never used")]


# ---- place: transfer vertices ----------------------------------------------------------------


def test_place_splits_cross_rank_reads_with_transfer_vertices() -> None:
    m = compiled(SPLIT, TWO_RANKS, until="place")
    flow = m.graph.flow
    transfers = {v: d for v, d in flow.nodes(data=True) if d["kind"] == "transfer"}
    assert [d["ir"] for d in transfers.values()] == list(m.placement.transfers)
    assert {(d["value"], d["src"], d["dst"]) for d in transfers.values()} == {("y", 0, 1), ("z", 1, 0)}
    t = next(v for v, d in transfers.items() if d["value"] == "y")
    assert flow.has_edge("go.s1/y", t) and flow.has_edge(t, "go.s2", "arg:y")
    assert not flow.has_edge("go.s1/y", "go.s2")  # the only reader is on the other rank
    assert flow.nodes["go.s2"]["ranks"] == (1,)
    # lowering's graph is not changed: passes are pure
    assert not any(d["kind"] == "transfer" for _, d in lowered(SPLIT).graph.flow.nodes(data=True))


def test_tp_reader_with_a_local_rank_keeps_its_direct_edge() -> None:
    yaml = "devices: {count: 2, type: cpu, memory_gib: 1}\nmodels: {m: {nodes: {lm: {ranks: [0, 1], tp: 2}}}}\n"
    m = compiled(SPLIT, yaml, until="place")
    flow = m.graph.flow
    assert flow.has_edge("go.s2/z", "go.s3", "arg:z")  # rank 0 of the group has z
    into = [d for u, _, d in flow.in_edges("go.s3", data=True) if d["kind"] == "transfer"]
    assert len(into) == 1 and into[0]["value"] == "go.s2/z"


def test_verifier_catches_a_cross_rank_read_without_transfer() -> None:
    m = compiled(SPLIT, TWO_RANKS, until="place")
    flow = m.graph.flow.copy()
    flow.add_edge("go.s1/y", "go.s2", key="arg:y", kind="use", vkind="value", consumer="go.s2", back=False, seq=10**6)
    broken = dataclasses.replace(m, graph=m.graph.with_flow(flow))
    assert any("without a transfer" in p for p in check_ir(broken))
    assert check_ir(m) == []


# ---- schedule: a topological order of each region ----------------------------------------------


def _calls_in_order(program: dict) -> list[str]:
    from mstar_runtime.plan.planfile import iter_ops
    return [op["id"] if op["op"] == "call" else op["op"] for op in iter_ops(program)]


def test_schedule_follows_dependencies_not_positions() -> None:
    """With the tie-break of the two first calls swapped (their `order`), it alone would put
    the reader first; the topological order keeps the writer before it."""
    m = compiled(SPLIT, TWO_RANKS, until="cuda-graphs")
    from mstarc.passes.schedule import schedule
    plain = schedule(m).schedule["go"]["program"]
    flow = m.graph.flow.copy()
    flow.nodes["go.s1"]["order"], flow.nodes["go.s2"]["order"] = flow.nodes["go.s2"]["pos"], flow.nodes["go.s1"]["pos"]
    swapped = schedule(dataclasses.replace(m, graph=m.graph.with_flow(flow))).schedule["go"]["program"]
    assert _calls_in_order(plain) == _calls_in_order(swapped)
    body = [op["op"] if op["op"] != "call" else op["id"] for op in plain["body"]]
    assert body[:4] == ["go.s1", "transfer", "go.s2", "transfer"]  # each transfer right before its reader


def test_independent_statements_follow_the_source() -> None:
    m = compiled(SPLIT, "devices: {count: 1, type: cpu, memory_gib: 1}\n")
    flow = m.graph.flow.copy()
    # enc.run and the emit of z do not depend on each other: moving the emit first is allowed
    flow.nodes["go.e2"]["order"] = -1
    from mstarc.passes.schedule import schedule
    out = schedule(dataclasses.replace(m, graph=m.graph.with_flow(flow), schedule=None)).schedule["go"]["program"]
    # but the emit reads z (dec.run), so it can only move up to right after it
    assert [op["op"] for op in out["body"]][:3] == ["call", "call", "emit"]


# ---- printing ------------------------------------------------------------------------------


def test_print_after_prints_the_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["compile", "models/orpheus/orpheus.walk", "-p", "placements/h200x2_split.yaml", "-o",
                 str(tmp_path / "p.bin"), "--print-after", "place"]) == 0
    err = capsys.readouterr().err
    graph = err[err.index("// ---- graph after place ----"):]
    assert "walk tts:" in graph and "tts.s3: call llm.decode ranks=[0]" in graph
    assert "<- tts.s3/token [arg:token, back]" in graph
    assert "transfer stream llm.code->snac.codes rank 0 -> 1" in graph


def test_dump_is_deterministic() -> None:
    a = G.dump(lowered(SPLIT).graph)
    assert a == G.dump(lowered(SPLIT).graph) and "unused" not in a.split("walk go:")[0]


def test_lca_children() -> None:
    flow = lowered(SPLIT).graph.flow
    assert G.lca_children(flow, "go.s3", "go.s4") == ("go", "go.s3", "go.l1")
    assert G.lca_children(flow, "go.l1", "go.s4") is None
    assert nx.is_directed_acyclic_graph(nx.DiGraph(
        (u, v) for u, v, d in flow.edges(data=True) if d["kind"] == "contains"))


def test_a_context_renamed_later_in_the_loop_does_not_order_backwards() -> None:
    """A fork after a branch renames the context the branch reads in the next iteration: that
    read comes through the back edge (the fork is after it), so the schedule must not order
    the fork before the branch (found by tests/test_fuzz_programs.py)."""
    src = """\
model m {
  variant real { }
  node lm : kv = m.LM {
    arch llama(layers = 2, hidden = 64, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, vocab = 256)
    tags main, alt
    out stop : bool[1]
    phase p() -> (stop)
  }
  walk w() -> (out: bool[N]) {
    dynamic_loop max = 3 until v {
      v = lm.p() @main
      parallel { branch b { u = lm.p() @alt } }
      fork lm @main -> @alt
      acc all += u
    }
    emit out += all
  }
}
"""
    m = compiled(src, "devices: {count: 1, type: cpu, memory_gib: 1}\n")
    body = m.schedule["w"]["program"]["body"][0]["body"]["body"]
    assert [op["op"] for op in body] == ["call", "parallel", "fork", "acc"]
