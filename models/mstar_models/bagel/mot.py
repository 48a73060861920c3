"""BAGEL's Mixture-of-Transformers language model as a KV node (`MoTLanguageModel`).

The LLM is Qwen2.5 with QK-norm (an RMSNorm over head_dim on q and k, before RoPE) and a
second, "gen", copy of every layer's weights (docs/models/bagel.md, Facts). Each token goes
through exactly one copy, chosen by its kind, with no gate: text, ViT tokens and the
<|vision_start|>/<|vision_end|> markers through the und copy (no suffix), VAE latents
through the gen copy (`*_moe_gen`, final norm `norm_moe_gen`). Both copies write K/V into
the same sequence, so a tag has one KV context whatever its tokens' kinds.

One step packs the whole batch: the und rows and the gen rows are kept as two residual
streams (`hu`, `hg`), each expert runs its GEMMs on its own rows, and only the attention
sees the packed order (q/k/v scattered into it by one index per tensor, the output gathered
back), with one `attn.attend` call per layer over the whole mixed batch.

Phases (models/bagel/bagel.walk, node `llm`; tags gen, cfg_text, cfg_img, think):
  prefill_text(text: i32[T]) -> ()          causal, und; RoPE positions advance by T
  prefill_vit(vit: [N, hidden]) -> ()       <vs> + N + <ve>, und, one RoPE position, mask full
  prefill_vae(clean: f32[M, P], height, width) -> ()
                                            <vs> + M latents + <ve> at one position, mask full;
                                            latents = vae2llm(x) + time_embedder(0) + latent_pos_embed
  start(temperature, max_length[, seed]) -> (token, emitted, done, image_start)
                                            feeds <|im_start|> at the current position
  decode(token) -> (token, emitted, done, image_start)
                                            `token` stays on the device (fed back); `emitted` is
                                            the same id as a host item for the text stream (a
                                            readback on a GPU: the tokenizer never waits on it)
  denoise(latent: f32[M, P], t, height, width) -> (velocity: f32[M, P])
                                            the latent block with time t against the cache, not
                                            kept; velocity = llm2vae(h) at the latents. M = 0: an
                                            empty velocity, no KV, no work.
Image blocks add one RoPE position whatever their size. Latent positions are
h_idx * max_latent_size + w_idx with h = height // 16, w = width // 16 (M must be h * w).
The timestep embedding is DiT's: 256 frequencies in [cos, sin] order, max_period 1e4, of
the raw t in [0, 1] (not scaled by 1000), then mlp.0, SiLU, mlp.2.

Generation: greedy at temperature 0, else sampling through `mstar_runtime.sampling` (the
settings read by its `read_sampling`), seeded by the optional `seed` input of `start` (a
random seed drawn once at `start` otherwise), draw k of a reply at sampler step k. `done`
on <|im_end|>, on <|vision_start|> (then `image_start` is true: the model asks for an image), when min(max_length,
max_text_tokens) tokens have been generated (the token that reaches the limit is returned
with done, as the official generate_text never returns it), or when the context reaches
the `max_seq_len` setting. A decode after done still runs (the runtime reads done one step
late). No step waits for the device: `decode` is written once, as a column step
(`cohort_phase`; a plain batched call runs it as a one-step cohort,
runtime/mstar_runtime/ops/column_call.py), whose `emitted`, `done` and `image_start` are
`readback.Lazy` values; `start`'s are too on a GPU (a `done` a host limit raises is a plain
True), plain values on the CPU (`lazy_outputs` selects).

Per-(request, tag) state in `attn.states[i]`, written only by prefills and `start`, so a
discarded speculative decode cannot corrupt it and a fork copies it whole:
  `rope_offset`: RoPE position minus KV position of the next token (text keeps it, an image
                 block of n tokens lowers it by n - 1); absent = 0 (an empty context)
  `gen`:         set by `start`: the KV position of its <|im_start|> (`base`; a step's
                 sampler step and token count come from its KV start), `max_new`, the
                 `SamplingParams`; a prefill drops it.
A context the plan moves to another rank takes its state along (`export_state` gives the
`SamplingParams` as its fields, `import_state` makes them one again).

Parameter names are the checkpoint's (`language_model.model.*`, `language_model.lm_head`,
`time_embedder.mlp.{0,2}`, `vae2llm`, `llm2vae`, `latent_pos_embed.pos_embed`), as
mstarc/archs/bagel.py `bagel_mot` lists them. Sizes come from the node's `arch` arguments,
then the model config (`rms_eps`, `rope_theta`, `latent_patch_size`, `max_text_tokens`,
`bos_id`, `eos_id`, `vision_start_id`, `vision_end_id`); the setting `max_seq_len` (default
4096, as the compiler's memory pass assumes) bounds a context.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar_models.layers import rotary
from mstar_models.layers.attention import Attend, Attention
from mstar_models.layers.embedding import LMHead, VocabEmbedding, lm_logits
from mstar_models.layers.init import seeded_init_
from mstar_models.layers.mlp import GatedMLP
from mstar_models.layers.norm import RMSNorm
from mstar_runtime import sampling
from mstar_runtime.kv.prefix_cache import media_key
from mstar_runtime.ops import fused, node
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import config_value, fed_token, max_seq_len, one_rank, scalar
from mstar_runtime.ops.readback import Lazy, Readback, upload_tensor

VAE_DOWNSAMPLE = 8  # FLUX VAE: pixels per latent pixel per side
TIME_MAX_PERIOD = 10000.0  # DiT's timestep embedding
EXPERTS = ("", "_moe_gen")  # und, gen: the checkpoint's name suffixes
SPECIAL_IDS = ("bos_id", "eos_id", "vision_start_id", "vision_end_id")
# the text generation's sampling ports: temperature, and `max_length` as its token limit
SAMPLING_PORTS = sampling.SamplingPorts(temperature=sampling.REQUIRED, limit="max_length", finite=True)


# --------------------------------------------------------------------------------- modules
# The layer library's modules under the checkpoint's names; `forward` wires them for two
# experts (fused q/k/v and gate/up GEMMs over shared storage, per expert).
class MoTLayer(nn.Module):
    """One layer: `self_attn` holding both experts' projections (`q_proj`, `q_proj_moe_gen`, ...),
    `mlp` / `mlp_moe_gen`, and each expert's two norms."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, qk_norm: bool,
                 eps: float, **factory: Any):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps=eps, qk_norm=qk_norm, bias=True,
                                   experts=EXPERTS, **factory)
        self.mlp = GatedMLP(hidden, intermediate, **factory)
        self.mlp_moe_gen = GatedMLP(hidden, intermediate, **factory)
        for sfx in EXPERTS:
            setattr(self, f"input_layernorm{sfx}", RMSNorm(hidden, eps, **factory))
            setattr(self, f"post_attention_layernorm{sfx}", RMSNorm(hidden, eps, **factory))


class MoTModel(nn.Module):
    """`language_model.model.*` of the checkpoint."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, qk_norm: bool, eps: float, **factory: Any):
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab, hidden, **factory)
        self.layers = nn.ModuleList(
            MoTLayer(hidden, heads, kv_heads, head_dim, intermediate, qk_norm, eps, **factory) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden, eps, **factory)
        self.norm_moe_gen = RMSNorm(hidden, eps, **factory)


class LanguageModel(nn.Module):
    def __init__(self, model: MoTModel, lm_head: LMHead | None):
        super().__init__()
        self.model = model
        if lm_head is not None:
            self.lm_head = lm_head


class TimestepEmbedder(nn.Module):
    def __init__(self, freq_dim: int, hidden: int, **factory: Any):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden, **factory), nn.SiLU(), nn.Linear(hidden, hidden, **factory))


class PositionTable(nn.Module):
    """`latent_pos_embed.pos_embed`: one row per latent position (h * max_latent_size + w)."""

    def __init__(self, positions: int, hidden: int, **factory: Any):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.empty(positions, hidden, **factory))


@dataclass(frozen=True)
class Expert:
    """One expert of one layer as `forward` runs it: `key` is its checkpoint suffix into the
    layer's two-expert attention."""

    attn: Attention
    key: str
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    mlp: GatedMLP

    @property
    def qkv_w(self) -> torch.Tensor:
        """[q + k + v rows, hidden]: the three projections' shared storage (one GEMM)."""
        return self.attn.fused_weight(self.key)


@dataclass(frozen=True)
class Route:
    """Where each expert's rows sit in the packed order of a step (device index tensors)."""

    und: torch.Tensor  # int64 [Nu]: packed index of each und row, ascending
    gen: torch.Tensor  # int64 [Ng]
    inv: torch.Tensor  # int64 [N]: packed row p is row inv[p] of cat([und rows, gen rows])


# ------------------------------------------------------------------------------- helpers
def _shape(shapes: Mapping[str, tuple[int, ...]], port: str, ndim: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shapes.get(port, ()))
    if len(shape) != ndim:
        raise node.RequestError(f"input '{port}' must have {ndim} dim(s), got shape {shape}", port)
    return shape


def sincos_2d(hidden: int, side: int) -> torch.Tensor:
    """The frozen 2-D sin-cos table [side * side, hidden] of BAGEL's PositionEmbedding (float64):
    row h * side + w; the first half of the channels encodes w, the second h, [sin | cos] in each."""
    quarter = hidden // 4
    omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coord = torch.arange(side, dtype=torch.float64)
    w = coord.repeat(side)  # row-major (h outer): w varies fastest
    h = coord.repeat_interleave(side)

    def half(pos: torch.Tensor) -> torch.Tensor:
        ang = pos[:, None] * omega[None, :]
        return torch.cat([ang.sin(), ang.cos()], dim=1)

    return torch.cat([half(w), half(h)], dim=1)


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """DiT's sinusoidal features [B, dim] (float32, [cos | sin]) of raw times t [B]."""
    half = dim // 2
    freqs = torch.exp(-math.log(TIME_MAX_PERIOD) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.to(torch.float32)[:, None] * freqs[None, :]
    return torch.cat([args.cos(), args.sin()], dim=-1)


# ---------------------------------------------------------------------------------- node
class MoTLanguageModel(node.KVNode):
    """BAGEL's MoT LLM node; see the module docstring for its phases, state and settings."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        one_rank(spec, "MoTLanguageModel")
        g = lambda name, *default: config_value(spec, name, *default, owner="MoTLanguageModel")  # noqa: E731
        self.vocab, self.hidden, self.layers = int(g("vocab")), int(g("hidden")), int(g("layers"))
        self.heads, self.kv_heads, self.head_dim = int(g("heads")), int(g("kv_heads")), int(g("head_dim"))
        self.intermediate = int(g("intermediate"))
        self.patch_dim, self.max_latent = int(g("patch_dim")), int(g("max_latent_size"))
        self.timestep_dim = int(g("timestep_dim", 256))
        self.qk_norm, self.tied = bool(g("qk_norm", True)), bool(g("tie_embeddings", False))
        self.eps, rope_theta = float(g("rms_eps", 1e-6)), float(g("rope_theta", 1e6))
        self.latent_downsample = VAE_DOWNSAMPLE * int(g("latent_patch_size", 2))
        self.bos, self.eos, self.vision_start, self.vision_end = (int(g(k)) for k in SPECIAL_IDS)
        self.max_seq_len = max_seq_len(spec)
        self.max_text_tokens = int(g("max_text_tokens", self.max_seq_len))
        if self.heads % self.kv_heads or self.head_dim % 2 or self.timestep_dim % 2:
            raise node.NodeError(f"node '{spec.name}': heads ({self.heads}) must be a multiple of kv_heads "
                                 f"({self.kv_heads}); head_dim ({self.head_dim}) and timestep_dim even")
        bad = [k for k in SPECIAL_IDS if not 0 <= int(g(k)) < self.vocab]
        if bad:
            raise node.NodeError(f"node '{spec.name}': special token id(s) {', '.join(bad)} outside the vocab "
                                 f"{self.vocab}")

        # Built on the meta device, then given real (uninitialised) storage: 14 B parameters must
        # not pay for torch's default init only to be overwritten by the loader.
        factory = {"dtype": spec.dtype}
        with torch.device("meta"):
            model = MoTModel(self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim,
                             self.intermediate, self.qk_norm, self.eps, **factory)
            head = None if self.tied else LMHead(self.vocab, self.hidden, **factory)
            self.language_model = LanguageModel(model, head)
            self.time_embedder = TimestepEmbedder(self.timestep_dim, self.hidden, **factory)
            self.vae2llm = nn.Linear(self.patch_dim, self.hidden, **factory)
            self.llm2vae = nn.Linear(self.hidden, self.patch_dim, **factory)
            self.latent_pos_embed = PositionTable(self.max_latent**2, self.hidden, **factory)
        self.to_empty(device=spec.device)
        self.experts = [tuple(self._expert(layer, sfx) for sfx in EXPERTS) for layer in model.layers]
        self._init_weights()
        # float32 whatever the weights' dtype, computed on the CPU and then moved, as HF does;
        # not persistent: the loader never looks for it
        self.register_buffer("inv_freq", rotary.inv_freq(self.head_dim, rope_theta).to(spec.device),
                             persistent=False)
        self.lazy_outputs = spec.device.type == "cuda"
        self._latent_index: dict[tuple[int, int], torch.Tensor] = {}  # (h, w) -> table rows (host)

    def _expert(self, layer: MoTLayer, sfx: str) -> Expert:
        return Expert(attn=layer.self_attn, key=sfx, in_norm=getattr(layer, f"input_layernorm{sfx}").weight,
                      post_norm=getattr(layer, f"post_attention_layernorm{sfx}").weight,
                      mlp=layer.mlp_moe_gen if sfx else layer.mlp)

    def _init_weights(self) -> None:
        """Deterministic weights for the `init` source (`layers.init.seeded_init_`, seeded by the
        node name), then the sin-cos latent table; `dummy` and checkpoints overwrite them."""
        seeded_init_(self, self.spec.name)
        with torch.no_grad():
            self.latent_pos_embed.pos_embed.copy_(sincos_2d(self.hidden, self.max_latent))

    # ------------------------------------------------------------------ contract
    @property
    def kv_geometry(self) -> node.KVGeometry:
        return node.KVGeometry(self.layers, self.kv_heads, self.head_dim)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase in ("start", "decode"):
            return node.SeqPlan(q_len=1)
        if phase == "prefill_text":
            (n,) = _shape(shapes, "text", 1)
            if n < 1:
                raise node.RequestError("text must be a non-empty token list", "text")
            plan = node.SeqPlan(q_len=n)
        elif phase in ("prefill_vit", "prefill_vae", "denoise"):
            port = {"prefill_vit": "vit", "prefill_vae": "clean", "denoise": "latent"}[phase]
            n, width = _shape(shapes, port, 2)
            want = int(config_value(spec, "hidden" if port == "vit" else "patch_dim", owner="MoTLanguageModel"))
            if width != want:
                raise node.RequestError(f"input '{port}' must be [n, {want}], got [{n}, {width}]", port)
            if n == 0 and phase == "denoise":
                # an empty latent switches this CFG branch off: no queries, no KV
                return node.SeqPlan(q_len=0, mask="full", keep=False)
            if n < 1:
                raise node.RequestError(f"input '{port}' must hold at least one token", port)
            plan = node.SeqPlan(q_len=n + 2, mask="full", keep=phase != "denoise")
        else:
            raise node.NodeError(f"node '{spec.name}' (MoTLanguageModel) has no phase '{phase}'")
        limit = max_seq_len(spec)
        if plan.q_len > limit:
            port = {"prefill_text": "text", "prefill_vit": "vit", "prefill_vae": "clean"}.get(phase, "latent")
            raise node.RequestError(f"{plan.q_len} tokens do not fit a context of max_seq_len {limit}", port)
        return plan

    @classmethod
    def prefix_content(cls, phase: str, inputs: Mapping[str, Any], spec: node.NodeSpec) -> list[int] | None:
        """Prefix caching: a text block's keys are its ids; a ViT block's (its two markers and
        its rows, through the understanding expert) the `media_key` of the rows for all of
        them. VAE blocks (the generation expert) are not keyed: the chain ends there."""
        value = inputs.get("text" if phase == "prefill_text" else "vit")
        if not isinstance(value, torch.Tensor):
            return None
        if phase == "prefill_text" and value.dim() == 1:
            return [int(t) for t in value.tolist()]
        if phase == "prefill_vit" and value.dim() == 2:
            return [media_key(value)] * (value.shape[0] + 2)
        return None

    # ------------------------------------------------------------------ phases
    def phase_prefill_text(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        # a prefix found cached (`seq.cached` leading tokens) is in the KV already: checked
        # whole, computed from there (the positions of a context count from its first token)
        ids = [self._check_text(entry, seq.start - seq.cached, seq.q_len + seq.cached)[seq.cached:]
               for entry, seq in zip(batch, attn.seqs, strict=True)]
        bases = [self._rope_base(seq.state, seq.start) for seq in attn.seqs]
        pos = torch.cat([torch.arange(b, b + t.numel()) for b, t in zip(bases, ids)])
        hu = self.language_model.model.embed_tokens(torch.cat(ids).to(torch.long))
        self.forward(hu, upload_tensor(pos, hu.device), None, None, None, attn.attend, need_output=False)
        for seq in attn.seqs:  # text keeps RoPE and KV positions in step
            seq.state.pop("gen", None)
        return [{} for _ in batch]

    def phase_prefill_vit(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        dt, dev = self.spec.dtype, self.inv_freq.device
        rows = []
        for entry, seq in zip(batch, attn.seqs, strict=True):
            vit = entry.get("vit")
            if not isinstance(vit, torch.Tensor) or vit.dim() != 2 or vit.shape[1] != self.hidden \
                    or not vit.dtype.is_floating_point or vit.shape[0] < 1:
                got = tuple(vit.shape) if isinstance(vit, torch.Tensor) else type(vit).__name__
                raise node.RequestError(f"vit must be a float tensor [N >= 1, {self.hidden}], got {got}", "vit")
            self._check_block(seq.start - seq.cached, seq.q_len + seq.cached, vit.shape[0], "vit")
            rows.append(upload_tensor(vit, dev).to(dt))
        marks = self._markers(len(batch))
        # a block's leading tokens found cached (`seq.cached`) are not computed again: its other
        # tokens attend to them (the mask is full) as they did when the block was computed whole
        hu = torch.cat([torch.cat((marks[2 * i : 2 * i + 1], v, marks[2 * i + 1 : 2 * i + 2]))[seq.cached:]
                        for i, (v, seq) in enumerate(zip(rows, attn.seqs))])
        bases = [self._rope_base(seq.state, seq.start - seq.cached) for seq in attn.seqs]
        pos = torch.cat([torch.full((seq.q_len,), b) for b, seq in zip(bases, attn.seqs)])
        self.forward(hu, upload_tensor(pos, dev), None, None, None, attn.attend, need_output=False)
        self._after_block(attn, bases)
        return [{} for _ in batch]

    def phase_prefill_vae(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        blocks = [self._check_latent(entry, seq.start, seq.q_len, "clean") for entry, seq in zip(batch, attn.seqs)]
        bases = [self._rope_base(seq.state, seq.start) for seq in attn.seqs]
        hu, pos_u, hg, pos_g, route = self._latent_blocks(blocks, bases, [0.0] * len(blocks))
        self.forward(hu, pos_u, hg, pos_g, route, attn.attend, need_output=False)
        self._after_block(attn, bases)
        return [{} for _ in batch]

    def phase_denoise(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        blocks = [self._check_latent(entry, seq.start, seq.q_len, "latent") for entry, seq in zip(batch, attn.seqs)]
        live = [i for i, b in enumerate(blocks) if b[0].shape[0]]
        times = [scalar(batch[i], "t", float, finite=True) for i in live]
        dev = self.inv_freq.device
        out: node.Batch = [{"velocity": torch.zeros(0, self.patch_dim, dtype=torch.float32, device=dev)} for _ in batch]
        if not live:  # every branch is off: nothing to attend, nothing to compute
            return out
        bases = [self._rope_base(attn.seqs[i].state, attn.seqs[i].start) for i in live]
        hu, pos_u, hg, pos_g, route = self._latent_blocks([blocks[i] for i in live], bases, times)
        _, gen = self.forward(hu, pos_u, hg, pos_g, route, attn.attend)
        velocity = self.llm2vae(gen).float()
        for i, v in zip(live, velocity.split([blocks[i][0].shape[0] for i in live])):
            out[i] = {"velocity": v}
        return out

    def phase_start(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        gens = [self._check_start(entry) for entry in batch]
        ids = torch.full((len(batch),), self.bos, dtype=torch.long)
        for seq, gen in zip(attn.seqs, gens, strict=True):
            gen["base"] = seq.start
            seq.state["gen"] = gen
        return self._generate(ids, attn)

    # ------------------------------------------------------------------ checks
    def _rope_base(self, state: Mapping[str, Any], start: int) -> int:
        """The RoPE position of a context's next token, from its KV start (never stored per step)."""
        return start + int(state.get("rope_offset", 0))

    def _after_block(self, attn: node.AttentionContext, bases: list[int]) -> None:
        for seq, base in zip(attn.seqs, bases):  # the block took q_len KV tokens and one position
            seq.state["rope_offset"] = base + 1 - (seq.start + seq.q_len)
            seq.state.pop("gen", None)

    def _check_fit(self, start: int, q_len: int, port: str) -> None:
        if start + q_len > self.max_seq_len:
            raise node.RequestError(f"a context of {start + q_len} tokens exceeds max_seq_len {self.max_seq_len}", port)

    def _check_block(self, start: int, q_len: int, n: int, port: str) -> None:
        if q_len != n + 2:
            raise node.NodeError(f"node '{self.spec.name}': a block of {n} tokens got {q_len} KV slots, not {n + 2}")
        self._check_fit(start, q_len, port)

    def _check_text(self, entry: Mapping[str, Any], start: int, q_len: int) -> torch.Tensor:
        text = entry.get("text")
        if not isinstance(text, torch.Tensor) or text.dim() != 1 or text.numel() == 0 \
                or text.dtype.is_floating_point or text.dtype == torch.bool:
            raise node.RequestError("text must be a 1-D, non-empty tensor of integer token ids", "text")
        if text.numel() != q_len:
            raise node.NodeError(f"node '{self.spec.name}': text of {text.numel()} tokens got {q_len} KV slots")
        self._check_fit(start, q_len, "text")
        lo, hi = text.aminmax()  # free for host tensors; one read for a device one
        if int(lo) < 0 or int(hi) >= self.vocab:
            raise node.RequestError(f"token ids must lie in [0, {self.vocab}), got [{int(lo)}, {int(hi)}]", "text")
        return upload_tensor(text, self.inv_freq.device)

    def _check_latent(self, entry: Mapping[str, Any], start: int, q_len: int,
                      port: str) -> tuple[torch.Tensor, int, int]:
        """(latent on the device, h, w) of a latent block; an empty denoise latent gives (it, 0, 0)."""
        x = entry.get(port)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.patch_dim \
                or not x.dtype.is_floating_point:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise node.RequestError(f"{port} must be a float tensor [M, {self.patch_dim}], got {got}", port)
        m = x.shape[0]
        if m == 0 and port == "latent":
            if q_len:
                raise node.NodeError(f"node '{self.spec.name}': an empty latent got {q_len} KV slots")
            return x, 0, 0
        height, width = scalar(entry, "height", int), scalar(entry, "width", int)
        h, w = height // self.latent_downsample, width // self.latent_downsample
        if not (1 <= h <= self.max_latent and 1 <= w <= self.max_latent):
            side = self.latent_downsample * self.max_latent
            raise node.RequestError(f"image size {height}x{width} must be {self.latent_downsample}..{side} px per side",
                                    "height")
        if m != h * w:
            raise node.RequestError(f"{port} has {m} tokens; a {height}x{width} image has {h}x{w} = {h * w}", port)
        self._check_block(start, q_len, m, port)
        return upload_tensor(x, self.inv_freq.device), h, w

    def _check_start(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        # a fixed seed for the whole reply: read_sampling gives a request without one a fresh one
        params = sampling.read_sampling(entry, SAMPLING_PORTS)
        return {"params": params, "max_new": min(params.max_tokens, self.max_text_tokens)}

    # ------------------------------------------------------------------ packing
    def _markers(self, n: int) -> torch.Tensor:
        """Embeddings [2n, hidden] of n (<|vision_start|>, <|vision_end|>) pairs."""
        ids = torch.tensor([self.vision_start, self.vision_end], dtype=torch.long).repeat(n)
        return self.language_model.model.embed_tokens(upload_tensor(ids, self.inv_freq.device))

    def _latent_rows(self, h: int, w: int) -> torch.Tensor:
        rows = self._latent_index.get((h, w))
        if rows is None:
            rows = (torch.arange(h)[:, None] * self.max_latent + torch.arange(w)[None, :]).reshape(-1)
            self._latent_index[(h, w)] = rows
        return rows

    def _latent_blocks(
        self, blocks: list[tuple[torch.Tensor, int, int]], bases: list[int], times: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Route]:
        """The rows of latent blocks <vs> + M latents + <ve> (one per entry, each at its RoPE
        base): und rows (the markers), gen rows (vae2llm(x) + time_embedder(t) + latent
        table), their positions and the route. Index tensors are built on the host per entry
        and uploaded in one copy."""
        dev, dt = self.inv_freq.device, self.spec.dtype
        ms = [x.shape[0] for x, _, _ in blocks]
        und_idx, gen_idx, pos_u, pos_g, table, entry_of = [], [], [], [], [], []
        at = 0
        for i, ((_, h, w), m, base) in enumerate(zip(blocks, ms, bases)):
            und_idx.append(torch.tensor([at, at + m + 1]))
            gen_idx.append(torch.arange(at + 1, at + m + 1))
            pos_u.append(torch.full((2,), base))
            pos_g.append(torch.full((m,), base))
            table.append(self._latent_rows(h, w))
            entry_of.append(torch.full((m,), i))
            at += m + 2
        und, gen = torch.cat(und_idx), torch.cat(gen_idx)
        inv = torch.empty(at, dtype=torch.long)
        inv[torch.cat([und, gen])] = torch.arange(at)
        parts = [und, gen, inv, torch.cat(pos_u), torch.cat(pos_g), torch.cat(table), torch.cat(entry_of)]
        packed = upload_tensor(torch.cat(parts), dev).split([p.numel() for p in parts])
        und_d, gen_d, inv_d, pos_u_d, pos_g_d, table_d, entry_d = packed
        hu = self._markers(len(blocks))
        temb = self.time_embed(upload_tensor(torch.tensor(times, dtype=torch.float32), dev))
        x = torch.cat([x for x, _, _ in blocks]).to(dt)
        hg = self.vae2llm(x) + temb.index_select(0, entry_d) + self.latent_pos_embed.pos_embed.index_select(0, table_d)
        return hu, pos_u_d, hg, pos_g_d, Route(und_d, gen_d, inv_d)

    def time_embed(self, t: torch.Tensor) -> torch.Tensor:
        """time_embedder(t) [B, hidden] of raw times t [B] in [0, 1]."""
        feats = timestep_features(t, self.timestep_dim).to(self.spec.dtype)
        return self.time_embedder.mlp(feats)

    # ------------------------------------------------------------------ math
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.rope_tables(positions, self.inv_freq, dtype)

    def _mlp(self, e: Expert, h: torch.Tensor, o: torch.Tensor,
             next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of a layer for one expert's rows: o_proj, residual, post norm, SwiGLU, residual,
        and the next norm (of the next layer, or the final one) fused with the last add."""
        h, x = fused.add_rms_norm(h, e.attn.out(o, e.key), e.post_norm, self.eps)
        return fused.add_rms_norm(h, e.mlp(x), next_norm, self.eps)

    def forward(
        self,
        hu: torch.Tensor,
        pos_u: torch.Tensor,
        hg: torch.Tensor | None,
        pos_g: torch.Tensor | None,
        route: Route | None,
        attend: Attend,
        need_output: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Und rows hu [Nu, hidden] and gen rows hg [Ng, hidden] (None: an all-und step) at RoPE
        positions pos_u / pos_g -> their final-normed hidden states (und: `norm`, gen:
        `norm_moe_gen`). `route` places the rows in the packed order the attention sees.

        Pure tensor code whose only attention is `attend` (an all-und step can be captured in a
        CUDA graph). `need_output=False` (a prefill: only the K/V matter) stops after the last
        attention call and returns empty tensors."""
        m = self.language_model.model
        nu, ng = hu.shape[0], 0 if hg is None else hg.shape[0]
        cos_u, sin_u = self._rope(pos_u, hu.dtype)
        xu = fused.rms_norm(hu, self.experts[0][0].in_norm, self.eps)
        if hg is not None:
            assert pos_g is not None and route is not None
            cos_g, sin_g = self._rope(pos_g, hg.dtype)
            xg = fused.rms_norm(hg, self.experts[0][1].in_norm, self.eps)
        last = len(self.experts) - 1
        for i, (und, gen) in enumerate(self.experts):
            q, k, v = und.attn.qkv(xu, cos_u, sin_u, und.key) if nu else (None, None, None)
            if hg is not None:
                qg, kg, vg = gen.attn.qkv(xg, cos_g, sin_g, gen.key)
                if nu:
                    q, k, v = (torch.cat([a, b]).index_select(0, route.inv) for a, b in ((q, qg), (k, kg), (v, vg)))
                else:
                    q, k, v = qg, kg, vg
            assert q is not None and k is not None and v is not None
            o = attend(i, q, k, v).reshape(nu + ng, self.heads * self.head_dim)
            if i == last and not need_output:
                return hu[:0], None if hg is None else hg[:0]
            nxt = self.experts[i + 1] if i < last else None
            if hg is not None:
                ou, og = (o.index_select(0, route.und), o.index_select(0, route.gen)) if nu else (o[:0], o)
                hg, xg = self._mlp(gen, hg, og, nxt[1].in_norm if nxt else m.norm_moe_gen.weight)
            else:
                ou = o
            if nu:
                hu, xu = self._mlp(und, hu, ou, nxt[0].in_norm if nxt else m.norm.weight)
        return xu, (xg if hg is not None else None)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] (computed in the weights' dtype, then widened)."""
        lm = self.language_model
        return lm_logits(hidden, lm.model.embed_tokens.weight) if self.tied else lm.lm_head(hidden)

    def _step_logits(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Logits [B, vocab] of one und token per row (start and decode): pure tensor code."""
        return self.head(self.forward(self.language_model.model.embed_tokens(ids), positions, None, None, None,
                                      attend)[0])

    # ------------------------------------------------------------------ generation
    def _generate(self, ids: torch.Tensor, attn: node.AttentionContext) -> node.Batch:
        """`start`'s token per entry: forward, one sampler call, the done flags (`decode` is the
        column step, `_cohort_step`)."""
        dev = self.inv_freq.device
        seqs = attn.seqs
        gens = [seq.state["gen"] for seq in seqs]
        positions = upload_tensor(torch.tensor([self._rope_base(s.state, s.start) for s in seqs]), dev)
        logits = attn.run_graphed(lambda i, p: self._step_logits(i, p, attn.attend),
                                  upload_tensor(ids.to(torch.long), dev), positions)
        steps = [seq.start - gen["base"] for seq, gen in zip(seqs, gens)]
        tokens = sampling.sample(logits, [gen["params"] for gen in gens], [None] * len(seqs), steps)
        tok32 = tokens.to(torch.int32)
        # host facts: tokens generated after this step, and the context after it
        limits = [step + 1 >= gen["max_new"] or seq.start + 1 >= self.max_seq_len
                  for seq, gen, step in zip(seqs, gens, steps)]
        ends = (self.eos, self.vision_start)
        out: node.Batch = []
        if self.lazy_outputs:
            back = Readback(tokens)
            for i, limit in enumerate(limits):
                out.append({
                    "token": tok32[i : i + 1],
                    "emitted": Lazy(lambda i=i: torch.tensor(back.values()[i : i + 1], dtype=torch.int32)),
                    "done": True if limit else Lazy(lambda i=i: back.values()[i] in ends),
                    "image_start": Lazy(lambda i=i: back.values()[i] == self.vision_start),
                })
            return out
        values = tokens.tolist()
        for i, (value, limit) in enumerate(zip(values, limits)):
            out.append({"token": tok32[i : i + 1], "emitted": torch.tensor([value], dtype=torch.int32),
                        "done": limit or value in ends, "image_start": value == self.vision_start})
        return out

    # ------------------------------------------------------------------ moving a context
    def export_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The state as flat values for another rank: `gen`'s `SamplingParams` as its fields."""
        gen = state.get("gen")
        if gen is not None and isinstance(gen.get("params"), sampling.SamplingParams):
            state = {**state, "gen": {**gen, "params": dataclasses.asdict(gen["params"])}}
        return super().export_state(state)

    def import_state(self, values: Mapping[str, Any]) -> dict[str, Any]:
        state = super().import_state(values)
        params = state.get("gen", {}).get("params")
        if isinstance(params, dict):
            state["gen"]["params"] = sampling.SamplingParams(**params)
        return state

    # ------------------------------------------------------------------ cohort
    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`decode`, written only as a column step (runtime/mstar_runtime/ops/cohort.py; a plain
        batched call runs it through runtime/mstar_runtime/ops/column_call.py), with the state
        as columns (`rope_offset`; the reply's `base`, `max_new` and the sampling settings)."""
        if phase != "decode":
            return None
        return CohortPhase(join=self._cohort_join, step=self._cohort_step, leave=lambda state, cols, steps: None,
                           max_items={"emitted": 1})

    def _cohort_join(self, state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        # a plain call passes the entry's inputs, fed-back `token` included (a cohort passes
        # only the invariant ones): its check is the host's, before any step runs
        fed_token(inputs)
        gen = state.get("gen")
        if gen is None:
            raise node.RequestError("decode on a KV context without a start since its last prefill", "token")
        cols = sampling.sampling_row(gen["params"], 0)  # `step` is derived from the KV position instead
        cols.update(rope_offset=torch.tensor(int(state.get("rope_offset", 0))), base=torch.tensor(gen["base"]),
                    max_new=torch.tensor(gen["max_new"]))
        return cols

    def _cohort_step(self, b: CohortStep) -> dict[str, torch.Tensor]:
        c = b.cols
        ids = b.inputs["token"].reshape(-1).to(torch.long)
        logits = self._step_logits(ids, b.positions + c["rope_offset"], b.attend)
        step = b.positions - c["base"]
        # no history: BAGEL has no repetition penalty, so the sampler skips that stage
        tokens = sampling.sample_columns(logits, sampling.SamplingColumns.from_cohort(c, step))
        limit = (step + 1 >= c["max_new"]) | (b.positions + 1 >= self.max_seq_len)
        opens = tokens == self.vision_start
        tok32 = tokens.to(torch.int32)[:, None]
        return {"token": tok32, "emitted": tok32, "emitted:count": torch.ones_like(tokens),
                "done": limit | opens | (tokens == self.eos), "image_start": opens}


__all__ = ["MoTLanguageModel", "sincos_2d", "timestep_features"]
