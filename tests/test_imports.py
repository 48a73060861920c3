"""Layering: the compiler never imports torch; the runtime never imports the compiler's stack (no module
imports another that imports it back: tests/test_import_cycles.py)."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
                         check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_compiler_does_not_import_torch() -> None:
    mods = _modules_after("import mstarc.cli, mstarc.pipeline, mstarc.plan, mstarc.explain, mstarc.diff, "
                          "mstarc.placement, mstarc.checkpoint")
    assert "torch" not in mods
    assert "mstarc.passes.memory" in mods  # the whole pipeline was really imported


def test_runtime_does_not_import_the_compiler() -> None:
    import pathlib

    import mstar_runtime
    runtime_dir = pathlib.Path(mstar_runtime.__file__).parent
    names = sorted(".".join(p.relative_to(runtime_dir).with_suffix("").parts)
                   for p in runtime_dir.rglob("*.py") if p.stem != "__init__")
    assert "control.conductor" in names  # the sub-packages were really walked
    code = "\n".join(f"import mstar_runtime.{n}" for n in names)
    mods = _modules_after(code)
    for forbidden in ("mstarc", "lark", "networkx", "jinja2"):
        assert not any(m == forbidden or m.startswith(forbidden + ".") for m in mods), forbidden
