"""Whisper (models/whisper) against transformers on CPU: a tiny random config on the same weights.

- the log-mel features within 1e-5 of `WhisperFeatureExtractor` (exact in practice);
- the catalogue's tensors are `WhisperForConditionalGeneration`'s at the real size (names,
  shapes, 1,543,490,560 parameters);
- the encoder output and the decoder's logits within 1e-5 of transformers' forward;
- greedy tokens through the plan (`transcribe` / `translate` walks on the runtime) equal to
  transformers' `generate` on up to 30 s: timestamps on and off, a given language and a
  detected one, translate, a prompt (long audio: tests/test_whisper_longform.py);
- bad input is a RequestError naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support import as_run

from mstar_models.whisper.decoder import Decoder
from mstar_models.whisper.encoder import Encoder
from mstar_models.whisper.features import N_SAMPLES, log_mel, mel_filters
from mstar_models.whisper.tokens import LANGUAGE_CODES, LANGUAGE_NAMES, Layout, byte_tokenizer
from mstar_runtime.api import MStar, RequestFailed
from mstar_runtime.ops.node import AttentionContext, SeqState
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.weights import build_node, load_weights
from mstarc.archs.whisper import whisper_decoder, whisper_encoder
from mstarc.cli import main as mstarc

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
WALK = ROOT / "models/whisper/whisper.walk"
LAYOUT = Layout(eot=50257, sot=50258, languages=100, vocab=51866)
# whisper-large-v3's generation_config.json (the walk's real variant holds the same lists)
SUPPRESS = [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93, 359, 503, 522,
            542, 873, 893, 902, 918, 922, 931, 1350, 1853, 1982, 2460, 2627, 3246, 3253, 3268, 3536, 3846, 3961,
            4183, 4667, 6585, 6647, 7273, 9061, 9383, 10428, 10929, 11938, 12033, 12331, 12562, 13793, 14157,
            14635, 15265, 15618, 16553, 16604, 18362, 18956, 20075, 21675, 22520, 26130, 26161, 26435, 28279,
            29464, 31650, 32302, 32470, 36865, 42863, 47425, 49870, 50254, 50258, 50359, 50360, 50361, 50362, 50363]


def _tiny_config() -> transformers.WhisperConfig:
    # the walk's tiny variant
    return transformers.WhisperConfig(
        vocab_size=51866, num_mel_bins=80, encoder_layers=2, decoder_layers=2, d_model=64,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, pad_token_id=50257, bos_token_id=50257,
        eos_token_id=50257, decoder_start_token_id=50258)


def _generation_config() -> transformers.GenerationConfig:
    return transformers.GenerationConfig(
        decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50257, bos_token_id=50257,
        no_timestamps_token_id=50364, prev_sot_token_id=LAYOUT.startofprev, suppress_tokens=SUPPRESS, begin_suppress_tokens=[220, 50257],
        max_initial_timestamp_index=50, is_multilingual=True, max_length=448,
        lang_to_id={f"<|{c}|>": LAYOUT.first_language + i for i, c in enumerate(LANGUAGE_CODES)},
        task_to_id={"translate": LAYOUT.translate, "transcribe": LAYOUT.transcribe})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.WhisperForConditionalGeneration, Path]:
    """transformers' model of the tiny config, every weight but the sinusoids perturbed (so norms
    and biases are not 1 and 0), saved as the checkpoint our plan loads."""
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(_tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "model.encoder.embed_positions.weight":
                p.add_(torch.randn_like(p) * 0.05)
    model.generation_config = _generation_config()
    folder = tmp_path_factory.mktemp("whisper-ck")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whisper") / "whisper-tiny.plan"
    assert mstarc(["compile", str(WALK), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(out)]) == 0
    return out


def _audio(seconds: float, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * (1 + np.sin(2 * np.pi * 0.5 * t))
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


# ------------------------------------------------------------------------------ features
@pytest.mark.parametrize("mels", [80, 128])
@pytest.mark.parametrize("seconds", [0.07, 5.0, 30.0])
def test_log_mel_matches_the_feature_extractor(mels: int, seconds: float) -> None:
    fe = transformers.WhisperFeatureExtractor(feature_size=mels)
    audio = _audio(seconds)
    ref = fe(audio, sampling_rate=16000, return_tensors="np").input_features[0]
    padded = torch.nn.functional.pad(torch.from_numpy(audio), (0, N_SAMPLES - audio.size))
    ours = log_mel(padded[None], torch.from_numpy(mel_filters(mels)).float(), torch.hann_window(400))[0]
    assert ours.shape == (mels, 3000)
    assert np.abs(ours.numpy() - ref).max() <= 1e-5
    assert np.abs(mel_filters(mels) - fe.mel_filters).max() <= 1e-12


# ------------------------------------------------------------------------------ catalogue
def test_catalogue_is_transformers_large_v3() -> None:
    cfg = transformers.WhisperConfig(vocab_size=51866, num_mel_bins=128, encoder_layers=32, decoder_layers=32,
                                     d_model=1280, encoder_attention_heads=20, decoder_attention_heads=20,
                                     encoder_ffn_dim=5120, decoder_ffn_dim=5120)
    with torch.device("meta"):
        model = transformers.WhisperForConditionalGeneration(cfg)
    enc = whisper_encoder(dict(layers=32, hidden=1280, heads=20, intermediate=5120, mels=128,
                               source_positions=1500), "bf16")
    dec = whisper_decoder(dict(layers=32, hidden=1280, heads=20, intermediate=5120, vocab=51866,
                               target_positions=448), "bf16")
    ours = {t.name: tuple(t.shape) for t in (*enc.tensors, *dec.tensors)}
    # proj_out is tied to the decoder's embedding: the checkpoint does not store it
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "proj_out.weight"}
    assert ours == theirs
    assert enc.param_count() + dec.param_count() == model.num_parameters() == 1_543_490_560
    assert dec.kv is not None and (dec.kv.layers, dec.kv.kv_heads, dec.kv.head_dim) == (32, 20, 64)


# ------------------------------------------------------------------------------ logits
def _context(q_len: int, cross: list[tuple[torch.Tensor, torch.Tensor]]) -> AttentionContext:
    """One entry's attention over plain tensors: causal self-attention over the prompt, and
    cross-attention over keys and values the test computed from the encoder states."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True)
        return o.transpose(0, 1)

    def read(layer: int, q: torch.Tensor, k: object, v: object, over: tuple[int, ...]) -> torch.Tensor:
        ck, cv = cross[layer]
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), ck.transpose(0, 1),
                                                             cv.transpose(0, 1))
        return o.transpose(0, 1)

    seq = SeqState(start=0, q_len=q_len, state={}, read_lens=(cross[0][0].shape[0],))
    return AttentionContext(seqs=[seq], attend_fn=attend, device=torch.device("cpu"), reads=("decoder@cross",),
                            read_fn=read)


def test_encoder_and_decoder_logits_match_transformers(reference: tuple, plan: Path) -> None:
    model, folder = reference
    p = load_plan(plan)
    enc, dec = build_node(p, "encoder", 0, "cpu"), build_node(p, "decoder", 0, "cpu")
    load_weights(enc, p, "encoder", folder)
    load_weights(dec, p, "decoder", folder)
    assert isinstance(enc, Encoder) and isinstance(dec, Decoder)
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    feats = fe(_audio(4.0), sampling_rate=16000, return_tensors="pt").input_features
    prompt = torch.tensor([LAYOUT.sot, LAYOUT.language_token("fr"), LAYOUT.transcribe, LAYOUT.timestamp_begin,
                           220, 1000, 30000, LAYOUT.timestamp_begin + 7])
    with torch.no_grad():
        ref = model(input_features=feats, decoder_input_ids=prompt[None], output_hidden_states=True)
        states = enc(feats)
        cross = [layer.encoder_attn.kv(states[0]) for layer in dec.layers]
        ctx = _context(prompt.numel(), cross)
        hidden = dec.forward_hidden(prompt, torch.arange(prompt.numel()), ctx.attend, ctx.attend_to)
        logits = dec.logits(hidden)
    assert (states - ref.encoder_last_hidden_state).abs().max() <= 1e-5
    assert (logits - ref.logits[0]).abs().max() <= 1e-5


# ------------------------------------------------------------------------------ greedy tokens
CASES = {
    "timestamps, language given": (dict(language="de", task="transcribe", return_timestamps=True),
                                   dict(language="de", timestamps=True)),
    "translate, no timestamps": (dict(language="en", task="translate"), dict(language="english")),
    "language detected, timestamps": (dict(task="transcribe", return_timestamps=True), dict(timestamps=True)),
    "language detected, no timestamps": (dict(task="transcribe"), dict()),
    "prompt": (dict(language="it", task="transcribe", prompt=" Ciao a tutti"), dict(language="it",
                                                                                  prompt="Ciao a tutti")),
    "min tokens, timestamps": (dict(language="en", task="transcribe", return_timestamps=True, min_new_tokens=50),
                               dict(language="en", timestamps=True, min_tokens=50)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(reference: tuple, plan: Path, case: str) -> None:
    model, folder = reference
    hf_kw, ours_kw = CASES[case]
    audio = _audio(6.0, seed=len(case))
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    feats = fe(audio, sampling_rate=16000, return_tensors="pt").input_features
    hf_kw = dict(hf_kw)
    if "prompt" in hf_kw:  # the same ids our tokenizer gives (the bundled byte-level one)
        ids = byte_tokenizer(LAYOUT).encode(hf_kw.pop("prompt"), add_special_tokens=False).ids
        hf_kw["prompt_ids"] = torch.tensor([LAYOUT.startofprev, *ids])
    walk = "translate" if hf_kw.get("task") == "translate" else "transcribe"
    with torch.no_grad():
        hf = model.generate(feats, max_new_tokens=60, **hf_kw)[0].tolist()
        lang = model.detect_language(feats)[0].item() if "language" not in hf_kw else None
    with MStar.load(plan, weights=folder) as m:
        out = m.submit(walk, {"audio": torch.from_numpy(audio), "max_tokens": 60, **ours_kw}).result()
    tokens = out["tokens"].tolist()
    # transformers' output: the segments' tokens, as ours (<|endoftext|> and the prompt dropped)
    assert tokens == hf
    if lang is not None:
        assert out["language"] == LANGUAGE_NAMES[LAYOUT.language_of(lang)]
    if hf_kw.get("return_timestamps"):
        assert any(t >= LAYOUT.timestamp_begin for t in tokens)  # the timestamp rules were exercised


def test_batched_requests_equal_each_alone(reference: tuple, plan: Path) -> None:
    _, folder = reference
    audios = [torch.from_numpy(_audio(s, seed=i)) for i, s in enumerate((2.0, 9.0, 15.5))]
    with MStar.load(plan, weights=folder) as m:
        alone = [m.submit("transcribe", {"audio": a, "max_tokens": 30, "timestamps": True}).result()["tokens"]
                 for a in audios]
        hs = [m.submit("transcribe", {"audio": a, "max_tokens": 30, "timestamps": True}) for a in audios]
        together = [h.result()["tokens"] for h in hs]
    for a, b in zip(alone, together, strict=True):
        assert a.tolist() == b.tolist()


def test_the_decode_loop_runs_on_the_cohort_as_on_the_generic_path(reference: tuple, plan: Path) -> None:
    """The decode loop (a step that reads @cross, accumulating its tokens and log-probs) runs as
    a decode cohort: batched requests with timestamps, a sampled one and a long-form one with
    the temperature fallback give the generic path's outputs (the plan without its cohort
    marks) bit for bit."""
    _, folder = reference
    requests = [{"audio": torch.from_numpy(_audio(9.0, seed=3)), "max_tokens": 30, "timestamps": True},
                {"audio": torch.from_numpy(_audio(4.0, seed=4)), "max_tokens": 20, "temperature": 0.7, "seed": 5},
                {"audio": torch.from_numpy(_audio(40.0, seed=6)), "max_tokens": 24, "timestamps": True,
                 "fallback_temperatures": torch.tensor([0.2, 0.4]), "compression_ratio_threshold": 1.2,
                 "logprob_threshold": -0.5, "condition_on_prev_tokens": True}]
    outs = {}
    for path in ("cohort", "generic"):
        with MStar.from_plan(as_run(load_plan(plan), path), weights=folder) as m:
            hs = [m.submit("transcribe", r) for r in requests]
            outs[path] = [h.result() for h in hs]
            steps = m.stats()["cohort_steps"]
        assert (steps > 0) == (path == "cohort")
    for c, g in zip(outs["cohort"], outs["generic"], strict=True):
        assert c["tokens"].tolist() == g["tokens"].tolist()
        # the segments' statistics to float32 rounding: the cohort attends with
        # `decode_attention`, the generic step with `paged_attention`
        cs, gs = json.loads(c["segments"]), json.loads(g["segments"])
        assert len(cs) == len(gs) > 0
        for a, b in zip(cs, gs, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) if isinstance(a[k], float) else a[k] == b[k], k


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("inputs", "field"), [
    ({"audio": torch.zeros(0)}, "audio"),
    ({"audio": torch.zeros(1800 * 16000 + 1)}, "audio"),  # over max_audio_seconds
    ({"audio": torch.zeros(N_SAMPLES + 160)}, "timestamps"),  # windows seek from timestamps
    ({"audio": torch.zeros(1600), "no_speech_threshold": 0.6}, "no_speech_threshold"),  # needs logprob_threshold
    ({"audio": torch.zeros(1600), "logprob_threshold": 0.5}, "logprob_threshold"),
    ({"audio": torch.zeros(1600), "compression_ratio_threshold": -1.0}, "compression_ratio_threshold"),
    ({"audio": torch.zeros(1600), "fallback_temperatures": torch.full((11,), 0.5)}, "fallback_temperatures"),
    ({"audio": torch.zeros(1600), "fallback_temperatures": torch.tensor([0.2, -0.4])}, "fallback_temperatures"),
    ({"audio": torch.zeros(1600), "language": "klingon"}, "language"),
    ({"audio": torch.zeros(1600), "max_tokens": 0}, "max_tokens"),
    ({"audio": torch.zeros(1600), "temperature": -1.0}, "temperature"),
])
def test_bad_input_names_the_field(plan: Path, inputs: dict, field: str) -> None:
    with MStar.load(plan) as m:
        with pytest.raises(RequestFailed) as info:
            m.submit("transcribe", inputs).result()
    assert info.value.field == field, info.value


def test_min_tokens_holds_back_the_end_of_text_only() -> None:
    from mstar_models.whisper.scores import Rules, whisper_scores

    rules = Rules(LAYOUT, SUPPRESS, [220, LAYOUT.eot], 50, torch.device("cpu"))
    logits = torch.zeros(2, LAYOUT.vocab)
    logits[:, LAYOUT.eot] = 5.0
    logits[:, 17] = 1.0
    n, minus = torch.tensor([3, 3]), torch.full((2,), -1)
    scores = whisper_scores(logits, rules, n, torch.tensor([100, 100]), torch.tensor([99, 99]), minus,
                            torch.zeros(2, dtype=torch.bool), torch.tensor([4, 3]))
    assert scores.argmax(dim=-1).tolist() == [17, LAYOUT.eot]


def test_only_the_recurrent_step_that_reads_the_cross_context_is_captured(tmp_path: Path) -> None:
    """`decoder.step` is a recurrent loop step (it takes its own carried output) that reads
    @cross: it is captured for the decode cohort that runs its loop (whose graph attends to
    the read context inside the capture); the phases that read by their shapes alone
    (`prefill`, `detect`) are not, since a generic step never replays a reading step."""
    from mstar_runtime.plan import planfile

    out = tmp_path / "whisper-real.plan"
    assert mstarc(["compile", str(WALK), "--variant", "real", "-p", str(ROOT / "placements/h200x1.yaml"),
                   "-o", str(out)]) == 0
    captured = {(g["node"], g["phase"]) for g in planfile.read(out)["cuda_graphs"]}
    assert ("encoder", "encode") in captured  # the pass ran and captures what it may
    assert ("decoder", "step") in captured
    assert not captured & {("decoder", "prefill"), ("decoder", "detect")}
