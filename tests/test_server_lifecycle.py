"""Server lifecycle: client disconnects, SIGTERM drain and abort, a dead worker, a dead engine.

Requests that must outlive a step of the test use the `slow` walk of
`test_server_support.EXTRA_WALKS` (it holds a KV context and streams one item per ~1 ms
flow step, for as many steps as asked), so each scenario controls its own timing. Every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
pytest.importorskip("uvicorn", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")

from test_server_support import (  # noqa: E402
    ROOT,
    Reader,
    Server,
    compile_plan,
    get,
    metric,
    ndjson_lines,
    open_stream,
    post,
    read_all,
    send_request,
    serving,
    wait_for,
)

from mstar_runtime.plan.loader import load_plan  # noqa: E402

LONG = 1_000_000  # steps of `slow` that no test waits for (~20 min)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_plan(tmp_path_factory.mktemp("lifecycle"))


@pytest.fixture
def server(plan: Path) -> Iterator[Server]:
    with serving(plan) as s:
        yield s


# ----------------------------------------------------------------------------- disconnects
def test_disconnect_cancels_and_frees_pages(server: Server) -> None:
    base = server.base
    assert metric(base, "mstar_kv_pages_in_use") == 0
    # streamed: hang up after the first lines
    s = open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}})
    wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the slow request to hold KV pages")
    s.close()
    wait_for(lambda: metric(base, "mstar_kv_pages_in_use") == 0 and metric(base, "mstar_requests_active") == 0,
             30, "the pages of a disconnected stream to be freed")
    assert metric(base, "mstar_requests_total", 'walk="slow",outcome="cancelled"') == 1
    # not streamed: the client gives up while the server waits for the whole result
    host, port = base.removeprefix("http://").split(":")
    c = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps({"inputs": {"steps": LONG}, "stream": False}).encode()
    c.sendall(f"POST /v1/walks/slow HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the second slow request to run")
    c.close()
    wait_for(lambda: metric(base, "mstar_kv_pages_in_use") == 0 and metric(base, "mstar_requests_active") == 0,
             30, "the pages of a disconnected non-streamed request to be freed")
    assert metric(base, "mstar_requests_total", 'walk="slow",outcome="cancelled"') == 2
    # the engine serves on
    assert post(base + "/v1/walks/slow", {"inputs": {"steps": 3}, "stream": False})[0] == 200


def test_chat_stream_disconnect(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.chat.completions.create(model="testfamily", messages=[{"role": "user", "content": "hi"}],
                                            stream=True)
    next(iter(stream))
    stream.close()
    wait_for(lambda: metric(server.base, "mstar_requests_active") == 0, 30, "the chat request to end")
    assert metric(server.base, "mstar_kv_pages_in_use") == 0


# ----------------------------------------------------------------------------- SIGTERM
def test_sigterm_drains_then_aborts(tmp_path: Path) -> None:
    """SIGTERM stops admission; requests in flight run on through the drain window; those
    still running when it ends are aborted with finish reason "shutdown".

    Nothing here depends on how many steps the machine runs per second. The plan admits
    two requests at a time (max_batch 2), and both slots hold `slow` requests of LONG steps,
    which provably cannot finish within the window. The short request therefore waits in the
    queue when SIGTERM arrives: it cannot start, let alone end, before the signal. The test
    then hangs up one long request (the client leaves: cancelled), which frees a slot; the
    short request runs its three steps inside the window and ends with "done" while the
    other long request is still running; that one is aborted when the window closes."""
    placement = tmp_path / "cpu_b2.yaml"
    placement.write_text((ROOT / "placements/cpu.yaml").read_text().replace("max_batch: 8", "max_batch: 2"))
    plan2 = compile_plan(tmp_path, placement=str(placement), extra=("slow",))
    assert load_plan(plan2).max_batch == 2
    drain, short_steps = 5, 3
    with serving(plan2, "--shutdown-timeout", str(drain)) as server:
        base = server.base
        leaving = Reader(open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}}))
        staying = Reader(open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}}))
        short = Reader(send_request(base, "/v1/walks/slow", {"inputs": {"steps": short_steps}}))
        wait_for(lambda: metric(base, "mstar_requests_running") == 2 and metric(base, "mstar_queue_depth") == 1,
                 30, "two long requests running and the short one queued")
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: get(base + "/health")[0] == 503, 10, "/health to report draining")
        assert json.loads(get(base + "/health")[1]) == {"status": "draining"}
        status, raw = post(base + "/v1/walks/chat", {"inputs": {"prompt": "late"}})
        assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
        assert metric(base, "mstar_queue_depth") == 1 and not short.ended.is_set()  # still waiting for a slot
        leaving.hang_up()  # frees a slot: the short request starts inside the drain window
        short_raw = short.result(60)
        assert short_raw.startswith(b"HTTP/1.1 200"), short_raw[:200]
        short_lines = ndjson_lines(short_raw)
        assert short_lines[-1]["type"] == "done" and len(short_lines) == short_steps + 1, short_lines[-1]
        assert not staying.ended.is_set()  # the short one finished inside the window, before the abort
        long_lines = ndjson_lines(staying.result(60))
        assert long_lines[-1]["type"] == "error" and long_lines[-1]["finish_reason"] == "shutdown"
        assert "shut down" in long_lines[-1]["error"]["message"]
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 >= drain - 0.5  # the long request had its whole drain window
        out = server.output()
        assert "draining 3 request(s)" in out and "aborting 1 request(s)" in out, out


def test_sigterm_when_idle_exits_at_once(plan: Path) -> None:
    with serving(plan) as server:
        t0 = time.monotonic()
        assert server.terminate(30) == 0
        assert time.monotonic() - t0 < 10


# ----------------------------------------------------------------------------- dead worker / engine
def test_dead_worker_fails_requests_and_health(tmp_path: Path) -> None:
    """The LM runs in a worker process (rank 1); killing it fails the in-flight request with
    an error (not a hang), turns /health to 503, refuses new requests, leaves no orphan."""
    plan2 = compile_plan(tmp_path, placement="tests/placements/cpu2.yaml")
    with serving(plan2) as server:
        base = server.base
        workers = server.children()
        assert len(workers) == 1, workers
        s = open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}})
        wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the slow request to run")
        os.kill(workers[0], signal.SIGKILL)
        lines = ndjson_lines(read_all(s, 60))
        assert lines[-1]["type"] == "error" and lines[-1]["finish_reason"] == "error"
        assert lines[-1]["error"]["code"] == "engine_unavailable"
        status, raw = get(base + "/health")
        assert status == 503 and json.loads(raw)["status"] == "unhealthy"
        status, raw = post(base + "/v1/walks/chat", {"inputs": {"prompt": "x"}})
        assert status == 503 and json.loads(raw)["error"]["code"] == "engine_unavailable"
        assert metric(base, "mstar_engine_healthy") == 0
        assert server.terminate(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                   for pid in workers)


def test_dead_engine_thread(plan: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In process: the engine thread dies mid-request; the request fails with 503, /health is 503.
    The client gets the stable message; the exception is in the server log."""
    httpx = pytest.importorskip("httpx")
    from mstar_runtime.api import MStar
    from mstar_runtime.serve.server import ServeConfig, create_app

    m = MStar.load(plan, weights="init")
    try:
        app = create_app(m, ServeConfig(weights="init"))

        async def scenario() -> tuple[int, dict, int]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
                pending = asyncio.ensure_future(c.post("/v1/walks/slow", json={"inputs": {"steps": LONG},
                                                                               "stream": False}))
                deadline = time.monotonic() + 30
                while m.stats()["kv_used_pages"] < 1:
                    assert time.monotonic() < deadline, "the slow request never ran"
                    await asyncio.sleep(0.02)

                def boom() -> bool:
                    raise RuntimeError("injected engine fault")

                m.conductor.step = boom  # type: ignore[method-assign]
                r = await asyncio.wait_for(pending, 30)
                health = await c.get("/health")
                return r.status_code, r.json(), health.status_code

        with caplog.at_level("ERROR", logger="mstar_runtime.serve.server"):
            status, body, health = asyncio.run(scenario())
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        assert "the engine thread stopped" in body["error"]["message"]
        assert "injected" not in body["error"]["message"]
        assert health == 503
        logged = [r.getMessage() for r in caplog.records if r.name == "mstar_runtime.serve.server"]
        assert len([x for x in logged if "injected engine fault" in x]) == 1, logged
    finally:
        done = threading.Event()
        threading.Thread(target=lambda: (m.close(), done.set()), daemon=True).start()
        assert done.wait(30)
