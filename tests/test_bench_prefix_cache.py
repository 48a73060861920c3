"""The prefix-cache benchmark (tools/bench/prefix_cache.py) at Orpheus' tiny size on the CPU.

No timing is asserted (the figures depend on the machine): the one command runs, the hit
requests found the shared prefix's blocks cached and the misses none, both gave the same
codes, and the JSON has the shape the benchmark promises."""

from __future__ import annotations

import json
from pathlib import Path

from support import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_prefix_cache_bench_runs_and_hits(tmp_path: Path) -> None:
    bench = load_script(ROOT / "tools" / "bench" / "prefix_cache.py", "prefix_cache_bench")
    out = tmp_path / "pc.json"
    assert bench.main(["--device", "cpu", "--variant", "tiny", "--prefix-tokens", "60", "--requests", "2",
                       "--warmup", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    miss, hit = rec["results"]
    assert (miss["mode"], hit["mode"]) == ("miss", "hit")
    assert miss["cached_tokens"] == 0 and hit["cached_tokens"] >= rec["prefix_tokens"] // 16 * 16 - 16 > 0
    assert rec["same_codes"] is True and rec["ratio_miss_over_hit"] > 0
    assert miss["ttft_p50_ms"] > 0 and hit["ttft_p50_ms"] > 0
