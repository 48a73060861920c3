"""BAGEL and Qwen3-Omni over several CPU ranks (Gloo, worker processes), tiny, against one rank.

The placements mirror the GPU ones of issue 19 (tests/placements/):

- cpu3_bagel_cfg3.yaml, as placements/bagel_cfg3.yaml: the MoT LLM on ranks 0, 1 and 2, the
  three CFG queries of each denoising step on ranks 0 (@gen), 1 (@cfg_text) and 2 (@cfg_img).
  `chat` and `understand` (rank 0 only) give one rank's text; `t2i` with the image branch off
  gives one rank's image (the text branch's context is forked before anything is written, so
  no KV pages have to move); `t2i` and `edit` with all three branches give one rank's images
  with the contexts prefilled on rank 0 moved to ranks 1 and 2 (the plan's kv transfers:
  pages and node state, once per request).
- cpu2_qwen3_split.yaml, as placements/h200x2_split.yaml's stage split: the thinker (with the
  encoders and the processor) on rank 0, the talker (its code predictor inside) and Code2Wav
  on rank 1. Greedy `speech` (text, image and audio inputs) and `chat` batched together give
  exactly one rank's text and audio.
- cpu2_qwen3_tp2.yaml, as placements/qwen3_omni_tp2.yaml: the thinker at tp 2 on ranks 0
  and 1 (half the heads, expert width and vocab on each), the talker and Code2Wav on rank 1.
  Greedy `speech` and `chat` batched together (with and without image and audio inputs)
  give exactly one rank's text and audio.

The Qwen3-Omni weights are transformers' tiny model written by `save_pretrained`, as in
tests/test_qwen3_omni_walks.py (its Code2Wav at scales that keep the audio unclipped); BAGEL
runs on the plan's dummy weights, which every rank draws alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from qwen3_omni_lm_support import hf_model
from support import compile_walk
from test_multirank import _children

from mstar_runtime.control.conductor import FINISHED, Conductor
from mstar_runtime.ops.node import NodeError
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.sampling import SamplingParams
from mstar_runtime.worker.remote import RemoteWorker
from mstar_runtime.worker.startup import shutdown_workers, start_workers
from mstar_runtime.worker.worker import Worker, WorkerStepError

pytest.importorskip("transformers")
from tests.test_qwen3_omni_code2wav import _randomize as unclipped_code2wav_  # noqa: E402
from tests.test_qwen3_omni_walks import clip, picture  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0.0, "top_k": 0}
SPF, TRIM, FRAMES = 1920, 555, 12  # Code2Wav samples per frame, its right-edge trim, talker_max_frames
QWEN_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("speech", {"prompt": "say something", "max_tokens": 6, "talker_do_sample": False,
                "talker_max_frames": FRAMES, **GREEDY}),
    ("chat", {"prompt": "hello there", "max_tokens": 8, **GREEDY}),
]
QWEN_MEDIA_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("speech", {"prompt": "what is this?", "max_tokens": 5, "talker_do_sample": False, "talker_max_frames": FRAMES,
                "image": picture(40, 56, 2), **GREEDY}),
    ("speech", {"prompt": "and this?", "max_tokens": 5, "talker_do_sample": False, "talker_max_frames": FRAMES,
                "audio": clip(1.2, 1), **GREEDY}),
    ("chat", {"prompt": "describe it", "max_tokens": 7, "image": picture(40, 56, 5), **GREEDY}),
]

SIZE = {"height": 64, "width": 48}
SOURCE = torch.randint(0, 256, (32, 40, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
# BAGEL's image walks with all three CFG branches computed (t2i's interval (0.4, 1] covers 3 of
# its 3 Euler steps at num_timesteps 4; edit's [0, 1] all of them).
BAGEL_CFG: list[tuple[str, dict[str, Any]]] = [
    ("t2i", {"prompt": "a red fox", "num_timesteps": 4, "seed": 3, **SIZE}),
    ("edit", {"source": SOURCE, "prompt": "make it blue", "num_timesteps": 3, "seed": 5}),
]
# ... and what needs no KV context on another rank: text walks (rank 0 only) and t2i with the
# image branch off (cfg_img_scale 1), whose text branch reads @cfg_text, forked from @gen
# before anything was written to it.
BAGEL_NO_MOVE: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"prompt": "hello", "max_length": 6}),
    ("understand", {"image": SOURCE, "question": "what is it?", "max_length": 6}),
    ("t2i", {"prompt": "a red fox", "num_timesteps": 4, "seed": 3, "cfg_img_scale": 1.0, **SIZE}),
]
# Pixels may differ by 1 of 255: on one rank gen's and cfg_text's queries are one batched call
# (two entries), on three ranks each is alone, and another batch shape changes the last bits of
# the velocities (8.9e-8 measured at the first step); after a few Euler steps and the VAE
# decoder a value near a .5 boundary can round to the next uint8 (none did in BAGEL_NO_MOVE's
# t2i: 0 of 9216 pixels differ). A context that is wrong changes pixels by up to tens.
PIXEL_TOL = 1


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("multirank_models")
    bagel, qwen = "models/bagel/bagel.walk", "models/qwen3_omni/qwen3_omni.walk"
    return {
        "bagel1": compile_walk(out / "bagel1.plan", bagel, "placements/cpu.yaml"),
        "bagel3": compile_walk(out / "bagel3.plan", bagel, "tests/placements/cpu3_bagel_cfg3.yaml"),
        "qwen1": compile_walk(out / "qwen1.plan", qwen, "placements/cpu.yaml"),
        "qwen_split": compile_walk(out / "qwen_split.plan", qwen, "tests/placements/cpu2_qwen3_split.yaml"),
        "qwen_tp2": compile_walk(out / "qwen_tp2.plan", qwen, "tests/placements/cpu2_qwen3_tp2.yaml"),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' tiny Qwen3-Omni (tests/test_qwen3_omni_walks.py's `hf` and `checkpoint`)."""
    model = hf_model(seed=0)
    unclipped_code2wav_(model.code2wav, seed=0)
    out = tmp_path_factory.mktemp("qwen3_omni_ckpt")
    model.save_pretrained(out)
    return out


def _run(path: Path, weights: str | Path, requests: list[tuple[str, dict[str, Any]]]
         ) -> tuple[list[dict[str, Any]], Conductor, dict[int, Any]]:
    """`requests` submitted together and run to the end: in-process on a one-rank plan, else
    rank 0 here and the other ranks as worker processes (stopped after, none left behind)."""
    plan = load_plan(path, device="cpu")
    if plan.num_ranks == 1:
        workers: dict[int, Any] = {0: Worker(plan, 0, "cpu", weights)}
    else:
        workers = start_workers(plan, weights, "cpu")
    try:
        conductor = Conductor(plan, workers)
        handles = [conductor.submit(w, dict(i)) for w, i in requests]
        conductor.run_until_idle()
    finally:
        shutdown_workers(workers)
    assert _children() == []
    assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
    return [h.outputs for h in handles], conductor, workers


def _same_text_and_audio(one: list[dict[str, Any]], many: list[dict[str, Any]]) -> None:
    """Text equal; audio bit for bit: greedy tokens and codes are the same, and every Code2Wav
    window is decoded on one rank in both plans by the same node in the same batches."""
    for i, (a, b) in enumerate(zip(one, many, strict=True)):
        assert set(a) == set(b), (i, set(a), set(b))
        assert a["text"] and a["text"] == b["text"], (i, a["text"], b["text"])
        if "audio_out" in a:
            assert a["audio_out"].numel() == SPF * FRAMES - TRIM, i  # the talker ran its whole budget
            assert a["audio_out"].abs().max() > 1e-3, i  # not silence
            assert torch.equal(a["audio_out"], b["audio_out"]), (i, (a["audio_out"] - b["audio_out"]).abs().max())


def _close_images(one: list[dict[str, Any]], many: list[dict[str, Any]]) -> None:
    for i, (a, b) in enumerate(zip(one, many, strict=True)):
        assert set(a) == set(b), (i, set(a), set(b))
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, (i, k)
                diff = int((a[k].int() - b[k].int()).abs().max())
                assert diff <= PIXEL_TOL, (i, k, diff)
            else:
                assert a[k] == b[k], (i, k, a[k], b[k])


# ------------------------------------------------------------------------------ Qwen3-Omni
def test_qwen3_split_gives_one_ranks_speech_and_chat(plans: dict[str, Path], checkpoint: Path) -> None:
    one, alone, _ = _run(plans["qwen1"], checkpoint, QWEN_REQUESTS)
    split, conductor, workers = _run(plans["qwen_split"], checkpoint, QWEN_REQUESTS)
    assert isinstance(workers[1], RemoteWorker) and sorted(workers[1].nodes) == ["code2wav", "talker"]
    assert "thinker" in workers[0].engines and "talker" not in workers[0].engines
    _same_text_and_audio(one, split)
    # the talker's loop is a cohort in the worker process (rank 1), stepping as on one rank
    talker = {c.key[2]: c.stats["row_steps"] for cd in (alone, conductor) for c in cd.cohorts.values()
              if c.key[0] == "talker"}
    assert set(talker) == {(0,), (1,)} and talker[(1,)] == talker[(0,)] > 0, talker
    assert conductor.stats["remote_steps"] + talker[(1,)] >= FRAMES  # every talker frame ran on rank 1


def test_qwen3_split_with_image_and_audio_inputs(plans: dict[str, Path], checkpoint: Path) -> None:
    """An image makes the talker's positions 3-D (they cross ranks with the thinker's states)."""
    one, _, _ = _run(plans["qwen1"], checkpoint, QWEN_MEDIA_REQUESTS)
    split, _, _ = _run(plans["qwen_split"], checkpoint, QWEN_MEDIA_REQUESTS)
    _same_text_and_audio(one, split)


def test_qwen3_thinker_tp2_gives_one_ranks_speech_and_chat(plans: dict[str, Path], checkpoint: Path) -> None:
    one, _, _ = _run(plans["qwen1"], checkpoint, QWEN_REQUESTS)
    tp2, conductor, workers = _run(plans["qwen_tp2"], checkpoint, QWEN_REQUESTS)
    assert isinstance(workers[1], RemoteWorker) and sorted(workers[1].nodes) == ["code2wav", "talker", "thinker"]
    thinker = workers[0].engines["thinker"].node  # rank 0's shard: half the heads, experts and vocab
    assert (thinker.tp, thinker.local_heads, thinker.local_kv_heads) == (2, thinker.heads // 2, thinker.kv_heads // 2)
    assert thinker.kv_geometry.kv_heads == load_plan(plans["qwen_tp2"]).node("thinker").shard.kv_heads_per_rank
    assert thinker.lm_head.weight.shape[0] == thinker.vocab // 2
    _same_text_and_audio(one, tp2)


def test_qwen3_thinker_tp2_init_weights_are_tp1s(plans: dict[str, Path]) -> None:
    """The `init` source at tp 2: each rank draws every full matrix and keeps its part, so the
    greedy text is tp 1's (drawing the shards' own shapes would give other weights)."""
    chat = [("chat", {"prompt": "hello there", "max_tokens": 8, **GREEDY})]
    one, _, _ = _run(plans["qwen1"], "init", chat)
    tp2, _, _ = _run(plans["qwen_tp2"], "init", chat)
    assert one[0]["text"] and one[0]["text"] == tp2[0]["text"], (one[0]["text"], tp2[0]["text"])


def test_qwen3_thinker_tp2_with_image_and_audio_inputs(plans: dict[str, Path], checkpoint: Path) -> None:
    """The encoders' rows, the deepstack additions and the talker's tapped states at tp 2."""
    one, _, _ = _run(plans["qwen1"], checkpoint, QWEN_MEDIA_REQUESTS)
    tp2, _, _ = _run(plans["qwen_tp2"], checkpoint, QWEN_MEDIA_REQUESTS)
    _same_text_and_audio(one, tp2)


# ------------------------------------------------------------------------------ BAGEL
def test_bagel_cfg3_gives_one_ranks_text_and_text_branch_image(plans: dict[str, Path]) -> None:
    one, _, _ = _run(plans["bagel1"], "dummy", BAGEL_NO_MOVE)
    three, conductor, workers = _run(plans["bagel3"], "dummy", BAGEL_NO_MOVE)
    assert all(isinstance(workers[r], RemoteWorker) and workers[r].nodes == ["llm"] for r in (1, 2))
    for i in (0, 1):
        assert isinstance(one[i]["text"], str) and one[i]["text"] == three[i]["text"], i
    _close_images(one[2:], three[2:])
    assert conductor.stats["remote_steps"] >= 3  # the text branch's denoise ran on rank 1


def test_bagel_cfg3_gives_one_ranks_t2i_and_edit(plans: dict[str, Path]) -> None:
    one, single, _ = _run(plans["bagel1"], "dummy", BAGEL_CFG)
    three, conductor, _ = _run(plans["bagel3"], "dummy", BAGEL_CFG)
    _close_images(one, three)
    # t2i: @cfg_img to rank 2 (@cfg_text, forked from @gen before the prompt, is empty: it needs
    # no move since no transition into t2i keeps it); edit: @cfg_text and @cfg_img, both
    # prefilled on rank 0 (the plan's kv transfers)
    assert single.stats["kv_moves"] == 0 and conductor.stats["kv_moves"] == 3


def test_a_kv_context_moves_through_a_worker_process_and_back(plans: dict[str, Path]) -> None:
    """`export_kv` / `import_kv` (the plan's kv transfers) over Gloo, rank 0 -> 1 -> 0, into
    other pages and another tag: the same page contents, the same node state (the MoT's
    `SamplingParams` included); a state value that cannot travel is refused, naming it."""
    plan = load_plan(plans["bagel3"], device="cpu")
    workers = start_workers(plan, "dummy", "cpu")
    try:
        engine = workers[0].engines["llm"]
        pool = engine.pool.data
        pool[:, [2, 5]] = torch.randn(pool[:, [2, 5]].shape, generator=torch.Generator().manual_seed(1))
        state = engine.state("r", "cfg_img")
        state.update(rope_offset=-7, gen={"base": 3, "max_new": 5, "params": SamplingParams(temperature=0.3, seed=9)})
        workers[1].import_kv("llm", "r", "cfg_text", [0, 1], workers[0].export_kv("llm", "r", "cfg_img", [2, 5]))
        back = workers[1].export_kv("llm", "r", "cfg_text", [0, 1])
        assert torch.equal(back["kv"], pool[:, [2, 5]])
        workers[0].import_kv("llm", "r", "gen", [7, 8], back)
        assert torch.equal(pool[:, [7, 8]], pool[:, [2, 5]]) and pool[:, 7].abs().sum() > 0
        assert engine.state("r", "gen") == state
        workers[1].import_kv("llm", "r", "cfg_text", [], workers[0].export_kv("llm", "r", "think", []))
        assert workers[1].export_kv("llm", "r", "cfg_text", [])["has_state"] is False  # no state: none there
        engine.state("r", "think")["handle"] = object()
        with pytest.raises(NodeError, match="state value 'handle' is a object, which cannot move to another rank"):
            workers[0].export_kv("llm", "r", "think", [])
        # a worker process that cannot export says why and serves on
        with pytest.raises(WorkerStepError, match="node 'llm' phase 'export_kv': rank 1: page 1000000 is not in rank 1's pool of"):
            workers[1].export_kv("llm", "r", "cfg_text", [10**6])
        assert workers[1].heartbeat() > 0 and workers[1].export_kv("llm", "r", "cfg_text", [0])["kv"].shape[1] == 1
    finally:
        shutdown_workers(workers)
    assert _children() == []
