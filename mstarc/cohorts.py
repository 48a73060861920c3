"""Cohort marks: which loops of a step program are steady-state "decode cohorts".

A helper of the `schedule` pass (not a pass itself): it reads one `loop` op of the step
program, in the plan's own JSON form (docs/plan-format.md), and says whether the runtime may
run it as a cohort, a batch whose per-request state stays on the device between
iterations. Working on the emitted op rather than the IR means the mark describes exactly
what the runtime will see, including `transfer` ops that `schedule` inserted.

A body of one call gives a single-call mark; a body of several calls (a *chain*: Qwen3-Omni's
thinker step and talker frame an iteration) gives `{"links": [mark, ...]}`, one single-call
mark per call in body order, each with `chained` when the call takes a result of an earlier
call of the same iteration. The single-call marks are the same bytes as before chains were
marked.

Requires: `loop` is a `loop` op as `schedule` builds it (`acc`, `index`, `dynamic`, `until`,
          `carry` and a `seq` body of `call` / `emit` / other ops with their plan fields; a
          call's `tag` is null exactly when its node is stateless).
          (The loop's index, where it has one, is an argument like an invariant one whose
          value counts the row's iterations from 0: the runtime keeps it as a column.)
Ensures:  `cohort_mark(loop)` is None when the loop does not qualify, else
          `{"call", "fed", "invariant", "emits"}` (and `"accs"` when the loop accumulates,
          `"index"` when the call takes the loop's index) for a body of one call, or
          `{"links": [...]}` of such marks (each with `"chained"` when it takes an earlier
          call's result) for a body of several, as the `schedule` pass documents (the rule
          is written out there, in its Ensures); `why_not(loop)` is None exactly when the
          loop qualifies, else the first rule it breaks, as a sentence. Both are pure and
          deterministic: `fed`, `invariant`, `index` and `chained` sorted by input port,
          `emits` and `accs` in body order.
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


class _Link:
    """One call of the body as the analysis collects it: its results and its emits and accs."""

    def __init__(self, call: Mapping[str, Any]):
        self.call = call
        self.results = {name: port for port, name in call["results"]}  # result name -> output port (last wins)
        self.emits: list[list[str]] = []
        self.accs: list[list[str]] = []


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
    links = [_Link(item) for item in items if item.get("op") == "call"]
    why = _chain_rule(links)
    if why:
        return None, why
    binder = {name: k for k, link in enumerate(links) for name in link.results}  # result name -> its link
    carry = set(loop.get("carry") or ())
    for item in before:
        why = _acc(item, links, binder, -1, carry, "in")
        if why:
            return None, why
    at = -1  # the link of the last call seen
    for item in items:
        kind = item.get("op")
        if kind == "call":
            at += 1
            continue
        if kind == "acc":
            why = _acc(item, links, binder, at, carry, "out")
            if why:
                return None, why
            continue
        if kind != "emit":
            calls = "its calls" if len(links) > 1 else "the call"
            return None, f"its body has a {kind} op besides {calls}, its emits and accs"
        if item.get("mode") != "append":
            return None, f"it sets output {item['output']} (only append-mode emits qualify)"
        value = item.get("value", {})
        k = binder.get(value.get("var"), len(links))
        if "var" not in value or k > at:
            return None, f"emit {item['output']} is not a result of {_calls(links[: at + 1])}"
        links[k].emits.append([item["output"], links[k].results[value["var"]]])
    args = {operand["var"] for link in links for operand in link.call["args"].values() if "var" in operand}
    first = links[0].call
    for t in transfers:
        if t.get("value") not in args or t.get("dst") != first["ranks"][0]:
            return None, f"its body moves {t.get('value')} to rank {t.get('dst')}, not an argument of {first['id']} there"
    names = [a[0] for link in links for a in link.accs]
    if sorted(names) != sorted(a["name"] for a in loop.get("acc") or ()) or len(set(names)) != len(names):
        return None, "its accumulations are not one acc op each in its body"
    marks = []
    for k in range(len(links)):
        mark, why = _link_mark(loop, links, binder, k, carry)
        if mark is None:
            return None, why
        marks.append(mark)
    if loop.get("dynamic") and loop.get("until") not in binder:
        return None, f"its flag {loop.get('until')} is not a result of {_calls(links)}"
    for link in links:
        result_ports = {port for port, _ in link.call["results"]}
        for feed in link.call.get("feeds") or ():
            if feed.get("port") not in result_ports:
                return None, f"{link.call['id']} feeds {feed.get('port')}, which is not one of its results"
    return (marks[0] if len(marks) == 1 else {"links": marks}), None


def _calls(links: list[_Link]) -> str:
    """The calls as a why-not sentence names them: `s3`, or `s3 or s4`."""
    return " or ".join(link.call["id"] for link in links) or "a call before it"


def _chain_rule(links: list[_Link]) -> str | None:
    """Why a body of several calls is no chain (None: one call, or a chain): every call is a
    kv node's (a call with a KV context: only such a node offers a column step), each on its
    own node (a row joins each node's columns once), on the ranks of the first, and no
    result name is bound by two calls."""
    if len(links) == 1:
        return None
    first = links[0].call
    seen: dict[str, str] = {}
    nodes: dict[str, str] = {}
    for link in links:
        call = link.call
        if call["node"] in nodes:
            return f"its calls {nodes[call['node']]} and {call['id']} are both on node {call['node']} (a chain's calls are on distinct nodes)"
        nodes[call["node"]] = call["id"]
        if call.get("tag") is None:
            return f"its call {call['id']} is {call['node']}.{call['phase']}, a stateless node's (a chain's calls are kv calls)"
        if list(call["ranks"]) != list(first["ranks"]):
            return f"its call {call['id']} runs on ranks {call['ranks']}, not on {first['id']}'s {first['ranks']}"
        for name in link.results:
            if name in seen:
                return f"its calls {seen[name]} and {call['id']} both bind {name}"
            seen[name] = call["id"]
    return None


def _link_mark(loop: Mapping[str, Any], links: list[_Link], binder: Mapping[str, int], k: int,
               carry: set[str]) -> tuple[Mark | None, str | None]:
    """Link k's mark: each argument a const or a var bound outside the body (invariant), the
    loop's index, a carried result of this call (fed back) or a result of an earlier call of
    the same iteration (chained)."""
    link = links[k]
    call = link.call
    fed: list[list[str]] = []
    invariant: list[str] = []
    index: list[str] = []
    chained: list[list[Any]] = []
    for port, operand in sorted(call["args"].items()):
        var = operand.get("var")
        at = binder.get(var) if var is not None else None
        if var is None:
            invariant.append(port)
        elif loop.get("index") is not None and var == loop["index"]:
            index.append(port)  # the row's iteration count: a column the runtime counts up
        elif at is None:  # the calls are the only binders in such a body
            invariant.append(port)
        elif at < k:  # this iteration's result of an earlier call: passed on the device
            chained.append([port, at, links[at].results[var]])
        elif var not in carry:
            return None, f"argument {port}={var} is rebound in the body but not carried"
        elif at == k:
            fed.append([port, link.results[var]])
        else:
            return None, (f"argument {port}={var} of {call['id']} is fed back from {links[at].call['id']}, "
                          "a later call (a chain feeds a call back only its own results)")
    mark: Mark = {"call": call["id"], "fed": fed, "invariant": invariant, "emits": link.emits}
    if link.accs:  # only then: the marks of loops without accs keep their bytes
        mark["accs"] = link.accs
    if index:  # likewise
        mark["index"] = index
    if chained:  # only in a chain's links
        mark["chained"] = chained
    return mark, None


def _acc(item: Mapping[str, Any], links: list[_Link], binder: Mapping[str, int], at: int, carry: set[str],
         what: str) -> str | None:
    """Append an acc op's `[name, output port, when]` to the accs of the link whose result
    it accumulates, or say why it does not qualify. `at`: the link of the last call before
    the acc (-1: none). "out": a result of that call or an earlier one, this iteration's;
    "in": the value a carried result has as the iteration starts (the loop's first value,
    then the previous iteration's), a result of a call at or after the acc."""
    value = item.get("value", {})
    var = value.get("var")
    k = binder.get(var) if var is not None else None
    if k is not None and k <= at:
        links[k].accs.append([item["name"], links[k].results[var], "out"])
        return None
    if k is not None and var in carry:
        links[k].accs.append([item["name"], links[k].results[var], "in"])
        return None
    kind = "carried result" if what == "in" else "result"
    call = "the loop's call" if len(links) == 1 else "a call of the loop"
    return f"acc {item.get('name')} accumulates {var or 'a constant'}, not a {kind} of {call}"
