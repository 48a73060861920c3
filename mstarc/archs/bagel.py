"""BAGEL-7B-MoT (ByteDance-Seed/Bagel), `ema.safetensors` naming.

Owns `bagel_mot`: the Qwen2 Mixture-of-Transformers LLM (`language_model.*`, every layer's
attention, norms and MLP duplicated as a `*_moe_gen` copy, plus `norm_moe_gen`) together with
the generation glue its denoise pass uses (`time_embedder`, `vae2llm`, `llm2vae`,
`latent_pos_embed`). And `bagel_vit`: the SigLIP NaViT (`vit_model.vision_model.*`, patch
embedding stored in Linear form), the MLP `connector` and the frozen `vit_pos_embed`.

Assumed where the released configs are silent (docs/models/bagel.md, Facts), following the official modules: the und and gen copies
both carry q/k/v biases and QK-norm; the SigLIP post_layernorm is kept (BAGEL drops the
last layer and the pooling head, not the final norm); the sin-cos position tables are
stored in the checkpoint (frozen Parameters) in the weights dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import (
    BOOL,
    DECODER_ARGS,
    INT,
    Tensors,
    decoder_args,
    decoder_attention,
    decoder_spec,
    encoder_dims,
    encoder_layers,
    parse_args,
    require,
    swiglu,
)
from mstarc.archs.spec import ArchSpec

MOT_ARGS = {
    **DECODER_ARGS,
    "patch_dim": INT(),  # latent_patch_size^2 * z_channels: 64 for the FLUX VAE
    "max_latent_size": INT(),  # latent positions per side (64 -> 1024 px)
    "timestep_dim": INT(256),  # sinusoidal frequencies of the TimestepEmbedder
    "qk_norm": BOOL(True),
    "tie_embeddings": BOOL(False),
}

VIT_ARGS = {
    "layers": INT(),
    "hidden": INT(),
    "heads": INT(),
    "intermediate": INT(),
    "patch": INT(),
    "max_patches_per_side": INT(),  # 70: a 980 px image in 14 px patches
    "llm_hidden": INT(),
    "channels": INT(3),
}

_EXPERTS = ("", "_moe_gen")  # the und copy has no suffix


def bagel_mot(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = decoder_args("bagel_mot", args, MOT_ARGS)
    t = Tensors(dtype)
    h = a["hidden"]
    lm = "language_model.model"
    t.add(f"{lm}.embed_tokens.weight", (a["vocab"], h), "vocab")
    for i in range(a["layers"]):
        p = f"{lm}.layers.{i}"
        for sfx in _EXPERTS:
            # Qwen2: q/k/v bias, no o_proj bias; BAGEL adds per-head RMS QK-norm
            decoder_attention(t, f"{p}.self_attn", h, a["heads"], a["kv_heads"], a["head_dim"],
                              qkv_bias=True, qk_norm=a["qk_norm"], suffix=sfx)
        for sfx in _EXPERTS:
            t.norm(f"{p}.input_layernorm{sfx}", h)
            t.norm(f"{p}.post_attention_layernorm{sfx}", h)
        swiglu(t, f"{p}.mlp", h, a["intermediate"])
        swiglu(t, f"{p}.mlp_moe_gen", h, a["intermediate"])
    t.norm(f"{lm}.norm", h)
    t.norm(f"{lm}.norm_moe_gen", h)
    if not a["tie_embeddings"]:
        t.add("language_model.lm_head.weight", (a["vocab"], h), "vocab")
    # generation glue, applied around the LLM in the denoise pass
    t.linear("time_embedder.mlp.0", h, a["timestep_dim"])
    t.linear("time_embedder.mlp.2", h, h)
    t.linear("vae2llm", h, a["patch_dim"])
    t.linear("llm2vae", a["patch_dim"], h)
    t.add("latent_pos_embed.pos_embed", (a["max_latent_size"] ** 2, h))
    # und and gen tokens write the same K/V layout: one KV entry per token and layer
    return decoder_spec(t, a, intermediate=a["intermediate"], vocab=a["vocab"])


def bagel_vit(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("bagel_vit", args, VIT_ARGS)
    h = a["hidden"]
    require(h % a["heads"] == 0, f"hidden ({h}) must be divisible by heads ({a['heads']})", "heads")
    t = Tensors(dtype)
    vm = "vit_model.vision_model"
    positions = a["max_patches_per_side"] ** 2
    # the conv patch embedding converted to Linear: [hidden, 3 * patch * patch], (h, w, c) order
    t.linear(f"{vm}.embeddings.patch_embedding", h, a["channels"] * a["patch"] ** 2)
    t.add(f"{vm}.embeddings.position_embedding.weight", (positions, h))
    encoder_layers(t, f"{vm}.encoder.layers", a["layers"], h, a["intermediate"],
                   ("layer_norm1", "layer_norm2"), "mlp.")
    t.norm(f"{vm}.post_layernorm", h, bias=True)
    t.linear("connector.fc1", a["llm_hidden"], h)
    t.linear("connector.fc2", a["llm_hidden"], a["llm_hidden"])
    t.add("vit_pos_embed.pos_embed", (positions, a["llm_hidden"]))
    return t.spec(encoder_dims(a["layers"], h, a["heads"], a["intermediate"]), None)


ARCHS = {"bagel_mot": bagel_mot, "bagel_vit": bagel_vit}
