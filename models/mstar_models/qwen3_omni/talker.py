"""Qwen3-Omni's talker as a KV node: the 20-layer MoE that turns the thinker's text into codec frames.

The math is transformers 5.24's `Qwen3OmniMoeTalkerForConditionalGeneration` (and the parts of
`Qwen3OmniMoeForConditionalGeneration.generate` that build its inputs): `layers.decoder.Decoder`
layers whose MLP is `layers.moe.SparseMoE` with the sigmoid-gated shared expert, interleaved MRoPE,
`codec_head` over the 3072 codec ids; `text_projection` / `hidden_projection` (2-layer SiLU
MLPs with bias) take thinker-width rows to talker width; the code predictor
(`code_predictor.CodePredictor`) adds each frame's residual codes. Parameters carry the
checkpoint's names under `talker.` (`talker.model.codec_embedding.weight`,
`talker.model.layers.{i}.*`, `talker.model.norm.weight`, `talker.codec_head.weight`,
`talker.{text,hidden}_projection.*`, `talker.code_predictor.*`).

Phases (models/qwen3_omni/qwen3_omni.walk, node `talker`):
- `prefill(states, mm, positions, speaker, do_sample, temperature, top_k, top_p,
  repetition_penalty, max_frames, seed) -> ()`: the talker prompt up to tts_bos + codec_pad.
  `states` [S, thinker hidden] / `mm` [S] / `positions` [3, S] are what the thinker's
  `prefill_speech` gives (`thinker.ThinkerMoE._talker_prompt`): the text stream rows are
  `hidden_projection` where `mm`, else `text_projection`; the codec stream adds, on the last
  five rows, `codec_embedding` of [nothink, think_bos, think_eos, speaker, codec_pad] (the
  first S - 5 rows have none). Row S - 5 is the projected `tts_pad`, kept for `frame_pad`.
- `frame(text) -> (frame, done)`: one 80 ms frame (`frame_math`). Input =
  `text_projection(text)` (the thinker's item [1, thinker hidden]) + the codec input:
  `codec_embedding(codec_bos)` on the first frame (HF's ninth prompt position), then the
  previous frame's sum of its 16 codec embeddings. The layer-0 code is sampled from
  `codec_head` with ids [vocab - 1024, vocab) suppressed except codec eos; repetition penalty
  over the codes generated so far; top-k / top-p / temperature when `do_sample`, else greedy.
  The code predictor then samples codes 1..15 from [the final-normed hidden state,
  `codec_embedding(code 0)`] (greedy, or HF's top-k 50 / top-p 0.8 when `do_sample`).
  `frame` is the frame's codes [1, code_groups], or no row for a codec-eos frame (HF never
  decodes one).
- `frame_pad() -> (frame, done)`: the same with the projected `tts_pad` as the text.
Both are written once, as column steps (`cohort_phase`; `frame_math`, one tensor function
with no host read): the tts_pad loop runs `frame_pad` as a decode cohort, and a plain batched
call runs either as a one-step cohort (runtime/mstar_runtime/ops/column_call.py); on a GPU
each is one CUDA graph per batch bucket (the talker step, the 15 predictor steps and all
sampling in one launch).
Positions: `positions` in prefill; a frame at KV index j has j + delta in all three
components, delta = (last prefill position + 1) - S (the talker's 3-D rule, HF's
`compute_3d_position_ids`). transformers 5.24 itself fails on a talker prompt with both audio
and an image or video (its talker config has no `audio_config` for the audio length); the
thinker computes those positions by the same rules, each audio's length its placeholder count.

`done` is raised on codec eos or after `max_frames` frames (lazy). Once a frame has sampled
codec eos, or `max_frames` frames have run, every later frame of the request returns codec
eos again (a no-op frame without codes), decided on the device.

Seeds: the walk gives the thinker and the talker one `seed`; the talker's draws use its
stream 1 (`SamplingParams.stream(1)`, `derive_seed(seed, 1)`) at step = frame index, the
predictor's stream 2 at step = its draws so far (15 per frame), so no two of the three draw
the same numbers.

Per-(request, tag) state: `sampling`, `max_frames`, `frames` (frames decoded), `seen` (bool
[codec vocab] on the device: the codes so far, for the repetition penalty), `finished` (bool
on the device), `codec` (the next codec input [hidden]), `pad` (projected tts_pad [hidden]),
`delta`, `seed`, `cp_seed`, `cp_draws`, `cp_greedy`.

Config: `code_groups`, the predictor's `cp_layers`, `cp_hidden` (= the talker's hidden),
`cp_heads`, `cp_kv_heads`, `cp_head_dim`, `cp_intermediate`, `codebook_size`, `cp_rope_theta`;
`talker_experts_per_token` (6 in the release), `talker_norm_topk_prob` (true), `rope_theta`,
`rms_eps`, `talker_mrope_section`, codec ids and speakers of `tokens.TokenIds`. Settings:
`max_seq_len`, `moe_kernel`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.decoder import Decoder, DecoderNode
from mstar_models.layers.embedding import VocabEmbedding, lm_logits
from mstar_models.layers.init import seeded_init_
from mstar_models.layers.linear import Weight
from mstar_models.layers.moe import SparseMoE
from mstar_models.layers.rotary import inv_freq, mrope_tables
from mstar_models.qwen3_omni.code_predictor import CodePredictor
from mstar_models.qwen3_omni.lm_common import attention_sizes
from mstar_models.qwen3_omni.positions import default_mrope_section
from mstar_models.qwen3_omni.tokens import TokenIds
from mstar_runtime import sampling
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import config_value, max_seq_len
from mstar_runtime.ops.readback import upload

PROMPT_TAIL = 5  # rows of the talker prefill that carry codec embeddings: nothink .. codec_pad
# the prefill's sampling ports: do_sample False is greedy; the token limit is `max_frames`
SAMPLING_PORTS = sampling.SamplingPorts(temperature=sampling.REQUIRED, top_k=0, top_p=1.0,
                                        repetition_penalty=sampling.REQUIRED, limit="max_frames",
                                        do_sample="do_sample")


class ResizeMLP(nn.Module):
    """`text_projection` / `hidden_projection`: thinker width -> talker width (SiLU between)."""

    def __init__(self, in_dim: int, inter: int, out_dim: int, **factory: Any):
        super().__init__()
        self.linear_fc1 = Weight.empty(inter, in_dim, bias=True, **factory)
        self.linear_fc2 = Weight.empty(out_dim, inter, bias=True, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerMoE(DecoderNode):
    """The talker node; see the module docstring for its phases, state and config."""

    checkpoint_prefix: ClassVar[str] = "talker."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = attention_sizes(spec, "TalkerMoE")
        g = lambda name, *default: config_value(spec, name, *default)  # noqa: E731 - a local shorthand
        self.vocab, self.thinker_hidden = int(g("codec_vocab")), int(g("thinker_hidden"))
        experts = int(g("experts"))
        top_k = int(g("talker_experts_per_token", min(6, experts)))
        normalize = bool(g("talker_norm_topk_prob", True))
        self.section = [int(s) for s in g("talker_mrope_section", default_mrope_section(self.head_dim))]
        if len(self.section) != 3 or sum(self.section) != self.head_dim // 2:
            raise node.NodeError(f"node '{spec.name}': talker_mrope_section {self.section} must be 3 values summing "
                                 f"to head_dim / 2 = {self.head_dim // 2}")
        self.tok = TokenIds.from_spec(spec)
        for name in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                     "codec_think_bos_id", "codec_think_eos_id"):
            if not 0 <= getattr(self.tok, name) < self.vocab:
                raise node.NodeError(f"node '{spec.name}': {name} {getattr(self.tok, name)} is outside the codec "
                                     f"vocab ({self.vocab})")
        self.max_seq_len = max_seq_len(spec)
        eps = float(g("rms_eps", 1e-6))
        kernel = str(spec.settings.get("moe_kernel", "auto"))
        inter, shared = int(g("moe_intermediate")), int(g("shared_intermediate"))
        factory: dict[str, Any] = {"dtype": spec.dtype, "device": spec.device}
        self.model = Decoder(
            self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, eps,
            lambda i: SparseMoE(self.hidden, experts, inter, top_k, normalize, shared, kernel=kernel, **factory),
            qk_norm=True, **factory,
        )
        self.model.codec_embedding = VocabEmbedding(self.vocab, self.hidden, **factory)
        self.codec_head = Weight.empty(self.vocab, self.hidden, **factory)
        proj = int(g("projection_intermediate"))
        self.text_projection = ResizeMLP(self.thinker_hidden, proj, self.hidden, **factory)
        self.hidden_projection = ResizeMLP(self.thinker_hidden, proj, self.hidden, **factory)
        self.groups = int(g("code_groups"))
        if self.groups < 2:
            raise node.NodeError(f"node '{spec.name}': code_groups must be >= 2, got {self.groups}")
        self.code_predictor = CodePredictor(
            int(g("cp_layers")), int(g("cp_hidden")), int(g("cp_heads")), int(g("cp_kv_heads")), int(g("cp_head_dim")),
            int(g("cp_intermediate")), int(g("codebook_size")), self.groups, eps, float(g("cp_rope_theta", 1e6)),
            **factory)
        if self.code_predictor.hidden != self.hidden:
            raise node.NodeError(f"node '{spec.name}': cp_hidden ({self.code_predictor.hidden}) must equal the "
                                 f"talker's hidden ({self.hidden}): the predictor reads the talker's hidden state")
        seeded_init_(self, spec.name)
        self.register_buffer("freq", inv_freq(self.head_dim, float(g("rope_theta", 1e6))).to(spec.device),
                             persistent=False)
        # HF's generate suppresses the top 1024 ids (control codes) except codec eos
        allowed = torch.ones(self.vocab, dtype=torch.bool)
        allowed[max(0, self.vocab - 1024):] = False
        allowed[self.tok.codec_eos_token_id] = True
        self.register_buffer("allowed", allowed.to(spec.device), persistent=False)
        self.attention_scale = self.head_dim**-0.5

    # ------------------------------------------------------------------ contract
    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase == "prefill":
            shape = tuple(shapes.get("states", ()))
            if len(shape) != 2 or shape[0] < 8:
                raise node.RequestError(f"states must be [S >= 8, thinker hidden] (the thinker's speech prefill), got "
                                        f"shape {shape}", "states")
            if shape[0] > max_seq_len(spec):
                raise node.RequestError(f"talker prompt of {shape[0]} rows is longer than max_seq_len "
                                        f"{max_seq_len(spec)}", "states")
            return node.SeqPlan(q_len=shape[0])
        if phase in ("frame", "frame_pad"):
            return node.SeqPlan(q_len=1)
        raise node.NodeError(f"node '{spec.name}' (TalkerMoE) has no phase '{phase}'")

    # ------------------------------------------------------------------ math
    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mrope_tables(positions, self.freq, self.section, self.codec_head.weight.dtype)

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 codec logits, the suppressed ids at -inf."""
        out = lm_logits(hidden, self.codec_head.weight)
        return out.masked_fill(~self.allowed, float("-inf"))

    def project(self, states: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        """Thinker-width rows -> talker width: hidden_projection where `mm`, text_projection elsewhere."""
        text = self.text_projection(states)
        if not bool(mm.any()):
            return text
        return torch.where(mm[:, None], self.hidden_projection(states), text)

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        checked = [self._check_prefill(entry, seq.start, seq.q_len) for entry, seq in zip(batch, attn.seqs)]
        dev = self.freq.device
        text = self.project(torch.cat([c[0] for c in checked]), torch.cat([c[1] for c in checked]))
        tail = [self.tok.codec_nothink_id, self.tok.codec_think_bos_id, self.tok.codec_think_eos_id]
        codec_ids, codec_at, offset = [], [], 0
        for s, _, _, speaker, _, _ in checked:
            n = s.shape[0]
            codec_ids += tail + [speaker, self.tok.codec_pad_id]
            codec_at += list(range(offset + n - PROMPT_TAIL, offset + n))
            offset += n
        h = text.index_add(0, upload(codec_at, torch.long, dev), self.codec_embed(upload(codec_ids, torch.long, dev)))
        positions = torch.cat([c[2] for c in checked], dim=1)
        cos, sin = self.tables(positions)
        self.model.forward_layers(h, cos, sin, attn.attend)
        bos = self.codec_embed(torch.tensor([self.tok.codec_bos_id], device=dev))[0]
        offset = 0
        for (s, _, pos, _, params, max_frames), seq in zip(checked, attn.seqs, strict=True):
            n = s.shape[0]
            seq.state.clear()
            seq.state.update(
                sampling=params, max_frames=max_frames, frames=0, codec=bos.clone(),
                # its own copy: a view would keep the batch's whole projected prompt alive
                pad=text[offset + n - PROMPT_TAIL].clone(), delta=float(pos[0, -1]) + 1 - n,
                finished=torch.zeros((), dtype=torch.bool, device=dev),
                seen=torch.zeros(self.vocab, dtype=torch.bool, device=dev),
                # the walk gives the thinker, the talker and the predictor one seed: each draws
                # from its own stream of it, so their (seed, step) draws are not the same numbers
                seed=sampling.signed64(params.stream(1).seed), cp_seed=sampling.signed64(params.stream(2).seed),
                cp_draws=0, cp_greedy=params.greedy,
            )
            offset += n
        return [{} for _ in batch]

    def _check_prefill(
        self, entry: Mapping[str, Any], start: int, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, sampling.SamplingParams, int]:
        dev, dt = self.freq.device, self.codec_head.weight.dtype
        if start:
            raise node.RequestError("the talker prefill starts a request's talker context; this one has "
                                    f"{start} tokens already", "states")
        states, mm, pos = entry.get("states"), entry.get("mm"), entry.get("positions")
        if not isinstance(states, torch.Tensor) or states.dim() != 2 or states.shape[1] != self.thinker_hidden:
            raise node.RequestError(f"states must be [S, {self.thinker_hidden}]", "states")
        n = states.shape[0]
        if n != q_len:
            raise node.NodeError(f"node '{self.spec.name}': prefill of {n} rows got {q_len} KV slots")
        if not isinstance(mm, torch.Tensor) or tuple(mm.shape) != (n,):
            raise node.RequestError(f"mm must be a bool tensor [{n}]", "mm")
        if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (3, n):
            raise node.RequestError(f"positions must be [3, {n}]", "positions")
        name = str(entry.get("speaker", "ethan")).lower()
        if name not in self.tok.speakers:
            raise node.RequestError(f"unknown speaker {name!r}; known: {', '.join(sorted(self.tok.speakers))}",
                                    "speaker")
        speaker = int(self.tok.speakers[name])
        params = sampling.read_sampling(entry, SAMPLING_PORTS)
        max_frames = params.max_tokens
        return (states.to(device=dev, dtype=dt), mm.to(device=dev, dtype=torch.bool), pos.to(device=dev,
                dtype=torch.float32), speaker, params, max_frames)

    # ------------------------------------------------------------------ one frame, the math
    def frame_math(self, text: torch.Tensor, codec: torch.Tensor, seen: torch.Tensor, finished: torch.Tensor,
                   cols: FrameColumns, positions: torch.Tensor, attend: Any) -> FrameOutputs:
        """One 80 ms frame of n rows as pure tensor code (no host read; capturable): the talker
        step on `text + codec` at the MRoPE `positions` [n] (all three components), its layer-0
        code (suppressed ids, the repetition penalty over the codes in `seen`, the talker's
        sampling; codec eos once `finished` or at `max_frames`), then the code predictor's
        residual codes, and the codec-embedding sum that is the next frame's `codec`."""
        hidden = self.model.forward_layers(text + codec, *self.tables(positions[None, :].expand(3, -1)), attend)
        logits = self.logits(hidden)
        pen = cols.draw.penalty[:, None]
        logits = torch.where(seen, torch.where(logits < 0, logits * pen, logits / pen), logits)
        plain = dataclasses.replace(cols.draw, penalty=torch.ones_like(cols.draw.penalty))
        sampled = sampling.sample_columns(logits, plain)
        eos = self.tok.codec_eos_token_id
        stop = finished | (cols.frames >= cols.max_frames)
        code0 = torch.where(stop, eos, sampled)
        first = torch.stack([hidden, self.codec_embed(code0)], dim=1)  # [n, 2, hidden]
        residual, embeds = self.code_predictor.residual_codes(first, cols.cp_greedy, cols.cp_seed, cols.cp_draws)
        # HF sums the frame's 16 codec embeddings (code 0 from the talker's table) in one reduction
        feedback = torch.cat([first[:, 1:], embeds], dim=1).sum(dim=1)
        ended = stop | (code0 == eos)
        return FrameOutputs(
            frame=torch.cat([code0[:, None], residual], dim=1).to(torch.int32), feedback=feedback,
            seen=seen.scatter(1, code0[:, None], True), finished=ended,
            done=ended | (cols.frames + 1 >= cols.max_frames))

    # ------------------------------------------------------------------ one frame, a column step
    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`frame` and `frame_pad`, written only as column steps (runtime/mstar_runtime/ops/cohort.py):
        the tts_pad loop after the text, whose body is that one call, runs as a decode cohort,
        the speech loop's frames as the second link of a chained one (engine/cohort_chain.py,
        `text` the thinker step's item on the device); where no chained cohort runs that loop,
        its frames and the first frame run as a one-step cohort (ops/column_call.py; on a GPU
        through the phase's CUDA graphs, the talker step, the predictor's 15 and all sampling in one)."""
        if phase not in ("frame", "frame_pad"):
            return None
        project = phase == "frame"
        return CohortPhase(join=self._cohort_join, step=lambda b: self._cohort_step(b, project),
                           leave=self._cohort_leave, max_items={"frame": 1})

    def _cohort_join(self, state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        text = inputs.get("text")  # a plain call's entry of `frame` holds it (a cohort's join sees none)
        if text is not None and (not isinstance(text, torch.Tensor) or tuple(text.shape) != (1, self.thinker_hidden)):
            raise node.RequestError(f"text must be one item [1, {self.thinker_hidden}]", "text")
        if "sampling" not in state:
            raise node.RequestError("a talker frame on a context that was never prefilled", "text")
        ints, floats, flags = _host_row(state)
        return {"ints": torch.tensor(ints, dtype=torch.long), "floats": torch.tensor(floats, dtype=torch.float32),
                "flags": torch.tensor(flags, dtype=torch.bool), "codec": state["codec"], "seen": state["seen"],
                "finished": state["finished"], "pad": state["pad"]}

    def _cohort_leave(self, state: dict[str, Any], cols: Columns, steps: int) -> None:
        state.update(codec=cols["codec"], seen=cols["seen"], finished=cols["finished"])
        state["frames"] += steps
        state["cp_draws"] += steps * (self.groups - 1)

    def _cohort_step(self, b: CohortStep, project: bool) -> dict[str, torch.Tensor]:
        """One frame per row: on the thinker's item (`frame`: `text` [n, 1, thinker hidden],
        through `text_projection`) or on the projected tts_pad (`frame_pad`)."""
        c = b.cols
        if project:
            text = self.text_projection(b.inputs["text"].reshape(b.n, -1).to(self.codec_head.weight.dtype))
        else:
            text = c["pad"]
        cols = FrameColumns.unpack(c["ints"], c["floats"], c["flags"])
        positions = b.positions.to(torch.float32) + c["floats"][:, _DELTA]
        out = self.frame_math(text, c["codec"], c["seen"], c["finished"], cols, positions, b.attend)
        c["codec"].copy_(out.feedback)
        c["seen"].copy_(out.seen)
        c["finished"].copy_(out.finished)
        c["ints"][:, _FRAMES].add_(1)
        c["ints"][:, _CP_DRAWS].add_(self.groups - 1)
        count = (out.frame[:, 0] != self.tok.codec_eos_token_id).to(torch.long)
        return {"frame": out.frame[:, None, :], "frame:count": count, "done": out.done}


# ------------------------------------------------------------------------------ frame columns
# The integer, float and flag columns of a frame, one row per request (`_host_row` builds a
# row from the node state at join; the column step keeps them as its columns).
_FRAMES, _MAX_FRAMES, _TOP_K, _SEED, _CP_SEED, _CP_DRAWS = range(6)
_DELTA, _TEMPERATURE, _TOP_P, _PENALTY = range(4)
_GREEDY, _CP_GREEDY = range(2)


def _host_row(st: Mapping[str, Any]) -> tuple[list[int], list[float], list[bool]]:
    """A request's frame columns from its talker state (the step adds each row's position to
    its delta column)."""
    p: sampling.SamplingParams = st["sampling"]
    ints = [st["frames"], st["max_frames"], 0 if p.greedy else p.top_k, st["seed"], st["cp_seed"], st["cp_draws"]]
    floats = [float(st["delta"]), 1.0 if p.greedy else p.temperature, 1.0 if p.greedy else p.top_p,
              p.repetition_penalty]
    return ints, floats, [p.greedy, st["cp_greedy"]]


@dataclass(frozen=True)
class FrameColumns:
    """A frame's per-row settings as device columns (views of the packed int / float / flag columns)."""

    draw: sampling.SamplingColumns  # the talker's layer-0 draw (its step is the frame index)
    frames: torch.Tensor  # i64 [n]: frames already decoded
    max_frames: torch.Tensor  # i64 [n]
    cp_greedy: torch.Tensor  # bool [n]
    cp_seed: torch.Tensor  # i64 [n]
    cp_draws: torch.Tensor  # i64 [n]: the predictor's draws so far (15 per frame)

    @staticmethod
    def unpack(ints: torch.Tensor, floats: torch.Tensor, flags: torch.Tensor) -> FrameColumns:
        greedy = flags[:, _GREEDY]
        # a pad row of a graph bucket is all zeros: temperature 1 keeps its (discarded) draw finite
        temperature = torch.where(floats[:, _TEMPERATURE] > 0, floats[:, _TEMPERATURE], 1.0)
        draw = sampling.SamplingColumns(
            temperature=temperature, top_k=ints[:, _TOP_K], top_p=floats[:, _TOP_P], penalty=floats[:, _PENALTY],
            greedy=greedy, seed=ints[:, _SEED], step=ints[:, _FRAMES], history=None)
        return FrameColumns(draw=draw, frames=ints[:, _FRAMES], max_frames=ints[:, _MAX_FRAMES],
                            cp_greedy=flags[:, _CP_GREEDY], cp_seed=ints[:, _CP_SEED], cp_draws=ints[:, _CP_DRAWS])


@dataclass(frozen=True)
class FrameOutputs:
    frame: torch.Tensor  # i32 [n, code_groups]: code 0, then the residual codes
    feedback: torch.Tensor  # [n, hidden]: the next frame's codec input
    seen: torch.Tensor  # bool [n, codec vocab]: the codes decoded so far, this one included
    finished: torch.Tensor  # bool [n]: codec eos decoded (or max_frames reached)
    done: torch.Tensor  # bool [n]: no further frame will make codes
