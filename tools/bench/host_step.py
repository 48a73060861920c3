"""Host time per decode step, cohort path against generic path, for a model whose forward is negligible.

    python tools/bench/host_step.py                                  # B = 1, 16, 64, 256; 64 tokens
    python tools/bench/host_step.py --batches 1,4 --tokens 8 --repeats 1 --out /tmp/hs.json

CPU only, one torch thread. The model is tools/bench/host_step.walk: one KV node, `EchoLM`
(models/mstar_models/testfamily/echo.py: one layer, one KV head, head_dim 2; the next token
is (token + 1) % vocab with the 1 coming out of one real paged-attention call), compiled for
a copy of placements/cpu.yaml whose `max_batch` is the largest batch asked for (the placement
sets the batch limit). The benchmark checks that the compiled decode loop carries a cohort mark.

What runs: two Conductors, each with its own in-process Worker (dummy weights): "generic" on
the plan without its cohort marks (`without_cohorts`: each request's walk generator resumes
every step, one StepCall per request, KV slots per entry, the node called with a list of
dicts) and "cohort" on the plan as compiled (the loop's requests are rows of device columns,
one `CohortPhase.step` call over all rows). Per batch size B and repeat, on each path in turn: B requests are submitted at
once, each decoding `--tokens` steps after its prefill (max_new = tokens + 1), and the
conductor's engine loop (`Conductor.step()`) is driven to idle, every iteration timed alone.

What is timed: the steady state only. An iteration counts when the node's decode ran on all B
requests in it (rows seen by a wrapper around the node's column step, which both paths run): that
leaves out admission, the prefill, the iterations where requests join or have left, and the
drain. Of those, the first `SKIP` and the last `SKIP` are dropped too (the first cohort step
flushes the prefill's effects; the last ones see the rows leave). Host us per request-step =
the counted iterations' wall time / (iterations x B). Each B first runs once unmeasured
(warm-up); the figure is the median over `--repeats` runs, each path's runs interleaved.

Where the time goes, from wrappers around the worker's step (`run_step` / `cohort_step`), the
node's column step and the attention calls inside it, all in us per
request-step: `*_conductor_us` (everything outside the worker: admission checks, scheduler,
interpreter generators, emits, cohort events), `*_engine_us` (the worker's engine around the
node: slots, attention context, device columns, readbacks), `*_node_us` (the node's own call,
attention included; `*_node_share` of the step) and `*_attend_us` (its attention calls: KV
write + paged attention). `*_no_attend_us` and `ratio_no_attend` leave the attention out: on
the CPU the generic path attends with the plain-PyTorch reference, a Python loop over the
entries, where a GPU runs one batched kernel on either path.

Checked in every run: every request finishes with exactly the expected tokens (prompt's last
+ 1, + 2, ...), the two paths give the same tokens for every request, the cohort path ran cohort
steps and the generic path none. The JSON (`--out`):
    {"results": [{"batch": B, "generic_us": .., "cohort_us": .., "ratio": .., ...}], "meta": {...}}
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, patched_copy, table, write_json  # noqa: E402 - the sibling module, found through the line above

from mstar_runtime.control.conductor import FINISHED, Conductor  # noqa: E402
from mstar_runtime.plan import planfile  # noqa: E402
from mstar_runtime.plan.loader import load_plan, without_cohorts  # noqa: E402
from mstar_runtime.worker.worker import Worker  # noqa: E402

WALK = Path(__file__).resolve().parent / "host_step.walk"
PLACEMENT = ROOT / "placements" / "cpu.yaml"
NODE, WALK_NAME = "lm", "generate"
PATHS = ("generic", "cohort")
SKIP = 2  # steady iterations dropped at each end of a run
WARMUP_TOKENS = 8


# ------------------------------------------------------------------------------ set-up
def compile_plan(max_batch: int, workdir: Path) -> Path:
    """The walk compiled for placements/cpu.yaml with `max_batch` raised to the largest batch."""
    from mstarc.cli import main as mstarc  # the compiler is a dev dependency of the benchmark only

    placement = patched_copy(PLACEMENT, r"(?m)^max_batch:\s*\d+\s*$", f"max_batch: {max_batch}", "max_batch: N",
                             workdir / "cpu.yaml")
    out = workdir / f"host_step-b{max_batch}.plan"
    rc = mstarc(["compile", str(WALK), "-p", str(placement), "-o", str(out)])
    if rc != 0:
        raise SystemExit(f"mstarc compile {WALK} -p {placement} failed with exit status {rc}")
    return out


def cohort_mark(plan_path: Path) -> dict[str, Any]:
    """The decode loop's cohort mark in the compiled plan; exits if the compiler did not mark it."""
    body = planfile.read(plan_path)
    ops = body["walks"][WALK_NAME]["program"]["body"]
    loops = [op for op in ops if op.get("op") == "loop"]
    if len(loops) != 1 or not loops[0].get("cohort"):
        raise SystemExit(f"{plan_path}: walk '{WALK_NAME}' has no loop marked as a cohort: {loops}")
    return loops[0]["cohort"]


class Probe:
    """Wraps the worker's step entry points, the node's column step (an instance attribute
    shadows the method) and the attention it calls: decode rows, and seconds in each."""

    def __init__(self, worker: Any, node: Any):
        self.rows = 0
        self.worker_seconds = 0.0
        self.seconds = 0.0
        self.attend_seconds = 0.0
        step = node._cohort_step  # both paths run it (a generic decode through ops/column_call.py)
        run_step, cohort_step_ = worker.run_step, worker.cohort_step

        def timed(fn: Any, field: str) -> Any:
            """`fn`, adding the seconds of each call to the counter `field`."""
            def call(*args: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*args)
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
                return out
            return call

        def cohort_step(b: Any) -> Any:
            t0 = time.perf_counter()
            b.attend = timed(b.attend, "attend_seconds")
            out = step(b)
            self.seconds += time.perf_counter() - t0
            self.rows += b.n
            return out

        node._cohort_step = cohort_step  # read by `cohort_phase` when the cohort opens (after this)
        worker.run_step = timed(run_step, "worker_seconds")
        worker.cohort_step = timed(cohort_step_, "worker_seconds")


class StepPath:
    """One step path ("generic": the plan without its cohort marks; "cohort": as compiled): its
    conductor, in-process worker and probe."""

    def __init__(self, plan_path: Path, path: str):
        assert path in PATHS, path
        plan = load_plan(plan_path, device="cpu")
        self.name = path
        self.worker = Worker(plan, 0, "cpu", "dummy")
        self.probe = Probe(self.worker, self.worker.engines[NODE].node)
        self.conductor = Conductor(plan if path == "cohort" else without_cohorts(plan), {0: self.worker})
        self.vocab = int(self.worker.engines[NODE].node.vocab)


def prompt(i: int, vocab: int) -> list[int]:
    """Request i's prompt: three ids, the last one different per request (so are the outputs)."""
    return [1, 2, 3 + (7 * i) % (vocab - 3)]


def expected_tokens(i: int, tokens: int, vocab: int) -> list[int]:
    last = prompt(i, vocab)[-1]
    return [(last + 1 + k) % vocab for k in range(tokens + 1)]


def run_once(p: StepPath, batch: int, tokens: int) -> dict[str, Any]:
    """B requests at once, driven to idle; the steady iterations' time and the outputs."""
    c, probe = p.conductor, p.probe
    cohort_before = c.stats["cohort_steps"]
    handles = [c.submit(WALK_NAME, {"prompt": torch.tensor(prompt(i, p.vocab), dtype=torch.int32),
                                     "max_new": tokens + 1}) for i in range(batch)]
    gc.collect()
    # per engine-loop iteration: (seconds, decode rows, worker s, node s, attention s)
    iters: list[tuple[float, int, float, float, float]] = []
    perf = time.perf_counter
    while True:
        rows0, w0, node0, att0 = probe.rows, probe.worker_seconds, probe.seconds, probe.attend_seconds
        t0 = perf()
        more = c.step()
        dt = perf() - t0
        if not more:
            break
        iters.append((dt, probe.rows - rows0, probe.worker_seconds - w0, probe.seconds - node0,
                      probe.attend_seconds - att0))
    full = [(dt, ws, ns, at) for dt, rows, ws, ns, at in iters if rows == batch]
    steady = full[SKIP: len(full) - SKIP] if len(full) > 2 * SKIP else full
    bad = [h for h in handles if h.state != FINISHED]
    if bad:
        raise SystemExit(f"{p.name} path, B={batch}: request {bad[0].id} ended {bad[0].state}: {bad[0].error}")
    outputs = [h.outputs["tokens"].reshape(-1).tolist() for h in handles]
    wrong = [i for i, out in enumerate(outputs) if out != expected_tokens(i, tokens, p.vocab)]
    if wrong:
        i = wrong[0]
        raise SystemExit(f"{p.name} path, B={batch}: request {i} gave {outputs[i]}, "
                         f"expected {expected_tokens(i, tokens, p.vocab)}")
    if not steady:
        raise SystemExit(f"{p.name} path, B={batch}: no engine-loop iteration decoded all {batch} requests at once")
    n = len(steady)
    per = 1e6 / (n * batch)
    return {"us": sum(s[0] for s in steady) * per, "worker_us": sum(s[1] for s in steady) * per,
            "node_us": sum(s[2] for s in steady) * per, "attend_us": sum(s[3] for s in steady) * per,
            "steps": n, "full_steps": len(full), "iterations": len(iters),
            "cohort_steps": int(c.stats["cohort_steps"] - cohort_before), "outputs": outputs}


def measure(paths: dict[str, StepPath], batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    for p in paths.values():  # warm-up: cohort columns, numpy stores, allocator
        run_once(p, batch, min(tokens, WARMUP_TOKENS))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, p in paths.items():
            runs[name].append(run_once(p, batch, tokens))
    res: dict[str, Any] = {"batch": batch}
    for name in PATHS:
        rs = runs[name]
        us = statistics.median(r["us"] for r in rs)
        node_us = statistics.median(r["node_us"] for r in rs)
        res[f"{name}_us"] = us
        res[f"{name}_us_min"] = min(r["us"] for r in rs)
        # where the step goes: the conductor (scheduler, interpreter or cohort events), the
        # worker's engine around the node (slots, attention context, columns), the node's own
        # code, and the attention it calls (KV write + paged attention)
        res[f"{name}_conductor_us"] = statistics.median(r["us"] - r["worker_us"] for r in rs)
        res[f"{name}_engine_us"] = statistics.median(r["worker_us"] - r["node_us"] for r in rs)
        res[f"{name}_node_us"] = node_us
        res[f"{name}_node_share"] = node_us / us if us > 0 else None
        res[f"{name}_attend_us"] = statistics.median(r["attend_us"] for r in rs)
        # the step without its attention call (the plain-PyTorch CPU attention of the generic
        # path loops over entries; on a GPU both paths call a batched kernel)
        res[f"{name}_no_attend_us"] = statistics.median(r["us"] - r["attend_us"] for r in rs)
        res[f"{name}_steps"] = rs[-1]["steps"]
        res[f"{name}_cohort_steps"] = rs[-1]["cohort_steps"]
    res["ratio"] = res["generic_us"] / res["cohort_us"] if res["cohort_us"] > 0 else None
    res["ratio_no_attend"] = (res["generic_no_attend_us"] / res["cohort_no_attend_us"]
                              if res["cohort_no_attend_us"] > 0 else None)
    res["steps"] = min(res["generic_steps"], res["cohort_steps"])
    res["repeats"] = repeats
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["generic"], runs["cohort"], strict=True))
    res["same_tokens"] = same
    if not same:
        raise SystemExit(f"B={batch}: the generic and the cohort path gave different tokens")
    if res["cohort_cohort_steps"] < 1 or res["generic_cohort_steps"] != 0:
        raise SystemExit(f"B={batch}: cohort steps: cohort path {res['cohort_cohort_steps']}, generic path "
                         f"{res['generic_cohort_steps']} (expected > 0 and 0)")
    res["sample"] = {name: runs[name][-1]["outputs"][0] for name in PATHS}  # request 0's tokens
    return res


# ------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes (default 1,16,64,256)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per request (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="measured runs per batch and path; the median is kept")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    if not args.batch_list or min(args.batch_list) < 1:
        ap.error("--batches needs positive batch sizes")
    if args.tokens < 2 * SKIP + 1:
        ap.error(f"--tokens must be at least {2 * SKIP + 1} (the first and last {SKIP} steps are not timed)")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> dict[str, Any]:
    max_batch = max(args.batch_list)
    with tempfile.TemporaryDirectory(prefix="host_step-") as tmp:
        plan_path = compile_plan(max_batch, Path(tmp))
        mark = cohort_mark(plan_path)
        paths = {name: StepPath(plan_path, name) for name in PATHS}
        meta: dict[str, Any] = {
            "what": "host time per decode request-step (us), steady state, EchoLM (negligible forward), CPU",
            "walk": str(WALK.relative_to(ROOT)), "placement": f"{PLACEMENT.relative_to(ROOT)} with max_batch {max_batch}",
            "cohort_mark": mark, "tokens": args.tokens, "repeats": args.repeats, "skip": SKIP,
            "torch_threads": torch.get_num_threads(), "env": environment("cpu"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        rec: dict[str, Any] = {"results": [], "meta": meta}
        for b in args.batch_list:
            res = measure(paths, b, args.tokens, args.repeats)
            rec["results"].append(res)
            print(f"B={b}: generic {res['generic_us']:.1f} us, cohort {res['cohort_us']:.1f} us per request-step "
                  f"(x{res['ratio']:.1f})", flush=True)
            if args.out is not None:
                write_json(args.out, rec)  # after every batch: a run cut short keeps what it measured
    cols = [("batch", "B", 0), ("generic_us", "generic us/req-step", 2), ("cohort_us", "cohort us/req-step", 2),
            ("ratio", "ratio", 1), ("generic_no_attend_us", "generic w/o attn", 2),
            ("cohort_no_attend_us", "cohort w/o attn", 2), ("ratio_no_attend", "ratio w/o attn", 1),
            ("steps", "steps", 0)]
    print(f"\nhost time per decode request-step (us), {args.tokens} tokens, median of {args.repeats} runs of "
          f"'steps' timed steps; w/o attn: less the node's attention calls")
    print(table(rec["results"], cols))
    parts = [("batch", "B", 0)]
    for name in PATHS:
        parts += [(f"{name}_conductor_us", f"{name}: conductor", 2), (f"{name}_engine_us", "engine", 2),
                  (f"{name}_node_us", "node (attn incl.)", 2), (f"{name}_attend_us", "attn", 2)]
    print("\nwhere it goes (us per request-step): conductor, worker engine around the node, node, its attention")
    print(table(rec["results"], parts))
    if args.out is not None:
        write_json(args.out, rec)
        print(f"\nwrote {args.out}")
    return rec


if __name__ == "__main__":
    main()
