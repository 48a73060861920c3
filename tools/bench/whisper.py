"""Whisper-large-v3 on 30 s clips, 128 tokens each: M* against its floor and transformers on the same weights.

    python tools/bench/whisper.py --out bench-whisper.json                                     # one H200, real size
    python tools/bench/whisper.py --device cpu --variant tiny --batches 2 --repeats 1 --tokens 8 --out /tmp/w.json

One process, one device, random (`dummy`) weights at the variant's size. Every request is
a 30 s clip of seeded noise (one whole window), `language = "en"`, no timestamps, and
exactly `--tokens` generated tokens (`min_tokens = max_tokens`: random weights would
otherwise stop at whatever step happens to pick <|endoftext|>):

- B = 1: latency per clip (features, encoder, cross K/V, language probe, prompt, the decode
  loop), p50 and p90 over `--repeats` `transcribe` requests after a warm-up, each alone;
- B = 16 / 64 (`--batches`): B requests submitted together; audio seconds per second =
  B x 30 / wall time, the best of `--repeats` runs, and the time against the floor;
- the floor, computed in the run: the encoder's FLOPs per clip (its linear layers over 1500
  positions, the two convolutions, attention over 1500 x 1500) plus the cross-attention K/V
  projection of the 1500 states, over the bf16 matmul peak measured now; then per decode
  step the decoder's weights (the embedding once, as the tied head reads it) plus every
  row's cross K/V (layers x 1500 x 2 x width bf16 values) over the read bandwidth measured
  now, or the step's FLOPs over the peak when larger; a batch's floor is the encoder part
  times B plus `--tokens` steps;
- the reference: transformers' `WhisperForConditionalGeneration` in bf16 (sdpa) holding the
  same weights (tests/whisper_reference.py), `generate` on the same log-mel features with
  the same prompt, `min_new_tokens = max_new_tokens`, batched as it batches (one
  `generate` call for the B clips): eagerly, and (`--compile-reference`) with the static
  cache and the forward compiled (`mode="reduce-overhead"`), as transformers' Whisper docs
  recommend; the agreement of its tokens with ours at B = 1 is reported.

Writes the figures as JSON and prints a table. `--budget` seconds bounds the optional parts.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # whisper_reference: the parity reference the tests use
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from common import (  # noqa: E402
    Budget,
    compile_and_load,
    environment,
    measure_bf16_peak,
    measure_read_bandwidth,
    percentile,
    reference_parser,
    sync,
    table,
    write_json,
)

WALK = ROOT / "models/whisper/whisper.walk"
CLIP_SECONDS = 30.0
RATE = 16000


def clip(i: int) -> torch.Tensor:
    """Request i's audio: one whole window (30 s) of seeded noise."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(int(CLIP_SECONDS * RATE), generator=g) * 0.1


def request(i: int, tokens: int) -> dict[str, Any]:
    """Request i: clip i in English, exactly `tokens` generated tokens (module docstring)."""
    return {"audio": clip(i), "language": "en", "max_tokens": tokens, "min_tokens": tokens}


def setup(variant: str, device: str, tokens: int) -> tuple[dict[str, Any], Any, Any]:
    """The walk's VARIANT compiled and loaded on DEVICE, one Worker (dummy weights) and its
    Conductor: (the plan's config, worker, conductor); `tokens` checked against the decoder's positions."""
    from mstar_runtime.control.conductor import Conductor
    from mstar_runtime.worker.worker import Worker

    plan = compile_and_load(WALK, variant, device)
    cfg = dict(plan.config)
    if not 1 <= tokens <= int(cfg["target_positions"]) - 4:
        raise SystemExit(f"--tokens must lie in [1, {int(cfg['target_positions']) - 4}]")
    worker = Worker(plan, 0, device, "dummy")
    return cfg, worker, Conductor(plan, {0: worker})


def transcribe(conductor: Any, batch: list[dict[str, Any]], tokens: int,
               device: str) -> tuple[list[dict[str, Any]], float]:
    """BATCH's `transcribe` requests submitted together and run to the end: their outputs and
    the wall seconds (the device synchronized on both sides); each must yield `tokens` tokens."""
    from mstar_runtime.control.conductor import FINISHED

    sync(device)
    t0 = time.perf_counter()
    hs = [conductor.submit("transcribe", r) for r in batch]
    conductor.run_until_idle()
    sync(device)
    dt = time.perf_counter() - t0
    for h in hs:
        if h.state != FINISHED:
            raise SystemExit(f"transcribe failed: {h.error}")
        if h.outputs["tokens"].numel() != tokens:
            raise SystemExit(f"a request generated {h.outputs['tokens'].numel()} tokens, not {tokens}")
    return [h.outputs for h in hs], dt


def floor_model(cfg: dict[str, Any], params: dict[str, int], value_bytes: int) -> dict[str, float]:
    """FLOPs of one clip's encoding and bytes / FLOPs of one decode step (module docstring)."""
    h, frames = int(cfg["hidden"]), int(cfg["source_positions"])
    mels, el, dl = int(cfg["mels"]), int(cfg["encoder_layers"]), int(cfg["decoder_layers"])
    conv = 2 * (2 * frames) * mels * 3 * h + 2 * frames * h * 3 * h
    conv_params = mels * 3 * h + h + 3 * h * h + h
    linear = 2 * (params["encoder"] - conv_params - frames * h) * frames  # positions are added, not multiplied
    attention = 4 * frames * frames * h * el
    cross_kv = 2 * (2 * h * h) * dl * frames
    positions = int(cfg["target_positions"]) * h  # one row of the position table is read per step
    cross_kv_bytes = dl * frames * 2 * h * value_bytes
    step_flops = 2 * (params["decoder"] - positions)  # per row: every weight once (the tied head included)
    return {"encoder_flops": conv + linear + attention + cross_kv, "cross_kv_bytes_per_row": cross_kv_bytes,
            "decoder_weight_bytes": (params["decoder"] - positions) * value_bytes, "step_flops_per_row": step_flops}


def floor_seconds(fm: dict[str, float], b: int, tokens: int, peak: float, bandwidth: float) -> dict[str, float]:
    encode = b * fm["encoder_flops"] / peak
    step = max((fm["decoder_weight_bytes"] + b * fm["cross_kv_bytes_per_row"]) / bandwidth,
               b * fm["step_flops_per_row"] / peak)
    return {"encode_s": encode, "step_s": step, "total_s": encode + tokens * step}


def main(argv: list[str] | None = None) -> int:
    ap = reference_parser(__doc__.split("\n")[0], [16, 64], "also time the reference with a static cache, compiled",
                          lambda ap: ap.add_argument("--tokens", type=int, default=128))
    args = ap.parse_args(argv)

    from mstar_models.whisper.features import N_SAMPLES, log_mel, mel_filters

    budget = Budget(args.budget)
    dev = args.device
    cuda = dev.startswith("cuda")
    cfg, worker, conductor = setup(args.variant, dev, args.tokens)
    nodes = {n: worker.engines[n].node for n in ("encoder", "decoder")}
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in nodes.items()}
    value_bytes = next(nodes["decoder"].parameters()).element_size()

    def run(batch: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
        return transcribe(conductor, batch, args.tokens, dev)

    peak = measure_bf16_peak(dev)
    bandwidth = measure_read_bandwidth(dev)
    fm = floor_model(cfg, params, value_bytes)
    report: dict[str, Any] = {"env": environment(dev), "variant": args.variant, "params": params,
                              "tokens": args.tokens, "bf16_peak_tflops": peak / 1e12,
                              "read_bandwidth_tbs": bandwidth / 1e12, "floor": fm}

    run([request(0, args.tokens)])  # warm-up
    lat = [run([request(0, args.tokens)])[1] for _ in range(args.repeats)]
    ours0 = run([request(0, args.tokens)])[0][0]["tokens"].tolist()
    f1 = floor_seconds(fm, 1, args.tokens, peak, bandwidth)
    report["b1"] = {"p50_ms": 1e3 * percentile(lat, 50), "p90_ms": 1e3 * percentile(lat, 90),
                    "floor_ms": 1e3 * f1["total_s"], "encode_floor_ms": 1e3 * f1["encode_s"],
                    "step_floor_ms": 1e3 * f1["step_s"]}
    report["b1"]["x_floor"] = report["b1"]["p50_ms"] / report["b1"]["floor_ms"]

    rows = []
    for b in args.batches:
        batch = [request(i, args.tokens) for i in range(b)]
        run(batch)  # warm-up at this size
        best = min(run(batch)[1] for _ in range(max(1, min(args.repeats, 3))))
        fb = floor_seconds(fm, b, args.tokens, peak, bandwidth)
        rows.append({"batch": b, "audio_s_per_s": b * CLIP_SECONDS / best, "ms": 1e3 * best,
                     "floor_ms": 1e3 * fb["total_s"], "x_floor": best / fb["total_s"],
                     "floor_audio_s_per_s": b * CLIP_SECONDS / fb["total_s"]})
    report["throughput"] = rows

    if not args.no_reference and budget.allows(120):
        from whisper_reference import from_nodes

        ref = from_nodes(nodes["encoder"], nodes["decoder"], cfg, dtype=torch.bfloat16)
        filters = torch.from_numpy(mel_filters(int(cfg["mels"]))).float().to(dev)
        window = torch.hann_window(400, device=dev)

        def features(n: int) -> torch.Tensor:
            audio = torch.stack([torch.nn.functional.pad(clip(i), (0, N_SAMPLES - clip(i).numel())) for i in range(n)])
            return log_mel(audio.to(dev), filters, window).to(torch.bfloat16)

        def generate(feats: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return ref.generate(feats, language="en", task="transcribe", max_new_tokens=args.tokens,
                                    min_new_tokens=args.tokens, force_unique_generate_call=True)

        def timed(feats: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
            got = generate(feats)
            times = []
            for _ in range(max(1, min(args.repeats, 3))):
                sync(dev)
                t0 = time.perf_counter()
                generate(feats)
                sync(dev)
                times.append(time.perf_counter() - t0)
            return got, times

        def reference_rows(mode: str) -> dict[str, Any]:
            got, times = timed(features(1))
            theirs = got[0].tolist()[-args.tokens:]
            same = sum(a == b for a, b in zip(ours0, theirs, strict=False))
            row: dict[str, Any] = {"b1_p50_ms": 1e3 * percentile(times, 50),
                                   "speedup_b1": percentile(times, 50) / percentile(lat, 50),
                                   "b1_tokens_equal": same / args.tokens,
                                   "b1_first_difference": next((i for i, (a, b) in enumerate(zip(ours0, theirs))
                                                                if a != b), None)}
            for r in rows:
                _, t = timed(features(r["batch"]))
                best = min(t)
                row[f"b{r['batch']}_ms"] = 1e3 * best
                row[f"b{r['batch']}_audio_s_per_s"] = r["batch"] * CLIP_SECONDS / best
                row[f"speedup_b{r['batch']}"] = best / (1e-3 * r["ms"])
            row["mode"] = mode
            return row

        report["reference"] = [reference_rows("eager, dynamic cache")]
        if args.compile_reference and cuda and budget.allows(900):
            mode = "static cache, forward compiled (reduce-overhead)"
            ref.generation_config.cache_implementation = "static"
            ref.forward = torch.compile(ref.forward, mode="reduce-overhead", fullgraph=True)
            try:
                report["reference"].append(reference_rows(mode))
            except Exception as e:  # a transformers/torch combination that does not compile: say so, keep the rest
                report["reference"].append({"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]})

    write_json(args.out, report)
    b1 = report["b1"]
    print(f"whisper {args.variant} on {dev}: peak {peak / 1e12:.0f} TFLOP/s, read {bandwidth / 1e12:.2f} TB/s; "
          f"{fm['encoder_flops'] / 1e12:.2f} TFLOP to encode a clip, "
          f"{(fm['decoder_weight_bytes'] + fm['cross_kv_bytes_per_row']) / 1e9:.2f} GB read per decode step at B=1")
    print(f"B=1: p50 {b1['p50_ms']:.1f} ms (p90 {b1['p90_ms']:.1f}), floor {b1['floor_ms']:.1f} ms "
          f"(encode {b1['encode_floor_ms']:.1f}, {args.tokens} steps of {b1['step_floor_ms']:.2f}): "
          f"{b1['x_floor']:.2f}x")
    if rows:
        print(table(rows, [("batch", "B", 0), ("audio_s_per_s", "audio s/s", 1), ("ms", "ms", 1),
                           ("floor_ms", "floor ms", 1), ("x_floor", "x floor", 2)]))
    for r in report.get("reference", []):
        print("transformers (bf16, sdpa):", {k: round(v, 4) if isinstance(v, float) and not math.isnan(v) else v
                                             for k, v in r.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
