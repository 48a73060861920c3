"""Shared pytest options: `--update-goldens` rewrites golden files instead of comparing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/golden/* from the current compiler output (review the diff!)")


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch at one intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny models gain nothing from more, and ranks sharing this 2-core box are slowed 10-100x
    by each other's spinning threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def testfamily_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test family's tiny plan on placements/cpu.yaml, compiled once per session."""
    from mstarc.cli import main as mstarc

    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.getbasetemp() / "testfamily-tiny.plan"
    if not out.exists():
        assert mstarc(["compile", str(root / "models/testfamily/testfamily.walk"), "--variant", "tiny",
                       "-p", str(root / "placements/cpu.yaml"), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    """The GPU with FlashInfer, for `gpu` tests; skips where either is missing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flashinfer", reason="flashinfer is not installed (tools/gpu_check.sh installs it)")
    return torch.device("cuda")
