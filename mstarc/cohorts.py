"""Cohort marks: which loops of a step program are steady-state "decode cohorts".

A helper of the `schedule` pass (not a pass itself): it reads one `loop` op of the step
program, in the plan's own JSON form (docs/plan-format.md), and says whether the runtime may
run it as a cohort, a batch whose per-request state stays on the device between
iterations. Working on the emitted op rather than the IR means the mark describes exactly
what the runtime will see, including `transfer` ops that `schedule` inserted.

Requires: `loop` is a `loop` op as `schedule` builds it (`acc`, `index`, `dynamic`, `until`,
          `carry` and a `seq` body of `call` / `emit` / other ops with their plan fields).
          (The loop's index, where it has one, is an argument like an invariant one whose
          value counts the row's iterations from 0: the runtime keeps it as a column.)
Ensures:  `cohort_mark(loop)` is None when the loop does not qualify, else
          `{"call", "fed", "invariant", "emits"}` (and `"accs"` when the loop accumulates,
          `"index"` when the call takes the loop's index)
          as the `schedule` pass documents (the rule is written out there, in its Ensures);
          `why_not(loop)` is None exactly when the loop qualifies, else the first rule it
          breaks, as a sentence. Both are pure and deterministic: `fed` and `invariant`
          sorted by input port, `emits` and `accs` in body order.
Fails when: never (a loop that does not fit the rule is simply not marked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Mark = dict[str, Any]


def cohort_mark(loop: Mapping[str, Any]) -> Mark | None:
    """The loop's cohort mark, or None when it does not qualify."""
    return _analyse(loop)[0]


def why_not(loop: Mapping[str, Any]) -> str | None:
    """None when the loop qualifies as a cohort, else the first rule it breaks."""
    return _analyse(loop)[1]


def _analyse(loop: Mapping[str, Any]) -> tuple[Mark | None, str | None]:
    body = loop.get("body") or {}
    ops = (body.get("body") if body.get("op") == "seq" else None) or []
    # value transfers that `schedule` placed before the call (a carried value first bound
    # elsewhere), and accumulations of the values the iteration starts with
    lead = next((i for i, item in enumerate(ops) if item.get("op") != "transfer"), len(ops))
    transfers, rest = ops[:lead], ops[lead:]
    first_call = next((i for i, item in enumerate(rest) if item.get("op") != "acc"), len(rest))
    before, items = rest[:first_call], rest[first_call:]
    if not items or items[0].get("op") != "call":
        first = items[0].get("op") if items else "nothing"
        return None, f"its body does not start with a call (it starts with {first})"
    call = items[0]
    results = {name: port for port, name in call["results"]}  # result name -> output port (last wins)
    carry = set(loop.get("carry") or ())
    emits: list[list[str]] = []
    accs: list[list[str]] = []
    for item in before:
        why = _acc(item, results, carry, accs, "in")
        if why:
            return None, why
    for item in items[1:]:
        kind = item.get("op")
        if kind == "call":
            return None, f"its body has a second call ({item['id']})"
        if kind == "acc":
            why = _acc(item, results, set(results), accs, "out")
            if why:
                return None, why
            continue
        if kind != "emit":
            return None, f"its body has a {kind} op besides the call, its emits and accs"
        if item.get("mode") != "append":
            return None, f"it sets output {item['output']} (only append-mode emits qualify)"
        value = item.get("value", {})
        if "var" not in value or value["var"] not in results:
            return None, f"emit {item['output']} is not a result of {call['id']}"
        emits.append([item["output"], results[value["var"]]])
    args = {operand["var"] for operand in call["args"].values() if "var" in operand}
    for t in transfers:
        if t.get("value") not in args or t.get("dst") != call["ranks"][0]:
            return None, f"its body moves {t.get('value')} to rank {t.get('dst')}, not an argument of {call['id']} there"
    names = [a[0] for a in accs]
    if sorted(names) != sorted(a["name"] for a in loop.get("acc") or ()) or len(set(names)) != len(names):
        return None, "its accumulations are not one acc op each in its body"
    fed: list[list[str]] = []
    invariant: list[str] = []
    index: list[str] = []
    for port, operand in sorted(call["args"].items()):
        if "var" not in operand:
            invariant.append(port)
        elif loop.get("index") is not None and operand["var"] == loop["index"]:
            index.append(port)  # the row's iteration count: a column the runtime counts up
        elif operand["var"] not in results:  # the call is the only binder in such a body
            invariant.append(port)
        elif operand["var"] in carry:
            fed.append([port, results[operand["var"]]])
        else:
            return None, f"argument {port}={operand['var']} is rebound in the body but not carried"
    if loop.get("dynamic") and loop.get("until") not in results:
        return None, f"its flag {loop.get('until')} is not a result of {call['id']}"
    result_ports = {port for port, _ in call["results"]}
    for feed in call.get("feeds") or ():
        if feed.get("port") not in result_ports:
            return None, f"{call['id']} feeds {feed.get('port')}, which is not one of its results"
    mark: Mark = {"call": call["id"], "fed": fed, "invariant": invariant, "emits": emits}
    if accs:  # only then: the marks of loops without accs keep their bytes
        mark["accs"] = accs
    if index:  # likewise
        mark["index"] = index
    return mark, None


def _acc(item: Mapping[str, Any], results: Mapping[str, str], allowed: set[str], accs: list[list[str]],
         when: str) -> str | None:
    """Append an acc op's `[name, output port, when]` to `accs`, or say why it does not
    qualify. "in" (before the call): the value a carried result has as the iteration starts
    (the loop's first value, then the previous iteration's); "out" (after it): the call's."""
    value = item.get("value", {})
    var = value.get("var")
    if var not in results or var not in allowed:
        what = "carried result" if when == "in" else "result"
        return f"acc {item.get('name')} accumulates {var or 'a constant'}, not a {what} of the loop's call"
    accs.append([item["name"], results[var], when])
    return None
