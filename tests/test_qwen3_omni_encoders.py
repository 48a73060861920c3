"""Qwen3-Omni's audio and vision encoder nodes (models/mstar_models/qwen3_omni/{audio,vision}_encoder.py)
against transformers 5.24's `Qwen3OmniMoeAudioEncoder` and `Qwen3OmniMoeVisionEncoder`.

The reference is a whole tiny `Qwen3OmniMoeForConditionalGeneration` whose audio and vision
sizes equal the walk's tiny variant; its encoder weights are spread (std 0.2, so attention is
far from uniform and a wrong window, position or mask shows), then `save_pretrained` writes
the checkpoint (its own names: `thinker.audio_tower.*`, `thinker.visual.*`) and our loader
reads our nodes from that folder. Both sides run fp32; they differ in summation order only
(padded SDPA over segments vs one call per segment, the patch conv as a matmul). Tolerance:
1e-5 relative to the largest output magnitude (measured: ~1e-6).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mstar_models.qwen3_omni.audio_encoder import AudioEncoder, encoded_length
from mstar_models.qwen3_omni.vision_encoder import VisionEncoder
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.weights import load_weights

transformers = pytest.importorskip("transformers")
from support import compile_model, cuda_fp32, saved_checkpoint  # noqa: E402
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5  # of the largest output magnitude; see the module docstring
pytestmark = pytest.mark.usefixtures("one_thread")

_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True}
# the walk's tiny variant (models/qwen3_omni/qwen3_omni.walk) in transformers' config names
TINY_AUDIO = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
              "d_model": 32, "output_dim": 64, "downsample_hidden_size": 8}
TINY_VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 16,
               "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
               "deepstack_visual_indexes": [0, 1], "out_hidden_size": 64}


def tiny_config() -> Any:
    text = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "rope_parameters": _MROPE}
    talker_text = {"vocab_size": 3072, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
                   "rope_parameters": _MROPE}
    predictor = {"vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_code_groups": 4}
    return hf_config.Qwen3OmniMoeConfig(
        thinker_config={"text_config": text, "audio_config": TINY_AUDIO, "vision_config": TINY_VISION},
        talker_config={"text_config": talker_text, "code_predictor_config": predictor, "num_code_groups": 4,
                       "thinker_hidden_size": 64, "accept_hidden_layer": 1, "spatial_merge_size": 2},
        code2wav_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "num_key_value_heads": 2, "intermediate_size": 64, "decoder_dim": 64,
                         "num_quantizers": 4, "codebook_size": 2048},
    )


@pytest.fixture(scope="module")
def hf() -> Any:
    torch.manual_seed(0)
    model = hf_model.Qwen3OmniMoeForConditionalGeneration(tiny_config()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.thinker.named_parameters():
            if "audio_tower" in name or "visual" in name:
                gain = 1.0 if ("norm" in name or "ln_" in name) and name.endswith("weight") else 0.0
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05) + gain)
    return model


@pytest.fixture(scope="module")
def checkpoint(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_checkpoint(hf, tmp_path_factory, "qwen3_omni_ckpt")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return load_plan(compile_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny.plan", "qwen3_omni"), device="cpu")


@pytest.fixture(scope="module")
def audio(plan: Plan, checkpoint: Path) -> AudioEncoder:
    node = AudioEncoder(plan.node_spec("audio_enc", device="cpu")).eval()
    load_weights(node, plan, "audio_enc", checkpoint)
    return node


@pytest.fixture(scope="module")
def vision(plan: Plan, checkpoint: Path) -> VisionEncoder:
    node = VisionEncoder(plan.node_spec("vision_enc", device="cpu")).eval()
    load_weights(node, plan, "vision_enc", checkpoint)
    return node


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=RTOL * float(ref.abs().max()), rtol=RTOL)


def hf_audio_tower(hf: Any) -> Any:
    return getattr(hf.thinker, "audio_tower", None) or hf.thinker.model.audio_tower


def hf_visual(hf: Any) -> Any:
    return getattr(hf.thinker, "visual", None) or hf.thinker.model.visual


# ------------------------------------------------------------------------------ audio
def test_audio_batch_equals_transformers_per_request(audio: AudioEncoder, hf: Any) -> None:
    g = torch.Generator().manual_seed(2)
    # one short chunk alone (no padding in HF), exactly one chunk, a padded tail chunk,
    # 10 chunks = 130 tokens = two attention windows (104 + 26), and no audio at all
    frames = (37, 100, 250, 1000, 0)
    mels = [torch.randn(128, f, generator=g) for f in frames]
    with torch.no_grad():
        out = audio.run("encode", [{"mel": m} for m in mels])
        tower = hf_audio_tower(hf)
        for f, m, o in zip(frames, mels, out, strict=True):
            assert o["embeds"].shape == (encoded_length(f), 64)
            if f:
                ref = tower(input_features=m, feature_lens=torch.tensor([f])).last_hidden_state
                assert_close(o["embeds"], ref)


def test_clips_of_one_request_equal_transformers_feature_lens(audio: AudioEncoder, hf: Any) -> None:
    """A conversation's clips in one mel (`clips`: frames each) are encoded apart, as transformers'
    tower encodes the audios of `feature_lens`, and their rows joined in order."""
    g = torch.Generator().manual_seed(4)
    frames = [250, 37, 1000]
    mel = torch.randn(128, sum(frames), generator=g)
    with torch.no_grad():
        got = audio.run("encode", [{"mel": mel, "clips": torch.tensor(frames, dtype=torch.int32)},
                                   {"mel": mel[:, :250], "clips": torch.zeros(0, dtype=torch.int32)}])
        ref = hf_audio_tower(hf)(input_features=mel, feature_lens=torch.tensor(frames)).last_hidden_state
    assert got[0]["embeds"].shape == (sum(encoded_length(f) for f in frames), 64)
    assert_close(got[0]["embeds"], ref)
    # a clip of over 100 frames gives the rows it gives alone (what lets a later turn's prefix hit)
    assert torch.equal(got[0]["embeds"][:encoded_length(250)], got[1]["embeds"])
    with pytest.raises(RequestError) as err:
        audio.run("encode", [{"mel": mel, "clips": torch.tensor([5, 5], dtype=torch.int32)}])
    assert err.value.field == "mel"


def test_audio_token_counts_match_transformers() -> None:
    lengths = torch.tensor([1, 7, 99, 100, 101, 199, 200, 1234, 30000])
    ref = hf_model._get_feat_extract_output_lengths(lengths)
    assert [encoded_length(int(n)) for n in lengths] == ref.tolist()


@pytest.mark.parametrize(
    "mel",
    [torch.zeros(64, 10), torch.zeros(128, 10, dtype=torch.int32), torch.zeros(128), torch.full((128, 5), float("nan"))],
)
def test_bad_mel_is_a_request_error(audio: AudioEncoder, mel: torch.Tensor) -> None:
    with pytest.raises(RequestError) as err:
        audio.run("encode", [{"mel": mel}])
    assert err.value.field == "mel"


# ----------------------------------------------------------------------------- vision
def test_vision_batch_equals_transformers(vision: VisionEncoder, hf: Any) -> None:
    g = torch.Generator().manual_seed(3)
    # grids smaller and larger than the 8 x 8 position table (bilinear down- and up-sampling),
    # non-square, a two-frame clip (two attention segments) and the smallest image
    grids = [[1, 4, 6], [1, 12, 10], [2, 4, 4], [1, 2, 2]]
    pixels = [torch.randn(t * h * w, 1536, generator=g) for t, h, w in grids]
    with torch.no_grad():
        ref = hf_visual(hf)(torch.cat(pixels), grid_thw=torch.tensor(grids))
        out = vision.run("encode", [
            {"pixels": torch.cat(pixels[:2]), "grid": torch.tensor(grids[:2], dtype=torch.int32)},
            {"pixels": torch.zeros(0, 1536), "grid": torch.zeros(0, 3, dtype=torch.int32)},
            {"pixels": torch.cat(pixels[2:]), "grid": torch.tensor(grids[2:], dtype=torch.int32)},
        ])
    assert out[1]["embeds"].shape == (0, 64) and out[1]["deepstack"].shape == (2, 0, 64)
    assert [o["embeds"].shape[0] for o in out] == [(24 + 120) // 4, 0, (32 + 4) // 4]
    assert_close(torch.cat([o["embeds"] for o in out]), ref.pooler_output)
    assert_close(torch.cat([o["deepstack"] for o in out], dim=1), torch.stack(ref.deepstack_features))


def test_vision_request_alone_equals_batched(vision: VisionEncoder) -> None:
    g = torch.Generator().manual_seed(4)
    entries = [{"pixels": torch.randn(t * h * w, 1536, generator=g), "grid": torch.tensor([[t, h, w]])}
               for t, h, w in ((1, 6, 8), (1, 4, 4))]
    with torch.no_grad():
        both = vision.run("encode", entries)
        alone = vision.run("encode", entries[1:])
    assert_close(both[1]["embeds"], alone[0]["embeds"])


@pytest.mark.parametrize(
    ("pixels", "grid", "field"),
    [
        (torch.zeros(16, 1536), torch.tensor([[1, 4, 3]]), "grid"),  # odd width: no 2x2 merge
        (torch.zeros(16, 1536), torch.tensor([[1.0, 4.0, 4.0]]), "grid"),  # float grid
        (torch.zeros(15, 1536), torch.tensor([[1, 4, 4]]), "pixels"),  # patch count != grid
        (torch.zeros(16, 768), torch.tensor([[1, 4, 4]]), "pixels"),  # wrong patch width
    ],
)
def test_bad_vision_inputs_are_request_errors(vision: VisionEncoder, pixels: torch.Tensor, grid: torch.Tensor,
                                              field: str) -> None:
    with pytest.raises(RequestError) as err:
        vision.run("encode", [{"pixels": pixels, "grid": grid}])
    assert err.value.field == field


# --------------------------------------------------------------------- GPU, real size
@pytest.mark.gpu
def test_real_size_encoders_equal_transformers_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The released audio / vision sizes (docs/models/qwen3_omni.md, Facts) on the GPU: fp32 parity (TF32 off) with
    transformers' default init, and the bf16 node close to the fp32 reference."""
    dev = cuda_fp32()
    plan = load_plan(compile_model(tmp_path_factory.mktemp("qwen3_omni_real") / "real.plan", "qwen3_omni",
                                   "placements/h200x1.yaml", variant="real"))
    g = torch.Generator().manual_seed(0)
    audio_cfg = hf_config.Qwen3OmniMoeAudioEncoderConfig(output_dim=2048)
    vision_cfg = hf_config.Qwen3OmniMoeVisionEncoderConfig(out_hidden_size=2048)
    with torch.device(dev):
        torch.manual_seed(0)
        tower = hf_model.Qwen3OmniMoeAudioEncoder(audio_cfg).eval()
        visual = hf_model.Qwen3OmniMoeVisionEncoder(vision_cfg).eval()
    mels = [torch.randn(128, f, generator=g) for f in (1234, 37)]
    grids = [[1, 28, 36], [1, 8, 8]]
    pixels = [torch.randn(t * h * w, 1536, generator=g) for t, h, w in grids]
    for dtype, rtol in ((torch.float32, 1e-4), (torch.bfloat16, None)):
        aud = AudioEncoder(dataclasses.replace(plan.node_spec("audio_enc", device=dev), dtype=dtype)).eval()
        aud.load_state_dict(tower.state_dict())
        vis = VisionEncoder(dataclasses.replace(plan.node_spec("vision_enc", device=dev), dtype=dtype)).eval()
        vis.load_state_dict(visual.state_dict())
        with torch.no_grad():
            got_a = aud.run("encode", [{"mel": m.to(dev)} for m in mels])
            got_v = vis.run("encode", [{"pixels": p.to(dev), "grid": torch.tensor([gr])} for p, gr in
                                       zip(pixels, grids, strict=True)])
            for m, o in zip(mels, got_a, strict=True):
                ref = tower(input_features=m.to(dev), feature_lens=torch.tensor([m.shape[1]], device=dev))
                _close(o["embeds"], ref.last_hidden_state, rtol)
            ref_v = visual(torch.cat(pixels).to(dev), grid_thw=torch.tensor(grids, device=dev))
            _close(torch.cat([o["embeds"] for o in got_v]), ref_v.pooler_output, rtol)
            _close(torch.cat([o["deepstack"] for o in got_v], dim=1), torch.stack(ref_v.deepstack_features), rtol)


def _close(got: torch.Tensor, ref: torch.Tensor, rtol: float | None) -> None:
    if rtol is not None:
        torch.testing.assert_close(got, ref, atol=rtol * float(ref.abs().max()), rtol=rtol)
    else:  # bf16 against fp32: the same direction, per token
        cos = F.cosine_similarity(got.float(), ref.float(), dim=-1)
        assert float(cos.min()) > 0.99, float(cos.min())
