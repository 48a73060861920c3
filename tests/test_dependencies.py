"""Every dependency pyproject.toml declares is used: imported by a tracked Python file, or on
the short list of those used another way (with the reason)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAME = {"pyyaml": "yaml", "pillow": "PIL", "flashinfer-python": "flashinfer"}
NOT_IMPORTED = {
    "ruff": "the linter, run as a command (tools/dev.sh test)",
    "python-multipart": "FastAPI parses the form bodies of /v1/images/edits with it",
}


def _requirements() -> dict[str, str]:
    """{distribution name: the group that declares it}."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower(): group
            for group, reqs in groups.items() for req in reqs}


def _imported() -> set[str]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names: set[str] = set()
    pattern = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", re.M)
    for f in files.split():
        path = ROOT / f
        if path.exists():  # a file deleted in the working tree but not yet in the index
            names.update(pattern.findall(path.read_text(encoding="utf-8", errors="replace")))
    return names


def test_every_dependency_is_used() -> None:
    requirements = _requirements()
    assert {"click", "prometheus_client", "torch", "fastapi"} <= set(requirements)  # the table was really read
    imported = _imported()
    unused = []
    for dist, group in sorted(requirements.items()):
        if dist in NOT_IMPORTED:
            continue
        name = IMPORT_NAME.get(dist, dist.replace("-", "_"))
        # `pytest.importorskip("snac")` imports too
        skipped = subprocess.run(["git", "grep", "-q", f'importorskip("{name}"'], cwd=ROOT).returncode == 0
        if name not in imported and not skipped:
            unused.append(f"{dist} ({group})")
    assert not unused, f"declared in pyproject.toml but imported nowhere: {', '.join(unused)}"
