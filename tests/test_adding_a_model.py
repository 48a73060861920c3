"""docs/adding-a-model.md stays true to the tree: every repository path it names exists, and
every `serves` declaration it quotes is one a model's walk makes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs/adding-a-model.md").read_text(encoding="utf-8")
PATH = re.compile(r"`((?:models|mstarc|runtime|tests|tools|docs)/[\w./*<>-]+?)(?:::\w+)?`")


def test_every_path_the_page_names_exists() -> None:
    named = {m.group(1) for m in PATH.finditer(PAGE) if "<" not in m.group(1)}
    assert len(named) >= 20
    missing = sorted(p for p in named if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()))
    assert not missing, f"docs/adding-a-model.md names paths that do not exist: {', '.join(missing)}"


def test_every_quoted_declaration_is_a_models() -> None:
    walks = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "models").glob("*/*.walk"))
    declared = " ".join(walks.split())
    quoted = re.findall(r"`serves ([a-z_]+(?:\([^`]*\))?)`", " ".join(PAGE.split()))
    assert len(quoted) >= 6
    for q in quoted:
        assert f"serves {q}" in declared or f", {q}" in declared, f"no walk declares `serves {q}`"
