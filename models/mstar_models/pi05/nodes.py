"""π0.5's Gemma VLM, its action expert and the flow-matching sampler (LeRobot's `PI05Pytorch`).

- `GemmaVLM` (kv): `prefill(images, prompt) -> ()`. The prefix is every camera's 256 tokens
  (the vision node's, unscaled) then the prompt's token embeddings times sqrt(width), at
  positions 0 .. P-1, attending bidirectionally within the prefix (`mask="full"`: the
  reference's prefix attention mask is all zeros, one block). Its K/V, per layer, is the
  context the expert reads. Gemma 2B's layers: `1 + w` RMSNorms, GQA with one KV head,
  RoPE (theta 10,000), GeGLU MLP with tanh-GELU (the layer library's `Decoder`,
  `unit_offset`). Nothing reads the VLM's output, so no final norm or head runs.
- `ActionExpert` (kv): `step(x, index) -> (x)`, reading `vlm`: one Euler step of the flow,
  t = 1 + index dt with dt = -1 / flow_steps and x + dt v (the reference's update, op for op),
  so the walk's denoise loop is one call per step. The velocity: the chunk x [50, 32] becomes 50
  tokens (`action_in_proj`); the flow time becomes the condition
  `silu(time_mlp_out(silu(time_mlp_in(sincos(t)))))` (periods 4e-3 .. 4, sin then cos);
  each of the 18 layers is Gemma-300M-shaped with adaptive norms
  (`layers.AdaptiveRMSNorm`): `h += gate_1 * attn(norm_1(h))`, `h += gate_2 * mlp(norm_2(h))`,
  where layer l's 50 queries attend in one softmax over the VLM's layer-l prefix K/V and
  over the chunk's own K/V (bidirectional within the chunk, kept nowhere: `keep=False`), at
  positions P .. P+49. The final adaptive norm, then `action_out_proj` in float32, gives v.
  The denoise loop runs as a decode cohort (`cohort_phase`): every live request's chunk in
  one step per Euler step, its index a column, captured as a CUDA graph per batch bucket.
  That column step is the only `step`: a plain batched call (a loop without its cohort mark)
  runs it as a one-step cohort (runtime/mstar_runtime/ops/column_call.py).
- `Flow` (stateless): `init(seed) -> (x)` N(0, 1) noise from the request's seed (a CPU
  generator: the same noise on every device), `start(noise) -> (x)` given noise (checked:
  [horizon, action_dim], finite), `finish(x, dims) -> (actions, dims)`.

Precision: the four projections of the expert (`action_in_proj`, `action_out_proj`,
`time_mlp_in`, `time_mlp_out`) sit outside the reference's `PaliGemmaWithExpertModel`, which
is what its bfloat16 setting converts, so they hold and compute float32 here too; the
condition is cast to the node dtype before the adaptive norms' dense layers.

Checkpoint names (`mstarc/archs/pi05.py`): the VLM under
`model.paligemma_with_expert.paligemma.model.` (its `checkpoint_prefix`); the expert's layers
and final norm under `model.paligemma_with_expert.gemma_expert.model.`, its projections under
`model.` (`rename`); the two language heads of the file are declared unused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers import rotary
from mstar_models.layers.attention import Attend, Attention
from mstar_models.layers.decoder import Decoder
from mstar_models.layers.embedding import VocabEmbedding
from mstar_models.layers.init import seeded_init_
from mstar_models.layers.mlp import GatedMLP
from mstar_models.layers.norm import AdaptiveRMSNorm
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import CohortPhase, CohortStep
from mstar_runtime.ops.ports import one_rank

ROPE_THETA = 10000.0  # Gemma's
RMS_EPS = 1e-6
MIN_PERIOD, MAX_PERIOD = 4e-3, 4.0  # PI05Config.min_period / max_period
POLICY_PREFIX = "model."  # LeRobot's PI05Policy.model
EXPERT_PREFIX = POLICY_PREFIX + "paligemma_with_expert.gemma_expert.model."
# in the released file, never read by π0.5 (the VLM's tied head and the expert's unused one)
UNUSED_HEADS = (POLICY_PREFIX + "paligemma_with_expert.paligemma.lm_head.weight",
                POLICY_PREFIX + "paligemma_with_expert.gemma_expert.lm_head.weight")


def _int(spec: node.NodeSpec, name: str) -> int:
    value = spec.arch_args.get(name, spec.settings.get(name, spec.config.get(name)))
    if isinstance(value, bool) or not isinstance(value, int):
        raise node.NodeError(f"node '{spec.name}': needs an integer '{name}' (arch argument, setting or config), "
                             f"got {value!r}")
    return value


def _check_chunk(shape: tuple[int, ...], horizon: int, action_dim: int) -> None:
    """An action chunk's shape must be the node's [horizon, action_dim]: a RequestError naming `x`."""
    if shape != (horizon, action_dim):
        raise node.RequestError(f"x must be [{horizon}, {action_dim}], got {shape}", "x")


def time_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sin-cos features [B, dim] (float32) of flow times t [B]: sin then cos of t * 2 pi / period for
    dim / 2 periods spaced geometrically from 4e-3 to 4, computed in float64 as the reference does."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = MIN_PERIOD * (MAX_PERIOD / MIN_PERIOD) ** fraction
    angles = (1.0 / period * 2 * math.pi)[None, :] * t.to(torch.float64)[:, None]
    return torch.cat([angles.sin(), angles.cos()], dim=1).to(torch.float32)


class _Gemma(node.KVNode):
    """The Gemma attention layout both KV nodes share (the expert reads the VLM's pages layer by layer)."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        one_rank(spec, type(self).__name__)
        self.hidden, self.depth = _int(spec, "hidden"), _int(spec, "layers")
        self.heads, self.kv_heads, self.head_dim = _int(spec, "heads"), _int(spec, "kv_heads"), _int(spec, "head_dim")
        self.intermediate = _int(spec, "intermediate")
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise node.NodeError(f"node '{spec.name}': heads must be a multiple of kv_heads, head_dim even")
        self.factory = {"device": spec.device, "dtype": spec.dtype}
        # on the node's device once: a host table copied up per step could not be captured
        self.inv_freq = rotary.inv_freq(self.head_dim, ROPE_THETA).to(spec.device)

    @property
    def kv_geometry(self) -> node.KVGeometry:
        return node.KVGeometry(self.depth, self.kv_heads, self.head_dim)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.rope_tables(positions, self.inv_freq, dtype)


class GemmaVLM(_Gemma):
    """prefill(images: [N, tokens, width], prompt: i32[T]) -> (): the prefix K/V (see the module docstring)."""

    checkpoint_prefix: ClassVar[str] = "model.paligemma_with_expert.paligemma.model."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.vocab = _int(spec, "vocab")
        self.max_prefix = int(spec.settings.get("max_seq_len", 0)) or None
        self.language_model = Decoder(
            self.depth, self.hidden, self.heads, self.kv_heads, self.head_dim, RMS_EPS,
            lambda i: GatedMLP(self.hidden, self.intermediate, activation="gelu_tanh", **self.factory),
            embed=VocabEmbedding(self.vocab, self.hidden, **self.factory), unit_offset=True, **self.factory)
        seeded_init_(self, spec.name)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase != "prefill":
            raise node.NodeError(f"node '{spec.name}' (GemmaVLM) has no phase '{phase}'")
        images, prompt = tuple(shapes.get("images", ())), tuple(shapes.get("prompt", ()))
        if len(images) != 3 or images[0] < 1:
            raise node.RequestError(f"images must be [cameras, tokens, width] features, got shape {images}", "images")
        if len(prompt) != 1 or prompt[0] < 1:
            raise node.RequestError(f"prompt must be a 1-D, non-empty token list, got shape {prompt}", "prompt")
        return node.SeqPlan(q_len=images[0] * images[1] + prompt[0], mask="full")

    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        rows = []
        for entry, seq in zip(batch, attn.seqs, strict=True):
            images, tokens = entry["images"], entry["prompt"]
            if images.dim() != 3 or images.shape[-1] != self.hidden:
                raise node.RequestError(f"images must be [cameras, tokens, {self.hidden}], got {tuple(images.shape)}",
                                        "images")
            if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab:
                raise node.RequestError(f"prompt token ids must lie in [0, {self.vocab})", "prompt")
            if seq.start != 0:
                raise node.RequestError("the VLM's context already holds a prefix: one prefill per request", "prompt")
            if self.max_prefix is not None and seq.q_len > self.max_prefix:
                raise node.RequestError(f"a prefix of {seq.q_len} tokens is longer than max_seq_len {self.max_prefix} "
                                        f"of node '{self.spec.name}'", "prompt")
            rows.append((images, tokens))
        h = self.prefix_embeddings(rows)
        cos, sin = self.rope(attn.positions(), h.dtype)
        self.language_model.forward_layers(h, cos, sin, attn.attend)
        return [{} for _ in batch]

    def prefix_embeddings(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Packed prefix rows [sum P, width]: each entry's image tokens, then its prompt embeddings * sqrt(width)."""
        dev, dtype = self.spec.device, self.spec.dtype
        ids = torch.cat([tokens.reshape(-1) for _, tokens in rows]).to(dev).long()
        text = self.language_model.embed_tokens(ids) * math.sqrt(self.hidden)
        parts, at = [], 0
        for images, tokens in rows:
            parts.append(images.reshape(-1, self.hidden).to(dev, dtype))
            parts.append(text[at:at + tokens.numel()])
            at += tokens.numel()
        return torch.cat(parts)


class _ExpertLayer(nn.Module):
    def __init__(self, attention: Attention, mlp: nn.Module, hidden: int, **factory: Any):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = AdaptiveRMSNorm(hidden, hidden, RMS_EPS, **factory)
        self.post_attention_layernorm = AdaptiveRMSNorm(hidden, hidden, RMS_EPS, **factory)


class ActionExpert(_Gemma):
    """step(x: f32[horizon, action_dim], index: int) -> (x), over the prefix the VLM wrote (the
    phase's first read, `reads vlm`)."""

    # its names share only the policy's `model.` prefix, so the loader's check for stray
    # tensors under it would refuse the two heads the released file holds
    unused_checkpoint_tensors: ClassVar[tuple[str, ...]] = UNUSED_HEADS

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.horizon, self.action_dim = _int(spec, "horizon"), _int(spec, "action_dim")
        self.steps = _int(spec, "flow_steps")
        self.dt = -1.0 / self.steps
        h, f = self.hidden, self.factory
        self.layers = nn.ModuleList(
            _ExpertLayer(Attention(h, self.heads, self.kv_heads, self.head_dim, eps=RMS_EPS, **f),
                         GatedMLP(h, self.intermediate, activation="gelu_tanh", **f), h, **f)
            for _ in range(self.depth))
        self.norm = AdaptiveRMSNorm(h, h, RMS_EPS, **f)
        f32 = {"device": spec.device, "dtype": torch.float32}
        self.action_in_proj = nn.Linear(self.action_dim, h, **f32)
        self.action_out_proj = nn.Linear(h, self.action_dim, **f32)
        self.time_mlp_in = nn.Linear(h, h, **f32)
        self.time_mlp_out = nn.Linear(h, h, **f32)
        seeded_init_(self, spec.name)

    def rename(self, name: str) -> str:
        """The checkpoint name of a module tensor (see the module docstring)."""
        return (EXPERT_PREFIX if name.startswith(("layers.", "norm.")) else POLICY_PREFIX) + name

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase != "step":
            raise node.NodeError(f"node '{spec.name}' (ActionExpert) has no phase '{phase}'")
        # the node's own chunk shape, so that a bad `x` fails its request here: the column step
        # adds a block of exactly `horizon` tokens (an entry of another count is a NodeError there)
        horizon = _int(spec, "horizon")
        _check_chunk(tuple(shapes.get("x", ())), horizon, _int(spec, "action_dim"))
        return node.SeqPlan(q_len=horizon, mask="full", keep=False)

    def condition(self, t: torch.Tensor) -> torch.Tensor:
        """The adaptive norms' condition rows [B, hidden] (float32) of flow times t [B]."""
        c = F.silu(self.time_mlp_in(time_features(t, self.hidden)))
        return F.silu(self.time_mlp_out(c))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Velocities [B, L, A] (float32) of chunks x [B, L, A] at times t [B]; the tokens at `positions` [B * L]."""
        b, n = x.shape[0], x.shape[1]
        dtype = self.spec.dtype
        cond = self.condition(t).to(dtype)
        h = self.action_in_proj(x.float()).to(dtype).reshape(b * n, self.hidden)
        cos, sin = self.rope(positions, dtype)

        def rows(m: torch.Tensor) -> torch.Tensor:  # one modulation row per request -> one per token
            return m.repeat_interleave(n, dim=0)

        for i, layer in enumerate(self.layers):
            scale, shift, gate = (rows(m) for m in layer.input_layernorm.modulation(cond))
            a = layer.self_attn(i, layer.input_layernorm(h, scale, shift), cos, sin, attend)
            h = h + a * gate
            scale, shift, gate = (rows(m) for m in layer.post_attention_layernorm.modulation(cond))
            h = h + layer.mlp(layer.post_attention_layernorm(h, scale, shift)) * gate
        scale, shift, _ = (rows(m) for m in self.norm.modulation(cond))
        out = self.norm(h, scale, shift)
        return self.action_out_proj(out.float()).reshape(b, n, self.action_dim)

    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`step`, written only as a column step (runtime/mstar_runtime/ops/cohort.py; a plain
        batched call runs it through runtime/mstar_runtime/ops/column_call.py): the rows in one
        call, the flow time from each row's index, the chunk's 50 tokens a block kept nowhere
        (`keep=False`) that attends to the VLM's prefix and to itself (`attend_block`); no
        columns of its own. A row runs at most `flow_steps` steps (`limit`: a longer loop is
        declined, and the plain call refuses the index that is out of range)."""
        if phase != "step":
            return None

        def step(b: CohortStep) -> dict[str, torch.Tensor]:
            if b.attend_block is None:
                raise node.NodeError(f"node '{self.spec.name}': a cohort step of `step` needs the VLM's context "
                                     "(the engine gave no attend_block)")
            x = b.inputs["x"].to(torch.float32)
            # t = 1 + index dt, in float64 then rounded to float32 (as the reference's Python float)
            t = (1.0 + b.inputs["index"].to(torch.float64) * self.dt).to(torch.float32)
            positions = (b.read_lens[0][:, None] + torch.arange(self.horizon, device=x.device)).reshape(-1)

            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return b.attend_block(layer, q, k, v, 0)  # type: ignore[misc]  # checked above

            return {"x": x + self.dt * self.velocity(x, t, positions, attend)}

        return CohortPhase(join=self._join, step=step, leave=lambda state, cols, steps: None,
                           tokens=self.horizon, keep=False, limit=lambda state, inputs: self.steps)

    def _join(self, state: dict[str, Any], inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """No columns; the host checks of the ports it is given (a RequestError naming the
        port): in a plain call the entry's `x` and `index`; in a cohort the loop-invariant
        inputs, neither of them (`kv_plan` checked the joining `x`, and the index column
        counts from 0, bounded by `limit`)."""
        if "x" in inputs:
            x = inputs["x"]
            _check_chunk(tuple(x.shape) if isinstance(x, torch.Tensor) else (), self.horizon, self.action_dim)
        if "index" in inputs:
            i = inputs["index"]
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.steps:
                raise node.RequestError(f"index must lie in [0, {self.steps}), got {i!r}", "index")
        return {}


class Flow(node.StatelessNode):
    """init(seed: int) -> (x); start(noise) -> (x); finish(x, dims: int) -> (actions, dims).
    x, noise, actions: f32[horizon, action_dim]."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.shape = (_int(spec, "horizon"), _int(spec, "action_dim"))

    def phase_init(self, batch: node.Batch) -> node.Batch:
        out = []
        for entry in batch:
            seed = entry["seed"]
            if isinstance(seed, torch.Tensor) and seed.numel() == 1:
                seed = seed.item()
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise node.RequestError(f"seed must be an integer in [0, 2^63), got {seed!r}", "seed")
            gen = torch.Generator().manual_seed(seed)
            out.append({"x": torch.randn(self.shape, generator=gen, dtype=torch.float32).to(self.spec.device)})
        return out

    def phase_start(self, batch: node.Batch) -> node.Batch:
        out = []
        for entry in batch:
            noise = entry["noise"]
            if not isinstance(noise, torch.Tensor) or tuple(noise.shape) != self.shape:
                got = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
                raise node.RequestError(f"noise must be f32[{self.shape[0]}, {self.shape[1]}], got {got}", "noise")
            if not bool(torch.isfinite(noise).all()):
                raise node.RequestError("noise holds NaN or infinite values", "noise")
            out.append({"x": noise.to(self.spec.device, torch.float32)})
        return out

    def phase_finish(self, batch: node.Batch) -> node.Batch:
        return [{"actions": entry["x"], "dims": entry["dims"]} for entry in batch]
