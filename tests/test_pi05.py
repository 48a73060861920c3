"""π0.5 (models/pi05/pi05.walk, models/mstar_models/pi05) on CPU at the tiny size, against the
reference of tests/pi05_reference.py (LeRobot's PI05Pytorch assembled from transformers'
PaliGemma and Gemma with openpi's adaptive norm) on the same weights and noise:

- the architectures' parameter counts equal the reference's modules' (real size, on the meta device);
- the prompt text and its 256-bin state discretisation;
- prefix K/V (every layer) and one velocity within 1e-5, node by node;
- the walk's action chunk (two cameras of three, the third masked out in the reference; the
  prompt padded to max_prompt there) within fp32 tolerance, batched across requests;
- bad input is a RequestFailed naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support import as_run

from mstar_models.pi05.nodes import ActionExpert
from mstar_models.pi05.prompt import Prompt, discretize, prompt_text
from mstar_runtime.api import MStar, RequestFailed
from mstar_runtime.ops.node import AttentionContext, RequestError, SeqPlan, SeqState
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.weights import build_node, load_weights
from mstarc.archs import get_arch
from mstarc.cli import main as mstarc
from tests.pi05_reference import REAL, TINY, PI05Reference, pixels

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
WALK = ROOT / "models/pi05/pi05.walk"
CAMERAS, MAX_PROMPT, OUT_DIM = 3, 96, 7  # the tiny variant's


def _arch_args(s: object) -> dict[str, dict[str, int]]:
    return {
        "pi05_siglip": dict(hidden=s.vis_hidden, layers=s.vis_layers, heads=s.vis_heads, intermediate=s.vis_mlp,
                            patch=s.patch, image=s.img, projection=s.width),
        "pi05_gemma": dict(layers=s.layers, hidden=s.width, heads=s.heads, kv_heads=s.kv_heads,
                           head_dim=s.head_dim, intermediate=s.mlp, vocab=s.vocab),
        "pi05_expert": dict(layers=s.layers, hidden=s.expert_width, heads=s.heads, kv_heads=s.kv_heads,
                            head_dim=s.head_dim, intermediate=s.expert_mlp, action_dim=s.action_dim),
    }


@pytest.fixture(scope="module")
def reference() -> PI05Reference:
    torch.manual_seed(0)
    ref = PI05Reference(TINY).eval()
    ref.randomize_(1234)
    return ref


@pytest.fixture(scope="module")
def checkpoint(reference: PI05Reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pi05_ckpt")
    # with the two language heads, as the released file has them (the expert declares them unused)
    save_file(reference.checkpoint(heads=True), str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def plan(checkpoint: Path) -> Path:
    out = checkpoint.parent / "pi05.plan"
    assert mstarc(["compile", str(WALK), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                   "--weights", str(checkpoint), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def engine(plan: Path, checkpoint: Path) -> Iterator[MStar]:
    with MStar.load(plan, weights=str(checkpoint)) as m:
        yield m


def _node(plan: Path, checkpoint: Path, name: str) -> torch.nn.Module:
    p = load_plan(plan)
    module = build_node(p, name, 0, "cpu")
    load_weights(module, p, name, checkpoint)
    return module


def _inputs(seed: int, cameras: int) -> tuple[torch.Tensor, str, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (cameras, TINY.img, TINY.img, 3), generator=g, dtype=torch.uint8)
    state = torch.rand(5, generator=g) * 2 - 1
    noise = torch.randn(TINY.horizon, TINY.action_dim, generator=g)
    return images, f"pick_up the block {seed}\n", state, noise


def _prompt_ids(instruction: str, state: torch.Tensor) -> list[int]:
    padded = np.zeros(TINY.action_dim, dtype=np.float32)
    padded[: state.numel()] = state.numpy()
    return [2] + [3 + b for b in prompt_text(instruction, padded).encode()]


def _reference_batch(images: torch.Tensor, ids: list[int]) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """LeRobot's model inputs for one request: every camera slot (the missing ones an all -1 image
    with mask false) and the prompt right-padded to max_prompt with its mask."""
    cams = [pixels(images[i : i + 1]) for i in range(images.shape[0])]
    masks = [torch.ones(1, dtype=torch.bool) for _ in cams]
    while len(cams) < CAMERAS:
        cams.append(-torch.ones_like(cams[0]))
        masks.append(torch.zeros(1, dtype=torch.bool))
    tokens = torch.zeros(1, MAX_PROMPT, dtype=torch.long)
    tokens[0, : len(ids)] = torch.tensor(ids)
    mask = torch.zeros(1, MAX_PROMPT, dtype=torch.bool)
    mask[0, : len(ids)] = True
    return cams, masks, tokens, mask


# ------------------------------------------------------------------------------ architecture
def test_parameter_counts_equal_the_reference_modules() -> None:
    """Real size, on the meta device: the vision tower (SigLIP + projector), the VLM (Gemma 2B with
    its embeddings and final norm) and the expert (adaptive norms and the four projections included)."""
    with torch.device("meta"):
        ref = PI05Reference(REAL)
    named = {n: p.numel() for n, p in ref.named_parameters()}
    pal = "paligemma_with_expert.paligemma.model."  # the reference's own names: no policy prefix
    vision = sum(v for n, v in named.items() if n.startswith((pal + "vision_tower", pal + "multi_modal_projector")))
    vlm = sum(v for n, v in named.items() if n.startswith(pal + "language_model"))
    expert = sum(v for n, v in named.items() if not n.startswith("paligemma_with_expert.paligemma")
                 and "lm_head" not in n)
    args = _arch_args(REAL)
    counts = {name: get_arch(name)(a, "bf16").param_count() for name, a in args.items()}
    assert counts == {"pi05_siglip": vision, "pi05_gemma": vlm, "pi05_expert": expert}
    spec = get_arch("pi05_expert")(args["pi05_expert"], "bf16")
    dense = sum(t.numel for t in spec.tensors if ".dense." in t.name)
    assert 0.25 < dense / spec.param_count() < 0.30  # the adaptive norms: the share an earlier count missed


def test_arch_names_are_the_reference_state_dict(reference: PI05Reference) -> None:
    names = set(reference.checkpoint())
    arch = set()
    for name, a in _arch_args(TINY).items():
        arch |= {t.name for t in get_arch(name)(a, "f32").tensors}
    assert arch == names


# ------------------------------------------------------------------------------ prompt
def test_prompt_text_discretises_the_state_into_256_bins() -> None:
    state = np.array([-1.0, 0.0, 0.999, 1.0, -1.5, 2 / 256 - 1, 0.0, 0.0], dtype=np.float32)
    assert discretize(state).tolist() == [0, 128, 255, 255, -1, 1, 128, 128]
    assert prompt_text("  pick_up\nthe cube ", state) == "Task: pick up the cube, State: 0 128 255 255 -1 1 128 128;\nAction: "


# ------------------------------------------------------------------------------ nodes
def test_prefix_kv_and_one_velocity_equal_the_reference(reference: PI05Reference, plan: Path,
                                                        checkpoint: Path) -> None:
    images, instruction, state, noise = _inputs(7, 2)
    ids = _prompt_ids(instruction, state)
    vision, vlm, expert = (_node(plan, checkpoint, n) for n in ("vision", "vlm", "expert"))
    cams, masks, tokens, mask = _reference_batch(images, ids)
    with torch.no_grad():
        embs, pad = reference.embed_prefix(cams, masks, tokens, mask)
        ref_kv = reference.prefix_kv(embs, pad)
        feats = vision.encode(images)
        h = vlm.prefix_embeddings([(feats, torch.tensor(ids))])
        torch.testing.assert_close(h, embs[0][pad[0]], atol=1e-5, rtol=1e-5)
        n = h.shape[0]
        ours: list[tuple[torch.Tensor, torch.Tensor]] = []

        def dense(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ours.append((k, v))
            rep = q.shape[1] // k.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                v.repeat_interleave(rep, 1).transpose(0, 1)).transpose(0, 1)

        cos, sin = vlm.rope(torch.arange(n), h.dtype)
        vlm.language_model.forward_layers(h, cos, sin, dense)
        assert len(ours) == TINY.layers
        for (k, v), (rk, rv) in zip(ours, ref_kv, strict=True):
            torch.testing.assert_close(k, rk[0].transpose(0, 1)[pad[0]], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, rv[0].transpose(0, 1)[pad[0]], atol=1e-5, rtol=1e-5)

        t = torch.tensor([0.7])
        ref_v = reference.velocity(ref_kv, pad, noise[None], t)

        def over_prefix(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pk, pv = ours[layer]
            kk, vv = torch.cat([pk, k]), torch.cat([pv, v])
            rep = q.shape[1] // kk.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), kk.repeat_interleave(rep, 1).transpose(0, 1),
                vv.repeat_interleave(rep, 1).transpose(0, 1)).transpose(0, 1)

        got = expert.velocity(noise[None], t, torch.arange(n, n + TINY.horizon), over_prefix)
    torch.testing.assert_close(got, ref_v, atol=1e-5, rtol=1e-5)
    assert float(ref_v.abs().mean()) > 1e-2  # the velocity is not a trivial zero


# ------------------------------------------------------------------------------ walk
def test_action_chunks_equal_the_reference(engine: MStar, reference: PI05Reference) -> None:
    """Three requests with 1, 2 and 3 cameras, batched: each chunk equals LeRobot's sample_actions
    on the same noise (missing cameras masked, the prompt padded). The denoise loop runs as a
    decode cohort: every request's flow_steps steps are cohort row steps."""
    requests = [_inputs(seed, cams) for seed, cams in ((1, 1), (2, 2), (3, 3))]
    before = engine.stats()
    handles = [engine.submit("act_noise", {"images": im, "instruction": ins, "state": st, "noise": nz})
               for im, ins, st, nz in requests]
    for h, (images, instruction, state, noise) in zip(handles, requests, strict=True):
        out = h.result(timeout=120)
        assert out["dims"] == OUT_DIM
        cams, masks, tokens, mask = _reference_batch(images, _prompt_ids(instruction, state))
        expect = reference.sample_actions(cams, masks, tokens, mask, noise[None])[0]
        torch.testing.assert_close(out["actions"], expect, atol=1e-5, rtol=1e-5)  # measured: 2.4e-7
        assert not torch.allclose(out["actions"], noise, atol=1e-2)
    # 3 rows of flow_steps steps each: >= flow_steps cohort steps (rows may join apart)
    assert engine.stats()["cohort_steps"] - before["cohort_steps"] >= TINY.flow_steps


def test_action_chunks_on_the_generic_path_equal_the_reference(plan: Path, checkpoint: Path,
                                                               reference: PI05Reference) -> None:
    """The plan without its cohort marks: the denoise loop step by step, each step a plain
    batched call of `step` (its column step as a one-step cohort, ops/column_call.py: the
    engine's read attention over the VLM's prefix and the chunk itself), no cohort step."""
    requests = [_inputs(seed, cams) for seed, cams in ((1, 1), (3, 3))]
    with MStar.from_plan(as_run(load_plan(plan), "generic"), weights=str(checkpoint)) as m:
        handles = [m.submit("act_noise", {"images": im, "instruction": ins, "state": st, "noise": nz})
                   for im, ins, st, nz in requests]
        for h, (images, instruction, state, noise) in zip(handles, requests, strict=True):
            cams, masks, tokens, mask = _reference_batch(images, _prompt_ids(instruction, state))
            expect = reference.sample_actions(cams, masks, tokens, mask, noise[None])[0]
            torch.testing.assert_close(h.result(timeout=120)["actions"], expect, atol=1e-5, rtol=1e-5)
        assert m.stats()["cohort_steps"] == 0


def test_seeded_noise_is_the_request_seed(engine: MStar) -> None:
    images, instruction, state, _ = _inputs(4, 2)
    noise = torch.randn(TINY.horizon, TINY.action_dim, generator=torch.Generator().manual_seed(11))
    seeded = engine.generate("act", images=images, instruction=instruction, state=state, seed=11)["actions"]
    given = engine.generate("act_noise", images=images, instruction=instruction, state=state, noise=noise)["actions"]
    torch.testing.assert_close(seeded, given, atol=0, rtol=0)
    other = engine.generate("act", images=images, instruction=instruction, state=state, seed=12)["actions"]
    assert not torch.allclose(seeded, other)


# ------------------------------------------------------------------------------ bad input
GOOD = _inputs(5, 2)


@pytest.mark.parametrize("change,field,words", [
    ({"images": torch.zeros(2, 12, 16, 3, dtype=torch.uint8)}, "images", "16 x 16"),
    ({"images": torch.zeros(2, 16, 16, 4, dtype=torch.uint8)}, "images", "must be 3, got 4"),
    ({"images": torch.zeros(2, 16, 16, 3)}, "images", "expected u8"),
    ({"images": torch.zeros(4, 16, 16, 3, dtype=torch.uint8)}, "images", "1 to 3 cameras"),
    ({"state": torch.zeros(TINY.action_dim + 1)}, "state", "at most 8"),
    ({"state": torch.tensor([0.0, float("nan")])}, "state", "NaN or infinite"),
    ({"state": torch.tensor([float("inf")])}, "state", "NaN or infinite"),
    ({"instruction": "  \n "}, "instruction", "empty"),
    ({"instruction": "x" * 200}, "instruction", "at most 96"),
    ({"noise": torch.full((TINY.horizon, TINY.action_dim), float("nan"))}, "noise", "NaN or infinite"),
])
def test_bad_input_names_the_field(engine: MStar, change: dict, field: str, words: str) -> None:
    images, instruction, state, noise = GOOD
    inputs = {"images": images, "instruction": instruction, "state": state, "noise": noise} | change
    # refused when submitted (the walk's declared type) or when its node runs
    with pytest.raises((RequestFailed, RequestError)) as e:
        engine.generate("act_noise", **inputs)
    assert e.value.field == field, str(e.value)
    assert words in str(e.value)
    # the engine serves the next request
    assert engine.generate("act_noise", images=images, instruction=instruction, state=state,
                           noise=noise)["actions"].shape == (TINY.horizon, TINY.action_dim)


H, A, STEPS = TINY.horizon, TINY.action_dim, TINY.flow_steps
CHUNK = torch.zeros(H, A)


@pytest.mark.parametrize("entry,field,words", [
    ({"x": torch.zeros(H, A + 1), "index": 0}, "x", f"x must be [{H}, {A}], got ({H}, {A + 1})"),
    ({"x": CHUNK, "index": STEPS}, "index", f"index must lie in [0, {STEPS}), got {STEPS}"),
    ({"x": CHUNK, "index": -1}, "index", "got -1"),
    ({"x": CHUNK, "index": True}, "index", "got True"),
    ({"x": CHUNK, "index": 1.0}, "index", "got 1.0"),
    ({"x": CHUNK}, "index", "input 'index' is missing"),
])
def test_expert_step_refuses_bad_input_naming_the_port(plan: Path, checkpoint: Path, entry: dict, field: str,
                                                       words: str) -> None:
    """`step` is written once, as the column step: a plain call checks each entry's chunk and
    index in its `join` (before any attention: this context has none to give) and `kv_plan`
    a chunk of another horizon, which would not be the step's block of `horizon` tokens."""
    expert = _node(plan, checkpoint, "expert")
    assert isinstance(expert, ActionExpert) and not hasattr(expert, "phase_step")
    limit = expert.cohort_phase("step").limit
    assert limit is not None and limit({}, {}) == STEPS  # a cohort declines a longer loop; the plain call refuses
    attn = AttentionContext([SeqState(0, H, {}, (40,))], None, torch.device("cpu"), reads=("vlm@main",))
    with pytest.raises(RequestError, match=re.escape(words)) as e:
        expert.run("step", [entry], attn)
    assert e.value.field == field
    with pytest.raises(RequestError, match=re.escape(f"x must be [{H}, {A}], got ({H - 1}, {A})")) as e:
        ActionExpert.kv_plan("step", {"x": (H - 1, A)}, expert.spec)
    assert e.value.field == "x"
    assert ActionExpert.kv_plan("step", {"x": (H, A)}, expert.spec) == SeqPlan(H, mask="full", keep=False)


def test_images_as_png_files_and_pil_images_equal_the_uint8_array(engine: MStar, tmp_path: Path) -> None:
    from PIL import Image

    images, instruction, state, noise = GOOD
    pils = [Image.fromarray(im.numpy()) for im in images]
    paths = []
    for i, p in enumerate(pils):
        paths.append(tmp_path / f"cam{i}.png")
        p.save(paths[-1])
    want = engine.generate("act_noise", images=images, instruction=instruction, state=state, noise=noise)["actions"]
    for given in (pils, [str(p) for p in paths]):
        got = engine.generate("act_noise", images=given, instruction=instruction, state=state, noise=noise)
        torch.testing.assert_close(got["actions"], want, atol=0, rtol=0)


def test_prompt_node_refuses_a_vocabulary_too_small_for_its_byte_tokenizer() -> None:
    from mstar_runtime.ops.node import NodeError, NodeSpec

    spec = NodeSpec("prompt", "stateless", {"action_dim": 8, "max_prompt": 96, "vocab": 200}, {}, {},
                    torch.float32, torch.device("cpu"))
    with pytest.raises(NodeError, match="at least 259"):
        Prompt(spec)


def test_reference_loads_the_nodes_tensors(reference: PI05Reference, plan: Path, checkpoint: Path) -> None:
    """What the GPU test and the benchmark use to give the reference the walk's weights."""
    from tests.pi05_reference import checkpoint_tensors

    nodes = [_node(plan, checkpoint, n) for n in ("vision", "vlm", "expert")]
    other = PI05Reference(TINY)
    other.load_checkpoint_(checkpoint_tensors(*nodes))
    for k, v in reference.state_dict().items():
        if "lm_head" not in k:
            torch.testing.assert_close(other.state_dict()[k], v, atol=0, rtol=0)


def test_bench_runs_on_the_cpu_at_the_tiny_size(tmp_path: Path) -> None:
    """tools/bench/pi05.py end to end (its GPU figures are the lead's; here: it runs and its
    reference chunk agrees with ours)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_pi05", ROOT / "tools/bench/pi05.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "p.json"
    assert bench.main(["--device", "cpu", "--variant", "tiny", "--batches", "2", "--repeats", "1",
                       "--prompt-tokens", "80", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["floor"]["prefix_tokens"] == CAMERAS * (TINY.img // TINY.patch) ** 2 + 80
    assert report["b1"]["p50_ms"] > 0 and report["throughput"][0]["batch"] == 2
    assert report["reference"]["chunk_rel_l2_vs_ours"] < 1e-2  # the reference runs in bf16 there


def test_native_route_takes_cameras_as_base64_pngs(engine: MStar, checkpoint: Path) -> None:
    """POST /v1/walks/act_noise with `images` a list of base64 PNGs (one per camera) gives the
    chunk the uint8 array gives; an undecodable camera and cameras of different sizes are 400s
    naming the field."""
    pytest.importorskip("fastapi", reason="the server needs the `serve` extra")
    httpx = pytest.importorskip("httpx")
    import asyncio
    import base64
    import io

    from PIL import Image

    from mstar_runtime.serve.server import ServeConfig, create_app

    app = create_app(engine, ServeConfig(weights=str(checkpoint)))

    def call(body: dict) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
                return await c.post("/v1/walks/act_noise", json=body)
        return asyncio.run(go())

    def png(array: np.ndarray) -> str:
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    images, instruction, state, noise = GOOD
    inputs = {"instruction": instruction, "state": state.tolist(), "noise": noise.tolist()}
    r = call({"inputs": inputs | {"images": [png(im.numpy()) for im in images]}, "stream": False})
    assert r.status_code == 200, r.text
    want = engine.generate("act_noise", images=images, instruction=instruction, state=state, noise=noise)
    got = r.json()["outputs"]
    assert got["dims"] == OUT_DIM
    torch.testing.assert_close(torch.tensor(got["actions"]), want["actions"], atol=1e-6, rtol=1e-6)
    bad = call({"inputs": inputs | {"images": [png(images[0].numpy()), "not base64!"]}, "stream": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "inputs.images[1]", bad.text
    mixed = call({"inputs": inputs | {"images": [png(images[0].numpy()), png(np.zeros((8, 16, 3), np.uint8))]},
                  "stream": False})
    assert mixed.status_code == 400 and "different sizes" in mixed.json()["error"]["message"], mixed.text
