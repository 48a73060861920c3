"""Cohort marks: which loops of a step program are steady-state "decode cohorts".

A helper of the `schedule` pass (not a pass itself): it reads one `loop` op of the step
program, in the plan's own JSON form (docs/plan-format.md), and says whether the runtime may
run it as a cohort, a batch whose per-request state stays on the device between
iterations. Working on the emitted op rather than the IR means the mark describes exactly
what the runtime will see, including `transfer` ops that `schedule` inserted.

Requires: `loop` is a `loop` op as `schedule` builds it (`acc`, `index`, `dynamic`, `until`,
          `carry` and a `seq` body of `call` / `emit` / other ops with their plan fields).
Ensures:  `cohort_mark(loop)` is None when the loop does not qualify, else
          `{"call", "fed", "invariant", "emits"}` as the `schedule` pass documents (the rule
          is written out there, in its Ensures); `why_not(loop)` is None exactly when the
          loop qualifies, else the first rule it breaks, as a sentence. Both are pure and
          deterministic: `fed` and `invariant` sorted by input port, `emits` in body order.
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
    if loop.get("acc"):
        return None, "it accumulates values (acc " + ", ".join(a["name"] for a in loop["acc"]) + ")"
    if loop.get("index") is not None:
        return None, f"it binds an index ({loop['index']})"
    body = loop.get("body") or {}
    ops = (body.get("body") if body.get("op") == "seq" else None) or []
    # value transfers that `schedule` placed before the call (a carried value first bound elsewhere)
    lead = next((i for i, item in enumerate(ops) if item.get("op") != "transfer"), len(ops))
    transfers, items = ops[:lead], ops[lead:]
    if not items or items[0].get("op") != "call":
        first = items[0].get("op") if items else "nothing"
        return None, f"its body does not start with a call (it starts with {first})"
    call = items[0]
    results = {name: port for port, name in call["results"]}  # result name -> output port (last wins)
    emits: list[list[str]] = []
    for item in items[1:]:
        kind = item.get("op")
        if kind == "call":
            return None, f"its body has a second call ({item['id']})"
        if kind != "emit":
            return None, f"its body has a {kind} op besides the call and its emits"
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
    if call.get("reads"):
        return None, f"{call['id']} reads other KV contexts"
    carry = set(loop.get("carry") or ())
    fed: list[list[str]] = []
    invariant: list[str] = []
    for port, operand in sorted(call["args"].items()):
        if "var" not in operand:
            invariant.append(port)
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
    return {"call": call["id"], "fed": fed, "invariant": invariant, "emits": emits}, None
