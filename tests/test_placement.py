"""Placement files: the loader's spans, defaults and every E050/E055 diagnostic, pinned exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstarc.diagnostics import CompileError, SourceCache, Span, render
from mstarc.placement import GIB, SPREAD, load_placement, parse_placement

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "placements").glob("*.yaml")) + [ROOT / "tests" / "placements" / "gpu24g.yaml"]


def errors(text: str, file: str = "p.yaml") -> str:
    """Every diagnostic of a bad file, rendered as the user sees it."""
    with pytest.raises(CompileError) as info:
        parse_placement(text, file)
    sources = SourceCache()
    sources.add(file, text)
    return "\n".join(render(d, sources) for d in info.value.diagnostics)


# ---- what a good file gives ------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_placements_load(path: Path) -> None:
    spec = load_placement(path, path.name)
    assert [d.rank for d in spec.devices] == list(range(len(spec.devices)))
    assert spec.name == path.stem


def test_defaults_and_units() -> None:
    spec = parse_placement("devices:\n  - {rank: 0, type: cuda, name: H200, memory_gib: 139.8, hbm_tb_s: 4.31}\n",
                           "h.yaml")
    assert spec.name == "h"
    (d,) = spec.devices
    assert (d.type, d.name, d.memory_bytes, d.hbm_bytes_per_s) == ("cuda", "H200", 150109106995, 4310000000000)
    assert (spec.kv_memory_fraction, spec.page_size, spec.max_batch, spec.default_rank) == (0.9, 16, 64, 0)
    assert d.span == Span("h.yaml", 2, 5, 2, 73)


def test_count_shorthand_expands_to_ranks() -> None:
    spec = parse_placement("placement: x\ndevices: {count: 3, type: cpu, memory_gib: 2}\ndefault_rank: spread\n",
                           "x.yaml")
    assert [(d.rank, d.type, d.name, d.memory_bytes, d.hbm_bytes_per_s) for d in spec.devices] == [
        (r, "cpu", "cpu", 2 * GIB, None) for r in range(3)]
    assert spec.default_rank == SPREAD


def test_model_sections_keep_spans() -> None:
    text = """\
devices: {count: 4, type: cuda, memory_gib: 80}
models:
  m:
    nodes:
      llm: {ranks: [0, 1, 2, 3], tp: 2}
      enc: 3
      dec: {rank: 1}
    walks:
      go:
        nodes: {dec: 2}
        branches: {a: [0, 1], b: 3}
"""
    m = parse_placement(text, "p.yaml").model("m")
    llm = m.nodes["llm"]
    assert (llm.ranks, llm.tp) == ((0, 1, 2, 3), 2)
    assert llm.tp_span == Span("p.yaml", 5, 38, 5, 39)
    assert llm.group.span == Span("p.yaml", 5, 7, 5, 10)
    assert llm.group.rank_spans[3] == Span("p.yaml", 5, 30, 5, 31)
    assert (m.nodes["enc"].ranks, m.nodes["enc"].tp) == ((3,), 1)
    assert (m.nodes["dec"].ranks, m.nodes["dec"].tp) == ((1,), 1)
    go = m.walks["go"]
    assert go.nodes["dec"].ranks == (2,)
    assert {b: g.ranks for b, g in go.branches.items()} == {"a": (0, 1), "b": (3,)}
    assert go.branches["b"].span == Span("p.yaml", 11, 31, 11, 32)


def test_ranks_default_tp_to_their_count() -> None:
    text = "devices: {count: 2, type: cuda, memory_gib: 80}\nmodels: {m: {nodes: {llm: {ranks: [0, 1]}}}}\n"
    assert parse_placement(text, "p.yaml").model("m").nodes["llm"].tp == 2


def test_missing_model_section_is_empty() -> None:
    spec = parse_placement("devices: {count: 1, type: cpu, memory_gib: 1}\n", "p.yaml")
    assert spec.model("other").nodes == {} and spec.model("other").walks == {}


# ---- E050: malformed files ---------------------------------------------------------------------


def test_malformed_yaml() -> None:
    assert errors("placement: x\ndevices: [ {rank: 0, type: cuda\nmodels: {}\n") == """\
p.yaml:3:7: error[E050]: malformed YAML: expected ',' or '}', but got ':' (while parsing a flow mapping)
   3 | models: {}
     |       ^"""


def test_malformed_yaml_indentation() -> None:
    assert errors("devices:\n  count: 1\n   type: cpu\n") == """\
p.yaml:3:8: error[E050]: malformed YAML: mapping values are not allowed here
   3 |    type: cpu
     |        ^"""


def test_unknown_top_level_key() -> None:
    assert errors("placement: x\ndevices: {count: 1, type: cpu, memory_gib: 16}\npage_sise: 16\n") == """\
p.yaml:3:1: error[E050]: unknown key 'page_sise' in the placement file
   3 | page_sise: 16
     | ^^^^^^^^^
  = hint: known keys: placement, devices, hosts, kv_memory_fraction, page_size, max_batch, default_rank, models"""


def test_unknown_device_key() -> None:
    assert errors("devices:\n  - {rank: 0, type: cpu, memory_gb: 16}\n") == """\
p.yaml:2:5: error[E050]: device 1 has no 'memory_gib'
   2 |   - {rank: 0, type: cpu, memory_gb: 16}
     |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  = hint: add `memory_gib:`; see docs/placement.md
p.yaml:2:26: error[E050]: unknown key 'memory_gb' in device 1
   2 |   - {rank: 0, type: cpu, memory_gb: 16}
     |                          ^^^^^^^^^
  = hint: known keys: rank, type, name, memory_gib, hbm_tb_s"""


def test_wrong_types_are_all_reported() -> None:
    text = "devices: {count: 1, type: cpu, memory_gib: 16}\npage_size: sixteen\nmax_batch: [1]\ndefault_rank: yes\n"
    assert errors(text) == """\
p.yaml:2:12: error[E050]: 'page_size' must be an integer, got a string ('sixteen')
   2 | page_size: sixteen
     |            ^^^^^^^
p.yaml:3:12: error[E050]: 'max_batch' must be an integer, got a list
   3 | max_batch: [1]
     |            ^^^
p.yaml:4:15: error[E050]: 'default_rank' must be a rank or `spread`, got a boolean (yes)
   4 | default_rank: yes
     |               ^^^"""


def test_missing_devices() -> None:
    assert errors("placement: x\npage_size: 16\n") == """\
p.yaml:1:1: error[E050]: the placement file has no 'devices'
   1 | placement: x
     | ^
  = hint: add `devices:`; see docs/placement.md"""


def test_empty_file_and_non_mapping() -> None:
    assert errors("") == "p.yaml:1:1: error[E050]: placement file is empty\n  = hint: see docs/placement.md"
    assert errors("- 1\n") == """\
p.yaml:1:1: error[E050]: the placement file must be a mapping, got a list
   1 | - 1
     | ^"""


def test_fraction_above_one() -> None:
    assert errors("devices: {count: 1, type: cpu, memory_gib: 1}\nkv_memory_fraction: 1.5\n") == """\
p.yaml:2:21: error[E050]: 'kv_memory_fraction' is a share of memory, at most 1, got 1.5
   2 | kv_memory_fraction: 1.5
     |                     ^^^"""


def test_node_entries() -> None:
    text = """\
devices: {count: 2, type: cuda, memory_gib: 80}
models:
  m:
    nodes:
      llm: {ranks: [0, 1, 2], tp: 2}
      x: {rank: 0, ranks: [1]}
      y: {ranks: 0}
      z: {ranks: [0, 0]}
    walks:
      go: {nodes: {enc: [one]}, branch: {}}
"""
    assert errors(text) == """\
p.yaml:5:35: error[E050]: node 'llm' has 3 ranks, not a multiple of its tp 2
   5 |       llm: {ranks: [0, 1, 2], tp: 2}
     |                                   ^
  = hint: list tp ranks per tensor-parallel group (several groups are replicas)
p.yaml:6:10: error[E050]: node 'x' needs exactly one of 'rank' and 'ranks'
   6 |       x: {rank: 0, ranks: [1]}
     |          ^^^^^^^^^^^^^^^^^^^^^
  = hint: `{rank: 0}` for one rank, `{ranks: [0, 1], tp: 2}` for a group
p.yaml:7:18: error[E050]: 'ranks' of node 'y' must be a list of ranks, got an integer (0)
   7 |       y: {ranks: 0}
     |                  ^
p.yaml:8:22: error[E050]: rank 0 is listed twice for node 'z'
   8 |       z: {ranks: [0, 0]}
     |                      ^
p.yaml:10:26: error[E050]: a rank of 'go.nodes.enc' must be an integer, got a string ('one')
  10 |       go: {nodes: {enc: [one]}, branch: {}}
     |                          ^^^
p.yaml:10:33: error[E050]: unknown key 'branch' in walk 'go'
  10 |       go: {nodes: {enc: [one]}, branch: {}}
     |                                 ^^^^^^
  = hint: known keys: nodes, branches"""


def test_duplicate_key() -> None:
    assert errors("devices: {count: 1, type: cpu, memory_gib: 1}\npage_size: 8\npage_size: 16\n") == """\
p.yaml:3:1: error[E050]: key 'page_size' appears twice in the placement file
   3 | page_size: 16
     | ^^^^^^^^^"""


# ---- E055: bad devices ---------------------------------------------------------------------------


def test_duplicate_device_rank() -> None:
    text = "devices:\n  - {rank: 0, type: cuda, name: H100, memory_gib: 80}\n  - {rank: 0, type: cuda, name: H100, memory_gib: 80}\n"
    assert errors(text) == """\
p.yaml:3:12: error[E055]: device rank 0 is defined twice
   3 |   - {rank: 0, type: cuda, name: H100, memory_gib: 80}
     |            ^
  = hint: 2 devices take ranks 0..1, each once"""


def test_bad_devices() -> None:
    text = "devices:\n  - {rank: 0, type: rocm, name: MI300, memory_gib: 192}\n  - {rank: 2, type: cuda, memory_gib: -1}\n"
    assert errors(text) == """\
p.yaml:2:21: error[E055]: device type must be 'cuda' or 'cpu', not 'rocm'
   2 |   - {rank: 0, type: rocm, name: MI300, memory_gib: 192}
     |                     ^^^^
p.yaml:3:12: error[E055]: device rank 2 is out of range
   3 |   - {rank: 2, type: cuda, memory_gib: -1}
     |            ^
  = hint: 2 devices take ranks 0..1, each once
p.yaml:3:39: error[E055]: 'memory_gib' of device 2 must be a positive number, got -1
   3 |   - {rank: 2, type: cuda, memory_gib: -1}
     |                                       ^^"""


def test_empty_devices_and_zero_count() -> None:
    assert errors("devices: []\n") == """\
p.yaml:1:10: error[E055]: 'devices' is empty
   1 | devices: []
     |          ^^
  = hint: a placement needs at least one device"""
    assert errors("devices: {count: 0, type: cpu, memory_gib: 1}\n") == """\
p.yaml:1:18: error[E055]: 'devices.count' must be at least 1, got 0
   1 | devices: {count: 0, type: cpu, memory_gib: 1}
     |                  ^"""


def test_memory_and_bandwidth_below_one_byte() -> None:
    """The plan holds whole bytes, at least one (its schema): 1e-300 GiB is no memory, not 0 bytes."""
    assert errors("devices: {count: 1, type: cuda, memory_gib: 1.0e-300, hbm_tb_s: 1.0e-15}\n") == """\
p.yaml:1:45: error[E055]: 'memory_gib' of the devices is 1e-300, less than one byte
   1 | devices: {count: 1, type: cuda, memory_gib: 1.0e-300, hbm_tb_s: 1.0e-15}
     |                                             ^^^^^^^^
p.yaml:1:65: error[E055]: 'hbm_tb_s' of the devices is 1e-15, less than one byte per second
   1 | devices: {count: 1, type: cuda, memory_gib: 1.0e-300, hbm_tb_s: 1.0e-15}
     |                                                                 ^^^^^^^"""


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(CompileError) as info:
        load_placement(tmp_path / "nope.yaml", "nope.yaml")
    assert info.value.diagnostics[0].header() == \
        "nope.yaml:1:1: error[E004]: cannot read placement file 'nope.yaml': No such file or directory"


def test_load_placement_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text("devices: {count: 2, type: cuda, memory_gib: 24}\n", encoding="utf-8")
    spec = load_placement(path)
    assert spec.name == "two" and spec.file == str(path) and len(spec.devices) == 2
