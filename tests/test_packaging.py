"""A non-editable install holds the whole project: the wheel `pip wheel` builds has every package
under the three source roots (mstarc/, runtime/, models/) and every data file they read at run
time (the grammar, the explain templates, the tiny tokenizers), so a sub-package added without a
pyproject entry cannot be left out of a release."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# {source root: the import name of its top package, relative to the repository}
ROOTS = {Path("mstarc"): "mstarc", Path("runtime/mstar_runtime"): "mstar_runtime",
         Path("models/mstar_models"): "mstar_models"}
DATA_SUFFIXES = {".json", ".j2", ".lark"}


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [Path(line) for line in out.splitlines() if (ROOT / line).exists()]


def _expected(tracked: list[Path]) -> tuple[set[str], set[str]]:
    """(the packages as wheel folders, the data files as wheel paths) the tree holds."""
    packages: set[str] = set()
    data: set[str] = set()
    for path in tracked:
        for root, name in ROOTS.items():
            if path.is_relative_to(root):
                inside = Path(name) / path.relative_to(root)
                if path.name == "__init__.py":
                    packages.add(inside.parent.as_posix())
                elif path.suffix in DATA_SUFFIXES:
                    data.add(inside.as_posix())
    # mstarc/grammar is a link to grammar/: the parser reads mstarc/grammar/walk.lark
    data.update(f"mstarc/grammar/{p.name}" for p in tracked if p.parent == Path("grammar") and p.suffix == ".lark")
    return packages, data


def test_wheel_holds_every_package_and_data_file(tmp_path: Path) -> None:
    tracked = _tracked()
    packages, data = _expected(tracked)
    # the listing was really read: the roots' packages, including the example models
    assert {"mstarc.passes", "mstar_runtime.serve", "mstar_models.vla", "mstar_models.asr"} <= {
        p.replace("/", ".") for p in packages}
    assert "mstarc/grammar/walk.lark" in data
    # Build from a copy of the tracked files: a stale build/ folder in the working tree would
    # hand setuptools packages the configuration no longer names.
    src = tmp_path / "src"
    for path in tracked:
        target = src / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / path).is_symlink():
            target.symlink_to((ROOT / path).readlink())
        else:
            shutil.copy2(ROOT / path, target)
    # no build isolation: the venv's setuptools builds it, so the test needs no network
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("mstar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    missing = sorted(p.replace("/", ".") for p in packages - folders)
    assert not missing, f"packages the wheel leaves out: {', '.join(missing)}"
    assert not sorted(data - names), f"data files the wheel leaves out: {sorted(data - names)}"
    # every module of a package, not only its __init__
    modules = {(Path(n).as_posix()) for n in names if n.endswith(".py")}
    expected_modules = {(Path(name) / p.relative_to(root)).as_posix() for p in tracked for root, name in ROOTS.items()
                        if p.is_relative_to(root) and p.suffix == ".py"}
    assert not sorted(expected_modules - modules), f"modules the wheel leaves out: {sorted(expected_modules - modules)}"
