"""Qwen3-Omni's language models as KV nodes (thinker, talker, code predictor): parity with transformers 5.24.

The reference is `Qwen3OmniMoeForConditionalGeneration` built from a tiny config at the walk's
tiny sizes (tests/qwen3_omni_lm_support.py), with randomized weights written by
`save_pretrained` (the checkpoint's per-expert names) and read back by our loader through the
compiled tiny plan. The audio and vision encoder outputs our thinker takes are HF's own
(`get_audio_features` / `get_image_features`): the encoders are other nodes.

Tolerances: float32 on the CPU, logits `rtol=1e-5, atol=2e-5` (|logits| ~ 5 here; summation
orders differ between paged attention and SDPA, grouped GEMMs and HF's expert loop); token and
code choices are compared exactly (the weights give gaps far above that noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from qwen3_omni_lm_support import NEWLINE, TINY_IDS, Harness, compile_plan, hf_model, node_spec
from support import saved_checkpoint

from mstar_models.qwen3_omni.positions import rope_index
from mstar_models.qwen3_omni.talker import TalkerMoE
from mstar_models.qwen3_omni.thinker import ThinkerMoE
from mstar_models.qwen3_omni.tokens import TokenIds
from mstar_runtime.ops.node import NodeSpec, RequestError
from mstar_runtime.plan.loader import Plan
from mstar_runtime.weights import load_weights

pytest.importorskip("transformers")

RTOL, ATOL = 1e-5, 2e-5
I = TINY_IDS
TOK = TokenIds.tiny()
THINKER = {"prefill": ("token", "done"), "decode": ("token", "done"),
           "prefill_speech": ("token", "done", "item", "states", "mm", "positions"),
           "decode_speech": ("token", "done", "item")}
TALKER = {"prefill": (), "frame": ("frame", "done"), "frame_pad": ("frame", "done")}
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
CLASSES = {"thinker": ThinkerMoE, "talker": TalkerMoE}


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.fixture(scope="module")
def checkpoint(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_checkpoint(hf, tmp_path_factory, "qwen3_omni_ckpt")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return compile_plan(tmp_path_factory.mktemp("qwen3_omni_plan") / "tiny.plan")


def load(plan: Plan, checkpoint: Path, name: str, **settings: Any) -> Any:
    node = CLASSES[name](node_spec(plan, name, **settings)).eval()
    load_weights(node, plan, name, str(checkpoint))
    return node


@pytest.fixture(scope="module")
def encoded(hf: Any) -> dict[str, torch.Tensor]:
    """One audio clip (100 mel frames: 13 tokens) and one image (grid 1 x 4 x 6: 6 tokens), HF-encoded."""
    gen = torch.Generator().manual_seed(5)
    feats, fmask = torch.randn(1, 128, 100, generator=gen), torch.ones(1, 100, dtype=torch.long)
    grid, pixels = torch.tensor([[1, 4, 6]]), torch.randn(24, 1536, generator=gen)
    with torch.no_grad():
        audio = hf.thinker.model.get_audio_features(feats, fmask, return_dict=True).last_hidden_state
        vis = hf.thinker.model.get_image_features(pixels, grid, return_dict=True)
    return {"feats": feats, "fmask": fmask, "grid": grid, "pixels": pixels, "audio": audio,
            "image": torch.cat(vis.pooler_output), "deepstack": torch.stack([torch.cat(f) for f in vis.deepstack_features])}


def chat(*turns: tuple[str, list[int]], audio: int = 0, image: int = 0) -> torch.Tensor:
    """A chat-template prompt: turns (role, text ids), the first user turn holding the audio and
    image placeholders, ending with the assistant header."""
    ids: list[int] = []
    media = True
    for role, text in turns:
        ids += [I["im_start_token_id"], I[f"{role}_token_id"], NEWLINE]
        if role == "user" and media:
            if audio:
                ids += [I["audio_start_token_id"]] + [I["audio_token_id"]] * audio + [I["audio_end_token_id"]]
            if image:
                ids += [I["vision_start_token_id"]] + [I["image_token_id"]] * image + [I["vision_end_token_id"]]
            media = False
        ids += text + [I["im_end_token_id"], NEWLINE]
    return torch.tensor(ids + [I["im_start_token_id"], I["assistant_token_id"], NEWLINE], dtype=torch.int32)


def text_prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 470, (n,), generator=torch.Generator().manual_seed(seed)).to(torch.int32)


def generate(run: Harness, rid: str, inputs: dict[str, Any], steps: int, speech: bool = False) -> list[dict[str, Any]]:
    suffix = "_speech" if speech else ""
    outs = run.step("prefill" + suffix, [(rid, {**GREEDY, "max_tokens": 64, **inputs})])
    while len(outs) <= steps:
        outs += run.step("decode" + suffix, [(rid, {"token": outs[-1]["token"]})])
    return outs


def tokens_of(outs: list[dict[str, Any]]) -> list[int]:
    return [int(o["token"]) for o in outs]


# ------------------------------------------------------------------------------ names
def test_token_ids_agree_with_the_processor() -> None:
    from mstar_models.qwen3_omni import processor

    for real, table in ((TokenIds(), processor.REAL_IDS), (TokenIds.tiny(), processor.TINY_IDS)):
        for name, value in vars(table).items():
            if name != "endoftext":
                assert getattr(real, f"{name}_token_id") == value, name


def test_parameters_carry_the_checkpoint_names(plan: Plan, checkpoint: Path) -> None:
    for name, cls in CLASSES.items():
        node = cls(node_spec(plan, name))
        ours = {cls.checkpoint_prefix + k: tuple(v.shape) for k, v in node.state_dict().items()}
        arch = {t.name: tuple(t.shape) for t in plan.node(name).arch.tensors}
        assert ours == arch, name
    # the constructor's own weights (the `init` source) are deterministic
    a, b = ThinkerMoE(node_spec(plan, "thinker")), ThinkerMoE(node_spec(plan, "thinker"))
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    # loading fills the fused expert buffers in place
    node = load(plan, checkpoint, "thinker")
    mlp = node.model.layers[1].mlp
    assert mlp.experts[3].down_proj.weight.data_ptr() == mlp.down[3].data_ptr()
    assert not torch.equal(mlp.down[3], a.model.layers[1].mlp.down[3])


def test_real_size_parameters_are_the_released_checkpoints() -> None:
    """At the released sizes (on the meta device: shapes only), every node's names and shapes are
    its arch's, i.e. the checkpoint's tensor list (48 x 128 experts in the thinker)."""
    from mstarc.archs import qwen3_omni as archs

    real = {
        "thinker": (archs.qwen3_omni_thinker, dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                                                   experts=128, moe_intermediate=768, vocab=152064)),
        "talker": (archs.qwen3_omni_talker, dict(layers=20, hidden=1024, heads=16, kv_heads=2, head_dim=128,
                                                 experts=128, moe_intermediate=384, shared_intermediate=768,
                                                 codec_vocab=3072, thinker_hidden=2048, projection_intermediate=2048,
                                                 cp_layers=5, cp_hidden=1024, cp_heads=16, cp_kv_heads=8,
                                                 cp_head_dim=128, cp_intermediate=3072, codebook_size=2048,
                                                 code_groups=16)),
    }
    for name, (arch, args) in real.items():
        cls = CLASSES[name]
        node = cls(NodeSpec(name, "kv", {"vocab": 152064}, args, {}, torch.bfloat16, torch.device("meta")))
        ours = {cls.checkpoint_prefix + k: tuple(v.shape) for k, v in node.state_dict().items()}
        assert ours == {t.name: tuple(t.shape) for t in arch(args, "bf16").tensors}, name
        if name == "thinker":
            assert len(ours) == 18867 and node.tok.audio_token_id == 151675 and node.section == [24, 20, 20]


# ------------------------------------------------------------------------------ thinker, text
def test_thinker_logits_match_hf(plan: Plan, checkpoint: Path, hf: Any) -> None:
    run = Harness(load(plan, checkpoint, "thinker"), THINKER)
    prompt = text_prompt(13, seed=2)  # 13 tokens over pages of 4: a partial last page
    outs = generate(run, "a", {"ids": prompt}, steps=6)
    fed = torch.cat([prompt.long()] + [o["token"].long() for o in outs[:-1]])
    with torch.no_grad():
        ref = hf.thinker(input_ids=fed[None], attention_mask=torch.ones(1, len(fed), dtype=torch.long)).logits[0]
    ours = torch.cat(run.logits)
    torch.testing.assert_close(ours, ref[len(prompt) - 1 :], rtol=RTOL, atol=ATOL)
    assert tokens_of(outs) == ref[len(prompt) - 1 :].argmax(-1).tolist()


def test_thinker_greedy_tokens_equal_hf_generate(plan: Plan, checkpoint: Path, hf: Any) -> None:
    prompt = text_prompt(9, seed=3)
    outs = generate(Harness(load(plan, checkpoint, "thinker"), THINKER, watch=None), "a",
                    {"ids": prompt, "max_tokens": 10}, steps=9)
    with torch.no_grad():
        ref = hf.thinker.generate(prompt.long()[None], max_new_tokens=10, do_sample=False,
                                  attention_mask=torch.ones(1, 9, dtype=torch.long))
    assert tokens_of(outs) == ref[0, 9:].tolist()
    # done on <|im_end|> (HF's generate here has no eos), and when max_tokens is reached on the 10th
    eos = [t == I["im_end_token_id"] for t in tokens_of(outs)]
    assert [o["done"] for o in outs] == eos[:9] + [True]


# ------------------------------------------------------------------------------ positions
def _hf_rope(hf: Any, ids: list[int], **kw: Any) -> tuple[torch.Tensor, float]:
    t = torch.tensor(ids)[None]
    pos, delta = hf.thinker.get_rope_index(t, attention_mask=torch.ones_like(t), **kw)
    return pos[:, 0], float(delta)


def test_positions_equal_hf_get_rope_index(hf: Any) -> None:
    # text, audio (250 mel frames: 33 tokens), an image 1 x 4 x 6 (6 tokens), text, a second
    # image 2 x 2 x 4 (4 tokens over 2 temporal patches), text
    vs, ve, a0, a1 = I["vision_start_token_id"], I["vision_end_token_id"], I["audio_start_token_id"], I["audio_end_token_id"]
    ids = ([1, 2, 3, a0] + [I["audio_token_id"]] * 33 + [a1, vs] + [I["image_token_id"]] * 6 + [ve, 4, 5, vs]
           + [I["image_token_id"]] * 4 + [ve, 6])
    grids = [(1, 4, 6), (2, 2, 4)]
    ref, ref_delta = _hf_rope(hf, ids, image_grid_thw=torch.tensor(grids), audio_seqlens=torch.tensor([250]))
    ours, delta = rope_index(ids, TOK, grids)
    assert torch.equal(ours, ref) and delta == ref_delta
    assert not torch.equal(ours[0], ours[1]) and delta != 0  # 3-D: rows and columns, time scaled by 13
    # a video with its audio track, at a fractional 0.7 s per temporal patch: patches and audio
    # interleaved by time; then a plain video
    v = I["video_token_id"]
    ids = ([1, vs, a0] + [v] * 8 + [I["audio_token_id"]] * 13 + [a1, ve, 2, vs] + [v] * 4 + [ve, 3])
    kw = dict(video_grid_thw=torch.tensor([[2, 4, 4], [1, 4, 4]]), use_audio_in_video=True,
              audio_seqlens=torch.tensor([100]), second_per_grids=torch.tensor([0.7, 2.0]))
    # use_audio_in_video applies to every video of the prompt in HF: the plain one is counted
    # as a video only if it has an audio start after its vision start, so give each its own call
    ref, ref_delta = _hf_rope(hf, ids[: ids.index(2)], **{**kw, "video_grid_thw": torch.tensor([[2, 4, 4]]),
                                                         "second_per_grids": torch.tensor([0.7])})
    ours, delta = rope_index(ids[: ids.index(2)], TOK, video_grids=[(2, 4, 4)], video_seconds=[0.7],
                             use_audio_in_video=True)
    assert torch.equal(ours, ref) and delta == ref_delta
    assert not torch.equal(ours[1], torch.sort(ours[1]).values)  # interleaved: rows jump between patch and audio
    tail = ids[ids.index(2) - 1 :]
    ref, ref_delta = _hf_rope(hf, tail, video_grid_thw=torch.tensor([[1, 4, 4]]),
                              second_per_grids=torch.tensor([2.0]))
    ours, delta = rope_index(tail, TOK, video_grids=[(1, 4, 4)], video_seconds=[2.0])
    assert torch.equal(ours, ref) and delta == ref_delta
    # no grids: 1-D positions even with audio, as HF
    ids = [1, a0] + [I["audio_token_id"]] * 13 + [a1, 2]
    ref, ref_delta = _hf_rope(hf, ids, audio_seqlens=torch.tensor([100]))
    ours, delta = rope_index(ids, TOK)
    assert torch.equal(ours, ref) and delta == ref_delta == 0.0
    with pytest.raises(RequestError, match="grid"):
        rope_index([vs] + [I["image_token_id"]] * 6 + [ve], TOK, [(1, 4, 6), (1, 2, 2)])


# ------------------------------------------------------------------------------ thinker, multimodal
def test_thinker_with_audio_image_and_deepstack_matches_hf(plan: Plan, checkpoint: Path, hf: Any,
                                                          encoded: dict[str, torch.Tensor]) -> None:
    e = encoded
    prompt = chat(("system", [40, 41]), ("user", [50, 51]), audio=13, image=6)
    run = Harness(load(plan, checkpoint, "thinker"), THINKER)
    inputs = {"ids": prompt, "audio": e["audio"], "image": e["image"], "deepstack": e["deepstack"], "grid": e["grid"]}
    outs = generate(run, "a", inputs, steps=4)
    with torch.no_grad():
        # HF's own decode loop (its positions after a multimodal prompt come from the rope deltas)
        gen = hf.thinker.generate(
            input_ids=prompt.long()[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            input_features=e["feats"], feature_attention_mask=e["fmask"], pixel_values=e["pixels"],
            image_grid_thw=e["grid"], max_new_tokens=5, do_sample=False, output_logits=True,
            return_dict_in_generate=True)
        # without the deepstack additions the answer differs (so the comparison can fail)
        plain = Harness(load(plan, checkpoint, "thinker"), THINKER)
        generate(plain, "a", {**inputs, "deepstack": None}, steps=0)
    ref = torch.cat(gen.logits)
    torch.testing.assert_close(torch.cat(run.logits), ref, rtol=RTOL, atol=ATOL)
    assert tokens_of(outs) == gen.sequences[0, len(prompt) :].tolist()
    assert not torch.allclose(plain.logits[0], ref[:1], rtol=1e-3, atol=1e-3)


def test_thinker_batch_equals_each_request_alone(plan: Plan, checkpoint: Path,
                                                 encoded: dict[str, torch.Tensor]) -> None:
    e = encoded
    requests = {
        "a": {"ids": text_prompt(5, seed=4)},
        "b": {"ids": chat(("user", [50]), audio=13, image=6), "audio": e["audio"], "image": e["image"],
              "deepstack": e["deepstack"], "grid": e["grid"]},
        "c": {"ids": text_prompt(11, seed=6), "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7},
        # an image without deepstack rows beside one with them
        "d": {"ids": chat(("user", [52]), image=6), "image": e["image"], "grid": e["grid"]},
    }
    node = load(plan, checkpoint, "thinker")
    alone = {}
    for rid, inputs in requests.items():
        run = Harness(node, THINKER)
        outs = generate(run, rid, inputs, steps=4)
        alone[rid] = (tokens_of(outs), torch.cat(run.logits))
    run = Harness(node, THINKER)
    got = {r: [o] for r, o in zip("abd", run.step("prefill", [(r, {**GREEDY, "max_tokens": 64, **requests[r]})
                                                             for r in "abd"]))}
    logits = {r: [run.logits[-1][i : i + 1]] for i, r in enumerate("abd")}
    while any(len(got.get(r, [])) <= 4 for r in requests):
        if len(got["a"]) == 2 and "c" not in got:  # c's prefill beside a's and b's decodes
            got["c"] = run.step("prefill", [("c", {**GREEDY, "max_tokens": 64, **requests["c"]})])
            logits["c"] = [run.logits[-1]]
        live = [r for r in got if len(got[r]) <= 4]
        for i, (r, out) in enumerate(zip(live, run.step("decode", [(r, {"token": got[r][-1]["token"]})
                                                                   for r in live]))):
            got[r].append(out)
            logits[r].append(run.logits[-1][i : i + 1])
    for rid in requests:
        assert tokens_of(got[rid]) == alone[rid][0], rid
        torch.testing.assert_close(torch.cat(logits[rid]), alone[rid][1], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------ speech
def speak(nodes: dict[str, Any], prompts: dict[str, dict[str, Any]], text_tokens: int, frames: int,
          **talker: Any) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Thinker -> talker frames (with their residual codes) for a batch of requests, each step batched across them."""
    th, tk = Harness(nodes["thinker"], THINKER, watch=None), Harness(nodes["talker"], TALKER, watch=None)
    rids = list(prompts)
    pre = th.step("prefill_speech", [(r, {**GREEDY, "max_tokens": text_tokens, **prompts[r]}) for r in rids])
    text = {r: [int(o["token"])] for r, o in zip(rids, pre)}
    items = {r: [o["item"]] for r, o in zip(rids, pre)}
    last = dict(zip(rids, pre))
    while not all(last[r]["done"] for r in rids):
        live = [r for r in rids if not last[r]["done"]]
        for r, o in zip(live, th.step("decode_speech", [(r, {"token": last[r]["token"]}) for r in live])):
            text[r].append(int(o["token"]))
            items[r].append(o["item"])
            last[r] = o
    settings = {"speaker": "ethan", "do_sample": False, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                "repetition_penalty": 1.05, "max_frames": frames, "seed": 0, **talker}
    tk.step("prefill", [(r, {"states": o["states"], "mm": o["mm"], "positions": o["positions"], **settings})
                        for r, o in zip(rids, pre)])
    codes: dict[str, list[torch.Tensor]] = {r: [] for r in rids}
    for f in range(frames):
        texted = [r for r in rids if f < len(items[r])]
        padded = [r for r in rids if f >= len(items[r])]
        outs = dict(zip(texted, tk.step("frame", [(r, {"text": items[r][f]}) for r in texted]) if texted else []))
        outs.update(zip(padded, tk.step("frame_pad", [(r, {}) for r in padded]) if padded else []))
        for r in rids:
            codes[r].append(outs[r]["frame"])
    return text, {r: torch.cat(c).T for r, c in codes.items()}


@pytest.fixture(scope="module")
def lm_nodes(plan: Plan, checkpoint: Path) -> dict[str, Any]:
    return {name: load(plan, checkpoint, name) for name in CLASSES}


@pytest.mark.parametrize("media", ["image", "audio"])
def test_speech_codes_equal_hf_generate(lm_nodes: dict[str, Any], hf: Any, encoded: dict[str, torch.Tensor],
                                        media: str) -> None:
    """Greedy end to end: the thinker's text, the talker prompt from the user turns (whose image
    makes the talker's positions 3-D; whose audio leaves them 1-D, as HF), read from the
    thinker's layer tap at the media positions, the talker's layer-0 codes and the code
    predictor's residual codes, against `generate(return_audio=True)`."""
    e = encoded
    prompt = chat(("system", [40, 41]), ("user", [50, 51]), ("assistant", [60, 61]), ("user", [70, 71, 72]),
                  **{media: 6 if media == "image" else 13})
    text_tokens, frames = 6, 8
    captured: dict[str, torch.Tensor] = {}
    decode = hf.code2wav.chunked_decode

    def capture(codes: torch.Tensor, **kw: Any) -> torch.Tensor:
        captured["codes"] = codes.clone()
        return torch.zeros(1, 1, 1)  # the vocoder is another node's test

    if media == "image":
        hf_media = {"pixel_values": e["pixels"], "image_grid_thw": e["grid"]}
        ours = {"image": e["image"], "deepstack": e["deepstack"], "grid": e["grid"]}
    else:
        hf_media = {"input_features": e["feats"], "feature_attention_mask": e["fmask"]}
        ours = {"audio": e["audio"]}
    hf.code2wav.chunked_decode = capture
    try:
        with torch.no_grad():
            seqs, _ = hf.generate(
                input_ids=prompt.long()[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                speaker="ethan", return_audio=True, thinker_max_new_tokens=text_tokens, thinker_do_sample=False,
                thinker_eos_token_id=I["im_end_token_id"], talker_do_sample=False, talker_max_new_tokens=frames,
                **hf_media)
    finally:
        hf.code2wav.chunked_decode = decode
    text, codes = speak(lm_nodes, {"r": {"ids": prompt, **ours}}, text_tokens, frames)
    assert text["r"] == seqs[0, len(prompt) :].tolist()
    ref = captured["codes"][0]  # [code groups, frames]: HF has no codes for its last talker token
    assert ref.shape == (4, frames - 1)
    assert torch.equal(codes["r"][:, : frames - 1].long(), ref)


def test_speech_batch_equals_each_request_alone(lm_nodes: dict[str, Any], encoded: dict[str, torch.Tensor]) -> None:
    e = encoded
    prompts = {
        "a": {"ids": chat(("user", [70, 71])), "max_tokens": 3},
        "b": {"ids": chat(("system", [40]), ("user", [50, 51]), image=6), "image": e["image"],
              "deepstack": e["deepstack"], "grid": e["grid"]},
    }
    together = speak(lm_nodes, prompts, 5, 6, do_sample=True, seed=11)
    for rid in prompts:
        alone = speak(lm_nodes, {rid: prompts[rid]}, 5, 6, do_sample=True, seed=11)
        assert together[0][rid] == alone[0][rid], rid
        assert torch.equal(together[1][rid], alone[1][rid]), rid
    assert not torch.equal(together[1]["a"], together[1]["b"])


def test_the_talker_state_is_the_request_s_own(plan: Plan) -> None:
    """A request's talker prefill keeps its own tensors, not views of the batch's: the tts_pad
    row (`pad`) was a row of the whole batch's projected prompt [tokens, hidden], which stayed
    alive as long as any request of the batch did. And a later frame call leaves the state of
    a row that is not in it as it was."""
    talker = TalkerMoE(node_spec(plan, "talker")).eval()
    load_weights(talker, plan, "talker", "dummy")
    run = Harness(talker, TALKER, watch=None)
    width = talker.thinker_hidden
    entries = [(rid, {"states": torch.randn(n, width), "mm": torch.zeros(n, dtype=torch.bool),
                      "positions": torch.arange(n, dtype=torch.float32).expand(3, n), **GREEDY,
                      "repetition_penalty": 1.0, "max_frames": 4})
               for rid, n in (("a", 12), ("b", 9), ("c", 10))]
    run.step("prefill", entries)
    for rid, _ in entries:
        state = run.engine.state(rid, "main")
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                held = t.untyped_storage().nbytes()
                assert held == t.numel() * t.element_size(), (rid, key, held)
    # A frame's leave keeps views of the call's own columns (ops/column_call.py: no copy per row
    # and column); what that needs: no later call writes them, so a row that left keeps its state.
    run.step("frame_pad", [("a", {}), ("b", {})])
    b = run.engine.state("b", "main")
    kept = {key: t.clone() for key, t in b.items() if isinstance(t, torch.Tensor)}
    a_codec = run.engine.state("a", "main")["codec"].clone()
    for _ in range(2):  # as many rows as the call b was in: a buffer kept for such calls would be written
        run.step("frame_pad", [("a", {}), ("c", {})])
    assert not torch.equal(run.engine.state("a", "main")["codec"], a_codec)  # a's columns were written
    assert all(torch.equal(b[key], t) for key, t in kept.items()), [k for k, t in kept.items() if not torch.equal(b[k], t)]


# ------------------------------------------------------------------------------ bad input
def test_bad_inputs_fail_the_request_with_a_clear_error(plan: Plan, lm_nodes: dict[str, Any],
                                                        encoded: dict[str, torch.Tensor]) -> None:
    th = Harness(lm_nodes["thinker"], THINKER, watch=None)
    with pytest.raises(RequestError, match="audio placeholders"):
        th.step("prefill", [("a", {**GREEDY, "max_tokens": 4, "ids": chat(("user", [1]), audio=13)})])
    with pytest.raises(RequestError, match="assistant header"):
        th.step("prefill_speech", [("b", {**GREEDY, "max_tokens": 4, "ids": text_prompt(6, seed=1)})])
    with pytest.raises(RequestError, match="never prefilled"):
        th.step("decode", [("c", {"token": torch.tensor([3], dtype=torch.int32)})])
    with pytest.raises(RequestError, match="must lie in"):
        th.step("prefill", [("d", {**GREEDY, "max_tokens": 4, "ids": torch.tensor([1, 999])})])
    with pytest.raises(RequestError, match="grid"):
        th.step("prefill", [("g", {**GREEDY, "max_tokens": 4, "ids": chat(("user", [1]), image=6),
                                   "image": encoded["image"], "grid": torch.tensor([[1, 4, 4]])})])
    tk = Harness(lm_nodes["talker"], TALKER, watch=None)
    with pytest.raises(RequestError, match="speaker"):
        tk.step("prefill", [("f", {"states": torch.zeros(9, 64), "mm": torch.zeros(9, dtype=torch.bool),
                                   "positions": torch.zeros(3, 9), "speaker": "nobody", "do_sample": False,
                                   "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
                                   "max_frames": 4})])
    with pytest.raises(RequestError, match="never prefilled"):
        tk.step("frame_pad", [("h", {})])
    with pytest.raises(RequestError, match="one item"):
        tk.step("frame", [("i", {"text": torch.zeros(2, 64)})])


# ------------------------------------------------------------------------------ the predictor's draw
def test_code_predictor_draw_is_hfs_top_k_top_p_distribution() -> None:
    """`sample_top_k_top_p` over u on a fine regular grid picks each code with HF's top-k 50 /
    top-p 0.8 probability (the runtime's reference processing of the whole row, softmaxed),
    to within the grid step; codes outside the kept set never; greedy rows the argmax."""
    from mstar_models.qwen3_omni.code_predictor import TOP_K, TOP_P, sample_top_k_top_p
    from mstar_runtime.sampling import SamplingParams, process_logits

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 2048, generator=gen) * torch.tensor([[0.5], [2.0], [4.0]])
    ref = process_logits(logits, [SamplingParams(temperature=1.0, top_k=TOP_K, top_p=TOP_P)] * 3,
                         [None] * 3).softmax(dim=-1)
    grid = 1 << 14
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    for r in range(3):
        picked = sample_top_k_top_p(logits[r : r + 1].expand(grid, -1), torch.zeros(grid, dtype=torch.bool), u)
        freq = torch.bincount(picked, minlength=2048).double() / grid
        assert set(picked.unique().tolist()) <= set(ref[r].nonzero()[:, 0].tolist())
        torch.testing.assert_close(freq, ref[r].double(), atol=2.0 / grid, rtol=0)
    greedy = sample_top_k_top_p(logits, torch.ones(3, dtype=torch.bool), u[:3])
    assert torch.equal(greedy, logits.argmax(dim=-1))
