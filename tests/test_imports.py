"""Layering: the compiler never imports torch; the runtime never imports the compiler's stack."""

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


def _runtime_imports(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports when it runs: at its top or inside a
    function (a lazy import still closes a circle), but not under `if TYPE_CHECKING:`
    (annotations only, never executed)."""
    import ast
    import pathlib

    import mstar_runtime

    root = pathlib.Path(mstar_runtime.__file__).parent
    folder = root / package.removeprefix("mstar_runtime.").replace(".", "/")
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        name = f"{package}.{path.stem}"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for stmt in node.body for n in ast.walk(stmt)}
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t.startswith(package + ".") and t.count(".") == package.count(".") + 1}
        graph[name] = found - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_serve_has_no_import_circle() -> None:
    """The routes import `ServerState` from `serve.state` and the server imports the routes;
    neither imports the other back (issue 24: the routes and the server formed a circle)."""
    graph = _runtime_imports("mstar_runtime.serve")
    assert "mstar_runtime.serve.state" in graph and "mstar_runtime.serve.chat" in graph["mstar_runtime.serve.server"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one
