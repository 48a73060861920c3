"""Soak: the server under mixed load for a while (streamed speech and chat, clients that hang up,
bad requests), then checked for leaks and lost requests from outside.

One server (the test family, tiny, with a `tts` walk) is driven by the load generator
(tools/bench/serve.py): a closed loop of 6 clients and an open loop at a Poisson rate of
20 requests/s (at most 12 in flight) at once, each a 1:1 mix of streamed speech and
streamed chat, 25 % of the streams closed by the client after 1 to 3 chunks, plus a client
sending a bad request (7 kinds: bad JSON, an unknown field, a token count over the limit, an
empty message list, a wrong Content-Type, blank speech input, an unknown model) every 50 ms.
A warm-up of the same load comes first, so the baseline is taken once allocators and caches
have grown to their working size. Then:
- nothing lost: every request the client sent has exactly one end (ok, cancelled, or the
  expected 4xx), no request failed, the server answered no 5xx;
- `/metrics` agrees with the client: 200s per route = ok + cancelled streams, 4xx per route
  = the bad requests sent there, finished + cancelled requests per walk = the client's
  requests of that walk, none failed or timed out; the engine's own count of submitted
  requests equals the sum of its end states;
- no leak: KV pages in use, requests active / running / queued and HTTP requests in flight
  are back to 0; the server's open file descriptors are back to the baseline (within 2) once
  the client's connections are closed; its RSS at the end is within max(32 MiB, 10 %) of the
  baseline.

`test_soak_short` (default tier) runs 8 s of load; `test_soak` (marked `slow`) runs
$MSTAR_SOAK_S seconds (default 600) and prints the figures for the record:
`pytest -m slow tests/test_soak.py -s`. Linux only (/proc).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import load_script
from support import metric_total as total

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
httpx = pytest.importorskip("httpx", reason="the load generator needs httpx")
if not Path("/proc/self/status").exists():
    pytest.skip("the soak reads the server's RSS and descriptors from /proc", allow_module_level=True)

from test_server_support import ROOT, Server, compile_plan, serving, wait_for  # noqa: E402

SCRIPT = ROOT / "tools" / "bench" / "serve.py"
MODEL = "testfamily"
WARMUP_S = 2.0
SHORT_S = 8.0
SLOW_S = float(os.environ.get("MSTAR_SOAK_S", "600"))
RSS_MARGIN = (32 << 20, 0.10)  # bytes, fraction of the baseline: whichever is larger
FD_MARGIN = 2
CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
PROMPT = [{"role": "user", "content": "hi"}]
# (route, body bytes or JSON, Content-Type, expected status)
BAD: list[tuple[str, Any, str, int]] = [
    (CHAT, b"{not json", "application/json", 400),
    (CHAT, {"model": MODEL, "messages": PROMPT, "bogus": 1}, "application/json", 400),
    (CHAT, {"model": MODEL, "messages": PROMPT, "max_tokens": 1000}, "application/json", 400),
    (CHAT, {"model": MODEL, "messages": []}, "application/json", 400),
    (CHAT, {"model": MODEL, "messages": PROMPT}, "text/plain", 415),
    (SPEECH, {"model": MODEL, "input": "   "}, "application/json", 400),
    (SPEECH, {"model": "nope", "input": "hi"}, "application/json", 404),
]


bench = load_script(SCRIPT, "bench_serve")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_plan(tmp_path_factory.mktemp("soak"), extra=("tts",))


# ------------------------------------------------------------------------------ the server from outside
def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def steady_fds(pid: int) -> int:
    """The descriptor count once it stops changing (the last client's sockets closed on the server's side)."""
    seen = [fds(pid)]

    def same() -> bool:
        seen.append(fds(pid))
        return seen[-1] == seen[-2]

    wait_for(same, 10, "a steady descriptor count", every=0.3)
    return seen[-1]


def scrape(base: str) -> dict[str, float]:
    return {k: v for k, (_, v) in bench.parse_metrics(httpx.get(base + "/metrics", timeout=10).text).items()}


def idle(base: str) -> dict[str, float]:
    gauges = ("mstar_kv_pages_in_use", "mstar_requests_active", "mstar_requests_running", "mstar_queue_depth",
              "mstar_server_inflight")
    last: dict[str, float] = {}

    def quiet() -> bool:
        last.clear()
        last.update(scrape(base))
        return all(any(k.partition("{")[0] == g for k in last) and total(last, g) == 0 for g in gauges)

    try:
        wait_for(quiet, 15, "the server to hold no request", every=0.1)
    except AssertionError:
        raise AssertionError(f"leak: {', '.join(f'{g} = {total(last, g)}' for g in gauges)}") from None
    return last


# ------------------------------------------------------------------------------ load
async def bad_requests(base: str, seconds: float, sent: Counter, wrong: list[str]) -> None:
    """One bad request every 50 ms for `seconds`; `sent` counts (route, status) as answered."""
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=30, trust_env=False) as client:
        i = 0
        while time.perf_counter() < deadline:
            route, body, ctype, status = BAD[i % len(BAD)]
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await client.post(route, content=data, headers={"Content-Type": ctype})
            sent[route, r.status_code] += 1
            if r.status_code != status:
                wrong.append(f"{route} {body!r} ({ctype}): {r.status_code} {r.text[:200]}, expected {status}")
            i += 1
            await asyncio.sleep(0.05)


async def load(base: str, seconds: float, seed: int) -> tuple[list[dict[str, Any]], Counter, list[str]]:
    settings = bench.Settings(model=MODEL, max_tokens=8, speech_length_field="max_new", timeout_s=60)
    mix = [("speech", 1.0), ("chat", 1.0)]
    prompts = bench.builtin_prompts(97, 6, seed)
    closed = bench.RunSpec("closed", 6, 10**9, seconds, None, 0, 0.25, seed)
    opened = bench.RunSpec("open", 20.0, 10**9, seconds, 12, 0, 0.25, seed + 1)
    sent: Counter = Counter()
    wrong: list[str] = []
    runs = await asyncio.gather(bench.run(base, settings, closed, mix, prompts),
                                bench.run(base, settings, opened, mix, prompts),
                                bad_requests(base, seconds, sent, wrong))
    return list(runs[:2]), sent, wrong


def soak(server: Server, seconds: float) -> dict[str, Any]:
    pid = server.proc.pid
    warm, _, wrong = asyncio.run(load(server.base, WARMUP_S, seed=100))
    assert not wrong and all(r["failed"] == 0 for r in warm), (wrong, [r["errors"] for r in warm])
    before = idle(server.base)
    fd0, rss0 = steady_fds(pid), rss(pid)
    peak = [rss0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], rss(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        runs, sent, wrong = asyncio.run(load(server.base, seconds, seed=0))
    finally:
        stop.set()
        sampler.join(5)
    wall = time.perf_counter() - t0
    after = idle(server.base)
    fd_end: list[int] = []
    try:  # the server closes a connection when it reads the client's close: give it a moment
        wait_for(lambda: fd_end.append(fds(pid)) or fd_end[-1] <= fd0 + FD_MARGIN, 10, "descriptors back")
    except AssertionError:
        pass
    return {"runs": runs, "sent": sent, "wrong": wrong, "before": before, "after": after, "wall_s": wall,
            "rss0": rss0, "rss1": rss(pid), "rss_peak": peak[0], "fd0": fd0,
            "fd1": fd_end[-1] if fd_end else fds(pid)}


def check(rec: dict[str, Any]) -> str:
    """Asserts the soak's promises (module docstring); returns a one-line summary of its figures."""
    runs, sent, before, after = rec["runs"], rec["sent"], rec["before"], rec["after"]
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    # nothing lost, no 5xx, every bad request answered as expected
    assert not rec["wrong"], rec["wrong"][:5]
    for r in runs:
        assert r["failed"] == 0, (r["run"], r["errors"], r["error_samples"])
        assert r["requests"] == r["ok"] + r["cancelled"] > 0
    fives = {k: v for k, v in delta.items()
             if k.startswith("mstar_http_responses_total") and 'code="5' in k and v}
    assert not fives, fives
    # /metrics agrees with the client
    for workload, route, walk in (("chat", CHAT, "chat"), ("speech", SPEECH, "tts")):
        figs = [r["workloads"][workload] for r in runs if workload in r["workloads"]]
        streams = sum(f["ok"] + f["cancelled"] for f in figs)
        assert streams > 0
        assert total(delta, "mstar_http_responses_total", route=route, code="200") == streams
        for code in (400, 404, 415):
            got = total(delta, "mstar_http_responses_total", route=route, code=str(code))
            assert got == sent[route, code], (route, code, got, sent[route, code])
        ended = sum(total(delta, "mstar_requests_total", walk=walk, outcome=o)
                    for o in ("finished", "cancelled"))
        assert ended == streams, (walk, ended, streams)
        cancelled = total(delta, "mstar_requests_total", walk=walk, outcome="cancelled")
        assert cancelled <= sum(f["cancelled"] for f in figs)
        for bad in ("failed", "timeout", "shutdown"):
            assert total(delta, "mstar_requests_total", walk=walk, outcome=bad) == 0
    engine: Counter = Counter()  # the engine's own count, by state
    for key, value in after.items():
        head, _, rest = key.partition("{")
        if head == "mstar_engine_requests_total":
            engine[dict(re.findall(r'(\w+)="([^"]*)"', rest)).get("state")] += value
    assert engine.get("submitted", 0) == sum(v for s, v in engine.items() if s != "submitted") > 0, engine
    # no leak (the gauges were checked by `idle`)
    assert rec["fd1"] <= rec["fd0"] + FD_MARGIN, f"descriptors: {rec['fd0']} before, {rec['fd1']} after"
    margin = max(RSS_MARGIN[0], RSS_MARGIN[1] * rec["rss0"])
    grew = rec["rss1"] - rec["rss0"]
    assert grew <= margin, f"RSS grew {grew / 2**20:.1f} MiB (from {rec['rss0'] / 2**20:.1f} MiB)"
    n = sum(r["requests"] for r in runs)
    return (f"soak {rec['wall_s']:.0f} s: {n} streams ({sum(r['ok'] for r in runs)} ok, "
            f"{sum(r['cancelled'] for r in runs)} cancelled by the client, 0 failed), "
            f"{sum(sent.values())} bad requests answered 4xx, 0 5xx; RSS {rec['rss0'] / 2**20:.1f} -> "
            f"{rec['rss1'] / 2**20:.1f} MiB (peak {rec['rss_peak'] / 2**20:.1f}), "
            f"descriptors {rec['fd0']} -> {rec['fd1']}, KV pages in use 0, requests active 0")


def test_soak_short(plan: Path) -> None:
    with serving(plan) as server:
        print("\n" + check(soak(server, SHORT_S)))


@pytest.mark.slow
def test_soak(plan: Path) -> None:
    with serving(plan) as server:
        print("\n" + check(soak(server, SLOW_S)))
