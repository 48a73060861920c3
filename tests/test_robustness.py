"""Bad input never crashes, stalls or slips through (issue 16, section 3).

A batch of generated inputs, each far larger or deeper than a real model (but under the
1 MB size cap): every one must compile or fail with coded diagnostics, never a traceback
or an internal error, within a wall-clock bound per input that is generous for a slow
2-core CI machine (`BOUND_S`). Each runs in process under a SIGALRM watchdog, so a stall
fails the test instead of hanging it. Also: the size caps of every file the compiler reads,
and the limits of mstarc/limits.py, each with its diagnostic.

`python tests/test_robustness.py` prints the time of every case.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import watchdog

from mstarc import limits
from mstarc.cli import main

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 5.0  # per input, wall clock
WATCHDOG_S = 30  # a case still running after this has stalled: fail instead of hanging


# ---- generators -------------------------------------------------------------------------

NODE_A = "node a : stateless = demo.A { in x : f32[2] out x : f32[2] out done : bool phase f(x) -> (x, done) }"
CPU = "devices:\n  - {rank: 0, type: cpu, memory_gib: 16}\n"
H200 = "devices:\n  - {rank: 0, type: cuda, name: H200, memory_gib: 139.8}\n"


def model(*items: str) -> str:
    return "model m {\n  variant real { }\n" + "\n".join(items) + "\n}\n"


def walk(body: str, ins: str = "x: f32[2]", outs: str = "y: f32[2]", name: str = "w") -> str:
    return f"walk {name}({ins}) -> ({outs}) {{\n{body}\n}}"


def many_settings(n: int = 16_000) -> str:
    return "model m {\n  variant real {\n" + "\n".join(f"    s{i} = {i} * 2" for i in range(n)) + "\n  }\n}\n"


def settings_chain(n: int = 15_000) -> str:
    # each setting refers to the next one: evaluated last to first
    lines = [f"    s{i} = s{i + 1} + 1" for i in range(n)] + [f"    s{n} = 0"]
    return "model m {\n  variant real {\n" + "\n".join(lines) + "\n  }\n}\n"


def extends_chain(n: int = 5_000) -> str:
    vs = ["  variant v0 { a = 1 }"] + [f"  variant v{i} extends v{i - 1} {{ a{i} = a + {i} }}" for i in range(1, n)]
    return "model m {\n" + "\n".join(vs) + f"\n  variant real extends v{n - 1} {{ }}\n}}\n"


def deep_blocks(depth: int = 500) -> str:
    return model(NODE_A, walk("loop n = 1 {\n" * depth + "r, d = a.f(x = x)\n" + "}\n" * depth + "emit y = x"))


def deep_parallel(depth: int = 300) -> str:
    body = "".join(f"parallel {{ branch b{i} {{\n" for i in range(depth)) + "r, d = a.f(x = x)\n" + "} }\n" * depth
    return model(NODE_A, walk(body + "emit y = x"))


def flat_sum(terms: int = 30_000) -> str:
    return "model m {\n  variant real { x = " + " + ".join(["1"] * terms) + " }\n}\n"


def deep_parens(depth: int = 40_000) -> str:
    return "model m {\n  variant real { x = " + "(" * depth + "1" + ")" * depth + " }\n}\n"


def deep_neg(depth: int = 50_000) -> str:
    return "model m {\n  variant real { x = " + "-" * depth + "1 }\n}\n"


def deep_list(depth: int = 20_000) -> str:
    return "model m {\n  variant real { x = " + "[" * depth + "1" + "]" * depth + " }\n}\n"


def deep_call(depth: int = 20_000) -> str:
    return "model m {\n  variant real { x = " + "f(" * depth + "1" + ")" * depth + " }\n}\n"


def doubling_string(n: int = 60) -> str:
    lines = ['    s0 = "ab"'] + [f"    s{i} = s{i - 1} + s{i - 1}" for i in range(1, n)]
    return "model m {\n  variant real {\n" + "\n".join(lines) + "\n  }\n}\n"


def doubling_list(n: int = 60) -> str:
    lines = ["    l0 = [1, 2]"] + [f"    l{i} = [l{i - 1}, l{i - 1}]" for i in range(1, n)]
    return "model m {\n  variant real {\n" + "\n".join(lines) + "\n  }\n}\n"


def repeated_constant(calls: int = 5_000) -> str:
    lines = ["    big = [" + ", ".join(["1.0"] * 2_000) + "]"]
    node = "node a : stateless = demo.A { in x : f32[N] out y : f32[2] phase f(x) -> (y) }"
    body = "\n".join(f"r{i} = a.f(x = big)" for i in range(calls)) + "\nemit y = r0"
    return "model m {\n  variant real {\n" + "\n".join(lines) + "\n  }\n" + node + "\n" + walk(body, "") + "\n}\n"


def squaring_ints(n: int = 40) -> str:
    lines = ["    i0 = 3"] + [f"    i{k} = i{k - 1} * i{k - 1}" for k in range(1, n)]
    return "model m {\n  variant real {\n" + "\n".join(lines) + "\n  }\n}\n"


def huge_literals() -> str:
    return model(NODE_A, "node b : stateless = demo.B { in x : f32[" + "9" * 5_000 + "] out y : f32[2] phase f(x) -> (y) }")


def float_overflow() -> str:
    return "model m {\n  variant real { a = 1.0e308 * 10.0 b = 1.0e999 c = a - a }\n}\n"


def huge_layers() -> str:
    node = ("node lm : kv = demo.LM { arch llama(layers = 1000000000000, hidden = 64, heads = 4, kv_heads = 2, "
            "head_dim = 16, intermediate = 128, vocab = 256) in x : f32[2] out y : f32[2] phase f(x) -> (y) }")
    return model(node, walk("r = lm.f(x = x)\nemit y = r"))


def huge_heads_tp() -> str:
    heads = (1 << 62) - 1
    node = (f"node lm : kv = demo.LM {{ arch llama(layers = 1, hidden = 64, heads = {heads}, kv_heads = 1, "
            "head_dim = 1, intermediate = 128, vocab = 256) in x : f32[2] out y : f32[2] phase f(x) -> (y) }")
    return model(node, walk("r = lm.f(x = x)\nemit y = r"))


def many_nodes(n: int = 1_500) -> str:
    nodes = [f"node n{i} : stateless = demo.N {{ in x : f32[2] out x : f32[2] phase f(x) -> (x) }}" for i in range(n)]
    edges = [f"edge n{i}.x -> n{i + 1}.x" for i in range(n - 1)]
    body = "\n".join(f"x = n{i}.f(x = x)" for i in range(n)) + "\nemit y = x"
    return model(*nodes, *edges, walk(body))


def many_arch_nodes(n: int = 600) -> str:
    """Kv nodes with weights, spread over the most devices a placement may have."""
    arch = "arch llama(layers = 2, hidden = 64, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, vocab = 256)"
    nodes = [f"node n{i} : kv = demo.N {{ {arch} in x : f32[2] out x : f32[2] phase f(x) -> (x) max_seq_len = 64 }}"
             for i in range(n)]
    edges = [f"edge n{i}.x -> n{i + 1}.x" for i in range(n - 1)]
    body = "\n".join(f"x = n{i}.f(x = x)" for i in range(n)) + "\nemit y = x"
    return "model m {\n  variant real { dtype = \"f32\" }\n" + "\n".join([*nodes, *edges, walk(body)]) + "\n}\n"


def many_edges(n: int = 2_500) -> str:
    nodes = ["node a : stateless = demo.A { " + " ".join(f"out o{i} : f32[2]" for i in range(n))
             + " in x : f32[2] phase f(x) -> (" + ", ".join(f"o{i}" for i in range(n)) + ") }",
             "node b : stateless = demo.B { " + " ".join(f"in i{i} : f32[2]" for i in range(n))
             + " out y : f32[2] phase g(" + ", ".join(f"i{i}" for i in range(n)) + ") -> (y) }"]
    edges = [f"edge a.o{i} -> b.i{i}" for i in range(n)]
    body = (", ".join(f"v{i}" for i in range(n)) + " = a.f(x = x)\n"
            + "r = b.g(" + ", ".join(f"i{i} = v{i}" for i in range(n)) + ")\nemit y = r")
    return model(*nodes, *edges, walk(body))


def many_streams(n: int = 800) -> str:
    nodes = ["node lm : stateless = demo.LM { in t : i32[1] " + " ".join(f"out c{i} : i32[1]" for i in range(n))
             + " phase step(t) -> (" + ", ".join(f"c{i}" for i in range(n)) + ") }",
             "node codec : stateless = demo.Codec { in codes : i32[N] out pcm : f32[S] phase decode(codes) -> (pcm) }"]
    streams = [f"stream lm.c{i} -> codec.codes : fixed(4)" for i in range(n)]
    blocks = "\n".join(f"on stream lm.c{i} -> codec.codes as k {{ p = codec.decode(codes = k) emit audio += p }}"
                       for i in range(n))
    body = blocks + "\n" + ", ".join(f"c{i}" for i in range(n)) + " = lm.step(t = t)"
    return model(*nodes, *streams, walk(body, "t: i32[1]", "audio: f32[S]"))


def nested_loops(depth: int = 60) -> str:
    """Loops nested to the limit, each carrying values: place's reaching definitions must not
    double their work at every level."""
    head = "".join("loop n = 2 carry x, z {\n" for _ in range(depth))
    body = "x, d = a.f(x = x)\nz, e = a.f(x = z)\n"
    return model(NODE_A, walk(head + body + "}\n" * depth + "emit y = x", "x: f32[2], z: f32[2]"))


def many_parallel_branches(n: int = 3_000) -> str:
    branches = " ".join(f"branch b{i} {{ r{i}, d{i} = a.f(x = x) }}" for i in range(n))
    return model(NODE_A, walk(f"parallel {{ {branches} }}\nemit y = r0"))


def many_walks(n: int = 1_500) -> str:
    walks = [walk("r, d = a.f(x = x)\nemit y = r\nemit go = d", "x: f32[2] = [0.0, 0.0]", "y: f32[2], go: bool",
                  name=f"w{i}") for i in range(n)]
    transitions = [f"transition w{i} -> w{i + 1} when go" for i in range(n - 1)]
    return model(NODE_A, *walks, *transitions)


def many_outputs(n: int = 3_000) -> str:
    outs = ", ".join(f"o{i}: f32[2]" for i in range(n))
    body = "r, d = a.f(x = x)\n" + "\n".join(f"emit o{i} = r" for i in range(n))
    return model(NODE_A, walk(body, outs=outs))


def many_tokens() -> str:
    return "model m {\n  variant real { x = [" + ", ".join(["1"] * (limits.MAX_WALK_TOKENS // 2 + 10)) + "] }\n}\n"


def over_size_cap() -> str:
    return "model m {\n  variant real { }\n}\n" + "// padding\n" * (limits.MAX_WALK_BYTES // 11 + 1)


def settings_cycles(n: int = 12_000) -> str:
    """A long chain whose every setting also refers back to its start: one cycle to report."""
    lines = [f"    s{i} = s{i + 1} + s0" for i in range(n)] + [f"    s{n} = s0"]
    return "model m {\n  variant real {\n" + "\n".join(lines) + "\n  }\n}\n"


def transition_cycles(n: int = 1_200) -> str:
    """A chain of walks whose every walk also transitions back to the first."""
    walks = [walk("r, d = a.f(x = x)\nemit y = r\nemit go = d", "x: f32[2] = [0.0, 0.0]", "y: f32[2], go: bool",
                  name=f"w{i}") for i in range(n)]
    ts = [f"transition w{i} -> w{i + 1} when go\ntransition w{i + 1} -> w0 when go" for i in range(n - 1)]
    return model(NODE_A, *walks, *ts)


def cyclic_transitions() -> str:
    w1 = walk("r, d = a.f(x = x)\nemit y = r\nemit again = true", "x: f32[2] = [0.0, 0.0]", "y: f32[2], again: bool")
    w2 = walk("r, d = a.f(x = x)\nemit y = r\nemit back = d", "x: f32[2] = [0.0, 0.0]", "y: f32[2], back: bool", "v")
    return model(NODE_A, w1, w2, "transition w -> v when again", "transition v -> w when back")


def unclosed_brackets(depth: int = 40_000) -> str:
    return "model m {\n  variant real { x = " + "[" * depth + "\n"


def unclosed_loops(depth: int = 15_000) -> str:
    return "model m {\n  walk w() -> () {\n" + "loop n = 1 {\n" * depth


def orpheus() -> str:
    return (ROOT / "models" / "orpheus" / "orpheus.walk").read_text()


# ---- placements
def many_devices(n: int = limits.MAX_DEVICES) -> str:
    return "devices:\n" + "".join(f"  - {{rank: {i}, type: cuda, name: H200, memory_gib: 139.8}}\n" for i in range(n)) \
        + "default_rank: spread\n"


def huge_count() -> str:
    return "devices: {count: 1000000000000, type: cuda, memory_gib: 80}\n"


def deep_yaml() -> str:
    return "devices: " + "[" * 20_000 + "]" * 20_000 + "\n"


def long_rank_list() -> str:
    ranks = ", ".join(str(i) for i in range(30_000))
    return CPU + f"models:\n  orpheus:\n    nodes:\n      llm: {{ranks: [{ranks}]}}\n"


def huge_numbers() -> str:
    return ("devices:\n  - {rank: 0, type: cuda, memory_gib: 1.0e+300, hbm_tb_s: 1.0e+300}\n"
            "max_batch: 100000000000000000000\npage_size: " + "9" * 5_000 + "\n")


def aliased_yaml() -> str:
    # anchors and aliases do not make the reader's work multiply
    lines = ["devices: &d", "  - {rank: 0, type: cpu, memory_gib: 16}", "models:"]
    lines += [f"  m{i}: &m{i}\n    walks: {{w: {{nodes: {{a: [0]}}}}}}" for i in range(2)]
    lines += [f"  x{i}: *m{i % 2}" for i in range(2_000)]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Case:
    name: str
    walk: Callable[[], str]
    placement: Callable[[], str] | None = None
    codes: tuple[str, ...] = ()  # every error code expected; () means it must compile
    variant: str = "real"


CASES = [
    Case("many_settings", many_settings),
    Case("settings_chain", settings_chain),
    Case("extends_chain", extends_chain),
    Case("deep_blocks", deep_blocks, codes=("E005",)),
    Case("deep_parallel", deep_parallel, codes=("E005",)),
    Case("flat_sum", flat_sum, codes=("E005",)),
    Case("deep_parens", deep_parens),
    Case("deep_neg", deep_neg, codes=("E005",)),
    Case("deep_list", deep_list, codes=("E005",)),
    Case("deep_call", deep_call, codes=("E005",)),
    Case("unclosed_brackets", unclosed_brackets, codes=("E003",)),
    Case("unclosed_loops", unclosed_loops, codes=("E003",)),
    Case("doubling_string", doubling_string, codes=("E025",)),
    Case("doubling_list", doubling_list, codes=("E025",)),
    Case("repeated_constant", repeated_constant, lambda: CPU, codes=("E025",)),
    Case("squaring_ints", squaring_ints, codes=("E025",)),
    Case("huge_literals", huge_literals, codes=("E025",)),
    Case("float_overflow", float_overflow, codes=("E025",)),
    Case("huge_layers", huge_layers, codes=("E023",)),
    Case("huge_heads_tp", huge_heads_tp, lambda: "devices: {count: 2, type: cuda, memory_gib: 80}\n"
         "models:\n  m:\n    nodes:\n      lm: {ranks: [0, 1], tp: 2}\n", codes=("E052",)),
    Case("many_nodes", many_nodes, lambda: H200),
    Case("many_arch_nodes", many_arch_nodes, many_devices),
    Case("many_edges", many_edges, lambda: H200),
    Case("many_streams", many_streams, lambda: H200),
    Case("nested_loops", nested_loops, lambda: "devices: {count: 2, type: cpu, memory_gib: 16}\n"
         "models:\n  m:\n    nodes:\n      a: {ranks: [0, 1], tp: 1}\n"),
    Case("many_parallel_branches", many_parallel_branches, lambda: H200),
    Case("many_walks", many_walks, lambda: CPU),
    Case("many_outputs", many_outputs, lambda: CPU),
    Case("many_tokens", many_tokens, codes=("E006",)),
    Case("over_size_cap", over_size_cap, codes=("E006",)),
    Case("cyclic_transitions", cyclic_transitions, codes=("E048",)),
    Case("settings_cycles", settings_cycles, codes=("E021",)),
    Case("transition_cycles", transition_cycles, codes=("E048",)),
    Case("many_devices", orpheus, many_devices),
    Case("huge_count", orpheus, huge_count, codes=("E055",)),
    Case("deep_yaml", orpheus, deep_yaml, codes=("E050",)),
    Case("long_rank_list", orpheus, long_rank_list, codes=("E051",)),
    Case("huge_numbers", orpheus, huge_numbers, codes=("E050", "E055")),
    Case("aliased_yaml", orpheus, aliased_yaml, codes=()),
]


def run_case(case: Case, tmp: Path) -> tuple[int, str, float, int]:
    """(exit status, stderr, seconds, input bytes) of `mstarc compile` (or `check`) on the case."""
    src = tmp / f"{case.name}.walk"
    text = case.walk()
    src.write_text(text)
    size = len(text.encode())
    args = ["check", str(src)]
    if case.placement is not None:
        yaml_path = tmp / f"{case.name}.yaml"
        yaml_text = case.placement()
        yaml_path.write_text(yaml_text)
        size = max(size, len(yaml_text.encode()))
        args = ["compile", str(src), "-p", str(yaml_path), "-o", str(tmp / f"{case.name}.plan")]
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with watchdog(WATCHDOG_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(args + ["--variant", case.variant])
    return code, err.getvalue(), time.perf_counter() - t0, size


def explain_times(plan: Path) -> dict[str, float]:
    """Seconds of `mstarc explain` of a plan in each format (each must succeed)."""
    times = {}
    for fmt in ("text", "markdown", "dot", "json"):
        t0 = time.perf_counter()
        with watchdog(WATCHDOG_S), contextlib.redirect_stdout(io.StringIO()):
            assert main(["explain", str(plan), "--format", fmt]) == 0, f"explain {plan.name} --format {fmt}"
        times[fmt] = time.perf_counter() - t0
    return times


def test_generated_inputs_fail_cleanly_and_fast(tmp_path: Path) -> None:
    """Every generated input compiles or fails with its codes, within BOUND_S, never with a
    traceback (an exception would fail the test) or an internal error (exit 3)."""
    slow, wrong = [], []
    total = time.perf_counter()
    for case in CASES:
        code, err, seconds, size = run_case(case, tmp_path)
        assert size <= limits.MAX_WALK_BYTES + 64, f"{case.name}: {size} bytes is not an input under the cap"
        got = sorted({line.split("error[", 1)[1][:4] for line in err.splitlines() if "error[" in line})
        if seconds > BOUND_S:
            slow.append(f"{case.name}: {seconds:.1f} s")
        if code == 3 or "Traceback" in err or got != sorted(case.codes) or code != (1 if case.codes else 0):
            wrong.append(f"{case.name}: exit {code}, codes {got}, expected {sorted(case.codes)}\n{err[-2000:]}")
        elif code == 0 and case.placement is not None:  # the plan explains within the bound too
            slow += [f"{case.name} explain --format {fmt}: {t:.1f} s"
                     for fmt, t in explain_times(tmp_path / f"{case.name}.plan").items() if t > BOUND_S]
    assert not wrong, "\n".join(wrong)
    assert not slow, f"inputs over the {BOUND_S} s bound: {', '.join(slow)}"
    assert time.perf_counter() - total < 120


# ---- at the limits, everything works --------------------------------------------------------


def at_the_limits(over: str = "") -> str:
    """Blocks nested as deep as allowed (the walk body and 63 loops), expressions as deep as
    allowed (a setting, a call constant and a dimension), the extreme 64-bit integers; with
    `over` "blocks" or "expression", one level more of it."""
    loops = limits.MAX_BLOCK_DEPTH - 1 + (over == "blocks")
    expr = "-" * (limits.MAX_EXPR_DEPTH - 1 + (over == "expression")) + "2"  # negations in a list
    body = "".join("loop n = 1 carry x {\n" for _ in range(loops)) + "x = a.f(x = x, s = k)\n" + "}\n" * loops
    branches = "".join(f"parallel {{ branch b{i} {{\n" for i in range(limits.MAX_BLOCK_DEPTH - 1)) \
        + "r = a.f(x = x, s = k)\n" + "} }\n" * (limits.MAX_BLOCK_DEPTH - 1)
    return ("model m {\n  variant real {\n    lo = -9223372036854775807 - 1\n    hi = 9223372036854775807\n"
            f"    k = [{expr}]\n    d = {'(' * 300}2{')' * 300}\n  }}\n"
            "  node a : stateless = demo.A { in x : f32[d] in s : i32[N] out x : f32[d] phase f(x, s) -> (x) }\n"
            f"  walk w(x: f32[2]) -> (y: f32[2]) {{\n{body}emit y = x\n  }}\n"
            f"  walk v(x: f32[2]) -> (y: f32[2]) {{\n{branches}emit y = r\n  }}\n}}\n")


def test_inputs_at_the_limits_compile_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the parser lets through, every later (recursive) step handles: lowering, the
    passes with --verify-each and --print-after, the plan, every explain format."""
    src, yaml = tmp_path / "deep.walk", tmp_path / "cpu.yaml"
    src.write_text(at_the_limits())
    yaml.write_text("devices: {count: 2, type: cpu, memory_gib: 16}\ndefault_rank: 1\n")
    plan = tmp_path / "deep.plan"
    args = ["compile", str(src), "-p", str(yaml), "-o", str(plan), "--verify-each"]
    for name in ("verify", "schedule"):
        args += ["--print-after", name]
    with watchdog(WATCHDOG_S):
        code, err = _check(args, capsys)
        assert code == 0, err[-3000:]
        for fmt in ("text", "markdown", "dot", "json"):
            assert main(["explain", str(plan), "--format", fmt]) == 0
            assert capsys.readouterr().out


def test_one_level_more_is_e005(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for what, message in (("blocks", "blocks nest more than 64 levels deep"),
                          ("expression", "expression nests more than 128 levels deep")):
        src = tmp_path / f"{what}.walk"
        src.write_text(at_the_limits(over=what))
        code, err = _check(["check", str(src)], capsys)
        assert code == 1
        assert f"error[E005]: {message}" in err and err.endswith("1 error\n"), err


def test_forward_transitions_and_the_64_bit_range_are_fine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    walks = "\n".join(walk("r, d = a.f(x = x)\nemit y = r\nemit go = d", "x: f32[2] = [0.0, 0.0]", "y: f32[2], go: bool",
                           name=f"w{i}") for i in range(4))
    src = tmp_path / "fwd.walk"
    src.write_text(model(NODE_A, walks, *(f"transition w{i} -> w{j} when go" for i in range(4) for j in range(i + 1, 4))))
    code, err = _check(["check", str(src)], capsys)
    assert code == 0, err


# ---- file size caps ------------------------------------------------------------------------


def _check(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def test_walk_file_over_the_cap_is_e006(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.walk"
    big.write_bytes(b"model m { variant real { } }\n" + b" " * limits.MAX_WALK_BYTES)
    code, err = _check(["check", str(big)], capsys)
    assert code == 1
    assert f"big.walk:0:0: error[E006]: '{big}' is too large: {limits.MAX_WALK_BYTES + 29} bytes, over the cap of " \
           f"{limits.MAX_WALK_BYTES} bytes" in err


def test_placement_file_over_the_cap_is_e006(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(CPU + "#" * limits.MAX_PLACEMENT_BYTES + "\n")
    code, err = _check(["check", str(ROOT / "models/orpheus/orpheus.walk"), "-p", str(big)], capsys)
    assert code == 1
    assert f"error[E006]: '{big}' is too large:" in err and f"over the cap of {limits.MAX_PLACEMENT_BYTES} bytes" in err


def test_checkpoint_config_over_the_cap_is_e022(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(limits, "MAX_JSON_BYTES", 1000)
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"hidden_size": 64, "pad": "x" * 2000}))
    _write_empty_checkpoint(weights / "model.safetensors")
    src = tmp_path / "m.walk"
    src.write_text('model m { variant real { h = from_checkpoint("config.json", "hidden_size", 64) } }\n')
    code, err = _check(["check", str(src), "--weights", str(weights)], capsys)
    assert code == 1
    assert "error[E022]: cannot read checkpoint config" in err and "over the cap of 1000 bytes" in err


def test_checkpoint_config_nan_and_deep_nesting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text('{"eps": NaN, "big": 100000000000000000000000, "deep": '
                                         + "[" * 100_000 + "]" * 100_000 + "}")
    _write_empty_checkpoint(weights / "model.safetensors")
    src = tmp_path / "m.walk"
    src.write_text('model m { variant real { e = from_checkpoint("config.json", "eps", 1.0) '
                   'b = from_checkpoint("config.json", "big", 1) } }\n')
    code, err = _check(["check", str(src), "--weights", str(weights)], capsys)
    assert code == 1 and "Traceback" not in err
    assert "error[E022]: cannot read checkpoint config" in err and "nests too deeply" in err
    (weights / "config.json").write_text('{"eps": NaN, "big": 100000000000000000000000, "list": [1, Infinity]}')
    src.write_text('model m { variant real { e = from_checkpoint("config.json", "eps", 1.0) '
                   'b = from_checkpoint("config.json", "big", 1) l = from_checkpoint("config.json", "list") } }\n')
    code, err = _check(["check", str(src), "--weights", str(weights)], capsys)
    assert code == 1
    assert "error[E025]: checkpoint config 'config.json' key 'eps' is nan, not a finite number" in err
    assert "error[E025]: checkpoint config 'config.json' key 'big' 100000000000000000000000 does not fit in 64 bits" \
        in err
    assert "error[E025]: a number of checkpoint config 'config.json' key 'list' is inf, not a finite number" in err


def _write_empty_checkpoint(path: Path) -> None:
    header = json.dumps({"__metadata__": {}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.parametrize("depth", [300, 450, 600, 5_000, 200_000])
def test_a_deeply_nested_plan_is_e070(depth: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan body nested deeper than any plan mstarc writes (crafted, with a valid checksum):
    explained and compared while Python can read it, else E070; never a traceback or E090."""
    import hashlib

    from mstar_runtime.plan import planfile

    src, yaml = tmp_path / "m.walk", tmp_path / "cpu.yaml"
    src.write_text(model(NODE_A, walk("r, d = a.f(x = x)\nemit y = r")))
    yaml.write_text(CPU)
    assert main(["compile", str(src), "-p", str(yaml), "-o", str(tmp_path / "ok.plan")]) == 0
    body = planfile.read(tmp_path / "ok.plan")
    body["walks"]["w"]["program"] = {"op": "seq", "body": ["DEEP"]}
    head, tail = json.dumps(body, sort_keys=True).encode().split(b'"DEEP"')
    raw = head + b'{"op": "seq", "body": [' * depth + b"]}" * depth + tail
    plan = tmp_path / "deep.plan"
    plan.write_bytes(planfile._HEADER.pack(planfile.MAGIC, planfile.CONTAINER_VERSION, 0, len(raw),
                                           hashlib.sha256(raw).digest()) + raw)
    for args, failed in ((["explain", str(plan)], 1), (["diff", str(plan), str(plan)], 2)):
        code, err = _check(args, capsys)
        assert code in (0, failed) and "Traceback" not in err and "E090" not in err, err[-2000:]
        assert (code == failed) == ("error[E070]" in err)
        if depth > 1000:
            assert code == failed


# ---- internal errors name their phase ------------------------------------------------------


def test_front_end_bug_is_an_internal_error_naming_the_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import mstarc.lower

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(mstarc.lower, "lower", broken)
    code, err = _check(["check", str(ROOT / "models/orpheus/orpheus.walk")], capsys)
    assert code == 3
    assert "mstarc: error[E090]: internal error in pass 'lower': KeyError: 'boom'" in err


if __name__ == "__main__":  # timings of every case
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for case in CASES:
            code, err, seconds, size = run_case(case, Path(d))
            codes = sorted({line.split("error[", 1)[1][:4] for line in err.splitlines() if "error[" in line})
            print(f"{case.name:24} {size / 1024:8.0f} KiB {seconds:6.2f} s exit {code} {codes}", flush=True)
    sys.exit(0)

