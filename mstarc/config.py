"""Config variants: resolve `extends`, evaluate setting expressions, read checkpoint configs.

A variant's settings are expressions over other settings of the same (resolved) variant.
`evaluate` is also used for node settings, `arch` arguments, port dims and walk defaults.
Evaluation errors are diagnostics (E020 bad value, E021 cycle, E022 checkpoint reference).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from mstarc import ast
from mstarc.diagnostics import DiagnosticSink, Span
from mstarc.ir import ConfigValue


class EvalError(Exception):
    def __init__(self, code: str, message: str, span: Span, hint: str | None = None):
        super().__init__(message)
        self.code, self.message, self.span, self.hint = code, message, span, hint


def _arith(op: str, a: ConfigValue, b: ConfigValue, span: Span) -> ConfigValue:
    numeric = (int, float)
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, numeric) or not isinstance(b, numeric):
        if op == "+" and isinstance(a, str) and isinstance(b, str):
            return a + b
        if op == "+" and isinstance(a, list) and isinstance(b, list):
            return a + b
        raise EvalError("E020", f"operator '{op}' needs numbers, got {type(a).__name__} and {type(b).__name__}", span)
    if op in ("/", "%") and b == 0:
        raise EvalError("E020", "division by zero", span)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        # exact integer division stays an int: `hidden / heads` is a head_dim, not 128.0
        if isinstance(a, int) and isinstance(b, int) and a % b == 0:
            return a // b
        return a / b
    return a % b


class CheckpointConfig:
    """JSON config files of a weights folder, read once each (`from_checkpoint(file, key, default)`)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self._cache: dict[str, object] = {}

    def lookup(self, file: str, key: str, default: ConfigValue | None, span: Span) -> ConfigValue:
        if self.folder is None:
            if default is None:
                raise EvalError("E022", f"from_checkpoint(\"{file}\", \"{key}\") has no default and no weights folder was given",
                                span, "pass --weights DIR, or add a default as the third argument")
            return default
        if file not in self._cache:
            path = self.folder / file
            try:
                self._cache[file] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise EvalError("E022", f"cannot read checkpoint config '{path}': {e}", span) from None
        node: object = self._cache[file]
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise EvalError("E022", f"checkpoint config '{file}' has no key '{key}'", span,
                                "check the key path against the checkpoint's config file")
            node = node[part]
        if not isinstance(node, int | float | str | bool | list):
            raise EvalError("E022", f"checkpoint config '{file}' key '{key}' is not a number, string or list", span)
        return node


def evaluate(expr: ast.Expr, lookup: Callable[[str, Span], ConfigValue],
             checkpoint: CheckpointConfig | None = None) -> ConfigValue:
    """Evaluate a config expression; `lookup` resolves names (raising EvalError when unknown)."""
    if isinstance(expr, ast.IntLit | ast.FloatLit | ast.StrLit | ast.BoolLit):
        return expr.value
    if isinstance(expr, ast.NameRef):
        return lookup(expr.name, expr.span)
    if isinstance(expr, ast.ListLit):
        return [evaluate(i, lookup, checkpoint) for i in expr.items]
    if isinstance(expr, ast.Neg):
        v = evaluate(expr.operand, lookup, checkpoint)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise EvalError("E020", f"cannot negate a {type(v).__name__}", expr.span)
        return -v
    if isinstance(expr, ast.BinOp):
        return _arith(expr.op, evaluate(expr.left, lookup, checkpoint), evaluate(expr.right, lookup, checkpoint), expr.span)
    if isinstance(expr, ast.FunCall):
        return _funcall(expr, lookup, checkpoint)
    raise EvalError("E020", "cannot evaluate this expression", getattr(expr, "span", Span.unknown()))


def _funcall(call: ast.FunCall, lookup, checkpoint: CheckpointConfig | None) -> ConfigValue:
    name = call.name.name
    if name != "from_checkpoint":
        raise EvalError("E020", f"unknown function '{name}'", call.name.span,
                        "the only function in config expressions is from_checkpoint(file, key, default)")
    values = [evaluate(a.value, lookup, checkpoint) for a in call.args]
    if any(a.name is not None for a in call.args) or not 2 <= len(values) <= 3 or \
            not all(isinstance(v, str) for v in values[:2]):
        raise EvalError("E020", "from_checkpoint takes (file: string, key: string[, default])", call.span)
    default = values[2] if len(values) == 3 else None
    return (checkpoint or CheckpointConfig(None)).lookup(values[0], values[1], default, call.span)


def resolve_variant(model: ast.Model, variant: str, checkpoint: CheckpointConfig,
                    sink: DiagnosticSink) -> dict[str, ConfigValue] | None:
    """Evaluate every setting of `variant` (with its `extends` chain). None if the variant is unknown."""
    by_name: dict[str, ast.Variant] = {}
    for v in model.variants:
        if v.name.name in by_name:
            sink.error("E010", f"variant '{v.name.name}' is defined twice", v.name.span)
        else:
            by_name[v.name.name] = v
    if variant not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        sink.error("E015", f"model '{model.name.name}' has no variant '{variant}' (it has: {known})",
                   model.name.span, "choose one with --variant")
        return None
    # merge the extends chain, base first
    chain: list[ast.Variant] = []
    cur: ast.Variant | None = by_name[variant]
    while cur is not None:
        if cur in chain:
            sink.error("E021", f"variant '{cur.name.name}' extends itself through a cycle", cur.name.span)
            return None
        chain.append(cur)
        if cur.extends is None:
            cur = None
        elif cur.extends.name not in by_name:
            sink.error("E015", f"variant '{cur.name.name}' extends unknown variant '{cur.extends.name}'", cur.extends.span)
            return None
        else:
            cur = by_name[cur.extends.name]
    exprs: dict[str, ast.Setting] = {}
    for v in reversed(chain):
        seen: set[str] = set()
        for s in v.settings:
            if s.name.name in seen:
                sink.error("E010", f"setting '{s.name.name}' is defined twice in variant '{v.name.name}'", s.name.span)
            seen.add(s.name.name)
            exprs[s.name.name] = s
    return _evaluate_settings(exprs, checkpoint, sink)


def _evaluate_settings(exprs: Mapping[str, ast.Setting], checkpoint: CheckpointConfig,
                       sink: DiagnosticSink) -> dict[str, ConfigValue]:
    values: dict[str, ConfigValue] = {}
    failed: set[str] = set()
    active: list[str] = []

    def lookup(name: str, span: Span) -> ConfigValue:
        if name in values:
            return values[name]
        if name in failed:
            raise EvalError("E020", "", span)  # already reported; suppressed below
        if name not in exprs:
            raise EvalError("E011", f"unknown config value '{name}'", span)
        if name in active:
            cycle = " -> ".join(active[active.index(name):] + [name])
            raise EvalError("E021", f"config values refer to each other in a cycle: {cycle}", span)
        active.append(name)
        try:
            values[name] = evaluate(exprs[name].value, lookup, checkpoint)
        finally:
            active.pop()
        return values[name]

    reported: set[tuple[str, str, Span]] = set()
    for name in exprs:  # source order, so the first diagnostic is the first in the file
        if name in values or name in failed:
            continue
        try:
            lookup(name, exprs[name].name.span)
        except EvalError as e:
            failed.add(name)
            key = (e.code, e.message, e.span)
            if e.message and key not in reported:  # a shared bad dependency is reported once
                reported.add(key)
                sink.error(e.code, e.message, e.span, e.hint)
    return values
