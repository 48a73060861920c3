"""No module of the runtime is over 700 lines (issue 24 section 4): a file that grows past it is
split by what its parts own, as control/conductor.py and worker/remote.py were."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "runtime"
MAX_LINES = 700


def too_long(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """The .py files under `root` with more than `limit` lines: path (relative to root) -> lines."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[str(path.relative_to(root))] = n
    return out


def test_no_runtime_module_is_over_700_lines() -> None:
    assert len(list(ROOT.rglob("*.py"))) > 50  # the tree was really walked
    assert too_long(ROOT) == {}


def test_the_check_counts_lines(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 4)
    assert too_long(tmp_path, limit=3) == {"pkg/long.py": 4}
