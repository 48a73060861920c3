"""Shared pytest options and fixtures.

- `--update-goldens` rewrites golden files instead of comparing.
"""

from __future__ import annotations

import gc
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
    from support import compile_model

    out = tmp_path_factory.getbasetemp() / "testfamily-tiny.plan"
    return out if out.exists() else compile_model(out, "testfamily")


@pytest.fixture(scope="module")
def cuda() -> Iterator[torch.device]:
    """The GPU with FlashInfer, for `gpu` tests; skips where either is missing. Afterwards the
    test's garbage is collected and the allocator's cache emptied: a real-size test sizes its
    KV pool by the memory it finds free, so whatever the one before left would shrink it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flashinfer", reason="flashinfer is not installed (tools/gpu_check.sh installs it)")
    yield torch.device("cuda")
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True, scope="module")
def _thaw_after_module() -> Iterator[None]:
    """A Worker freezes the heap it was built in (`worker.freeze_heap`: out of the cyclic GC's
    reach, as a serving process with one worker wants); a test process builds many, and a
    dropped worker's cycles would never be collected: at real size its KV pool (~80 GiB) stayed
    allocated and the next GPU test ran out of memory. After each module the heap is thawed and
    collected."""
    yield
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
