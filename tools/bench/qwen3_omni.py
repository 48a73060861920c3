"""Qwen3-Omni-30B-A3B: M* against transformers' `generate(..., return_audio=True)` on the same weights, one process.

    python tools/bench/qwen3_omni.py --out $OUT/qwen3_omni.json                     # H200: real size
    python tools/bench/qwen3_omni.py --device cpu --variant tiny --batches 1,2 --tokens 4 --frames 10 \
        --chat-batches 1,2 --chat-tokens 8 --out /tmp/qwen3_omni.json               # smoke

What runs (every figure in the JSON written to --out, rewritten after every measurement; a
part that fails is recorded under `errors` and the rest still runs):
- M*: models/qwen3_omni/qwen3_omni.walk compiled for --placement (placements/h200x1.yaml, on
  the CPU placements/cpu.yaml), run through a Conductor with rank 0's Worker in this process,
  weights from --weights (default `dummy`: deterministic random weights).
  - speech, for each B of --batches: B requests submitted at once, prompts from the built-in
    set of 32 English sentences of similar length (SeedTTS-style "read this aloud" requests;
    request i reads sentence i mod 32), the walk's sampling defaults, `max_tokens = --tokens`
    text tokens and exactly `--frames` codec frames (80 ms each) per request. The fixed length
    comes from the talker: its codec-eos logit is masked in this process (the node's `allowed`
    buffer), so no frame ends a request early and every request makes `--frames` frames, the
    last ones on tts_pad after its text. Figures: audio seconds per second (all requests'
    audio over the wall time, prefill and Code2Wav included), TTFA p50 / p90 (submit -> the
    first audio chunk: `c2w_chunk` frames through Code2Wav; on a GPU a CUDA event recorded
    when the chunk is emitted), RTF p50 (a request's generation time over its audio length),
    the frame period (mean interval between the talker's frame launches), per-node steps
    and mean batch sizes.
  - chat (text out), for each B of --chat-batches and mode of --chat-modes: `sampled` (the
    walk's defaults, top-k 20) and `greedy`, whose rows alike join the decode cohort;
    `--chat-tokens` tokens at most per request (the text's own end is kept: tokens are
    counted as generated). Text tokens/s and TTFT p50.
  - parity: one greedy speech request (thinker and talker; --parity-tokens, --parity-frames)
    whose text and codec codes are compared with transformers' on the same weights.
- transformers (unless --skip-hf): `Qwen3OmniMoeForConditionalGeneration` built from the
  plan's config, with every parameter taken from M*'s nodes by name (shared storage, no
  copy; see `share_weights`: the nodes carry the checkpoint's names, which transformers 5.x
  renames in memory and whose per-expert tensors it fuses), after M*'s KV pools and graphs
  are freed. At B = 1 only: `generate(..., return_audio=True)` with the same prompt ids,
  sampling settings, `--tokens` text tokens (`thinker_min_new_tokens`) and `--frames` frames
  of codes (`talker_min_new_tokens = talker_max_new_tokens = frames + 1`: HF computes a
  frame's residual codes at the next talker step), timed per stage (thinker, talker,
  Code2Wav); its audio exists only when generate returns, so its TTFA is its whole call. And
  `generate(..., return_audio=False)` for the text tokens/s. The version of transformers and
  its attention / experts implementations are recorded (the GPU machine may hold another
  version than the CPU venv: both 5.17 and 5.24 layouts are handled).
- Floors: the bytes a step must read over the read bandwidth of a `x.sum()` measured in this
  run. MoE active bytes: a step of n tokens through a layer of E experts with top-k routing
  reads E * (1 - (1 - k / E)^n) experts' gate/up/down weights (the expected number of
  distinct experts n tokens pick when each picks k of E uniformly; k at n = 1, nearly all E at
  large n), plus every dense tensor (attention, norms, router, the talker's shared expert), the
  output heads in full, one embedding row per token, and the KV of the context. A thinker
  token = one thinker step; a talker frame = one talker step plus the code predictor's
  `code_groups - 1` steps (each its dense layers and one of its heads) plus Code2Wav's weights
  once per `c2w_chunk` frames; a text frame also reads the talker's text projection and, but
  for the first (the prefill's item), one thinker step.
  The speech floor of a run adds the prefills (B prompts' tokens through the thinker and the
  talker) and is given as audio seconds per second; FLOPs are not counted (at these batch
  sizes the steps are bandwidth-bound).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402 - the sibling module, found through the line above
    Budget,
    Launches,
    environment,
    gpu_memory,
    measure_read_bandwidth,
    on_path,
    percentile,
    reset_peak,
    sync,
    table,
    write_json,
)

WALK = ROOT / "models/qwen3_omni/qwen3_omni.walk"
INSTRUCTION = "Read this sentence aloud: "
# 32 English sentences of 58..65 characters, written for this benchmark in the manner of the
# SeedTTS English test set (short, plain declarative sentences): similar lengths give prompts of
# nearly the same token count, recorded in the JSON.
SENTENCES = (
    "The old lighthouse keeper climbed the stairs every single night.",
    "She planted tomatoes along the fence before the first warm rain.",
    "Our train was delayed because a tree had fallen across the line.",
    "He wrapped the fragile vase in newspaper and packed it carefully.",
    "The children built a snowman with a carrot nose and coal eyes.",
    "A gentle breeze carried the smell of fresh bread down the street.",
    "The museum opens at nine, but the queue starts forming at eight.",
    "They painted the kitchen a pale shade of yellow last summer.",
    "My grandmother keeps her recipes in a box tied with blue ribbon.",
    "The river rose quickly after three days of heavy mountain rain.",
    "He practised the violin for an hour before every school concert.",
    "The bakery on the corner sells the best cinnamon rolls in town.",
    "We watched the sunset from the top of the hill behind the farm.",
    "The library will be closed on Monday for the spring holiday.",
    "A small dog chased the ball across the park and brought it back.",
    "The pilot announced that we would land twenty minutes early.",
    "She wrote a long letter to her friend who had moved overseas.",
    "The gardener trimmed the hedges into neat rectangular shapes.",
    "Fresh snow covered the cars parked along the narrow avenue.",
    "The teacher asked everyone to read the first chapter by Friday.",
    "Our neighbours hosted a barbecue to celebrate the long weekend.",
    "The scientist checked the results twice before publishing them.",
    "A flock of geese flew south in a wide and perfect formation.",
    "He found his missing keys under the cushion of the old sofa.",
    "The concert hall fell silent as the conductor raised his baton.",
    "They rented a small cabin by the lake for the whole of August.",
    "The market was crowded with people buying fruit and flowers.",
    "She fixed the broken chair with glue and a few small screws.",
    "The storm knocked out the power for most of the afternoon.",
    "Every morning he walks his dog along the beach before work.",
    "The new bridge will connect the two halves of the old city.",
    "The cat slept in a patch of sunlight on the warm wooden floor.",
)
PROMPTS = tuple(INSTRUCTION + s for s in SENTENCES)
GREEDY = {"temperature": 0.0, "top_k": 0, "talker_do_sample": False}
# the walk's speech defaults (HF generate's talker defaults), given to HF as they are to M*
THINKER_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
TALKER_SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}

log = logging.getLogger("bench.qwen3_omni")


# ------------------------------------------------------------------------------ set-up
def default_placement(device: str) -> Path:
    return ROOT / ("placements/cpu.yaml" if device == "cpu" else "placements/h200x1.yaml")


def compile_plan(variant: str, placement: Path, workdir: Path, weights: str) -> Path:
    out = workdir / f"qwen3_omni-{variant}.plan"
    cmd = [sys.executable, "-m", "mstarc.cli", "compile", str(WALK), "--variant", variant, "-p", str(placement),
           "-o", str(out)]
    if weights not in ("dummy", "random"):
        cmd += ["--weights", weights]  # from_checkpoint values and the files' hashes
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"compile failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


class _Probe:
    """Conductor listener: text pieces per request (one per generated token: the walk's
    detokenize runs once per id), and when each request's first text and first audio exist.

    On a GPU a timing event is recorded on the current stream when the first audio chunk is
    emitted (the stream is then ordered after its Code2Wav decode) and converted against an
    event recorded at the start: no synchronisation in the middle of the run."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pieces: dict[str, int] = {}
        self.first_text: dict[str, float] = {}
        self.first_audio: dict[str, float] = {}
        self._events: dict[str, Any] = {}
        self.t0 = 0.0
        self._start: Any = None

    def begin(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def on_output(self, request: Any, name: str, value: Any) -> None:
        rid = request.id
        if name == "text":
            self.pieces[rid] = self.pieces.get(rid, 0) + 1
            self.first_text.setdefault(rid, time.perf_counter())
        elif name == "audio_out" and rid not in self.first_audio and rid not in self._events:
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self._events[rid] = ev
            else:
                self.first_audio[rid] = time.perf_counter()

    def on_finish(self, request: Any) -> None:
        pass

    def audio_times(self) -> dict[str, float]:
        """Request id -> perf_counter time of its first audio (call after the device is synchronised)."""
        for rid, ev in self._events.items():
            self.first_audio[rid] = self.t0 + self._start.elapsed_time(ev) / 1e3
        return self.first_audio


class _Windows:
    """Records the codec frames Code2Wav decodes while in a `with` (each frame once: a window's
    left-context frames are dropped), for the parity check of one request."""

    def __init__(self, node: Any):
        self.node, self.frames = node, []

    def __enter__(self) -> _Windows:
        original = self.node.phase_decode

        def recording(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
            for e in batch:
                self.frames.append(e["codes"][int(e.get("codes:context", 0)):].to("cpu", torch.long))
            return original(batch)

        self.node.phase_decode = recording
        return self

    def __exit__(self, *exc: object) -> None:
        del self.node.phase_decode

    def codes(self) -> torch.Tensor:
        return torch.cat(self.frames) if self.frames else torch.zeros(0, 0, dtype=torch.long)


def node_stats(worker: Any) -> dict[str, dict[str, dict[str, float]]]:
    return {n: {p: dict(v) for p, v in ph.items()} for n, ph in worker.stats()["nodes"].items()}


def stats_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per `node.phase`: steps, mean entries per step and host ms per step over one run."""
    out: dict[str, dict[str, float]] = {}
    for node, phases in after.items():
        for phase, a in phases.items():
            b = before.get(node, {}).get(phase, {"steps": 0, "entries": 0, "seconds": 0.0})
            steps = a["steps"] - b["steps"]
            if steps:
                out[f"{node}.{phase}"] = {"steps": steps, "mean_batch": (a["entries"] - b["entries"]) / steps,
                                          "host_ms": (a["seconds"] - b["seconds"]) / steps * 1e3}
    return out


def mask_codec_eos(talker: Any) -> int:
    """No frame can sample codec eos: every request makes exactly its `talker_max_frames` frames."""
    eos = int(talker.tok.codec_eos_token_id)
    with torch.no_grad():
        talker.allowed[eos] = False
    return eos


# ------------------------------------------------------------------------------ M*
def speech_inputs(i: int, tokens: int, frames: int, seed: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "talker_max_frames": frames, "seed": seed + i}


def run_requests(plan: Any, worker: Any, device: torch.device, walk: str, inputs: list[dict[str, Any]],
                 path: str, launch_node: str, launch_phases: tuple[str, ...]) -> dict[str, Any]:
    """One batch of requests through a fresh conductor; what every figure is computed from."""
    from mstar_runtime.control.conductor import Conductor

    conductor = Conductor(on_path(plan, path), {0: worker}, max_running=len(inputs))
    probe = _Probe(device)
    before = node_stats(worker)
    sync(device)
    launches = Launches(worker, launch_node, launch_phases)
    probe.begin()
    reqs = [conductor.submit(walk, dict(x), listener=probe) for x in inputs]
    try:
        conductor.run_until_idle()
    finally:
        launches.close()
    sync(device)
    wall = time.perf_counter() - probe.t0
    failed = [f"{r.id}: {r.error}" for r in reqs if r.state != "finished"]
    if failed:
        raise RuntimeError(f"M* {walk} requests failed: " + "; ".join(failed[:3]))
    return {"reqs": reqs, "wall": wall, "probe": probe, "audio_at": probe.audio_times(), "period": launches.period(),
            "nodes": stats_delta(before, node_stats(worker)), "cohort_steps": int(conductor.stats["cohort_steps"]),
            "wasted_steps": int(conductor.stats["wasted_steps"])}


def run_speech(plan: Any, worker: Any, device: torch.device, batch: int, tokens: int, frames: int, seed: int,
               path: str, c2w: Any, rate: float) -> dict[str, Any]:
    inputs = [speech_inputs(i, tokens, frames, seed) for i in range(batch)]
    r = run_requests(plan, worker, device, "speech", inputs, path, "talker", ("frame", "frame_pad"))
    reqs, wall, probe = r["reqs"], r["wall"], r["probe"]
    samples = [sum(int(x.numel()) for x in q.outputs.get("audio_out", [])) for q in reqs]
    made = [frames_of(c2w, s) for s in samples]
    audio = [s / rate for s in samples]
    ttfa = [r["audio_at"][q.id] - q.stats.submitted_at for q in reqs if q.id in r["audio_at"]]
    rtf = [(q.stats.finished_at - q.stats.submitted_at) / a for q, a in zip(reqs, audio, strict=True) if a > 0]
    text = [probe.pieces.get(q.id, 0) for q in reqs]
    return {
        "batch": batch, "wall_s": wall, "requests": batch, "frames": sum(made), "min_frames": min(made),
        "max_frames": max(made), "audio_s": sum(audio), "audio_s_per_s": sum(audio) / wall,
        "ttfa_p50_ms": _ms(percentile(ttfa, 50)), "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
        "rtf_p50": percentile(rtf, 50), "rtf_max": max(rtf) if rtf else None,
        "text_tokens": sum(text), "text_tokens_per_s": sum(text) / wall,
        "frame_ms": _ms(r["period"]), "wall_per_frame_ms": wall / max(frames, 1) * 1e3,
        "wasted_steps": r["wasted_steps"], "nodes": r["nodes"],
    }


def frames_of(c2w: Any, samples: int) -> int:
    """Codec frames behind `samples` streamed samples (the windows tile one full decode: 1920 T - 555)."""
    if samples == 0:
        return 0
    frames = (samples + c2w.trim) // c2w.samples_per_frame
    if c2w.output_length(frames) != samples:
        raise RuntimeError(f"{samples} audio samples are not whole codec frames")
    return int(frames)


def run_chat(plan: Any, worker: Any, device: torch.device, batch: int, tokens: int, seed: int, mode: str,
             path: str) -> dict[str, Any]:
    extra = {"temperature": 0.0, "top_k": 0} if mode == "greedy" else {}
    inputs = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "seed": seed + i, **extra}
              for i in range(batch)]
    r = run_requests(plan, worker, device, "chat", inputs, path, "thinker", ("decode",))
    reqs, wall, probe = r["reqs"], r["wall"], r["probe"]
    text = [probe.pieces.get(q.id, 0) for q in reqs]
    ttft = [probe.first_text[q.id] - q.stats.submitted_at for q in reqs if q.id in probe.first_text]
    return {"batch": batch, "mode": mode, "wall_s": wall, "tokens": sum(text), "min_tokens": min(text),
            "tokens_per_s": sum(text) / wall, "ttft_p50_ms": _ms(percentile(ttft, 50)),
            "step_ms": _ms(r["period"]), "cohort_steps": r["cohort_steps"], "nodes": r["nodes"]}


def tokenizer_source(weights: str) -> str:
    """Which tokenizer the processor uses: the checkpoint's files, else its bundled byte-level
    512-id one (whose ids a dummy-weight run of the real size relabels to Qwen's special ids)."""
    folder = Path(weights)
    if weights not in ("dummy", "random") and any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        return "checkpoint"
    return "bundled (tiny)"


def prompt_ids(proc: Any, n: int) -> list[torch.Tensor]:
    """The ids M*'s processor builds for the first n prompts (HF is given the same)."""
    out = proc.run("build", [{"prompt": PROMPTS[i % len(PROMPTS)], "system": "", "audio": None, "image": None}
                             for i in range(n)])
    return [o["ids"].to("cpu", torch.long) for o in out]


# ------------------------------------------------------------------------------ floors
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expected_experts(experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts `tokens` tokens touch when each picks top_k of `experts` uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens) if tokens > 0 else 0.0


def lm_profile(node: Any, rows: tuple[str, ...], once: tuple[str, ...] = (), skip: str = "//") -> dict[str, Any]:
    """What one step of a decoder node reads: `dense` bytes (every parameter but the experts,
    the tables named in `rows`, of which a token reads one row, the tensors named in `once`,
    read at prefill only, and those under `skip`, a submodule counted on its own), per-layer
    MoE geometry, and the row bytes of the tables."""
    from mstar_models.qwen3_omni.moe import SparseMoE

    dense = row = 0
    for name, p in node.named_parameters():
        if ".experts." in name or any(o in name for o in once) or name.startswith(skip):
            continue
        if any(r in name for r in rows):
            row += p.shape[-1] * p.element_size()
            continue
        dense += _nbytes(p)
    moes = [m for m in node.modules() if isinstance(m, SparseMoE)]
    expert = (_nbytes(moes[0].gate_up) + _nbytes(moes[0].down)) // moes[0].gate_up.shape[0] if moes else 0
    geo = node.kv_geometry
    itemsize = next(node.parameters()).element_size()
    return {"dense_bytes": dense, "row_bytes": row, "moe_layers": len(moes),
            "experts": moes[0].gate_up.shape[0] if moes else 0, "top_k": moes[0].top_k if moes else 0,
            "expert_bytes": expert, "kv_bytes_per_token": geo.layers * 2 * geo.kv_heads * geo.head_dim * itemsize}


def step_bytes(p: Mapping[str, Any], tokens: float, context: float) -> float:
    """Bytes a step of `tokens` tokens reads (KV of `context` tokens in all): see the module docstring."""
    experts = expected_experts(p["experts"], p["top_k"], tokens) if p["experts"] else 0.0
    return (p["dense_bytes"] + p["moe_layers"] * experts * p["expert_bytes"] + tokens * p["row_bytes"]
            + context * p["kv_bytes_per_token"])


def floor_profile(worker: Any) -> dict[str, Any]:
    e = worker.engines
    cp = e["talker"].node.code_predictor
    groups = int(cp.groups) - 1
    head = sum(_nbytes(w.weight) for w in cp.lm_head)
    cp_dense = sum(_nbytes(p) for n, p in cp.named_parameters() if not n.startswith(("lm_head", "model.codec_embedding")))
    cp_row = sum(w.weight.shape[-1] * w.weight.element_size() for w in cp.model.codec_embedding) // max(groups, 1)
    c2w = sum(_nbytes(p) for p in e["code2wav"].node.parameters())
    talker = e["talker"].node
    # the projections run at prefill (hidden_projection for media rows only) and, text_projection, on
    # each text item: a tts_pad frame reuses the projected pad
    profile = lm_profile(talker, rows=("codec_embedding",), once=("hidden_projection", "text_projection"),
                         skip="code_predictor.")
    profile["text_projection_bytes"] = sum(_nbytes(p) for p in talker.text_projection.parameters())
    return {
        "thinker": lm_profile(e["thinker"].node, rows=("embed_tokens",)),
        "talker": profile,
        # one step: the dense layers, one of the heads, one embedding row, its <= 16-token context
        "code_predictor": {"steps_per_frame": groups, "step_bytes": cp_dense + head / max(groups, 1) + cp_row},
        "code2wav": {"bytes": c2w, "chunk_frames": int(worker.plan.config.get("c2w_chunk", 25))},
    }


def frame_floor_bytes(f: Mapping[str, Any], batch: int, talker_ctx: float) -> float:
    """Bytes one tts_pad frame of a batch must read: the talker step, the predictor's steps and
    Code2Wav's share of a window."""
    total = step_bytes(f["talker"], batch, batch * talker_ctx)
    total += f["code_predictor"]["steps_per_frame"] * f["code_predictor"]["step_bytes"]
    return total + f["code2wav"]["bytes"] / f["code2wav"]["chunk_frames"]


def speech_floor(f: Mapping[str, Any], batch: int, prompt: float, tokens: int, frames: int, audio_s: float,
                 bw: float) -> dict[str, float]:
    """The floor of one speech run of `batch` requests (prompt = mean prompt ids)."""
    talker_prompt = prompt + 5  # the user turn's rows, the assistant header, 4 tts_pad, tts_bos
    thinker_ctx, talker_ctx = prompt + tokens / 2, talker_prompt + frames / 2
    pad_frame = frame_floor_bytes(f, batch, talker_ctx)
    thinker_step = step_bytes(f["thinker"], batch, batch * thinker_ctx)
    # a text frame projects its item; all but the first (the prefill's item) follow a thinker step
    text_frame = pad_frame + f["talker"]["text_projection_bytes"] + thinker_step
    total = step_bytes(f["thinker"], batch * prompt, batch * prompt) + step_bytes(f["talker"], batch * talker_prompt,
                                                                                  batch * talker_prompt)
    text_frames = min(tokens, frames)
    frame_bytes = text_frames * text_frame - thinker_step + (frames - text_frames) * pad_frame
    seconds = (total + frame_bytes) / bw
    return {"floor_s": seconds, "audio_s_per_s_floor": audio_s / seconds, "text_frame_floor_ms": text_frame / bw * 1e3,
            "pad_frame_floor_ms": pad_frame / bw * 1e3, "frame_floor_ms": frame_bytes / max(frames, 1) / bw * 1e3,
            "thinker_token_floor_ms": thinker_step / bw * 1e3}


def chat_floor(f: Mapping[str, Any], batch: int, prompt: float, tokens: int, bw: float) -> dict[str, float]:
    step = step_bytes(f["thinker"], batch, batch * (prompt + tokens / 2))
    total = step_bytes(f["thinker"], batch * prompt, batch * prompt) + max(tokens - 1, 0) * step
    return {"step_floor_ms": step / bw * 1e3, "floor_s": total / bw, "tokens_per_s_floor": batch * tokens / (total / bw)}


# ------------------------------------------------------------------------------ transformers
@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init), their
    buffers as usual (rotary tables, code offsets): the parameters are then set from M*'s."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def hf_config(cfg: Mapping[str, Any], tok: Any) -> Any:
    """transformers' config of the plan's sizes and the nodes' token ids (its class defaults are
    not the released values: every value the nodes use is given)."""
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C

    g = lambda k, d=None: cfg.get(k, d)  # noqa: E731 - a local shorthand
    mrope = {"rope_type": "default", "rope_theta": float(g("rope_theta", 1e6)),
             "mrope_section": [int(s) for s in g("mrope_section", _mrope(int(g("head_dim"))))], "interleaved": True}
    talker_mrope = dict(mrope, mrope_section=[int(s) for s in g("talker_mrope_section", _mrope(int(g("talker_head_dim"))))])
    media = {k: getattr(tok, k) for k in ("audio_token_id", "image_token_id", "video_token_id", "audio_start_token_id",
                                          "vision_start_token_id")}
    text = dict(vocab_size=g("vocab"), hidden_size=g("hidden"), num_hidden_layers=g("layers"),
                num_attention_heads=g("heads"), num_key_value_heads=g("kv_heads"), head_dim=g("head_dim"),
                num_experts=g("experts"), num_experts_per_tok=g("experts_per_token"),
                moe_intermediate_size=g("moe_intermediate"), norm_topk_prob=True, rms_norm_eps=1e-6,
                max_position_embeddings=65536, rope_parameters=mrope)
    thinker = dict(
        text_config=text,
        audio_config=dict(num_mel_bins=g("mel_bins"), encoder_layers=g("audio_layers"), d_model=g("audio_dim"),
                          encoder_attention_heads=g("audio_heads"), encoder_ffn_dim=g("audio_ffn"),
                          downsample_hidden_size=g("audio_conv_dim"), output_dim=g("hidden"),
                          n_window=g("audio_n_window", 50), n_window_infer=g("audio_n_window_infer", 800)),
        vision_config=dict(depth=g("vis_depth"), hidden_size=g("vis_hidden"), num_heads=g("vis_heads"),
                           intermediate_size=g("vis_intermediate"), out_hidden_size=g("hidden"),
                           patch_size=g("vis_patch"), temporal_patch_size=g("vis_temporal_patch"),
                           spatial_merge_size=g("vis_merge"), num_position_embeddings=g("vis_positions"),
                           deepstack_visual_indexes=list(g("vis_deepstack"))),
        position_id_per_seconds=int(tok.position_id_per_seconds), user_token_id=tok.user_token_id, **media)
    talker_text = dict(vocab_size=g("codec_vocab"), hidden_size=g("talker_hidden"),
                       intermediate_size=g("talker_intermediate"), num_hidden_layers=g("talker_layers"),
                       num_attention_heads=g("talker_heads"), num_key_value_heads=g("talker_kv_heads"),
                       head_dim=g("talker_head_dim"), num_experts=g("talker_experts"),
                       num_experts_per_tok=g("talker_experts_per_token", 6),
                       moe_intermediate_size=g("talker_moe_intermediate"),
                       shared_expert_intermediate_size=g("talker_shared_intermediate"), norm_topk_prob=True,
                       rms_norm_eps=1e-6, max_position_embeddings=65536, rope_parameters=talker_mrope)
    predictor = dict(vocab_size=g("codebook_size"), hidden_size=g("cp_hidden"), intermediate_size=g("cp_intermediate"),
                     num_hidden_layers=g("cp_layers"), num_attention_heads=g("cp_heads"),
                     num_key_value_heads=g("cp_kv_heads"), head_dim=g("cp_head_dim"), num_code_groups=g("code_groups"),
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    codec = {k: getattr(tok, k) for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                                          "codec_think_bos_id", "codec_think_eos_id")}
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=g("code_groups"),
                  thinker_hidden_size=g("hidden"), accept_hidden_layer=g("accept_hidden_layer"),
                  spatial_merge_size=g("vis_merge"), position_id_per_seconds=int(tok.position_id_per_seconds),
                  speaker_id=dict(tok.speakers), **codec, **media)
    code2wav = dict(num_hidden_layers=g("c2w_layers"), hidden_size=g("c2w_hidden"), num_attention_heads=g("c2w_heads"),
                    num_key_value_heads=g("c2w_kv_heads"), intermediate_size=g("c2w_intermediate"),
                    num_quantizers=g("code_groups"), codebook_size=g("codebook_size"), decoder_dim=g("c2w_decoder_dim"),
                    upsample_rates=list(g("c2w_upsample_rates")), upsampling_ratios=list(g("c2w_upsampling_ratios")),
                    sliding_window=g("c2w_sliding_window", 72),
                    rope_parameters={"rope_type": "default", "rope_theta": float(g("c2w_rope_theta", 10000.0))})
    top = {k: getattr(tok, k) for k in ("im_start_token_id", "im_end_token_id", "system_token_id", "user_token_id",
                                        "assistant_token_id", "tts_pad_token_id", "tts_bos_token_id",
                                        "tts_eos_token_id")}
    return C.Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, **top)


def _mrope(head_dim: int) -> list[int]:
    from mstar_models.qwen3_omni.positions import default_mrope_section

    return list(default_mrope_section(head_dim))


# transformers 5.x's module tree against the checkpoint's names (which the nodes carry): 5.17
# keeps the checkpoint's layout; 5.24 nests the thinker's parts under thinker.model.
RENAMES = (("thinker.model.language_model.", "thinker.model."), ("thinker.model.audio_tower.", "thinker.audio_tower."),
           ("thinker.model.visual.", "thinker.visual."))
FUSED = {"gate_up_proj": "gate_up", "down_proj": "down"}  # transformers' fused expert tensor -> SparseMoE buffer


def checkpoint_tensors(worker: Any) -> dict[str, tuple[Any, str, torch.Tensor]]:
    """Checkpoint name -> (node module, its state-dict name, tensor) over every node of the worker."""
    from mstar_runtime.weights import checkpoint_name

    out: dict[str, tuple[Any, str, torch.Tensor]] = {}
    for engine in worker.engines.values():
        node = engine.node
        for name, t in node.state_dict(keep_vars=True).items():
            out[checkpoint_name(node, name)] = (node, name, t)
    return out


def hf_source(name: str, shape: tuple[int, ...], ckpt: Mapping[str, tuple[Any, str, torch.Tensor]],
              used: set[str]) -> torch.Tensor:
    """The M* tensor behind transformers' parameter `name` (see RENAMES and FUSED)."""
    candidates = [name] + [new + name[len(old):] for old, new in RENAMES if name.startswith(old)]
    for c in candidates:
        if c in ckpt:
            used.add(c)
            return ckpt[c][2]
    leaf = name.rsplit(".", 1)[-1]
    if leaf in FUSED and name.endswith(f".experts.{leaf}"):
        for c in candidates:
            prefix = c[: -len(leaf)]  # "...mlp.experts."
            first = prefix + ("0.gate_proj.weight" if leaf == "gate_up_proj" else "0.down_proj.weight")
            if first in ckpt:
                node, node_name, _ = ckpt[first]
                moe = node.get_submodule(node_name.rsplit(".experts.", 1)[0])
                kinds = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
                used.update(k for k in ckpt if k.startswith(prefix) and k.rsplit(".", 2)[-2] in kinds)
                return getattr(moe, FUSED[leaf])
    raise KeyError(name)


def share_weights(model: nn.Module, worker: Any) -> dict[str, Any]:
    """Every parameter of `model` (built under `parameters_on_meta`) set to the M* tensor of the
    same checkpoint name, storage shared. Raises naming what has no counterpart either way."""
    ckpt = checkpoint_tensors(worker)
    used: set[str] = set()
    missing, mismatched = [], []
    plan: list[tuple[nn.Module, str, torch.Tensor]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        try:
            src = hf_source(name, tuple(p.shape), ckpt, used)
        except KeyError:
            missing.append(name)
            continue
        if tuple(src.shape) != tuple(p.shape):
            mismatched.append(f"{name} {list(p.shape)} vs M* {list(src.shape)}")
            continue
        owner, _, leaf = name.rpartition(".")
        plan.append((model.get_submodule(owner) if owner else model, leaf, src))
    # every M* parameter must be used (buffers such as rotary tables are each side's own)
    params = {id(t) for e in worker.engines.values() for t in e.node.parameters()}
    unused = sorted(k for k, (_, _, t) in ckpt.items() if k not in used and id(t) in params)
    if missing or mismatched or unused:
        raise RuntimeError(f"weights do not map one to one: {len(missing)} transformers parameters without an M* "
                           f"tensor {missing[:3]}, {len(mismatched)} of another shape {mismatched[:3]}, "
                           f"{len(unused)} M* tensors unused {unused[:3]}")
    for module, leaf, src in plan:
        module._parameters[leaf] = nn.Parameter(src, requires_grad=False)
    unique = {id(src): src for _, _, src in plan}
    return {"parameters": len(plan), "gb": sum(_nbytes(t) for t in unique.values()) / 1e9}


def build_hf(worker: Any, device: torch.device) -> tuple[Any, dict[str, Any]]:
    import transformers
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"transformers {transformers.__version__}: the baseline needs 5.x (fused experts, "
                           "rope_parameters)")
    cfg = hf_config(dict(worker.plan.config), worker.engines["thinker"].node.tok)
    with parameters_on_meta():
        model = M.Qwen3OmniMoeForConditionalGeneration(cfg)
    info = share_weights(model, worker)
    model.to(device)  # the buffers (the parameters are already there)
    model.eval()
    text = getattr(model.thinker.config, "text_config", model.config)
    info.update(version=transformers.__version__, attention=getattr(text, "_attn_implementation", None),
                experts=getattr(text, "_experts_implementation", None))
    return model, info


class _Stages:
    """Times of transformers' stages inside one generate: the thinker, the talker, Code2Wav (the
    device synchronised around each), and the codes Code2Wav was given."""

    def __init__(self, model: Any, device: torch.device):
        self.model, self.device, self.seconds, self.codes = model, device, {}, None
        self._parts = [(model.thinker, "generate", "thinker_s")]
        if hasattr(model, "talker"):
            self._parts += [(model.talker, "generate", "talker_s"), (model.code2wav, "chunked_decode", "code2wav_s")]

    def __enter__(self) -> _Stages:
        for module, fn, key in self._parts:
            original = getattr(module, fn)

            def timed(*a: Any, _f: Callable[..., Any] = original, _k: str = key, **kw: Any) -> Any:
                if _k == "code2wav_s":
                    self.codes = a[0].detach().to("cpu") if a else kw["codes"].detach().to("cpu")
                sync(self.device)
                t0 = time.perf_counter()
                out = _f(*a, **kw)
                sync(self.device)
                self.seconds[_k] = self.seconds.get(_k, 0.0) + time.perf_counter() - t0
                return out

            object.__setattr__(module, fn, timed)  # an instance attribute over the class's method
        return self

    def __exit__(self, *exc: object) -> None:
        for module, fn, _ in self._parts:
            with contextlib.suppress(AttributeError):
                object.__delattr__(module, fn)


def hf_speech(model: Any, ids: torch.Tensor, device: torch.device, tokens: int, frames: int, seed: int,
              greedy: bool, rate: float) -> dict[str, Any]:
    """One `generate(..., return_audio=True)` at B = 1 (frames of codes: frames + 1 talker steps)."""
    tok = model.config
    kw: dict[str, Any] = dict(speaker="ethan", return_audio=True, thinker_max_new_tokens=tokens,
                              thinker_eos_token_id=tok.im_end_token_id, talker_max_new_tokens=frames + 1,
                              talker_min_new_tokens=frames + 1)
    if greedy:
        kw.update(thinker_do_sample=False, talker_do_sample=False)
    else:
        kw.update(thinker_do_sample=True, thinker_min_new_tokens=tokens,
                  **{f"thinker_{k}": v for k, v in THINKER_SAMPLING.items()},
                  **{f"talker_{k}": v for k, v in TALKER_SAMPLING.items()})
    x = ids[None].to(device)
    torch.manual_seed(seed)
    reset_peak(device)
    with _Stages(model, device) as st, torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        seqs, wav = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
        sync(device)
        wall = time.perf_counter() - t0
    wav = wav[0] if isinstance(wav, list) else wav
    samples = int(wav.numel())
    new = seqs[0, x.shape[1]:].to("cpu").tolist()
    audio = samples / rate
    codes = st.codes[0].T if st.codes is not None else torch.zeros(0, 0, dtype=torch.long)  # [frames, groups]
    return {"batch": 1, "wall_s": wall, "text_tokens": len(new), "frames": int(codes.shape[0]), "samples": samples,
            "audio_s": audio, "audio_s_per_s": audio / wall if wall else None,
            "ttfa_p50_ms": wall * 1e3, "ttfa_p90_ms": wall * 1e3,  # the audio exists when generate returns
            "rtf_p50": wall / audio if audio else None, **{k: v for k, v in st.seconds.items()},
            "frame_ms": st.seconds.get("talker_s", 0.0) / max(frames + 1, 1) * 1e3,
            "_ids": new, "_codes": codes, **gpu_memory(device)}


def hf_chat(model: Any, ids: torch.Tensor, device: torch.device, tokens: int, seed: int) -> dict[str, Any]:
    x = ids[None].to(device)
    torch.manual_seed(seed)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), return_audio=False,
                             thinker_max_new_tokens=tokens, thinker_min_new_tokens=tokens, thinker_do_sample=True,
                             thinker_eos_token_id=model.config.im_end_token_id,
                             **{f"thinker_{k}": v for k, v in THINKER_SAMPLING.items()})
        sync(device)
        wall = time.perf_counter() - t0
    seqs = out.sequences if hasattr(out, "sequences") else out
    new = int(seqs.shape[1] - x.shape[1])
    return {"batch": 1, "wall_s": wall, "tokens": new, "tokens_per_s": new / wall, "step_ms": wall / max(new, 1) * 1e3}


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--variant", default=None, choices=["real", "tiny"], help="default: real on cuda, tiny on cpu")
    ap.add_argument("--weights", default="dummy", help="dummy (random) or a checkpoint folder")
    ap.add_argument("--placement", type=Path, default=None,
                    help="default: placements/h200x1.yaml on cuda, placements/cpu.yaml on cpu (one rank)")
    ap.add_argument("--batches", default="1,4,16,32", help="speech batch sizes")
    ap.add_argument("--tokens", type=int, default=32, help="text tokens per speech request")
    ap.add_argument("--frames", type=int, default=128, help="codec frames (80 ms each) per speech request")
    ap.add_argument("--chat-batches", default="1,16", help="chat batch sizes; empty: no chat runs")
    ap.add_argument("--chat-tokens", type=int, default=128, help="tokens at most per chat request")
    ap.add_argument("--chat-modes", default="sampled,greedy", help="sampled (walk defaults), greedy")
    ap.add_argument("--path", default="cohort", choices=["cohort", "generic"],
                    help="the step path (generic: the plan without its cohort marks, common.on_path)")
    ap.add_argument("--parity-tokens", type=int, default=8)
    ap.add_argument("--parity-frames", type=int, default=16)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=16,
                    help="on a GPU, one speech run of this batch under torch.profiler (0: none)")
    ap.add_argument("--profile-frames", type=int, default=48, help="frames per request of the profiled run")
    ap.add_argument("--skip-hf", action="store_true", help="M* only")
    ap.add_argument("--budget-s", type=float, default=None, help="skip transformers runs that would not fit in this")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "qwen3_omni.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.frames < args.tokens or args.parity_frames < args.parity_tokens:
        raise SystemExit("--frames must be >= --tokens (a frame per text token, then tts_pad frames)")
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    variant = args.variant or ("real" if device.type == "cuda" else "tiny")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    chat_batches = [int(b) for b in args.chat_batches.split(",") if b.strip()]
    modes = [m for m in args.chat_modes.split(",") if m.strip()]
    placement = (args.placement or default_placement(device.type)).resolve()
    torch.backends.cuda.matmul.allow_tf32 = False
    rec: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "env": environment(device), "variant": variant, "weights": args.weights,
        "placement": os.path.relpath(placement, ROOT), "batches": batches, "tokens": args.tokens,
        "frames": args.frames, "chat_tokens": args.chat_tokens, "path": args.path,
        "sampling": {"thinker": THINKER_SAMPLING, "talker": TALKER_SAMPLING},
        "fixed_length": "codec eos masked in the talker's logits: every request makes --frames frames",
        "mstar": {"speech": {}, "chat": {}}, "hf": {}, "errors": [],
    }
    save = lambda: write_json(args.out, rec)  # noqa: E731 - after every measurement
    rec["read_bandwidth_tb_s"] = bw_tb = measure_read_bandwidth(device) / 1e12
    bw = bw_tb * 1e12
    save()

    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker

    with tempfile.TemporaryDirectory(prefix="bench-qwen3-omni-") as tmp:
        plan = load_plan(compile_plan(variant, placement, Path(tmp), args.weights), device=device.type,
                         kv_pages_cap=None if device.type == "cuda" else 4096)
    if plan.num_ranks != 1:
        raise SystemExit(f"{placement}: this benchmark runs one rank; the plan has {plan.num_ranks}")
    t0 = time.perf_counter()
    worker = Worker(plan, 0, device, args.weights)
    rec["mstar_setup_s"] = time.perf_counter() - t0
    rec["codec_eos_masked"] = mask_codec_eos(worker.engines["talker"].node)
    c2w = worker.engines["code2wav"].node
    rate = float(plan.config.get("sample_rate", 24000))
    rec["audio_per_request_s"] = c2w.output_length(args.frames) / rate
    prompts = prompt_ids(worker.engines["proc"].node, max(batches + chat_batches + [1]))
    lengths = [int(p.numel()) for p in prompts]
    rec["prompt_ids"] = {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths),
                         "tokenizer": tokenizer_source(args.weights)}
    rec["weights_gb"] = {n: sum(_nbytes(p) for p in e.node.parameters()) / 1e9 for n, e in worker.engines.items()}
    rec["floor_model"] = fm = floor_profile(worker)
    rec["floor_method"] = ("bytes read / measured read bandwidth; MoE layers read E * (1 - (1 - k / E)^n) experts "
                           "for a step of n tokens (uniform routing), dense tensors and heads in full, one table "
                           "row per token, the KV of the context; a frame = talker step + code_groups - 1 "
                           "predictor steps + Code2Wav / c2w_chunk (+ a thinker step while the text lasts)")
    save()

    bench_mstar(args, rec, save, plan, worker, device, batches, chat_batches, modes, fm, bw, lengths, c2w, rate)
    if args.profile_batch and device.type == "cuda":
        profile_speech(args, rec, save, plan, worker, device, c2w, rate)
    parity = None if args.skip_parity else mstar_parity(args, rec, save, plan, worker, device, c2w)
    rec["memory"] = gpu_memory(device)
    save()
    if not args.skip_hf:
        bench_hf(args, rec, save, worker, device, prompts, parity, budget, fm, bw, rate)
    summary(rec, save, batches, variant, device, bw_tb, args.out)
    return 0 if rec["mstar"]["speech"] else 1


def profile_speech(args: argparse.Namespace, rec: dict[str, Any], save: Callable[[], None], plan: Any,
                   worker: Any, device: torch.device, c2w: Any, rate: float) -> None:
    """One speech run of --profile-batch requests under torch.profiler: CUDA-graph launches
    against talker frame steps (generic `frame` steps and `frame_pad` cohort steps), kernel
    launches outside graphs, the device time by kernel (top 12) and the host self time by op
    (top 15), into rec["profile"]."""
    from torch.profiler import ProfilerActivity, profile

    b, frames = args.profile_batch, max(args.profile_frames, args.tokens + 1)
    try:
        run_speech(plan, worker, device, b, args.tokens, frames, args.seed + 20_000, args.path, c2w, rate)  # warm
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r = run_speech(plan, worker, device, b, args.tokens, frames, args.seed, args.path, c2w, rate)
        events = prof.key_averages()
        count = {e.key: e.count for e in events}
        kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: -e.device_time_total)
        steps = {k: v["steps"] for k, v in r["nodes"].items()}
        talker_steps = steps.get("talker.frame", 0) + steps.get("talker.frame_pad", 0) + \
            steps.get("talker.frame_pad:cohort", 0)
        rec["profile"] = {
            "batch": b, "frames": frames, "wall_s": r["wall_s"], "steps": steps,
            "talker_frame_steps": talker_steps,
            "cuda_graph_launches": count.get("cudaGraphLaunch", 0),
            "kernel_launches_outside_graphs": count.get("cudaLaunchKernel", 0) + count.get("cuLaunchKernel", 0)
            + count.get("cudaLaunchKernelExC", 0),
            "top_kernels_ms": [[e.key[:90], e.device_time_total / 1e3, e.count] for e in kernels[:12]],
            # host time by op (self time): where the eager parts (prefills, Code2Wav) spend theirs
            "top_host_ops_ms": [[e.key[:90], e.self_cpu_time_total / 1e3, e.count] for e in sorted(
                (e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)[:15]],
        }
        log.info("profile B=%d: %d talker frame steps, %d CUDA-graph launches in all, %d kernel launches outside "
                 "graphs", b, talker_steps, rec["profile"]["cuda_graph_launches"],
                 rec["profile"]["kernel_launches_outside_graphs"])
    except Exception as e:  # noqa: BLE001
        log.exception("M* profile failed")
        rec["errors"].append(f"mstar profile: {type(e).__name__}: {e}")
    save()


def bench_mstar(args: argparse.Namespace, rec: dict[str, Any], save: Callable[[], None], plan: Any, worker: Any,
                device: torch.device, batches: list[int], chat_batches: list[int], modes: list[str],
                fm: Mapping[str, Any], bw: float, lengths: list[int], c2w: Any, rate: float) -> None:
    chunk = int(plan.config.get("c2w_chunk", 25))
    for b in batches:
        prompt = sum(lengths[:b]) / b  # request i reads prompt i: this batch's mean prompt length
        try:
            # warm-up at this batch size: graph capture, kernel JIT, allocator; past one Code2Wav window
            run_speech(plan, worker, device, b, min(args.tokens, 4), min(args.frames, chunk + 2), args.seed + 10_000,
                       args.path, c2w, rate)
            reset_peak(device)
            r = run_speech(plan, worker, device, b, args.tokens, args.frames, args.seed, args.path, c2w, rate)
            r.update(speech_floor(fm, b, prompt, args.tokens, args.frames, r["audio_s"], bw))
            r["x_floor"] = r["audio_s_per_s_floor"] / r["audio_s_per_s"]
            if r["frame_ms"] is not None:
                r["frame_over_floor"] = r["frame_ms"] / r["frame_floor_ms"]
            r.update(gpu_memory(device))
            rec["mstar"]["speech"][str(b)] = r
            log.info("speech B=%d: %.1f audio-s/s (floor %.1f), TTFA p50 %s ms, RTF p50 %s", b, r["audio_s_per_s"],
                     r["audio_s_per_s_floor"], _round(r["ttfa_p50_ms"]), _round(r["rtf_p50"], 3))
        except Exception as e:  # noqa: BLE001 - record and go on to the next figure
            log.exception("M* speech at batch %d failed", b)
            rec["errors"].append(f"mstar speech batch {b}: {type(e).__name__}: {e}")
        save()
    for mode in modes:
        for b in chat_batches:
            prompt = sum(lengths[:b]) / b
            try:
                run_chat(plan, worker, device, b, min(args.chat_tokens, 4), args.seed + 10_000, mode, args.path)
                r = run_chat(plan, worker, device, b, args.chat_tokens, args.seed, mode, args.path)
                r.update(chat_floor(fm, b, prompt, max(round(r["tokens"] / b), 1), bw))
                if r["step_ms"] is not None:
                    r["step_over_floor"] = r["step_ms"] / r["step_floor_ms"]
                rec["mstar"]["chat"].setdefault(mode, {})[str(b)] = r
                log.info("chat %s B=%d: %.1f tokens/s", mode, b, r["tokens_per_s"])
            except Exception as e:  # noqa: BLE001
                log.exception("M* chat (%s) at batch %d failed", mode, b)
                rec["errors"].append(f"mstar chat {mode} batch {b}: {type(e).__name__}: {e}")
            save()


def mstar_parity(args: argparse.Namespace, rec: dict[str, Any], save: Callable[[], None], plan: Any, worker: Any,
                 device: torch.device, c2w: Any) -> dict[str, Any] | None:
    """One greedy speech request whose text and codes transformers' run is compared with."""
    inputs = {**speech_inputs(0, args.parity_tokens, args.parity_frames, args.seed), **GREEDY}
    proc, ids = worker.engines["proc"].node, []
    detokenize = proc.phase_detokenize

    def recording(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids.extend(int(e["token"].reshape(-1)[-1]) for e in batch)  # a chunk's last id is its new one
        return detokenize(batch)

    try:
        proc.phase_detokenize = recording
        with _Windows(c2w) as w:
            r = run_requests(plan, worker, device, "speech", [inputs], args.path, "talker", ("frame",))
        return {"text": "".join(r["reqs"][0].outputs.get("text", [])), "codes": w.codes(), "ids": ids}
    except Exception as e:  # noqa: BLE001
        log.exception("M* parity run failed")
        rec["errors"].append(f"mstar parity: {type(e).__name__}: {e}")
        save()
        return None
    finally:
        del proc.phase_detokenize


def release_mstar(worker: Any, device: torch.device) -> None:
    """M*'s KV pools, cohort columns and captured graphs go; the nodes' weights stay (shared with HF)."""
    worker.release_graphs()
    worker._cohorts.clear()
    for engine in worker.engines.values():
        if hasattr(engine, "pool"):
            engine.pool.data = torch.empty(0, dtype=engine.pool.data.dtype, device=engine.pool.data.device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_hf(args: argparse.Namespace, rec: dict[str, Any], save: Callable[[], None], worker: Any,
             device: torch.device, prompts: list[torch.Tensor], parity: dict[str, Any] | None, budget: Budget,
             fm: Mapping[str, Any], bw: float, rate: float) -> None:
    release_mstar(worker, device)
    try:
        model, info = build_hf(worker, device)
    except Exception as e:  # noqa: BLE001
        log.exception("building the transformers model failed")
        rec["errors"].append(f"hf build: {type(e).__name__}: {e}")
        save()
        return
    rec["hf"]["model"] = info
    save()
    per_frame = 0.25 if device.type == "cuda" else 0.02  # seconds, generously: HF's talker + predictor generate

    def fits(part: str, frames: int) -> bool:
        need = 5.0 + frames * per_frame
        if budget.allows(need):
            return True
        rec["hf"][part] = {"skipped": f"budget: {budget.left():.0f} s left, about {need:.0f} s needed"}
        save()
        return False

    proc = worker.engines["proc"].node
    if parity is not None and fits("parity", args.parity_frames + args.parity_tokens):
        with _baseline(rec, "parity", save):
            h = hf_speech(model, prompts[0], device, args.parity_tokens, args.parity_frames, args.seed, True, rate)
            full = proc.tokenizer.decode(h["_ids"], skip_special_tokens=True)
            ours, codes = parity["text"], parity["codes"]
            ref = h["_codes"]
            n = min(len(codes), len(ref))
            same = next((i for i in range(n) if not torch.equal(codes[i], ref[i])), n)
            group = None if same == n else int((codes[same] != ref[same]).nonzero()[0])
            rec["parity"] = {
                "ids_equal": parity["ids"] == [int(i) for i in h["_ids"]][: len(parity["ids"])] and bool(parity["ids"]),
                "first_mismatch": None if group is None else {"frame": same, "group": group,
                                                              "mstar": codes[same].tolist(), "hf": ref[same].tolist()},
                "tokens": args.parity_tokens, "frames": args.parity_frames, "mstar_frames": int(len(codes)),
                "hf_frames": int(len(ref)), "codes_match_frames": same,
                "codes_equal": bool(len(codes) == len(ref) and same == n), "hf_text_tokens": len(h["_ids"]),
                "mstar_text_chars": len(ours), "hf_text_chars": len(full),
                # the stream holds back an unfinished last character (at most 3 bytes, each U+FFFD at the end)
                "text_equal": bool(full.startswith(ours) and set(full[len(ours):]) <= {"\ufffd"}
                                   and len(full) - len(ours) <= 3),
            }
    if fits("speech", 2 * (args.frames + args.tokens)):  # a warm-up and the measured run
        with _baseline(rec, "speech", save):
            hf_speech(model, prompts[0], device, min(args.tokens, 2), min(args.frames, 3), args.seed + 10_000,
                      False, rate)  # warm-up
            h = hf_speech(model, prompts[0], device, args.tokens, args.frames, args.seed, False, rate)
            h = {k: v for k, v in h.items() if not k.startswith("_")}
            h.update(speech_floor(fm, 1, int(prompts[0].numel()), args.tokens, args.frames, h["audio_s"], bw))
            h["x_floor"] = h["audio_s_per_s_floor"] / h["audio_s_per_s"]
            rec["hf"]["speech"] = {"1": h}
            log.info("transformers speech B=1: %.2f audio-s/s", h["audio_s_per_s"])
    if fits("chat", args.chat_tokens // 4):
        with _baseline(rec, "chat", save):
            hf_chat(model, prompts[0], device, min(args.chat_tokens, 2), args.seed + 10_000)
            h = hf_chat(model, prompts[0], device, args.chat_tokens, args.seed)
            h.update(chat_floor(fm, 1, int(prompts[0].numel()), args.chat_tokens, bw))
            rec["hf"]["chat"] = {"1": h}
            log.info("transformers chat B=1: %.1f tokens/s", h["tokens_per_s"])


@contextlib.contextmanager
def _baseline(rec: dict[str, Any], what: str, save: Callable[[], None]) -> Iterator[None]:
    """One transformers baseline: a failure is logged and recorded under `errors` (the other
    baselines still run); the record is saved after it either way."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one failed baseline must not lose the others
        log.exception("transformers %s failed", what)
        rec["errors"].append(f"hf {what}: {type(e).__name__}: {e}")
    save()


def _round(v: float | None, d: int = 1) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def summary(rec: dict[str, Any], save: Callable[[], None], batches: list[int], variant: str, device: torch.device,
            bw: float, out: Path) -> None:
    rows = [{"system": "M*", **r} for b in batches if (r := rec["mstar"]["speech"].get(str(b)))]
    hf = rec["hf"].get("speech", {}).get("1")
    if hf:
        rows.append({"system": "transformers", **hf})
    cols = [("system", "system", 0), ("batch", "B", 0), ("audio_s_per_s", "audio s/s", 2),
            ("audio_s_per_s_floor", "floor s/s", 1), ("ttfa_p50_ms", "TTFA p50 ms", 1), ("ttfa_p90_ms", "p90 ms", 1),
            ("rtf_p50", "RTF p50", 3), ("frame_ms", "frame ms", 2), ("frame_floor_ms", "floor ms", 2),
            ("text_tokens_per_s", "text tok/s", 1), ("peak_allocated_gib", "peak GiB", 1)]
    print(f"\nQwen3-Omni {variant} speech on {rec['env'].get('gpu', device.type)}: {rec['tokens']} text tokens and "
          f"{rec['frames']} frames ({rec['audio_per_request_s']:.2f} s) per request, read bandwidth {bw:.2f} TB/s")
    print(table(rows, cols))
    chat = [{"system": f"M* {mode}", **r} for mode, per in rec["mstar"]["chat"].items() for r in per.values()]
    if "1" in rec["hf"].get("chat", {}):
        chat.append({"system": "transformers", **rec["hf"]["chat"]["1"]})
    if chat:
        print(table(chat, [("system", "chat", 0), ("batch", "B", 0), ("tokens_per_s", "tokens/s", 1),
                           ("tokens_per_s_floor", "floor tok/s", 1), ("step_ms", "step ms", 2),
                           ("step_floor_ms", "floor ms", 2), ("ttft_p50_ms", "TTFT p50 ms", 1)]))
    speedups: dict[str, float] = {}
    if hf and "audio_s_per_s" in hf:
        for b, r in rec["mstar"]["speech"].items():
            speedups[f"speech_b{b}"] = r["audio_s_per_s"] / hf["audio_s_per_s"]
    hc = rec["hf"].get("chat", {}).get("1")
    m1 = rec["mstar"]["chat"].get("sampled", {}).get("1")
    if hc and m1:
        speedups["chat_b1"] = m1["tokens_per_s"] / hc["tokens_per_s"]
    rec["speedup_vs_hf_b1"] = speedups
    for k, v in speedups.items():
        print(f"{k}: M* / transformers (B = 1) = {v:.2f}x")
    if "parity" in rec:
        print("parity (greedy, B = 1):", rec["parity"])
    for err in rec["errors"]:
        print("error:", err)
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
