"""What a person gives each corpus model's walks: the tiny variant runs its own defaults.

Each model's tiny plan (cpu.yaml): every walk's default inputs pass the checks made before a
request is queued (`control.bounds`: image sizes, flow steps, CFG settings; the bounds of
fixed loops whose count is an input), so `mstar-run PLAN --walk W` with only the inputs that
have no default runs. The bounds themselves, in one error, on their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mstar_runtime.control.bounds import out_of_bounds
from mstar_runtime.plan import planfile
from mstar_runtime.serve.server import loop_limits
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
MODELS = sorted(p.name for p in (ROOT / "models").iterdir() if (p / f"{p.name}.walk").exists())


def tiny_plan(model: str, out: Path) -> dict[str, Any]:
    plan = out / f"{model}-tiny.plan"
    assert mstarc(["compile", str(ROOT / f"models/{model}/{model}.walk"), "--variant", "tiny",
                   "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    return planfile.read(plan)


@pytest.mark.parametrize("model", MODELS)
def test_the_tiny_variants_defaults_are_requests_it_can_run(model: str, tmp_path: Path) -> None:
    doc = tiny_plan(model, tmp_path)
    config = doc["model"]["config"]
    for walk, program in doc["walks"].items():
        assert out_of_bounds(config, program, {}) == [], walk
        defaults = {p["name"]: p["default"] for p in program["inputs"]}
        for name, most in loop_limits(program).items():
            value = defaults.get(name)
            assert value is None or 0 <= value <= most, (walk, name, value, most)


BAGEL_T2I = {"inputs": [
    {"name": "height", "type": {"kind": "int"}, "default": 1024},
    {"name": "width", "type": {"kind": "int"}, "default": 1024},
    {"name": "num_timesteps", "type": {"kind": "int"}, "default": 50},
    {"name": "cfg_interval_start", "type": {"kind": "float"}, "default": 0.4},
    {"name": "cfg_interval_end", "type": {"kind": "float"}, "default": 1.0},
]}
TINY = {"max_latent_size": 4, "latent_patch_size": 2, "vae_ch_mult": [1, 2, 4, 4], "max_timesteps": 8}


def test_every_input_out_of_bounds_is_found_and_defaults_say_so() -> None:
    found = out_of_bounds(TINY, BAGEL_T2I, {"cfg_interval_end": 0.1})
    assert [p.names for p in found] == [("width", "height"), ("num_timesteps",), ("cfg_interval_end",)]
    assert [p.code for p in found] == ["unsupported_size", "out_of_range", "out_of_range"]
    assert "is the walk's default" in found[0].render() and "is the walk's default" in found[1].render()
    assert found[2].render() == "cfg_interval_end: the CFG interval must have start <= end, got [0.4, 0.1]"
    # a field per side, or both sides under one (the images route's `size`)
    assert found[0].render({"width": "size", "height": "size"}.__getitem__).startswith("size: 1024x1024")
    assert found[0].render("inputs.{}".format).startswith("inputs.width and inputs.height: 1024x1024")
    assert out_of_bounds(TINY, BAGEL_T2I, {"height": 64, "width": 48, "num_timesteps": 9}) == []
    assert out_of_bounds({}, BAGEL_T2I, {}) == []  # no latent geometry, no bound: a plan that is not BAGEL's
