"""Orpheus-3B TTS: M* against Hugging Face `transformers` on the same dummy weights, one process.

    python tools/bench/orpheus.py                                   # H200: real size, B = 1, 16, 64, 128, 256
    python tools/bench/orpheus.py --device cpu --variant tiny --batches 1,2 --tokens 16   # smoke
    python tools/bench/orpheus.py --placement placements/h200x2_tp2.yaml --skip-hf        # 2 GPUs, tp 2
    python tools/bench/orpheus.py --fp8 --skip-hf                   # the llm's weights in FP8, with the parity figure

What runs:
- M*: the walk compiled with `python -m mstarc.cli` for `--placement` (default
  placements/h200x1.yaml, cpu.yaml on the CPU), variant `bench` (the real sizes with
  `audio_only`: random weights would otherwise sample text ids and starve the SNAC stream),
  run through a Conductor with rank 0's Worker in this process and, for a multi-rank
  placement, `startup.start_workers`' worker processes for the other ranks (a TP group or
  a split by stage alike; the llm must have rank 0 among its ranks, whose engine gives the
  step times): B `tts` requests submitted at once, each generating exactly `--tokens` tokens,
  on each step path of `--paths` (`cohort`: the decode loop as a decode cohort, one graphed
  step for all rows; `generic`: the plan without its cohort marks, a step call per request
  per step; `common.on_path`, docs/runtime.md). The
  fixed length comes from `max_tokens` plus an end check that never fires: the walk copy
  compiled here sets `end_of_speech` beyond the vocabulary, so no token can end a request.
- M* closed loop (`--closed-loop C1,C2`, after the batches): 4 x C requests with C in flight,
  a new one submitted as one finishes (`run_mstar_closed`): the load `tools/bench/serve.py`
  puts on a server, in process. Its tokens/s over the lockstep batch's at B = C separates
  the cost of staggered arrivals from the HTTP server's (BENCHMARKS.md, Orpheus over HTTP).
- HF (unless `--skip-hf`): `LlamaForCausalLM` built from the same config with the M* node's
  weights copied in by name (a sharded llm's full weights are rebuilt at tp 1 from the same
  seeds), the same prompt token ids (left-padded), the same sampling settings, and
  `min_new_tokens = max_new_tokens = --tokens`; with the default dynamic cache, and with
  `cache_implementation="static"` and transformers' automatic torch.compile (its first call,
  compile included, is reported apart; on the CPU the static run is not compiled).

Figures per system and batch size (all in the JSON written to --out, default $OUT/orpheus.json):
- tokens/s (all generated tokens over the wall time, prefill and SNAC included) and audio
  seconds per second (tokens/s / 82);
- time to first audio, p50 and p90: submit -> the first 2048-sample chunk (28 codes + a SNAC
  decode of the window). For HF: time to its 28th generated token plus a SNAC decode of B
  windows with the same SNAC module;
- real-time factor p50: a request's generation time over its audio length (82 tokens = 1 s);
- the decode step time against the floor: (weight bytes + KV bytes read at the run's average
  context) / the read bandwidth of a 4 GiB `x.sum()` measured in the same run; bytes of one
  rank's shard under TP (the ranks read theirs at the same time);
- GPU memory (peak allocated, reserved, device used).
With `--fp8` the placement is the given one with `weights: fp8` on the llm (the decoder's
projections in E4M3, per-channel scales, activations per token: docs/placement.md), and
before the runs the parity figure is printed and recorded (`fp8_parity`): a bf16 and an
FP8 llm built from the same dummy weights, the bf16 one continues `--parity-tokens` tokens
greedily from the first prompt, both are run teacher-forced over that sequence (dense causal
attention, full vocabulary), and the figure is the largest |logit difference| (also over the
bf16 logits' largest magnitude) and the share of the positions where both pick the same
greedy token. HF does not run with `--fp8` (it would be handed E4M3 tensors).
The JSON is rewritten after every measurement, so a run cut short keeps what it measured;
`--budget-s` skips HF runs that would not fit (recorded as skipped).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402 - the sibling module, found through the line above
    Budget,
    Launches,
    environment,
    gpu_memory,
    measure_read_bandwidth,
    on_path,
    patched_copy,
    percentile,
    reset_peak,
    sync,
    table,
    write_json,
)

WALK = ROOT / "models/orpheus/orpheus.walk"
TOKENS_PER_SECOND_OF_AUDIO = 82.0
FIRST_AUDIO_CODES = 28
NEVER_EOS = 2_000_000_000  # an end_of_speech id no token can have: every request runs to max_tokens
PAD_ID = 128263
SAMPLING = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3}  # orpheus-speech defaults
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
TEXTS = (
    "Hello there, this is M star speaking.",
    "The quick brown fox jumps over the lazy dog, twice on Sundays.",
    "Streaming speech arrives chunk by chunk while the model keeps writing codes.",
    "Can you hear the difference between one request and sixty four at once?",
    "Benchmarks measure what they measure; read the method before the numbers.",
    "A short one.",
    "Composite multimodal models change their execution path with the task at hand.",
    "Every eighty two tokens make one second of audio at twenty four kilohertz.",
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

log = logging.getLogger("bench.orpheus")


# ------------------------------------------------------------------------------ set-up
def default_placement(device: str) -> Path:
    return ROOT / ("placements/cpu.yaml" if device == "cpu" else "placements/h200x1.yaml")


def fp8_placement(placement: Path, workdir: Path) -> Path:
    """A copy of `placement` with `weights: fp8` on Orpheus' llm (its entry's ranks kept; none
    given: the placement's default rank)."""
    import yaml

    doc = yaml.safe_load(placement.read_text())
    nodes = doc.setdefault("models", {}).setdefault("orpheus", {}).setdefault("nodes", {})
    entry = nodes.get("llm", doc.get("default_rank", 0))
    if entry == "spread":
        raise SystemExit(f"{placement}: --fp8 needs the llm's rank; give `models.orpheus.nodes.llm`")
    nodes["llm"] = {**(entry if isinstance(entry, dict) else {"rank": entry}), "weights": "fp8"}
    out = workdir / f"{placement.stem}_fp8.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def compile_plan(variant: str, placement: Path, workdir: Path) -> Path:
    """The walk with an end check that never fires, compiled by the CLI for `placement`."""
    walk = patched_copy(WALK, r"(\bend_of_speech\s*=\s*)\d+", rf"\g<1>{NEVER_EOS}", "end_of_speech = N",
                        workdir / "orpheus.walk")
    out = workdir / f"orpheus-{variant}-{placement.stem}.plan"
    cmd = [sys.executable, "-m", "mstarc.cli", "compile", str(walk), "--variant", variant,
           "-p", str(placement), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"compile failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out


class _FirstAudio:
    """Conductor listener: when each request's first audio chunk exists on the device.

    On a GPU a timing event is recorded on the current stream when the chunk is emitted (the
    stream is then ordered after its SNAC decode), and `times()` converts it against an event
    recorded at the start: no synchronisation in the middle of the run, which would stall
    the pipeline it measures. On the CPU the chunk exists when it is emitted."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.at: dict[str, float] = {}
        self.events: dict[str, Any] = {}
        self.t0 = time.perf_counter()
        self.start = None
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def on_output(self, request: Any, name: str, value: Any) -> None:
        if name != "audio" or request.id in self.at or request.id in self.events:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[request.id] = ev
        else:
            self.at[request.id] = time.perf_counter()

    def times(self) -> dict[str, float]:
        """Request id -> perf_counter time of its first audio (call after the device is synchronised)."""
        for rid, ev in self.events.items():
            self.at[rid] = self.t0 + self.start.elapsed_time(ev) / 1e3
        return self.at

    def on_finish(self, request: Any) -> None:
        pass


def local_node(plan: Any, worker: Any, name: str, device: torch.device) -> Any:
    """Stateless node `name` in this process: rank 0's instance, else a fresh one with the same
    dummy weights (its own rank's is in another process, e.g. SNAC of a split placement)."""
    if name in worker.engines:
        return worker.engines[name].node
    from mstar_runtime.weights import build_node, load_weights

    node = build_node(plan, name, plan.node(name).ranks[0], device)
    load_weights(node, plan, name, "dummy")
    return node


def prompt_ids(node: Any, n: int) -> list[torch.Tensor]:
    """The token ids the M* prompt node builds for request i's (text, voice): HF gets the same."""
    out = node.run("build", [{"text": TEXTS[i % len(TEXTS)], "voice": VOICES[i % len(VOICES)]} for i in range(n)])
    return [o["tokens"].to("cpu", torch.long) for o in out]


# ------------------------------------------------------------------------------ FP8 parity
def _dense_attend(heads: int) -> Any:
    """Causal attention over one sequence's rows [N, heads, hd] (K/V [N, kv_heads, hd]), no cache."""
    import torch.nn.functional as F

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(q.shape[0], heads, -1)

    return attend


def sequence_logits(node: Any, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits [N, vocab] of the llm node over one sequence of token ids [N] (positions 0..N-1)."""
    positions = torch.arange(ids.numel(), device=ids.device)
    hidden = node.forward_hidden(ids, positions, _dense_attend(node.local_heads))
    return node.head(hidden)


def fp8_parity(ref: Any, fp8: Any, prompt: torch.Tensor, tokens: int) -> dict[str, Any]:
    """The FP8 llm against the bf16 one on the same weights: `ref` continues `prompt` greedily
    for `tokens` tokens; then both run teacher-forced over that sequence, and at each of the
    `tokens` positions that predict a generated token the logits are compared (full vocabulary)."""
    device = ref.inv_freq.device
    ids = prompt.to(device, torch.long)
    with torch.inference_mode():
        for _ in range(tokens):  # the reference's own greedy continuation (no cache: plain and exact)
            ids = torch.cat([ids, sequence_logits(ref, ids)[-1:].argmax(-1)])
        seq, first = ids[:-1], prompt.numel() - 1
        a, b = sequence_logits(ref, seq)[first:], sequence_logits(fp8, seq)[first:]
    err = (b - a).abs()
    agree = (a.argmax(-1) == b.argmax(-1)).float()
    return {"tokens": tokens, "prompt_tokens": int(prompt.numel()), "max_logit_error": float(err.max()),
            "mean_logit_error": float(err.mean()), "max_logit_error_rel": float(err.max() / a.abs().max()),
            "greedy_agreement": float(agree.mean()),
            # the first position where the FP8 model's greedy token differs (tokens: none)
            "first_disagreement": int((agree == 0).nonzero()[0, 0]) if bool((agree == 0).any()) else tokens}


def measure_fp8_parity(bf16_plan: Any, fp8_plan: Any, device: torch.device, tokens: int) -> dict[str, Any]:
    """`fp8_parity` for the llm of the two plans (dummy weights, built here at tp 1 on rank 0's device)."""
    from mstar_runtime.weights import build_node, load_weights

    prompter = build_node(bf16_plan, "prompt", 0, device)
    load_weights(prompter, bf16_plan, "prompt", "dummy")
    prompt = prompt_ids(prompter, 1)[0]
    nodes = []
    for plan in (bf16_plan, fp8_plan):
        node = build_node(plan, "llm", 0, device)
        load_weights(node, plan, "llm", "dummy")  # the fp8 plan's loader quantizes after filling
        nodes.append(node.eval())
    try:
        return fp8_parity(nodes[0], nodes[1], prompt, tokens)
    finally:
        del nodes
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ M*
def _decode_stats(worker: Any) -> dict[str, float]:
    """The llm's decode steps and host seconds so far, generic and cohort steps together."""
    nodes = worker.stats()["nodes"].get("llm", {})
    parts = [nodes.get(p, {"steps": 0, "seconds": 0.0}) for p in ("decode", "decode:cohort")]
    return {"steps": sum(x["steps"] for x in parts), "seconds": sum(x["seconds"] for x in parts)}


def run_mstar(plan: Any, workers: dict[int, Any], device: torch.device, batch: int, tokens: int,
              seed: int, path: str = "cohort") -> dict[str, Any]:
    """One batch through the conductor; step times from rank 0's worker (the llm's, or one rank of its TP group)."""
    from mstar_runtime.control.conductor import Conductor

    worker = workers[0]
    conductor = Conductor(on_path(plan, path), workers, max_running=batch)
    first = _FirstAudio(device)
    before = _decode_stats(worker)
    sync(device)
    launches = Launches(worker, "llm", ("decode",))
    t0 = time.perf_counter()
    first.t0 = t0
    if first.start is not None:
        first.start.record()
    reqs = [conductor.submit("tts", {"text": TEXTS[i % len(TEXTS)], "voice": VOICES[i % len(VOICES)],
                                     "max_tokens": tokens, "seed": seed + i, **SAMPLING}, listener=first)
            for i in range(batch)]
    try:
        conductor.run_until_idle()
    finally:
        launches.close()
    sync(device)
    wall = time.perf_counter() - t0
    first_at = first.times()
    failed = [f"{r.id}: {r.error}" for r in reqs if r.state != "finished"]
    if failed:
        raise RuntimeError("M* requests failed: " + "; ".join(failed[:3]))
    after = _decode_stats(worker)
    generated = [int(r.outputs["codes"].numel()) for r in reqs]
    steps = after["steps"] - before["steps"]
    step_s = (after["seconds"] - before["seconds"]) / max(steps, 1)
    ttfa = [first_at[r.id] - r.stats.submitted_at for r in reqs if r.id in first_at]
    period = launches.period(skip=4)
    rtf = [(r.stats.finished_at - r.stats.submitted_at) / (g / TOKENS_PER_SECOND_OF_AUDIO)
           for r, g in zip(reqs, generated) if g]
    return {
        "batch": batch, "path": path, "cohort_steps": int(conductor.stats["cohort_steps"]), "wall_s": wall, "generated_tokens": sum(generated), "min_tokens": min(generated),
        "tokens_per_s": sum(generated) / wall, "audio_s_per_s": sum(generated) / wall / TOKENS_PER_SECOND_OF_AUDIO,
        "ttfa_p50_ms": _ms(percentile(ttfa, 50)), "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
        "rtf_p50": percentile(rtf, 50), "decode_steps": steps,
        # the achieved step period (see common.Launches); the host time per step is apart
        "decode_step_ms": _ms(period) if period is not None else step_s * 1e3, "decode_host_ms": step_s * 1e3,
        "wall_per_decode_ms": wall / max(tokens - 1, 1) * 1e3,
        "conductor_steps": int(conductor.stats["steps"]), "wasted_steps": int(conductor.stats["wasted_steps"]),
        # a split placement: steps sent to worker processes, and how many steps ran while one was in flight
        "remote_steps": int(conductor.stats["remote_steps"]),
        "overlapped_steps": int(conductor.stats["overlapped_steps"]),
        "remote_wait_s": conductor.stats["remote_wait_seconds"],
        # a TP placement: inputs the TP members took from their own outputs instead of the wire
        "tp_refs": conductor.tp.refs_sent,
        # per decode step: rank 0's time on the TP members (their answers, sending the step)
        # and a member's own time in its steps (summed over the batch's steps / decode steps)
        "tp_member_wait_ms": conductor.tp.member_wait_s / max(steps, 1) * 1e3,
        "tp_member_step_ms": conductor.tp.member_step_s / max(steps, 1) * 1e3,
        "tp_member_read_ms": conductor.tp.member_read_s / max(steps, 1) * 1e3,
    }


def run_mstar_closed(plan: Any, workers: dict[int, Any], device: torch.device, concurrency: int, total: int,
                     tokens: int, seed: int, path: str = "cohort") -> dict[str, Any]:
    """`total` requests in a closed loop of `concurrency` in flight (a new one submitted as one
    finishes), in process: the load `tools/bench/serve.py` puts on a server, without HTTP.
    Next to `run_mstar`'s lockstep batch it separates the cost of staggered arrivals (prefills
    between decode steps, rows joining and leaving, SNAC windows at different steps) from the
    server's own cost."""
    from mstar_runtime.control.conductor import RUNNING, WAITING, Conductor

    conductor = Conductor(on_path(plan, path), workers, max_running=concurrency)
    first = _FirstAudio(device)
    reqs: list[Any] = []

    def top_up() -> None:
        live = sum(r.state in (WAITING, RUNNING) for r in reqs)
        while live < concurrency and len(reqs) < total:
            i = len(reqs)
            reqs.append(conductor.submit("tts", {"text": TEXTS[i % len(TEXTS)], "voice": VOICES[i % len(VOICES)],
                                                 "max_tokens": tokens, "seed": seed + i, **SAMPLING}, listener=first))
            live += 1

    sync(device)
    t0 = time.perf_counter()
    first.t0 = t0
    if first.start is not None:
        first.start.record()
    top_up()
    while len(reqs) < total or any(r.state in (WAITING, RUNNING) for r in reqs):
        conductor.run_until_idle(top_up)
        top_up()
    sync(device)
    wall = time.perf_counter() - t0
    failed = [f"{r.id}: {r.error}" for r in reqs if r.state != "finished"]
    if failed:
        raise RuntimeError("M* requests failed: " + "; ".join(failed[:3]))
    first_at = first.times()
    generated = [int(r.outputs["codes"].numel()) for r in reqs]
    ttfa = [first_at[r.id] - r.stats.submitted_at for r in reqs if r.id in first_at]
    rtf = [(r.stats.finished_at - r.stats.submitted_at) / (g / TOKENS_PER_SECOND_OF_AUDIO)
           for r, g in zip(reqs, generated) if g]
    return {"concurrency": concurrency, "requests": total, "path": path, "wall_s": wall,
            "generated_tokens": sum(generated), "tokens_per_s": sum(generated) / wall,
            "ttfa_p50_ms": _ms(percentile(ttfa, 50)), "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
            "rtf_p50": percentile(rtf, 50), "rtf_p90": percentile(rtf, 90),
            "conductor_steps": int(conductor.stats["steps"]), "cohort_steps": int(conductor.stats["cohort_steps"])}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def time_snac(node: Any, device: torch.device, batch: int) -> float:
    """Seconds of one SNAC decode of `batch` 28-code windows (what HF's first chunk also needs)."""
    windows = [{"codes": torch.randint(0, 4096, (FIRST_AUDIO_CODES,), dtype=torch.int32, device=device)}
               for _ in range(batch)]
    with torch.inference_mode():
        node.run("decode", windows)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        node.run("decode", windows)
        sync(device)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------ HF
def build_hf(config: dict[str, Any], state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = bool(config.get("tie_embeddings", True))
    cfg = LlamaConfig(
        vocab_size=int(config["vocab"]), hidden_size=int(config["hidden"]),
        num_hidden_layers=int(config["layers"]), num_attention_heads=int(config["heads"]),
        num_key_value_heads=int(config["kv_heads"]), head_dim=int(config["head_dim"]),
        intermediate_size=int(config["intermediate"]), rms_norm_eps=float(config.get("rms_eps", 1e-5)),
        tie_word_embeddings=tied, max_position_embeddings=131072,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": float(config.get("rope_theta", 500000.0))},
        bos_token_id=128000, eos_token_id=None, pad_token_id=PAD_ID,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    return model


class _TokenTimes:
    """A generate() streamer that stamps when each new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def left_padded(prompts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def run_hf(model: Any, prompts: list[torch.Tensor], device: torch.device, tokens: int, static: bool,
           compile_static: bool, snac_s: float, seed: int) -> dict[str, Any]:
    from transformers.generation.streamers import BaseStreamer

    class Stamp(_TokenTimes, BaseStreamer):
        pass

    ids, mask = left_padded(prompts, device)
    kwargs: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                                  top_k=0, pad_token_id=PAD_ID, **SAMPLING)
    if static:
        kwargs["cache_implementation"] = "static"
        if not compile_static:
            kwargs["disable_compile"] = True
    stamp = Stamp()
    torch.manual_seed(seed)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, streamer=stamp, **kwargs)
    sync(device)
    wall = time.perf_counter() - t0
    new = int(out.shape[1] - ids.shape[1])
    batch = len(prompts)
    token_times = stamp.times[1:]  # after the prompt
    first_audio = (token_times[FIRST_AUDIO_CODES - 1] - t0 + snac_s) if len(token_times) >= FIRST_AUDIO_CODES else None
    decode_s = (token_times[-1] - token_times[0]) / max(len(token_times) - 1, 1) if len(token_times) > 1 else None
    return {
        "batch": batch, "wall_s": wall, "generated_tokens": new * batch, "tokens_per_s": new * batch / wall,
        "audio_s_per_s": new * batch / wall / TOKENS_PER_SECOND_OF_AUDIO,
        "ttfa_p50_ms": _ms(first_audio), "ttfa_p90_ms": _ms(first_audio),
        "rtf_p50": wall / (new / TOKENS_PER_SECOND_OF_AUDIO) if new else None,
        "decode_step_ms": _ms(decode_s), **gpu_memory(device),
    }


# ------------------------------------------------------------------------------ main
def floor_ms(weight_bytes: int, kv_token_bytes: int, batch: int, context: float, bandwidth: float) -> float:
    return (weight_bytes + batch * context * kv_token_bytes) / bandwidth * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--variant", default=None, help="walk variant (default: bench on cuda, tiny on cpu)")
    ap.add_argument("--batches", default="1,16,64,128,256")
    ap.add_argument("--paths", default="cohort,generic",
                    help="step paths to run M* on, comma list (generic: the plan without its cohort marks)")
    ap.add_argument("--hf-batches", default="1,16,64", help="batch sizes of the HF baseline (a subset of --batches)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per request (fixed)")
    ap.add_argument("--placement", type=Path, default=None,
                    help="placement file (default: placements/h200x1.yaml on cuda, placements/cpu.yaml on cpu); "
                         "ranks > 0 run as worker processes")
    ap.add_argument("--hf-modes", default="dynamic,static", help="comma list of dynamic, static; empty: no HF")
    ap.add_argument("--skip-hf", action="store_true", help="M* only (same as --hf-modes '')")
    ap.add_argument("--budget-s", type=float, default=None, help="skip HF runs that would not fit in this")
    ap.add_argument("--closed-loop", default="",
                    help="concurrencies of an in-process closed loop (4 x C requests each, one submitted as one "
                         "finishes: serve.py's load without HTTP), comma list; empty: none")
    ap.add_argument("--fp8", action="store_true",
                    help="the llm's weights in FP8 (the placement with `weights: fp8` on it); prints the parity "
                         "figure against bf16 on the same weights; no HF runs")
    ap.add_argument("--parity-tokens", type=int, default=64, help="greedy tokens the --fp8 parity figure covers")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "orpheus.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    variant = args.variant or ("bench" if device.type == "cuda" else "tiny")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    modes = [] if args.skip_hf or args.fp8 else [m for m in args.hf_modes.split(",") if m.strip()]
    placement = (args.placement or default_placement(device.type)).resolve()
    torch.backends.cuda.matmul.allow_tf32 = False
    rec: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "env": environment(device), "variant": variant, "tokens": args.tokens, "batches": batches,
        "placement": os.path.relpath(placement, ROOT),
        "sampling": SAMPLING, "eos": "disabled: end_of_speech set beyond the vocabulary", "mstar": {}, "hf": {},
        "errors": [], "weights": "fp8" if args.fp8 else "checkpoint dtype",
    }
    save = lambda: write_json(args.out, rec)  # noqa: E731 - after every measurement

    rec["read_bandwidth_tb_s"] = bw = measure_read_bandwidth(device) / 1e12
    save()
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.startup import shutdown_workers, start_workers

    workdir = Path(tempfile.mkdtemp(prefix="bench-orpheus-"))
    cap = None if device.type == "cuda" else 4096
    plan = load_plan(compile_plan(variant, fp8_placement(placement, workdir) if args.fp8 else placement, workdir),
                     device=device.type, kv_pages_cap=cap)
    if args.fp8:
        if plan.node("llm").tp_of(plan.node("llm").ranks[0])[1] != 1:
            rec["errors"].append("fp8 parity: measured at tp 1 only; the llm is sharded here")
        else:
            bf16 = load_plan(compile_plan(variant, placement, workdir), device=device.type, kv_pages_cap=cap)
            rec["fp8_parity"] = fp8 = measure_fp8_parity(bf16, plan, device, args.parity_tokens)
            print(f"FP8 parity against bf16 on the same weights, {fp8['tokens']} greedy tokens (teacher-forced): "
                  f"max |logit error| {fp8['max_logit_error']:.4f} ({fp8['max_logit_error_rel']:.2%} of the largest "
                  f"|logit|), mean {fp8['mean_logit_error']:.4f}; greedy agreement {fp8['greedy_agreement']:.1%} "
                  f"(first difference at token {fp8['first_disagreement']})", flush=True)
        save()
    if 0 not in plan.node("llm").ranks:
        raise SystemExit(f"{placement}: the llm must have rank 0 among its ranks (this process reads its "
                         f"engine's step times); it is on {list(plan.node('llm').ranks)}")
    rec.update(ranks=plan.num_ranks, llm_tp=plan.node("llm").tp_of(0)[1],
               nodes_by_rank={str(r): list(plan.resident_nodes(r)) for r in range(plan.num_ranks)})
    t0 = time.perf_counter()
    workers = start_workers(plan, "dummy", device.type)  # a one-rank plan: rank 0's Worker only
    try:
        rec["mstar_setup_s"] = time.perf_counter() - t0
        measured = bench_mstar(args, rec, save, plan, workers, device, batches, bw, variant)
    finally:
        t0 = time.perf_counter()
        shutdown_workers(workers)  # the other ranks' memory is free before HF runs
        if plan.num_ranks > 1:
            print(f"worker processes shut down in {time.perf_counter() - t0:.1f} s", flush=True)
    if modes:
        hf_batches = [b for b in (int(x) for x in args.hf_batches.split(",") if x.strip()) if b in batches]
        bench_hf(args, rec, save, plan, workers, device, hf_batches, bw, modes, budget, measured)
    summary(args, rec, save, batches, bw, variant, device)
    return 0 if rec["mstar"] else 1


@dataclass
class _Measured:
    """What the HF runs reuse from the M* set-up."""

    prompts: list[torch.Tensor]
    snac_s: dict[int, float]


def bench_mstar(args: argparse.Namespace, rec: dict[str, Any], save: Any, plan: Any, workers: dict[int, Any],
                device: torch.device, batches: list[int], bw: float, variant: str) -> _Measured:
    """M* at every batch size, then the SNAC timing that HF's first-audio figure needs."""
    from mstar_runtime.kv.flashinfer_backend import backend_name

    worker = workers[0]
    llm = worker.engines["llm"]
    node = llm.node
    weight_bytes = sum(p.numel() * p.element_size() for p in node.parameters())  # this rank's shard
    geo = node.kv_geometry  # this rank's KV heads
    kv_token_bytes = geo.layers * 2 * geo.kv_heads * geo.head_dim * llm.pool.dtype.itemsize
    prompts = prompt_ids(local_node(plan, worker, "prompt", device), max(batches))
    rec.update(weights_gb=weight_bytes / 1e9, kv_bytes_per_token=kv_token_bytes,
               attention_backend=backend_name(llm.backend), audio_only=bool(getattr(node, "audio_only", False)),
               graph_buckets={p: r.buckets for p, r in llm.graph_runners.items()},
               kv_pool_gib=llm.pool.data.numel() * llm.pool.data.element_size() / 2**30,
               prompt_tokens_mean=sum(len(p) for p in prompts) / len(prompts))
    if not rec["audio_only"]:
        rec["errors"].append(f"variant {variant} has audio_only off: random weights may emit few codes")
    save()

    # ---- M*: a short warm-up per batch size (graph capture, kernel JIT, allocator), then the run
    paths = [p for p in args.paths.split(",") if p.strip()]
    for b, path in ((b, path) for b in batches for path in paths):
        try:
            run_mstar(plan, workers, device, b, min(args.tokens, FIRST_AUDIO_CODES + 8), args.seed + 10_000, path)
            reset_peak(device)
            r = run_mstar(plan, workers, device, b, args.tokens, args.seed, path)
            ctx = sum(len(p) for p in prompts[:b]) / b + args.tokens / 2
            r["floor_ms"] = floor_ms(weight_bytes, kv_token_bytes, b, ctx, bw * 1e12)
            r["step_over_floor"] = r["decode_step_ms"] / r["floor_ms"]
            r.update(gpu_memory(device))
            runner = llm.graph_runners.get("decode")
            r["graph_replays"] = runner.replays if runner is not None else 0
            r["graph_failed"] = runner.failed if runner is not None else None
            r["cohort_graph_replays"] = sum(c.graphs.replays for c in worker._cohorts.values() if c.graphs)
            rec["mstar"][str(b) if path == paths[0] else f"{b}:{path}"] = r
        except Exception as e:  # noqa: BLE001 - record and go on to the next figure
            log.exception("M* at batch %d (%s path) failed", b, path)
            rec["errors"].append(f"mstar batch {b} ({path}): {type(e).__name__}: {e}")
        save()
    for c in (int(x) for x in args.closed_loop.split(",") if x.strip()):
        try:
            run_mstar_closed(plan, workers, device, c, c, min(args.tokens, FIRST_AUDIO_CODES + 8), args.seed + 20_000,
                             paths[0])  # warm-up
            r = run_mstar_closed(plan, workers, device, c, 4 * c, args.tokens, args.seed, paths[0])
            lockstep = rec["mstar"].get(str(c))
            if lockstep:
                r["vs_lockstep"] = r["tokens_per_s"] / lockstep["tokens_per_s"]
            rec.setdefault("mstar_closed", {})[str(c)] = r
            log.info("closed loop c=%d: %.0f tokens/s, TTFA p50 %.1f ms", c, r["tokens_per_s"], r["ttfa_p50_ms"] or 0)
        except Exception as e:  # noqa: BLE001
            log.exception("M* closed loop at %d failed", c)
            rec["errors"].append(f"mstar closed loop {c}: {type(e).__name__}: {e}")
        save()
    snac = local_node(plan, worker, "snac", device)
    snac_s = {b: time_snac(snac, device, b) for b in batches}
    rec["snac_decode_ms"] = {str(b): s * 1e3 for b, s in snac_s.items()}
    save()
    return _Measured(prompts, snac_s)


def llm_state(plan: Any, node: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The llm's full weights: the node's own at tp 1; else a tp-1 instance with the same dummy
    weights (every rank's shard is a slice of exactly these tensors)."""
    if plan.node("llm").tp_of(0)[1] == 1:
        return dict(node.state_dict())
    from mstar_runtime.weights import build_node, load_weights

    full = build_node(plan, "llm", 0, device)
    load_weights(full, plan, "llm", "dummy")
    return dict(full.state_dict())


def bench_hf(args: argparse.Namespace, rec: dict[str, Any], save: Any, plan: Any, workers: dict[int, Any],
             device: torch.device, batches: list[int], bw: float, modes: list[str], budget: Any,
             measured: _Measured) -> None:
    """HF on the same weights; M*'s pool and graphs are freed first (`workers` is emptied)."""
    worker = workers[0]
    llm = worker.engines["llm"]
    # the KV pools (sized for 256 requests), cohort columns and captured graphs go before HF's
    # copy of the weights is made; the node (and its weights) stays until the copy exists
    worker.release_graphs()
    worker._cohorts.clear()
    for engine in worker.engines.values():
        if hasattr(engine, "pool"):
            engine.pool.data = torch.empty(0, dtype=engine.pool.data.dtype, device=engine.pool.data.device)
    del worker
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        state = llm_state(plan, llm.node, device)
        hf = build_hf(dict(plan.config), state, device, llm.pool.dtype)
        del state
    except Exception as e:  # noqa: BLE001
        log.exception("building the HF model failed")
        rec["errors"].append(f"hf build: {type(e).__name__}: {e}")
        return
    finally:
        del llm
        workers.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # HF's floor reads the whole model (M*'s, under TP, one rank's shard)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    cfg = hf.config
    kv_token_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * hf.dtype.itemsize
    # cheapest first; static at B=16 before 1 and 64: it is the comparison the target names
    order = [("dynamic", b) for b in batches if "dynamic" in modes]
    order += [("static", b) for b in sorted(batches, key=lambda b: (b != 16, b)) if "static" in modes]
    for mode, b in order:
        compile_static = mode == "static" and device.type == "cuda"
        need = (60.0 if compile_static else 5.0) + args.tokens * (0.01 if compile_static else 0.1)
        entry = rec["hf"].setdefault(mode, {})
        if not budget.allows(need):
            entry[str(b)] = {"skipped": f"budget: {budget.left():.0f} s left, about {need:.0f} s needed"}
            save()
            continue
        try:
            hf_args = (hf, measured.prompts[:b], device)
            hf_kw = dict(static=mode == "static", compile_static=compile_static, snac_s=measured.snac_s[b],
                         seed=args.seed)
            t0 = time.perf_counter()
            # warm-up (compiles the static graph): the full length there, so the measured run reuses it
            run_hf(*hf_args, args.tokens if compile_static else min(args.tokens, 8), **hf_kw)
            first_call = time.perf_counter() - t0
            r = run_hf(*hf_args, args.tokens, **hf_kw)
            if compile_static:
                r["first_call_s"] = first_call
            ctx = sum(len(p) for p in measured.prompts[:b]) / b + args.tokens / 2
            if r["decode_step_ms"] is not None:
                r["floor_ms"] = floor_ms(weight_bytes, kv_token_bytes, b, ctx, bw * 1e12)
                r["step_over_floor"] = r["decode_step_ms"] / r["floor_ms"]
            entry[str(b)] = r
        except Exception as e:  # noqa: BLE001
            log.exception("HF %s at batch %d failed", mode, b)
            rec["errors"].append(f"hf {mode} batch {b}: {type(e).__name__}: {e}")
        save()


def summary(args: argparse.Namespace, rec: dict[str, Any], save: Any, batches: list[int], bw: float,
            variant: str, device: torch.device) -> None:
    """The table of every figure, M* against HF per batch size, and the speed-ups."""
    rows = []
    for b in batches:
        m = rec["mstar"].get(str(b))
        for key, r in rec["mstar"].items():
            if key == str(b) or key.startswith(f"{b}:"):
                rows.append({"system": f"M* {r.get('path', '')}" + (" fp8" if args.fp8 else ""), **r, "mem": r.get("peak_allocated_gib")})
        for mode in ("dynamic", "static"):
            h = rec["hf"].get(mode, {}).get(str(b))
            if h and "skipped" not in h:
                rows.append({"system": f"HF {mode}", **h, "mem": h.get("peak_allocated_gib")})
        best = max((h["tokens_per_s"] for mode in rec["hf"].values() for k, h in mode.items()
                    if k == str(b) and "tokens_per_s" in h), default=None)
        if m and best:
            rec.setdefault("speedup_vs_best_hf", {})[str(b)] = m["tokens_per_s"] / best
    cols = [("system", "system", 0), ("batch", "B", 0), ("tokens_per_s", "tok/s", 1),
            ("audio_s_per_s", "audio s/s", 2), ("ttfa_p50_ms", "TTFA p50 ms", 1), ("ttfa_p90_ms", "p90 ms", 1),
            ("rtf_p50", "RTF p50", 3), ("decode_step_ms", "step ms", 2), ("floor_ms", "floor ms", 2),
            ("step_over_floor", "x floor", 2), ("mem", "peak GiB", 1)]
    print(f"\nOrpheus {variant} on {rec['env'].get('gpu', device.type)} ({rec['placement']}, llm tp "
          f"{rec['llm_tp']}): {args.tokens} tokens/request, read bandwidth {bw:.2f} TB/s, "
          f"attention {rec.get('attention_backend')}")
    print(table(rows, cols))
    for b, s in rec.get("speedup_vs_best_hf", {}).items():
        print(f"B={b}: M* / best HF tokens/s = {s:.2f}x")
    closed = list(rec.get("mstar_closed", {}).values())
    if closed:
        print("\nM* in-process closed loop (4 x C requests, C in flight):")
        print(table(closed, [("concurrency", "C", 0), ("tokens_per_s", "tok/s", 1), ("vs_lockstep", "/ lockstep", 2),
                             ("ttfa_p50_ms", "TTFA p50 ms", 1), ("rtf_p50", "RTF p50", 3), ("rtf_p90", "p90", 3)]))
    for err in rec["errors"]:
        print("error:", err)
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
