"""The `mstarc` command-line contract: exit codes, outputs, corrupt plans, pass hooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mstar_runtime.plan import planfile
from mstarc import pipeline
from mstarc.cli import main

ROOT = Path(__file__).resolve().parent.parent
ORPHEUS = "models/orpheus/orpheus.walk"


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _compile(tmp: Path, *extra: str, placement: str = "placements/cpu.yaml", variant: str = "tiny") -> Path:
    out = tmp / "plan.bin"
    assert main(["compile", ORPHEUS, "--variant", variant, "-p", placement, "-o", str(out), *extra]) == 0
    return out


def test_check_ok_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", ORPHEUS, "--variant", "tiny", "-p", "placements/cpu.yaml"]) == 0
    assert capsys.readouterr().out.startswith("ok: model 'orpheus' (tiny) on placements/cpu.yaml: 3 nodes")


def test_bad_usage_exits_2() -> None:
    with pytest.raises(SystemExit) as e:
        main(["compile", ORPHEUS])  # no -p, no -o
    assert e.value.code == 2
    proc = subprocess.run([sys.executable, "-m", "mstarc.cli", "frobnicate"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_print_after_unknown_pass_is_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compile", ORPHEUS, "--variant", "tiny", "-p", "placements/cpu.yaml", "-o", str(tmp_path / "p"),
                 "--print-after", "nope"])
    assert code == 2
    assert "unknown pass 'nope'" in capsys.readouterr().err


def test_print_after_and_time_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _compile(tmp_path, "--print-after", "verify", "--print-after", "streams", "--time-passes", "--verify-each")
    err = capsys.readouterr().err
    assert "// ---- IR after verify ----" in err and "[tts.s2] token, code, done = llm.prefill(" in err
    assert "// ---- IR after streams ----" in err and '"policy": {' in err
    for name in pipeline.PIPELINE:
        assert f"\n{name:<15} " in err
    assert "total" in err


@pytest.mark.parametrize("fmt,needle", [("text", "walk tts("), ("markdown", "## Walk `tts("),
                                        ("dot", 'digraph "orpheus"'), ("json", '"schema": {')])
def test_explain_formats(fmt: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _compile(tmp_path)
    capsys.readouterr()
    assert main(["explain", str(plan), "--format", fmt]) == 0
    assert needle in capsys.readouterr().out


def test_diff_equal_and_different(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _compile(tmp_path)
    b = tmp_path / "b.bin"
    assert main(["compile", ORPHEUS, "--variant", "tiny", "-p", "placements/cpu.yaml", "-o", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.strip() == "plans are equal"
    c = tmp_path / "c.bin"
    assert main(["compile", ORPHEUS, "-p", "placements/h200x1.yaml", "-o", str(c)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "~ model.variant: 'tiny' -> 'real'" in out
    assert "~ nodes.llm.arch.dims.hidden: 64 -> 3072" in out


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_plan_is_a_clear_error(damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _compile(tmp_path)
    raw = bytearray(plan.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "garbage":
        raw = bytearray(b"#!/bin/sh\necho not a plan\n")
    else:
        raw = bytearray()
    plan.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["explain", str(plan)]) == 1
    err = capsys.readouterr().err
    assert "error[E070]" in err and "Traceback" not in err
    assert main(["diff", str(plan), str(plan)]) == 2  # trouble, not "different" (diff(1)'s codes)
    assert "error[E070]" in capsys.readouterr().err


def test_newer_schema_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _compile(tmp_path)
    body = planfile.read(plan)
    body["schema"]["major"] = planfile.SCHEMA_MAJOR + 1
    planfile.write(plan, body)
    capsys.readouterr()
    assert main(["explain", str(plan)]) == 1
    assert "error[E071]" in capsys.readouterr().err


def test_diff_exit_codes_are_diffs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0 equal, 1 different, 2 trouble: a missing plan, an internal error in the comparison."""
    plan = _compile(tmp_path)
    assert main(["diff", str(plan), str(tmp_path / "missing.plan")]) == 2
    assert "error[E004]" in capsys.readouterr().err
    import mstarc.diff

    def broken(a: object, b: object) -> list[str]:
        raise ValueError("boom")

    mp = pytest.MonkeyPatch()
    mp.setattr(mstarc.diff, "diff_plans", broken)
    try:
        assert main(["diff", str(plan), str(plan)]) == 2
    finally:
        mp.undo()
    assert "error[E090]" in capsys.readouterr().err


def test_plans_do_not_depend_on_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """An absolute path from another folder gives the same bytes as a relative one from the root
    (docs/plan-format.md); the plan keeps only the .walk file's name."""
    here = _compile(tmp_path).read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "abs.plan"
    assert main(["compile", str(ROOT / ORPHEUS), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                 "-o", str(out)]) == 0
    assert out.read_bytes() == here
    assert planfile.read(out)["model"]["source"] == "orpheus.walk"
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "plan.bin"), str(out)]) == 0


def test_missing_model_file_is_e004(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "models/nope/nope.walk"]) == 1
    assert "error[E004]: cannot read 'models/nope/nope.walk'" in capsys.readouterr().err


def test_internal_error_names_the_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    def broken(model):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(pipeline, "streams", broken)
    code = main(["compile", ORPHEUS, "--variant", "tiny", "-p", "placements/cpu.yaml", "-o", str(tmp_path / "p")])
    assert code == 3
    assert "internal error in pass 'streams': ZeroDivisionError: boom" in capsys.readouterr().err


def test_qwen3_omni_real_does_not_fit_24_gib(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "models/qwen3_omni/qwen3_omni.walk", "-p", "tests/placements/gpu24g.yaml"])
    assert code == 1
    err = capsys.readouterr().err
    assert "error[E060]: rank 0 (cuda" in err and "Traceback" not in err


def test_weights_folder_headers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--weights DIR reads safetensors headers; a missing tensor is E062 naming it."""
    import json
    import struct

    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [156940, 64], "data_offsets": [0, 0]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 156940, "tie_word_embeddings": True, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["check", ORPHEUS, "--variant", "tiny", "--weights", str(tmp_path)])
    assert code == 1
    assert f"error[E062]: weights folder '{tmp_path / 'snac'}' does not exist" in capsys.readouterr().err
    (tmp_path / "snac").write_text("")  # a file where the folder should be: said so, not "does not exist"
    assert main(["check", ORPHEUS, "--variant", "tiny", "--weights", str(tmp_path)]) == 1
    assert f"error[E062]: weights folder '{tmp_path / 'snac'}' is not a folder" in capsys.readouterr().err
    (tmp_path / "snac").unlink()
    (tmp_path / "snac").mkdir()  # SNAC's own checkpoint lives in the sub-folder the walk names
    snac = json.dumps({"decoder.model.0.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "snac" / "model.safetensors").write_bytes(struct.pack("<Q", len(snac)) + snac)
    code = main(["check", ORPHEUS, "--variant", "tiny", "--weights", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "error[E062]: node 'llm': missing tensor 'model.layers.0.input_layernorm.weight'" in err
    assert "error[E062]: node 'snac': tensor 'decoder.model.0.weight' has shape [1]" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    assert main(["--version"]) == 0
    assert re.fullmatch(r"mstarc \S+ \(plan schema \d+\.\d+\)\n", capsys.readouterr().out)


def test_usage_error_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["explain", "p.plan", "--format", "pdf"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("Usage: mstarc explain [OPTIONS] PLAN\n")
    assert "mstarc: error: Invalid value for '--format': 'pdf' is not one of" in err
    with pytest.raises(SystemExit) as e:
        main([])  # no command: the help, as a usage error
    assert e.value.code == 2 and "Commands:" in capsys.readouterr().err


def test_options_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MSTAR_VARIANT", "tiny")
    monkeypatch.setenv("MSTAR_PLACEMENT", "placements/cpu.yaml")
    assert main(["compile", ORPHEUS, "-o", str(tmp_path / "p.plan")]) == 0
    assert "model 'orpheus' (tiny)" in capsys.readouterr().out
    assert main(["check", ORPHEUS, "--variant", "real", "-p", "placements/h200x1.yaml"]) == 0  # the command line wins
    assert capsys.readouterr().out.startswith("ok: model 'orpheus' (real) on placements/h200x1.yaml")


def test_shell_completion() -> None:
    import os

    env = {**os.environ, "COMP_WORDS": "mstarc comp", "COMP_CWORD": "1", "_MSTARC_COMPLETE": "bash_complete"}
    proc = subprocess.run([sys.executable, "-m", "mstarc.cli"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0 and proc.stdout.split() == ["plain,compile"]
