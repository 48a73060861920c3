"""The load generator (tools/bench/serve.py) against our server on tiny plans, from outside over HTTP.

Servers (subprocesses, `--weights init`): the test family with `tts` and `t2i` (chat,
speech, images), Orpheus tiny (speech: SNAC windows of 2048 samples), BAGEL tiny (images,
and chat with an `image_url` part, served by its `understand` walk). Checked:
- each mode (closed loop at two concurrencies, open loop at a Poisson rate and at `inf`) and
  each workload, through `main` and its JSON: every request counted once (ok + failed +
  cancelled = sent, warm-up apart), the figures consistent with the requests behind them
  (TTFT / TTFA <= latency, ITL gaps inside the stream, tokens from the usage chunk, audio
  seconds = PCM bytes / (rate x 2), RTF = latency / audio seconds, totals / duration =
  per-second figures, p50 <= p90 <= p99) and with the server's own `/metrics` counts;
- the same seeded speech request gives the same PCM bytes streamed raw, streamed as SSE and
  whole, and Orpheus' audio is whole SNAC windows;
- failures are reported, never crashed on: a wrong model (404s), a prompt row over the
  token limit (400s among successes), a wrong API key (401s; the right one is sent as a
  bearer token), an unreachable server, and a server killed mid-run;
- the parsers (WAV headers with extra chunks, fed a byte at a time; SSE events; JSONL
  prompt sets and their errors; the Poisson schedule; /metrics text) on their own;
- the script imports nothing of the runtime.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import load_script
from support import metric_total as total

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
pytest.importorskip("httpx", reason="the load generator needs httpx")

from test_server_support import ROOT, Server, compile_plan, metric, serving, wait_for  # noqa: E402

SCRIPT = ROOT / "tools" / "bench" / "serve.py"
MODEL = "testfamily"
WINDOW = 2048  # Orpheus: samples per released SNAC window
TF_LIMIT = 33  # the test family's token limit (max_new_tokens 32 + the prefill's token)


bench = load_script(SCRIPT, "bench_serve")


# ------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def tf_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_plan(tmp_path_factory.mktemp("bench-serve"), extra=("tts", "t2i"))


@pytest.fixture(scope="module")
def tf(tf_plan: Path) -> Iterator[Server]:
    with serving(tf_plan) as s:
        yield s


def _compiled(walk: Path, out: Path) -> Path:
    from mstarc.cli import main as mstarc

    plan = out / f"{walk.stem}-tiny.plan"
    assert mstarc(["compile", str(walk), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(plan)]) == 0
    return plan


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # the tiny variant samples only audio ids (audio_only), so random weights still speak
    with serving(_compiled(ROOT / "models/orpheus/orpheus.walk", tmp_path_factory.mktemp("orpheus"))) as s:
        yield s


@pytest.fixture(scope="module")
def bagel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(_compiled(ROOT / "models/bagel/bagel.walk", tmp_path_factory.mktemp("bagel"))) as s:
        yield s


@pytest.fixture(scope="module")
def qwen3_omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(_compiled(ROOT / "models/qwen3_omni/qwen3_omni.walk", tmp_path_factory.mktemp("qwen3_omni"))) as s:
        yield s


# ------------------------------------------------------------------------------ helpers
def run_main(tmp_path: Path, base: str, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / f"serve-{time.monotonic_ns()}.json"
    # 8-word prompts: with its chat template a 12-word prompt can pass the tiny test family's
    # 96-token context (a 400 the runs would count as a failure)
    rc = bench.main(["--base-url", base, "--out", str(out), "--timeout", "60", "--prompt-words", "8", *args])
    return rc, json.loads(out.read_text())


def send_all(base: str, settings: Any, jobs: list[Any], concurrency: int = 2) -> list[Any]:
    """The Results of `jobs`, sent `concurrency` at a time (the per-request view behind the figures)."""
    async def go() -> list[Any]:
        async with bench.http_client(base, None, concurrency, False, 60.0) as client:
            sem = asyncio.Semaphore(concurrency)

            async def one(job: Any) -> Any:
                async with sem:
                    return await bench.send(client, settings, job)

            return list(await asyncio.gather(*(one(j) for j in jobs)))

    return asyncio.run(go())


def check_counts(run: dict[str, Any], sent: int) -> None:
    assert run["requests"] == sent == run["ok"] + run["failed"] + run["cancelled"]
    assert sum(run["errors"].values()) == run["failed"]
    assert sum(f["requests"] for f in run["workloads"].values()) == sent
    assert math.isclose(run["request_throughput"], run["ok"] / run["duration_s"], rel_tol=1e-9)
    for fig in run["workloads"].values():
        for value in fig.values():
            if isinstance(value, dict) and value.get("n"):
                assert value["min"] <= value["p50"] <= value["p90"] <= value["p99"] <= value["max"]


def requests_total(base: str, walk: str, outcome: str) -> float:
    return metric(base, "mstar_requests_total", f'walk="{walk}",outcome="{outcome}"')


def idle(base: str) -> None:
    """The server holds no request and no KV page (cancellations are freed on the engine's next step)."""
    def free() -> bool:
        return metric(base, "mstar_kv_pages_in_use") == 0 and metric(base, "mstar_requests_active") == 0

    wait_for(free, 10, "the server to free every request")


def sine_wav(samples: int, rate: int = 16000, extra_chunk: bytes = b"") -> bytes:
    pcm = b"".join(struct.pack("<h", int(8000 * math.sin(i / 5))) for i in range(samples))
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + fmt + extra_chunk + b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", len(body)) + body


# ------------------------------------------------------------------------------ chat
def test_chat_closed_loop_figures_match_the_requests_and_the_server(tf: Server, tmp_path: Path) -> None:
    before = requests_total(tf.base, "chat", "finished")
    rc, rec = run_main(tmp_path, tf.base, "--workload", "chat", "--concurrency", "1,4",
                       "--num-requests", "12", "--max-tokens", "8", "--warmup", "2", "--scrape-metrics")
    assert rc == 0 and rec["model"] == MODEL and rec["served_models"] == [MODEL]
    assert [r["run"] for r in rec["runs"]] == ["closed c=1", "closed c=4"]
    for run in rec["runs"]:
        check_counts(run, 12)
        assert run["ok"] == 12 and run["warmup"] == {"sent": 2, "ok": 2}
        fig = run["workloads"]["chat"]
        assert fig["tokens_from"] == {"usage": 12} and fig["finish_reasons"] == {"length": 12}
        assert fig["output_tokens"]["min"] == fig["output_tokens"]["max"] == 8
        assert fig["output_tokens_total"] == 96
        assert math.isclose(fig["output_tokens_per_s"], 96 / run["duration_s"], rel_tol=1e-9)
        assert fig["ttft_ms"]["max"] <= fig["latency_ms"]["max"] and fig["ttft_ms"]["n"] == 12
        assert fig["prompt_tokens_total"] > 0
        # the server's own count over the timed part (after the warm-up): the 12 requests
        delta = run["server_metrics"]["delta"]
        assert total(delta, "mstar_requests_total", walk="chat", outcome="finished") == 12
        assert total(delta, "mstar_completion_tokens_total", walk="chat") == 96
    assert requests_total(tf.base, "chat", "finished") - before == 2 * (12 + 2)

    # per request: TTFT and the gaps between text chunks lie inside the request's latency
    settings = bench.Settings(model=MODEL, max_tokens=8)
    jobs = [bench.Job(i, "chat", bench.Prompt(f"hello {i}"), None) for i in range(6)]
    results = send_all(tf.base, settings, jobs)
    for r in results:
        assert r.ok and r.status == 200 and r.output_tokens == 8 and r.chunks >= 1
        assert len(r.itl) == r.chunks - 1 and all(x >= 0 for x in r.itl)
        assert 0 < r.first <= r.first + sum(r.itl) <= r.latency


def test_chat_open_loop_with_a_jsonl_prompt_set(tf: Server, tmp_path: Path) -> None:
    rows = ['"a bare string prompt"', '{"prompt": "four tokens only", "max_tokens": 4}',
            '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}',
            "# a comment line", "",
            f'{{"prompt": "over the limit", "max_tokens": {TF_LIMIT + 1}}}', '{"text": "the text key"}']
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    rate, n = 40.0, 10
    rc, rec = run_main(tmp_path, tf.base, "--workload", "chat", "--request-rate", f"{rate},inf",
                       "--num-requests", str(n), "--max-tokens", "6", "--prompts", str(prompts),
                       "--warmup", "0", "--seed", "3")
    assert rc == 1  # some requests failed: reported in the JSON and the table, the run went on
    for run in rec["runs"]:
        check_counts(run, n)
        # prompt i is row i % 5: rows 3 (over the limit) fail, the others succeed
        bad = sum(i % 5 == 3 for i in range(n))
        assert run["failed"] == bad and run["errors"] == {"HTTP 400 max_tokens_too_large": bad}
        assert "max_tokens" in run["error_samples"][0]
        fig = run["workloads"]["chat"]
        assert fig["output_tokens"]["min"] == 4 and fig["output_tokens"]["max"] == 6
    # open loop: request i is not sent before its Poisson time
    assert rec["runs"][0]["duration_s"] >= bench.poisson_times(n, rate, 3)[-1]
    assert rec["runs"][0]["run"] == "open r=40/s" and rec["runs"][1]["run"] == "open r=inf/s"


# ------------------------------------------------------------------------------ speech
def test_speech_on_orpheus_counts_the_streamed_audio(orpheus: Server, tmp_path: Path) -> None:
    rc, rec = run_main(tmp_path, orpheus.base, "--workload", "speech", "--concurrency", "2",
                       "--num-requests", "4", "--max-tokens", "64", "--warmup", "1", "--scrape-metrics")
    assert rc == 0 and rec["model"] == "orpheus"
    run = rec["runs"][0]
    check_counts(run, 4)
    fig = run["workloads"]["speech"]
    assert fig["sample_rates"] == [24000] and fig["silent"] == 0
    assert fig["audio_bytes_total"] % (2 * WINDOW) == 0 and fig["audio_bytes_total"] > 0
    assert math.isclose(fig["audio_s_total"], fig["audio_bytes_total"] / (24000 * 2), rel_tol=1e-9)
    assert math.isclose(fig["audio_s_per_s"], fig["audio_s_total"] / run["duration_s"], rel_tol=1e-9)
    assert fig["ttfa_ms"]["max"] <= fig["latency_ms"]["max"]
    rtf = fig["rtf"]
    assert 0 <= fig["realtime_streams"] <= 4
    if rtf["max"] < 1 or rtf["min"] >= 1:
        assert fig["realtime_streams"] == (4 if rtf["max"] < 1 else 0)
    server_audio = total(run["server_metrics"]["delta"], "mstar_audio_seconds_total", walk="tts")
    assert math.isclose(server_audio, fig["audio_s_total"], rel_tol=1e-6)  # the server sent what we counted

    # one seeded request three ways: the same PCM bytes, whole windows, consistent figures
    prompt = bench.Prompt("Hello from M star.", extra={"seed": 7})
    got = {}
    for stream in ("audio", "sse", "none"):
        settings = bench.Settings(model="orpheus", max_tokens=64, speech_stream=stream)
        (r,) = send_all(orpheus.base, settings, [bench.Job(0, "speech", prompt, None)])
        assert r.ok, (stream, r.error, r.message)
        assert r.audio_bytes % (2 * WINDOW) == 0 and r.sample_rate == 24000 and r.bytes_per_second == 48000
        assert math.isclose(r.audio_s, r.audio_bytes / 48000) and 0 < r.first <= r.latency
        assert r.stall >= 0 and r.chunks >= 1
        got[stream] = r.audio_bytes
    assert got["audio"] == got["sse"] == got["none"] > 0


def test_speech_takes_its_voice_from_the_served_model(qwen3_omni: Server, orpheus: Server, tmp_path: Path) -> None:
    """Without --voice the run sends the served model's default_voice (GET /v1/models):
    Qwen3-Omni's speaker `ethan` (Orpheus' `tara` is a 400 there), Orpheus' `tara`."""
    rc, rec = run_main(tmp_path, qwen3_omni.base, "--workload", "speech", "--num-requests", "1",
                       "--speech-length-field", "", "--extra-body", '{"talker_max_frames": 2}')
    assert rc == 0 and rec["settings"]["voice"] == "ethan", rec["runs"][0]["errors"]
    assert rec["runs"][0]["ok"] == 1
    assert bench.served_voice(asyncio.run(bench.served_models(orpheus.base, None, False)), "orpheus") == "tara"
    rc, rec = run_main(tmp_path, qwen3_omni.base, "--workload", "speech", "--num-requests", "1", "--voice", "tara",
                       "--speech-length-field", "", "--extra-body", '{"talker_max_frames": 2}')
    assert rc == 1 and rec["settings"]["voice"] == "tara" and rec["runs"][0]["failed"] == 1  # an unknown speaker


def test_speech_pcm_rate_comes_from_the_response(tf: Server, tmp_path: Path) -> None:
    # a wrong --sample-rate is overridden by the server's X-Sample-Rate header (pcm has no header of its own)
    rc, rec = run_main(tmp_path, tf.base, "--workload", "speech", "--speech-format", "pcm",
                       "--sample-rate", "8000", "--speech-length-field", "max_new", "--max-tokens", "24",
                       "--num-requests", "3")
    assert rc == 0
    fig = rec["runs"][0]["workloads"]["speech"]
    assert fig["sample_rates"] == [24000]
    assert math.isclose(fig["audio_s_total"], fig["audio_bytes_total"] / 48000, rel_tol=1e-9)
    assert fig["rtf"]["n"] == 3 and fig["rtf"]["min"] > 0


# ------------------------------------------------------------------------------ images, image chat
def test_images_and_image_chat_on_bagel(bagel: Server, tmp_path: Path) -> None:
    rc, rec = run_main(tmp_path, bagel.base, "--workload", "images", "--concurrency", "2",
                       "--num-requests", "3", "--image-size", "32x32", "--extra-body", '{"num_timesteps": 3}',
                       "--warmup", "1")
    assert rc == 0, rec["runs"][0]["error_samples"]
    run = rec["runs"][0]
    check_counts(run, 3)
    fig = run["workloads"]["images"]
    assert fig["images_total"] == 3 and fig["image_bytes_total"] > 3 * 8
    assert math.isclose(fig["images_per_s"], 3 / run["duration_s"], rel_tol=1e-9)

    rc, rec = run_main(tmp_path, bagel.base, "--workload", "chat", "--chat-image-size", "24x16",
                       "--max-tokens", "4", "--num-requests", "2", "--warmup", "0", "--scrape-metrics")
    assert rc == 0, rec["runs"][0]["error_samples"]
    assert rec["runs"][0]["workloads"]["chat"]["output_tokens_total"] == 8
    # the image part went to the understand walk (chat takes no image)
    delta = rec["runs"][0]["server_metrics"]["delta"]
    assert total(delta, "mstar_requests_total", walk="understand", outcome="finished") == 2


# ------------------------------------------------------------------------------ cancellations and failures
def test_cancelled_streams_are_counted_apart_and_freed(tf: Server, tmp_path: Path) -> None:
    outcomes = ("finished", "cancelled", "failed")
    before = {(w, o): requests_total(tf.base, w, o) for w in ("chat", "tts") for o in outcomes}
    rc, rec = run_main(tmp_path, tf.base, "--workload", "chat=1,speech=1", "--speech-length-field", "max_new",
                       "--max-tokens", "24", "--concurrency", "4", "--num-requests", "30",
                       "--cancel-fraction", "0.6", "--warmup", "0")
    assert rc == 0
    run = rec["runs"][0]
    check_counts(run, 30)
    assert run["failed"] == 0 and run["cancelled"] > 0
    idle(tf.base)  # a hang-up is seen by the server a moment after the client's last byte
    after = {k: requests_total(tf.base, *k) - v for k, v in before.items()}
    # every request the client sent ended on the server as finished or cancelled (one that had
    # already finished when the client hung up counts as finished there)
    for walk, workload in (("chat", "chat"), ("tts", "speech")):
        assert after[walk, "finished"] + after[walk, "cancelled"] == run["workloads"][workload]["requests"]
        assert after[walk, "cancelled"] <= run["workloads"][workload]["cancelled"]
        assert after[walk, "failed"] == 0


def test_errors_are_reported_not_raised(tf: Server, tmp_path: Path) -> None:
    rc, rec = run_main(tmp_path, tf.base, "--model", "nope", "--workload", "chat=1,speech=1,images=1",
                       "--num-requests", "6", "--warmup", "1")
    assert rc == 1
    run = rec["runs"][0]
    check_counts(run, 6)
    assert run["failed"] == 6 and run["errors"] == {"HTTP 404 model_not_found": 6}
    assert "nope" in run["error_samples"][0]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc, rec = run_main(tmp_path, dead, "--model", MODEL, "--num-requests", "3", "--concurrency", "2")
    assert rc == 1 and rec["served_models"] == []
    assert rec["runs"][0]["failed"] == 3 and list(rec["runs"][0]["errors"]) == ["ConnectError"]
    # no --model and no server to ask for one: one error line
    assert bench.main(["--base-url", dead, "--out", str(tmp_path / "x.json")]) == 1


def test_api_key_is_sent_as_a_bearer_token(tf_plan: Path, tmp_path: Path) -> None:
    with serving(tf_plan, "--api-key", "sekret") as server:
        rc, rec = run_main(tmp_path, server.base, "--api-key", "sekret", "--max-tokens", "4",
                           "--num-requests", "2")
        assert rc == 0 and rec["served_models"] == [MODEL] and rec["runs"][0]["ok"] == 2
        rc, rec = run_main(tmp_path, server.base, "--api-key", "wrong", "--model", MODEL,
                           "--num-requests", "2")
        assert rc == 1 and rec["served_models"] == []  # GET /v1/models wants the key too
        assert rec["runs"][0]["errors"] == {"HTTP 401 invalid_api_key": 2}


def test_a_server_that_dies_mid_run_is_reported(tf_plan: Path, tmp_path: Path) -> None:
    server = Server(tf_plan)
    out: dict[str, Any] = {}
    try:
        n = 600

        def drive() -> None:
            out["rc"], out["rec"] = run_main(tmp_path, server.base, "--workload", "chat=1,speech=1",
                                             "--speech-length-field", "max_new", "--max-tokens", "8",
                                             "--concurrency", "4", "--num-requests", str(n), "--warmup", "0")

        t = threading.Thread(target=drive, daemon=True)
        t.start()
        wait_for(lambda: requests_total(server.base, "chat", "finished") >= 10, 30, "some requests to finish")
        server.proc.kill()
        t.join(60)
        assert not t.is_alive(), "the load generator did not end after the server died"
    finally:
        server.stop()
    assert out["rc"] == 1
    run = out["rec"]["runs"][0]
    check_counts(run, n)
    assert run["ok"] >= 10 and run["failed"] > 0
    # refused connections after the kill; a stream cut in the middle, if one was running
    assert set(run["errors"]) <= {"ConnectError", "RemoteProtocolError", "ReadError", "incomplete stream"}
    assert "ConnectError" in run["errors"]


# ------------------------------------------------------------------------------ parsers and schedules
def test_wav_stream_finds_the_data_chunk_fed_a_byte_at_a_time() -> None:
    # a LIST chunk of odd size (so padded) before the data chunk
    wav = sine_wav(100, rate=16000, extra_chunk=b"LIST" + struct.pack("<I", 5) + b"abcde\x00")
    w = bench.WavStream(True, 24000)
    assert sum(w.feed(wav[i:i + 1]) for i in range(len(wav))) == 200
    assert (w.rate, w.channels, w.width, w.bytes_per_second) == (16000, 1, 2, 32000)
    w = bench.WavStream(True, 24000)
    assert w.feed(wav) == 200  # all at once
    with pytest.raises(ValueError, match="not a WAV"):
        bench.WavStream(True, 24000).feed(b"\x00" * 64)
    assert bench.WavStream(True, 24000, sniff=True).feed(b"\x01" * 64) == 64  # SSE deltas of raw pcm
    assert bench.WavStream(False, 24000).feed(b"\x01\x02\x03") == 3


def test_stall_and_sse_parsing() -> None:
    assert bench.stall_seconds([]) == 0.0
    assert bench.stall_seconds([(0.0, 1.0), (0.5, 1.0), (1.9, 1.0)]) == 0.0  # always ahead of the player
    assert math.isclose(bench.stall_seconds([(0.0, 0.5), (1.0, 0.5), (1.2, 1.0)]), 0.5)  # dry from 0.5 to 1.0

    async def events(lines: list[str]) -> list[str]:
        async def gen() -> Any:
            for line in lines:
                yield line
        return [e async for e in bench.sse_events(gen())]

    lines = ['data: {"a": 1}', "", ": a comment", "event: x", "data: one", "data:two", "", "",
             "data: [DONE]"]
    assert asyncio.run(events(lines)) == ['{"a": 1}', "one\ntwo", "[DONE]"]
    assert bench.stream_error({"error": {"code": "timeout", "message": "m"}}) == ("stream error timeout", "m")
    assert bench.stream_error({"type": "error", "error": {"message": "m"}}) == ("stream error", "m")
    assert bench.stream_error({"choices": []}) is None


def test_prompt_sets(tmp_path: Path) -> None:
    a, b = bench.builtin_prompts(20, 9, seed=5), bench.builtin_prompts(20, 9, seed=5)
    assert a == b and len({p.text for p in a}) == 20
    assert all(len(p.text.split()) == 9 and p.text.endswith(".") for p in a)
    assert a != bench.builtin_prompts(20, 9, seed=6)
    bad = tmp_path / "bad.jsonl"
    for text, message in (('{"prompt": "x"}\n[1, 2]', "bad.jsonl:2: expected an object"),
                          ('{"max_tokens": 3}', "bad.jsonl:1: needs a string"),
                          ('{"prompt": "x", "max_tokens": "3"}', "max_tokens must be an integer"),
                          ("{oops", "bad.jsonl:1: not JSON"), ("# only a comment", "no prompts")):
        bad.write_text(text)
        with pytest.raises(SystemExit, match=message):
            bench.load_prompts(bad)


def test_poisson_schedule_and_jobs() -> None:
    t = bench.poisson_times(4000, 50.0, seed=1)
    assert t == bench.poisson_times(4000, 50.0, seed=1) != bench.poisson_times(4000, 50.0, seed=2)
    assert all(x < y for x, y in zip(t, t[1:]))
    assert math.isclose(t[-1] / len(t), 1 / 50.0, rel_tol=0.1)  # mean gap 1 / rate
    assert bench.poisson_times(5, math.inf, seed=1) == [0.0] * 5
    assert max(bench.poisson_times(10**6, 50.0, seed=1, until=2.0)) <= 2.0
    prompts = bench.builtin_prompts(3, 4, 0)
    mix = [("chat", 3.0), ("speech", 1.0)]
    jobs = [bench.make_job(i, 9, mix, prompts, 0.5) for i in range(400)]
    assert jobs == [bench.make_job(i, 9, mix, prompts, 0.5) for i in range(400)]  # by (seed, index) alone
    chat = sum(j.workload == "chat" for j in jobs)
    assert 250 < chat < 350 and all(j.prompt == prompts[j.index % 3] for j in jobs)
    assert 150 < sum(j.cancel_after is not None for j in jobs) < 250
    assert all(j.cancel_after in (None, 1, 2, 3) for j in jobs)
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "video"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--request-rate", "inf", "--duration", "5"])


def test_png_and_metrics_parsing() -> None:
    Image = pytest.importorskip("PIL.Image")
    with Image.open(io.BytesIO(bench.png(24, 16, seed=1))) as img:
        assert img.size == (24, 16) and img.mode == "RGB"
        img.load()
    assert base64.b64encode(bench.png(2, 2, 1)) == base64.b64encode(bench.png(2, 2, 1))
    text = "\n".join(["# TYPE a_total counter", 'a_total{x="1"} 3', "# TYPE g gauge", "g 2",
                      "# TYPE h histogram", 'h_bucket{le="1"} 1', "h_sum 0.5", "h_count 1", "bad line x"])
    before = bench.parse_metrics(text)
    assert before == {'a_total{x="1"}': ("counter", 3.0), "g": ("gauge", 2.0), "h_sum": ("histogram", 0.5),
                      "h_count": ("histogram", 1.0)}
    after = bench.parse_metrics(text.replace("} 3", "} 5").replace("g 2", "g 0"))
    assert bench.metrics_delta(before, after) == {"delta": {'a_total{x="1"}': 2.0},
                                                  "gauges_after": {"g": 0.0}}


def test_the_script_imports_nothing_of_the_runtime() -> None:
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('s', {str(SCRIPT)!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m; spec.loader.exec_module(m)\n"
            "ours = {'mstar_runtime', 'mstarc', 'mstar_models'}\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & ours))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
