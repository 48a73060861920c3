"""Files and text the toolchain reads from users (issue 29, section 3): special files are refused
without blocking or reading without end, JSON nests boundedly everywhere, what a file holds is
printed escaped, and a byte-order mark or a U+2028 does not change what a diagnostic says."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from mstar_runtime import untrusted
from mstar_runtime.plan import planfile
from mstarc.cli import main

ROOT = Path(__file__).resolve().parent.parent
DEMO = """model m {
  variant real { }
  node a : stateless = demo.A { in x : f32[2] out y : f32[2] phase f(x) -> (y) }
  walk w(x: f32[2]) -> (y: f32[2]) {
    r = a.f(x = x)
    emit y = r
  }
}
"""
CPU = "devices:\n  - {rank: 0, type: cpu, memory_gib: 16}\n"
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`mstarc ARGS` in a thread with a deadline: a hang fails the test instead of stalling it."""
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(main(args)), daemon=True)
    t.start()
    t.join(20)
    assert result, f"mstarc {' '.join(args)} did not return within 20 s"
    return result[0], capsys.readouterr().err


@needs_fifo
@pytest.mark.parametrize("role", ["walk", "placement", "plan"])
def test_a_named_pipe_is_refused_without_blocking(role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe")  # nobody ever writes it: `open` would wait forever
    Path("m.walk").write_text(DEMO)
    Path("cpu.yaml").write_text(CPU)
    args = {"walk": ["check", "pipe"], "placement": ["check", "m.walk", "-p", "pipe"],
            "plan": ["explain", "pipe"]}[role]
    code, err = _run(args, capsys)
    assert code == 1
    assert "error[E004]" in err and "not a regular file (a named pipe)" in err, err


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
@pytest.mark.parametrize("args", [["explain", "/dev/zero"], ["diff", "/dev/zero", "/dev/zero"], ["check", "/dev/zero"]])
def test_a_device_is_refused_without_reading_it(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(args, capsys)
    assert code == (2 if args[0] == "diff" else 1)
    assert "error[E004]" in err and "not a regular file (a character device)" in err, err


def test_read_file_caps_what_it_reads(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 11)
    assert untrusted.read_file(f, 11) == b"x" * 11
    with pytest.raises(untrusted.FileTooLarge) as info:
        untrusted.read_file(f, 10)
    assert info.value.size == 11
    with pytest.raises(OSError, match="a directory"):
        untrusted.read_file(tmp_path, 10)


@pytest.mark.parametrize("depth", [401, 900, 100_000])
def test_deep_json_is_a_value_error(depth: int) -> None:
    text = "[" * depth + "]" * depth
    with pytest.raises(ValueError, match="nests too deeply"):
        untrusted.loads_json(text)
    assert untrusted.loads_json("[" * 400 + "]" * 400) is not None


@pytest.mark.parametrize("depth", [450, 100_000])
def test_a_deeply_nested_plan_is_a_plan_error_at_load(depth: int, tmp_path: Path) -> None:
    """The runtime's reader refuses what `mstarc explain` refuses (was: RecursionError)."""
    import hashlib

    from mstar_runtime.plan.loader import PlanError, load_plan

    raw = b'{"schema":{"major":1,"minor":1},"x":' + b"[" * depth + b"]" * depth + b"}"
    plan = tmp_path / "deep.plan"
    plan.write_bytes(planfile._HEADER.pack(planfile.MAGIC, planfile.CONTAINER_VERSION, 0, len(raw),
                                           hashlib.sha256(raw).digest()) + raw)
    with pytest.raises(PlanError, match="nests too deeply"):
        load_plan(plan)


@pytest.mark.parametrize("depth", [65, 5_000, 100_000])
def test_a_deeply_nested_tensor_input_is_a_request_error(depth: int) -> None:
    from mstar_runtime.cli_inputs import parse_text
    from mstar_runtime.ops.node import RequestError

    with pytest.raises(RequestError, match="nests too deeply") as info:
        parse_text("encode", "frames", {"kind": "tensor", "dtype": "u8", "dims": ["N"]}, "[" * depth + "]" * depth)
    assert info.value.field == "frames"


def test_a_deeply_nested_batch_line_is_that_lines_error() -> None:
    from mstar_runtime.cli import parse_line

    item = parse_line(None, 3, json.dumps({"walk": "w"})[:-1] + ', "inputs": {"x": ' + "[" * 5000 + "]" * 5000 + "}}")
    assert item.error is not None and "nests too deeply" in str(item.error)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_batch_line_with_a_non_json_constant_is_that_lines_error(constant: str) -> None:
    """Python's writer emits NaN for float('nan'); the line is refused, not a traceback."""
    from mstar_runtime.cli import parse_line

    item = parse_line(None, 2, '{"walk": "act", "inputs": {"state": [0.5, ' + constant + ']}}')
    assert item.error is not None and f"{constant} is not JSON" in str(item.error), item


# ---- what diagnostics print -------------------------------------------------------------------

def test_a_byte_order_mark_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A BOM (Windows editors write one) is not E002 hiding the file's real error."""
    monkeypatch.chdir(tmp_path)
    Path("ok.walk").write_bytes(b"\xef\xbb\xbf" + DEMO.encode())
    assert main(["check", "ok.walk"]) == 0
    Path("bad.walk").write_bytes(b"\xef\xbb\xbf" + DEMO.replace("x = x", "x = q").encode())
    assert main(["check", "bad.walk"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bad.walk:5:17: error[E011]: unknown name 'q'\n   5 |     r = a.f(x = q)\n"), err


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x0c", "\x0b", "\x85", "\x1c"])
def test_a_line_separator_in_a_comment_does_not_shift_the_line_shown(
        sep: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("m.walk").write_text(DEMO.replace("  variant real { }", f"  // one{sep}two\n  variant real {{ }}")
                              .replace("x = x", "x = q"), encoding="utf-8")
    assert main(["check", "m.walk"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "m.walk:6:17: error[E011]: unknown name 'q'"
    assert lines[1] == "   6 |     r = a.f(x = q)"
    assert lines[2] == "     |                 ^"


def test_escape_sequences_from_a_walk_are_printed_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A comment or a string that clears the screen or sets the title reaches the terminal as text;
    the caret stays under the span."""
    monkeypatch.chdir(tmp_path)
    line = '  variant real { s = "\x1b]0;owned\x07" q = 1 $ } // \x1b[2J\x1b[31m\u202e'
    Path("m.walk").write_text(DEMO.replace("  variant real { }", line), encoding="utf-8")
    assert main(["check", "m.walk"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err
    lines = err.splitlines()
    shown = '   2 |   variant real { s = "\\x1b]0;owned\\x07" q = 1 $ } // \\x1b[2J\\x1b[31m\\u202e'
    assert lines[1] == shown
    assert lines[2].index("^") == shown.index("$") and lines[2].count("^") == 1


def test_printable_escapes_what_acts_on_a_terminal() -> None:
    assert untrusted.printable("a\x1b[31mb\tc\nd\x9b\u2028\u202e\ufeffe") == "a\\x1b[31mb\tc\nd\\x9b\\u2028\\u202e\\ufeffe"


def test_escape_sequences_from_a_plan_are_printed_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A plan's strings (its model name here, checksum recomputed) reach the terminal as text in
    every format of `explain` and in `diff`."""
    monkeypatch.chdir(tmp_path)
    Path("m.walk").write_text(DEMO)
    Path("cpu.yaml").write_text(CPU)
    assert main(["compile", "m.walk", "-p", "cpu.yaml", "-o", "a.plan"]) == 0
    body = planfile.read("a.plan")
    body["model"]["name"] = "m\x1b[2J\x1b]0;owned\x07\u202e"
    planfile.write("b.plan", body)
    capsys.readouterr()
    for args in (["explain", "b.plan"], ["explain", "b.plan", "--format", "markdown"],
                 ["explain", "b.plan", "--format", "dot"], ["explain", "b.plan", "--format", "json"],
                 ["diff", "a.plan", "b.plan"]):
        main(args)
        out = capsys.readouterr()
        assert not any(c in out.out + out.err for c in "\x1b\x07\u202e"), args
        assert "\\x1b[2J" in out.out or "\\u001b[2J" in out.out, (args, out.out[:300])
