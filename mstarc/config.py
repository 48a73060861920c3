"""Config variants: resolve `extends`, evaluate setting expressions, read checkpoint configs.

A variant's settings are expressions over other settings of the same (resolved) variant.
`evaluate` is also used for node settings, `arch` arguments, port dims and walk defaults.
Evaluation errors are diagnostics (E020 bad value, E021 cycle, E022 checkpoint reference,
E025 a value out of range).

Values stay representable: every integer result fits in signed 64 bits, every float result is
finite (no inf or nan, also not by overflow), and a `ValueBudget` caps the items (string
characters, list elements through nested lists) that one compilation evaluates, so that a
setting doubling a list or string cannot run away (mstarc/limits.py). Settings are evaluated
in dependency order found by an explicit-stack search, not by recursion through references,
so a long chain of settings that refer to each other needs no deep Python stack.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from mstarc import ast, limits
from mstarc.diagnostics import CompileError, DiagnosticSink, Span, spell_cycle
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
    try:
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
    except OverflowError:  # a float result beyond the float range
        raise EvalError("E025", f"the result of '{op}' is out of the float range", span) from None


def check_number(v: ConfigValue, span: Span, what: str = "value") -> None:
    """E025 for an integer beyond signed 64 bits or a float that is not finite."""
    if isinstance(v, bool):
        return
    if isinstance(v, int) and not limits.int_fits(v):
        shown = str(v) if v.bit_length() < 256 else f"of {v.bit_length()} bits"
        raise EvalError("E025", f"{what} {shown} does not fit in 64 bits", span,
                        f"integers are signed 64-bit: {limits.INT_MIN} to {limits.INT_MAX}")
    if isinstance(v, float) and not limits.float_fits(v):
        raise EvalError("E025", f"{what} is {v}, not a finite number", span,
                        "inf and nan cannot be written, computed or read from a checkpoint config")


class ValueBudget:
    """The items (string characters; list elements, counted through nested lists) of the values
    one compilation evaluates, in all: E025 beyond `cap`. Charged for every string or list an
    expression builds and for every evaluated string or list value, so that the work spent on
    values, and the size of the plan that records them, stay bounded."""

    def __init__(self, cap: int = limits.MAX_VALUE_ITEMS):
        self.cap, self.used = cap, 0
        self._sizes: dict[int, tuple[list, int]] = {}  # id -> (the list, kept alive; its size)

    def size(self, v: object) -> int:
        """Items of a value: 1 for a scalar, its length for a string, 1 + its items' for a list
        (each distinct list counted once, by an explicit stack; stops counting past the cap)."""
        if isinstance(v, str):
            return len(v)
        if not isinstance(v, list):
            return 1
        memo = self._sizes
        if id(v) in memo:
            return memo[id(v)][1]
        stop = self.cap + 1
        stack: list[list] = [[v, 0, 1]]  # [list, index of the next item, size so far]
        while stack:
            frame = stack[-1]
            lst = frame[0]
            descended = False
            while frame[1] < len(lst) and frame[2] <= stop:
                item = lst[frame[1]]
                if isinstance(item, list):
                    hit = memo.get(id(item))
                    if hit is None or hit[0] is not item:  # count it first, then come back to it
                        stack.append([item, 0, 1])
                        descended = True
                        break
                    frame[2] += hit[1]
                else:
                    frame[2] += len(item) if isinstance(item, str) else 1
                frame[1] += 1
            if not descended:
                memo[id(lst)] = (lst, min(frame[2], stop))
                stack.pop()
        return memo[id(v)][1]

    def charge(self, v: object, span: Span) -> None:
        if not isinstance(v, str | list):
            return
        self.used += self.size(v)
        if self.used > self.cap:
            raise EvalError("E025", f"values are too large: more than {self.cap} items (string characters and "
                            "list elements) in all", span,
                            "a config value that grows by joining itself doubles at every step; build smaller values")


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
                text = limits.read_text_capped(path, str(path), limits.MAX_JSON_BYTES)
                self._cache[file] = json.loads(text)
            except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSON errors are ValueErrors
                reason = "it nests too deeply" if isinstance(e, RecursionError) else e
                raise EvalError("E022", f"cannot read checkpoint config '{path}': {reason}", span) from None
            except CompileError as e:  # over the size cap
                raise EvalError("E022", f"cannot read checkpoint config '{path}': {e.diagnostics[0].message}",
                                span) from None
        node: object = self._cache[file]
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise EvalError("E022", f"checkpoint config '{file}' has no key '{key}'", span,
                                "check the key path against the checkpoint's config file")
            node = node[part]
        if not isinstance(node, int | float | str | bool | list):
            raise EvalError("E022", f"checkpoint config '{file}' key '{key}' is not a number, string or list", span)
        _check_numbers(node, span, f"checkpoint config '{file}' key '{key}'")
        return node


def _check_numbers(value: object, span: Span, where: str) -> None:
    """`check_number` for every number in a JSON value (explicit stack: JSON may nest deeply)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, int | float):
            check_number(v, span, f"a number of {where}" if v is not value else where)


def evaluate(expr: ast.Expr, lookup: Callable[[str, Span], ConfigValue],
             checkpoint: CheckpointConfig | None = None, budget: ValueBudget | None = None) -> ConfigValue:
    """Evaluate a config expression; `lookup` resolves names (raising EvalError when unknown).

    Recursive in the expression only: its depth is bounded by the parser (limits.MAX_EXPR_DEPTH).
    Every string or list built is charged to `budget` (a fresh one when None)."""
    return _eval(expr, lookup, checkpoint, budget if budget is not None else ValueBudget())


def _eval(expr: ast.Expr, lookup, checkpoint: CheckpointConfig | None, budget: ValueBudget) -> ConfigValue:
    if isinstance(expr, ast.IntLit | ast.FloatLit | ast.StrLit | ast.BoolLit):
        check_number(expr.value, expr.span, "integer" if isinstance(expr, ast.IntLit) else "float")
        budget.charge(expr.value, expr.span)
        return expr.value
    if isinstance(expr, ast.NameRef):
        return lookup(expr.name, expr.span)
    if isinstance(expr, ast.ListLit):
        out = [_eval(i, lookup, checkpoint, budget) for i in expr.items]
        budget.charge(out, expr.span)
        return out
    if isinstance(expr, ast.Neg):
        v = _eval(expr.operand, lookup, checkpoint, budget)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise EvalError("E020", f"cannot negate a {type(v).__name__}", expr.span)
        check_number(-v, expr.span, "the result")
        return -v
    if isinstance(expr, ast.BinOp):
        left = _eval(expr.left, lookup, checkpoint, budget)
        right = _eval(expr.right, lookup, checkpoint, budget)
        if isinstance(left, str | list) and isinstance(right, type(left)):  # charged before it is built
            budget.charge(left, expr.span)
            budget.charge(right, expr.span)
        v = _arith(expr.op, left, right, expr.span)
        check_number(v, expr.span, "the result")
        return v
    if isinstance(expr, ast.FunCall):
        v = _funcall(expr, lookup, checkpoint, budget)
        budget.charge(v, expr.span)
        return v
    raise EvalError("E020", "cannot evaluate this expression", getattr(expr, "span", Span.unknown()))


def _funcall(call: ast.FunCall, lookup, checkpoint: CheckpointConfig | None, budget: ValueBudget) -> ConfigValue:
    name = call.name.name
    if name != "from_checkpoint":
        raise EvalError("E020", f"unknown function '{name}'", call.name.span,
                        "the only function in config expressions is from_checkpoint(file, key, default)")
    values = [_eval(a.value, lookup, checkpoint, budget) for a in call.args]
    if any(a.name is not None for a in call.args) or not 2 <= len(values) <= 3 or \
            not all(isinstance(v, str) for v in values[:2]):
        raise EvalError("E020", "from_checkpoint takes (file: string, key: string[, default])", call.span)
    default = values[2] if len(values) == 3 else None
    return (checkpoint or CheckpointConfig(None)).lookup(values[0], values[1], default, call.span)


def references(expr: ast.Expr) -> list[ast.NameRef]:
    """The names an expression mentions, left to right (explicit stack)."""
    out: list[ast.NameRef] = []
    stack: list[object] = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, ast.NameRef):
            out.append(e)
        elif isinstance(e, ast.BinOp):
            stack += (e.right, e.left)
        elif isinstance(e, ast.Neg):
            stack.append(e.operand)
        elif isinstance(e, ast.ListLit):
            stack.extend(reversed(e.items))
        elif isinstance(e, ast.FunCall):
            stack.extend(a.value for a in reversed(e.args))
    return out


def resolve_variant(model: ast.Model, variant: str, checkpoint: CheckpointConfig,
                    sink: DiagnosticSink, budget: ValueBudget | None = None) -> dict[str, ConfigValue] | None:
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
    in_chain: set[str] = set()  # by name, which is unique here: comparing variants would be deep
    cur: ast.Variant | None = by_name[variant]
    while cur is not None:
        if cur.name.name in in_chain:
            sink.error("E021", f"variant '{cur.name.name}' extends itself through a cycle", cur.name.span)
            return None
        chain.append(cur)
        in_chain.add(cur.name.name)
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
    return _evaluate_settings(exprs, checkpoint, sink, budget if budget is not None else ValueBudget())


def _evaluate_settings(exprs: Mapping[str, ast.Setting], checkpoint: CheckpointConfig,
                       sink: DiagnosticSink, budget: ValueBudget) -> dict[str, ConfigValue]:
    """Evaluate the settings in dependency order (each after the settings it mentions).

    The order is a depth-first search from each setting in source order, references left to
    right, with an explicit stack; a reference back into the search path is a cycle (E021,
    spelled out along the path). A setting that fails, or depends on one that failed, has no
    value; only the first failure is reported, at its own position."""
    values: dict[str, ConfigValue] = {}
    failed: set[str] = set()
    reported: set[tuple[str, str, Span]] = set()

    def report(e: EvalError) -> None:
        key = (e.code, e.message, e.span)
        if e.message and key not in reported:  # a shared bad dependency is reported once
            reported.add(key)
            sink.error(e.code, e.message, e.span, e.hint)

    done: set[str] = set()
    order: list[str] = []
    for root in exprs:  # source order, so the first diagnostic is the first in the file
        if root in done:
            continue
        path: list[str] = [root]
        on_path: dict[str, int] = {root: 0}  # name -> its index in `path`
        stack = [iter(references(exprs[root].value))]
        while stack:
            for ref in stack[-1]:
                name = ref.name
                if name not in exprs or name in done:
                    continue
                if name in on_path:
                    if name not in failed:  # a cycle through a value already in one is not reported again
                        cycle = path[on_path[name]:]
                        report(EvalError("E021", "config values refer to each other in a cycle: "
                                         + spell_cycle(cycle + [name]), ref.span))
                        failed.update(cycle)
                    continue
                on_path[name] = len(path)
                path.append(name)
                stack.append(iter(references(exprs[name].value)))
                break
            else:
                stack.pop()
                name = path.pop()
                del on_path[name]
                done.add(name)
                order.append(name)

    def lookup(name: str, span: Span) -> ConfigValue:
        if name in values:
            return values[name]
        if name not in exprs:
            raise EvalError("E011", f"unknown config value '{name}'", span)
        raise EvalError("E020", "", span)  # failed (already reported; suppressed in report)

    for name in order:
        if name in failed:
            continue
        try:
            value = evaluate(exprs[name].value, lookup, checkpoint, budget)
            budget.charge(value, exprs[name].value.span)
            values[name] = value
        except EvalError as e:
            failed.add(name)
            report(e)
    return values  # in evaluation order, as a recursive evaluation would have filled it
