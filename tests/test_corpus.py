"""Plan replay: compile the corpus `models/ x placements/` and compare explanations with goldens.

Every model compiles in its tiny variant for cpu.yaml and in its real variant for every GPU
placement; the text explanation of each plan is committed under tests/golden/. A change that
alters any plan shows up here as a diff; refresh deliberately with
`pytest tests/test_corpus.py --update-goldens` and review the golden diff in the commit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mstarc.cli import main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"
MODELS = sorted(p.name for p in (ROOT / "models").iterdir() if (p / f"{p.name}.walk").exists())
PLACEMENTS = sorted(p.stem for p in (ROOT / "placements").glob("*.yaml"))
PAIRS = [(m, p) for m in MODELS for p in PLACEMENTS]


def test_corpus_is_complete() -> None:
    for required in ("orpheus", "vjepa2", "bagel", "qwen3_omni"):
        assert required in MODELS
    for required in ("cpu", "h200x1", "h100x4", "h200x8"):
        assert required in PLACEMENTS


@pytest.mark.parametrize("model,placement", PAIRS, ids=[f"{m}-{p}" for m, p in PAIRS])
def test_golden_explanation(model: str, placement: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str], update_goldens: bool) -> None:
    monkeypatch.chdir(ROOT)  # relative paths in plans: the goldens do not depend on the checkout's location
    variant = "tiny" if placement == "cpu" else "real"
    plan = tmp_path / "plan.bin"
    code = main(["compile", f"models/{model}/{model}.walk", "--variant", variant,
                 "-p", f"placements/{placement}.yaml", "-o", str(plan), "--verify-each"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert main(["explain", str(plan)]) == 0
    text = capsys.readouterr().out
    golden = GOLDEN / f"{model}__{placement}.txt"
    if update_goldens or not golden.exists():
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(text)
        if not update_goldens:
            pytest.fail(f"golden {golden.name} did not exist; written now — review and commit it")
    assert text == golden.read_text(), f"explanation of {model} on {placement} changed; see --update-goldens"
