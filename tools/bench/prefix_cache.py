"""Prefix caching: time to first token with a long shared prompt prefix, hit against miss (Orpheus-3B).

    python tools/bench/prefix_cache.py                                             # H200: real size, 2,000-token prefix
    python tools/bench/prefix_cache.py --device cpu --variant tiny --prefix-tokens 80 --requests 2   # smoke

What runs: the Orpheus walk (tools/bench/orpheus.py's copy whose end check never fires, variant
`bench` by default: the real sizes, dummy weights, audio codes only) through a Conductor with
one in-process Worker, one request at a time (B = 1, so each TTFT is one prefill alone). Every
request's text is one shared prefix (sentences repeated until the prompt node's ids reach
`--prefix-tokens`) followed by a short question of its own, so requests share the prefix's
full KV blocks and differ after them.

- miss: a conductor with `prefix_caching=False`; each request computes its whole prompt.
- hit: a conductor with the cache on, warmed by one request with its own question (not
  timed); every timed request then finds the prefix's blocks and computes only the rest (its
  `cached_tokens` is recorded).
Both run the same `--requests` questions, after `--warmup` untimed requests of another
prefix on each conductor (allocator, kernels, cuBLAS plans).

TTFT: submit -> the request's first code is applied on the host (its first output, one
engine step late: docs/runtime.md, "lanes"); on a GPU the listener synchronises the device
there, so the time covers the prefill's kernels. Each request runs `--tokens` tokens (2 by
default: TTFT is the figure). Printed and written to the JSON (--out, default
$OUT/prefix_cache.json): the p50 / mean TTFT of each, the ratio miss / hit, the prompt and
cached token counts, and `same_codes`: whether every request's codes were equal on both
(seeded sampling: a hit that changed a logit's last bits could flip a sampled token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, sync, table, write_json  # noqa: E402 - the sibling modules, found through the line above
from orpheus import compile_plan, default_placement, local_node  # noqa: E402

SENTENCE = "Speech models read a long description of the voice and the scene before they say a word. "
QUESTIONS = ("What do you hear now?", "Say it once more, slowly.", "And now in a whisper?", "Louder, please!",
             "Can you sing it?", "One more time.", "Tell me a story.", "Goodbye for today.")


class _FirstCode:
    """Conductor listener: the perf_counter time of each request's first `codes` output."""

    def __init__(self, device: torch.device):
        self.device, self.at = device, {}

    def on_output(self, request: Any, name: str, value: Any) -> None:
        if name == "codes" and request.id not in self.at:
            sync(self.device)
            self.at[request.id] = time.perf_counter()

    def on_finish(self, request: Any) -> None:
        pass


def shared_prefix(prompt_node: Any, tokens: int, voice: str) -> tuple[str, int]:
    """A text whose prompt ids (with `voice`) number at least `tokens`, and that count."""
    text, n = "", 0
    while n < tokens:
        text += SENTENCE
        n = int(prompt_node.run("build", [{"text": text, "voice": voice}])[0]["tokens"].numel())
    return text, n


def run(conductor: Any, texts: list[str], device: torch.device, tokens: int, seed: int) -> list[dict[str, Any]]:
    """Each text as one `tts` request alone; its TTFT, prompt length, cached tokens and codes."""
    out = []
    for i, text in enumerate(texts):
        first = _FirstCode(device)
        sync(device)
        req = conductor.submit("tts", {"text": text, "voice": "tara", "max_tokens": tokens, "seed": seed + i,
                                       "temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3}, listener=first)
        conductor.run_until_idle()
        if req.state != "finished":
            raise RuntimeError(f"request failed: {req.error}")
        out.append({"ttft_ms": (first.at[req.id] - req.stats.submitted_at) * 1e3,
                    "cached_tokens": req.stats.cached_tokens, "codes": req.outputs["codes"].tolist()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default="bench")
    ap.add_argument("--placement", type=Path, default=None)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "prefix_cache.json")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.requests > len(QUESTIONS) - 1 or args.prefix_tokens < 1:
        ap.error(f"--requests must lie in [1, {len(QUESTIONS) - 1}] and --prefix-tokens be >= 1")
    from mstar_runtime.control.conductor import Conductor
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = compile_plan(args.variant, args.placement or default_placement(args.device), Path(tmp))
        plan = load_plan(plan_path, device=args.device)
    worker = Worker(plan, 0, device, "dummy")
    prefix, n_prefix = shared_prefix(local_node(plan, worker, "prompt", device), args.prefix_tokens, "tara")
    warm = [f"{i}. " + prefix + "Warm up." for i in range(args.warmup)]  # another prefix: never a hit
    texts = [prefix + q for q in QUESTIONS[1 : args.requests + 1]]
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in ("miss", "hit"):
        conductor = Conductor(plan, {0: worker}, max_running=1, prefix_caching=mode == "hit")
        run(conductor, warm, device, args.tokens, args.seed)
        if mode == "hit":
            run(conductor, [prefix + QUESTIONS[0]], device, args.tokens, args.seed)  # caches the prefix
        runs[mode] = run(conductor, texts, device, args.tokens, args.seed)
        del conductor
    rows = []
    for mode, rs in runs.items():
        ttft = [r["ttft_ms"] for r in rs]
        rows.append({"mode": mode, "ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.fmean(ttft),
                     "cached_tokens": statistics.median(r["cached_tokens"] for r in rs)})
    rec = {"results": rows, "prefix_tokens": n_prefix, "requests": args.requests,
           "ratio_miss_over_hit": rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"],
           "same_codes": all(a["codes"] == b["codes"] for a, b in zip(runs["miss"], runs["hit"])),
           "meta": {"variant": args.variant, "device": str(device), "tokens": args.tokens,
                    "env": environment(device)}}
    print(table(rows, [("mode", "mode", 0), ("ttft_p50_ms", "TTFT p50 ms", 1), ("ttft_mean_ms", "mean ms", 1),
                       ("cached_tokens", "cached tokens", 0)]))
    print(f"prefix {n_prefix} tokens; miss / hit = {rec['ratio_miss_over_hit']:.2f}x; same codes: {rec['same_codes']}")
    write_json(args.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
