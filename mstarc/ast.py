"""The `.walk` abstract syntax tree: frozen dataclasses, a `Span` on every node.

Built by `mstarc.parser` from the Lark parse tree; printed back to source by
`mstarc.printer` (print -> parse -> print is a fixed point, tested). Nothing here is
evaluated: config expressions stay expressions until `mstarc.lower` elaborates a variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstarc.diagnostics import Span

_NO_SPAN = Span.unknown()


@dataclass(frozen=True)
class Ident:
    name: str
    span: Span = field(default=_NO_SPAN, compare=False)


# ---- expressions --------------------------------------------------------------------


@dataclass(frozen=True)
class IntLit:
    value: int
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class FloatLit:
    value: float
    text: str
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class StrLit:
    value: str
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class BoolLit:
    value: bool
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class NameRef:
    name: str
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class ListLit:
    items: tuple[Expr, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class BinOp:
    op: str  # one of + - * / %
    left: Expr
    right: Expr
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Neg:
    operand: Expr
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Arg:
    """A call argument: positional when `name` is None."""

    name: Ident | None
    value: Expr
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class FunCall:
    name: Ident
    args: tuple[Arg, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


Expr = IntLit | FloatLit | StrLit | BoolLit | NameRef | ListLit | BinOp | Neg | FunCall


# ---- model-level declarations ---------------------------------------------------------


@dataclass(frozen=True)
class TypeRef:
    """`str`, `int`, `float`, `bool`, `image`, or a tensor `dtype[dims]` (dims None: no brackets)."""

    name: Ident
    dims: tuple[Expr, ...] | None
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Setting:
    name: Ident
    value: Expr
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Variant:
    name: Ident
    extends: Ident | None
    settings: tuple[Setting, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Arch:
    name: Ident
    args: tuple[Arg, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Port:
    direction: str  # "in" | "out"
    name: Ident
    type: TypeRef
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class ReadRef:
    """`reads NODE[@TAG]` on a phase: a KV context the phase attends to besides its call's own."""

    node: Ident
    tag: Ident | None  # None: the tag of the call
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Phase:
    name: Ident
    inputs: tuple[Ident, ...]
    outputs: tuple[Ident, ...]
    span: Span = field(default=_NO_SPAN, compare=False)
    reads: tuple[ReadRef, ...] = ()


@dataclass(frozen=True)
class Tags:
    names: tuple[Ident, ...]
    span: Span = field(default=_NO_SPAN, compare=False)
    args: tuple[tuple[Arg, ...], ...] = ()  # per name, its `(max_len = N)` arguments (empty: none)


@dataclass(frozen=True)
class Node:
    name: Ident
    engine: Ident
    impl: tuple[Ident, ...]
    arch: Arch | None
    ports: tuple[Port, ...]
    phases: tuple[Phase, ...]
    tags: Tags | None
    settings: tuple[Setting, ...]
    span: Span = field(default=_NO_SPAN, compare=False)
    extra_archs: tuple[Arch, ...] = ()  # more than one `arch` line: an error, kept for E010
    impl_args: tuple[Arg, ...] | None = None  # `= pkg.Impl(key = value, ...)`: the implementation's settings


@dataclass(frozen=True)
class Endpoint:
    node: Ident
    port: Ident
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Edge:
    src: Endpoint
    dst: Endpoint
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Policy:
    name: Ident
    args: tuple[Arg, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Stream:
    src: Endpoint
    dst: Endpoint
    policy: Policy
    span: Span = field(default=_NO_SPAN, compare=False)


# ---- walks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: Ident
    type: TypeRef
    default: Expr | None
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Call:
    node: Ident
    phase: Ident
    args: tuple[Arg, ...]
    tag: Ident | None
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class CallStmt:
    targets: tuple[Ident, ...]
    call: Call
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class LoopStmt:
    """`loop` (fixed trip count) or `dynamic_loop` (per-request early exit)."""

    kind: str  # "loop" | "dynamic_loop"
    settings: tuple[Setting, ...]  # n=..., max=...
    index: tuple[Ident, ...]
    carry: tuple[Ident, ...]
    until: tuple[Ident, ...]
    body: Block
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Branch:
    name: Ident
    body: Block
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class ParallelStmt:
    branches: tuple[Branch, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class OnStream:
    src: Endpoint
    dst: Endpoint
    name: Ident
    body: Block
    span: Span = field(default=_NO_SPAN, compare=False)
    # `carry a, b`: a stream loop, run in line with the walk's body (walk-language.md 9.5);
    # None: a block that runs beside the walk
    carry: tuple[Ident, ...] | None = None


@dataclass(frozen=True)
class Emit:
    name: Ident
    op: str  # "+=" | "="
    value: Expr
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Acc:
    name: Ident
    value: Expr
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Fork:
    node: Ident
    src_tag: Ident
    dst_tag: Ident
    span: Span = field(default=_NO_SPAN, compare=False)


Stmt = CallStmt | LoopStmt | ParallelStmt | OnStream | Emit | Acc | Fork


@dataclass(frozen=True)
class Block:
    stmts: tuple[Stmt, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Route:
    """`serves NAME(slot = value, ...)` on a walk: an OpenAI route the walk serves, each slot
    bound to an input or output of the walk (a name) or to a string (mstarc/routes.py checks it)."""

    name: Ident
    args: tuple[Arg, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Walk:
    name: Ident
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    body: Block
    span: Span = field(default=_NO_SPAN, compare=False)
    routes: tuple[Route, ...] = ()  # its `serves` clause, in source order


@dataclass(frozen=True)
class KeepItem:
    node: Ident
    tag: Ident
    as_tag: Ident | None
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Transition:
    src: Ident
    dst: Ident
    when: Ident
    keep: tuple[KeepItem, ...]
    span: Span = field(default=_NO_SPAN, compare=False)


@dataclass(frozen=True)
class Model:
    name: Ident
    variants: tuple[Variant, ...]
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    streams: tuple[Stream, ...]
    walks: tuple[Walk, ...]
    transitions: tuple[Transition, ...]
    span: Span = field(default=_NO_SPAN, compare=False)
