"""Prefix caching: time to first output with a long shared prompt prefix, hit against miss.

    python tools/bench/prefix_cache.py                                   # H200: Orpheus-3B, 2,000-token prefix
    python tools/bench/prefix_cache.py --model qwen3_omni                # H200: Qwen3-Omni's second turn
    python tools/bench/prefix_cache.py --device cpu --variant tiny --prefix-tokens 80 --requests 2   # smoke
    python tools/bench/prefix_cache.py --model qwen3_omni --device cpu --prefix-tokens 80 --requests 2

One request at a time (B = 1, so each figure is one prefill alone), through Conductors over
one in-process Worker and dummy weights, in three modes: `off` (the cache off: the one-piece
prefill), `miss` (the cache on, each timed request on a fresh conductor that holds nothing:
its prefill in chunks of `--prefix-chunk` tokens, docs/runtime.md "Prefix caching") and `hit`
(the cache on, the shared prefix cached); each first runs `--warmup` untimed requests of
another prefix (allocator, kernels).

- `--model orpheus` (default): the Orpheus walk (tools/bench/orpheus.py's copy whose end check
  never fires, variant `bench` by default: real sizes, audio codes only). Every request's
  text is one shared prefix (sentences repeated until the prompt node's ids reach
  `--prefix-tokens`) and a short question of its own; the hit conductor is warmed by one
  request with its own question first, so every timed request finds the prefix's blocks.
  TTFT: submit -> the first code applied on the host (one engine step late: docs/runtime.md,
  "lanes"); `--tokens` codes per request (2: TTFT is the figure).
- `--model qwen3_omni`: a conversation's second turn on the `speech` walk (variant `real` by
  default; tools/bench/qwen3_omni.py compiles it; codec eos masked so every request makes its
  frames). Conversation i has its own system prompt of about `--prefix-tokens` tokens and a
  first question; its second turn's prompt is the first question, a reply and a new question.
  Hit: the first turn runs (untimed), then the second is timed; miss: the second turn alone
  on the cache-off conductor. TTFT (the first text piece) and TTFA (the first audio chunk).

A listener synchronises the device at the output it times, so a figure covers the kernels
before it. Printed and written to the JSON (--out, default $OUT/prefix_cache.json): p50 and
mean of each figure per mode (`results`: off, miss, hit), the ratios miss / hit and off / hit
of the TTFT p50, the prompt and cached token counts, `same_outputs`: whether every timed
request's outputs (codes; text) were equal in miss and hit (seeded sampling: a hit that
changed a logit's last bits could flip a token; the chunks are what keeps them equal), and
`same_as_off`: whether they were equal to the cache-off run too (not promised on a GPU: the
one-piece prefill runs other kernels than the chunks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, sync, table, write_json  # noqa: E402 - the sibling modules, found through the line above

from mstar_runtime.control.scheduler import DEFAULT_PREFIX_CHUNK  # noqa: E402 - after the path line, with the others

SENTENCE = "Speech models read a long description of the voice and the scene before they say a word. "
QUESTIONS = ("What do you hear now?", "Say it once more, slowly.", "And now in a whisper?", "Louder, please!",
             "Can you sing it?", "One more time.", "Tell me a story.", "Goodbye for today.")
REPLY = "Of course. Here is a short answer, spoken calmly and clearly for you."
FIRSTS = {"orpheus": ("codes",), "qwen3_omni": ("text", "audio_out")}  # the outputs timed, per model


class _First:
    """Conductor listener: the perf_counter time of each request's first item of each output in `names`."""

    def __init__(self, device: torch.device, names: tuple[str, ...]):
        self.device, self.names, self.at = device, names, {}

    def on_output(self, request: Any, name: str, value: Any) -> None:
        if name in self.names and (request.id, name) not in self.at:
            sync(self.device)
            self.at[(request.id, name)] = time.perf_counter()

    def on_finish(self, request: Any) -> None:
        pass


def grown(text_of: Callable[[str], str], count: Callable[[str], int], tokens: int) -> tuple[str, int]:
    """SENTENCE repeated until `count(text_of(prefix))` reaches `tokens`: the prefix and that count."""
    prefix, n = "", 0
    while n < tokens:
        prefix += SENTENCE
        n = count(text_of(prefix))
    return prefix, n


def run(conductor: Any, walk: str, inputs: list[dict[str, Any]], device: torch.device,
        names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each input as one request alone: its first-output times (ms from submit), cached tokens, outputs."""
    out = []
    for x in inputs:
        first = _First(device, names)
        sync(device)
        req = conductor.submit(walk, dict(x), listener=first)
        conductor.run_until_idle()
        if req.state != "finished":
            raise RuntimeError(f"request failed: {req.error}")
        times = {f"{n}_ms": (first.at[(req.id, n)] - req.stats.submitted_at) * 1e3
                 for n in names if (req.id, n) in first.at}
        kept = {n: req.outputs[n] for n in ("codes", "text") if n in req.outputs}
        out.append({**times, "cached_tokens": req.stats.cached_tokens,
                    "outputs": {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in kept.items()}})
    return out


MODES = ("off", "miss", "hit")


def run_mode(mode: str, setup: dict[str, Any], chunk: int, device: torch.device,
             names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The timed requests of one mode (module docstring), after its warm-up requests."""
    from mstar_runtime.control.conductor import Conductor

    plan, worker, walk = setup["plan"], setup["worker"], setup["walk"]

    def conductor() -> Any:
        return Conductor(plan, {0: worker}, max_running=1, prefix_caching=mode != "off", prefix_chunk=chunk)

    first = conductor()
    run(first, walk, setup["warm"], device, names)
    if mode == "off":
        return run(first, walk, setup["timed"], device, names)
    if mode == "miss":  # a conductor that holds nothing for each: every request computes its prompt
        return [run(first if i == 0 else conductor(), walk, [x], device, names)[0]
                for i, x in enumerate(setup["timed"])]
    if setup.get("interleave"):  # each conversation's first turn, then its second
        return [run(first, walk, [a, b], device, names)[1] for a, b in zip(setup["before_hit"], setup["timed"])]
    run(first, walk, setup["before_hit"], device, names)
    return run(first, walk, setup["timed"], device, names)


def orpheus_setup(args: argparse.Namespace, tmp: Path, device: torch.device) -> dict[str, Any]:
    from orpheus import compile_plan, default_placement, local_node

    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    plan = load_plan(compile_plan(args.variant or "bench", args.placement or default_placement(args.device), tmp),
                     device=args.device)
    worker = Worker(plan, 0, device, "dummy")
    node = local_node(plan, worker, "prompt", device)
    prefix, n = grown(lambda p: p, lambda t: int(node.run("build", [{"text": t, "voice": "tara"}])[0]["tokens"].numel()),
                      args.prefix_tokens)

    def req(text: str, i: int) -> dict[str, Any]:
        return {"text": text, "voice": "tara", "max_tokens": args.tokens, "seed": args.seed + i, "temperature": 0.6,
                "top_p": 0.8, "repetition_penalty": 1.3}

    timed = [req(prefix + q, i) for i, q in enumerate(QUESTIONS[1 : args.requests + 1])]
    return {"plan": plan, "worker": worker, "walk": "tts", "prefix_tokens": n, "timed": timed,
            "warm": [req(f"{i}. " + prefix + "Warm up.", i) for i in range(args.warmup)],  # another prefix
            "before_hit": [req(prefix + QUESTIONS[0], 0)]}  # caches the shared prefix


def qwen3_omni_setup(args: argparse.Namespace, tmp: Path, device: torch.device) -> dict[str, Any]:
    from qwen3_omni import compile_plan, default_placement, mask_codec_eos

    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    variant = args.variant or ("real" if device.type == "cuda" else "tiny")
    plan = load_plan(compile_plan(variant, args.placement or default_placement(device.type), tmp, "dummy"),
                     device=device.type, kv_pages_cap=None if device.type == "cuda" else 4096)
    worker = Worker(plan, 0, device, "dummy")
    mask_codec_eos(worker.engines["talker"].node)
    tokenizer = worker.engines["proc"].node.tokenizer
    system, n = grown(lambda p: p, lambda t: len(tokenizer.encode(t).ids), args.prefix_tokens)

    def req(system: str, prompt: str, i: int) -> dict[str, Any]:
        return {"system": system, "prompt": prompt, "max_tokens": args.tokens, "talker_max_frames": args.frames,
                "seed": args.seed + i, "temperature": 0.0, "top_k": 0}

    first = [req(f"Conversation {i}. " + system, QUESTIONS[i], i) for i in range(args.requests)]
    second = [dict(x, prompt=f"{x['prompt']} {REPLY} {QUESTIONS[-1]}") for x in first]
    return {"plan": plan, "worker": worker, "walk": "speech", "prefix_tokens": n, "timed": second,
            "warm": [req(f"Warm up {i}. " + system, "Hello.", i) for i in range(args.warmup)],
            "before_hit": first, "interleave": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", choices=sorted(FIRSTS), default="orpheus")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default=None, help="default: bench (Orpheus); real on cuda, tiny on cpu (Qwen3-Omni)")
    ap.add_argument("--placement", type=Path, default=None)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2, help="tokens per request (Qwen3-Omni: text tokens)")
    ap.add_argument("--frames", type=int, default=8, help="Qwen3-Omni: codec frames per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-chunk", type=int, default=DEFAULT_PREFIX_CHUNK,
                    help="tokens of a prefill chunk with the cache on (a multiple of the page size)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "prefix_cache.json")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= len(QUESTIONS) - 1 or args.prefix_tokens < 1 or args.tokens < 1:
        ap.error(f"--requests must lie in [1, {len(QUESTIONS) - 1}], --prefix-tokens and --tokens be >= 1")
    device = torch.device(args.device)
    names = FIRSTS[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        setup = (orpheus_setup if args.model == "orpheus" else qwen3_omni_setup)(args, Path(tmp), device)
    runs = {mode: run_mode(mode, setup, args.prefix_chunk, device, names) for mode in MODES}
    rows = []
    for mode, rs in runs.items():
        row: dict[str, Any] = {"mode": mode, "cached_tokens": statistics.median(r["cached_tokens"] for r in rs)}
        for n in names:
            ms = [r[f"{n}_ms"] for r in rs if f"{n}_ms" in r]
            row[f"{n}_p50_ms"] = statistics.median(ms) if ms else None
            row[f"{n}_mean_ms"] = statistics.fmean(ms) if ms else None
        rows.append(row)
    key = f"{names[0]}_p50_ms"
    p50 = {row["mode"]: row[key] for row in rows}
    rec = {"model": args.model, "results": rows, "prefix_tokens": setup["prefix_tokens"], "requests": args.requests,
           "prefix_chunk": args.prefix_chunk, "ratio_miss_over_hit": p50["miss"] / p50["hit"],
           "ratio_off_over_hit": p50["off"] / p50["hit"],
           "same_outputs": all(a["outputs"] == b["outputs"] for a, b in zip(runs["miss"], runs["hit"])),
           "same_as_off": all(a["outputs"] == b["outputs"] for a, b in zip(runs["off"], runs["hit"])),
           "meta": {"variant": args.variant, "device": str(device), "tokens": args.tokens, "env": environment(device)}}
    cols = [("mode", "mode", 0)] + [(f"{n}_p50_ms", f"first {n} p50 ms", 1) for n in names] + [
        (f"{n}_mean_ms", f"{n} mean ms", 1) for n in names] + [("cached_tokens", "cached tokens", 0)]
    print(table(rows, cols))
    print(f"{args.model}: prefix {setup['prefix_tokens']} tokens, chunk {args.prefix_chunk}; miss / hit = "
          f"{rec['ratio_miss_over_hit']:.2f}x, off / hit = {rec['ratio_off_over_hit']:.2f}x (first {names[0]}); "
          f"same outputs (miss, hit): {rec['same_outputs']}; same as off: {rec['same_as_off']}")
    write_json(args.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
