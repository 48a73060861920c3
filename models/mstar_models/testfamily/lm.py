"""TinyLM: a tiny Llama-style LM (kv node) with a flow-matching `denoise` phase.

Parameter names follow the Hugging Face Llama layout that `mstarc.archs.llama` lists
(`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`, ..., `lm_head` when untied), so
the runtime's loader can check them against the plan. The denoise glue (`flow_in`,
`flow_time`, `flow_out`) is not in the llama arch: the catalogue has no arch for it.

Per-(request, tag) state in `attn.states[i]`, set by `prefill` and only read afterwards, so
a discarded speculative decode or a fork cannot corrupt it:
  `gen_base`: KV length at which the tag had produced 0 tokens (start + T - 1 of the last
              prefill; the token count after a step is `kv_len_after - gen_base`),
  `max_new`:  the request's token budget since that prefill.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers import rotary
from mstar_models.layers.decoder import Decoder, DecoderNode
from mstar_models.layers.embedding import VocabEmbedding
from mstar_models.layers.linear import Weight
from mstar_models.layers.mlp import GatedMLP
from mstar_models.testfamily.common import llama_sizes, seed_and_place_, setting, start_reply
from mstar_runtime.kv.prefix_cache import token_keys
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import fed_token, one_rank
from mstar_runtime.ops.readback import Lazy, Readback

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def llama_model(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                intermediate: int, eps: float) -> Decoder:
    """`model.*` of a Llama checkpoint on the layer library (`embed_tokens`, `layers.{i}.*`, `norm`),
    uninitialised: the node fills it (`common.seed_and_place_`)."""
    return Decoder(layers, hidden, heads, kv_heads, head_dim, eps, lambda i: GatedMLP(hidden, intermediate),
                   embed=VocabEmbedding(vocab, hidden))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, 1, head_dim] (float32) of absolute positions (HF's rotate-half pairing: i with i + D/2)."""
    return rotary.rope_tables(positions, rotary.inv_freq(head_dim, theta, positions.device), torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated in float32 (rotate-half), back in x's dtype: the test family's own
    nodes that attend densely (the ASR encoder) rotate one tensor at a time."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def time_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features [B, dim] of flow times t [B] in [0, 1] (scaled by 1000 as in DiT)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.to(torch.float32)[:, None] * 1000.0 * freqs[None, :]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TinyLM(DecoderNode):
    """prefill(tokens: i32[T], max_new: int) / decode(token: i32[1]) -> (token: i32[1],
    code: i32[0 or 1], done: bool, hidden: f32[1, hidden]); denoise(x: f32[L, C], t: f32[1]) -> (v: f32[L, C])."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        one_rank(spec, "TinyLM")
        g = lambda name: setting(spec, name)  # noqa: E731 - a local shorthand
        self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = llama_sizes(spec)
        self.rope_theta, self.eps = float(g("rope_theta")), float(g("rms_eps"))
        self.eos, self.codebook, self.max_context = int(g("eos")), int(g("codebook")), int(g("max_context"))
        self.latent_dim = int(g("latent_dim"))
        if self.heads % self.kv_heads or self.hidden % 2 or self.head_dim % 2:
            raise node.NodeError(
                f"node '{spec.name}': heads must be a multiple of kv_heads; hidden and head_dim even"
            )
        self.model = llama_model(
            self.vocab,
            self.hidden,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            int(g("intermediate")),
            self.eps,
        )
        self.tied = bool(g("tie_embeddings"))
        if not self.tied:
            self.lm_head = Weight.empty(self.vocab, self.hidden)
        self.flow_in = nn.Linear(self.latent_dim, self.hidden)
        self.flow_time = nn.Linear(self.hidden, self.hidden)
        self.flow_out = nn.Linear(self.hidden, self.latent_dim)
        seed_and_place_(self, spec)

    # ------------------------------------------------------------------ contract
    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase == "prefill":
            n = int(shapes["tokens"][0]) if len(shapes["tokens"]) == 1 else 0
            if n < 1:
                raise node.RequestError(
                    f"prefill needs a 1-D, non-empty token list, got shape {tuple(shapes['tokens'])}",
                    "tokens",
                )
            return node.SeqPlan(q_len=n)
        if phase == "decode":
            return node.SeqPlan(q_len=1)
        if phase == "denoise":
            # The latent block attends to the context and to itself, and leaves no KV behind:
            # every Euler step and every CFG branch queries the same context.
            return node.SeqPlan(q_len=int(shapes["x"][0]), mask="full", keep=False)
        raise node.NodeError(f"node '{spec.name}' (TinyLM) has no phase '{phase}'")

    @classmethod
    def prefix_content(cls, phase: str, inputs: Mapping[str, Any], spec: node.NodeSpec) -> list[int] | None:
        """A prefill's KV depends on its token ids (and what precedes them) only: they are its keys."""
        return token_keys(inputs.get("tokens")) if phase == "prefill" else None

    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`decode`, written only as a column step (ops/cohort.py; `run` calls it through ops/column_call.py)."""
        if phase != "decode":
            return None
        return CohortPhase(join=self._cohort_join, step=self._cohort_step, leave=lambda state, cols, steps: None,
                           max_items={"code": 1})

    def _cohort_join(self, state: dict, inputs: Mapping) -> Columns:
        if "gen_base" not in state:
            raise node.RequestError("decode on a KV context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry: its fed token (a cohort's join sees none)
        return {"gen_base": torch.tensor(state["gen_base"]), "max_new": torch.tensor(state["max_new"])}

    def _cohort_step(self, b: CohortStep) -> dict[str, torch.Tensor]:
        ids = b.inputs["token"].reshape(-1).long()
        hidden = self.forward_hidden(self.model.embed_tokens(ids), b.positions, b.attend)
        tokens = self.logits(hidden).argmax(dim=-1).to(torch.int32)
        kv_after = b.positions + 1
        limit = (kv_after - b.cols["gen_base"] >= b.cols["max_new"]) | (kv_after >= self.max_context)
        eos = tokens == self.eos
        return {"token": tokens[:, None], "code": (tokens % self.codebook)[:, None], "code:count": (~eos).long(),
                "done": limit | eos, "hidden": hidden[:, None, :]}

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        # a prefix found cached (`seq.cached`) is in the KV already: only the rest is computed,
        # through run_graphed (a row-wise function: prefix caching's chunks cut it, engine/chunked.py)
        ids = [start_reply(entry, seq, self.vocab, self.max_context, "max_context")[seq.cached:]
               for entry, seq in zip(batch, attn.seqs, strict=True)]
        hidden = attn.run_graphed(lambda i, p: self.forward_hidden(self.model.embed_tokens(i), p, attn.attend),
                                  torch.cat(ids).long(), attn.positions())
        return self._next_tokens(attn.last_rows(hidden), attn)

    def phase_denoise(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        xs = [entry["x"] for entry in batch]
        for x in xs:
            if x.dim() != 2 or x.shape[1] != self.latent_dim:
                raise node.RequestError(f"x must be [L, {self.latent_dim}], got {tuple(x.shape)}", "x")
        t = torch.cat([entry["t"].reshape(1) for entry in batch]).to(self.flow_time.weight.dtype)
        temb = self.flow_time(time_features(t, self.hidden).to(t.dtype))  # [B, hidden]
        lens = torch.tensor([x.shape[0] for x in xs], device=temb.device)
        h = self.flow_in(torch.cat(xs).to(temb.dtype)) + temb.repeat_interleave(lens, dim=0)
        v = self.flow_out(self.forward_hidden(h, attn.positions(), attn.attend))
        return [{"v": part} for part in attn.split(v)]

    # ------------------------------------------------------------------ math
    def forward_hidden(self, h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Packed rows h [N, hidden] at absolute `positions` [N] -> final-normed hidden [N, hidden]."""
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta)
        return self.model.forward_layers(h, cos.to(h.dtype), sin.to(h.dtype), attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(hidden, weight)

    def _next_tokens(self, last: torch.Tensor, attn: node.AttentionContext) -> node.Batch:
        """Greedy next tokens. `code` and `done` depend on the token, so they are `Lazy` (as in
        Orpheus' backbone): the step never waits for the device, and every runtime test with
        this model goes through the interpreter's lanes (runtime/mstar_runtime/ops/readback.py)."""
        tokens = self.logits(last).argmax(dim=-1).to(torch.int32)
        back = Readback(tokens)
        eos = tokens == self.eos  # each `done`'s device value (a chain's join copies it unread)
        out: node.Batch = []
        for i, seq in enumerate(attn.seqs):
            kv_after = seq.start + seq.q_len
            produced = kv_after - seq.state["gen_base"]
            limit = produced >= seq.state["max_new"] or kv_after >= self.max_context
            is_eos = Lazy(lambda i=i: back.values()[i] == self.eos, eos[i])
            out.append({
                "token": tokens[i : i + 1],
                "code": Lazy(lambda i=i, e=is_eos: tokens[i:i] if e.get() else tokens[i : i + 1] % self.codebook),
                "done": True if limit else is_eos,
                "hidden": last[i : i + 1],
            })
        return out
