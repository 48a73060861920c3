"""Negative tests: every case in tests/negative/*.walk.txt gives exactly its CHECK diagnostics.

A case's `// CHECK:` lines are the complete set of expected error headers (file:line:col,
code and message); an extra or a missing diagnostic fails. `// CARET:` pins the caret line
of the first diagnostic. No case may produce a traceback: `mstarc check` must exit 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mstarc.cli import main

NEGATIVE = Path(__file__).parent / "negative"
HEADER = re.compile(r"^\S+:\d+:\d+: (error|warning)\[E\d{3}\]: .*$")


def _cases() -> list[tuple[str, str]]:
    out = []
    for path in sorted(NEGATIVE.glob("*.walk.txt")):
        for i, chunk in enumerate(path.read_text().split("// -----\n")):
            lines = chunk.splitlines()
            while lines and (not lines[0].strip() or lines[0].startswith("//")):
                lines.pop(0)  # the file's preamble and a case's leading comments are not part of it
            out.append((f"{path.stem}-{i}", "\n".join(lines) + "\n"))
    return out


CASES = _cases()


def test_enough_negative_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("name,text", CASES, ids=[c[0] for c in CASES])
def test_negative_case(name: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    expected = [line.removeprefix("// CHECK: ") for line in text.splitlines() if line.startswith("// CHECK: ")]
    carets = [line.removeprefix("// CARET: ") for line in text.splitlines() if line.startswith("// CARET: ")]
    assert expected, f"case {name} has no CHECK line"
    monkeypatch.chdir(tmp_path)
    source = "\n".join(line for line in text.splitlines() if not line.startswith(("// CHECK: ", "// CARET: ")))
    (tmp_path / "case.walk").write_text(source + "\n")
    code = main(["check", "case.walk"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    got = [line for line in err.splitlines() if HEADER.match(line) and "error[" in line]
    assert sorted(got) == sorted(expected), f"\n--- got:\n{err}"
    assert code == 1
    assert err.rstrip().endswith(f"{len(expected)} error{'s' if len(expected) != 1 else ''}")
    if carets:
        lines = err.splitlines()
        first = lines.index(got[0]) if got else 0
        assert lines[first + 2] == carets[0]
