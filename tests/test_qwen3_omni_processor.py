"""Qwen3-Omni's Processor node (models/mstar_models/qwen3_omni/processor.py) against transformers 5.24's
`Qwen3OmniMoeProcessor` with a `WhisperFeatureExtractor`, a `Qwen2VLImageProcessorPil` and the
same tokenizer and chat template.

transformers' processor is built without its class check (it wants a video processor, which
needs torchvision, absent here; videos are not used). Tolerance: token ids, grids and pixel
values exactly equal; log-mel features within 1e-5 absolute (both take the same fp32 STFT;
the filter banks differ by ~1e-9, built in float64 by each side).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mstar_models.qwen3_omni.processor import (
    BUNDLED_TEMPLATE,
    BUNDLED_TOKENIZER,
    REAL_IDS,
    TINY_IDS,
    Processor,
    mel_filters,
    token_ids,
)
from mstar_runtime.ops.node import NodeError, RequestError
from mstar_runtime.plan.loader import Plan, load_plan

transformers = pytest.importorskip("transformers")
from support import compile_model  # noqa: E402
from transformers import PreTrainedTokenizerFast, WhisperFeatureExtractor  # noqa: E402
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor  # noqa: E402
from transformers.processing_utils import ProcessorMixin  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MEL_ATOL = 1e-5  # see the module docstring
EXTRA_TOKENS = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
                "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return load_plan(compile_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny.plan", "qwen3_omni"), device="cpu")


@pytest.fixture(scope="module")
def ours(plan: Plan) -> Processor:
    return Processor(plan.node_spec("proc", device="cpu"))


def hf_processor(tokenizer: Any, template: str, monkeypatch: pytest.MonkeyPatch, **image: Any) -> Any:
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                 chunk_length=300, return_attention_mask=True)
    ip = Qwen2VLImageProcessorPil(**{"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                                     "min_pixels": 3136, "max_pixels": 12845056, **image})
    proc = Qwen3OmniMoeProcessor(image_processor=ip, video_processor=None, feature_extractor=fe,
                                 tokenizer=tokenizer, chat_template=template)
    monkeypatch.undo()
    return proc


def bundled_hf_tokenizer() -> Any:
    return PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", extra_special_tokens=EXTRA_TOKENS)


def reference(proc: Any, ours: Processor, prompt: str, system: str, wave: np.ndarray | None,
              image: np.ndarray | None) -> dict[str, torch.Tensor]:
    text = proc.apply_chat_template(ours.messages(prompt, system, wave is not None, image is not None),
                                    tokenize=False, add_generation_prompt=True)
    out = proc(text=[text], images=None if image is None else [image], audio=None if wave is None else [wave],
               return_tensors="pt")
    return dict(out)


def entry(prompt: str, system: str, wave: np.ndarray | None, image: np.ndarray | None) -> dict[str, Any]:
    return {"prompt": prompt, "system": system,
            "audio": torch.zeros(0) if wave is None else torch.from_numpy(wave),
            "image": torch.zeros(0, dtype=torch.uint8) if image is None else torch.from_numpy(image)}


def check(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got["ids"].dtype == torch.int32
    assert got["ids"].tolist() == ref["input_ids"][0].tolist()
    if "input_features" in ref:
        frames = int(ref["feature_attention_mask"][0].sum())
        assert got["mel"].shape == (128, frames)
        torch.testing.assert_close(got["mel"], ref["input_features"][0, :, :frames], atol=MEL_ATOL, rtol=0)
    else:
        assert got["mel"].shape == (128, 0)
    if "pixel_values" in ref:
        assert torch.equal(got["pixels"], ref["pixel_values"].float())
        assert got["grid"].tolist() == ref["image_grid_thw"].tolist()
    else:
        assert got["pixels"].shape == (0, 1536) and got["grid"].shape == (0, 3)


# ----------------------------------------------------------------------------- parity
def test_build_batch_equals_transformers(ours: Processor, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = hf_processor(bundled_hf_tokenizer(), BUNDLED_TEMPLATE, monkeypatch)
    g = np.random.default_rng(0)
    wave = lambda seconds: (g.standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)  # noqa: E731
    image = lambda h, w: g.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noqa: E731
    cases = [
        ("Describe both, please.", "You are a helpful assistant.", wave(2.3), image(70, 90)),
        ("What is said here?", "", wave(0.41), None),  # < 1 s: one short chunk
        ("And here?", "", wave(12.345), None),  # 13 chunks, two attention windows
        ("What is this? Ünïcödé 你好 123", "", None, image(20, 30)),  # below min_pixels: upscaled
        ("A tall one.", "Be brief.", None, image(480, 64)),
        ("Just text, no media at all.", "System words.", None, None),
    ]
    got = ours.run("build", [entry(*c) for c in cases])
    for case, out in zip(cases, got, strict=True):
        check(out, reference(proc, ours, *case))


def test_a_conversation_with_a_clip_per_turn_equals_transformers(ours: Processor,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`history`: earlier turns rendered before the new one, each user turn's clip at the front of
    `audio`, in order; transformers takes the same messages and the clips as a list."""
    proc = hf_processor(bundled_hf_tokenizer(), BUNDLED_TEMPLATE, monkeypatch)
    g = np.random.default_rng(5)
    clips = [(g.standard_normal(int(16000 * s)) * 0.1).astype(np.float32) for s in (1.7, 0.6, 2.2)]
    history = [{"role": "user", "content": "", "audio": len(clips[0])},
               {"role": "assistant", "content": "A dog barks."},
               {"role": "user", "content": "And this one?", "audio": len(clips[1])},
               {"role": "assistant", "content": "Rain."}]
    e = entry("Last one.", "Be brief.", np.concatenate(clips), None) | {"history": json.dumps(history)}
    got = ours.run("build", [e])[0]
    messages = ours.messages("Last one.", "Be brief.", True, False, ours._history(e))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = proc(text=[text], audio=clips, return_tensors="pt")
    assert got["ids"].tolist() == ref["input_ids"][0].tolist()
    frames = ref["feature_attention_mask"].sum(dim=1).tolist()
    assert got["clips"].tolist() == frames and got["mel"].shape == (128, sum(frames))
    # each clip's features as transformers computes a clip alone: in a batch it pads the shorter
    # clips with zeros before its STFT, which changes their last frame (a batching artifact)
    for start, n, clip in zip(np.cumsum([0, *frames[:-1]]).tolist(), frames, clips, strict=True):
        alone = proc.feature_extractor(clip, sampling_rate=16000, padding=True, truncation=False,
                                       return_attention_mask=True, return_tensors="pt")
        torch.testing.assert_close(got["mel"][:, start:start + n], alone["input_features"][0, :, :n], atol=MEL_ATOL,
                                   rtol=0)
    # the turn before, as its own request, is a prefix of this one's ids up to its reply
    before = entry("And this one?", "Be brief.", np.concatenate(clips[:2]), None) | {
        "history": json.dumps(history[:2])}
    head = ours.run("build", [before])[0]["ids"].tolist()
    assert got["ids"].tolist()[:len(head)] == head


@pytest.mark.parametrize(("history", "audio"), [
    ("not json", 0), ('{"role": "user"}', 0), ('[{"role": "robot", "content": "x"}]', 0),
    ('[{"role": "assistant", "content": "x", "audio": 400}]', 400), ('[{"role": "user", "content": "x", "audio": 900}]', 400),
    ('[{"role": "user", "content": "x", "audio": 100}]', 400), ('[{"role": "user", "content": "x", "colour": 1}]', 0),
])
def test_bad_history_is_a_request_error(ours: Processor, history: str, audio: int) -> None:
    e = {"prompt": "hi", "system": "", "audio": torch.full((audio,), 0.1), "image": torch.zeros(0, dtype=torch.uint8),
         "history": history}
    with pytest.raises(RequestError) as err:
        ours.run("build", [e])
    assert err.value.field == "history"


def test_detokenize_drops_every_added_token(ours: Processor, tmp_path: Path) -> None:
    """Qwen's tokenizer marks `<tool_call>`, `<|fim_pad|>`, `<|repo_name|>`, `<think>`, ... non-special;
    the reply's text drops them as it drops `<|im_end|>`, whole and streamed, with the bundled
    tokenizer and with a checkpoint's own `tokenizer.json`; encoding a prompt is unchanged."""
    text = "Hi wörld"
    plain = ["<tool_call>", "<|fim_pad|>", "<|repo_name|>", "<think>", "<tool_response>"]
    for node in (ours, _with_checkpoint_tokenizer(ours, tmp_path)):
        ids = [node.tokenizer.token_to_id(t) for t in plain]
        body = node.tokenizer.encode(text, add_special_tokens=False).ids
        seq = [ids[0], *body[:3], *ids[1:3], *body[3:], *ids[3:], TINY_IDS.im_end]
        assert node.run("detokenize", [{"token": torch.tensor(seq, dtype=torch.int32)}])[0]["piece"] == text
        streamed = [{"token": torch.tensor(seq[max(0, i - 4): i + 1], dtype=torch.int32), "token:context": min(i, 4)}
                    for i in range(len(seq))]
        assert "".join(o["piece"] for o in node.run("detokenize", streamed)) == text
    assert ours.tokenizer.encode("a<|fim_pad|>b").ids == bundled_hf_tokenizer()("a<|fim_pad|>b")["input_ids"]


def _with_checkpoint_tokenizer(ours: Processor, folder: Path) -> Processor:
    node = Processor(ours.spec)
    (folder / "tokenizer.json").write_text(BUNDLED_TOKENIZER.read_text(encoding="utf-8"), encoding="utf-8")
    node.on_weights(str(folder))
    return node


def test_mel_filters_equal_transformers() -> None:
    from transformers.audio_utils import mel_filter_bank

    for n_mels in (80, 128):
        ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
                              sampling_rate=16000, norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(mel_filters(400, n_mels, 16000).numpy(), ref, atol=1e-8, rtol=0)


def test_detokenize_skips_special_tokens(ours: Processor) -> None:
    text = "Hello there, wörld! 你好"
    ids = [TINY_IDS.im_start, TINY_IDS.assistant, *ours.tokenizer.encode(text, add_special_tokens=False).ids,
           TINY_IDS.im_end]
    out = ours.run("detokenize", [{"token": torch.tensor(ids, dtype=torch.int32)},
                                  {"token": torch.tensor([TINY_IDS.im_end], dtype=torch.int32)}])
    assert out == [{"piece": "assistant" + text}, {"piece": ""}]
    with pytest.raises(RequestError):
        ours.run("detokenize", [{"token": torch.tensor([512])}])


def test_node_holds_no_tensors(ours: Processor) -> None:
    # the server copies the prompt node to count tokens and render text only when it holds none
    assert not list(ours.parameters()) and not list(ours.buffers())


# ------------------------------------------------------------------------- token ids
def test_token_id_tables() -> None:
    assert token_ids(152064) == REAL_IDS and token_ids(512) == TINY_IDS
    assert (REAL_IDS.im_start, REAL_IDS.image, REAL_IDS.audio, REAL_IDS.tts_bos, REAL_IDS.user) == (
        151644, 151655, 151675, 151672, 872)
    tok = bundled_hf_tokenizer()
    for name, real in REAL_IDS.__dict__.items():
        tiny = getattr(TINY_IDS, name)
        assert tiny < 512 and (tiny == real - 151164 if real > 151000 else True)
    assert [tok.convert_tokens_to_ids(t) for t in ("system", "user", "assistant")] == [
        TINY_IDS.system, TINY_IDS.user, TINY_IDS.assistant]
    with pytest.raises(ValueError):
        token_ids(256)


def test_real_vocab_relabels_the_bundled_tokenizer(plan: Plan, ours: Processor) -> None:
    spec = plan.node_spec("proc", device="cpu")
    real = Processor(dataclasses.replace(spec, config={**spec.config, "vocab": 152064}))
    e = entry("Hi there", "Sys", np.zeros(4000, dtype=np.float32), None)
    tiny_ids = ours.run("build", [e])[0]["ids"].tolist()
    real_ids = real.run("build", [e])[0]["ids"].tolist()
    relabel = {getattr(TINY_IDS, k): v for k, v in REAL_IDS.__dict__.items()}
    assert real_ids == [relabel.get(t, t) for t in tiny_ids]
    assert real_ids[:2] == [151644, 8948] and real_ids.count(151675) == 4  # 25 frames -> 4 tokens


# --------------------------------------------------------------------- checkpoint files
def _write_qwen2_files(folder: Path) -> None:
    """vocab.json + merges.txt + tokenizer_config.json of the bundled tokenizer, as a checkpoint ships them."""
    spec = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    added = {t["content"]: t for t in spec["added_tokens"]}
    vocab = {k: v for k, v in spec["model"]["vocab"].items() if k not in added}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = {"added_tokens_decoder": {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                         "single_word", "special")}
                                       for t in spec["added_tokens"]},
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "bos_token": None,
              "extra_special_tokens": EXTRA_TOKENS, "tokenizer_class": "Qwen2Tokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def test_checkpoint_files_are_used(plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_qwen2_files(tmp_path)
    template = "{{- '<|endoftext|>' }}" + BUNDLED_TEMPLATE  # a visibly different template
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    image_cfg = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 6, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5]}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**image_cfg, "feature_size": 128}),
                                                       encoding="utf-8")
    node = Processor(plan.node_spec("proc", device="cpu"))
    node.on_weights(str(tmp_path))
    hf_tok = Qwen2Tokenizer.from_pretrained(str(tmp_path))
    text = "Qwen2's regex: don't SPLIT 12345 wörds\n\n  like   this; 你好!"
    assert node.tokenizer.encode(text, add_special_tokens=False).ids == hf_tok.encode(text)
    proc = hf_processor(hf_tok, template, monkeypatch, **image_cfg)
    g = np.random.default_rng(1)
    case = ("Look.", "", None, g.integers(0, 256, (200, 300, 3), dtype=np.uint8))
    got = node.run("build", [entry(*case)])[0]
    check(got, reference(proc, node, *case))
    assert got["ids"][0] == TINY_IDS.endoftext and got["grid"].tolist() == [[1, 4, 6]]


def test_a_checkpoint_tokenizer_with_other_ids_is_refused(plan: Plan, tmp_path: Path) -> None:
    spec = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    spec["model"]["vocab"]["user"], spec["model"]["vocab"]["Ġth"] = spec["model"]["vocab"]["Ġth"], TINY_IDS.user
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    node = Processor(plan.node_spec("proc", device="cpu"))
    with pytest.raises(NodeError, match="'user'"):
        node.on_weights(str(tmp_path))


# ------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"audio": torch.zeros(4000, dtype=torch.int16)}, "audio"),
        ({"audio": torch.zeros(2, 4000)}, "audio"),
        ({"audio": torch.zeros(150)}, "audio"),  # shorter than the STFT's reflection
        ({"audio": torch.full((4000,), float("nan"))}, "audio"),
        ({"image": torch.zeros(32, 32, 3)}, "image"),  # floats
        ({"image": torch.zeros(32, 32, 4, dtype=torch.uint8)}, "image"),  # RGBA
        ({"image": torch.zeros(2, 900, 3, dtype=torch.uint8)}, "image"),  # aspect ratio 450
        ({"prompt": "look: <|image_pad|>"}, "prompt"),  # a placeholder in the text
        ({"prompt": "   "}, "prompt"),  # nothing to answer
        ({"prompt": 3}, "prompt"),
    ],
)
def test_bad_inputs_are_request_errors(ours: Processor, values: dict[str, Any], field: str) -> None:
    e = {"prompt": "hi", "system": "", "audio": torch.zeros(0), "image": torch.zeros(0, dtype=torch.uint8), **values}
    with pytest.raises(RequestError) as err:
        ours.run("build", [e])
    assert err.value.field == field


def test_config_token_ids_relabel_the_bundled_tokenizer(plan: Plan, ours: Processor) -> None:
    # the thinker's config names (mstar_models.qwen3_omni.tokens); 500 is <|file_sep|>'s and 7 a byte's: they swap
    spec = plan.node_spec("proc", device="cpu")
    node = Processor(dataclasses.replace(spec, config={**spec.config, "audio_token_id": 500, "user_token_id": 7}))
    assert (node.ids.audio, node.ids.user) == (500, 7)
    e = entry("Hi there", "", np.zeros(4000, dtype=np.float32), None)
    base, moved = ours.run("build", [e])[0]["ids"].tolist(), node.run("build", [e])[0]["ids"].tolist()
    swap = {TINY_IDS.audio: 500, TINY_IDS.user: 7}
    assert moved == [swap.get(t, t) for t in base] and moved.count(500) == 4
    assert node.run("detokenize", [{"token": torch.tensor(moved)}])[0]["piece"] == "user\nHi there\nassistant\n"
    with pytest.raises(NodeError, match="distinct"):
        Processor(dataclasses.replace(spec, config={**spec.config, "audio_token_id": TINY_IDS.image}))
