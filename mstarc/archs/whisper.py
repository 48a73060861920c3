"""Whisper (openai/whisper-large-v3) in Hugging Face naming: `whisper_encoder` and `whisper_decoder`.

The checkpoint (transformers' `WhisperForConditionalGeneration`) holds `model.encoder.*` and
`model.decoder.*`; the output projection `proj_out` is tied to `model.decoder.embed_tokens`
and not stored. Per layer: `self_attn` (q/v/out with bias, k without), `self_attn_layer_norm`,
`fc1`, `fc2`, `final_layer_norm`, all LayerNorms with bias; the decoder adds `encoder_attn`
and `encoder_attn_layer_norm`. The encoder starts with `conv1` (mels -> width, kernel 3) and
`conv2` (stride 2) and holds its sinusoidal positions as `embed_positions.weight`
[source_positions, width]; the decoder's positions are learned ([target_positions, width]).

whisper-large-v3: 128 mels, 32 + 32 layers, width 1280, 20 heads, MLP 5120, vocabulary
51866, 1500 source and 448 target positions: 1,543,490,560 parameters (transformers'
`num_parameters()` of the model, the tied head counted once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import INT, Tensors, parse_args, require
from mstarc.archs.spec import ArchSpec, KVGeometry

_COMMON = {
    "layers": INT(),
    "hidden": INT(),
    "heads": INT(),
    "intermediate": INT(),
}
ENCODER_ARGS = {**_COMMON, "mels": INT(), "source_positions": INT()}
DECODER_ARGS = {**_COMMON, "vocab": INT(), "target_positions": INT()}


def _attention(t: Tensors, prefix: str, hidden: int) -> None:
    t.linear(f"{prefix}.q_proj", hidden, hidden, True)
    t.linear(f"{prefix}.k_proj", hidden, hidden, False)
    t.linear(f"{prefix}.v_proj", hidden, hidden, True)
    t.linear(f"{prefix}.out_proj", hidden, hidden, True)


def _layer(t: Tensors, prefix: str, hidden: int, intermediate: int, cross: bool) -> None:
    _attention(t, f"{prefix}.self_attn", hidden)
    t.norm(f"{prefix}.self_attn_layer_norm", hidden, bias=True)
    if cross:
        _attention(t, f"{prefix}.encoder_attn", hidden)
        t.norm(f"{prefix}.encoder_attn_layer_norm", hidden, bias=True)
    t.linear(f"{prefix}.fc1", intermediate, hidden, True)
    t.linear(f"{prefix}.fc2", hidden, intermediate, True)
    t.norm(f"{prefix}.final_layer_norm", hidden, bias=True)


def _head_dim(a: Mapping[str, Any]) -> int:
    require(a["hidden"] % a["heads"] == 0, f"hidden ({a['hidden']}) must be a multiple of heads ({a['heads']})",
            "heads")
    return int(a["hidden"] // a["heads"])


def whisper_encoder(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("whisper_encoder", args, ENCODER_ARGS)
    _head_dim(a)
    t = Tensors(dtype)
    h, p = a["hidden"], "model.encoder"
    t.conv(f"{p}.conv1", h, a["mels"], (3,))
    t.conv(f"{p}.conv2", h, h, (3,))
    t.add(f"{p}.embed_positions.weight", (a["source_positions"], h))
    for i in range(a["layers"]):
        _layer(t, f"{p}.layers.{i}", h, a["intermediate"], cross=False)
    t.norm(f"{p}.layer_norm", h, bias=True)
    # the activation of one window at its peak: the conv1 output (2 x positions x width) and
    # one layer's MLP (positions x intermediate), as the memory pass budgets a batch row
    peak = a["source_positions"] * (2 * h + a["intermediate"])
    dims = {"layers": a["layers"], "hidden": h, "heads": a["heads"], "intermediate": a["intermediate"],
            "activation_elements": peak}
    return t.spec(dims, None)


def whisper_decoder(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("whisper_decoder", args, DECODER_ARGS)
    hd = _head_dim(a)
    t = Tensors(dtype)
    h, p = a["hidden"], "model.decoder"
    t.add(f"{p}.embed_tokens.weight", (a["vocab"], h))
    t.add(f"{p}.embed_positions.weight", (a["target_positions"], h))
    for i in range(a["layers"]):
        _layer(t, f"{p}.layers.{i}", h, a["intermediate"], cross=True)
    t.norm(f"{p}.layer_norm", h, bias=True)
    dims = {"layers": a["layers"], "hidden": h, "heads": a["heads"], "kv_heads": a["heads"], "head_dim": hd,
            "intermediate": a["intermediate"], "vocab": a["vocab"]}
    # one geometry for both contexts: self-attention (text) and cross-attention (cross)
    return t.spec(dims, KVGeometry(a["layers"], a["heads"], hd))


ARCHS = {"whisper_encoder": whisper_encoder, "whisper_decoder": whisper_decoder}
