"""Qwen3-Omni's code predictor as a KV node: the 5-layer dense model that adds a frame's 15 residual codes.

The math is transformers 5.24's `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`
as the talker's `prepare_inputs_for_generation` runs it once per frame: a fresh context, a
2-row prefill [the talker's final-normed hidden state, `codec_embedding(code0)`] whose last row
gives code 1 through `lm_head[0]`, then single-row steps: step g feeds
`codec_embedding[g - 1](code g)` and `lm_head[g]` gives code g + 1. Layers are `decoder.Decoder`
with a dense SwiGLU MLP, QK-norm and 1-D RoPE (positions 0 .. 15 within the frame).
Parameters carry the checkpoint's names under `talker.code_predictor.`
(`model.layers.{i}.*`, `model.norm.weight`, `model.codec_embedding.{g}.weight`,
`lm_head.{g}.weight`, g < code_groups - 1); the tables and heads are views of two stacked
buffers, so a batch gathers every entry's table with one index.

Phases (models/qwen3_omni/qwen3_omni.walk, node `code_predictor`):
- `step(inputs, group, do_sample, seed) -> (code, inputs)`: group 0 starts the frame with
  the talker's `context` [2, hidden]; group g >= 1 feeds the previous step's returned
  embedding [1, hidden]. Returns code g + 1 ([1], greedy, or top-k 50 / top-p 0.8 at
  temperature 1 when `do_sample`, HF's code-predictor settings) and its embedding, the next
  step's input. The `seed` read at group 0 makes the draws reproducible (the sampler's
  (seed, step) rule, the step counting the request's draws); without one each draw takes
  fresh randomness.
- `finish(code0, residual) -> (frame, feedback)`: the frame's codes [1, code_groups] (code0,
  then the residual codes; no row for a codec-eos frame, which HF never decodes) and the
  talker's next codec input [1, hidden], the sum of `codec_embedding(code0)` and the 15
  residual embeddings (HF sums the 16 rows in one reduction; so does this).

The context lives in the request's node state, not in the paged pool: the runtime's KV
contexts only grow, and this one must restart every frame (at most 16 tokens, 5 layers). So
every phase adds no KV (`SeqPlan(q_len=0)`; the walk's `max_seq_len = 16` keeps the pool the
memory pass reserves for this node minimal); the K/V of the frame so far are a dense
[layers, code_groups, kv_heads, head_dim] pair in `attn.states[i]["kv"]`, and a step's
attention runs over the batch's stacked frames with a causal mask.

Per-(request, tag) state: `kv` (K, V), `len` (tokens in the frame's context), `group` (the
last step's group), `embeds` (the frame's codec-embedding rows so far), `seed`, `draws`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mstar_models.qwen3_omni.decoder import Decoder, StackedWeights, seeded_init_
from mstar_models.qwen3_omni.lm_common import attention_sizes, scalar
from mstar_models.qwen3_omni.moe import DenseMLP
from mstar_models.qwen3_omni.positions import inv_freq, rope_tables
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
from mstar_runtime.ops.ports import config_value
from mstar_runtime.ops.readback import Lazy, Readback, upload
from mstar_runtime.ops.sampler import SamplingParams, sample

TOP_K, TOP_P = 50, 0.8  # HF's talker passes these to the code predictor's generate when sampling


class CodePredictor(KVNode):
    """The code-predictor node; see the module docstring for its phases and state."""

    checkpoint_prefix: ClassVar[str] = "talker.code_predictor."

    def __init__(self, spec: NodeSpec):
        super().__init__(spec)
        self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = attention_sizes(spec, "CodePredictor")
        g = lambda name, *default: config_value(spec, name, *default)  # noqa: E731 - a local shorthand
        self.vocab, self.groups = int(g("vocab")), int(g("code_groups"))
        if self.groups < 2:
            raise NodeError(f"node '{spec.name}': code_groups must be >= 2, got {self.groups}")
        self.tok = TokenIds.from_spec(spec)
        eps = float(g("rms_eps", 1e-6))
        inter = int(g("intermediate"))
        factory: dict[str, Any] = {"dtype": spec.dtype, "device": spec.device}
        self.model = Decoder(self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, eps,
                             lambda i: DenseMLP(self.hidden, inter, **factory), **factory)
        self.model.codec_embedding = StackedWeights(self.groups - 1, self.vocab, self.hidden, **factory)
        self.lm_head = StackedWeights(self.groups - 1, self.vocab, self.hidden, **factory)
        seeded_init_(self, spec.name)
        self.register_buffer("freq", inv_freq(self.head_dim, float(g("cp_rope_theta", 1e6))).to(spec.device),
                             persistent=False)
        self.scale = self.head_dim**-0.5

    # ------------------------------------------------------------------ contract
    @property
    def kv_geometry(self) -> KVGeometry:
        # the engine's pool is never written (every phase has q_len 0): the smallest legal one
        return KVGeometry(1, 1, self.head_dim)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: NodeSpec) -> SeqPlan:
        if phase in ("step", "finish"):
            return SeqPlan(q_len=0)
        raise NodeError(f"node '{spec.name}' (CodePredictor) has no phase '{phase}'")

    # ------------------------------------------------------------------ step
    def phase_step(self, batch: Batch, attn: AttentionContext) -> Batch:
        dev, dt = self.freq.device, self.lm_head.stacked.dtype
        checked = [self._check_step(entry, st) for entry, st in zip(batch, attn.states)]
        for (group, _, _, seed), st in zip(checked, attn.states, strict=True):
            if group == 0:  # a new frame: a fresh context
                shape = (self.layers, self.groups, self.kv_heads, self.head_dim)
                st.update(kv=(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)),
                          len=0, embeds=[], draws=st.get("draws", 0))
                if seed is not None:
                    st["seed"] = seed
        inputs = [x for _, x, _, _ in checked]
        lens = [st["len"] for st in attn.states]
        q_lens = [x.shape[0] for x in inputs]
        x = torch.cat(inputs)
        for (group, rows, _, _), st in zip(checked, attn.states):
            if group == 0:
                st["embeds"].append(rows[1:2])  # codec_embedding(code0), the talker's table
        positions = upload([p for n, q in zip(lens, q_lens) for p in range(n, n + q)], torch.long, dev)
        cos, sin = rope_tables(positions, self.freq, dt)
        keys = torch.stack([st["kv"][0] for st in attn.states])
        values = torch.stack([st["kv"][1] for st in attn.states])
        hidden = self.model.forward_layers(x, cos, sin, self._attend(keys, values, lens, q_lens))
        ends = upload([sum(q_lens[: i + 1]) - 1 for i in range(len(q_lens))], torch.long, dev)
        last = hidden.index_select(0, ends)
        groups = upload([c[0] for c in checked], torch.long, dev)
        logits = torch.bmm(self.lm_head.stacked.index_select(0, groups), last[:, :, None])[:, :, 0].float()
        params = [self._params(st, do_sample) for (_, _, do_sample, _), st in zip(checked, attn.states)]
        codes = sample(logits, params, [None] * len(params), [st["draws"] for st in attn.states])
        # the embedding of code g + 1 in table g: the next step's input
        embeds = self.model.codec_embedding.stacked[groups, codes][:, None, :]
        out: Batch = []
        codes32 = codes.to(torch.int32)
        for i, ((group, _, _, _), st) in enumerate(zip(checked, attn.states)):
            st["kv"] = (keys[i], values[i])
            st["len"] = lens[i] + q_lens[i]
            st["group"] = group
            st["draws"] += 1
            st["embeds"].append(embeds[i])
            out.append({"code": codes32[i : i + 1], "inputs": embeds[i]})
        return out

    def _check_step(
        self, entry: Mapping[str, Any], st: Mapping[str, Any]
    ) -> tuple[int, torch.Tensor, bool, int | None]:
        group = scalar(entry, "group", int)
        if not 0 <= group <= self.groups - 2:
            raise RequestError(f"group must be in [0, {self.groups - 2}], got {group}", "group")
        rows = entry.get("inputs")
        want = 2 if group == 0 else 1
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (want, self.hidden):
            raise RequestError(f"inputs of group {group} must be [{want}, {self.hidden}], got "
                               f"{list(getattr(rows, 'shape', []))}", "inputs")
        if group and st.get("group") != group - 1:
            raise RequestError(f"step of group {group} after group {st.get('group')}: a frame's steps run in "
                               "order from group 0", "group")
        seed = entry.get("seed")
        return (group, rows.to(device=self.freq.device, dtype=self.lm_head.stacked.dtype),
                scalar(entry, "do_sample", bool, True), None if seed is None else scalar(entry, "seed", int))

    def _params(self, st: Mapping[str, Any], do_sample: bool) -> SamplingParams:
        if not do_sample:
            return SamplingParams(temperature=0.0)
        return SamplingParams(temperature=1.0, top_k=TOP_K, top_p=TOP_P, seed=st.get("seed"))

    def _attend(
        self, keys: torch.Tensor, values: torch.Tensor, lens: list[int], q_lens: list[int]
    ) -> Any:
        """An `attend` over the batch's dense frame contexts keys/values [B, layers, M, Hkv, D]:
        writes each row's K/V at its frame position, then causal attention per entry."""
        dev = keys.device
        b_idx = upload([b for b, q in enumerate(q_lens) for _ in range(q)], torch.long, dev)
        q_idx = upload([i for q in q_lens for i in range(q)], torch.long, dev)
        k_pos = upload([n + i for n, q in zip(lens, q_lens) for i in range(q)], torch.long, dev)
        q_max, m = max(q_lens), keys.shape[2]
        # query i of entry b sits at frame position lens[b] + i and sees keys up to it
        see = torch.arange(m, device=dev)[None, None, :] <= (
            torch.tensor(lens, device=dev)[:, None, None] + torch.arange(q_max, device=dev)[None, :, None])
        group = self.heads // self.kv_heads

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys[b_idx, layer, k_pos] = k
            values[b_idx, layer, k_pos] = v
            qp = q.new_zeros(len(q_lens), q_max, self.heads, self.head_dim)
            qp[b_idx, q_idx] = q
            kk = keys[:, layer].repeat_interleave(group, dim=2)  # [B, M, H, D]
            vv = values[:, layer].repeat_interleave(group, dim=2)
            out = F.scaled_dot_product_attention(qp.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                                 attn_mask=see[:, None], scale=self.scale)
            return out.transpose(1, 2)[b_idx, q_idx]

        return attend

    # ------------------------------------------------------------------ finish
    def phase_finish(self, batch: Batch, attn: AttentionContext) -> Batch:
        dev = self.freq.device
        frames = []
        for entry, st in zip(batch, attn.states, strict=True):
            code0, residual = entry.get("code0"), entry.get("residual")
            if not isinstance(code0, torch.Tensor) or code0.numel() != 1:
                raise RequestError("code0 must be one code [1]", "code0")
            if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != (self.groups - 1,):
                raise RequestError(f"residual must hold the frame's {self.groups - 1} residual codes, got "
                                   f"{list(getattr(residual, 'shape', []))}", "residual")
            if len(st.get("embeds", ())) != self.groups:
                raise RequestError("finish before the frame's residual steps all ran", "residual")
            frames.append(torch.cat([code0.reshape(1), residual.reshape(-1)]).to(device=dev, dtype=torch.int32))
        stacked = torch.stack(frames)  # [B, code_groups]
        back = Readback(stacked[:, 0])
        eos = self.tok.codec_eos_token_id
        out: Batch = []
        for i, st in enumerate(attn.states):
            feedback = torch.cat(st["embeds"]).sum(dim=0, keepdim=True)
            st["embeds"] = []
            frame = stacked[i : i + 1]
            out.append({"frame": Lazy(lambda f=frame, i=i: f[:0] if back.values()[i] == eos else f),
                        "feedback": feedback})
        return out
