"""Prefix caching on one GPU at real size (random weights): Orpheus-3B with a 2,000-token
shared prefix and Qwen3-Omni's second turn, hit against miss, through the benchmark's own
code (tools/bench/prefix_cache.py). The miss runs with the cache on, on an engine that holds
nothing: its prefill in chunks of the default prefix chunk (512), the hit's in the same chunks
from its cached length on. The hit's outputs must equal the miss's (seeded sampling and greedy
decoding: the chunks give the suffix the same kernels in both), it must find the prefix cached
up to a multiple of the chunk, and its time to first output must be shorter. Equality with the
cache-off run is printed, not asserted (another prefill: other kernels). The figures are
printed (`pytest -s`).

    pytest -m gpu -s tests/test_gpu_prefix_cache.py
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support import load_script

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    bench = load_script(ROOT / "tools" / "bench" / "prefix_cache.py", "prefix_cache_gpu")
    out = tmp_path / "pc.json"
    assert bench.main(["--device", "cuda", "--requests", "4", "--out", str(out), *args]) == 0
    # The bench's worker froze the heap (worker.freeze_heap); thaw it so that its real-size KV
    # pool is freed before the next model's case sizes its own by the memory it finds free.
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()
    rec = json.loads(out.read_text())
    print(json.dumps(rec["results"]), rec["ratio_miss_over_hit"], rec["ratio_off_over_hit"], rec["same_as_off"])
    return rec


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["orpheus", "qwen3_omni"])
def test_a_hit_equals_its_miss_and_comes_sooner(cuda: Any, tmp_path: Path, model: str) -> None:
    rec = _bench(tmp_path, "--model", model)
    off, miss, hit = rec["results"]
    assert rec["same_outputs"] is True
    chunk = rec["prefix_chunk"]
    assert hit["cached_tokens"] >= rec["prefix_tokens"] // chunk * chunk - chunk and hit["cached_tokens"] % chunk == 0
    assert hit["cached_tokens"] > 0 and miss["cached_tokens"] == off["cached_tokens"] == 0
    assert rec["ratio_miss_over_hit"] > 1.5
