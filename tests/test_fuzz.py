"""Property tests: the parser and the plan loader never fail with anything but their own errors.

- Programs generated from AST strategies print, parse and print again to the same text.
- Mutated corpus files (bytes deleted, duplicated, swapped) parse or raise CompileError.
- Truncated and bit-flipped plans raise PlanFileError, never another exception.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar_runtime.plan import planfile
from mstarc import ast
from mstarc.diagnostics import CompileError
from mstarc.parser import parse
from mstarc.printer import format_model

ROOT = Path(__file__).resolve().parent.parent
CORPUS = {p.name: p.read_text() for p in sorted((ROOT / "models").glob("*/*.walk"))}

KEYWORDS = {"model", "variant", "extends", "node", "arch", "in", "out", "phase", "tags", "edge", "stream", "walk",
            "loop", "dynamic_loop", "index", "carry", "until", "parallel", "branch", "on", "as", "emit", "acc",
            "fork", "transition", "when", "keep", "true", "false"}
names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda s: s not in KEYWORDS)
ident = names.map(ast.Ident)


def exprs() -> st.SearchStrategy:
    leaf = st.one_of(
        st.integers(0, 10**6).map(ast.IntLit),
        st.text("abc xyz", max_size=5).map(ast.StrLit),
        st.booleans().map(ast.BoolLit),
        names.map(ast.NameRef),
    )
    return st.recursive(leaf, lambda sub: st.one_of(
        st.tuples(st.sampled_from(["+", "-", "*", "/", "%"]), sub, sub).map(lambda t: ast.BinOp(*t)),
        st.lists(sub, max_size=3).map(lambda xs: ast.ListLit(tuple(xs))),
    ), max_leaves=6)


types = st.one_of(
    st.sampled_from(["str", "int", "float", "bool", "image"]).map(lambda n: ast.TypeRef(ast.Ident(n), None)),
    st.tuples(st.sampled_from(["f32", "bf16", "i32", "bool"]), st.lists(exprs(), max_size=3)).map(
        lambda t: ast.TypeRef(ast.Ident(t[0]), tuple(t[1]))),
)


def _call(node, phase, args, tag):
    return ast.Call(node, phase, tuple(ast.Arg(k, v) for k, v in args), tag)


calls = st.builds(_call, ident, ident, st.lists(st.tuples(ident, exprs()), max_size=2), st.none() | ident)
simple_stmts = st.one_of(
    st.builds(lambda t, c: ast.CallStmt(tuple(t), c), st.lists(ident, max_size=2), calls),
    st.builds(lambda n, op, v: ast.Emit(n, op, v), ident, st.sampled_from(["+=", "="]), exprs()),
    st.builds(lambda n, v: ast.Acc(n, v), ident, exprs()),
    st.builds(lambda n, a, b: ast.Fork(n, a, b), ident, ident, ident),
)


def stmts() -> st.SearchStrategy:
    def extend(sub):
        block = st.lists(sub, max_size=3).map(lambda xs: ast.Block(tuple(xs)))
        return st.one_of(
            st.builds(lambda k, n, carry, body: ast.LoopStmt(
                k, (ast.Setting(ast.Ident("n"), n),), (), tuple(carry), (ast.Ident("done"),) if k == "dynamic_loop" else (),
                body), st.sampled_from(["loop", "dynamic_loop"]), exprs(), st.lists(ident, max_size=2), block),
            st.builds(lambda bs: ast.ParallelStmt(tuple(ast.Branch(n, b) for n, b in bs)),
                      st.lists(st.tuples(ident, block), max_size=2)),
        )
    return st.recursive(simple_stmts, extend, max_leaves=6)


models = st.builds(
    lambda name, settings_, ports, body: ast.Model(
        name, (ast.Variant(ast.Ident("real"), None, tuple(ast.Setting(k, v) for k, v in settings_)),),
        (ast.Node(ast.Ident("n1"), ast.Ident("kv"), (ast.Ident("pkg"), ast.Ident("C")), None,
                  tuple(ast.Port(d, n, t) for d, n, t in ports),
                  (ast.Phase(ast.Ident("go"), (), ()),), None, ()),),
        (), (), (ast.Walk(ast.Ident("w"), (), (), ast.Block(tuple(body))),), ()),
    ident, st.lists(st.tuples(ident, exprs()), max_size=4),
    st.lists(st.tuples(st.sampled_from(["in", "out"]), ident, types), max_size=3),
    st.lists(stmts(), max_size=4),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models)
def test_print_parse_print_is_a_fixed_point(model: ast.Model) -> None:
    text = format_model(model)
    reparsed = parse(text, "gen.walk")
    assert format_model(reparsed) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(CORPUS)), st.data())
def test_mutated_corpus_parses_or_raises_compile_error(name: str, data: st.DataObject) -> None:
    text = CORPUS[name]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, max(0, len(text) - 1)))
        j = data.draw(st.integers(i, min(len(text), i + 12)))
        op = data.draw(st.sampled_from(["delete", "duplicate", "insert"]))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + data.draw(st.sampled_from(list("{}()[]=,.:@-+*/\"#\n x1_"))) + text[i:]
    try:
        parse(text, name)
    except CompileError as e:
        assert e.diagnostics and all(d.code in ("E001", "E002", "E003") for d in e.diagnostics)


def _sample_plan() -> bytes:
    body = {"schema": {"major": planfile.SCHEMA_MAJOR, "minor": 0}, "model": {"name": "m"}, "walks": {"w": [1, 2.5, "x"]}}
    return planfile.encode(body)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_truncated_or_bitflipped_plans_raise_plan_file_error(data: st.DataObject) -> None:
    raw = bytearray(_sample_plan())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        planfile.decode(bytes(raw), "p.plan")
    except planfile.PlanFileError as e:
        assert str(e).startswith("p.plan: ")
    else:  # a flip that cancels itself out leaves a valid plan
        assert bytes(raw) == _sample_plan()
