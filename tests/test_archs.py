"""The architecture catalogue (mstarc.archs) and the model corpus (models/*/*.walk).

Parameter counts are checked against published figures, tensor names and shapes against
the released checkpoints' (docs/models/<model>.md, Facts), argument errors against the ArchError contract. The corpus test
parses every .walk file with the grammar alone and calls each `arch` line's function with
the real and tiny config values kept below, so it needs no front end; when the front end
is importable, a last test also compiles every model at both sizes.
"""

from __future__ import annotations

import math
from pathlib import Path

import lark
import pytest

from mstarc.archs import REGISTRY, SHARD_ROLES, ArchError, ArchSpec, get_arch

ROOT = Path(__file__).resolve().parents[1]
GRAMMAR = ROOT / "grammar" / "walk.lark"
MODELS = ("orpheus", "vjepa2", "bagel", "qwen3_omni")

# ---- the corpus' arch lines, by model and node: (arch, real args, tiny overrides) --------
# Mirrors the variants in models/*/*.walk (test_corpus_arch_lines checks the argument names
# against the files, test_corpus_compiles the values when the front end is present).

_ORPHEUS_LLM = dict(layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, intermediate=8192,
                    vocab=156940, tie_embeddings=True)
_SNAC_24K = dict(encoder_dim=48, encoder_rates=[2, 4, 8, 8], decoder_dim=1024, decoder_rates=[8, 8, 4, 2],
                 codebook_size=4096, codebook_dim=8, vq_strides=[4, 2, 1], depthwise=True, noise=True,
                 attn_window=0)
_VITG = dict(dim=1408, depth=40, heads=22, mlp=6144, patch=16, tubelet=2, in_chans=3)
_AC = dict(enc_dim=1408, dim=1024, depth=24, heads=16, mlp=4096, action_dim=7, state_dim=7, extrinsics_dim=6)
_MOT = dict(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064,
            patch_dim=64, max_latent_size=64, timestep_dim=256)
_SIGLIP = dict(layers=26, hidden=1152, heads=16, intermediate=4304, patch=14, max_patches_per_side=70,
               llm_hidden=3584)
_FLUX = dict(ch=128, ch_mult=[1, 2, 4, 4], res_blocks=2, z_channels=16)
_THINKER = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, moe_intermediate=768,
                vocab=152064)
_AUDIO = dict(layers=32, dim=1280, heads=20, ffn=5120, mel_bins=128, conv_dim=480, out_dim=2048)
_VISION = dict(depth=27, hidden=1152, heads=16, intermediate=4304, patch=16, temporal_patch=2, merge=2,
               positions=2304, deepstack=[8, 16, 24], out_dim=2048)
_TALKER = dict(layers=20, hidden=1024, heads=16, kv_heads=2, head_dim=128, experts=128, moe_intermediate=384,
               shared_intermediate=768, codec_vocab=3072, thinker_hidden=2048, projection_intermediate=2048,
               cp_layers=5, cp_hidden=1024, cp_heads=16, cp_kv_heads=8, cp_head_dim=128, cp_intermediate=3072,
               codebook_size=2048, code_groups=16)
_CODE2WAV = dict(layers=8, hidden=1024, heads=16, kv_heads=16, head_dim=64, intermediate=3072, codebook_size=2048,
                 quantizers=16, upsampling_ratios=[2, 2], upsample_rates=[8, 5, 4, 3], decoder_dim=1536)

CORPUS: dict[str, dict[str, tuple[str, dict, dict]]] = {
    "orpheus": {
        "llm": ("llama", _ORPHEUS_LLM, dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)),
        "snac": ("snac_decoder", {**_SNAC_24K, "window": 28}, dict(encoder_dim=4, decoder_dim=64)),
    },
    "vjepa2": {
        "encoder": ("vjepa2_vit", _VITG, dict(dim=64, depth=2, heads=2, mlp=256)),
        "predictor": ("vjepa2_ac_predictor", _AC, dict(enc_dim=64, dim=64, depth=2, heads=2, mlp=256)),
    },
    "bagel": {
        "vit": ("bagel_vit", _SIGLIP, dict(layers=2, hidden=32, heads=2, intermediate=64, max_patches_per_side=4,
                                           llm_hidden=64)),
        "llm": ("bagel_mot", _MOT, dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                                        vocab=300, patch_dim=16, max_latent_size=4)),
        "vae_enc": ("flux_vae_encoder", _FLUX, dict(ch=32, z_channels=4)),
        "vae_dec": ("flux_vae_decoder", _FLUX, dict(ch=32, z_channels=4)),
    },
    "qwen3_omni": {
        "audio_enc": ("qwen3_omni_audio", _AUDIO, dict(layers=2, dim=32, heads=2, ffn=64, conv_dim=8, out_dim=64)),
        "vision_enc": ("qwen3_omni_vision", _VISION, dict(depth=2, hidden=32, heads=2, intermediate=64, positions=64,
                                                          deepstack=[0, 1], out_dim=64)),
        "thinker": ("qwen3_omni_thinker", _THINKER, dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                         experts=4, moe_intermediate=32, vocab=512)),
        "talker": ("qwen3_omni_talker", _TALKER, dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16,
                                                      experts=4, moe_intermediate=16, shared_intermediate=32,
                                                      thinker_hidden=64, projection_intermediate=64, cp_layers=1,
                                                      cp_hidden=32, cp_heads=4, cp_kv_heads=2, cp_head_dim=8,
                                                      cp_intermediate=64, code_groups=4)),
        "code2wav": ("qwen3_omni_code2wav", _CODE2WAV, dict(layers=1, hidden=32, heads=2, kv_heads=2, head_dim=16,
                                                            intermediate=64, quantizers=4, decoder_dim=64)),
    },
}


def build(model: str, node: str, variant: str = "real", dtype: str = "bf16") -> ArchSpec:
    arch, real, tiny = CORPUS[model][node]
    return get_arch(arch)(real if variant == "real" else {**real, **tiny}, dtype)


def total(model: str) -> int:
    return sum(build(model, node).param_count() for node in CORPUS[model])


# ---- published figures -------------------------------------------------------------------

def test_orpheus_llm_is_llama_3b_with_tied_head():
    spec = build("orpheus", "llm")
    assert spec.param_count() == 3_300_867_072
    names = spec.tensor_map()
    assert "lm_head.weight" not in names  # tied: the checkpoint has no head
    assert names["model.embed_tokens.weight"].shape == (156940, 3072)
    assert names["model.layers.27.self_attn.k_proj.weight"].shape == (1024, 3072)
    assert names["model.layers.0.mlp.down_proj.weight"].shape == (3072, 8192)
    assert len(spec.tensors) == 1 + 28 * 9 + 1
    assert spec.kv is not None and spec.kv.bytes_per_token("bf16") == 2 * 28 * 8 * 128 * 2


def test_snac_24khz():
    dec = build("orpheus", "snac").param_count()
    full = get_arch("snac")(_SNAC_24K, "f32").param_count()
    assert full == pytest.approx(19.8e6, rel=0.005)  # the published size of snac_24khz
    assert 10e6 < dec < full  # decoder + quantizer: all but the encoder
    names = build("orpheus", "snac").tensor_map()
    assert names["quantizer.quantizers.2.codebook.weight"].shape == (4096, 8)
    assert names["decoder.model.0.weight"].shape == (768, 1, 7)  # depthwise conv on the 768-d latent
    assert names["decoder.model.2.block.1.weight"].shape == (1024, 512, 16)  # ConvTranspose [in, out, 2*stride]
    assert names["decoder.model.2.block.2.linear.weight"].shape == (512, 512, 1)  # NoiseBlock, no bias
    assert "decoder.model.2.block.2.linear.bias" not in names
    assert names["decoder.model.7.weight"].shape == (1, 64, 7)  # the final conv to one channel


def test_snac_44khz_local_attention():
    # the 44.1 kHz config has LocalMHA in encoder and decoder; published size 54.5M
    cfg = dict(encoder_dim=64, encoder_rates=[2, 3, 8, 8], decoder_dim=1536, decoder_rates=[8, 8, 3, 2],
               attn_window=32, codebook_size=4096, codebook_dim=8, vq_strides=[8, 4, 2, 1])
    assert get_arch("snac")(cfg, "f32").param_count() == pytest.approx(54.5e6, rel=0.005)


def test_vjepa2_sizes_and_names():
    enc, pred = build("vjepa2", "encoder"), build("vjepa2", "predictor")
    assert enc.param_count() == pytest.approx(1.0e9, rel=0.03)  # ViT-g: "1B"
    assert pred.param_count() == pytest.approx(300e6, rel=0.03)  # AC predictor: "300M"
    e, p = enc.tensor_map(), pred.tensor_map()
    assert e["patch_embed.proj.weight"].shape == (1408, 3, 2, 16, 16)
    assert e["blocks.39.attn.qkv.weight"].shape == (4224, 1408)
    assert e["blocks.0.mlp.fc1.weight"].shape == (6144, 1408)
    assert "pos_embed" not in e and enc.kv is None
    assert p["action_encoder.weight"].shape == (1024, 7)
    assert p["extrinsics_encoder.weight"].shape == (1024, 6)
    assert p["predictor_proj.weight"].shape == (1408, 1024)
    assert "predictor_blocks.23.attn.qkv.bias" in p
    assert pred.kv is not None and (pred.kv.layers, pred.kv.kv_heads, pred.kv.head_dim) == (24, 16, 64)


def test_bagel_mot_is_14b_with_two_experts():
    llm = build("bagel", "llm")
    assert llm.param_count() == pytest.approx(14e9, rel=0.02)  # "14B total, 7B active"
    n = llm.tensor_map()
    assert n["language_model.model.embed_tokens.weight"].shape == (152064, 3584)
    assert n["language_model.lm_head.weight"].shape == (152064, 3584)
    for sfx in ("", "_moe_gen"):
        assert n[f"language_model.model.layers.3.self_attn.k_proj{sfx}.bias"].shape == (512,)
        assert n[f"language_model.model.layers.3.self_attn.q_norm{sfx}.weight"].shape == (128,)
        assert f"language_model.model.layers.3.self_attn.o_proj{sfx}.bias" not in n
        assert f"language_model.model.layers.3.input_layernorm{sfx}.weight" in n
    assert "language_model.model.layers.3.mlp_moe_gen.down_proj.weight" in n
    assert "language_model.model.norm_moe_gen.weight" in n
    assert n["latent_pos_embed.pos_embed"].shape == (4096, 3584)
    assert n["vae2llm.weight"].shape == (3584, 64) and n["llm2vae.weight"].shape == (64, 3584)
    assert n["time_embedder.mlp.0.weight"].shape == (3584, 256)
    vit = build("bagel", "vit").tensor_map()
    assert vit["vit_model.vision_model.embeddings.patch_embedding.weight"].shape == (1152, 588)
    assert vit["vit_model.vision_model.embeddings.position_embedding.weight"].shape == (4900, 1152)
    assert "vit_model.vision_model.encoder.layers.25.mlp.fc2.bias" in vit
    assert "vit_model.vision_model.encoder.layers.26.mlp.fc2.bias" not in vit  # 26 of 27 layers
    assert vit["connector.fc1.weight"].shape == (3584, 1152)
    assert vit["vit_pos_embed.pos_embed"].shape == (4900, 3584)


def test_flux_vae():
    enc, dec = build("bagel", "vae_enc"), build("bagel", "vae_dec")
    # FLUX.1's ae.safetensors holds 83,819,683 parameters (encoder + decoder)
    assert enc.param_count() + dec.param_count() == 83_819_683
    e, d = enc.tensor_map(), dec.tensor_map()
    assert e["encoder.conv_out.weight"].shape == (32, 512, 3, 3)  # mean and log-variance of 16 channels
    assert "encoder.down.3.downsample.conv.weight" not in e  # no downsampling after the last level
    assert e["encoder.down.1.block.0.nin_shortcut.weight"].shape == (256, 128, 1, 1)
    assert d["decoder.conv_in.weight"].shape == (512, 16, 3, 3)
    assert d["decoder.up.0.block.2.conv2.weight"].shape == (128, 128, 3, 3)  # res_blocks + 1 per level
    assert "decoder.up.0.upsample.conv.weight" not in d
    assert d["decoder.mid.attn_1.proj_out.weight"].shape == (512, 512, 1, 1)


def test_qwen3_omni_matches_the_released_checkpoint():
    specs = [build("qwen3_omni", node) for node in CORPUS["qwen3_omni"]]
    # The released model is 35.26B parameters in 28,010 tensors (65.68 GiB of bf16). Our
    # per-node lists together give 35,259,818,545 parameters in exactly 28,010 tensors: the
    # checkpoint stores nothing else (no tied copies, no non-persistent buffers).
    assert sum(s.param_count() for s in specs) == pytest.approx(35.26e9, rel=5e-4)
    assert sum(len(s.tensors) for s in specs) == 28_010
    assert sum(s.bytes() for s in specs) / 2**30 == pytest.approx(65.68, rel=1e-3)
    names = {t.name: t for s in specs for t in s.tensors}
    assert len(names) == 28_010  # no name is listed by two nodes
    assert names["thinker.model.embed_tokens.weight"].shape == (152064, 2048)
    assert names["thinker.model.layers.47.self_attn.q_proj.weight"].shape == (4096, 2048)
    assert names["thinker.model.layers.0.self_attn.k_proj.weight"].shape == (512, 2048)
    assert names["thinker.model.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert names["thinker.model.layers.0.mlp.gate.weight"].shape == (128, 2048)
    assert names["thinker.model.layers.0.mlp.experts.127.gate_proj.weight"].shape == (768, 2048)
    assert names["thinker.model.layers.0.mlp.experts.5.down_proj.weight"].shape == (2048, 768)
    assert names["thinker.model.layers.0.mlp.experts.5.down_proj.weight"].shard == "expert"
    assert names["thinker.audio_tower.conv_out.weight"].shape == (1280, 7680)
    assert names["thinker.visual.merger.mlp.0.weight"].shape == (4608, 4608)
    assert names["thinker.visual.merger_list.2.ln_q.weight"].shape == (4608,)
    assert names["talker.model.codec_embedding.weight"].shape == (3072, 1024)
    assert names["talker.text_projection.linear_fc1.weight"].shape == (2048, 2048)
    assert names["talker.hidden_projection.linear_fc2.weight"].shape == (1024, 2048)
    assert names["talker.model.layers.19.mlp.shared_expert_gate.weight"].shape == (1, 1024)
    assert names["talker.code_predictor.model.codec_embedding.14.weight"].shape == (2048, 1024)
    assert names["talker.code_predictor.lm_head.14.weight"].shape == (2048, 1024)
    assert names["code2wav.code_embedding.weight"].shape == (32768, 1024)
    assert names["code2wav.pre_transformer.layers.7.mlp_layer_scale.scale"].shape == (1024,)
    assert names["code2wav.upsample.1.1.gamma"].shape == (1024,)
    assert names["code2wav.decoder.1.block.1.conv.weight"].shape == (1536, 768, 16)
    assert names["code2wav.decoder.4.block.4.conv2.conv.weight"].shape == (96, 96, 1)
    assert names["code2wav.decoder.6.conv.weight"].shape == (1, 96, 7)


def test_kv_geometry_of_kv_nodes():
    expected = {("orpheus", "llm"): (28, 8, 128), ("vjepa2", "predictor"): (24, 16, 64),
                ("bagel", "llm"): (28, 4, 128), ("qwen3_omni", "thinker"): (48, 4, 128),
                ("qwen3_omni", "talker"): (20, 2, 128)}
    for model, nodes in CORPUS.items():
        for node in nodes:
            kv = build(model, node).kv
            if (model, node) in expected:
                assert kv is not None and (kv.layers, kv.kv_heads, kv.head_dim) == expected[model, node]
            else:
                assert kv is None, (model, node)  # encoders, codecs, VAEs are stateless


# ---- every spec is well formed -------------------------------------------------------------

@pytest.mark.parametrize("variant", ["real", "tiny"])
def test_specs_are_well_formed(variant):
    for model, nodes in CORPUS.items():
        for node in nodes:
            spec = build(model, node, variant, dtype="f32")
            assert len({t.name for t in spec.tensors}) == len(spec.tensors)
            assert all(t.dtype == "f32" and t.shard in SHARD_ROLES for t in spec.tensors)
            assert all(t.shape and all(isinstance(d, int) and d > 0 for d in t.shape) for t in spec.tensors)
            assert spec.bytes() == 4 * spec.param_count()
            assert spec.param_count() == sum(math.prod(t.shape) for t in spec.tensors)
            assert set(spec.dims) <= {"heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "layers",
                                      "experts", "moe_intermediate", "activation_elements"}


def test_tiny_variants_are_tiny():
    for model, nodes in CORPUS.items():
        size = sum(build(model, node, "tiny").param_count() for node in nodes)
        assert size < 12e6, (model, size)  # CPU tests: Orpheus keeps its 156,940-token vocab


# ---- argument errors ------------------------------------------------------------------------

def _error(arch: str, args: dict, dtype: str = "bf16") -> ArchError:
    with pytest.raises(ArchError) as info:
        get_arch(arch)(args, dtype)
    return info.value


@pytest.mark.parametrize("model,node", [(m, n) for m in CORPUS for n in CORPUS[m]])
def test_missing_and_unknown_arguments_are_named(model, node):
    arch, real, _ = CORPUS[model][node]
    first = next(iter(real))  # a required argument in every entry
    err = _error(arch, {k: v for k, v in real.items() if k != first})
    assert err.arg == first and f"'{first}'" in str(err)
    err = _error(arch, {**real, "hiden": 1})
    assert err.arg == "hiden" and "'hiden'" in str(err)


@pytest.mark.parametrize("value", ["28", 28.0, True, 0, -1, None, [28]])
def test_ill_typed_integer_argument(value):
    err = _error("llama", {**_ORPHEUS_LLM, "layers": value})
    assert err.arg == "layers" and "'layers'" in str(err)


def test_ill_typed_bool_and_list_arguments():
    assert _error("llama", {**_ORPHEUS_LLM, "tie_embeddings": 1}).arg == "tie_embeddings"
    assert _error("snac_decoder", {**_SNAC_24K, "decoder_rates": 8}).arg == "decoder_rates"
    assert _error("snac_decoder", {**_SNAC_24K, "vq_strides": [4, "2", 1]}).arg == "vq_strides"
    assert _error("snac_decoder", {**_SNAC_24K, "vq_strides": []}).arg == "vq_strides"
    assert _error("flux_vae_encoder", {**_FLUX, "ch_mult": [1, 2.5]}).arg == "ch_mult"


def test_inconsistent_arguments_blame_one_argument():
    assert _error("llama", {**_ORPHEUS_LLM, "kv_heads": 7}).arg == "kv_heads"  # 24 heads
    assert _error("vjepa2_vit", {**_VITG, "heads": 5}).arg == "heads"  # 1408 / 5
    assert _error("flux_vae_decoder", {**_FLUX, "ch": 48}).arg == "ch"  # GroupNorm(32)
    assert _error("snac_decoder", {**_SNAC_24K, "decoder_dim": 1000}).arg == "decoder_dim"  # 4 halvings
    assert _error("qwen3_omni_vision", {**_VISION, "deepstack": [8, 27]}).arg == "deepstack"
    assert _error("qwen3_omni_code2wav", {**_CODE2WAV, "decoder_dim": 1000}).arg == "decoder_dim"


def test_bad_weights_dtype():
    err = _error("llama", _ORPHEUS_LLM, dtype="i32")
    assert err.arg is None and "dtype" in str(err)


def test_registry_lookup():
    assert get_arch("llama") is REGISTRY["llama"]
    with pytest.raises(KeyError) as info:
        get_arch("lama")
    message = str(info.value)
    assert "lama" in message and all(name in message for name in REGISTRY)


# ---- the corpus -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grammar() -> lark.Lark:
    return lark.Lark(GRAMMAR.read_text(encoding="utf-8"), parser="lalr")


def _arch_lines(tree: lark.Tree) -> dict[str, tuple[str, set[str]]]:
    """node name -> (arch name, keyword names) for every node with an `arch` line."""
    out = {}
    for node in tree.find_data("node"):
        for arch in node.find_data("arch"):
            kwargs = {str(kw.children[0]) for kw in arch.find_data("kwarg")}
            out[str(node.children[0])] = (str(arch.children[0]), kwargs)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_walk_file_parses(grammar, model):
    tree = grammar.parse((ROOT / "models" / model / f"{model}.walk").read_text(encoding="utf-8"))
    assert str(next(tree.find_data("model")).children[0]) == model


@pytest.mark.parametrize("model", MODELS)
def test_corpus_arch_lines(grammar, model):
    """Each arch line names a registered arch with the arguments kept in CORPUS, and the
    arch accepts the real and the tiny values."""
    tree = grammar.parse((ROOT / "models" / model / f"{model}.walk").read_text(encoding="utf-8"))
    lines = _arch_lines(tree)
    assert set(lines) == set(CORPUS[model]), "CORPUS is out of step with the .walk file"
    for node, (arch, kwargs) in lines.items():
        name, real, tiny = CORPUS[model][node]
        assert arch == name and arch in REGISTRY
        assert kwargs == set(real), f"{model}.{node}: the arch line's arguments differ from CORPUS"
        assert set(tiny) <= kwargs
        for variant in ("real", "tiny"):
            assert build(model, node, variant).param_count() > 0


def test_corpus_compiles_with_the_front_end():
    """When the front end is present, lowering + verify accept every model at both sizes and
    compute the same parameter counts as CORPUS (so CORPUS mirrors the files' values)."""
    try:
        from mstarc.lower import lower
        from mstarc.parser import parse_file
        from mstarc.passes.verify import verify
    except ImportError:
        pytest.skip("the front end is not importable")
    for model in MODELS:
        path = ROOT / "models" / model / f"{model}.walk"
        for variant in ("real", "tiny"):
            ir = verify(lower(parse_file(path), variant, path.read_text(encoding="utf-8")))
            for node in CORPUS[model]:
                assert ir.nodes[node].arch.param_count() == build(model, node, variant).param_count(), \
                    (model, variant, node)


def test_snac_decoder_states_its_peak_activation_per_window():
    """With `window`, the arch states the peak activation elements of decoding one window, which
    the memory pass budgets per batch row: by hand for Orpheus' 28-code window (4 frames of 7
    codes = 16 latent steps; blocks 1024->512 x8, 512->256 x8, 256->128 x4, 128->64 x2)."""
    assert "activation_elements" not in get_arch("snac_decoder")(_SNAC_24K, "bf16").dims
    dims = get_arch("snac_decoder")({**_SNAC_24K, "window": 28}, "bf16").dims
    per_block = [1024 * 16 + 3 * 512 * 128, 512 * 128 + 3 * 256 * 1024, 256 * 1024 + 3 * 128 * 4096,
                 128 * 4096 + 3 * 64 * 8192]
    assert dims["activation_elements"] == max(per_block) == 2_097_152
    assert _error("snac_decoder", {**_SNAC_24K, "window": 30}).arg == "window"  # not whole frames of 7
