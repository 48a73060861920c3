"""Why an Orpheus prefix-cache hit draws other tokens than its miss on a GPU, and why it is slower.

    python tools/probes/prefix_hit_miss.py --device cuda --out $OUT/prefix_probe      # H200, variant bench
    python tools/probes/prefix_hit_miss.py --device cpu --variant tiny --prefix-tokens 80 --requests 3   # smoke

One process, one Worker and dummy weights (tools/bench/prefix_cache.py's `orpheus_setup`: a
shared prefix of about `--prefix-tokens` tokens plus a short question per request), Conductors
over that worker, one request at a time:
- `off`: cache off; request 0 (prefix + question 1) is computed in one piece, as every request after it.
- `miss`: cache on, every request on a fresh conductor that holds nothing: request 0 is computed
  whole, in chunks of `--prefix-chunk` tokens at absolute multiples of it (docs/runtime.md,
  "Prefix caching"), as every request after it.
- `hit`: cache on, warmed by prefix + question 0, so request 0 finds the prefix's full pages
  cached (computed by a prompt of another length) up to a multiple of the chunk, and its
  prefill computes the rest only, in the same chunks as the miss.
- `split`: cache on, fresh: request 0 twice. The first (`split_first`) is computed whole, as
  the miss (a control: it must equal the miss bit for bit); the second (`split`) finds the
  pages of that very computation, so it is "the prompt in two pieces": prefix pages equal to
  the miss's, the rest computed apart (and timed as often as the others, on those pages).
  With the chunks miss, split and hit must all be equal; off vs miss shows what the chunks
  change against the one-piece prefill (on a GPU: other kernels, other last bits).

Taps (instance attributes over the llm node's `phase_prefill`/`head` and the worker's
`run_step`/`cohort_step`, removed at the end; the runtime is unchanged): per llm prefill
its cached tokens, its pieces (`pieces`: (q_len, kv_len) of each chunk that ran apart, or of
the whole step), the attention wrapper FlashInfer planned last, CUDA-event time of the step
(`step_gpu_ms`), host time inside it (`step_host_ms`), the host time from submit to it
(`before_step_ms`: the prompt node, admission, the prefix lookup) and from its return to
the worker's next call (`after_step_ms`: the commit of the pages' hashes, the decode join).
Request 0 of each mode also keeps the last prefill row's hidden state and float32 logits
(the first token's distribution) and, from the pool by the step's page table, K and V of
the first, middle and last layer; it and the profiled last request are left out of the
times. The last request of off, miss and hit runs under torch.profiler:
`profile_{off,miss,hit}.txt` under --out, the top 25 kernels by device time and CPU ops by CPU time.

Printed at the end: a table of every llm prefill (label, cached tokens, attention, the four
times: a first-call cost such as a kernel built on first use shows in its row), then the
summary, also written to `summary.json` under --out (default $OUT/prefix_probe, else a
temporary folder) with those rows as `records`. `compare.{miss_vs_hit, miss_vs_split,
miss_vs_split_first, split_vs_hit, off_vs_miss}`: `logits_max_abs`, `argmax_equal`, `hidden_max_abs` (the
last prefill row), `first_code_equal` and `codes_equal` (the drawn codes), `kv_prefix` /
`kv_suffix` (per kept layer, max |dK| and |dV| over the positions before / from `cut`, the
first position either run computed after cached pages); `modes.<mode>`: `cached_tokens`,
`attention` (the wrapper request 0's prefill ran on last), `pieces`, the medians of the four times and of
`first_code_ms` (submit -> first code on the host, the bench's figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))
from common import environment, sync, table, write_json  # noqa: E402 - tools/bench, found through the line above
from prefix_cache import orpheus_setup, run  # noqa: E402

from mstar_runtime.control.scheduler import DEFAULT_PREFIX_CHUNK  # noqa: E402 - after the path lines
from mstar_runtime.engine.chunked import ChunkedRows  # noqa: E402

NODE = "llm"
PAIRS = (("miss", "hit"), ("miss", "split"), ("miss", "split_first"), ("split", "hit"), ("off", "miss"))


class Tap:
    """Records every llm prefill the worker runs (see the module docstring); `label` names the
    next request's records, `keep` makes its prefill keep tensors, `profile` profiles it."""

    def __init__(self, worker: Any, device: torch.device):
        self.worker, self.device = worker, device
        self.engine = worker.engines[NODE]
        node, n = self.engine.node, self.engine.pool.num_layers
        self.layers = sorted({0, n // 2, n - 1})
        self.records: list[dict[str, Any]] = []
        self.label, self.keep, self.profile, self.t_call = "", False, None, 0.0
        self._inside, self._last = False, None
        prefill, head, step, cohort = node.phase_prefill, node.head, worker.run_step, worker.cohort_step

        def phase_prefill(batch: Any, attn: Any) -> Any:
            rec = self.records[-1]
            rec["cached"] = attn.seqs[0].cached
            self._inside = True
            try:
                out = prefill(batch, attn)
            finally:
                self._inside = False
            st = getattr(self.engine.backend, "_step", None)  # FlashInferBackend's plan of this step
            rec["attention"] = "reference" if st is None else f"{st.mode} long={st.long} causal={st.causal}"
            runner = attn.graph_runner
            rec["pieces"] = ([[s.q_len, s.kv_len] for p in runner.pieces for s in p.meta.seqs]
                             if isinstance(runner, ChunkedRows) else [[s.q_len, s.start + s.q_len] for s in attn.seqs])
            if self.keep:
                s, pool = attn.extra["metadata"].seqs[0], self.engine.pool
                rec["kv"] = {i: [t.clone() for t in pool.gather(i, s.page_table, s.kv_len)] for i in self.layers}
            return out

        def tapped_head(hidden: torch.Tensor) -> torch.Tensor:
            logits = head(hidden)
            if self._inside and self.keep:
                self.records[-1].update(hidden=hidden.float().clone(), logits=logits.float().clone())
            return logits

        def run_step(batch: Any) -> Any:
            self._next_call()
            if batch.node != NODE or batch.phase != "prefill":
                return step(batch)
            rec: dict[str, Any] = {"label": self.label, "before_step_ms": (time.perf_counter() - self.t_call) * 1e3}
            self.records.append(rec)
            prof = self._start_profile()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
            if ev:
                ev[0].record()
            t0 = time.perf_counter()
            out = step(batch)
            rec["step_host_ms"] = (time.perf_counter() - t0) * 1e3
            if ev:
                ev[1].record()
                rec["events"] = ev
            if prof is not None:
                self._end_profile(prof)
            self._last = (rec, time.perf_counter())
            return out

        def cohort_step(key: Any, n: int) -> Any:
            self._next_call()
            return cohort(key, n)

        node.phase_prefill, node.head = phase_prefill, tapped_head
        worker.run_step, worker.cohort_step = run_step, cohort_step

    def _next_call(self) -> None:
        if self._last is not None:
            rec, at = self._last
            rec["after_step_ms"] = (time.perf_counter() - at) * 1e3
            self._last = None

    def _start_profile(self) -> Any:
        if self.profile is None:
            return None
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        sync(self.device)
        prof = profile(activities=acts, record_shapes=True)
        prof.__enter__()
        return prof

    def _end_profile(self, prof: Any) -> None:
        sync(self.device)
        prof.__exit__(None, None, None)
        avg, parts = prof.key_averages(), []
        if self.device.type == "cuda":
            key = "device_time_total" if hasattr(avg[0], "device_time_total") else "cuda_time_total"
            parts.append(f"top 25 by {key}\n" + avg.table(sort_by=key, row_limit=25))
        parts.append("top 25 by cpu_time_total\n" + avg.table(sort_by="cpu_time_total", row_limit=25))
        self.profile.write_text("\n\n".join(parts) + "\n")

    def resolve(self) -> None:
        """Event times of every record (call with the device synchronised)."""
        for rec in self.records:
            ev = rec.pop("events", None)
            rec["step_gpu_ms"] = ev[0].elapsed_time(ev[1]) if ev else None

    def close(self) -> None:
        del self.engine.node.phase_prefill, self.engine.node.head
        del self.worker.run_step, self.worker.cohort_step


def request(conductor: Any, walk: str, x: dict[str, Any], tap: Tap, label: str, keep: bool = False,
            profile: Path | None = None) -> dict[str, Any]:
    """One request alone, its prefill recorded under `label`: prefix_cache.run's result and that record."""
    tap.label, tap.keep, tap.profile, tap.t_call = label, keep, profile, time.perf_counter()
    out = run(conductor, walk, [x], tap.device, ("codes",))[0]
    tap.keep, tap.profile = False, None
    recs = [r for r in tap.records if r["label"] == label]
    if len(recs) != 1:
        raise RuntimeError(f"{label}: expected one llm prefill, saw {len(recs)}")
    return {**out, "rec": recs[0]}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Request 0 of two modes: logits, last hidden row, codes, and K/V before and from `cut`, the
    first position either computed after cached pages (0 when neither found any)."""
    ra, rb = a["rec"], b["rec"]
    cut = min([c for c in (ra["cached"], rb["cached"]) if c > 0], default=0)
    kv_pre, kv_suf = {}, {}
    for layer, (ka, va) in ra["kv"].items():
        kb, vb = rb["kv"][layer]
        if ka.shape != kb.shape:
            raise RuntimeError(f"layer {layer}: contexts of {ka.shape[0]} and {kb.shape[0]} tokens")
        kv_pre[layer] = {"k": max_abs(ka[:cut], kb[:cut]), "v": max_abs(va[:cut], vb[:cut])}
        kv_suf[layer] = {"k": max_abs(ka[cut:], kb[cut:]), "v": max_abs(va[cut:], vb[cut:])}
    return {"logits_max_abs": max_abs(ra["logits"], rb["logits"]),
            "argmax_equal": bool(torch.equal(ra["logits"].argmax(-1), rb["logits"].argmax(-1))),
            "hidden_max_abs": max_abs(ra["hidden"], rb["hidden"]),
            "first_code_equal": a["outputs"]["codes"][:1] == b["outputs"]["codes"][:1],
            "codes_equal": a["outputs"] == b["outputs"], "cut": cut, "kv_prefix": kv_pre, "kv_suffix": kv_suf}


def med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarise(first: dict[str, Any], timed: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's request 0 facts and the medians of its timed requests."""
    recs = [t["rec"] for t in timed]
    row: dict[str, Any] = {"cached_tokens": first["cached_tokens"], "attention": first["rec"].get("attention"),
                           "pieces": first["rec"].get("pieces"), "timed_requests": len(timed), "first_code_ms": med([t.get("codes_ms") for t in timed])}
    for key in ("step_gpu_ms", "step_host_ms", "before_step_ms", "after_step_ms"):
        row[key] = med([r.get(key) for r in recs])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default=None, help="default: bench (real sizes, audio codes only)")
    ap.add_argument("--placement", type=Path, default=None)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=6, help="per mode: request 0 keeps tensors, the last is profiled")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-chunk", type=int, default=DEFAULT_PREFIX_CHUNK,
                    help="tokens of a prefill chunk with the cache on (a multiple of the page size)")
    ap.add_argument("--out", type=Path, default=None, help="folder (default $OUT/prefix_probe, else a temp dir)")
    args = ap.parse_args(argv)
    if not 3 <= args.requests <= 7:
        ap.error("--requests must lie in [3, 7]")
    out = args.out or (Path(os.environ["OUT"]) / "prefix_probe" if os.environ.get("OUT")
                       else Path(tempfile.mkdtemp(prefix="prefix_probe-")))
    out.mkdir(parents=True, exist_ok=True)
    from mstar_runtime.control.conductor import Conductor

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        setup = orpheus_setup(args, Path(tmp), device)
    plan, worker, walk, xs = setup["plan"], setup["worker"], setup["walk"], setup["timed"]
    tap = Tap(worker, device)
    firsts: dict[str, dict[str, Any]] = {}
    modes: dict[str, Any] = {}
    def new(cache: bool = True) -> Any:
        return Conductor(plan, {0: worker}, max_running=1, prefix_caching=cache, prefix_chunk=args.prefix_chunk)

    try:
        for mode in ("off", "miss", "hit"):
            conductor = new(mode != "off")
            for i, x in enumerate(setup["warm"] + (setup["before_hit"] if mode == "hit" else [])):
                request(conductor, walk, x, tap, f"{mode}-warm{i}")
            # a miss: each request on a conductor that holds nothing
            again = (lambda: new()) if mode == "miss" else (lambda c=conductor: c)
            firsts[mode] = request(conductor, walk, xs[0], tap, mode, keep=True)
            timed = [request(again(), walk, x, tap, f"{mode}{i}") for i, x in enumerate(xs[1:-1], 1)]
            request(again(), walk, xs[-1], tap, f"{mode}-profiled", profile=out / f"profile_{mode}.txt")
            modes[mode] = (firsts[mode], timed)
            del conductor
        conductor = new()
        for i, x in enumerate(setup["warm"]):
            request(conductor, walk, x, tap, f"split-warm{i}")
        firsts["split_first"] = request(conductor, walk, xs[0], tap, "split_first", keep=True)
        firsts["split"] = request(conductor, walk, xs[0], tap, "split", keep=True)
        modes["split"] = (firsts["split"], [request(conductor, walk, xs[0], tap, f"split{i}")
                                            for i in range(1, len(xs) - 1)])  # the same pages again
        del conductor
        sync(device)
        tap.resolve()
    finally:
        tap.close()
    rec = {"prefix_tokens": setup["prefix_tokens"], "prefix_chunk": args.prefix_chunk,
           "prompt_tokens": int(firsts["miss"]["rec"]["kv"][0][0].shape[0]),
           "kv_layers": tap.layers, "compare": {f"{a}_vs_{b}": compare(firsts[a], firsts[b]) for a, b in PAIRS},
           "modes": {m: summarise(f, t) for m, (f, t) in modes.items()},
           "records": [{k: v for k, v in r.items() if k not in ("kv", "hidden", "logits")} for r in tap.records],
           "out": str(out), "meta": {"variant": args.variant or "bench", "device": str(device),
                                     "env": environment(device)}}
    write_json(out / "summary.json", rec)
    cols = [("label", "prefill", 0), ("cached", "cached", 0), ("attention", "attention", 0),
            ("step_gpu_ms", "step gpu ms", 2), ("step_host_ms", "step host ms", 2),
            ("before_step_ms", "before ms", 2), ("after_step_ms", "after ms", 2)]
    print(table(rec["records"], cols))  # every prefill: a first-call cost (a JIT build) shows here
    print(json.dumps({k: v for k, v in rec.items() if k != "records"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
