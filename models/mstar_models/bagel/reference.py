"""A plain re-derivation of BAGEL's MoT forward for tests: one sequence, a dense cache, no batching.

Written from the math of the official modeling/bagel/qwen2_navit.py (`PackedAttentionMoT`,
`Qwen2MoTDecoderLayer`, `Qwen2Model.forward_inference`) and modeling/bagel/bagel.py (the
`prepare_*` / `forward_cache_update_*` functions, `_forward_flow`, `generate_text`), and
deliberately unlike the node: every layer runs *both* experts on every row and keeps, per
row, the one its kind selects (`torch.where`); attention is an explicit softmax over the
concatenated cache with the mask of flash-attn's bottom-right-aligned causal rule or none.

A `ReferenceContext` is one KV context (the official `NaiveCache` with its kv_len and
`curr_rope`):
  - `text(ids)`: a causal und segment; the RoPE position advances by len(ids);
  - `vit(tokens)`: <|vision_start|> + tokens + <|vision_end|>, und, all at one position,
    non-causal; the position advances by 1;
  - `vae(latent, height, width, t=0)`: the same block with the latent rows embedded as
    vae2llm(x) + time_embedder(t) + latent_pos_embed[h * max_latent + w], gen expert for the
    latents, und for the markers;
  - `step(token) -> logits`: one causal und token at the current position, kept (the
    official generate_text feeds <|im_start|> first, then each sampled token);
  - `velocity(latent, t, height, width)`: the noised block as a query that is not kept;
    llm2vae(h) at the latent rows;
  - `copy()`: a deep copy (the official CFG contexts are deepcopies).
`weights` maps checkpoint names (language_model.model.*, ...) to tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ReferenceConfig:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_latent_size: int
    bos_id: int
    eos_id: int
    vision_start_id: int
    vision_end_id: int
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    latent_downsample: int = 16  # FLUX's 8x times the 2x2 latent patch
    timestep_dim: int = 256


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm: normalise in float32, back to the input dtype, then the gain."""
    xf = x.float()
    return weight * (xf / torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's default rotary embedding of x [L, heads, D] at integer positions [L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def timestep_embedding(t: float, dim: int) -> torch.Tensor:
    """TimestepEmbedder.timestep_embedding for one t: [cos(t f_i) ..., sin(t f_i) ...], f_i = 1e4^(-i/half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = torch.tensor([t], dtype=torch.float32)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_table(hidden: int, side: int) -> torch.Tensor:
    """get_2d_sincos_pos_embed(hidden, side) re-derived: meshgrid(grid_w, grid_h), so the first
    half of the channels is the 1-D embedding of w and the second of h, each [sin | cos]."""
    def one_d(dim: int, pos: torch.Tensor) -> torch.Tensor:
        omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = torch.einsum("m,d->md", pos.reshape(-1).double(), omega)
        return torch.cat([out.sin(), out.cos()], dim=1)

    grid_w, grid_h = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy")
    return torch.cat([one_d(hidden // 2, grid_w), one_d(hidden // 2, grid_h)], dim=1)


class ReferenceContext:
    """One dense KV context of the official inference; see the module docstring."""

    def __init__(self, weights: Mapping[str, torch.Tensor], cfg: ReferenceConfig):
        self.w = weights
        self.cfg = cfg
        self.keys: list[torch.Tensor | None] = [None] * cfg.layers
        self.values: list[torch.Tensor | None] = [None] * cfg.layers
        self.rope = 0  # the official curr_rope

    def copy(self) -> ReferenceContext:
        other = copy.copy(self)
        other.keys, other.values = list(self.keys), list(self.values)  # tensors are never mutated
        return other

    @property
    def kv_len(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[0]

    # ------------------------------------------------------------------ segments
    def text(self, ids: torch.Tensor) -> None:
        n = ids.numel()
        x = self._embed(ids)
        self._run(x, torch.zeros(n, dtype=torch.bool), torch.arange(self.rope, self.rope + n), causal=True, keep=True)
        self.rope += n

    def vit(self, tokens: torch.Tensor) -> None:
        x = torch.cat([self._embed([self.cfg.vision_start_id]), tokens.to(self._dtype),
                       self._embed([self.cfg.vision_end_id])])
        self._block(x, torch.zeros(x.shape[0], dtype=torch.bool), keep=True)

    def vae(self, latent: torch.Tensor, height: int, width: int, t: float = 0.0) -> None:
        x, gen = self._latent_block(latent, height, width, t)
        self._block(x, gen, keep=True)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token (generate_text's step) and return the float32 logits [vocab] of the next."""
        h = self._run(self._embed([token]), torch.zeros(1, dtype=torch.bool), torch.tensor([self.rope]),
                      causal=True, keep=True)
        self.rope += 1
        return (h @ self._head().T).float()[0]

    def velocity(self, latent: torch.Tensor, t: float, height: int, width: int) -> torch.Tensor:
        x, gen = self._latent_block(latent, height, width, t)
        h = self._block(x, gen, keep=False)
        return (h @ self.w["llm2vae.weight"].T + self.w["llm2vae.bias"])[gen].float()

    # ------------------------------------------------------------------ pieces
    @property
    def _dtype(self) -> torch.dtype:
        return self.w["language_model.model.embed_tokens.weight"].dtype

    def _embed(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        return self.w["language_model.model.embed_tokens.weight"][torch.as_tensor(ids, dtype=torch.long)]

    def _head(self) -> torch.Tensor:
        return self.w.get("language_model.lm_head.weight", self.w["language_model.model.embed_tokens.weight"])

    def _latent_block(self, latent: torch.Tensor, height: int, width: int,
                      t: float) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.cfg, self.w
        h_n, w_n = height // c.latent_downsample, width // c.latent_downsample
        assert latent.shape[0] == h_n * w_n, "latent tokens != (height/16) * (width/16)"
        # get_flattened_position_ids_extrapolate
        pos_ids = (torch.arange(h_n)[:, None] * c.max_latent_size + torch.arange(w_n)).flatten()
        feats = timestep_embedding(t, c.timestep_dim).to(self._dtype)
        temb = F.silu(feats @ w["time_embedder.mlp.0.weight"].T + w["time_embedder.mlp.0.bias"])
        temb = temb @ w["time_embedder.mlp.2.weight"].T + w["time_embedder.mlp.2.bias"]
        lat = latent.to(self._dtype) @ w["vae2llm.weight"].T + w["vae2llm.bias"]
        lat = lat + temb + w["latent_pos_embed.pos_embed"][pos_ids]
        x = torch.cat([self._embed([c.vision_start_id]), lat, self._embed([c.vision_end_id])])
        gen = torch.zeros(x.shape[0], dtype=torch.bool)
        gen[1:-1] = True
        return x, gen

    def _block(self, x: torch.Tensor, gen: torch.Tensor, keep: bool) -> torch.Tensor:
        """An image block: every row at the current RoPE position, non-causal; the position
        advances by one when the block is kept."""
        h = self._run(x, gen, torch.full((x.shape[0],), self.rope), causal=False, keep=keep)
        if keep:
            self.rope += 1
        return h

    def _pick(self, gen: torch.Tensor, name: str, x: torch.Tensor, bias: bool = False) -> torch.Tensor:
        """Linear `name` (und) or `name`_moe_gen per row, chosen by the row's kind."""
        stem, leaf = name.rsplit(".", 1)
        outs = []
        for sfx in ("", "_moe_gen"):
            y = x @ self.w[f"{stem}.{leaf}{sfx}.weight"].T
            if bias:
                y = y + self.w[f"{stem}.{leaf}{sfx}.bias"]
            outs.append(y)
        return torch.where(gen[:, None], outs[1], outs[0])

    def _norm(self, gen: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
        und = rms_norm(x, self.w[f"{name}.weight"], self.cfg.rms_eps)
        g = rms_norm(x, self.w[f"{name}_moe_gen.weight"], self.cfg.rms_eps)
        return torch.where(gen.reshape(-1, *([1] * (x.dim() - 1))), g, und)

    def _mlp(self, gen: torch.Tensor, prefix: str, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for mlp in ("mlp", "mlp_moe_gen"):
            p = f"{prefix}.{mlp}"
            a = F.silu(x @ self.w[f"{p}.gate_proj.weight"].T) * (x @ self.w[f"{p}.up_proj.weight"].T)
            outs.append(a @ self.w[f"{p}.down_proj.weight"].T)
        return torch.where(gen[:, None], outs[1], outs[0])

    def _run(self, x: torch.Tensor, gen: torch.Tensor, positions: torch.Tensor, causal: bool,
             keep: bool) -> torch.Tensor:
        """The layers over the query rows x [L, hidden] against the cache -> final-normed rows."""
        c = self.cfg
        n, past = x.shape[0], self.kv_len
        group = c.heads // c.kv_heads
        keys, values = list(self.keys), list(self.values)
        for i in range(c.layers):
            p = f"language_model.model.layers.{i}"
            a = f"{p}.self_attn"
            residual = x
            y = self._norm(gen, f"{p}.input_layernorm", x)
            q = self._pick(gen, f"{a}.q_proj", y, bias=True).view(n, c.heads, c.head_dim)
            k = self._pick(gen, f"{a}.k_proj", y, bias=True).view(n, c.kv_heads, c.head_dim)
            v = self._pick(gen, f"{a}.v_proj", y, bias=True).view(n, c.kv_heads, c.head_dim)
            if f"{a}.q_norm.weight" in self.w:  # QK-norm, before RoPE
                q, k = self._norm(gen, f"{a}.q_norm", q), self._norm(gen, f"{a}.k_norm", k)
            q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
            old_k, old_v = keys[i], values[i]
            all_k = k if old_k is None else torch.cat([old_k, k])
            all_v = v if old_v is None else torch.cat([old_v, v])
            if keep:
                keys[i], values[i] = all_k, all_v
            # head j reads kv head j // group
            kh = all_k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, S, D]
            vh = all_v.repeat_interleave(group, dim=1).transpose(0, 1).float()
            scores = q.transpose(0, 1).float() @ kh.transpose(1, 2) / math.sqrt(c.head_dim)  # [H, L, S]
            if causal:  # bottom-right aligned: query r sees keys 0 .. past + r
                allowed = torch.arange(past + n)[None, :] <= past + torch.arange(n)[:, None]
                scores = scores.masked_fill(~allowed, float("-inf"))
            o = (scores.softmax(dim=-1) @ vh).transpose(0, 1).reshape(n, c.heads * c.head_dim).to(x.dtype)
            x = residual + self._pick(gen, f"{a}.o_proj", o)
            residual = x
            x = residual + self._mlp(gen, p, self._norm(gen, f"{p}.post_attention_layernorm", x))
        if keep:
            self.keys, self.values = keys, values
        und = rms_norm(x, self.w["language_model.model.norm.weight"], c.rms_eps)
        g = rms_norm(x, self.w["language_model.model.norm_moe_gen.weight"], c.rms_eps)
        return torch.where(gen[:, None], g, und)
