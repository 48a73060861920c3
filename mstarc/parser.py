"""Front end: `.walk` text -> `mstarc.ast.Model`, with Lark errors turned into diagnostics.

The Lark LALR parser is built once per process from grammar/walk.lark (positions kept) and
cached. No Lark exception ever reaches a caller: a syntax error becomes `CompileError` with
code E001 (unexpected token), E002 (unexpected character) or E003 (unexpected end of file),
naming what was expected in words.

Bounded work (mstarc/limits.py): a file is read with a size cap and refused above a token
count before Lark sees it (E006); the parse tree is turned into the AST by an explicit stack,
not by recursion, and a tree that nests blocks or expressions deeper than the limits is E005
at the construct that crosses the limit. So no input can make a later recursive walk of the
AST (evaluation, lowering, the passes, the printer) exceed Python's recursion limit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lark
from lark import Token, Tree

from mstarc import ast, limits
from mstarc.diagnostics import CompileError, Diagnostic, Span, source_lines

GRAMMAR_PATH = Path(__file__).resolve().parent / "grammar" / "walk.lark"

# Lark's terminal names -> what a user reads in "expected ..." lists.
_TERMINAL_WORDS = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
    "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'",
    "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "DOT": "'.'", "AT": "'@'", "MINUS": "'-'",
    "PLUS": "'+'", "STAR": "'*'", "SLASH": "'/'", "PERCENT": "'%'", "__ANON_0": "'->'",
}


@functools.cache
def _lark() -> lark.Lark:
    return lark.Lark(GRAMMAR_PATH.read_text(encoding="utf-8"), parser="lalr",
                     propagate_positions=True, maybe_placeholders=True)


def _describe_expected(parser: lark.Lark, names: set[str]) -> str:
    words = []
    for name in sorted(names):
        if name in _TERMINAL_WORDS:
            words.append(_TERMINAL_WORDS[name])
            continue
        try:
            pattern = parser.get_terminal(name).pattern
        except KeyError:
            words.append(name)
            continue
        if pattern.type == "str":
            words.append(f"'{pattern.value}'")
        else:
            words.append(name.lower())
    words = sorted(set(words))
    if len(words) > 8:
        words = words[:8] + ["..."]
    return ", ".join(words)


def _token_text(tok: Token) -> str:
    text = str(tok)
    return text if len(text) <= 30 else text[:27] + "..."


def parse(text: str, file: str) -> ast.Model:
    """Parse one `.walk` source. Raises CompileError (one syntax diagnostic) on bad input."""
    parser = _lark()
    if len(text) > limits.MAX_WALK_TOKENS:  # a shorter text cannot hold more tokens
        n = limits.count_tokens(text, limits.MAX_WALK_TOKENS + 1)
        if n > limits.MAX_WALK_TOKENS:
            raise CompileError([Diagnostic(
                "E006", f"'{file}' is too large: more than {limits.MAX_WALK_TOKENS} tokens, the cap",
                Span(file, 0, 0), "a model file is far smaller; split the model or check that this is the file you meant")])
    try:
        tree = parser.parse(text)
    except lark.exceptions.UnexpectedToken as e:
        # LALR merges look-ahead sets of similar states; asking the parser state which tokens it
        # would really accept here gives an exact "expected" list.
        try:
            accepts = set(e.interactive_parser.accepts()) if e.interactive_parser is not None else set(e.expected)
        except Exception:  # noqa: BLE001 - best effort; fall back to Lark's own list
            accepts = set(e.expected)
        expected = _describe_expected(parser, accepts or set(e.expected))
        if e.token.type == "$END":
            lines = source_lines(text) or [""]
            span = Span(file, len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2)
            diag = Diagnostic("E003", f"unexpected end of file; expected {expected}", span,
                              "a block or a call is not closed")
        else:
            span = Span(file, e.line, e.column, e.token.end_line or e.line,
                        e.token.end_column or e.column + 1)
            diag = Diagnostic("E001", f"unexpected '{_token_text(e.token)}'; expected {expected}", span)
        raise CompileError([diag]) from None
    except lark.exceptions.UnexpectedCharacters as e:
        span = Span(file, e.line, e.column, e.line, e.column + 1)
        char = text[e.pos_in_stream] if 0 <= e.pos_in_stream < len(text) else "?"
        raise CompileError([Diagnostic("E002", f"unexpected character {char!r}", span)]) from None
    except lark.exceptions.UnexpectedEOF as e:  # pragma: no cover - LALR reports $END as a token
        lines = source_lines(text) or [""]
        span = Span(file, len(lines), len(lines[-1]) + 1)
        raise CompileError([Diagnostic("E003", f"unexpected end of file; expected {e.expected}", span)]) from None
    except lark.exceptions.LarkError as e:  # pragma: no cover - defensive: never leak Lark
        raise CompileError([Diagnostic("E001", f"cannot parse: {e}", Span(file, 1, 1))]) from None
    return _ToAst(file).transform(tree)


def read_source(path: str | Path, display_name: str | None = None) -> tuple[bytes, str]:
    """The bytes and text of a `.walk` file: E004 when it cannot be read (or is not UTF-8),
    E006 over the size cap."""
    name = display_name or str(path)
    try:
        data = limits.read_bytes_capped(path, name, limits.MAX_WALK_BYTES)
        return data, limits.decode_text(data)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CompileError([Diagnostic("E004", f"cannot read '{name}': {reason}", Span(name, 0, 0))]) from None


def parse_file(path: str | Path, display_name: str | None = None) -> ast.Model:
    """Read and parse a file; an unreadable file is E004, not an OSError."""
    name = display_name or str(path)
    return parse(read_source(path, name)[1], name)


def _kids(children: list[Any]) -> list[Any]:
    return [c for c in children if c is not None]


# Rules that open one level of nesting (limits.MAX_BLOCK_DEPTH, MAX_EXPR_DEPTH).
_BLOCK_RULES = frozenset({"block"})
_EXPR_RULES = frozenset({"add", "sub", "mul", "div", "mod", "neg", "list", "funcall"})


class _ToAst:
    """Lark tree -> AST. One method per grammar rule, called as `method(meta, children)` with
    the children already converted; spans from Lark's meta.

    `transform` walks the tree with an explicit stack (post-order), so a deep tree cannot
    exhaust Python's recursion limit, and refuses a tree deeper than the nesting limits."""

    def __init__(self, file: str):
        self.file = file

    def transform(self, tree: Tree) -> Any:
        # a frame: (tree, its children iterator, converted children, block depth, expression depth)
        stack: list[tuple[Tree, Any, list[Any], int, int]] = [(tree, iter(tree.children), [], 0, 0)]
        while True:
            node, children, out, blocks, exprs = stack[-1]
            for child in children:
                if isinstance(child, Tree):
                    rule = str(child.data)
                    b = blocks + (rule in _BLOCK_RULES)
                    e = exprs + (rule in _EXPR_RULES)
                    if b > limits.MAX_BLOCK_DEPTH or e > limits.MAX_EXPR_DEPTH:
                        raise CompileError([self._too_deep(child, b > limits.MAX_BLOCK_DEPTH)])
                    stack.append((child, iter(child.children), [], b, e))
                    break
                out.append(self.NAME(child) if isinstance(child, Token) and child.type == "NAME" else child)
            else:
                stack.pop()
                result = getattr(self, str(node.data))(node.meta, out)
                if not stack:
                    return result
                stack[-1][2].append(result)

    def _too_deep(self, tree: Tree, blocks: bool) -> Diagnostic:
        meta = tree.meta
        span = Span(self.file, meta.line, meta.column, meta.line, meta.column + 1) \
            if not getattr(meta, "empty", True) else Span(self.file, 0, 0)
        if blocks:
            return Diagnostic("E005", f"blocks nest more than {limits.MAX_BLOCK_DEPTH} levels deep", span,
                              "a walk's body and every loop, branch and stream body is one level; "
                              "flatten the nesting")
        return Diagnostic("E005", f"expression nests more than {limits.MAX_EXPR_DEPTH} levels deep", span,
                          "every operator, negation, list and function call is one level, so is every term "
                          "of a chain like `a + b + c`; split the expression into several settings")

    def _span(self, meta: Any) -> Span:
        if getattr(meta, "empty", True):
            return Span(self.file, 0, 0)
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok_span(self, tok: Token) -> Span:
        return Span(self.file, tok.line, tok.column, tok.end_line, tok.end_column)

    # terminals: names carry spans; the other tokens stay Lark tokens
    def NAME(self, tok: Token) -> ast.Ident:  # noqa: N802 - named after the terminal
        return ast.Ident(str(tok), self._tok_span(tok))

    # ---- top level
    def start(self, meta, children):
        return children[0]

    def model(self, meta, children):
        name, *items = children
        groups: dict[type, list] = {t: [] for t in (ast.Variant, ast.Node, ast.Edge, ast.Stream,
                                                    ast.Walk, ast.Transition)}
        for item in items:
            groups[type(item)].append(item)
        return ast.Model(name, *(tuple(groups[t]) for t in groups), span=self._span(meta))

    def variant(self, meta, children):
        name, *rest = children
        extends = rest.pop(0) if rest and isinstance(rest[0], ast.Ident) else None
        return ast.Variant(name, extends, tuple(rest), self._span(meta))

    def extends(self, meta, children):
        return children[0]

    def setting(self, meta, children):
        return ast.Setting(children[0], children[1], self._span(meta))

    # ---- nodes
    def node(self, meta, children):
        name, engine, impl, *rest = children
        impl_args = rest.pop(0)[1] if rest and isinstance(rest[0], tuple) and rest[0][:1] == ("impl",) else None
        items = rest[0] if rest else []
        archs = [i for i in items if isinstance(i, ast.Arch)]
        tags = [i for i in items if isinstance(i, ast.Tags)]
        return ast.Node(
            name=name, engine=engine, impl=impl, arch=archs[0] if archs else None,
            ports=tuple(i for i in items if isinstance(i, ast.Port)),
            phases=tuple(i for i in items if isinstance(i, ast.Phase)),
            tags=ast.Tags(tuple(n for t in tags for n in t.names), tags[0].span,
                          tuple(a for t in tags for a in t.args)) if tags else None,
            settings=tuple(i for i in items if isinstance(i, ast.Setting)),
            span=self._span(meta), extra_archs=tuple(archs[1:]), impl_args=impl_args,
        )

    def impl_args(self, meta, children):
        return ("impl", tuple(children[0] or ()))

    def dotted(self, meta, children):
        return tuple(children)

    def node_body(self, meta, children):
        return list(children)

    def arch(self, meta, children):
        return ast.Arch(children[0], tuple(children[1] or ()), self._span(meta))

    def port(self, meta, children):
        return ast.Port(children[0], children[1], children[2], self._span(meta))

    def port_dir(self, meta, children):
        return str(children[0])

    def phase(self, meta, children):
        name, ins, outs, *reads = children
        return ast.Phase(name, tuple(ins or ()), tuple(outs or ()), self._span(meta), tuple(reads[0]) if reads else ())

    def reads(self, meta, children):
        return list(children)

    def read_item(self, meta, children):
        return ast.ReadRef(children[0], children[1] if len(children) > 1 else None, self._span(meta))

    def tags(self, meta, children):
        return ast.Tags(tuple(n for n, _ in children), self._span(meta), tuple(a for _, a in children))

    def tag_decl(self, meta, children):
        return (children[0], tuple(children[1] or ()) if len(children) > 1 else ())

    def name_list(self, meta, children):
        return list(children)

    def type(self, meta, children):
        dims = children[1] if len(children) > 1 else None
        return ast.TypeRef(children[0], dims, self._span(meta))

    def dims(self, meta, children):
        return tuple(_kids(children))

    # ---- edges
    def edge(self, meta, children):
        return ast.Edge(children[0], children[1], self._span(meta))

    def stream(self, meta, children):
        return ast.Stream(children[0], children[1], children[2], self._span(meta))

    def endpoint(self, meta, children):
        return ast.Endpoint(children[0], children[1], self._span(meta))

    def policy(self, meta, children):
        return ast.Policy(children[0], tuple(children[1] or ()), self._span(meta))

    # ---- walks
    def walk(self, meta, children):
        name, ins, outs, *serves, body = children
        routes = tuple(serves[0]) if serves and serves[0] is not None else ()
        return ast.Walk(name, tuple(ins or ()), tuple(outs or ()), body, self._span(meta), routes)

    def serves(self, meta, children):
        return list(children)

    def route(self, meta, children):
        return ast.Route(children[0], tuple(children[1] or ()), self._span(meta))

    def params(self, meta, children):
        return list(_kids(children))

    def param(self, meta, children):
        default = children[2] if len(children) > 2 else None
        return ast.Param(children[0], children[1], default, self._span(meta))

    def default(self, meta, children):
        return children[0]

    def block(self, meta, children):
        return ast.Block(tuple(children), self._span(meta))

    def call_stmt(self, meta, children):
        targets = children[0] if len(children) == 2 else ()
        return ast.CallStmt(tuple(targets), children[-1], self._span(meta))

    def targets(self, meta, children):
        return tuple(children)

    def call(self, meta, children):
        node, phase, args, *tag = children
        return ast.Call(node, phase, tuple(args or ()), tag[0] if tag else None, self._span(meta))

    def tag(self, meta, children):
        return children[0]

    def loop(self, meta, children):
        kind, *clauses, body = children
        pick = {k: [] for k in ("setting", "index", "carry", "until")}
        for kind_name, value in clauses:
            pick[kind_name].extend(value)
        return ast.LoopStmt(kind, tuple(pick["setting"]), tuple(pick["index"]), tuple(pick["carry"]),
                            tuple(pick["until"]), body, self._span(meta))

    def loop_kind(self, meta, children):
        return str(children[0])

    def loop_setting(self, meta, children):
        return ("setting", [ast.Setting(children[0], children[1], self._span(meta))])

    def loop_index(self, meta, children):
        return ("index", [children[0]])

    def loop_carry(self, meta, children):
        return ("carry", list(children[0]))

    def loop_until(self, meta, children):
        return ("until", [children[0]])

    def parallel(self, meta, children):
        return ast.ParallelStmt(tuple(children), self._span(meta))

    def branch(self, meta, children):
        return ast.Branch(children[0], children[1], self._span(meta))

    def on_stream(self, meta, children):
        src, dst, name, carry, body = children  # carry: ("carry", names), or None when absent
        return ast.OnStream(src, dst, name, body, self._span(meta), tuple(carry[1]) if carry else None)

    def emit(self, meta, children):
        return ast.Emit(children[0], children[1], children[2], self._span(meta))

    def emit_op(self, meta, children):
        return str(children[0])

    def acc(self, meta, children):
        return ast.Acc(children[0], children[1], self._span(meta))

    def fork(self, meta, children):
        return ast.Fork(children[0], children[1], children[2], self._span(meta))

    def transition(self, meta, children):
        src, dst, when, *keep = children
        return ast.Transition(src, dst, when, tuple(keep[0]) if keep else (), self._span(meta))

    def keep(self, meta, children):
        return list(children)

    def keep_item(self, meta, children):
        as_tag = children[2] if len(children) > 2 else None
        return ast.KeepItem(children[0], children[1], as_tag, self._span(meta))

    # ---- expressions
    def args(self, meta, children):
        out = []
        for c in _kids(children):
            out.append(c if isinstance(c, ast.Arg) else ast.Arg(None, c, getattr(c, "span", Span.unknown())))
        return out

    def kwarg(self, meta, children):
        return ast.Arg(children[0], children[1], self._span(meta))

    def _bin(self, op: str, meta, children):
        return ast.BinOp(op, children[0], children[1], self._span(meta))

    def add(self, meta, children):
        return self._bin("+", meta, children)

    def sub(self, meta, children):
        return self._bin("-", meta, children)

    def mul(self, meta, children):
        return self._bin("*", meta, children)

    def div(self, meta, children):
        return self._bin("/", meta, children)

    def mod(self, meta, children):
        return self._bin("%", meta, children)

    def neg(self, meta, children):
        return ast.Neg(children[0], self._span(meta))

    def int(self, meta, children):
        digits = str(children[0]).replace("_", "")
        if len(digits) > 100:  # far beyond 64 bits (and Python refuses to convert > 4300 digits)
            raise CompileError([Diagnostic("E025", f"integer literal of {len(digits)} digits does not fit in 64 bits",
                                           self._span(meta), f"integers are signed 64-bit: {limits.INT_MIN} to "
                                           f"{limits.INT_MAX}")])
        return ast.IntLit(int(digits), self._span(meta))

    def float(self, meta, children):
        text = str(children[0])
        return ast.FloatLit(float(text.replace("_", "")), text, self._span(meta))

    def string(self, meta, children):
        raw = str(children[0])[1:-1]
        try:
            value = raw.encode("utf-8").decode("unicode_escape") if "\\" in raw else raw
        except UnicodeDecodeError as e:  # `\x4`, `\N{nothing}`: a malformed escape
            raise CompileError([Diagnostic("E001", f"bad escape in string: {e.reason}", self._span(meta),
                                           "use \\\\ for a backslash")]) from None
        return ast.StrLit(value, self._span(meta))

    def true(self, meta, children):
        return ast.BoolLit(True, self._span(meta))

    def false(self, meta, children):
        return ast.BoolLit(False, self._span(meta))

    def name(self, meta, children):
        ident = children[0]
        return ast.NameRef(ident.name, ident.span)

    def list(self, meta, children):
        return ast.ListLit(tuple(_kids(children)), self._span(meta))

    def funcall(self, meta, children):
        return ast.FunCall(children[0], tuple(children[1] or ()), self._span(meta))
