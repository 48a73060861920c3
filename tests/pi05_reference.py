"""The π0.5 parity reference: LeRobot's `PI05Pytorch` assembled from transformers' own modules.

LeRobot's `policies/pi05/modeling_pi05.py` needs openpi's fork of transformers
(`transformers_replace`: a Gemma whose RMSNorm takes a condition, whose decoder layer gates
its residuals, and whose attention concatenates a cache without growing it) and refuses to
build without it (`transformers.models.siglip.check`). So the reference is put together here
the way that file puts it together, from the installed transformers' PaliGemma (SigLIP vision
tower, projector, Gemma language model) and Gemma (the expert's attention and MLP), plus the
fork's adaptive RMSNorm written from its definition:

- prefix (`embed_prefix`): per camera SigLIP + projector, unscaled, masked when the camera
  is missing (an all -1 image, mask false); the prompt's token embeddings times sqrt(width),
  masked where the tokenizer padded; one bidirectional block (att_masks all 0); positions
  `cumsum(pad_masks) - 1`; the VLM's layers as transformers' `GemmaDecoderLayer` computes
  them (no sqrt(width) inside the model: the fork drops it), K/V kept per layer after RoPE;
- denoise step (`denoise_step`): `embed_suffix` (action_in_proj; the condition
  silu(time_mlp_out(silu(time_mlp_in(sincos(t))))), the expert's 18 layers with the fork's
  `GemmaRMSNorm(cond)` and `_gated_residual`, queries over [prefix K/V (pad mask), own K/V]
  at positions `sum(pad_masks) + i`, the adaptive final norm, `action_out_proj` in float32;
- `sample_actions`: x from noise at t = 1, `x += dt v` with dt = -1 / steps, t = 1 + i dt.

`checkpoint()` gives the state dict under the released file's names
(`model.paligemma_with_expert.*`, `model.action_in_proj.*`, ...), so a safetensors file of it
is a checkpoint folder for the walk. Test code
only: nothing here is used to serve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GemmaConfig, GemmaForCausalLM, PaliGemmaConfig, PaliGemmaForConditionalGeneration
from transformers.models.gemma import modeling_gemma

MASK_VALUE = -2.3819763e38  # lerobot.utils.constants.OPENPI_ATTENTION_MASK_VALUE


@dataclass(frozen=True)
class Sizes:
    vis_hidden: int
    vis_layers: int
    vis_heads: int
    vis_mlp: int
    patch: int
    img: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    expert_width: int
    expert_mlp: int
    horizon: int
    action_dim: int
    flow_steps: int


TINY = Sizes(32, 2, 2, 64, 4, 16, 48, 2, 4, 1, 16, 96, 512, 32, 64, 6, 8, 3)  # models/pi05/pi05.walk, tiny
REAL = Sizes(1152, 27, 16, 4304, 14, 224, 2048, 18, 8, 1, 256, 16384, 257152, 1024, 4096, 50, 32, 10)


class AdaRMS(nn.Module):
    """The fork's GemmaRMSNorm with `cond_dim`: dense(cond) -> scale, shift, gate; returns (normed, gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dense = nn.Linear(dim, 3 * dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        scale, shift, gate = torch.chunk(self.dense(cond.to(self.dense.weight.dtype))[:, None, :], 3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def sincos(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """create_sinusoidal_pos_embedding: float64 periods, sin then cos."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    x = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=1)


class Holder(nn.Module):
    pass


class PI05Reference(nn.Module):
    def __init__(self, s: Sizes):
        super().__init__()
        self.s = s
        text = dict(model_type="gemma", hidden_size=s.width, intermediate_size=s.mlp, num_attention_heads=s.heads,
                    num_key_value_heads=s.kv_heads, head_dim=s.head_dim, num_hidden_layers=s.layers,
                    vocab_size=s.vocab, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6)
        vision = dict(model_type="siglip_vision_model", hidden_size=s.vis_hidden, intermediate_size=s.vis_mlp,
                      num_hidden_layers=s.vis_layers, num_attention_heads=s.vis_heads, image_size=s.img,
                      patch_size=s.patch, projection_dim=s.width, hidden_act="gelu_pytorch_tanh",
                      layer_norm_eps=1e-6, vision_use_head=False)  # PaliGemma's tower has no pooling head
        pal = PaliGemmaConfig(text_config=text, vision_config=vision, vocab_size=s.vocab,
                              image_token_index=s.vocab, projection_dim=s.width)
        pal._attn_implementation = "eager"
        expert = GemmaConfig(hidden_size=s.expert_width, intermediate_size=s.expert_mlp, num_attention_heads=s.heads,
                             num_key_value_heads=s.kv_heads, head_dim=s.head_dim, num_hidden_layers=s.layers,
                             vocab_size=s.vocab, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6)
        expert._attn_implementation = "eager"
        self.paligemma_with_expert = Holder()
        self.paligemma_with_expert.paligemma = PaliGemmaForConditionalGeneration(pal)
        self.paligemma_with_expert.gemma_expert = GemmaForCausalLM(expert)
        em = self.paligemma_with_expert.gemma_expert.model
        em.embed_tokens = None
        for layer in em.layers:
            layer.input_layernorm = AdaRMS(s.expert_width)
            layer.post_attention_layernorm = AdaRMS(s.expert_width)
        em.norm = AdaRMS(s.expert_width)
        self.action_in_proj = nn.Linear(s.action_dim, s.expert_width)
        self.action_out_proj = nn.Linear(s.expert_width, s.action_dim)
        self.time_mlp_in = nn.Linear(s.expert_width, s.expert_width)
        self.time_mlp_out = nn.Linear(s.expert_width, s.expert_width)

    def randomize_(self, seed: int) -> None:
        """Every parameter ~ N(0, 0.1) from one generator (norm gains and adaptive denses too, so that
        every weight matters; transformers' init would zero the gains' offsets and the denses)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def to_lerobot_bf16_(self) -> PI05Reference:
        """LeRobot's `precision="bfloat16"`: `paligemma_with_expert` in bfloat16 except the
        parameters `to_bfloat16_for_selected_params` keeps float32 (the SigLIP patch and position
        embeddings, every `input_layernorm` / `post_attention_layernorm` / `model.norm`, which
        includes the expert's adaptive denses); the four projections stay float32."""
        keep = ("vision_tower.embeddings.patch_embedding", "vision_tower.embeddings.position_embedding",
                "input_layernorm", "post_attention_layernorm", "model.norm")
        self.paligemma_with_expert.to(torch.bfloat16)
        for name, p in self.paligemma_with_expert.named_parameters():
            if any(k in name for k in keep):
                p.data = p.data.float()
        return self

    def load_checkpoint_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load tensors under the checkpoint's names (e.g. `checkpoint_tensors` of the walk's nodes);
        everything but the unused heads must be there."""
        mine = {k.removeprefix("model.").replace(".vision_tower.vision_model.", ".vision_tower."): v
                for k, v in tensors.items()}
        missing, unexpected = self.load_state_dict(mine, strict=False)
        assert not unexpected, f"not reference tensors: {unexpected[:3]}"
        assert all("lm_head" in k for k in missing), f"missing from the checkpoint: {missing[:3]}"

    def checkpoint(self, heads: bool = False) -> dict[str, torch.Tensor]:
        """The state dict under the released file's names: LeRobot's policy prefix `model.`, and
        the SigLIP `vision_model` level of transformers 4.53 (openpi's fork), which 5.x dropped.
        With `heads`, the two language heads the released file also holds (untied copies)."""
        out = {}
        for k, v in self.state_dict().items():
            if "lm_head" in k and not heads:
                continue
            name = "model." + k.replace(".vision_tower.", ".vision_tower.vision_model.")
            out[name] = v.detach().clone().contiguous()
        return out

    # ------------------------------------------------------------------ prefix
    @property
    def lm(self) -> nn.Module:
        return self.paligemma_with_expert.paligemma.model.language_model

    def embed_prefix(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], tokens: torch.Tensor,
                     masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images: per camera [B, 3, H, W] in [-1, 1]; -> (embeddings [B, P, width], pad masks [B, P])."""
        pal = self.paligemma_with_expert.paligemma.model
        vt = pal.vision_tower
        dtype = pal.multi_modal_projector.linear.weight.dtype
        embs, pads = [], []
        for img, m in zip(images, img_masks, strict=True):
            # the fork's SiglipVisionTransformer casts the (float32) embeddings to the encoder's dtype
            h = vt.embeddings(img.to(vt.embeddings.patch_embedding.weight.dtype)).to(dtype)
            e = pal.multi_modal_projector(vt.post_layernorm(vt.encoder(inputs_embeds=h).last_hidden_state))
            embs.append(e)
            pads.append(m[:, None].expand(e.shape[0], e.shape[1]))
        # the table's rows: transformers 5 folds sqrt(width) into Gemma's embedding module, the fork's is plain
        lang = F.embedding(tokens, self.lm.embed_tokens.weight)
        embs.append((lang * math.sqrt(lang.shape[-1])).to(dtype))
        pads.append(masks)
        return torch.cat(embs, dim=1), torch.cat(pads, dim=1)

    def prefix_kv(self, embs: torch.Tensor, pad: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The VLM over the prefix (one bidirectional block): per layer (K, V) [B, kv_heads, P, hd] after RoPE."""
        mask2d = pad[:, None, :] & pad[:, :, None]
        mask = torch.where(mask2d[:, None], 0.0, MASK_VALUE)
        positions = torch.cumsum(pad, dim=1) - 1
        cos, sin = self.lm.rotary_emb(embs, positions)
        h, kv = embs, []
        for layer in self.lm.layers:
            x = layer.input_layernorm(h)
            att = layer.self_attn
            shape = (*x.shape[:-1], -1, att.head_dim)
            q, k, v = (p(x).view(shape).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
            q, k = modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin)
            kv.append((k, v))
            o, _ = modeling_gemma.eager_attention_forward(att, q, k, v, mask, att.scaling)
            h = h + att.o_proj(o.reshape(*x.shape[:-1], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return kv

    # ------------------------------------------------------------------ denoise
    def velocity(self, kv: list[tuple[torch.Tensor, torch.Tensor]], pad: torch.Tensor, x: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
        """One denoise step's v [B, L, A] (float32) of chunks x [B, L, A] at times t [B]."""
        time_emb = sincos(t, self.s.expert_width).type(t.dtype)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
        em = self.paligemma_with_expert.gemma_expert.model
        h = self.action_in_proj(x).to(em.layers[0].self_attn.q_proj.weight.dtype)
        b, n = h.shape[:2]
        mask2d = torch.cat([pad[:, None, :].expand(b, n, pad.shape[1]), torch.ones(b, n, n, dtype=torch.bool, device=pad.device)], dim=2)
        mask = torch.where(mask2d[:, None], 0.0, MASK_VALUE)
        positions = pad.sum(-1)[:, None] + torch.arange(n, device=pad.device)[None, :]
        cos, sin = em.rotary_emb(h, positions)
        for i, layer in enumerate(em.layers):
            xn, gate = layer.input_layernorm(h, cond)
            att = layer.self_attn
            shape = (*xn.shape[:-1], -1, att.head_dim)
            q, k, v = (p(xn).view(shape).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
            q, k = modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin)
            k, v = torch.cat([kv[i][0], k], dim=2), torch.cat([kv[i][1], v], dim=2)
            o, _ = modeling_gemma.eager_attention_forward(att, q, k, v, mask, att.scaling)
            h = h + att.o_proj(o.reshape(b, n, -1)) * gate
            xn, gate = layer.post_attention_layernorm(h, cond)
            h = h + layer.mlp(xn) * gate
        out, _ = em.norm(h, cond)
        return self.action_out_proj(out.to(torch.float32))

    @torch.no_grad()
    def sample_actions(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], tokens: torch.Tensor,
                       masks: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        embs, pad = self.embed_prefix(images, img_masks, tokens, masks)
        kv = self.prefix_kv(embs, pad)
        dt = -1.0 / self.s.flow_steps
        x = noise
        for step in range(self.s.flow_steps):
            t = torch.tensor(1.0 + step * dt, dtype=torch.float32, device=x.device).expand(x.shape[0])
            x = x + dt * self.velocity(kv, pad, x, t)
        return x


def pixels(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> the reference's [N, 3, H, W] float32 in [-1, 1] (x / 255 * 2 - 1)."""
    return images_u8.permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0


def checkpoint_tensors(*nodes: nn.Module) -> dict[str, torch.Tensor]:
    """The walk's node modules' tensors under the checkpoint's names (their `rename` or
    `checkpoint_prefix`, as mstar_runtime.weights maps them), as float32 on the CPU."""
    out = {}
    for node in nodes:
        for name, t in node.state_dict().items():
            key = node.rename(name) if hasattr(node, "rename") else getattr(node, "checkpoint_prefix", "") + name
            out[key] = t.detach().float().cpu()
    return out
