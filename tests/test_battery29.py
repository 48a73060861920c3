"""A fresh battery of bad input for the compiler and the plan loader (issue 29, section 3).

Generated instances of every class the issue lists, none of them copied from the other
negative tests: duplicate context reads and tag settings, reads ordered after their writes
by a loop or an `on stream` block, values past the plan schema's ranges, text that acts on a
terminal, special files where a file is read, and plans edited and re-checksummed. Each
walk case must compile (or check) or fail with exactly its error codes; each plan case must
be refused by the loader and by `mstarc explain` alike, naming the field, or be accepted by
both. Never a traceback, an internal error (exit 3) or a hang: every case runs under a
SIGALRM watchdog (no wall-clock bound on how fast it is).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import watchdog

from mstar_runtime.plan import planfile
from mstar_runtime.plan.loader import PlanError, load_plan
from mstarc.cli import main

ROOT = Path(__file__).resolve().parent.parent
WATCHDOG_S = 60  # a case still running after this has hung


def mstarc(args: list[str]) -> tuple[int, str, str]:
    """(exit status, stderr, stdout) of `mstarc ARGS`, in process, under the watchdog."""
    err, out = io.StringIO(), io.StringIO()
    with watchdog(WATCHDOG_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(args)
    return code, err.getvalue(), out.getvalue()


def error_codes(err: str) -> list[str]:
    return sorted({line.split("error[", 1)[1][:4] for line in err.splitlines() if ": error[E" in line})


# ---- walk sources ---------------------------------------------------------------------------

ARCH = "arch llama(layers = 2, hidden = 64, heads = 4, kv_heads = 2, head_dim = 16, intermediate = {}, vocab = 32)"
CPU = "devices:\n  - {rank: 0, type: cpu, memory_gib: 16}\n"
HUGE = "devices:\n  - {rank: 0, type: cpu, memory_gib: 1048576}\n"


def kv_model(body: str, reads: str = "vlm", extra: str = "") -> str:
    """A VLM that writes two contexts (and streams codes to the expert), an expert that reads one."""
    return f"""model m {{
  variant real {{ }}
  node vlm : kv = demo.VLM {{
    {ARCH.format(128)}
    tags main, side
    in p : i32[T]
    out code : i32[1]
    phase prefill(p) -> ()
    phase gen(p) -> (code)
  }}
  node ex : kv = demo.Ex {{
    {ARCH.format(64)}
    tags main, side
    in x : f32[2]
    in codes : i32[N]
    out v : f32[2]
    phase denoise(x) -> (v) reads {reads}
    phase eat(codes) -> ()
  }}
  node s : stateless = demo.S {{ in x : f32[2] out done : bool phase stop(x) -> (done) }}
  stream vlm.code -> ex.codes : fixed(size = 2)
  {extra}
  walk w(p: i32[T], x: f32[2]) -> (v: f32[2]) {{
{body}
    emit v = x
  }}
}}
"""


def plain_model(items: str, body: str, ins: str = "x: f32[2]", outs: str = "y: f32[2]") -> str:
    return (f"model m {{\n  variant real {{ }}\n  node a : stateless = demo.A {{ in x : f32[2] out y : f32[2] "
            f"out d : bool phase f(x) -> (y) phase g(x) -> (y, d) }}\n{items}\n"
            f"  walk w({ins}) -> ({outs}) {{\n{body}\n  }}\n}}\n")


@dataclass(frozen=True)
class WalkCase:
    name: str
    text: str
    codes: tuple[str, ...] = ()  # every error code expected; () means it must pass
    placement: str | None = None  # given: `compile` (every pass, and the plan's schema check)


def _resolve(read: str, tag: str) -> str:
    return read if "@" in read else f"{read}@{tag}"


def read_cases() -> list[WalkCase]:
    """Every pair (and a triple) of `reads` entries, called on each tag: a context twice is E010."""
    cases = []
    entries = ["vlm", "vlm@main", "vlm@side"]
    writes = "    vlm.prefill(p = p)\n    vlm.prefill(p = p) @side\n"
    for a in entries:
        for b in entries:
            for tag in ("main", "side"):
                dup = a == b or _resolve(a, tag) == _resolve(b, tag)
                body = writes + f"    r = ex.denoise(x = x) @{tag}"
                cases.append(WalkCase(f"reads[{a},{b}]@{tag}", kv_model(body, f"{a}, {b}"), ("E010",) if dup else ()))
    cases.append(WalkCase("reads[triple]", kv_model(writes + "    r = ex.denoise(x = x) @side",
                                                    "vlm@main, vlm@side, vlm"), ("E010",)))
    # lowering stops the checks: the unknown node (E012, verify) is not reported yet
    cases.append(WalkCase("reads[unknown twice]", kv_model(writes + "    r = ex.denoise(x = x)", "nope, nope"),
                          ("E010",)))
    return cases


def tag_cases() -> list[WalkCase]:
    settings = {
        "max_len = 8": (), "max_len = 8, max_len = 8": ("E010",), "max_len = 8, max_len = 9": ("E010",),
        "max_len = 9, max_len = 8, max_len = 7": ("E010",), "max_len = 0": ("E026",), "max_len = -3": ("E026",),
        "max_len = 8.0": ("E026",), 'max_len = "8"': ("E026",), "8": ("E026",), "max_lne = 8": ("E026",),
        "max_len = 8, max_lne = 8, max_lne = 8": ("E026",), "max_len = true": ("E026",),
        "max_len = 9223372036854775807": (), "max_len = 9223372036854775808": ("E025",),
    }
    cases = []
    for args, codes in settings.items():
        text = (f"model m {{\n  variant real {{ }}\n  node lm : kv = demo.LM {{\n    {ARCH.format(128)}\n"
                f"    tags text, cross({args})\n    in x : f32[2]\n    out y : f32[2]\n    phase f(x) -> (y)\n  }}\n"
                "  walk w(x: f32[2]) -> (y: f32[2]) { r = lm.f(x = x) @cross emit y = r }\n}\n")
        cases.append(WalkCase(f"tag[{args}]", text, codes))
    return cases


ORDER: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # name: (reads, body, codes)
    "write_then_read": ("vlm", "vlm.prefill(p = p)\nr = ex.denoise(x = x)", ()),
    "read_then_write": ("vlm", "r = ex.denoise(x = x)\nvlm.prefill(p = p)", ("E039",)),
    "loop_read_then_write": ("vlm", "loop n = 3 { r = ex.denoise(x = x) vlm.prefill(p = p) }", ("E039",)),
    "loop_write_then_read": ("vlm", "loop n = 3 { vlm.prefill(p = p) r = ex.denoise(x = x) }", ()),
    "before_and_in_loop": ("vlm", "vlm.prefill(p = p)\nloop n = 3 { r = ex.denoise(x = x) vlm.prefill(p = p) }", ()),
    "dynamic_read_then_write": ("vlm", "dynamic_loop max = 4 until d { r = ex.denoise(x = x) vlm.prefill(p = p) "
                                "d = s.stop(x = x) }", ("E039",)),
    "indexed_loop": ("vlm", "loop n = 2 index i { r = ex.denoise(x = x) vlm.prefill(p = p) }", ("E039",)),
    "inner_read_outer_write": ("vlm", "loop n = 2 { loop n = 2 { r = ex.denoise(x = x) } vlm.prefill(p = p) }",
                               ("E039",)),
    "outer_write_inner_read": ("vlm", "loop n = 2 { vlm.prefill(p = p) loop n = 2 { r = ex.denoise(x = x) } }", ()),
    "write_in_later_inner_loop": ("vlm", "loop n = 2 { r = ex.denoise(x = x) loop n = 2 { vlm.prefill(p = p) } }",
                                  ("E039",)),
    "sibling_branch": ("vlm", "parallel { branch a { vlm.prefill(p = p) } branch b { r = ex.denoise(x = x) } }",
                       ("E039",)),
    "after_parallel": ("vlm", "parallel { branch a { vlm.prefill(p = p) } branch b { q = s.stop(x = x) } }\n"
                       "r = ex.denoise(x = x)", ()),
    "fork_then_read": ("vlm@side", "vlm.prefill(p = p)\nfork vlm @main -> @side\nr = ex.denoise(x = x)", ()),
    "block_write_main_read": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                              "vlm.prefill(p = p) @side }\nk = vlm.gen(p = p)\nr = ex.denoise(x = x)", ("E039",)),
    "block_write_main_read_after_block": ("vlm@side", "k = vlm.gen(p = p)\non stream vlm.code -> ex.codes as c { "
                                          "ex.eat(codes = c) vlm.prefill(p = p) @side }\nr = ex.denoise(x = x)",
                                          ("E039",)),
    "block_write_loop_read": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                              "vlm.prefill(p = p) @side }\nloop n = 2 { k = vlm.gen(p = p) r = ex.denoise(x = x) }",
                              ("E039",)),
    "block_write_then_read_in_block": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                                       "vlm.prefill(p = p) @side r = ex.denoise(x = x) }\nk = vlm.gen(p = p)", ()),
    "block_read_then_write_in_block": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                                       "r = ex.denoise(x = x) vlm.prefill(p = p) @side }\nk = vlm.gen(p = p)",
                                       ("E039",)),
    "main_and_block_write": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                             "vlm.prefill(p = p) @side }\nvlm.prefill(p = p) @side\nk = vlm.gen(p = p)\n"
                             "r = ex.denoise(x = x)", ()),
    "block_loop_read_then_write": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) loop n = 2 "
                                   "{ r = ex.denoise(x = x) vlm.prefill(p = p) @side } }\nk = vlm.gen(p = p)",
                                   ("E039",)),
    # a block runs beside the walk wherever it is written: what the main body writes before
    # the block's first producer step is there for every chunk
    "block_above_main_write": ("vlm", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) r = ex.denoise(x = x) }"
                               "\nvlm.prefill(p = p)\nk = vlm.gen(p = p)", ()),
    "block_above_producer_writes": ("vlm", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                                    "r = ex.denoise(x = x) }\nk = vlm.gen(p = p)", ()),
    "block_above_write_after_producer": ("vlm", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                                         "r = ex.denoise(x = x) @side }\nk = vlm.gen(p = p)\nvlm.prefill(p = p) @side",
                                         ("E039",)),
    "block_above_write_in_branch": ("vlm@side", "on stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                                    "r = ex.denoise(x = x) }\nparallel { branch a { vlm.prefill(p = p) @side } "
                                    "branch b { k = vlm.gen(p = p) } }", ("E039",)),
    "block_above_write_in_loop_before_producer": ("vlm@side", "on stream vlm.code -> ex.codes as c { "
                                                  "ex.eat(codes = c) r = ex.denoise(x = x) }\nloop n = 2 { "
                                                  "vlm.prefill(p = p) @side k = vlm.gen(p = p) }", ()),
    # values (not contexts) keep their scopes
    "value_from_block": ("vlm", "vlm.prefill(p = p)\non stream vlm.code -> ex.codes as c { ex.eat(codes = c) "
                         "q = ex.denoise(x = x) }\nk = vlm.gen(p = p)\nr = ex.denoise(x = q)", ("E034",)),
    "value_from_loop": ("vlm", "vlm.prefill(p = p)\nloop n = 2 { r = ex.denoise(x = x) }\nr2 = ex.denoise(x = r)",
                        ("E034",)),
    "value_from_sibling_branch": ("vlm", "vlm.prefill(p = p)\nparallel { branch a { r = ex.denoise(x = x) } "
                                  "branch b { r2 = ex.denoise(x = r) } }", ("E034",)),
}


def order_cases() -> list[WalkCase]:
    out = []
    for name, (reads, body, codes) in ORDER.items():
        out.append(WalkCase(f"order[{name}]", kv_model("    " + body.replace("\n", "\n    "), reads), codes))
    # a context a transition keeps is written before the walk starts
    keep = ("walk u(p: i32[T], x: f32[2]) -> (go: bool) { vlm.prefill(p = p) @side emit go = true }\n"
            "  transition u -> w when go keep vlm@side")
    out.append(WalkCase("order[kept_by_transition]", kv_model("    r = ex.denoise(x = x)", "vlm@side", keep)))
    return out


BOUND = 1 << 31
ITEMS, CHUNK = 1 << 24, 1 << 20
STREAM = ("  node c : stateless = demo.C {{ in y : f32[N] out z : f32[N] phase h(y) -> (z) {setting} }}\n"
          "  stream a.y -> c.y : {policy}")
STREAM_BODY = "r = a.f(x = x)\non stream a.y -> c.y as k { z = c.h(y = k) emit y += z }"


def range_cases() -> list[WalkCase]:
    """Values at and past the plan schema's bounds, compiled: every pass and the schema check run."""
    cases = []
    loops = {f"loop n = {BOUND}": (), f"loop n = {BOUND + 1}": ("E040",), f"loop n = k max = {BOUND}": (),
             f"loop n = k max = {BOUND + 1}": ("E040",), f"loop n = {1 << 62}": ("E040",),
             f"dynamic_loop max = {BOUND} until d": (), f"dynamic_loop max = {BOUND * 2} until d": ("E040",)}
    for head, codes in loops.items():
        body = f"{head} {{ r, d = a.g(x = x) acc all += r }}\nemit y = x"
        cases.append(WalkCase(f"range[{head}]", plain_model("", body, "x: f32[2], k: int", "y: f32[2]")
                              .replace("emit y = x", "emit y = x\n  emit n = all").replace("-> (y: f32[2])",
                                                                                         "-> (y: f32[2], n: f32[N])"),
                              codes, CPU))
    streams = {("", "fixed(size = 2)"): (), (f"stream_capacity = {ITEMS}", "fixed(size = 2)"): (),
               (f"stream_capacity = {ITEMS + 1}", "fixed(size = 2)"): ("E026",),
               (f"stream_capacity = {1 << 40}", "sliding(window = 4, stride = 2)"): ("E026",),
               ("stream_capacity = 0", "fixed(size = 2)"): ("E026",),
               ("stream_capacity = 1", "fixed(size = 2)"): ("E044",),
               ("", f"fixed(size = {CHUNK})"): (), ("", f"fixed(size = {CHUNK + 1})"): ("E044",),
               ("", f"sliding(window = {CHUNK}, stride = {CHUNK})"): (),
               ("", f"sliding(window = {CHUNK}, stride = {CHUNK + 1})"): ("E044",),
               ("", f"left_context(chunk = {CHUNK // 2}, left = {CHUNK // 2})"): (),
               ("", f"left_context(chunk = {CHUNK // 2}, left = {CHUNK // 2 + 1})"): ("E044",),
               ("", f"left_context(chunk = 1, left = 0, first = {CHUNK})"): (),
               ("", f"left_context({CHUNK}, {CHUNK}, {CHUNK})"): ("E044",)}
    for (setting, policy), codes in streams.items():
        items = STREAM.format(setting=setting, policy=policy)
        cases.append(WalkCase(f"range[{setting or 'default'} {policy}]",
                              plain_model(items, STREAM_BODY, outs="y: f32[S]"), codes, CPU))
    kv = {"head_dim = 1048576": ((), HUGE), "head_dim = 1048577": (("E023",), HUGE),
          "layers = 1048577": (("E023",), HUGE), "max_seq_len = 4611686018427387904": (("E061",), CPU),
          "max_prefill_tokens = 4611686018427387904": (("E060",), CPU)}
    for what, (codes, placement) in kv.items():
        arch = (f"arch llama(layers = {what.split(' = ')[1] if what.startswith('layers') else 1}, hidden = 4, "
                f"heads = 1, kv_heads = 1, head_dim = {what.split(' = ')[1] if what.startswith('head_dim') else 4}, "
                "intermediate = 4, vocab = 4)")
        setting = what if what.startswith("max_") else "max_seq_len = 1"
        text = (f"model m {{\n  variant real {{ }}\n  node lm : kv = demo.LM {{ {arch} in x : f32[2] out y : f32[2] "
                f"phase f(x) -> (y) {setting} }}\n  walk w(x: f32[2]) -> (y: f32[2]) {{ r = lm.f(x = x) emit y = r }}\n}}\n")
        cases.append(WalkCase(f"range[kv {what}]", text, codes, placement))
    devices = {"memory_gib: 1.0e-300": ("E055",), "memory_gib: 1048576": (), "memory_gib: 1048577": ("E055",),
               "memory_gib: 16, hbm_tb_s: 1.0e-15": ("E055",), "memory_gib: 16, hbm_tb_s: 1.0e-12": (),
               "memory_gib: 16, hbm_tb_s: 1000": ()}
    for dev, codes in devices.items():
        cases.append(WalkCase(f"range[device {dev}]", plain_model("", "r = a.f(x = x)\nemit y = r"), codes,
                              f"devices:\n  - {{rank: 0, type: cuda, {dev}}}\n"))
    for dtype, codes in {"f16": (), "i32": ("E031",), "u8": ("E031",), "bool": ("E031",), "f64": ("E031",)}.items():
        text = plain_model("", "r = a.f(x = x)\nemit y = r").replace("phase g(x) -> (y, d) }",
                                                                     f'phase g(x) -> (y, d) dtype = "{dtype}" }}')
        cases.append(WalkCase(f"range[node dtype {dtype}]", text, codes, CPU))
    return cases


ESC = "\x1b[2J\x1b]0;owned\x07"


def text_cases() -> list[WalkCase]:
    ok = plain_model("", "r = a.f(x = x)\nemit y = r")
    bad = plain_model("", "r = a.f(x = q)\nemit y = r")  # E011 on the walk's first line
    return [
        WalkCase("text[bom]", "\ufeff" + bad, ("E011",)),
        WalkCase("text[bom twice]", "\ufeff\ufeff" + ok, ("E002",)),
        WalkCase("text[escape in comment]", ok.replace("variant real { }", f"variant real {{ }} // {ESC}"), ()),
        WalkCase("text[escape in comment, then error]", bad.replace("variant real { }", f"variant real {{ }} // {ESC}"),
                 ("E011",)),
        WalkCase("text[escape in a name]", ok.replace("node a :", f"node a{ESC} :"), ("E002",)),
        WalkCase("text[escape in a string]", ok.replace("variant real { }", f'variant real {{ s = "{ESC}" }}'), ()),
        WalkCase("text[line separators]", bad.replace("variant real { }", "variant real { } // \u2028\u2029\x0c\x85"),
                 ("E011",)),
        WalkCase("text[bidi override]", bad.replace("variant real { }", "variant real { } // \u202e\u2066"), ("E011",)),
        WalkCase("text[NUL]", ok.replace("variant real { }", "variant real { } \x00"), ("E002",)),
        WalkCase("text[carriage returns]", ok.replace("\n", "\r"), ()),
        WalkCase("text[CRLF]", bad.replace("\n", "\r\n"), ("E011",)),
    ]


WALK_CASES = read_cases() + tag_cases() + order_cases() + range_cases() + text_cases()


@pytest.mark.parametrize("case", WALK_CASES, ids=[c.name for c in WALK_CASES])
def test_walk_case(case: WalkCase, tmp_path: Path) -> None:
    src = tmp_path / "case.walk"
    src.write_bytes(case.text.encode("utf-8"))
    args = ["check", str(src)]
    if case.placement is not None:
        (tmp_path / "p.yaml").write_text(case.placement)
        args = ["compile", str(src), "-p", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "case.plan")]
    code, err, out = mstarc(args)
    assert "Traceback" not in err and "E090" not in err, err
    assert error_codes(err) == sorted(case.codes), err
    assert code == (1 if case.codes else 0), err
    assert "\x1b" not in err + out and "\u2028" not in err + out and "\u202e" not in err + out
    if case.codes:  # every error has its caret line (a file-level error has none: 0:0)
        lines = err.splitlines()
        for i, line in enumerate(lines):
            if ": error[E" in line and ":0:0:" not in line:
                assert lines[i + 2].lstrip().startswith("|") and "^" in lines[i + 2], err
    elif case.placement is not None:  # the plan explains, its strings escaped
        code, err, out = mstarc(["explain", str(tmp_path / "case.plan")])
        assert code == 0 and "\x1b" not in out, err


# ---- files that are not files -----------------------------------------------------------------

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
CHECKPOINT_WALK = ('model m {\n  variant real { h = from_checkpoint("config.json", "hidden_size", 64) }\n'
                   "  node a : stateless = demo.A { in x : f32[2] out y : f32[2] phase f(x) -> (y) }\n"
                   "  walk w(x: f32[2]) -> (y: f32[2]) { r = a.f(x = x) emit y = r }\n}\n")


@needs_fifo
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_a_named_pipe_in_the_weights_folder_does_not_block(name: str, tmp_path: Path) -> None:
    (tmp_path / "m.walk").write_text(CHECKPOINT_WALK)
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "a.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"{}")  # a header without tensors
    os.mkfifo(weights / name)  # nobody writes it: an `open` would wait forever
    code, err, _ = mstarc(["check", str(tmp_path / "m.walk"), "--weights", str(weights)])
    assert code == 1 and "Traceback" not in err and "E090" not in err, err
    assert "not a regular file" in err, err


@pytest.mark.parametrize("role", ["walk", "placement", "plan", "diff"])
def test_a_link_to_an_endless_device_is_refused(role: str, tmp_path: Path) -> None:
    if not Path("/dev/urandom").exists():
        pytest.skip("needs /dev/urandom")
    link = tmp_path / "link"
    link.symlink_to("/dev/urandom")
    (tmp_path / "m.walk").write_text(CHECKPOINT_WALK)
    args = {"walk": ["check", str(link)], "placement": ["check", str(tmp_path / "m.walk"), "-p", str(link)],
            "plan": ["explain", str(link)], "diff": ["diff", str(link), str(link)]}[role]
    code, err, _ = mstarc(args)
    assert code == (2 if role == "diff" else 1) and "E004" in err and "a character device" in err, err


# ---- plans edited and re-checksummed ------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_body(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("battery") / "tf.plan"
    assert main(["compile", str(ROOT / "models/testfamily/testfamily.walk"), "--variant", "tiny",
                 "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(out)]) == 0
    return planfile.read(out)


def _write(path: Path, body: Any) -> Path:
    raw = json.dumps(body, sort_keys=True).encode()
    path.write_bytes(planfile._HEADER.pack(planfile.MAGIC, planfile.CONTAINER_VERSION, 0, len(raw),
                                           hashlib.sha256(raw).digest()) + raw)
    return path


def _leaves(v: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    yield path, v
    if isinstance(v, dict):
        for k in sorted(v):
            yield from _leaves(v[k], (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _leaves(x, (*path, i))


# where the schema allows any JSON: the model's config, node settings, an arch's arguments and
# dimensions, input defaults, constant operands
FREE = ("config", "settings", "args", "dims", "default", "const")


def _free(path: tuple) -> bool:
    return any(p in FREE for p in path[:-1]) or (path and path[-1] in ("default", "const", "config", "settings"))


def _other_type(v: Any) -> Any:
    """A value of another JSON type than `v`."""
    if isinstance(v, bool):
        return 1
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        return {"0": v}
    if isinstance(v, dict):
        return [v]
    return False


def _set(body: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        body = body[p]
    body[path[-1]] = value


def _mutations(body: dict[str, Any], n: int = 120) -> list[tuple[str, tuple, Any, bool]]:
    """(id, path, new value, must be refused): a deterministic sample of every path, each given
    a value of another type (refused unless the schema allows any value there), and every
    integer given -1 and 2^64 (refused outside free fields: no plan integer is negative or
    beyond 64 bits)."""
    rng = random.Random(29)
    paths = [(p, v) for p, v in _leaves(body) if p and p[0] != "schema"]
    out = []
    for p, v in rng.sample(paths, min(n, len(paths))):
        out.append(("type", p, _other_type(v), not _free(p)))
    ints = [(p, v) for p, v in paths if isinstance(v, int) and not isinstance(v, bool)]
    for p, _ in rng.sample(ints, min(n // 3, len(ints))):
        out.append(("neg", p, -1, not _free(p)))
        out.append(("huge", p, 1 << 64, not _free(p)))
    return out


def _first(body: dict[str, Any], kind: str, pred: Callable[[dict], bool] = lambda op: True) -> dict:
    return next(op for w in body["walks"].values() for op in planfile.iter_ops(w["program"])
                if op["op"] == kind and pred(op))


def _flip(op: dict, key: str, a: str, b: str) -> None:
    op[key] = b if op[key] == a else a


def _cross_refs(body: dict[str, Any]) -> list[tuple[str, Callable[[dict], None]]]:
    """Edits that keep every value's type and range but break a reference between sections."""
    node = sorted(body["nodes"])[0]
    ghost = {"src": "ghost", "dst": "ghost", "when": "f", "keep": []}
    return [
        ("call_node", lambda x: _first(x, "call").__setitem__("node", "ghost")),
        ("call_phase", lambda x: _first(x, "call").__setitem__("phase", "ghost")),
        ("call_rank", lambda x: _first(x, "call").__setitem__("ranks", [7])),
        ("call_tag", lambda x: _first(x, "call").__setitem__("tag", "ghost")),
        ("stream_rank", lambda x: x["streams"][0].__setitem__("producer_rank", 3)),
        ("stream_walk", lambda x: x["streams"][0].__setitem__("walk", "ghost")),
        ("on_stream_stream", lambda x: _first(x, "on_stream").__setitem__("stream", "ghost")),
        ("transition_walk", lambda x: x.__setitem__("transitions", [*x["transitions"], ghost])),
        ("node_rank", lambda x: x["nodes"][node].__setitem__("ranks", [5])),
        ("resident_node", lambda x: x["placement"]["resident"][0]["nodes"].append("ghost")),
        ("kv_pool_node", lambda x: next(r for r in x["memory"]["ranks"] if r["kv"])["kv"][0]
         .__setitem__("node", "ghost")),
        ("memory_rank", lambda x: x["memory"]["ranks"][0].__setitem__("rank", 9)),
        ("loop_until", lambda x: _first(x, "loop", lambda op: op["dynamic"]).__setitem__("until", None)),
        ("phase_input", lambda x: next(iter(x["nodes"][node]["phases"].values()))["inputs"].append("ghost")),
        ("edge_node", lambda x: x["edges"][0].__setitem__("src", ["ghost", "y"])),
        ("emit_mode", lambda x: _flip(_first(x, "emit"), "mode", "append", "set")),
        ("page_size", lambda x: x["memory"].__setitem__("page_size", x["placement"]["page_size"] + 1)),
        ("requires", lambda x: x.setdefault("requires", []).append("time_travel")),
    ]


def _refusal(path: Path, original: Path | None = None) -> tuple[str | None, int, str]:
    """(the loader's PlanError message or None when it loads, explain's status, explain's stderr).
    A plan explain accepts is rendered in every format, and compared with `original` by
    `mstarc diff` (which exits 2 on a plan it refuses); their troubles are added to stderr."""
    with watchdog(WATCHDOG_S):
        try:
            load_plan(path)
            loaded = None
        except PlanError as e:
            loaded = str(e)
    code, err, _ = mstarc(["explain", str(path)])
    if code == 0:
        for fmt in ("markdown", "dot", "json"):
            fcode, ferr, _ = mstarc(["explain", str(path), "--format", fmt])
            if fcode != 0:
                err += f"\nexplain --format {fmt}: exit {fcode}\n{ferr}"
                code = 3
    if original is not None:
        dcode, derr, _ = mstarc(["diff", str(original), str(path)])
        if dcode not in (0, 1, 2) or "Traceback" in derr or "E090" in derr:
            err += f"\ndiff: exit {dcode}\n{derr[-600:]}"
            code = 3
        elif code == 1 and dcode != 2:
            err += f"\ndiff: exit {dcode} on a plan explain refuses"
            code = 3
    return loaded, code, err


def test_edited_plans_are_refused_by_the_loader_and_explain_alike(plan_body: dict[str, Any], tmp_path: Path) -> None:
    original = _write(tmp_path / "original.plan", plan_body)
    wrong = []
    for kind, path, value, must in _mutations(plan_body):
        body = copy.deepcopy(plan_body)
        _set(body, path, value)
        loaded, code, err = _refusal(_write(tmp_path / "m.plan", body), original)
        where = f"{kind} {'.'.join(map(str, path))} = {str(value)[:30]}"
        if code not in (0, 1) or "Traceback" in err or "E090" in err:
            wrong.append(f"{where}: explain exit {code}\n{err[-600:]}")
        elif must and (loaded is None or code != 1):
            wrong.append(f"{where}: accepted (loader: {loaded}, explain exit {code})")
        elif (loaded is None) != (code == 0):
            wrong.append(f"{where}: loader {'accepts' if loaded is None else 'refuses'}, explain exit {code}")
    assert not wrong, "\n".join(wrong)


def test_broken_references_are_refused(plan_body: dict[str, Any], tmp_path: Path) -> None:
    wrong = []
    for name, edit in _cross_refs(plan_body):
        body = copy.deepcopy(plan_body)
        edit(body)
        loaded, code, err = _refusal(_write(tmp_path / f"{name}.plan", body), _write(tmp_path / "o.plan", plan_body))
        if loaded is None or "Traceback" in err or "E090" in err or code == 3:
            wrong.append(f"{name}: loader {loaded!r}, explain exit {code}\n{err[-400:]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("where", ["config", "settings", "default", "const", "args"])
def test_deep_json_in_free_fields_is_refused_not_a_crash(where: str, plan_body: dict[str, Any], tmp_path: Path) -> None:
    """Nesting past the reader's limit in a field the schema does not look into."""
    body = copy.deepcopy(plan_body)
    deep: Any = 1
    for _ in range(450):
        deep = [deep]
    node = next(n for n in body["nodes"].values() if n.get("arch"))
    call = next(op for w in body["walks"].values() for op in planfile.iter_ops(w["program"]) if op["op"] == "call")
    holder = {"config": body["model"]["config"], "settings": node["settings"],
              "default": next(p for w in body["walks"].values() for p in w["inputs"]),
              "const": call["args"], "args": node["arch"]["args"]}[where]
    holder[{"default": "default"}.get(where, "deep")] = {"const": deep} if where == "const" else deep
    loaded, code, err = _refusal(_write(tmp_path / "deep.plan", body))
    assert loaded is not None and "nests too deeply" in loaded
    assert code == 1 and "nests too deeply" in err and "Traceback" not in err


# ---- a request's inputs --------------------------------------------------------------------------

@needs_fifo
@pytest.mark.parametrize("declared", [{"kind": "image"}, {"kind": "tensor", "dtype": "f32", "dims": ["S"]}])
def test_an_input_file_that_is_a_named_pipe_is_refused(declared: dict[str, Any], tmp_path: Path) -> None:
    from mstar_runtime.cli_inputs import parse_text
    from mstar_runtime.ops.node import RequestError

    os.mkfifo(tmp_path / "clip")
    with watchdog(WATCHDOG_S), pytest.raises(RequestError, match="not a regular file") as info:
        parse_text("w", "x", declared, f"@{tmp_path / 'clip'}")
    assert info.value.field == "x"


@pytest.mark.parametrize("text", ["[" * 64 + "1" + "]" * 64, "[" * 65 + "1" + "]" * 65, '{"a": ' * 500 + "1" + "}" * 500,
                                  "[1e999]", "[1e39]", "[NaN]", "[-Infinity]", '["1"]', "[[1], [1, 2]]"])
def test_a_tensor_input_that_cannot_be_one_is_that_inputs_error(text: str) -> None:
    from mstar_runtime.cli_inputs import parse_text
    from mstar_runtime.ops.node import RequestError

    declared = {"kind": "tensor", "dtype": "f32", "dims": ["N"]}
    with watchdog(WATCHDOG_S):
        try:
            value = parse_text("w", "x", declared, text)
        except RequestError as e:
            assert e.field == "x" and str(e)
            return
    assert text.startswith("[" * 64) and value.ndim == 64  # the deepest a tensor may be, and a rank torch takes


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e999", "Infinity"])
def test_a_float_input_is_finite(text: str) -> None:
    from mstar_runtime.cli_inputs import parse_text
    from mstar_runtime.ops.node import RequestError

    with pytest.raises(RequestError, match="expected a finite number") as info:
        parse_text("w", "x", {"kind": "float"}, text)
    assert info.value.field == "x"
