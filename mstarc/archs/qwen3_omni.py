"""Qwen3-Omni-30B-A3B (transformers' qwen3_omni_moe), in the released checkpoint's names.

Owns one arch per node: `qwen3_omni_thinker` (`thinker.model.*` + `thinker.lm_head`),
`qwen3_omni_audio` (`thinker.audio_tower.*`), `qwen3_omni_vision` (`thinker.visual.*`),
`qwen3_omni_talker` (`talker.model.*`, `talker.codec_head`, the two projection MLPs and the
code predictor `talker.code_predictor.*`, which the talker node owns: a frame is one call)
and `qwen3_omni_code2wav` (`code2wav.*`). MoE experts are listed per expert (`mlp.experts.{e}.gate_proj.weight`), as
the checkpoint stores them; transformers >= 5 fuses them on load, our loader may too.

Every thinker/talker layer is sparse (the released config has decoder_sparse_step 1 and no
mlp_only_layers). Buffers that are not persistent (rotary tables, the audio sinusoid
table, code2wav's code offsets) are not checkpoint tensors and are not listed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mstarc.archs._common import (
    INT,
    INTS,
    Tensors,
    decoder_args,
    decoder_attention,
    decoder_dims,
    decoder_spec,
    encoder_dims,
    encoder_layers,
    gqa_checks,
    parse_args,
    require,
    swiglu,
)
from mstarc.archs.spec import ArchSpec

_ATTN = {"layers": INT(), "hidden": INT(), "heads": INT(), "kv_heads": INT(), "head_dim": INT()}

THINKER_ARGS = {**_ATTN, "experts": INT(), "moe_intermediate": INT(), "vocab": INT()}
TALKER_ARGS = {**_ATTN, "experts": INT(), "moe_intermediate": INT(), "shared_intermediate": INT(),
               "codec_vocab": INT(), "thinker_hidden": INT(), "projection_intermediate": INT(),
               "cp_layers": INT(), "cp_hidden": INT(), "cp_heads": INT(), "cp_kv_heads": INT(), "cp_head_dim": INT(),
               "cp_intermediate": INT(), "codebook_size": INT(), "code_groups": INT(minimum=2)}
CODE2WAV_ARGS = {**_ATTN, "intermediate": INT(), "codebook_size": INT(), "quantizers": INT(),
                 "upsampling_ratios": INTS(allow_empty=True), "upsample_rates": INTS(),
                 "decoder_dim": INT()}
AUDIO_ARGS = {"layers": INT(), "dim": INT(), "heads": INT(), "ffn": INT(), "mel_bins": INT(),
              "conv_dim": INT(), "out_dim": INT()}
VISION_ARGS = {"depth": INT(), "hidden": INT(), "heads": INT(), "intermediate": INT(), "patch": INT(),
               "temporal_patch": INT(), "merge": INT(), "positions": INT(),
               "deepstack": INTS(minimum=0, allow_empty=True), "out_dim": INT(), "in_channels": INT(3)}


def _layer_common(t: Tensors, p: str, a: dict[str, Any]) -> None:
    decoder_attention(t, f"{p}.self_attn", a["hidden"], a["heads"], a["kv_heads"], a["head_dim"], qk_norm=True)
    t.norm(f"{p}.input_layernorm", a["hidden"])
    t.norm(f"{p}.post_attention_layernorm", a["hidden"])


def _experts(t: Tensors, p: str, hidden: int, experts: int, inter: int) -> None:
    t.add(f"{p}.gate.weight", (experts, hidden))  # the router
    for e in range(experts):
        swiglu(t, f"{p}.experts.{e}", hidden, inter, ("expert", "expert"))


def _moe_stack(t: Tensors, a: dict[str, Any], model: str, embed: str, vocab: int, head: str,
               per_layer: Callable[[str], None] | None = None) -> None:
    """`{model}.model.*` of a Qwen3-MoE stack (the embedding `embed`, per layer the attention, norms
    and routed experts, then `per_layer(prefix)`'s tensors, the final norm) and its head `{model}.{head}`."""
    h = a["hidden"]
    t.add(f"{model}.model.{embed}.weight", (vocab, h), "vocab")
    for i in range(a["layers"]):
        p = f"{model}.model.layers.{i}"
        _layer_common(t, p, a)
        _experts(t, f"{p}.mlp", h, a["experts"], a["moe_intermediate"])
        if per_layer is not None:
            per_layer(p)
    t.norm(f"{model}.model.norm", h)
    t.add(f"{model}.{head}.weight", (vocab, h), "vocab")  # untied


def qwen3_omni_thinker(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = decoder_args("qwen3_omni_thinker", args, THINKER_ARGS)
    t = Tensors(dtype)
    _moe_stack(t, a, "thinker", "embed_tokens", a["vocab"], "lm_head")
    return decoder_spec(t, a, vocab=a["vocab"], experts=a["experts"], moe_intermediate=a["moe_intermediate"])


def qwen3_omni_talker(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = decoder_args("qwen3_omni_talker", args, TALKER_ARGS)
    t = Tensors(dtype)
    h = a["hidden"]

    def shared_expert(p: str) -> None:
        swiglu(t, f"{p}.mlp.shared_expert", h, a["shared_intermediate"])
        t.add(f"{p}.mlp.shared_expert_gate.weight", (1, h))  # sigmoid gate of the shared expert

    _moe_stack(t, a, "talker", "codec_embedding", a["codec_vocab"], "codec_head", shared_expert)
    # thinker width -> talker width, for text embeddings and for the layer-24 hidden taps
    for proj in ("text_projection", "hidden_projection"):
        t.linear(f"talker.{proj}.linear_fc1", a["projection_intermediate"], a["thinker_hidden"])
        t.linear(f"talker.{proj}.linear_fc2", h, a["projection_intermediate"])
    _code_predictor(t, a)
    return decoder_spec(t, a, vocab=a["codec_vocab"], experts=a["experts"], moe_intermediate=a["moe_intermediate"],
                        intermediate=a["shared_intermediate"])


def _code_predictor(t: Tensors, a: dict[str, Any]) -> None:
    """The code predictor's tensors (`talker.code_predictor.*`) from the talker's `cp_*` args."""
    cp = {"hidden": a["cp_hidden"], "heads": a["cp_heads"], "kv_heads": a["cp_kv_heads"], "head_dim": a["cp_head_dim"]}
    gqa_checks(cp["heads"], cp["kv_heads"])
    require(cp["hidden"] == a["hidden"], f"cp_hidden ({cp['hidden']}) must equal hidden ({a['hidden']}): the code "
            "predictor reads the talker's hidden state", "cp_hidden")
    h, p0 = cp["hidden"], "talker.code_predictor"
    for i in range(a["cp_layers"]):
        p = f"{p0}.model.layers.{i}"
        _layer_common(t, p, cp)
        swiglu(t, f"{p}.mlp", h, a["cp_intermediate"])
    t.norm(f"{p0}.model.norm", h)
    # code groups 1..G-1 each have an input embedding and an output head; the 15 small tables
    # and heads stay whole on every rank, so no "vocab" dim to divide
    for g in range(a["code_groups"] - 1):
        t.add(f"{p0}.model.codec_embedding.{g}.weight", (a["codebook_size"], h))
    for g in range(a["code_groups"] - 1):
        t.add(f"{p0}.lm_head.{g}.weight", (a["codebook_size"], h))


def _snake_beta(t: Tensors, p: str, c: int) -> None:
    t.add(f"{p}.alpha", (c,))
    t.add(f"{p}.beta", (c,))


def qwen3_omni_code2wav(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("qwen3_omni_code2wav", args, CODE2WAV_ARGS)
    gqa_checks(a["heads"], a["kv_heads"])
    levels = len(a["upsample_rates"])
    require(a["decoder_dim"] % 2**levels == 0,
            f"decoder_dim ({a['decoder_dim']}) must be divisible by 2^{levels} (one halving per upsample rate)",
            "decoder_dim")
    t = Tensors(dtype)
    h = a["hidden"]
    # one table for all quantizers; code q of group g is row g * codebook_size + q
    t.add("code2wav.code_embedding.weight", (a["codebook_size"] * a["quantizers"], h))
    for i in range(a["layers"]):
        p = f"code2wav.pre_transformer.layers.{i}"
        t.norm(f"{p}.input_layernorm", h)
        decoder_attention(t, f"{p}.self_attn", h, a["heads"], a["kv_heads"], a["head_dim"])  # no QK-norm
        t.add(f"{p}.self_attn_layer_scale.scale", (h,))
        t.norm(f"{p}.post_attention_layernorm", h)
        swiglu(t, f"{p}.mlp", h, a["intermediate"])
        t.add(f"{p}.mlp_layer_scale.scale", (h,))
    t.norm("code2wav.pre_transformer.norm", h)
    for k, factor in enumerate(a["upsampling_ratios"]):
        p = f"code2wav.upsample.{k}"
        t.conv_transpose(f"{p}.0.conv", h, h, (factor,))
        t.conv(f"{p}.1.dwconv.conv", h, 1, (7,))  # depthwise
        t.norm(f"{p}.1.norm", h, bias=True)
        t.linear(f"{p}.1.pwconv1", 4 * h, h)
        t.linear(f"{p}.1.pwconv2", h, 4 * h)
        t.add(f"{p}.1.gamma", (h,))
    dd = a["decoder_dim"]
    t.conv("code2wav.decoder.0.conv", dd, h, (7,))
    out_dim = dd
    for i, rate in enumerate(a["upsample_rates"]):
        in_dim, out_dim = dd // 2**i, dd // 2 ** (i + 1)
        p = f"code2wav.decoder.{i + 1}.block"
        _snake_beta(t, f"{p}.0", in_dim)
        t.conv_transpose(f"{p}.1.conv", in_dim, out_dim, (2 * rate,))
        for j in range(2, 5):  # residual units, dilations 1, 3, 9
            _snake_beta(t, f"{p}.{j}.act1", out_dim)
            t.conv(f"{p}.{j}.conv1.conv", out_dim, out_dim, (7,))
            _snake_beta(t, f"{p}.{j}.act2", out_dim)
            t.conv(f"{p}.{j}.conv2.conv", out_dim, out_dim, (1,))
    _snake_beta(t, f"code2wav.decoder.{levels + 1}", out_dim)
    t.conv(f"code2wav.decoder.{levels + 2}.conv", 1, out_dim, (7,))
    return t.spec(decoder_dims(a, intermediate=a["intermediate"]), None)


def qwen3_omni_audio(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("qwen3_omni_audio", args, AUDIO_ARGS)
    d, c = a["dim"], a["conv_dim"]
    require(d % a["heads"] == 0, f"dim ({d}) must be divisible by heads ({a['heads']})", "heads")
    t = Tensors(dtype)
    at = "thinker.audio_tower"
    t.conv(f"{at}.conv2d1", c, 1, (3, 3))
    t.conv(f"{at}.conv2d2", c, c, (3, 3))
    t.conv(f"{at}.conv2d3", c, c, (3, 3))
    freq = (((a["mel_bins"] + 1) // 2 + 1) // 2 + 1) // 2  # mel bins after three stride-2 convs
    t.linear(f"{at}.conv_out", d, c * freq, bias=False)
    encoder_layers(t, f"{at}.layers", a["layers"], d, a["ffn"],
                   ("self_attn_layer_norm", "final_layer_norm"), "")
    t.norm(f"{at}.ln_post", d, bias=True)
    t.linear(f"{at}.proj1", d, d)
    t.linear(f"{at}.proj2", a["out_dim"], d)
    return t.spec(encoder_dims(a["layers"], d, a["heads"], a["ffn"]), None)


def _merger(t: Tensors, p: str, hidden: int, merged: int, out_dim: int, postshuffle: bool) -> None:
    # the main merger norms each patch before the 2x2 shuffle, the deepstack ones after it
    t.norm(f"{p}.ln_q", merged if postshuffle else hidden, bias=True)
    t.linear(f"{p}.mlp.0", merged, merged)
    t.linear(f"{p}.mlp.2", out_dim, merged)


def qwen3_omni_vision(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("qwen3_omni_vision", args, VISION_ARGS)
    h = a["hidden"]
    require(h % a["heads"] == 0, f"hidden ({h}) must be divisible by heads ({a['heads']})", "heads")
    for idx in a["deepstack"]:
        require(idx < a["depth"], f"deepstack index {idx} is not a layer (depth {a['depth']})", "deepstack")
    side = round(a["positions"] ** 0.5)
    require(side * side == a["positions"], f"positions ({a['positions']}) must be a square grid", "positions")
    t = Tensors(dtype)
    v = "thinker.visual"
    t.conv(f"{v}.patch_embed.proj", h, a["in_channels"], (a["temporal_patch"], a["patch"], a["patch"]))
    t.add(f"{v}.pos_embed.weight", (a["positions"], h))
    for i in range(a["depth"]):
        p = f"{v}.blocks.{i}"
        t.norm(f"{p}.norm1", h, bias=True)
        t.norm(f"{p}.norm2", h, bias=True)
        t.linear(f"{p}.attn.qkv", 3 * h, h, True, "col")
        t.linear(f"{p}.attn.proj", h, h, True, "row")
        t.linear(f"{p}.mlp.linear_fc1", a["intermediate"], h, True, "col")
        t.linear(f"{p}.mlp.linear_fc2", h, a["intermediate"], True, "row")
    merged = h * a["merge"] ** 2
    _merger(t, f"{v}.merger", h, merged, a["out_dim"], postshuffle=False)
    for j in range(len(a["deepstack"])):
        _merger(t, f"{v}.merger_list.{j}", h, merged, a["out_dim"], postshuffle=True)
    return t.spec(encoder_dims(a["depth"], h, a["heads"], a["intermediate"]), None)


ARCHS = {
    "qwen3_omni_thinker": qwen3_omni_thinker,
    "qwen3_omni_audio": qwen3_omni_audio,
    "qwen3_omni_vision": qwen3_omni_vision,
    "qwen3_omni_talker": qwen3_omni_talker,
    "qwen3_omni_code2wav": qwen3_omni_code2wav,
}
