"""What an operator sees of the server: `/metrics` through prometheus_client (a `model_name`
label on every series, inter-token latency, the 0-1 KV usage gauge, process metrics,
OpenMetrics on request), `--api-key` (Bearer auth on every route but /health), the access
log (`--no-access-log`), and server options read from `MSTAR_*` environment variables.

Two servers in subprocesses: one with the defaults, one configured only through the
environment (`MSTAR_API_KEY`, `MSTAR_SERVED_MODEL_NAME`, `MSTAR_ACCESS_LOG=0`).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
pytest.importorskip("prometheus_client", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="pip install openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server_support import (  # noqa: E402
    MODEL,
    Reader,
    Server,
    compile_plan,
    get,
    metric,
    open_stream,
    post,
    samples,
    serving,
    wait_for,
)

KEY = "sk-test-7f3a"
SERVED = "tf-served"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_plan(tmp_path_factory.mktemp("ops"))


@pytest.fixture(scope="module")
def server(plan: Path) -> Iterator[Server]:
    with serving(plan) as s:
        yield s


@pytest.fixture(scope="module")
def secured(plan: Path) -> Iterator[Server]:
    env = {"MSTAR_API_KEY": KEY, "MSTAR_SERVED_MODEL_NAME": SERVED, "MSTAR_ACCESS_LOG": "0"}
    with serving(plan, env=env) as s:
        yield s


def request(url: str, *, key: str | None = None, headers: dict[str, str] | None = None,
            body: object | None = None) -> tuple[int, Any, bytes]:
    """(status, headers (case-insensitive), body) of a GET, or of a POST with a JSON `body`."""
    h = dict(headers or {})
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        data, h["Content-Type"] = json.dumps(body).encode(), "application/json"
    req = urllib.request.Request(url, data=data, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback test server
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


# ----------------------------------------------------------------------------- metrics
def test_metrics_are_prometheus_client_series(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=8, stream=True))
    assert chunks
    assert post(server.base + "/v1/audio/speech", {"model": MODEL, "input": "hello there"})[0] == 200
    status, headers, raw = request(server.base + "/metrics")
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = raw.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # the library's parser reads it all

    # every M* series names the model, as vLLM's do
    ours = [s for f in families.values() if f.name.startswith("mstar_") for s in f.samples]
    assert len(ours) > 50 and all(s.labels.get("model_name") == MODEL for s in ours)
    # inter-token latency and time per output token of the streamed chat reply
    assert metric(server.base, "mstar_inter_token_latency_seconds_count", 'walk="chat"') >= 1
    assert metric(server.base, "mstar_request_time_per_output_token_seconds_count", 'walk="chat"') == 1
    assert metric(server.base, "mstar_time_to_first_audio_seconds_count", 'walk="tts"') == 1
    assert families["mstar_inter_token_latency_seconds"].type == "histogram"
    # process metrics from prometheus_client's collectors
    assert metric(server.base, "process_resident_memory_bytes") > 10 << 20
    assert metric(server.base, "process_open_fds") > 0 and "python_info" in families
    # names and types the docs and dashboards use are unchanged
    for name, kind in (("mstar_requests", "counter"), ("mstar_kv_pages_in_use", "gauge"),
                       ("mstar_time_to_first_token_seconds", "histogram"), ("mstar_engine_steps", "counter")):
        assert families[name].type == kind, name
    assert "_created" not in text  # disabled: they double the lines and nothing reads them


def test_kv_usage_is_the_fraction_of_pages_in_use(server: Server) -> None:
    base = server.base
    assert metric(base, "mstar_kv_cache_usage_perc") == 0.0
    s = open_stream(base, "/v1/walks/slow", {"inputs": {"steps": 1_000_000}})
    reader = Reader(s)
    try:
        wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the slow request to hold KV pages")
        _, text = get(base + "/metrics")
        value = {name: v for name in ("mstar_kv_pages_in_use", "mstar_kv_pages_total", "mstar_kv_cache_usage_perc")
                 for _, v in samples(text.decode(), name)}
        assert 0 < value["mstar_kv_cache_usage_perc"] <= 1
        assert value["mstar_kv_cache_usage_perc"] == pytest.approx(value["mstar_kv_pages_in_use"]
                                                                   / value["mstar_kv_pages_total"])
    finally:
        reader.hang_up()
    wait_for(lambda: metric(base, "mstar_kv_cache_usage_perc") == 0.0, 30, "the pages to be freed")


def test_openmetrics_on_request(server: Server) -> None:
    status, headers, raw = request(server.base + "/metrics",
                                   headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert raw.endswith(b"# EOF\n") and b"mstar_kv_cache_usage_perc" in raw


def test_access_log_has_a_line_per_request(server: Server) -> None:
    assert get(server.base + "/v1/models?x=1")[0] == 200
    assert get(server.base + "/nope")[0] == 404
    wait_for(lambda: '"GET /nope HTTP/1.1" 404' in server.output(), 10, "the access log line")
    lines = [line for line in server.output().splitlines() if "mstar_runtime.serve.access" in line]
    models = [line for line in lines if '"GET /v1/models?x=1 HTTP/1.1" 200' in line]
    assert len(models) == 1 and models[0].split()[-1].endswith("s")  # ... 200 BYTES SECONDSs
    assert any('"POST /v1/chat/completions HTTP/1.1" 200' in line for line in lines)


# ----------------------------------------------------------------------------- --api-key
def test_api_key_guards_every_route_but_health_and_the_description(secured: Server) -> None:
    base = secured.base
    assert get(base + "/health") == (200, b'{"status":"ok"}')  # probes carry no key
    assert get(base + "/openapi.json")[0] == 200  # the API's description is no secret
    for path in ("/v1/models", "/metrics", "/v1/walks", "/nope"):
        for key, why in ((None, "needs an API key"), ("wrong", "incorrect API key")):
            status, headers, raw = request(base + path, key=key)
            assert status == 401, (path, key)
            err = json.loads(raw)["error"]
            assert err["code"] == "invalid_api_key" and why in err["message"] and headers["WWW-Authenticate"] == "Bearer"
    status, _, raw = request(base + "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert status == 401 and "Bearer" in json.loads(raw)["error"]["message"]
    status, _, raw = request(base + "/v1/walks/chat", key=None, body={"inputs": {"prompt": "x"}})
    assert status == 401  # refused before the body is looked at


def test_api_key_with_the_openai_client(secured: Server) -> None:
    good = openai.OpenAI(base_url=secured.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = good.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.model == SERVED and r.choices[0].finish_reason == "length"  # MSTAR_SERVED_MODEL_NAME took effect
    bad = openai.OpenAI(base_url=secured.base + "/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, _, raw = request(secured.base + "/metrics", key=KEY)
    assert status == 200
    text = raw.decode()
    refused = sum(v for labels, v in samples(text, "mstar_http_responses_total") if labels["code"] == "401")
    assert refused >= 1  # counted, with route "other" (refused before routing)
    finished = samples(text, "mstar_requests_total")
    assert finished and all(labels["model_name"] == SERVED for labels, _ in finished)
    doc = json.loads(request(secured.base + "/openapi.json", key=KEY)[2])
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []


def test_no_access_log_from_the_environment(secured: Server) -> None:
    assert get(secured.base + "/health")[0] == 200
    assert "mstar_runtime.serve.access" not in secured.output()  # MSTAR_ACCESS_LOG=0


def test_docs_list_exactly_the_series(server: Server) -> None:
    """docs/serving.md's metrics section names every series the server exports, and no other."""
    import re

    docs = (Path(__file__).resolve().parents[1] / "docs/serving.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Metrics (`GET /metrics`)"):docs.index("## Examples")]
    documented = set(re.findall(r"\b((?:mstar|process|python)_[a-z_]*[a-z])\b", section))
    _, raw = get(server.base + "/metrics")
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(raw.decode())}
    assert documented == exported, (f"documented only: {sorted(documented - exported)}; "
                                    f"exported only: {sorted(exported - documented)}")
