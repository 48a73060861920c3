"""Printers: AST -> canonical `.walk` source, and IR region trees -> readable text.

`format_model` prints any AST back to source that parses to an equal AST (spans aside), so
print -> parse -> print is a fixed point (a Hypothesis test checks it); it is also the
formatter a `mstarc fmt` would use.
"""

from __future__ import annotations

from mstarc import ast
from mstarc import ir as I

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "%": 2}


def format_expr(e: ast.Expr, parent_prec: int = 0, right: bool = False) -> str:
    if isinstance(e, ast.IntLit):
        return str(e.value)
    if isinstance(e, ast.FloatLit):
        return e.text if e.text else repr(e.value)
    if isinstance(e, ast.StrLit):
        return '"' + e.value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(e, ast.BoolLit):
        return "true" if e.value else "false"
    if isinstance(e, ast.NameRef):
        return e.name
    if isinstance(e, ast.ListLit):
        return "[" + ", ".join(format_expr(i) for i in e.items) + "]"
    if isinstance(e, ast.Neg):
        return "-" + format_expr(e.operand, 3)
    if isinstance(e, ast.FunCall):
        return f"{e.name.name}({format_args(e.args)})"
    if isinstance(e, ast.BinOp):
        p = _PREC[e.op]
        text = f"{format_expr(e.left, p)} {e.op} {format_expr(e.right, p, right=True)}"
        # left-associative: a right operand of equal precedence needs parentheses
        return f"({text})" if p < parent_prec or (right and p == parent_prec) else text
    raise TypeError(type(e).__name__)


def format_args(args) -> str:
    return ", ".join((f"{a.name.name}={format_expr(a.value)}" if a.name else format_expr(a.value)) for a in args)


def format_type(t: ast.TypeRef) -> str:
    if t.dims is None:
        return t.name.name
    return f"{t.name.name}[{', '.join(format_expr(d) for d in t.dims)}]"


def _block(b: ast.Block, ind: int) -> list[str]:
    out: list[str] = []
    for s in b.stmts:
        out.extend(_stmt(s, ind))
    return out


def _stmt(s: ast.Stmt, ind: int) -> list[str]:
    pad = "  " * ind
    if isinstance(s, ast.CallStmt):
        c = s.call
        lhs = ", ".join(t.name for t in s.targets) + " = " if s.targets else ""
        tag = f" @{c.tag.name}" if c.tag else ""
        return [f"{pad}{lhs}{c.node.name}.{c.phase.name}({format_args(c.args)}){tag}"]
    if isinstance(s, ast.LoopStmt):
        parts = [s.kind] + [f"{st.name.name}={format_expr(st.value)}" for st in s.settings]
        parts += [f"until {u.name}" for u in s.until] + [f"index {i.name}" for i in s.index]
        if s.carry:
            parts.append("carry " + ", ".join(c.name for c in s.carry))
        return [f"{pad}{' '.join(parts)} {{", *_block(s.body, ind + 1), f"{pad}}}"]
    if isinstance(s, ast.ParallelStmt):
        out = [f"{pad}parallel {{"]
        for b in s.branches:
            out += [f"{pad}  branch {b.name.name} {{", *_block(b.body, ind + 2), f"{pad}  }}"]
        return out + [f"{pad}}}"]
    if isinstance(s, ast.OnStream):
        head = f"on stream {s.src.node.name}.{s.src.port.name} -> {s.dst.node.name}.{s.dst.port.name} as {s.name.name}"
        if s.carry is not None:
            head += " carry " + ", ".join(c.name for c in s.carry)
        return [f"{pad}{head} {{", *_block(s.body, ind + 1), f"{pad}}}"]
    if isinstance(s, ast.Emit):
        return [f"{pad}emit {s.name.name} {s.op} {format_expr(s.value)}"]
    if isinstance(s, ast.Acc):
        return [f"{pad}acc {s.name.name} += {format_expr(s.value)}"]
    if isinstance(s, ast.Fork):
        return [f"{pad}fork {s.node.name} @{s.src_tag.name} -> @{s.dst_tag.name}"]
    raise TypeError(type(s).__name__)


def _reads(p: ast.Phase) -> str:
    if not p.reads:
        return ""
    return " reads " + ", ".join(r.node.name + (f"@{r.tag.name}" if r.tag else "") for r in p.reads)


def _params(ps) -> str:
    return ", ".join(f"{p.name.name}: {format_type(p.type)}" + (f" = {format_expr(p.default)}" if p.default else "")
                     for p in ps)


def format_model(m: ast.Model) -> str:
    out = [f"model {m.name.name} {{"]
    for v in m.variants:
        ext = f" extends {v.extends.name}" if v.extends else ""
        out.append(f"  variant {v.name.name}{ext} {{")
        out += [f"    {s.name.name} = {format_expr(s.value)}" for s in v.settings]
        out.append("  }")
    for n in m.nodes:
        impl_args = f"({format_args(n.impl_args)})" if n.impl_args is not None else ""
        out.append(f"  node {n.name.name} : {n.engine.name} = {'.'.join(i.name for i in n.impl)}{impl_args} {{")
        for a in ([n.arch] if n.arch else []) + list(n.extra_archs):
            out.append(f"    arch {a.name.name}({format_args(a.args)})")
        if n.tags:
            args = n.tags.args or ((),) * len(n.tags.names)
            out.append("    tags " + ", ".join(t.name + (f"({format_args(a)})" if a else "")
                                           for t, a in zip(n.tags.names, args)))
        out += [f"    {p.direction} {p.name.name} : {format_type(p.type)}" for p in n.ports]
        out += [f"    phase {p.name.name}({', '.join(i.name for i in p.inputs)}) -> "
                f"({', '.join(o.name for o in p.outputs)})" + _reads(p) for p in n.phases]
        out += [f"    {s.name.name} = {format_expr(s.value)}" for s in n.settings]
        out.append("  }")
    for e in m.edges:
        out.append(f"  edge {e.src.node.name}.{e.src.port.name} -> {e.dst.node.name}.{e.dst.port.name}")
    for s in m.streams:
        out.append(f"  stream {s.src.node.name}.{s.src.port.name} -> {s.dst.node.name}.{s.dst.port.name} : "
                   f"{s.policy.name.name}({format_args(s.policy.args)})")
    for w in m.walks:
        serves = ""
        if w.routes:
            serves = " serves " + ", ".join(f"{r.name.name}({format_args(r.args)})" for r in w.routes)
        out.append(f"  walk {w.name.name}({_params(w.inputs)}) -> ({_params(w.outputs)}){serves} {{")
        out += _block(w.body, 2)
        out.append("  }")
    for t in m.transitions:
        keep = ""
        if t.keep:
            keep = " keep " + ", ".join(f"{k.node.name}@{k.tag.name}" + (f" as {k.as_tag.name}" if k.as_tag else "")
                                        for k in t.keep)
        out.append(f"  transition {t.src.name} -> {t.dst.name} when {t.when.name}{keep}")
    out.append("}")
    return "\n".join(out) + "\n"


def _operand(op: I.Operand) -> str:
    return op.name if isinstance(op, I.Var) else repr(op.value)


def print_regions(r: I.Region, ind: int = 0) -> str:
    pad = "  " * ind
    if isinstance(r, I.Seq):
        return "\n".join(print_regions(x, ind) for x in r.body)
    if isinstance(r, I.Call):
        lhs = ", ".join(r.results) + " = " if r.results else ""
        args = ", ".join(f"{k}={_operand(v)}" for k, v in r.args.items())
        return f"{pad}[{r.id}] {lhs}{r.node}.{r.phase}({args})" + (f" @{r.tag}" if r.tag else "")
    if isinstance(r, I.Loop):
        head = (f"dynamic_loop max={r.max} until {r.until}" if r.dynamic
                else f"loop n={_operand(r.count) if r.count else '?'}" + (f" max={r.max}" if r.max else ""))
        extra = (f" index {r.index}" if r.index else "") + (f" carry {', '.join(r.carry)}" if r.carry else "")
        return f"{pad}[{r.id}] {head}{extra}\n{print_regions(r.body, ind + 1)}"
    if isinstance(r, I.Parallel):
        return f"{pad}[{r.id}] parallel\n" + "\n".join(
            f"{pad}  branch {b.name}\n{print_regions(b.body, ind + 2)}" for b in r.branches)
    if isinstance(r, I.OnStream):
        carry = f" carry {', '.join(r.carry)}" if r.carry is not None else ""
        return f"{pad}[{r.id}] on stream {r.stream} as {r.name}{carry}\n{print_regions(r.body, ind + 1)}"
    if isinstance(r, I.Emit):
        return f"{pad}emit {r.output} {r.op} {_operand(r.value)}"
    if isinstance(r, I.Acc):
        return f"{pad}acc {r.name} += {_operand(r.value)}"
    if isinstance(r, I.Fork):
        return f"{pad}fork {r.node} @{r.src_tag} -> @{r.dst_tag}"
    raise TypeError(type(r).__name__)
