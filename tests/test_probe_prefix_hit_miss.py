"""The prefix hit/miss probe (tools/probes/prefix_hit_miss.py) at tiny sizes on the CPU.

The one command runs every mode, its summary has the fields the probe promises, the miss runs in
chunks of --prefix-chunk and the hit the same chunks from its cached length on, and the hit
equals its miss bit for bit (logits, last hidden row, K/V of every kept layer), as the control
(the same prompt computed whole twice) and the split run (its prompt's own pages cached) do;
the cache-off run, in one piece, is only close. Timings are only checked to exist (they depend
on the machine)."""

from __future__ import annotations

import json
from pathlib import Path

from support import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_probe_hit_equals_miss_on_cpu(tmp_path: Path) -> None:
    probe = load_script(ROOT / "tools" / "probes" / "prefix_hit_miss.py", "prefix_hit_miss_probe")
    out = tmp_path / "probe"
    assert probe.main(["--device", "cpu", "--variant", "tiny", "--prefix-tokens", "60", "--requests", "3",
                       "--warmup", "1", "--prefix-chunk", "32", "--out", str(out)]) == 0
    rec = json.loads((out / "summary.json").read_text())
    assert rec["prompt_tokens"] > rec["prefix_tokens"] >= 60 and rec["kv_layers"][0] == 0
    assert (out / "profile_miss.txt").read_text().startswith("top 25 by cpu_time_total")
    assert (out / "profile_hit.txt").stat().st_size > 0
    modes = rec["modes"]
    assert modes["off"]["cached_tokens"] == modes["miss"]["cached_tokens"] == 0 and rec["prefix_chunk"] == 32
    assert modes["hit"]["cached_tokens"] > 0 and modes["hit"]["cached_tokens"] % 32 == 0
    assert modes["split"]["cached_tokens"] >= modes["hit"]["cached_tokens"]
    # the miss in chunks of 32, the hit the same chunks from its cached length on; off in one piece
    n = rec["prompt_tokens"]
    assert modes["off"]["pieces"] == [[n, n]]
    assert modes["miss"]["pieces"] == [[min(32, n - a), min(a + 32, n)] for a in range(0, n, 32)]
    assert modes["hit"]["pieces"] == [p for p in modes["miss"]["pieces"] if p[1] > modes["hit"]["cached_tokens"]]
    for m in modes.values():
        assert m["timed_requests"] == 1 and m["step_gpu_ms"] is None
        assert m["step_host_ms"] > 0 and m["before_step_ms"] > 0 and m["after_step_ms"] > 0 and m["first_code_ms"] > 0
    cmp = rec["compare"]
    assert set(cmp) == {"miss_vs_hit", "miss_vs_split", "miss_vs_split_first", "split_vs_hit", "off_vs_miss"}
    for name in ("miss_vs_hit", "miss_vs_split_first", "miss_vs_split", "split_vs_hit"):
        c = cmp[name]
        assert c["logits_max_abs"] == 0.0 and c["hidden_max_abs"] == 0.0, name
        assert c["argmax_equal"] and c["codes_equal"], name
        for part in ("kv_prefix", "kv_suffix"):
            assert set(c[part]) == {str(i) for i in rec["kv_layers"]}
            assert all(d == {"k": 0.0, "v": 0.0} for d in c[part].values()), (name, part)
    assert cmp["miss_vs_hit"]["cut"] == modes["hit"]["cached_tokens"] and cmp["miss_vs_split_first"]["cut"] == 0
    off = cmp["off_vs_miss"]  # the chunks against the one-piece prefill: close (not promised equal)
    assert off["cut"] == 0 and off["argmax_equal"] and off["logits_max_abs"] < 1e-3
