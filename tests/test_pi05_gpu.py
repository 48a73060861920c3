"""π0.5 at real size on one GPU (random weights): ours in bf16 against the reference in float32.

The rule of the V-JEPA 2-AC test (tests/test_vjepa2.py): bf16 rounds each of the ~36 residual
updates of each of 10 expert steps at 2^-8, so the check is relative: our action chunk must
be as close to the float32 reference as the reference's own bfloat16 run is (LeRobot's
`precision="bfloat16"`, `PI05Reference.to_lerobot_bf16_`), within 1.5x.

    pytest -m gpu tests/test_pi05_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar_models.pi05.prompt import prompt_text
from mstar_runtime.control.conductor import FINISHED, Conductor
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker.worker import Worker
from mstarc.cli import main as mstarc
from tests.pi05_reference import REAL, PI05Reference, checkpoint_tensors, pixels

ROOT = Path(__file__).resolve().parents[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # ours come back on the host (the denoise cohort's carried chunk is read back each step)
    return ((a.float().to(b.device) - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
def test_real_size_bf16_chunk_is_as_close_to_fp32_as_the_references_bf16(cuda: torch.device,
                                                                          tmp_path: Path) -> None:
    out = tmp_path / "pi05.plan"
    assert mstarc(["compile", str(ROOT / "models/pi05/pi05.walk"), "--variant", "real",
                   "-p", str(ROOT / "placements/h200x1.yaml"), "-o", str(out)]) == 0
    plan = load_plan(out, device="cuda")
    worker = Worker(plan, 0, "cuda", "dummy")
    conductor = Conductor(plan, {0: worker})
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 224, 224, 3), generator=g, dtype=torch.uint8)  # the third camera missing
    state = torch.rand(14, generator=g) * 2 - 1
    noise = torch.randn(50, 32, generator=g)
    instruction = "put the cup on the plate"
    h = conductor.submit("act_noise", {"images": images, "instruction": instruction, "state": state, "noise": noise})
    conductor.run_until_idle()
    assert h.state == FINISHED, h.error
    ours = h.outputs["actions"]

    with torch.device("cuda"):
        ref = PI05Reference(REAL).eval()
    ref.load_checkpoint_(checkpoint_tensors(*(worker.engines[n].node for n in ("vision", "vlm", "expert"))))
    padded = torch.zeros(32)
    padded[:14] = state
    ids = [2] + [3 + b for b in prompt_text(instruction, padded.numpy()).encode()]
    cams = [pixels(images[i : i + 1]).cuda() for i in range(2)] + [-torch.ones(1, 3, 224, 224, device="cuda")]
    masks = [torch.tensor([True], device="cuda")] * 2 + [torch.tensor([False], device="cuda")]
    tokens = torch.zeros(1, 200, dtype=torch.long, device="cuda")
    tokens[0, : len(ids)] = torch.tensor(ids)
    mask = tokens != 0
    truth = ref.sample_actions(cams, masks, tokens, mask, noise[None].cuda())[0]
    ref_bf16 = ref.to_lerobot_bf16_().sample_actions(cams, masks, tokens, mask, noise[None].cuda())[0]
    err_ours, err_ref = rel(ours, truth), rel(ref_bf16, truth)
    print(f"rel L2 to the fp32 reference: ours (bf16) {err_ours:.4f}, reference bf16 {err_ref:.4f}")
    assert err_ours <= max(1.5 * err_ref, 1e-2), (err_ours, err_ref)
