"""The prefix-cache benchmark (tools/bench/prefix_cache.py) at tiny sizes on the CPU: Orpheus
(a shared prefix) and Qwen3-Omni (a conversation's second turn).

No timing is asserted (the figures depend on the machine): the one command runs, the hit
requests found the shared prefix's blocks cached and the misses (and the cache-off run) none,
miss and hit gave the same outputs, and the JSON has the shape the benchmark promises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support import load_script

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    bench = load_script(ROOT / "tools" / "bench" / "prefix_cache.py", "prefix_cache_bench")
    out = tmp_path / "pc.json"
    assert bench.main(["--device", "cpu", "--prefix-tokens", "60", "--requests", "2", "--warmup", "1",
                       "--prefix-chunk", "32", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def _check(rec: dict[str, Any], first: str) -> None:
    off, miss, hit = rec["results"]
    assert (off["mode"], miss["mode"], hit["mode"]) == ("off", "miss", "hit") and rec["prefix_chunk"] == 32
    assert off["cached_tokens"] == miss["cached_tokens"] == 0
    assert hit["cached_tokens"] >= rec["prefix_tokens"] // 32 * 32 - 32 > 0 and hit["cached_tokens"] % 32 == 0
    assert rec["same_outputs"] is True and rec["ratio_miss_over_hit"] > 0 and rec["ratio_off_over_hit"] > 0
    assert isinstance(rec["same_as_off"], bool)
    assert all(r[f"{first}_p50_ms"] > 0 for r in (off, miss, hit))


def test_prefix_cache_bench_orpheus(tmp_path: Path) -> None:
    _check(_run(tmp_path, "--variant", "tiny"), "codes")


def test_prefix_cache_bench_qwen3_omni_second_turn(tmp_path: Path) -> None:
    rec = _run(tmp_path, "--model", "qwen3_omni", "--frames", "6")
    _check(rec, "text")
    assert rec["results"][1]["audio_out_p50_ms"] > 0
