"""Placements with hosts: the `hosts` key (E057), tensor-parallel groups kept inside one host
(E058), the cross-host transfers with their bytes per step in the plan and in `explain`, and
plans of placements without hosts unchanged (no new keys)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstarc import ir as I
from mstarc.diagnostics import CompileError, SourceCache, render
from mstarc.explain import explain
from mstarc.lower import lower
from mstarc.parser import parse
from mstarc.passes.place import place
from mstarc.passes.verify import verify
from mstarc.pipeline import run
from mstarc.placement import HostSpec, parse_placement
from mstarc.plan import build_plan

ROOT = Path(__file__).resolve().parents[1]

# an LM that can shard (its heads divide by 2), a codec after it on a stream, and a CFG
# parallel whose branches a placement may map: what every host rule needs
MODEL = """\
model m {
  variant real { }
  node llm : kv = m.LLM {
    arch llama(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
    tags gen, cfg
    in prompt : i32[T]
    in x : f32[4, 8]
    out code : i32[K]
    out v : f32[4, 8]
    phase prefill(prompt) -> (code)
    phase denoise(x) -> (v)
  }
  node codec : stateless = m.Codec {
    in codes : i32[W]
    out pcm : f32[W, 16]
    phase decode(codes) -> (pcm)
  }
  stream llm.code -> codec.codes : fixed(size=4)
  walk speak(prompt: i32[T]) -> (audio: f32[N], codes: i32[M]) {
    code = llm.prefill(prompt=prompt) @gen
    emit codes += code
    on stream llm.code -> codec.codes as chunk {
      pcm = codec.decode(codes=chunk)
      emit audio += pcm
    }
  }
  walk cfg(prompt: i32[T], x: f32[4, 8]) -> (v: f32[4, 8]) {
    llm.prefill(prompt=prompt) @gen
    fork llm @gen -> @cfg
    parallel {
      branch cond { v = llm.denoise(x=x) @gen }
      branch uncond { u = llm.denoise(x=x) @cfg }
    }
    emit v = v
  }
}
"""


def errors(text: str, file: str = "p.yaml", model: str | None = None) -> str:
    """Every diagnostic of a bad placement (with `model`: through the place pass), rendered."""
    with pytest.raises(CompileError) as info:
        spec = parse_placement(text, file)
        if model is not None:
            place(verify(lower(parse(model, "m.walk"), "real", "m.walk")), spec)
    sources = SourceCache()
    sources.add(file, text)
    return "\n".join(render(d, sources) for d in info.value.diagnostics)


def compiled(text: str) -> I.ModelIR:
    model = verify(lower(parse(MODEL, "m.walk"), "real", "m.walk"))
    return run(model, parse_placement(text, "p.yaml"))


# ---- the hosts key --------------------------------------------------------------------------------


def test_host_shorthand_and_list_map_ranks_in_order() -> None:
    spec = parse_placement("devices: {count: 4, type: cuda, memory_gib: 80}\nhosts: {count: 2, devices: 2}\n", "p.yaml")
    assert [(h.host, h.ranks) for h in spec.hosts] == [(0, (0, 1)), (1, (2, 3))]
    assert [spec.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    spec = parse_placement("devices: {count: 3, type: cpu, memory_gib: 1}\nhosts:\n  - {ranks: [0, 1]}\n"
                           "  - {ranks: [2]}\n", "p.yaml")
    assert spec.hosts == (HostSpec(0, (0, 1)), HostSpec(1, (2,)))
    assert spec.hosts[1].span.line == 4
    no_hosts = parse_placement("devices: {count: 2, type: cpu, memory_gib: 1}\n", "p.yaml")
    assert no_hosts.hosts == () and no_hosts.host_of(1) is None


@pytest.mark.parametrize("hosts,expected", [
    ("{count: 2, devices: 2}", """\
p.yaml:2:8: error[E057]: 2 hosts of 2 devices make 4 ranks, but 'devices' has 3
   2 | hosts: {count: 2, devices: 2}
     |        ^^^^^^^^^^^^^^^^^^^^^^
  = hint: give as many ranks per host as each host has devices, or list them: `hosts: [{ranks: [0, 1]}, {ranks: [2]}]`"""),
    ("[{ranks: [0, 1]}, {ranks: [3]}]", """\
p.yaml:2:35: error[E057]: host 1 lists rank 3, but the placement has 3 ranks
   2 | hosts: [{ranks: [0, 1]}, {ranks: [3]}]
     |                                   ^
  = hint: known ranks: 0..2"""),
    ("[{ranks: [1, 0, 2]}]", """\
p.yaml:2:18: error[E057]: host 0 lists rank 1 where rank 0 is due
   2 | hosts: [{ranks: [1, 0, 2]}]
     |                  ^
  = hint: hosts take the ranks in order, as torchrun numbers its nodes' processes: host 0 ranks 0..k-1, host 1 \
the next ones, ..."""),
    ("[{ranks: [0]}]", """\
p.yaml:2:8: error[E057]: ranks 1..2 are on no host
   2 | hosts: [{ranks: [0]}]
     |        ^^^^^^^^^^^^^^
  = hint: every rank runs on one host: hosts take the ranks in order, as torchrun numbers its nodes' processes: \
host 0 ranks 0..k-1, host 1 the next ones, ..."""),
    ("[]", """\
p.yaml:2:8: error[E057]: 'hosts' is empty
   2 | hosts: []
     |        ^^
  = hint: list each host's ranks, or leave `hosts` out"""),
    ("[{ranks: [0, 1, 2], name: a}]", """\
p.yaml:2:28: error[E050]: unknown key 'name' in host 0
   2 | hosts: [{ranks: [0, 1, 2], name: a}]
     |                            ^^^^
  = hint: known keys: ranks"""),
    ("3", """\
p.yaml:2:8: error[E050]: 'hosts' must be a list of {ranks: [...]} or {count: H, devices: D}, got an integer (3)
   2 | hosts: 3
     |        ^"""),
])
def test_bad_hosts(hosts: str, expected: str) -> None:
    assert errors(f"devices: {{count: 3, type: cpu, memory_gib: 1}}\nhosts: {hosts}\n") == expected


# ---- tensor parallelism inside a host -------------------------------------------------------------

HOSTS = "devices: {count: 4, type: cuda, memory_gib: 80}\nhosts: {count: 2, devices: 2}\n"


def test_tp_group_across_hosts_is_refused_at_its_tp() -> None:
    text = HOSTS + "models:\n  m:\n    nodes:\n      llm: {ranks: [0, 1, 2, 3], tp: 2}\n      codec: 2\n"
    compiled(text)  # two groups, (0, 1) on host 0 and (2, 3) on host 1: fine
    assert errors(HOSTS + "models:\n  m:\n    nodes:\n      llm: {ranks: [1, 2], tp: 2}\n", model=MODEL) == """\
p.yaml:6:32: error[E058]: the tensor-parallel group [1, 2] of node 'llm' spans hosts (rank 1 on host 0, rank 2 \
on host 1)
   6 |       llm: {ranks: [1, 2], tp: 2}
     |                                ^
  = hint: keep a tp group on one host (its all-reduces run in every layer); replicas (tp 1) or pipeline stages \
may sit on other hosts"""
    # without hosts the same group is one machine's business: no diagnostic
    compiled("devices: {count: 4, type: cuda, memory_gib: 80}\nmodels:\n  m:\n    nodes:\n"
             "      llm: {ranks: [1, 2], tp: 2}\n")


def test_tp_overrides_across_hosts_are_refused_at_the_override() -> None:
    text = HOSTS + """\
models:
  m:
    nodes:
      llm: {ranks: [0, 1, 2, 3], tp: 2}
    walks:
      speak:
        nodes: {llm: [1, 2]}
      cfg:
        branches: {cond: [0, 1], uncond: [1, 2]}
"""
    out = errors(text, model=MODEL)
    assert out.count("error[E058]") == 2, out
    assert "p.yaml:9:17: error[E058]: the tensor-parallel group [1, 2] of node 'llm' in walk 'speak' spans hosts" in out
    assert "p.yaml:11:34: error[E058]: the tensor-parallel group [1, 2] of branch 'uncond' of walk 'cfg' spans " \
           "hosts" in out


# ---- what the plan records ------------------------------------------------------------------------


def test_cross_host_transfers_carry_their_bytes() -> None:
    text = HOSTS + """\
models:
  m:
    nodes:
      llm: {ranks: [0, 2], tp: 1}
      codec: 3
    walks:
      cfg:
        branches: {cond: 0, uncond: 2}
"""
    m = compiled(text)
    assert m.placement.hosts == ((0, 1), (2, 3))
    got = {(x.transfer.walk, x.transfer.value, x.transfer.kind, x.transfer.src_rank, x.transfer.dst_rank):
           (x.src_host, x.dst_host, x.bytes, x.per) for x in m.placement.cross_host}
    kv = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, bf16
    assert got == {
        ("speak", "llm.code->codec.codes", "stream", 0, 3): (0, 1, 4, ("K",)),
        ("speak", "pcm", "value", 3, 0): (1, 0, 4 * 16, ("W",)),
        ("cfg", "llm@cfg", "kv", 0, 2): (0, 1, kv, ("token",)),
    }
    body = build_plan(m, "0" * 64)
    assert body["placement"]["hosts"] == [{"host": 0, "ranks": [0, 1]}, {"host": 1, "ranks": [2, 3]}]
    assert len(body["placement"]["cross_host"]) == 3
    text_out = explain(body)
    assert "rank 2 (host 1): cuda, 80.00 GiB" in text_out
    assert "  host 0: ranks 0, 1\n  host 1: ranks 2, 3\n" in text_out
    assert ("  speak: llm.code->codec.codes (stream) rank 0 (host 0) -> rank 3 (host 1), 4 B x K   "
            "[speak.s1 -> speak.s2]") in text_out
    assert "  cfg: llm@cfg (kv) rank 0 (host 0) -> rank 2 (host 1), 256 B per token" in text_out
    md = explain(body, "markdown")
    assert "## Rank 3 (host 1)" in md and "| `speak` | `pcm` | value | rank 3 (host 1) -> rank 0 (host 0) | 64 B x W |" in md
    assert 'label="rank 1 (host 0): ' in explain(body, "dot")


def test_one_host_plans_have_no_host_keys() -> None:
    body = build_plan(compiled("devices: {count: 4, type: cuda, memory_gib: 80}\nmodels:\n  m:\n    nodes:\n"
                               "      codec: 3\n"), "0" * 64)
    assert "hosts" not in body["placement"] and "cross_host" not in body["placement"]
    out = explain(body)
    assert "host" not in out and "cross-host" not in out


def test_shipped_multi_host_placement_compiles() -> None:
    """placements/h200x4_2hosts.yaml: the thinker at tp 2 inside host 0, speech on host 1."""
    from mstarc.cli import main

    assert main(["check", str(ROOT / "models/qwen3_omni/qwen3_omni.walk"),
                 "-p", str(ROOT / "placements/h200x4_2hosts.yaml")]) == 0
