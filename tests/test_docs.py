"""The language reference and the diagnostics catalogue are checked against the compiler.

docs/walk-language.md:
  - every ```walk block parses. A block that starts with `model` is a whole file; any other
    block is a fragment and must parse wrapped either as model items (`model m { ... }`) or
    as walk statements (`model m { walk w() -> () { ... } }`);
  - every whole-model block passes `mstarc check` (variant `real`), unless the line before
    it is `<!-- error: E0xx -->`: then check exits 1 and E0xx is the only error code.

docs/diagnostics.md:
  - every code of `mstarc.diagnostics.CODES` has a section (`## E0xx ...`), and no section
    names a code that is not in the catalogue;
  - its examples are replayed: a fenced block preceded by `<!-- file: NAME -->` is written to
    NAME in a scratch folder; a ```text block whose first line is `$ mstarc ARGS` and whose
    last line is `[exit N]` is a transcript: `mstarc ARGS` runs there, and its stderr then
    stdout (lines right-stripped) and exit status must equal the block. A transcript in the
    section of code E0xx must show E0xx. The fixtures the page describes but cannot hold
    (a checkpoint folder, broken plan files) are made by `make_fixtures`.
Both pages' transcripts are replayed the same way.
"""

from __future__ import annotations

import json
import re
import shlex
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mstarc.cli import main
from mstarc.diagnostics import CODES, CompileError
from mstarc.parser import parse

DOCS = Path(__file__).resolve().parents[1] / "docs"
LANGUAGE = DOCS / "walk-language.md"
DIAGNOSTICS = DOCS / "diagnostics.md"

_MARKER = re.compile(r"^<!--\s*(error|file):\s*(\S+)\s*-->$")
_SECTION = re.compile(r"^#{2,4}\s+(E\d{3})\b")
_ERROR_CODE = re.compile(r"\berror\[(E\d{3})\]")
_EXIT = re.compile(r"^\[exit (\d+)\]$")


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    marker: tuple[str, str] | None  # ("error", "E035") or ("file", "bad.walk")
    section: str | None  # the code of the enclosing `## E0xx` section, if any


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown page, with the marker comment right before each."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    section: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if (m := _SECTION.match(line)) is not None:
            section = m.group(1)
        elif line.startswith("#"):
            section = None if line.startswith("## ") else section
        if line.startswith("```"):
            start, lang = i, line[3:].strip()
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"{path.name}:{start + 1}: unclosed code block"
            prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            m = _MARKER.match(prev)
            out.append(Block(lang, "\n".join(body) + "\n", start + 1, (m.group(1), m.group(2)) if m else None,
                             section))
        i += 1
    return out


def _where(path: Path, b: Block) -> str:
    return f"{path.name}:{b.line}"


def _is_model(text: str) -> bool:
    return re.match(r"\s*model\b", text) is not None


def _expected_error(b: Block) -> str | None:
    return b.marker[1] if b.marker and b.marker[0] == "error" else None


LANGUAGE_WALK = [b for b in blocks(LANGUAGE) if b.lang == "walk"]
LANGUAGE_MODELS = [b for b in LANGUAGE_WALK if _is_model(b.text)]


def test_language_page_has_examples() -> None:
    assert len(LANGUAGE_WALK) >= 20 and len(LANGUAGE_MODELS) >= 4


@pytest.mark.parametrize("block", LANGUAGE_WALK, ids=[_where(LANGUAGE, b) for b in LANGUAGE_WALK])
def test_walk_block_parses(block: Block) -> None:
    code = _expected_error(block)
    if code in ("E001", "E002", "E003"):  # a syntax-error example must not parse, with its code
        with pytest.raises(CompileError) as e:
            parse(block.text, "doc.walk")
        assert [d.code for d in e.value.diagnostics] == [code]
        return
    if _is_model(block.text):
        parse(block.text, "doc.walk")
        return
    problems = []
    for wrapped in (f"model m {{\n{block.text}}}\n", f"model m {{\nwalk w() -> () {{\n{block.text}}}\n}}\n"):
        try:
            parse(wrapped, "doc.walk")
            return
        except CompileError as e:
            problems.append(e.diagnostics[0].header())
    pytest.fail(f"{_where(LANGUAGE, block)}: the fragment parses neither as model items nor as statements: "
                + " / ".join(problems))


@pytest.mark.parametrize("block", LANGUAGE_MODELS, ids=[_where(LANGUAGE, b) for b in LANGUAGE_MODELS])
def test_model_block_checks(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("example.walk").write_text(block.text, encoding="utf-8")
    status = main(["check", "example.walk"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    code = _expected_error(block)
    if code is None:
        assert status == 0, f"{_where(LANGUAGE, block)} should pass check:\n{err}"
    else:
        assert status == 1, f"{_where(LANGUAGE, block)} should fail check with {code}:\n{err}"
        assert set(_ERROR_CODE.findall(err)) == {code}, f"{_where(LANGUAGE, block)} expects only {code}:\n{err}"


# ---- the diagnostics catalogue ----------------------------------------------------------


def test_every_code_has_a_section() -> None:
    text = DIAGNOSTICS.read_text(encoding="utf-8")
    sections = [m.group(1) for line in text.splitlines() if (m := _SECTION.match(line))]
    missing = [c for c in CODES if c not in sections]
    assert not missing, f"docs/diagnostics.md has no section for {', '.join(missing)}"
    unknown = [c for c in sections if c not in CODES]
    assert not unknown, f"docs/diagnostics.md documents codes that are not in CODES: {', '.join(unknown)}"
    assert len(sections) == len(set(sections)), "a code has two sections"


def make_fixtures(folder: Path) -> None:
    """What docs/diagnostics.md describes but cannot hold as text (run inside `folder`).

    - `weights/model.safetensors`: a safetensors header for `lm.walk`'s node `llm` without
      `model.norm.weight` and with a 128000-row `model.embed_tokens.weight`;
    - `demo.plan`, compiled from `demo.walk` on `cpu.yaml`, and from it `corrupt.plan` (the
      last byte flipped), `future.plan` (container version 2) and `huge.plan` (a header
      that claims a 100 MiB body).
    """
    from mstarc.lower import lower
    from mstarc.parser import parse_file

    if (folder / "lm.walk").exists():
        model = lower(parse_file(folder / "lm.walk", "lm.walk"), "real", "lm.walk")
        header = {t.name: {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [0, 0]}
                  for t in model.nodes["llm"].arch.tensors if t.name != "model.norm.weight"}
        header["model.embed_tokens.weight"]["shape"] = [128000, 3072]
        raw = json.dumps(header).encode()
        (folder / "weights").mkdir(exist_ok=True)
        (folder / "weights" / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    if (folder / "demo.walk").exists() and (folder / "cpu.yaml").exists():
        assert main(["compile", "demo.walk", "-p", "cpu.yaml", "-o", "demo.plan"]) == 0
        plan = (folder / "demo.plan").read_bytes()
        corrupt = bytearray(plan)
        corrupt[-1] ^= 1
        (folder / "corrupt.plan").write_bytes(bytes(corrupt))
        future = bytearray(plan)
        struct.pack_into("<H", future, 8, 2)  # container version
        (folder / "future.plan").write_bytes(bytes(future))
        huge = bytearray(plan)
        struct.pack_into("<Q", huge, 12, 100 << 20)  # body length
        (folder / "huge.plan").write_bytes(bytes(huge))


@dataclass(frozen=True)
class Transcript:
    block: Block
    args: list[str]
    output: list[str]
    status: int


def transcripts(path: Path) -> Iterator[Transcript]:
    for b in blocks(path):
        lines = b.text.splitlines()
        if b.lang != "text" or not lines or not lines[0].startswith("$ mstarc "):
            continue
        m = _EXIT.match(lines[-1]) if len(lines) > 1 else None
        assert m is not None, f"{_where(path, b)}: a transcript ends with `[exit N]`"
        yield Transcript(b, shlex.split(lines[0].removeprefix("$ mstarc ")), lines[1:-1], int(m.group(1)))


def replay(path: Path, folder: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[Transcript, list[str], int]]:
    """Write the page's files into `folder` (the current directory), make the fixtures, run
    every transcript; returns (transcript, actual output lines, actual status)."""
    names = [b.marker[1] for b in blocks(path) if b.marker and b.marker[0] == "file"]
    assert len(names) == len(set(names)), f"{path.name}: a file name is used twice"
    for b in blocks(path):
        if b.marker and b.marker[0] == "file":
            target = folder / b.marker[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.text, encoding="utf-8")
    make_fixtures(folder)
    capsys.readouterr()
    out = []
    for t in transcripts(path):
        status = main(list(t.args))
        captured = capsys.readouterr()
        lines = [line.rstrip() for line in (captured.err + captured.out).splitlines()]
        out.append((t, lines, status))
    return out


@pytest.mark.parametrize("page", [DIAGNOSTICS, LANGUAGE], ids=["diagnostics", "walk-language"])
def test_transcripts(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    results = replay(page, tmp_path, capsys)
    if page == DIAGNOSTICS:
        assert len(results) >= len(CODES) - 2  # E090 and a few others show no run of their own
    for t, lines, status in results:
        where = _where(page, t.block)
        assert "Traceback" not in "\n".join(lines), f"{where}: traceback\n" + "\n".join(lines)
        assert lines == [line.rstrip() for line in t.output], \
            f"{where}: `mstarc {shlex.join(t.args)}` printed:\n" + "\n".join(lines)
        assert status == t.status, f"{where}: exit status {status}, the page says {t.status}"
        if t.block.section is not None and t.block.section != "E090":
            assert f"[{t.block.section}]" in "\n".join(lines), f"{where}: the transcript does not show {t.block.section}"
