"""π0.5 (Physical Intelligence; LeRobot's `policies/pi05`): PaliGemma's vision tower and Gemma VLM, and the action expert.

Names are the released checkpoint's as LeRobot publishes it (`lerobot/pi05_base`'s
`model.safetensors`: the policy's state dict, so openpi's converter names
(`examples/convert_jax_model_to_pytorch.py`) under the policy's `model.`; a file straight from
openpi's converter lacks that prefix, and `PI05Policy.from_pretrained` adds it):

- `pi05_siglip`: the SigLIP vision tower and the multimodal projector,
  `model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.*` and
  `...model.multi_modal_projector.linear.*` (So400m/14: width 1152, 27 layers, 16 heads,
  MLP 4304; 224 x 224 gives 256 patch tokens, one learned position each);
- `pi05_gemma`: the Gemma VLM, `model.paligemma_with_expert.paligemma.model.language_model.*`
  (Gemma 2B: 18 layers, width 2048, 8 query heads over 1 KV head of 256, GeGLU MLP 16,384,
  `1 + w` RMSNorm gains, vocabulary 257,152). The final `norm` is in the checkpoint though
  π0.5 never reads the VLM's last hidden state;
- `pi05_expert`: the action expert, `model.paligemma_with_expert.gemma_expert.model.layers.*` and
  `.norm` (Gemma-300M shape: 18 layers, width 1024, the VLM's attention layout, MLP 4096),
  whose three RMSNorms per layer-pair are adaptive: `<norm>.dense` [3 * width, width] with a
  bias maps the flow-time condition to scale, shift and gate (no gain of its own), and the
  projections `model.action_in_proj`, `model.action_out_proj`, `model.time_mlp_in`,
  `model.time_mlp_out`. The file also holds both language heads
  (`...paligemma.lm_head.weight`, `...gemma_expert.lm_head.weight`), which π0.5 never reads:
  no arch lists them, and the expert node declares them unused (`unused_checkpoint_tensors`).
  The dense layers are 2 * 18 + 1 = 37 matrices of 3072 x 1024 with biases: 116.5M of the
  expert's 430.1M parameters (27 %).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import (
    DECODER_ARGS,
    INT,
    LAYER_ARGS,
    Tensors,
    decoder_attention,
    encoder_dims,
    gqa_checks,
    parse_args,
    require,
)
from mstarc.archs.spec import ArchSpec, KVGeometry

POLICY = "model"  # LeRobot's PI05Policy.model
PALIGEMMA = f"{POLICY}.paligemma_with_expert.paligemma.model"
EXPERT = f"{POLICY}.paligemma_with_expert.gemma_expert.model"

SIGLIP_ARGS = {
    "hidden": INT(),
    "layers": INT(),
    "heads": INT(),
    "intermediate": INT(),
    "patch": INT(),
    "image": INT(),
    "channels": INT(3),
    "projection": INT(),  # the VLM's width
}

GEMMA_ARGS = DECODER_ARGS
EXPERT_ARGS = {**LAYER_ARGS, "action_dim": INT()}  # the VLM's layer sizes; actions in place of a vocabulary


def pi05_siglip(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("pi05_siglip", args, SIGLIP_ARGS)
    h = a["hidden"]
    require(h % a["heads"] == 0, f"hidden ({h}) must be divisible by heads ({a['heads']})", "heads")
    require(a["image"] % a["patch"] == 0, f"image ({a['image']}) must be a multiple of patch ({a['patch']})",
            "patch")
    t = Tensors(dtype)
    vm = f"{PALIGEMMA}.vision_tower.vision_model"
    t.conv(f"{vm}.embeddings.patch_embedding", h, a["channels"], (a["patch"], a["patch"]))
    t.add(f"{vm}.embeddings.position_embedding.weight", ((a["image"] // a["patch"]) ** 2, h))
    for i in range(a["layers"]):
        p = f"{vm}.encoder.layers.{i}"
        t.norm(f"{p}.layer_norm1", h, bias=True)
        t.linear(f"{p}.self_attn.q_proj", h, h, True, "col")
        t.linear(f"{p}.self_attn.k_proj", h, h, True, "col")
        t.linear(f"{p}.self_attn.v_proj", h, h, True, "col")
        t.linear(f"{p}.self_attn.out_proj", h, h, True, "row")
        t.norm(f"{p}.layer_norm2", h, bias=True)
        t.linear(f"{p}.mlp.fc1", a["intermediate"], h, True, "col")
        t.linear(f"{p}.mlp.fc2", h, a["intermediate"], True, "row")
    t.norm(f"{vm}.post_layernorm", h, bias=True)
    t.linear(f"{PALIGEMMA}.multi_modal_projector.linear", a["projection"], h)
    return t.spec(encoder_dims(a["layers"], h, a["heads"], a["intermediate"]), None)


def _gemma_layer(t: Tensors, p: str, a: Mapping[str, int], adaptive: bool) -> None:
    h = a["hidden"]
    decoder_attention(t, f"{p}.self_attn", h, a["heads"], a["kv_heads"], a["head_dim"])
    t.linear(f"{p}.mlp.gate_proj", a["intermediate"], h, False, "col")
    t.linear(f"{p}.mlp.up_proj", a["intermediate"], h, False, "col")
    t.linear(f"{p}.mlp.down_proj", h, a["intermediate"], False, "row")
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if adaptive:
            t.linear(f"{p}.{norm}.dense", 3 * h, h)
        else:
            t.norm(f"{p}.{norm}", h)


def _dims(a: Mapping[str, int]) -> dict[str, int]:
    return {k: a[k] for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")}


def pi05_gemma(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("pi05_gemma", args, GEMMA_ARGS)
    gqa_checks(a["heads"], a["kv_heads"])
    t = Tensors(dtype)
    lm = f"{PALIGEMMA}.language_model"
    t.add(f"{lm}.embed_tokens.weight", (a["vocab"], a["hidden"]), "vocab")
    for i in range(a["layers"]):
        _gemma_layer(t, f"{lm}.layers.{i}", a, adaptive=False)
    t.norm(f"{lm}.norm", a["hidden"])
    dims = _dims(a) | {"vocab": a["vocab"]}
    return t.spec(dims, KVGeometry(a["layers"], a["kv_heads"], a["head_dim"]))


def pi05_expert(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("pi05_expert", args, EXPERT_ARGS)
    gqa_checks(a["heads"], a["kv_heads"])
    require(a["hidden"] % 2 == 0, f"hidden ({a['hidden']}) must be even (sin-cos time features)", "hidden")
    t = Tensors(dtype)
    h = a["hidden"]
    for i in range(a["layers"]):
        _gemma_layer(t, f"{EXPERT}.layers.{i}", a, adaptive=True)
    t.linear(f"{EXPERT}.norm.dense", 3 * h, h)
    t.linear(f"{POLICY}.action_in_proj", h, a["action_dim"])
    t.linear(f"{POLICY}.action_out_proj", a["action_dim"], h)
    t.linear(f"{POLICY}.time_mlp_in", h, h)
    t.linear(f"{POLICY}.time_mlp_out", h, h)
    return t.spec(_dims(a), KVGeometry(a["layers"], a["kv_heads"], a["head_dim"]))


ARCHS = {"pi05_siglip": pi05_siglip, "pi05_gemma": pi05_gemma, "pi05_expert": pi05_expert}
