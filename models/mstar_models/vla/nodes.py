"""pi0-shaped VLA nodes: a VLM backbone that prefills the prompt, an action expert that reads
its context, and the flow-matching sampler.

Both KV nodes have the `llama` arch's tensors (Hugging Face names, `model.layers.{i}...`),
the same layers, KV heads and head dim, so the expert's layer i attends to the VLM's layer i
pages. The expert's arch has `vocab = action_dim`: its `model.embed_tokens.weight`
[action_dim, hidden] is the action input projection (an action row times it) and its
`lm_head.weight` [action_dim, hidden] the output projection to velocities. The flow time
enters as in pi0: sinusoidal features of t (periods 4e-3 .. 4) concatenated to each action
token, then `action_time_mlp_in` (2 hidden -> hidden), swish, `action_time_mlp_out` (glue
the arch catalogue does not list). The action tokens sit at positions prefix_len + i, attend
to the whole prefix and to each other (a full mask), and leave no KV behind (`keep=False`:
every denoise step queries the same prefix).

Flow: x goes from noise at t = 1 to actions at t = 0 on t_i = 1 - i / flow_steps, x <- x + dt
v with dt = -1 / flow_steps (pi0's Euler sampler, v pointing from actions to noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.decoder import DecoderNode
from mstar_models.layers.linear import Weight
from mstar_models.testfamily.common import as_int, llama_sizes, seed_and_place_, setting
from mstar_models.testfamily.lm import llama_model, rope_tables
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import one_rank

ROPE_THETA = 10000.0  # Gemma's, the pi0 VLM's
RMS_EPS = 1e-6

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sinusoidal features [B, dim] of flow times t [B]: sin then cos of t * 2 pi / period for
    periods spaced geometrically from `min_period` to `max_period` (pi0's time embedding)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = t.to(torch.float64)[:, None] * (2 * math.pi / period)[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(torch.float32)


class _Llama(DecoderNode):
    """What both KV nodes share: the Llama layout, its sizes, and a forward over packed rows."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        one_rank(spec, type(self).__name__)
        self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = llama_sizes(spec)
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise node.NodeError(f"node '{spec.name}': heads must be a multiple of kv_heads, head_dim even")
        self.model = llama_model(self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim,
                                 int(setting(spec, "intermediate")), RMS_EPS)
        self.lm_head = Weight.empty(self.vocab, self.hidden)

    def forward_hidden(self, h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Packed rows h [N, hidden] at absolute `positions` [N] -> final-normed hidden [N, hidden]."""
        cos, sin = rope_tables(positions, self.head_dim, ROPE_THETA)
        return self.model.forward_layers(h, cos.to(h.dtype), sin.to(h.dtype), attend)


class Backbone(_Llama):
    """prefill(prompt: i32[T]) -> (): the prompt's K/V, causally, in the node's context (the
    action expert reads it). Its `lm_head` is the arch's; no phase of this walk reads logits."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.max_prefix = int(spec.settings.get("max_seq_len", 0)) or None
        seed_and_place_(self, spec)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase != "prefill":
            raise node.NodeError(f"node '{spec.name}' (Backbone) has no phase '{phase}'")
        shape = tuple(shapes.get("prompt", ()))
        if len(shape) != 1 or shape[0] < 1:
            raise node.RequestError(f"prompt must be a 1-D, non-empty token list, got shape {shape}", "prompt")
        return node.SeqPlan(q_len=shape[0])

    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        for entry, seq in zip(batch, attn.seqs, strict=True):
            tokens = entry["prompt"]
            if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab:
                raise node.RequestError(f"prompt token ids must lie in [0, {self.vocab})", "prompt")
            if self.max_prefix is not None and seq.start + seq.q_len > self.max_prefix:
                raise node.RequestError(f"a prefix of {seq.start + seq.q_len} tokens is longer than max_seq_len "
                                        f"{self.max_prefix} of node '{self.spec.name}'", "prompt")
        ids = torch.cat([entry["prompt"].reshape(-1) for entry in batch]).to(self.spec.device).long()
        self.forward_hidden(self.model.embed_tokens(ids), attn.positions(), attn.attend)
        return [{} for _ in batch]


class ActionExpert(_Llama):
    """denoise(x: f32[horizon, action_dim], t: f32[1]) -> (v: f32[horizon, action_dim]), over
    the prefix the backbone wrote (the phase's first read, `reads vlm`)."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.horizon, self.action_dim = int(setting(spec, "horizon")), int(setting(spec, "action_dim"))
        if self.vocab != self.action_dim:
            raise node.NodeError(f"node '{spec.name}': its arch's vocab ({self.vocab}) must be action_dim "
                                 f"({self.action_dim}); the embedding and head are the action projections")
        self.action_time_mlp_in = nn.Linear(2 * self.hidden, self.hidden)
        self.action_time_mlp_out = nn.Linear(self.hidden, self.hidden)
        seed_and_place_(self, spec)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase != "denoise":
            raise node.NodeError(f"node '{spec.name}' (ActionExpert) has no phase '{phase}'")
        shape = tuple(shapes.get("x", ()))
        if len(shape) != 2 or shape[0] < 1:
            raise node.RequestError(f"x must be [horizon, action_dim], got shape {shape}", "x")
        return node.SeqPlan(q_len=shape[0], mask="full", keep=False)

    def action_tokens(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Rows [B, L, hidden] of the action chunks x [B, L, A] at flow times t [B]."""
        a = x.to(self.model.embed_tokens.weight.dtype) @ self.model.embed_tokens.weight
        te = time_embedding(t, self.hidden).to(a.dtype)[:, None, :].expand_as(a)
        return self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, te], dim=-1))))

    def phase_denoise(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        for entry in batch:
            if tuple(entry["x"].shape) != (self.horizon, self.action_dim):
                raise node.RequestError(f"x must be [{self.horizon}, {self.action_dim}], got {tuple(entry['x'].shape)}",
                                        "x")
            if entry["t"].numel() != 1:
                raise node.RequestError(f"t must hold one flow time, got shape {tuple(entry['t'].shape)}", "t")
        dev = self.spec.device
        x = torch.stack([entry["x"] for entry in batch]).to(dev)
        t = torch.cat([entry["t"].reshape(1) for entry in batch]).to(dev)
        h = self.action_tokens(x, t).reshape(-1, self.hidden)
        # the action tokens follow the prefix: positions prefix_len .. prefix_len + L - 1
        positions = torch.tensor([s.read_lens[0] + i for s in attn.seqs for i in range(s.q_len)], device=dev)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attn.attend(layer, q, k, v, over=(0,))

        v = F.linear(self.forward_hidden(h, positions, attend), self.lm_head.weight)
        return [{"v": part.to(entry["x"].dtype)} for part, entry in zip(attn.split(v), batch)]


class Flow(node.StatelessNode):
    """init(seed: int) -> (x: f32[horizon, action_dim]); time(index: int) -> (t: f32[1]);
    step(x, v: f32[horizon, action_dim]) -> (x)."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.shape = (int(setting(spec, "horizon")), int(setting(spec, "action_dim")))
        self.steps = int(setting(spec, "flow_steps"))

    def phase_init(self, batch: node.Batch) -> node.Batch:
        # one generator per request (its seed), on the CPU: the same noise on every device
        return [{"x": torch.randn(self.shape, generator=torch.Generator().manual_seed(as_int(e, "seed")))
                 .to(self.spec.device)} for e in batch]

    def phase_time(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            i = as_int(entry, "index")
            if not 0 <= i < self.steps:
                raise node.RequestError(f"index must lie in [0, {self.steps}), got {i}", "index")
            out.append({"t": torch.tensor([1.0 - i / self.steps], device=self.spec.device)})
        return out

    def phase_step(self, batch: node.Batch) -> node.Batch:
        x = torch.stack([entry["x"] for entry in batch])
        v = torch.stack([entry["v"] for entry in batch]).to(x.dtype)
        return [{"x": row} for row in (x - v / self.steps).unbind(0)]
