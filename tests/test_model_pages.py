"""The model pages (docs/models/) say what a person needs to run each model: every walk and
every input it takes (checked against the compiled tiny plan, so a walk or input added to a
`.walk` file without a word on its page fails here), and the facts the code cites are on
the pages, not in a file the repository does not hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from mstar_runtime.plan import planfile
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parents[1]
# page -> its walk file
PAGES = {
    "bagel": "models/bagel/bagel.walk",
    "qwen3_omni": "models/qwen3_omni/qwen3_omni.walk",
    "orpheus": "models/orpheus/orpheus.walk",
    "vjepa2": "models/vjepa2/vjepa2.walk",
    "testfamily": "models/testfamily/testfamily.walk",
    "vla": "models/vla/vla.walk",
    "asr": "models/asr/asr.walk",
    "whisper": "models/whisper/whisper.walk",
    "pi05": "models/pi05/pi05.walk",
}
SECTION = re.compile(r"^## (?:Walks and their inputs|Inputs, and what the tiny variant accepts)\n(.*?)(?=^## |\Z)",
                     re.M | re.S)


def inputs_section(page: str) -> str:
    text = (ROOT / "docs/models" / f"{page}.md").read_text(encoding="utf-8")
    found = SECTION.search(text)
    assert found is not None, f"docs/models/{page}.md has no inputs section"
    return found.group(1)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_names_every_walk_and_input(page: str, tmp_path: Path) -> None:
    plan = tmp_path / f"{page}.plan"
    assert mstarc(["compile", str(ROOT / PAGES[page]), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(plan)]) == 0
    walks = planfile.read(plan)["walks"]
    assert walks, page
    section = inputs_section(page)
    missing = [f"walk {w}" for w in walks if f"`{w}" not in section]
    missing += [f"input {w}.{p['name']}" for w, program in walks.items() for p in program["inputs"]
                if f"`{p['name']}`" not in section]
    assert not missing, f"docs/models/{page}.md's inputs section does not name: {', '.join(missing)}"


def test_no_file_cites_a_missing_reference() -> None:
    """The facts once cited from reference/models.md, which the repository never held, are
    written into the model pages; a citation of a section number would point nowhere."""
    out = subprocess.run(["git", "grep", "-n", "-E", r"reference/models\.md|models\.md [0-9]", "--", ".",
                          ":!tests/test_model_pages.py"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1, f"citations of a file the repository does not hold:\n{out.stdout}"
    for page in PAGES:
        assert "## Facts" in (ROOT / "docs/models" / f"{page}.md").read_text(encoding="utf-8") or page in (
            "testfamily", "vla", "asr"), page
