"""The `serves` declarations of the walks: checked against the routes' slots, and written
into the plan (`walks[w].routes`).

The routes, their slots and the rule that a walk's input or output fits a slot are the
runtime's (`mstar_runtime.plan.routes`): the server applies the same rule when it loads a
plan, so a plan the compiler accepts is one the server serves. Here each problem becomes a
diagnostic at the declaration: E080 an unknown route, E081 a bad binding (a slot the route
does not have, given twice or positionally, a value that is neither a name nor a string, a
name the walk does not have, a required slot left unbound), E082 an input or output whose
type (or mode) does not fit its slot, E083 a route declared twice by one walk, or served by
two walks where a request could not tell which one answers it.
"""

from __future__ import annotations

from typing import Any

from mstar_runtime.plan import routes as R
from mstarc import ir as I
from mstarc.diagnostics import DiagnosticSink, Span

_CODES = {"route": "E080", "bind": "E081", "type": "E082"}


def emit_modes(walk: I.WalkIR) -> dict[str, str]:
    """Each output's mode, from its first emit in pre-order ("set" when it has none)."""
    modes: dict[str, str] = {}
    for r in I.iter_regions(walk.body):
        if isinstance(r, I.Emit) and r.output not in modes:
            modes[r.output] = "append" if r.op == "+=" else "set"
    return modes


def program_view(walk: I.WalkIR) -> dict[str, Any]:
    """The walk's typed inputs and outputs as the plan writes them (what `R.resolve` reads)."""
    modes = emit_modes(walk)
    return {"inputs": [{"name": p.name, "type": p.type.to_json()} for p in walk.inputs],
            "outputs": [{"name": p.name, "type": p.type.to_json(), "mode": modes.get(p.name, "set")}
                        for p in walk.outputs]}


def routes_json(walk: I.WalkIR) -> list[dict[str, Any]]:
    """`walks[w].routes` of the plan: each declaration's route and the slots it binds, in source order."""
    return [{"route": r.route, "bind": dict(sorted(r.bind().items()))} for r in walk.routes]


def check_routes(model: I.ModelIR, sink: DiagnosticSink) -> None:
    """Every walk's `serves` declarations (the module docstring lists the diagnostics)."""
    served: list[tuple[R.Served, I.RouteIR]] = []
    for walk in model.walks.values():
        view = program_view(walk)
        seen: set[str] = set()
        for r in walk.routes:
            if r.route in seen:
                sink.error("E083", f"walk '{walk.name}' declares route '{r.route}' twice", r.name_span,
                           "declare each route once, with all of its slots")
                continue
            seen.add(r.route)
            if not _args_ok(walk, r, sink):
                continue
            s, problems = R.resolve(walk.name, view, {"route": r.route, "bind": r.bind()})
            for slot, kind, message in problems:
                span = _slot_span(r, slot)
                hint = None if kind == "route" else "docs/walk-language.md lists each route's slots"
                sink.error(_CODES[kind], f"walk '{walk.name}' cannot serve {r.route}: {message}", span, hint)
            if s is not None:
                served.append((s, r))
    spans = {id(s): r for s, r in served}
    for s, message in R.conflicts([s for s, _ in served], lambda s: "image" in s.slots):
        sink.error("E083", f"walk '{s.walk}' cannot serve {s.route}: {message}", spans[id(s)].name_span,
                   "serve the route from one walk, or give the walks different slots")


def _args_ok(walk: I.WalkIR, r: I.RouteIR, sink: DiagnosticSink) -> bool:
    """The arguments' form: each `slot = name` (or `= "string"` for a string slot), once."""
    route = R.ROUTES.get(r.route)
    ok, seen = True, set()
    for a in r.args:
        slot = route.slot(a.slot) if route is not None and a.slot is not None else None
        if a.slot is None:
            sink.error("E081", f"walk '{walk.name}': a route's arguments are `slot = name`; this one has no slot",
                       a.span, _slots_hint(route))
        elif a.slot in seen:
            sink.error("E081", f"walk '{walk.name}' binds slot '{a.slot}' of {r.route} twice", a.span)
        elif a.value is None:
            sink.error("E081", f"walk '{walk.name}': slot '{a.slot}' of {r.route} takes the name of an input or "
                               "output of the walk (or a string for a string slot)", a.span)
        elif slot is not None and (slot.side == "string") != a.literal:
            want = "a string" if slot.side == "string" else f"the name of an {slot.side} of the walk"
            sink.error("E081", f"walk '{walk.name}': slot '{a.slot}' of {r.route} takes {want}", a.span)
        else:
            seen.add(a.slot)
            continue
        ok = False
    return ok


def _slots_hint(route: R.Route | None) -> str | None:
    return f"its slots: {', '.join(s.name for s in route.slots)}" if route is not None else None


def _slot_span(r: I.RouteIR, slot: str) -> Span:
    """Where a slot's problem is shown: its `slot = value` when written, else the route's name."""
    return next((a.span for a in r.args if a.slot == slot), r.name_span) if slot else r.name_span


__all__ = ["check_routes", "emit_modes", "program_view", "routes_json"]
