"""tools/dev.sh asks for torch's CPU build where it can: `bash tools/dev.sh torch-args` prints
the pip arguments set-up would use (no install happens)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="the CPU index is chosen on Linux")


def torch_args(index: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "tools/dev.sh", "torch-args"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TORCH_INDEX_URL": index}, timeout=60)


def pinned() -> str:
    m = re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / "tools/dev.sh").read_text(), re.M)
    assert m is not None
    return m.group(1)


def test_the_cpu_index_when_it_answers(tmp_path: Path) -> None:
    import functools
    import http.server
    import threading

    (tmp_path / "whl" / "torch").mkdir(parents=True)  # a PEP 503 index: a page per project
    (tmp_path / "whl" / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}/whl"
        p = torch_args(url)
        httpd.shutdown()
    assert p.returncode == 0 and p.stdout.split() == [f"torch=={pinned()}", "--index-url", url]
    assert p.stderr == ""


@pytest.mark.parametrize("index", ["", "http://127.0.0.1:9/whl/cpu"])  # skipped; nothing listens on port 9
def test_otherwise_pip_config_and_a_plain_warning(index: str) -> None:
    p = torch_args(index)
    assert p.returncode == 0 and p.stdout.split() == [f"torch=={pinned()}"]
    assert "CUDA build" in p.stderr and "not used" in p.stderr


def test_the_readme_names_the_pinned_version() -> None:
    assert f"torch=={pinned()}" in (ROOT / "README.md").read_text()
