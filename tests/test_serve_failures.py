"""Requests that fail after their response started, and what clients and the log see (issue 17).

- A raw audio stream (`/v1/audio/speech`, `stream: true`, wav or pcm) that fails after its
  first chunk, by a shutdown abort or a lost worker, ends cleanly (the chunked body is
  terminated: the client reads a shorter file, no protocol error), and the server logs one
  line for it, never "Exception in ASGI application" with tracebacks.
- After a worker dies, clients (stream error lines, 503 bodies, `/health`) get one stable
  message, without the transport's source paths, peer addresses, ports or pids; the
  details are in the server log.

The speech walk is `tts_long` of `test_server_support.EXTRA_WALKS` (one audio chunk per
flow step, for as many steps as asked), so the streams outlive whatever ends them.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
pytest.importorskip("uvicorn", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="these tests use the openai client: pip install openai")

from test_server_support import (  # noqa: E402
    MODEL,
    Reader,
    compile_plan,
    get,
    metric,
    ndjson_lines,
    open_stream,
    post,
    serving,
    wait_for,
)

LONG = 1_000_000  # flow steps no test waits for
LOST = "a worker process was lost"  # the stable text of a lost worker (serve/server.py)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _speech(client: openai.OpenAI, fmt: str):  # noqa: ANN202 - the openai client's context manager
    return client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="alloy", input="a long stream", response_format=fmt,
        extra_body={"stream": True, "steps": LONG})


def _assert_clean_log(out: str, early: int) -> None:
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out
    ended = [line for line in out.splitlines() if "audio stream ended early" in line]
    assert len(ended) == early, out


def test_raw_speech_streams_end_cleanly_on_shutdown_abort(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, extra=("tts_long",))
    with serving(plan, "--shutdown-timeout", "1") as server:
        client = _client(server.base)
        with _speech(client, "wav") as wav, _speech(client, "pcm") as pcm:
            assert wav.headers["content-type"].startswith("audio/wav")
            server.proc.send_signal(signal.SIGTERM)
            # iter_bytes raises (httpx.RemoteProtocolError: incomplete chunked read) on a cut connection
            wav_data = b"".join(wav.iter_bytes())
            pcm_data = b"".join(pcm.iter_bytes())
        assert wav_data[:4] == b"RIFF" and len(wav_data) > 44 and (len(wav_data) - 44) % 2 == 0
        assert len(pcm_data) > 0 and len(pcm_data) % 2 == 0
        assert server.proc.wait(30) == 0
        out = server.output()
    _assert_clean_log(out, early=2)
    line = next(x for x in out.splitlines() if "audio stream ended early" in x)
    assert "shut down" in line


def test_lost_worker_stable_messages_details_in_log(tmp_path: Path) -> None:
    """The LM runs in a worker process (rank 1); killing it ends a raw speech stream cleanly,
    fails a native stream with the stable message, and /health and new requests say the same."""
    plan = compile_plan(tmp_path, placement="tests/placements/cpu2.yaml", extra=("tts_long", "slow"))
    with serving(plan) as server:
        base = server.base
        (worker,) = server.children()
        native = Reader(open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}}))
        with _speech(_client(base), "pcm") as pcm:
            wait_for(lambda: metric(base, "mstar_requests_running") == 2, 30, "both requests to run")
            os.kill(worker, signal.SIGKILL)
            audio = b"".join(pcm.iter_bytes())  # ends cleanly, shorter
        assert len(audio) > 0 and len(audio) % 2 == 0
        lines = ndjson_lines(native.result(60))
        err = lines[-1]
        assert err["type"] == "error" and err["finish_reason"] == "error"
        assert err["error"]["code"] == "engine_unavailable"
        status, health = get(base + "/health")
        status2, refused = post(base + "/v1/walks/chat", {"inputs": {"prompt": "x"}})
        status3, chat = post(base + "/v1/chat/completions", {"model": MODEL,
                                                            "messages": [{"role": "user", "content": "x"}]})
        assert (status, status2, status3) == (503, 503, 503)
        texts = [err["error"]["message"], json.loads(health)["error"], json.loads(refused)["error"]["message"],
                 json.loads(chat)["error"]["message"]]
        for text in texts:
            assert LOST in text, text
            # no pid, no peer address or port, no source path of the transport
            assert str(worker) not in text and "pid" not in text and "127.0.0.1" not in text, text
            assert not re.search(r"[/\\]\w+\.(cc|cpp|py)|:\d{2,5}\b", text), text
        assert json.loads(refused)["error"]["code"] == "engine_unavailable"
        assert server.terminate(30) == 0
        out = server.output()
    _assert_clean_log(out, early=1)
    # the details are in the server log, once
    detail = [line for line in out.splitlines() if "worker rank 1 lost" in line]
    assert len(detail) == 1 and f"pid {worker}" in detail[0], out


def test_internal_error_names_the_request_not_the_node_error(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """In process: a node fails for a reason that is not the request's input (a bug). The
    client gets a 500 naming the request id; the node's error text is in the server log."""
    import asyncio
    import threading

    httpx = pytest.importorskip("httpx")
    from mstar_runtime.api import MStar
    from mstar_runtime.serve.server import ServeConfig, create_app

    m = MStar.load(compile_plan(tmp_path, extra=("t2i",)), weights="init")
    secret = "transport failed at /src/gloo/pair.cc:537 [127.0.0.1]:4242"
    engine = m.conductor.workers[0].engines["flow"]
    run = engine.run

    def failing(phase: str, entries: list) -> list:  # flow.init is the t2i walk's first flow step
        if phase == "init":
            raise RuntimeError(secret)
        return run(phase, entries)

    engine.run = failing  # type: ignore[method-assign]
    try:
        app = create_app(m, ServeConfig(weights="init"))

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=30) as c:
                whole = await c.post("/v1/walks/t2i", json={"inputs": {"prompt": "x"}, "stream": False})
                images = await c.post("/v1/images/generations", json={"model": MODEL, "prompt": "x"})
                return whole, images

        with caplog.at_level("ERROR", logger="mstar_runtime.serve.server"):
            whole, images = asyncio.run(scenario())
        for r in (whole, images):
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "internal_error" and re.search(r"request req-\d+", err["message"]), err
            assert "pair.cc" not in err["message"] and "127.0.0.1" not in err["message"], err
        logged = [r.getMessage() for r in caplog.records if r.name == "mstar_runtime.serve.server"]
        assert sum(secret in x for x in logged) == 2, logged
    finally:
        done = threading.Event()
        threading.Thread(target=lambda: (m.close(), done.set()), daemon=True).start()
        assert done.wait(30)
