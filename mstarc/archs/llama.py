"""Llama decoder LMs in Hugging Face naming (`model.layers.{i}...`): Orpheus-3B's backbone.

Owns `llama`: embed_tokens, per layer q/k/v/o (no bias), RMSNorms and a SwiGLU MLP, the final
norm, and `lm_head.weight` only when the head is not tied (Orpheus ties it, so its
checkpoint has no lm_head: 3,300,867,072 parameters).

Its FP8-able weights (`ArchSpec.fp8`, a placement's `weights: fp8`) are every layer's seven
projections, which `mstar_models.layers.decoder.Decoder.quantize_fp8_` quantizes; the
embedding, the head and the norms stay in the checkpoint's dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import (
    BOOL,
    DECODER_ARGS,
    Tensors,
    decoder_args,
    decoder_attention,
    decoder_spec,
    swiglu,
)
from mstarc.archs.spec import ArchSpec

LLAMA_ARGS = {
    **DECODER_ARGS,
    "tie_embeddings": BOOL(False),
    # Llama 3 has no attention bias; kept as an argument so Llama-likes with a q/k/v bias fit
    "attention_bias": BOOL(False),
}


def llama(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = decoder_args("llama", args, LLAMA_ARGS)
    t = Tensors(dtype)
    h = a["hidden"]
    t.add("model.embed_tokens.weight", (a["vocab"], h), "vocab")
    for i in range(a["layers"]):
        p = f"model.layers.{i}"
        decoder_attention(t, f"{p}.self_attn", h, a["heads"], a["kv_heads"], a["head_dim"],
                          qkv_bias=a["attention_bias"])
        swiglu(t, f"{p}.mlp", h, a["intermediate"])
        t.norm(f"{p}.input_layernorm", h)
        t.norm(f"{p}.post_attention_layernorm", h)
    t.norm("model.norm", h)
    if not a["tie_embeddings"]:
        t.add("lm_head.weight", (a["vocab"], h), "vocab")
    spec = decoder_spec(t, a, intermediate=a["intermediate"], vocab=a["vocab"])
    return dataclasses.replace(spec, fp8=tuple(x.name for x in spec.tensors if _FP8.fullmatch(x.name)))


# the decoder layers' projection weights (not their biases): what `weights: fp8` quantizes
_FP8 = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


ARCHS = {"llama": llama}
