"""`mstarc explain`: a plan body rendered for humans (text, markdown, graphviz dot) or as JSON.

The view is built in Python (`plan_view`) and rendered by jinja2 templates in
`mstarc/templates/`; the templates only lay out what the view holds, so every format shows
the same facts: per rank its device, nodes, weights and KV bytes, TP degree, captured CUDA
graphs with their batch buckets, and stream buffers with their policies; for a placement
with hosts, each host's ranks and every transfer between hosts with the bytes it carries
per step; then each walk's step program as an indented tree (a loop marked as a cohort
says so, with its fed-back ports; any other loop says why it runs iteration by iteration:
the first cohort rule it breaks, `mstarc.cohorts.why_not`).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import jinja2

from mstar_runtime import sizes, untrusted
from mstar_runtime.plan.routes import ROUTES
from mstarc.cohorts import why_not
from mstarc.lower import POLICY_OPTIONAL, POLICY_PARAMS


def human_bytes(n: int | float | None) -> str:
    """A size as explain shows it: two decimals (`80.00 GiB`), `-` where it is not known."""
    return "-" if n is None else sizes.human_bytes(n, digits=2)


def carried(nbytes: int | None, per: list[str]) -> str:
    """What one copy of a transfer carries: `4.00 KiB`, `4 B x K`, `56.00 KiB per token`."""
    if nbytes is None:
        return "size not known from the types"
    if per == ["token"]:
        return f"{human_bytes(nbytes)} per token"
    return " x ".join([human_bytes(nbytes), *per])


def _operand(op: dict[str, Any]) -> str:
    return op["var"] if "var" in op else json.dumps(op["const"])


def program_lines(op: dict[str, Any], depth: int = 0) -> list[tuple[int, str]]:
    """A step program as (depth, text) lines, one per op."""
    kind = op["op"]
    if kind == "seq":
        return [line for child in op["body"] for line in program_lines(child, depth)]
    if kind == "call":
        lhs = ", ".join(name for _, name in op["results"])
        args = ", ".join(f"{k}={_operand(v)}" for k, v in op["args"].items())
        tag = f" @{op['tag']}" if op.get("tag") else ""
        ranks = ",".join(str(r) for r in op["ranks"])
        extras = [f"rank {ranks}"] + ([f"graph {op['graph']}"] if op.get("graph") else [])
        extras += [f"feeds {f['stream'].split(':', 1)[1]}" for f in op.get("feeds", [])]
        extras += [f"reads {r['node']}@{r['tag']}" for r in op.get("reads", [])]
        return [(depth, f"{lhs + ' = ' if lhs else ''}{op['node']}.{op['phase']}({args}){tag}   [{'; '.join(extras)}]")]
    if kind == "loop":
        if op["dynamic"]:
            head = f"dynamic_loop max={op['max']} until {op['until']}"
        else:
            head = f"loop n={_operand(op['count']) if op['count'] else '?'}" + (f" max={op['max']}" if op["max"] else "")
        head += f" index {op['index']}" if op.get("index") else ""
        head += f" carry {', '.join(op['carry'])}" if op.get("carry") else ""
        notes = [f"captured whole: {op['graph']}"] if op.get("graph") else []
        notes.append(_cohort(op["cohort"]) if op.get("cohort") else _not_cohort(op))
        head += f"   [{'; '.join(notes)}]" if notes else ""
        return [(depth, head)] + program_lines(op["body"], depth + 1)
    if kind == "parallel":
        lines = [(depth, "parallel")]
        for b in op["branches"]:
            rank = f"   [rank {b['rank']}]" if b.get("rank") is not None else ""
            lines.append((depth + 1, f"branch {b['name']}{rank}"))
            lines += program_lines(b["body"], depth + 2)
        return lines
    if kind == "on_stream":
        carry = f" carry {', '.join(op['carry'])}" if "carry" in op else ""
        head = f"on stream {op['stream'].split(':', 1)[1]} as {op['as']}{carry}"
        return [(depth, head)] + program_lines(op["body"], depth + 1)
    if kind == "emit":
        return [(depth, f"emit {op['output']} {'+=' if op['mode'] == 'append' else '='} {_operand(op['value'])}")]
    if kind == "acc":
        return [(depth, f"acc {op['name']} += {_operand(op['value'])}")]
    if kind == "fork":
        return [(depth, f"fork {op['node']} @{op['src']} -> @{op['dst']}")]
    if kind == "transfer":
        return [(depth, f"transfer {op['value']}: rank {op['src']} -> rank {op['dst']}")]
    return [(depth, f"<{kind}>")]


def _cohort(mark: dict[str, Any]) -> str:
    """A loop's cohort mark in one phrase: `cohort: fed token<-token, invariant actions,
    index index, acc fed<-token (in)`; a chain's links each so, after its call's id, with
    the inputs it takes from an earlier link: `cohort chain: s7 fed token<-token | s8 fed
    none, chained text<-s7.item`."""
    if "links" not in mark:
        return f"cohort: {_link(mark)}"
    ids = [link["call"] for link in mark["links"]]
    return "cohort chain: " + " | ".join(f"{link['call']} {_link(link, ids)}" for link in mark["links"])


def _not_cohort(loop: dict[str, Any]) -> str:
    """Why an unmarked loop runs on the generic (per-iteration) path: the first cohort rule
    it breaks; a loop that breaks none was marked by no compiler (a 1.0 plan's loops)."""
    why = why_not(loop)
    return f"not a cohort: {why}" if why else "not a cohort: not marked (a plan from before schema 1.1)"


def _link(mark: dict[str, Any], ids: list[str] | None = None) -> str:
    """One call's part of a cohort mark (`ids`: the calls of its chain, which `chained` refers to)."""
    fed = ", ".join(f"{dst}<-{src}" for dst, src in mark["fed"]) or "none"
    invariant = f", invariant {', '.join(mark['invariant'])}" if mark["invariant"] else ""
    accs = ", ".join(f"{name}<-{port} ({when})" for name, port, when in mark.get("accs") or ())
    index = f", index {', '.join(mark['index'])}" if mark.get("index") else ""
    chained = ", ".join(f"{dst}<-{(ids or [])[at]}.{src}" for dst, at, src in mark.get("chained") or ())
    return f"fed {fed}{invariant}{index}" + (f", acc {accs}" if accs else "") + (f", chained {chained}" if chained else "")


def plan_view(plan: dict[str, Any]) -> dict[str, Any]:
    nodes = plan["nodes"]
    mem_by_rank = {m["rank"]: m for m in plan["memory"]["ranks"]}
    # grouped once, not searched per rank: a plan may have up to 1024 ranks
    resident_by_rank: dict[int, list[str]] = {}
    for x in plan["placement"]["resident"]:
        resident_by_rank.setdefault(x["rank"], x["nodes"])
    graphs_by_rank: dict[int, list[dict[str, Any]]] = {}
    for g in plan["cuda_graphs"]:
        graphs_by_rank.setdefault(g["rank"], []).append(g)
    streams_by_rank: dict[int, list[dict[str, Any]]] = {}
    for s in plan["streams"]:
        streams_by_rank.setdefault(s["consumer_rank"], []).append(s)
    hosts = plan["placement"].get("hosts", [])  # absent unless the placement names hosts
    host_of = {r: h["host"] for h in hosts for r in h["ranks"]}
    where: dict[str, list[int]] = {}  # node -> the ranks it is resident on, in rank order
    ranks = []
    for dev in plan["placement"]["ranks"]:
        r = dev["rank"]
        mem = mem_by_rank.get(r, {})
        resident = resident_by_rank.get(r, [])
        kv_by_node: dict[str, dict[str, Any]] = {}
        for k in mem.get("kv", []):
            kv_by_node.setdefault(k["node"], k)
        node_rows = []
        for name in resident:
            where.setdefault(name, []).append(r)
            n = nodes[name]
            shard = n.get("shard") or {}
            kv = kv_by_node.get(name)
            node_rows.append({
                "name": name, "engine": n["engine"], "impl": n["impl"], "tp": shard.get("tp", 1),
                "params": n["arch"]["params"] if n["arch"] else 0,
                "weights": human_bytes(mem.get("node_weights", {}).get(name))
                + (" (fp8)" if n.get("quantized") else ""),
                "kv_per_token": human_bytes(kv["bytes_per_token"]) if kv else "-",
                "kv_tokens": kv["tokens"] if kv else None, "kv_pages": kv["pages"] if kv else None,
                "tags": ", ".join(t + (f" (max_len {n['tag_max_len'][t]})" if t in n.get("tag_max_len", {}) else "")
                                  for t in n["tags"]) if n["engine"] == "kv" else "",
            })
        ranks.append({
            "rank": r, "host": host_of.get(r), "device": dev["type"] if dev["name"] == dev["type"] else f"{dev['type']} {dev['name']}", "capacity": human_bytes(dev["memory_bytes"]),
            "weights": human_bytes(mem.get("weights_bytes")),
            "kv_pool": human_bytes(sum(k["bytes"] for k in mem.get("kv", []))),
            "graph_pool": human_bytes(mem.get("graph_pool_bytes")), "workspace": human_bytes(mem.get("workspace_bytes")),
            "nodes": node_rows,
            "graphs": [{"key": g["key"], "kind": g["kind"], "buckets": ", ".join(str(b) for b in g["buckets"])}
                       for g in graphs_by_rank.get(r, [])],
            "streams": [{"id": s["id"], "policy": _policy(s["policy"]), "capacity": s["capacity"],
                         "route": f"rank {s['producer_rank']} -> rank {s['consumer_rank']}"}
                        for s in streams_by_rank.get(r, [])],
        })
    walks = []
    for name, w in sorted(plan["walks"].items()):
        sig_in = ", ".join(f"{p['name']}: {_type(p['type'])}" + (f" = {json.dumps(p['default'])}" if p["default"] is not None else "")
                           + (" (streamed)" if p.get("stream") else "") for p in w["inputs"])
        sig_out = ", ".join(f"{p['name']}: {_type(p['type'])}" for p in w["outputs"])
        serves = [_serves(r) for r in w.get("routes", [])]
        walks.append({"name": name, "signature": f"({sig_in}) -> ({sig_out})", "lines": program_lines(w["program"], 1),
                      "serves": ", ".join(serves)})
    # `pairs`: (src rank, dst rank) of every pair of the two nodes' instances (the dot graph's arrows)
    edges = [{"id": e["id"], "src": e["src"], "dst": e["dst"], "policy": _policy(e["policy"]) if e["policy"] else None,
              "pairs": [(a, b) for a in where.get(e["src"][0], []) for b in where.get(e["dst"][0], [])]}
             for e in plan["edges"]]
    cross_host = [{"walk": x["walk"], "value": x["value"], "kind": x["kind"],
                   "route": f"rank {x['src_rank']} (host {x['src_host']}) -> rank {x['dst_rank']} (host {x['dst_host']})",
                   "steps": f"{x['producer_step']} -> {x['consumer_step']}", "carries": carried(x["bytes"], x["per"])}
                  for x in plan["placement"].get("cross_host", [])]
    return {"model": plan["model"], "weights": plan["weights"], "ranks": ranks, "walks": walks, "edges": edges,
            "hosts": [{"host": h["host"], "ranks": ", ".join(str(r) for r in h["ranks"])} for h in hosts],
            "cross_host": cross_host,
            "transitions": plan["transitions"], "placement": plan["placement"].get("name", ""),
            "schema": f"{plan['schema']['major']}.{plan['schema']['minor']}"
                      + (f" (requires {', '.join(plan['requires'])})" if plan.get("requires") else ""),
            "compiler": plan.get("compiler", "")}


def _policy(p: dict[str, Any]) -> str:
    order = POLICY_PARAMS.get(p["kind"], tuple(sorted(k for k in p if k != "kind"))) + POLICY_OPTIONAL.get(p["kind"], ())
    args = ", ".join(f"{k}={p[k]}" for k in order if k in p)
    return f"{p['kind']}({args})"


def _type(t: dict[str, Any]) -> str:
    if t["kind"] != "tensor":
        return t["kind"]
    return f"{t['dtype']}[{', '.join(str(d) for d in t['dims'])}]"


def _env() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(lambda name: resources.files("mstarc.templates").joinpath(name).read_text("utf-8"))
    return jinja2.Environment(loader=loader, autoescape=False, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)


def explain(plan: dict[str, Any], fmt: str = "text") -> str:
    """The plan in `fmt`; a string of the plan that would act on a terminal (an escape
    sequence in a name) is escaped (`untrusted.printable`; JSON escapes it itself)."""
    if fmt == "json":
        return json.dumps(plan, indent=2, sort_keys=True) + "\n"
    template = {"text": "explain.txt.j2", "markdown": "explain.md.j2", "dot": "explain.dot.j2"}[fmt]
    return untrusted.printable(_env().get_template(template).render(v=plan_view(plan)))


def _serves(decl: dict[str, Any]) -> str:
    """A walk's route declaration as the `.walk` file writes it: `speech(input=text)`, strings quoted."""
    route = ROUTES.get(decl["route"])

    def shown(slot: str, value: str) -> str:
        s = route.slot(slot) if route is not None else None
        return json.dumps(value) if s is not None and s.side == "string" else value

    args = ", ".join(f"{k}={shown(k, v)}" for k, v in decl["bind"].items())
    return f"{decl['route']}({args})" if args else decl["route"]
