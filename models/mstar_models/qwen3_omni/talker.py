"""Qwen3-Omni's talker as a KV node: the 20-layer MoE that turns the thinker's text into layer-0 codec codes.

The math is transformers 5.24's `Qwen3OmniMoeTalkerForConditionalGeneration` (and the parts of
`Qwen3OmniMoeForConditionalGeneration.generate` that build its inputs): `decoder.Decoder`
layers whose MLP is `moe.SparseMoE` with the sigmoid-gated shared expert, interleaved MRoPE,
`codec_head` over the 3072 codec ids; `text_projection` / `hidden_projection` (2-layer SiLU
MLPs with bias) take thinker-width rows to talker width. Parameters carry the checkpoint's
names under `talker.` (`talker.model.codec_embedding.weight`, `talker.model.layers.{i}.*`,
`talker.model.norm.weight`, `talker.codec_head.weight`, `talker.{text,hidden}_projection.*`).

Phases (models/qwen3_omni/qwen3_omni.walk, node `talker`):
- `prefill(states, mm, positions, speaker, do_sample, temperature, top_k, top_p,
  repetition_penalty, max_frames, seed) -> ()`: the talker prompt up to tts_bos + codec_pad.
  `states` [S, thinker hidden] / `mm` [S] / `positions` [3, S] are what the thinker's
  `prefill_speech` gives (`thinker.ThinkerMoE._talker_prompt`): the text stream rows are
  `hidden_projection` where `mm`, else `text_projection`; the codec stream adds, on the last
  five rows, `codec_embedding` of [nothink, think_bos, think_eos, speaker, codec_pad] (the
  first S - 5 rows have none). Row S - 5 is the projected `tts_pad`, kept for `decode_pad`.
- `decode(text) -> (code, context, done)`: one 80 ms frame. Input = `text_projection(text)`
  (the thinker's item [1, thinker hidden]) + the codec input: `codec_embedding(codec_bos)` on
  the first frame (HF's ninth prompt position), then the previous frame's `feedback`. The
  layer-0 code is sampled from `codec_head` with ids [vocab - 1024, vocab) suppressed except
  codec eos; repetition penalty over the codes generated so far; top-k / top-p / temperature
  when `do_sample`, else greedy. `context` [2, hidden] = [the final-normed hidden state,
  `codec_embedding(code)`]: the code predictor's first two inputs.
- `decode_pad() -> (code, context, done)`: the same with the projected `tts_pad` as the text.
- `feed(feedback) -> ()`: the frame's codec-embedding sum (from the code predictor), the next
  decode's codec input. Adds no KV.
Positions: `positions` in prefill; decode at KV index j has j + delta in all three
components, delta = (last prefill position + 1) - S (the talker's 3-D rule, HF's
`compute_3d_position_ids`). transformers 5.24 itself fails on a talker prompt with both audio
and an image or video (its talker config has no `audio_config` for the audio length); the
thinker computes those positions by the same rules, each audio's length its placeholder count.

`done` is raised on codec eos (lazy) or after `max_frames` frames. Once a frame has sampled
codec eos, or `max_frames` frames have run, every later frame of the request returns codec
eos again (a no-op frame: the code predictor emits no codes for it), decided on the device.

Per-(request, tag) state: `sampling`, `max_frames`, `frames` (frames decoded), `history`
(int64 [max_frames] codes so far, -1 beyond; only with a repetition penalty), `finished`
(bool on the device), `codec` (the next codec input [1, hidden]), `pad` (projected tts_pad
[1, hidden]), `delta`.

Config: `talker_experts_per_token` (6 in the release), `talker_norm_topk_prob` (true),
`rope_theta`, `rms_eps`, `talker_mrope_section`, codec ids and speakers of `tokens.TokenIds`.
Settings: `max_seq_len`, `moe_kernel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.qwen3_omni.decoder import Decoder, seeded_init_
from mstar_models.qwen3_omni.lm_common import attention_sizes, sampling_params, scalar
from mstar_models.qwen3_omni.moe import SparseMoE, Weight
from mstar_models.qwen3_omni.positions import default_mrope_section, inv_freq, mrope_tables
from mstar_models.qwen3_omni.tokens import TokenIds
from mstar_runtime.ops.node import (
    AttentionContext,
    Batch,
    KVGeometry,
    KVNode,
    NodeError,
    NodeSpec,
    RequestError,
    SeqPlan,
)
from mstar_runtime.ops.ports import config_value, max_seq_len
from mstar_runtime.ops.readback import Lazy, Readback, upload
from mstar_runtime.ops.sampler import SamplingParams, sample

PROMPT_TAIL = 5  # rows of the talker prefill that carry codec embeddings: nothink .. codec_pad


class Linear(nn.Module):
    """`weight` and `bias` of a linear layer, under the checkpoint's names."""

    def __init__(self, out_features: int, in_features: int, **factory: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ResizeMLP(nn.Module):
    """`text_projection` / `hidden_projection`: thinker width -> talker width (SiLU between)."""

    def __init__(self, in_dim: int, inter: int, out_dim: int, **factory: Any):
        super().__init__()
        self.linear_fc1 = Linear(inter, in_dim, **factory)
        self.linear_fc2 = Linear(out_dim, inter, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerMoE(KVNode):
    """The talker node; see the module docstring for its phases, state and config."""

    checkpoint_prefix: ClassVar[str] = "talker."

    def __init__(self, spec: NodeSpec):
        super().__init__(spec)
        self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = attention_sizes(spec, "TalkerMoE")
        g = lambda name, *default: config_value(spec, name, *default)  # noqa: E731 - a local shorthand
        self.vocab, self.thinker_hidden = int(g("codec_vocab")), int(g("thinker_hidden"))
        experts = int(g("experts"))
        top_k = int(g("talker_experts_per_token", min(6, experts)))
        normalize = bool(g("talker_norm_topk_prob", True))
        self.section = [int(s) for s in g("talker_mrope_section", default_mrope_section(self.head_dim))]
        if len(self.section) != 3 or sum(self.section) != self.head_dim // 2:
            raise NodeError(f"node '{spec.name}': talker_mrope_section {self.section} must be 3 values summing "
                            f"to head_dim / 2 = {self.head_dim // 2}")
        self.tok = TokenIds.from_spec(spec)
        for name in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                     "codec_think_bos_id", "codec_think_eos_id"):
            if not 0 <= getattr(self.tok, name) < self.vocab:
                raise NodeError(f"node '{spec.name}': {name} {getattr(self.tok, name)} is outside the codec "
                                f"vocab ({self.vocab})")
        self.max_seq_len = max_seq_len(spec)
        eps = float(g("rms_eps", 1e-6))
        kernel = str(spec.settings.get("moe_kernel", "auto"))
        inter, shared = int(g("moe_intermediate")), int(g("shared_intermediate"))
        factory: dict[str, Any] = {"dtype": spec.dtype, "device": spec.device}
        self.model = Decoder(
            self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, eps,
            lambda i: SparseMoE(self.hidden, experts, inter, top_k, normalize, shared, kernel=kernel, **factory),
            **factory,
        )
        self.model.codec_embedding = Weight(torch.empty(self.vocab, self.hidden, **factory))
        self.codec_head = Weight(torch.empty(self.vocab, self.hidden, **factory))
        proj = int(g("projection_intermediate"))
        self.text_projection = ResizeMLP(self.thinker_hidden, proj, self.hidden, **factory)
        self.hidden_projection = ResizeMLP(self.thinker_hidden, proj, self.hidden, **factory)
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
    @property
    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(self.layers, self.kv_heads, self.head_dim)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: NodeSpec) -> SeqPlan:
        if phase == "prefill":
            shape = tuple(shapes.get("states", ()))
            if len(shape) != 2 or shape[0] < 8:
                raise RequestError(f"states must be [S >= 8, thinker hidden] (the thinker's speech prefill), got "
                                   f"shape {shape}", "states")
            if shape[0] > max_seq_len(spec):
                raise RequestError(f"talker prompt of {shape[0]} rows is longer than max_seq_len "
                                   f"{max_seq_len(spec)}", "states")
            return SeqPlan(q_len=shape[0])
        if phase in ("decode", "decode_pad"):
            return SeqPlan(q_len=1)
        if phase == "feed":
            return SeqPlan(q_len=0)
        raise NodeError(f"node '{spec.name}' (TalkerMoE) has no phase '{phase}'")

    # ------------------------------------------------------------------ math
    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mrope_tables(positions, self.freq, self.section, self.codec_head.weight.dtype)

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.model.codec_embedding.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 codec logits, the suppressed ids at -inf."""
        out = F.linear(hidden, self.codec_head.weight).float()
        return out.masked_fill(~self.allowed, float("-inf"))

    def project(self, states: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        """Thinker-width rows -> talker width: hidden_projection where `mm`, text_projection elsewhere."""
        text = self.text_projection(states)
        if not bool(mm.any()):
            return text
        return torch.where(mm[:, None], self.hidden_projection(states), text)

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: Batch, attn: AttentionContext) -> Batch:
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
        bos = self.codec_embed(torch.tensor([self.tok.codec_bos_id], device=dev))
        offset = 0
        for (s, _, pos, _, params, max_frames), seq in zip(checked, attn.seqs, strict=True):
            n = s.shape[0]
            seq.state.clear()
            seq.state.update(
                sampling=params, max_frames=max_frames, frames=0, codec=bos.clone(),
                pad=text[offset + n - PROMPT_TAIL : offset + n - PROMPT_TAIL + 1],
                delta=float(pos[0, -1]) + 1 - n, finished=torch.zeros((), dtype=torch.bool, device=dev),
                history=None if params.repetition_penalty == 1.0 else torch.full(
                    (max_frames,), -1, dtype=torch.long, device=dev),
            )
            offset += n
        return [{} for _ in batch]

    def _check_prefill(
        self, entry: Mapping[str, Any], start: int, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, SamplingParams, int]:
        dev, dt = self.freq.device, self.codec_head.weight.dtype
        if start:
            raise RequestError("the talker prefill starts a request's talker context; this one has "
                               f"{start} tokens already", "states")
        states, mm, pos = entry.get("states"), entry.get("mm"), entry.get("positions")
        if not isinstance(states, torch.Tensor) or states.dim() != 2 or states.shape[1] != self.thinker_hidden:
            raise RequestError(f"states must be [S, {self.thinker_hidden}]", "states")
        n = states.shape[0]
        if n != q_len:
            raise NodeError(f"node '{self.spec.name}': prefill of {n} rows got {q_len} KV slots")
        if not isinstance(mm, torch.Tensor) or tuple(mm.shape) != (n,):
            raise RequestError(f"mm must be a bool tensor [{n}]", "mm")
        if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (3, n):
            raise RequestError(f"positions must be [3, {n}]", "positions")
        name = str(entry.get("speaker", "ethan")).lower()
        if name not in self.tok.speakers:
            raise RequestError(f"unknown speaker {name!r}; known: {', '.join(sorted(self.tok.speakers))}", "speaker")
        speaker = int(self.tok.speakers[name])
        do_sample = scalar(entry, "do_sample", bool, True)
        params = sampling_params(entry, greedy=not do_sample, repetition=True)
        max_frames = scalar(entry, "max_frames", int)
        if max_frames < 1:
            raise RequestError(f"max_frames must be >= 1, got {max_frames}", "max_frames")
        return (states.to(device=dev, dtype=dt), mm.to(device=dev, dtype=torch.bool), pos.to(device=dev,
                dtype=torch.float32), speaker, params, max_frames)

    def phase_decode(self, batch: Batch, attn: AttentionContext) -> Batch:
        texts = []
        for entry in batch:
            text = entry.get("text")
            if not isinstance(text, torch.Tensor) or tuple(text.shape) != (1, self.thinker_hidden):
                raise RequestError(f"text must be one item [1, {self.thinker_hidden}]", "text")
            texts.append(text)
        self._check_prefilled(attn)
        dt = self.codec_head.weight.dtype
        text = self.text_projection(torch.cat(texts).to(device=self.freq.device, dtype=dt))
        return self._frame(text, attn)

    def phase_decode_pad(self, batch: Batch, attn: AttentionContext) -> Batch:
        self._check_prefilled(attn)
        return self._frame(torch.cat([st["pad"] for st in attn.states]), attn)

    def phase_feed(self, batch: Batch, attn: AttentionContext) -> Batch:
        self._check_prefilled(attn)
        for entry in batch:
            fb = entry.get("feedback")
            if not isinstance(fb, torch.Tensor) or tuple(fb.shape) != (1, self.hidden):
                raise RequestError(f"feedback must be [1, {self.hidden}]", "feedback")
        for entry, st in zip(batch, attn.states):
            st["codec"] = entry["feedback"].to(device=self.freq.device, dtype=self.codec_head.weight.dtype)
        return [{} for _ in batch]

    def _check_prefilled(self, attn: AttentionContext) -> None:
        if any("sampling" not in st for st in attn.states):
            raise RequestError("a talker frame on a context that was never prefilled", "text")

    # ------------------------------------------------------------------ one frame
    def _frame(self, text: torch.Tensor, attn: AttentionContext) -> Batch:
        states = attn.states
        dev = self.freq.device
        h = text + torch.cat([st["codec"] for st in states])
        pos = upload([s.start + float(s.state["delta"]) for s in attn.seqs], torch.float32, dev)

        def step(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            cos, sin = self.tables(p[None, :].expand(3, -1))
            return self.model.forward_layers(x, cos, sin, attn.attend)

        hidden = attn.run_graphed(step, h, pos)
        histories = [None if st["history"] is None else st["history"][: st["frames"]] for st in states]
        sampled = sample(self.logits(hidden), [st["sampling"] for st in states], histories,
                         [st["frames"] for st in states])
        # a frame past max_frames is a no-op too (the walk may still feed it text items)
        over = upload([st["frames"] >= st["max_frames"] for st in states], torch.bool, dev)
        finished = torch.stack([st["finished"] for st in states]) | over
        eos = self.tok.codec_eos_token_id
        codes = torch.where(finished, eos, sampled)
        context = torch.stack([hidden, self.codec_embed(codes)], dim=1)  # [B, 2, hidden]
        back = Readback(codes)
        out: Batch = []
        codes32 = codes.to(torch.int32)
        for i, st in enumerate(states):
            st["finished"] = finished[i] | (codes[i] == eos)
            if st["history"] is not None and st["frames"] < st["history"].numel():
                st["history"][st["frames"] : st["frames"] + 1] = codes[i : i + 1]
            st["frames"] += 1
            limit = st["frames"] >= st["max_frames"]
            out.append({
                "code": codes32[i : i + 1],
                "context": context[i],
                "done": True if limit else Lazy(lambda i=i: back.values()[i] == eos),
            })
        return out
