"""A bounded load test (64 concurrent clients) and the server's overhead on the first streamed item.

- 64 clients, each sending `ROUNDS` requests one after another (chat streamed with usage,
  chat whole, speech, native walk in turn), all at once against one server: no request is
  lost and every response is complete (streams end with their finish reason and [DONE],
  token counts match the usage, WAV sizes match their headers). Prints requests/s and the
  p50/p99 latency.
- Time to first audio chunk of the same `tts` request over HTTP (streamed speech) and
  through the Python API (`RequestHandle.stream`), one request at a time: prints both
  medians; their difference is the server's overhead.

The figures are printed (run with `-s` to see them) and loosely bounded, so a slow shared
box does not fail the suite; the completeness checks are strict.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install httpx")

from test_server_support import MODEL, Server, compile_plan, samples, serving  # noqa: E402

CLIENTS = 64
ROUNDS = 2
DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_plan(tmp_path_factory.mktemp("load"), extra=("tts",))


@pytest.fixture(scope="module")
def server(plan: Path) -> Iterator[Server]:
    with serving(plan) as s:
        yield s


def _check_sse(text: str) -> int:
    """Completion tokens of a complete chat stream (asserts the stream invariants)."""
    lines = [x[6:] for x in text.split("\n\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", text[-200:]
    chunks = [json.loads(x) for x in lines[:-1]]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in with_choices if c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(content.split(" ")) == 8
    return usage["completion_tokens"]


async def _one(c: httpx.AsyncClient, kind: int, i: int) -> float:
    prompt = f"client {i} says hello"
    t0 = time.perf_counter()
    if kind == 0:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            _check_sse((await r.aread()).decode())
    elif kind == 1:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": prompt}]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["message"]["content"].split(" ")) == 8
    elif kind == 2:
        r = await c.post("/v1/audio/speech", json={"model": MODEL, "input": prompt, "voice": "alloy",
                                                   "max_new": 24})
        assert r.status_code == 200, r.text
        data = r.content
        assert data[:4] == b"RIFF" and int.from_bytes(data[40:44], "little") == len(data) - 44 > 0
    else:
        r = await c.post("/v1/walks/generate", json={"inputs": {"prompt": prompt, "max_new": 8}})
        assert r.status_code == 200, r.text
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert lines[-1]["type"] == "done" and sum(x.get("output") == "tokens" for x in lines) >= 1
    return time.perf_counter() - t0


async def _load(base: str) -> tuple[list[float], float]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
        async def client(i: int) -> list[float]:
            return [await _one(c, (i + r) % 4, i) for r in range(ROUNDS)]

        t0 = time.perf_counter()
        per_client = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(CLIENTS))), DEADLINE_S)
        wall = time.perf_counter() - t0
    return [x for xs in per_client for x in xs], wall


def test_64_concurrent_clients_lose_nothing(server: Server) -> None:
    latencies, wall = asyncio.run(_load(server.base))
    assert len(latencies) == CLIENTS * ROUNDS
    q = statistics.quantiles(latencies, n=100)
    print(f"\nload: {len(latencies)} requests from {CLIENTS} concurrent clients in {wall:.2f} s = "
          f"{len(latencies) / wall:.1f} requests/s; latency p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms")
    metrics = httpx.get(server.base + "/metrics").text
    finished = sum(v for labels, v in samples(metrics, "mstar_requests_total") if labels["outcome"] == "finished")
    assert finished >= CLIENTS * ROUNDS
    assert [v for _, v in samples(metrics, "mstar_kv_pages_in_use")] == [0.0]
    assert [v for _, v in samples(metrics, "mstar_requests_active")] == [0.0]


def _first_audio_http(base: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=base, timeout=60) as c:
        for i in range(n):
            body = {"model": MODEL, "input": f"first audio {i}", "voice": "alloy", "max_new": 24, "stream": True}
            t0 = time.perf_counter()
            with c.stream("POST", "/v1/audio/speech", json=body) as r:
                got, first = b"", None
                for chunk in r.iter_raw():
                    got += chunk
                    if first is None and len(got) > 44:  # past the WAV header: the first samples
                        first = time.perf_counter() - t0
                assert first is not None and r.status_code == 200
                out.append(first)
    return out


def _first_audio_api(plan: Path, n: int) -> list[float]:
    import torch

    from mstar_runtime.api import MStar

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server subprocess runs (OMP_NUM_THREADS=1)
    out = []
    try:
        with MStar.load(plan, weights="init") as m:
            for i in range(n):
                t0 = time.perf_counter()
                h = m.submit("tts", {"text": f"first audio {i}", "max_new": 24})
                for name, _ in h.stream():
                    if name == "audio":
                        out.append(time.perf_counter() - t0)
                        break
                h.result(60)
    finally:
        torch.set_num_threads(threads)
    return out


def test_time_to_first_audio_http_vs_api(server: Server, plan: Path) -> None:
    n = 30
    http = _first_audio_http(server.base, n)
    api = _first_audio_api(plan, n)
    assert len(http) == len(api) == n
    h, a = statistics.median(http), statistics.median(api)
    print(f"\ntime to first audio chunk (median of {n}): HTTP {h * 1000:.2f} ms, Python API {a * 1000:.2f} ms, "
          f"server overhead {(h - a) * 1000:.2f} ms")
    assert h < a + 1.0  # loose: a shared box; the figure itself is what matters
