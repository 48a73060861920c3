"""BAGEL's walks on M*'s nodes against the official BAGEL code (ByteDance-Seed/Bagel), same weights.

CPU, the tiny variant (models/bagel/bagel.walk, placements/cpu.yaml), float32. Skipped, with
the reason, when `.official/` is absent (tools/official_bagel.sh makes it; CI does not, and
the folder is never committed).

- M*: the compiled tiny plan run through a Conductor and rank 0's Worker in this process.
  Weights: `dummy`, then every float tensor of the llm, vit, vae_enc and vae_dec nodes redrawn
  in place with spreads that make each part matter (matrices N(0, 1/fan_in), embeddings
  N(0, 0.25^2), the position tables N(0, 0.5^2), biases N(0, 0.1^2), norm gains
  1 + N(0, 0.1^2)); the dummy rule's zero biases and unit gains would hide a swapped norm or
  bias. The latent the VAE decoder receives, the x_1 noise and the streamed tokens are read off
  the nodes by probes on their phases (bagel_official.MStarRun).
- Official: tools/bench/bagel_official.py in a subprocess (its transformers 4.49 cannot share
  a process with this venv's 5.24), on those tensors by checkpoint name, through the official
  `InterleaveInferencer.interleave_inference` (stand-ins: flash_attn as SDPA per sequence,
  cv2 / torchvision stubs, bf16 casts redirected to f32).

Cases: T2I after 3 Euler steps of the 3-branch CFG (global renorm, every step inside the
interval), T2I with a step outside the interval, the image branch off and channel renorm;
edit after 3 steps with text_channel renorm and three distinct contexts ([VAE, ViT, text],
[VAE, ViT], [text]); edit's bare mixed-expert velocity (CFG off, one step: the gen context of
VAE latents (gen expert) + markers, ViT tokens and text (und expert) against a query of
markers (und) and noised latents (gen)); understanding's and chat's greedy tokens.

Tolerance: both sides compute in f32 with different summation orders (paged attention and
fused GEMMs against SDPA and separate GEMMs) and the CFG combination amplifies differences
(x cfg_text_scale x cfg_img_scale). Latents are compared by their displacement from the shared
x_1 (what the velocities moved): max |diff| <= 2e-5 x max |displacement| (measured 3e-7 to
1.2e-6); a wrong CFG combination is off by 1.2e-1 (`test_comparison_sees_a_wrong_cfg`), a
wrong routing, mask or position by more. Tokens must be equal: M* streams up to max_length of
them, the official generate_text returns max_length - 1 (its first slot is the start token).
M* also stops on <|vision_start|> (the model asking for an image; the chat walk then
continues as draw), where the official decode goes on: the prompts here were chosen so that
neither reply holds one, and a test failing on it says so.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
OFFICIAL = ROOT / ".official"
HARNESS = ROOT / "tools/bench/bagel_official.py"
WALK = ROOT / "models/bagel/bagel.walk"
REL_TOL = 2e-5  # of the largest displacement; see the module docstring

sys.path.insert(0, str(HARNESS.parent))
import bagel_official  # noqa: E402 - tools/bench is not a package on the path

pytestmark = pytest.mark.skipif(bagel_official.missing(OFFICIAL) is not None,
                                reason=f"no official BAGEL code: {bagel_official.missing(OFFICIAL)}")


IMAGES = {"edit_src": bagel_official.synthetic_image(40, 56, 1),
          "und_img": bagel_official.synthetic_image(56, 36, 2)}
T2I = [
    ("t2i_cfg3", {"prompt": "a red fox sitting in the snow", "height": 48, "width": 64, "num_timesteps": 4,
                  "seed": 7}),
    ("t2i_gated", {"prompt": "two cats on a sofa", "height": 64, "width": 32, "num_timesteps": 4, "seed": 11,
                   "cfg_interval_start": 0.7, "cfg_img_scale": 1.0, "cfg_renorm_type": "channel"}),
]
EDIT = [
    ("edit_cfg3", {"source": "edit_src", "prompt": "make the sky purple", "num_timesteps": 4, "seed": 3}),
    ("edit_mixed", {"source": "edit_src", "prompt": "add a moon", "num_timesteps": 2, "seed": 5,
                    "cfg_text_scale": 1.0}),
]
UND = [
    ("und", {"image": "und_img", "question": "What is in this image?", "max_length": 24}),
]
CHAT = [("chat", {"prompt": "Tell me about lighthouses.", "max_length": 24})]


# ------------------------------------------------------------------------------ M* side
def _plan(tmp: Path) -> Path:
    names = sorted(set(re.findall(r"= bagel\.(\w+) \{", WALK.read_text(encoding="utf-8"))))
    module = importlib.import_module("mstar_models.bagel")
    lacking = [n for n in names if not hasattr(module, n)]
    if lacking:
        pytest.skip(f"the BAGEL plan cannot load yet: mstar_models.bagel has no {', '.join(lacking)}")
    return bagel_official.compile_plan("tiny", ROOT / "placements/cpu.yaml", tmp / "bagel-tiny.plan")


def redraw_(module: torch.nn.Module, seed: int) -> None:
    """Every float tensor of the module's state (parameters and persistent buffers), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            if "embed_tokens" in name:
                v = 0.25 * torch.randn(t.shape, generator=g)
            elif name.endswith("pos_embed") or "position_embedding" in name:
                v = 0.5 * torch.randn(t.shape, generator=g)
            elif t.dim() >= 2:
                v = torch.randn(t.shape, generator=g) / math.sqrt(math.prod(t.shape[1:]))
            elif name.endswith("bias"):
                v = 0.1 * torch.randn(t.shape, generator=g)
            else:
                v = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
            t.copy_(v)


# ------------------------------------------------------------------------------ fixtures
def _flow_settings(case: dict[str, Any]) -> dict[str, Any]:
    """Walk inputs -> every official setting of the job (the walk's defaults are the official app's)."""
    defaults = bagel_official.EDIT_DEFAULTS if "source" in case else bagel_official.T2I_DEFAULTS
    return bagel_official.settings_from_walk(case, defaults)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every case on M* (in process) and on the official code (one subprocess), same weights."""
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("bagel_official")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny sizes; the box is shared
    try:
        ms = bagel_official.MStarRun(_plan(tmp), "cpu")
        for i, name in enumerate(bagel_official.BAGEL_NODES):
            redraw_(ms.worker.engines[name].node, 100 + i)
        ours: dict[str, Any] = {}
        jobs: list[dict[str, Any]] = []
        for name, case in T2I:
            ms.run("t2i", dict(case))
            ours[name] = {"latent": ms.latents[-1], "noise": ms.noise[-1]}
            jobs.append({"name": name, "task": "t2i", "prompt_ids": ms.segment_ids(case["prompt"]),
                         "height": case["height"], "width": case["width"], "num_timesteps": case["num_timesteps"],
                         "seed": case["seed"], **_flow_settings(case)})
        wrong = dict(jobs[0], name="t2i_cfg3_wrong", cfg_img_scale=1.0)  # official only: a negative case
        jobs.append(wrong)
        for name, case in EDIT:
            ms.run("edit", {**case, "source": IMAGES[case["source"]]})
            ours[name] = {"latent": ms.latents[-1], "noise": ms.noise[-1]}
            jobs.append({"name": name, "task": "edit", "image": case["source"],
                         "prompt_ids": ms.segment_ids(case["prompt"]), "num_timesteps": case["num_timesteps"],
                         "seed": case["seed"], **_flow_settings(case)})
        for name, case in UND:
            out = ms.run("understand", {**case, "image": IMAGES[case["image"]]})
            ours[name] = {"tokens": list(ms.tokens), "text": out.get("text")}
            jobs.append({"name": name, "task": "understand", "image": case["image"],
                         "question_ids": ms.segment_ids(case["question"]), "max_length": case["max_length"]})
        for name, case in CHAT:
            out = ms.run("chat", dict(case))
            ours[name] = {"tokens": list(ms.tokens), "text": out.get("text")}
            jobs.append({"name": name, "task": "understand", "question_ids": ms.segment_ids(case["prompt"]),
                         "max_length": case["max_length"]})

        save_file(bagel_official.worker_weights(ms.worker, "cpu"), str(tmp / "weights.safetensors"))
        save_file({k: v.contiguous() for k, v in IMAGES.items()}, str(tmp / "images.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dict(ms.plan.config), default=list))
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, str(HARNESS), "--folder", str(OFFICIAL), "run", "--weights", str(tmp / "weights.safetensors"),
             "--config", str(tmp / "config.json"), "--jobs", str(tmp / "jobs.json"),
             "--inputs", str(tmp / "images.safetensors"), "--out", str(tmp / "official.safetensors")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"official run failed:\n{proc.stderr[-4000:]}"
        official = load_file(str(tmp / "official.safetensors"))
        yield {"ours": ours, "official": official, "mstar": ms}
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------ tests
def _check_latent(name: str, ours: dict[str, torch.Tensor], official: torch.Tensor) -> float:
    x1, lat = ours["noise"], ours["latent"]
    assert lat.shape == official.shape == x1.shape, f"{name}: {tuple(lat.shape)} vs {tuple(official.shape)}"
    moved = official - x1
    scale = moved.abs().max().item()
    assert scale > 1e-2, f"{name}: the official steps barely moved the latent ({scale:.2e}): a degenerate case"
    err = (lat - official).abs().max().item()
    assert err <= REL_TOL * scale, f"{name}: max |diff| {err:.3e} > {REL_TOL:g} x max displacement {scale:.3e}"
    return err / scale


@pytest.mark.parametrize("name", [n for n, _ in T2I])
def test_t2i_latents_match_official(runs: dict[str, Any], name: str) -> None:
    _check_latent(name, runs["ours"][name], runs["official"][name])


@pytest.mark.parametrize("name", [n for n, _ in EDIT])
def test_edit_latents_match_official(runs: dict[str, Any], name: str) -> None:
    _check_latent(name, runs["ours"][name], runs["official"][name])


@pytest.mark.parametrize("name", [n for n, _ in UND + CHAT])
def test_greedy_tokens_match_official(runs: dict[str, Any], name: str) -> None:
    official = runs["official"][name].tolist()
    ours = runs["ours"][name]["tokens"]
    eos = int(runs["mstar"].plan.config["eos_id"])
    assert len(official) >= 4, f"{name}: the official reply is too short to compare ({official})"
    vision_start = int(runs["mstar"].plan.config["vision_start_id"])
    assert vision_start not in official, (f"{name}: the reply opens an image (<|vision_start|>), where M* stops "
                                          "and the official decode goes on: pick another prompt")
    # generate_text returns at most max_length - 1 tokens and never the <|im_end|> it stops on;
    # M* streams up to max_length tokens, the final <|im_end|> included
    assert ours[: len(official)] == official, f"{name}: M* {ours} vs official {official}"
    if len(ours) > len(official):
        assert ours[len(official)] == eos or len(ours) == len(official) + 1, f"{name}: M* went on: {ours}"
    tok = runs["mstar"].worker.engines["tok"].node
    assert runs["ours"][name]["text"] == tok.decode(ours), f"{name}: streamed text != decode of the tokens"


def test_comparison_sees_a_wrong_cfg(runs: dict[str, Any]) -> None:
    """The check can fail: M*'s t2i_cfg3 latent against the official one of the same request with
    the image branch off (cfg_img_scale 1.0; in T2I v_img = v, so only the combination changes)."""
    with pytest.raises(AssertionError, match="max displacement"):
        _check_latent("t2i_cfg3 vs image branch off", runs["ours"]["t2i_cfg3"], runs["official"]["t2i_cfg3_wrong"])


# ------------------------------------------------------------------------------ GPU, real size
GPU_SLACK = 1.25  # M*'s bf16 error against the f32 reference may exceed the official bf16's by 25%
GPU_MIN_PREFIX = 8  # greedy tokens M* shares with the f32 reference (or all the official shares)


@pytest.mark.gpu
def test_real_size_matches_official_on_gpu(tmp_path: Path) -> None:
    """Real size, bf16, one H200, the plan's `dummy` weights (`bagel_official.py parity`, a process
    of its own: the GPU machine's transformers 5.x must not be imported beside the official 4.49;
    ~150 s): M*'s t2i (1024^2, with and without CFG) and edit (512^2) latents after 3 Euler steps,
    and understanding's greedy tokens, against the official code in bf16 and in f32 (the same
    weights upcast: the exact reference). bf16 alone moves a latent by a few % of its displacement
    and the CFG combination amplifies that (x4 text, x1.5-2 image), so M* and the official bf16 runs
    differ from each other by ~15% (measured, t2i with CFG) while each is 12.2% from the f32 run:
    the test asks M* to be as close to f32 as the official bf16 run is. Measured on an H200: t2i
    0.122 (M*) vs 0.122 (official), t2i without CFG 0.024 vs 0.025, edit 0.066 vs 0.065 (rms of the
    displacement); tokens: 13 shared with f32 (the official 15 of 15; random weights have near-ties)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path / "parity.json"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(HARNESS), "--folder", str(OFFICIAL), "parity", "--variant", "real",
                           "--device", "cuda", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, f"parity run failed:\n{proc.stderr[-4000:]}"
    rec = json.loads(out.read_text())
    for case in ("t2i", "t2i_nocfg", "edit"):
        r = rec[case]
        assert r["official_vs_f32"]["moved_max"] > 1e-1, f"{case}: the steps barely moved the latent: {r}"
        ours, theirs = r["mstar_vs_f32"]["rms_rel"], r["official_vs_f32"]["rms_rel"]
        assert ours <= GPU_SLACK * theirs + 5e-3, f"{case}: M* {ours:.4f} from f32, the official bf16 {theirs:.4f}: {r}"
    und = rec["und"]
    want = min(GPU_MIN_PREFIX, und["common_prefix_f32"]["official"])
    assert und["common_prefix_f32"]["mstar"] >= want, f"understanding tokens: {und}"
