"""No import circle among the project's modules: the compiler (mstarc/), the runtime
(runtime/mstar_runtime/) and the models (models/mstar_models/). Every module's imports (any of
them: at the top, inside a function, or under `if TYPE_CHECKING:`) form a graph without
cycles, so that each module can be read, and imported, after the ones it builds on (issue 24
section 4). A lazy or a type-only import hides a circle without removing it: the record moves
to the lower module, the layer that owns a thing defines it, or a lower module names what it
needs of a higher one by what it has (a `Protocol`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# each package, and the folder it lies in (the import path is the file path)
PACKAGES = {"mstarc": REPO, "mstar_runtime": REPO / "runtime", "mstar_models": REPO / "models"}

Graph = dict[str, dict[str, int]]  # module -> {module it imports: line of the first such import}


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    mods = {}
    for package, folder in packages.items():
        for path in (folder / package).rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The modules of `known` that `name` imports, each with its first line (a `from X import Y`
    counts X, and X.Y when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            if t in known and t != name:
                out[t] = min(out.get(t, node.lineno), node.lineno)
    return out


def import_graph(packages: dict[str, Path] = PACKAGES) -> tuple[Graph, dict[str, Path]]:
    mods = _modules(packages)
    return {n: _imports(n, p, set(mods)) for n, p in mods.items()}, mods


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def describe(comp: list[str], graph: Graph, files: dict[str, Path], root: Path = REPO) -> str:
    """A circle as its files and the imports that close it (`file:line imports module`)."""
    rel = {m: files[m].relative_to(root).as_posix() for m in comp}
    lines = [f"import circle among {', '.join(rel[m] for m in comp)}:"]
    lines += [f"  {rel[a]}:{graph[a][b]} imports {b}" for a in comp for b in sorted(graph[a]) if b in rel]
    return "\n".join(lines)


def test_the_project_has_no_import_circle() -> None:
    graph, files = import_graph()
    for walked in ("mstarc.ir", "mstar_runtime.control.conductor", "mstar_models.orpheus.backbone"):
        assert graph.get(walked), walked  # each package really walked, imports found
    found = cycles(graph)
    assert not found, "\n".join(describe(c, graph, files) for c in found)


def test_the_check_finds_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("def f():\n    import pkg.a\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph, files = import_graph({"pkg": tmp_path})
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert describe(found[0], graph, files, tmp_path) == (
        "import circle among pkg/a.py, pkg/c.py, pkg/sub/b.py:\n"
        "  pkg/a.py:1 imports pkg.sub.b\n"
        "  pkg/c.py:2 imports pkg.a\n"
        "  pkg/sub/b.py:3 imports pkg.c")
