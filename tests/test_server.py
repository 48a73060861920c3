"""The HTTP server with real clients: the `openai` package (max_retries=0) and plain HTTP.

One server (a subprocess on 127.0.0.1) serves the test family plus the walks of
`test_server_support.EXTRA_WALKS`, so every route exists: chat (the family's `chat` walk,
token ids rendered as numbers), speech (`tts`), images (`t2i`, `edit`), the native walk
routes, models, health, metrics and the OpenAPI document.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
pytest.importorskip("uvicorn", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="the conformance tests need the openai client: pip install openai")

from test_server_support import MODEL, Server, compile_plan, get, metric, post, serving  # noqa: E402

RATE = 24000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = compile_plan(tmp_path_factory.mktemp("server"))
    with serving(plan, "--request-timeout", "60") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ----------------------------------------------------------------------------- chat
def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    ids = choice.message.content.split(" ")
    assert len(ids) == 6 and all(i.isdigit() for i in ids)  # ids rendered as numbers (no detokenize phase)
    # the byte-level prompt node: [bos] + the bytes of the family's chat template, "<|user|>hello\n<|assistant|>"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (28, 6, 34)


def test_chat_stream_invariants(client: openai.OpenAI) -> None:
    for include_usage in (True, False):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            stream=True, stream_options={"include_usage": include_usage}, max_tokens=7)
        chunks = list(stream)
        with_choices = [c for c in chunks if c.choices]
        assert with_choices[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.role is None for c in with_choices[1:])
        finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert with_choices[-1].choices[0].finish_reason == "length"  # nothing after the finish chunk
        text = "".join(c.choices[0].delta.content or "" for c in with_choices)
        assert len(text.split(" ")) == 7
        usage = [c.usage for c in chunks if c.usage is not None]
        if include_usage:
            assert len(usage) == 1 and not chunks[-1].choices and chunks[-1].usage.completion_tokens == 7
        else:
            assert usage == []
        assert len({c.id for c in chunks}) == 1


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "same"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs).choices[0]
    parts = client.chat.completions.create(model=MODEL, messages=msgs, stream=True)
    chunks = [c for c in parts if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"n": 2}, 400, "n"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 1000}, 400, "max_tokens"),  # beyond the plan's decode bound: the limit is in the message
    ({"temperature": 3.0}, 400, "temperature"),
    ({"stop": ["\n"]}, 400, "stop"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"modalities": ["text", "audio"]}, 400, "modalities[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
     400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),  # longer than max_context 96
    ({"extra_body": {"bogus": 1}}, 400, "bogus"),
])
def test_chat_errors_are_4xx_naming_the_field(client: openai.OpenAI, kwargs: dict, status: int, param: str) -> None:
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == status
    err = info.value.body if isinstance(info.value.body, dict) else {}
    assert err.get("param") == param, err
    if kwargs.get("max_tokens") == 1000:
        assert "33" in err["message"]
    if "content" in str(kwargs.get("messages")) and "x" * 200 in str(kwargs.get("messages")):
        assert "max_context 96" in err["message"]


def test_chat_extra_body_reaches_the_walk(client: openai.OpenAI) -> None:
    # `max_new` is an input of the walk; the family's chat decodes on in `continue`, so the
    # reply is longer than max_new (no max_tokens cap), and finishes with "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"max_new": 2})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens >= 2


# ----------------------------------------------------------------------------- speech
def _wav(data: bytes) -> tuple[int, int]:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getframerate(), len(w.readframes(1 << 30)) // 2


def test_speech_wav_and_pcm(client: openai.OpenAI, server: Server) -> None:
    wav = client.audio.speech.create(model=MODEL, voice="alloy", input="Hello there, M star.", response_format="wav")
    rate, samples = _wav(wav.content)
    assert rate == RATE and samples > 0 and samples % 8 == 0  # whole codec hops
    pcm = client.audio.speech.create(model=MODEL, voice="alloy", input="Hello there, M star.", response_format="pcm")
    assert pcm.content == wav.content[44:]  # same audio, no header: deterministic walk
    status, native = post(server.base + "/v1/walks/tts", {"inputs": {"text": "Hello there, M star."}, "stream": False})
    assert status == 200
    audio = json.loads(native)["outputs"]["audio"]
    assert audio["encoding"] == "pcm_s16le_base64" and base64.b64decode(audio["data"]) == pcm.content


def test_speech_streams_chunks_as_decoded(client: openai.OpenAI) -> None:
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="alloy", input="Streaming speech, chunk by chunk.", response_format="wav",
            extra_body={"stream": True, "max_new": 24}) as resp:
        assert resp.headers["content-type"].startswith("audio/wav")
        chunks = [c for c in resp.iter_bytes() if c]
    data = b"".join(chunks)
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"  # streamed: length unknown up front
    assert len(data) > 44 and (len(data) - 44) % 2 == 0


def test_speech_sse(server: Server) -> None:
    import urllib.request

    body = {"model": MODEL, "input": "sse please", "stream_format": "sse", "response_format": "pcm"}
    req = urllib.request.Request(server.base + "/v1/audio/speech", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1]) and len(events) > 1
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) > 0
    # the byte-level prompt node: [bos] + the input's bytes in; the family's tts emits no tokens out
    assert events[-1]["usage"] == {"input_tokens": 11, "output_tokens": 0, "total_tokens": 11}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": "   "}, "input"),
    ({"input": "x" * 5000}, "input"),
    ({"response_format": "mp3"}, "response_format"),
    ({"speed": 1.5}, "speed"),
    ({"instructions": "whisper"}, "instructions"),
    ({"max_new": "many"}, "max_new"),
    ({"max_new": 0}, "max_new"),
    ({"unknown_knob": 1}, "unknown_knob"),
])
def test_speech_errors(server: Server, body: dict, param: str) -> None:
    status, raw = post(server.base + "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "alloy", **body})
    assert status == 400
    assert error_of(raw)["param"] == param


# ----------------------------------------------------------------------------- images
def test_images_generate_and_edit(client: openai.OpenAI) -> None:
    from PIL import Image

    r = client.images.generate(model=MODEL, prompt="a red square", n=2, response_format="b64_json")
    pngs = [base64.b64decode(d.b64_json) for d in r.data]
    assert len(pngs) == 2 and pngs[0] != pngs[1]  # seeds 0 and 1
    with Image.open(io.BytesIO(pngs[0])) as img:
        assert img.format == "PNG" and img.size == (8, 4)  # the walk's [latent_len, latent_dim] output
    buf = io.BytesIO()
    Image.new("RGB", (5, 3), (10, 20, 30)).save(buf, format="PNG")
    e = client.images.edit(model=MODEL, image=("in.png", buf.getvalue(), "image/png"), prompt="bluer")
    assert base64.b64decode(e.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(model=MODEL, image=("in.png", b"not an image", "image/png"), prompt="x")
    assert info.value.body["param"] == "image"
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model=MODEL, prompt="x", response_format="url")
    assert info.value.body["param"] == "response_format"


# ----------------------------------------------------------------------------- native, models, health
def test_native_walk_streams_ndjson(server: Server) -> None:
    status, raw = post(server.base + "/v1/walks/generate", {"inputs": {"prompt": "hi", "max_new": 12}})
    assert status == 200
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    outs, done = lines[:-1], lines[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    tokens = [x for x in outs if x["output"] == "tokens"]
    # indexed in order; a cohort flushes several tokens a chunk
    assert [x["index"] for x in tokens] == list(range(len(tokens))) and all(len(x["value"]) >= 1 for x in tokens)
    audio = [x for x in outs if x["output"] == "audio"]
    assert audio and all(a["value"]["encoding"] == "pcm_s16le_base64" for a in audio)
    assert len(done["outputs"]["hidden"][0]) == 32  # the set output, as lists
    whole = json.loads(post(server.base + "/v1/walks/generate",
                            {"inputs": {"prompt": "hi", "max_new": 12}, "stream": False})[1])
    assert whole["outputs"]["tokens"] == [v for t in tokens for v in t["value"]]  # appended outputs concatenated


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/walks/nope", {"inputs": {}}, 404, "walk"),
    ("/v1/walks/chat", {"inputs": {}}, 400, "inputs.prompt"),
    ("/v1/walks/chat", {"inputs": {"prompt": 3}}, 400, "inputs.prompt"),
    ("/v1/walks/chat", {"inputs": {"prompt": "x", "colour": 1}}, 400, "inputs.colour"),
    ("/v1/walks/chat", {"inputs": {"prompt": "x", "max_new": 2**70}}, 400, "inputs.max_new"),
    ("/v1/walks/flow", {"inputs": {"prompt": "x", "scale": "big"}}, 400, "inputs.scale"),
    ("/v1/walks/edit", {"inputs": {"prompt": "x", "image": "@/etc/passwd"}}, 400, "inputs.image"),
    ("/v1/walks/edit", {"inputs": {"prompt": "x", "image": "http://example.com/a.png"}}, 400, "inputs.image"),
    ("/v1/walks/chat", {"inputs": {"prompt": "x" * 300}}, 400, "inputs.prompt"),
])
def test_native_errors(server: Server, path: str, body: dict, status: int, param: str) -> None:
    got, raw = post(server.base + path, body)
    assert got == status, raw
    assert error_of(raw)["param"] == param


def test_models_health_metrics_openapi(server: Server) -> None:
    status, raw = get(server.base + "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL]
    assert get(server.base + "/health") == (200, b'{"status":"ok"}')
    assert get(server.base + "/nope")[0] == 404 and error_of(get(server.base + "/nope")[1])
    _, text = get(server.base + "/metrics")
    names = {line.split()[2] for line in text.decode().splitlines() if line.startswith("# TYPE")}
    for name in ("mstar_requests_total", "mstar_time_to_first_token_seconds", "mstar_time_to_first_audio_seconds",
                 "mstar_real_time_factor", "mstar_queue_depth", "mstar_kv_pages_in_use", "mstar_preemptions_total",
                 "mstar_wasted_speculative_steps_total", "mstar_request_duration_seconds", "mstar_engine_healthy"):
        assert name in names, name
    assert metric(server.base, "mstar_engine_healthy") == 1.0
    paths = json.loads(get(server.base + "/openapi.json")[1])["paths"]
    for route in ("/v1/chat/completions", "/v1/audio/speech", "/v1/images/generations", "/v1/images/edits",
                  "/v1/models", "/health", "/metrics", "/v1/walks/chat", "/v1/walks/tts", "/v1/walks/{walk}"):
        assert route in paths, route


def test_a_chat_cut_at_max_tokens_reaches_the_latency_histograms(client: openai.OpenAI, server: Server) -> None:
    """The route stops a reply at max_tokens and cancels the rest of the walk: the request is
    `finished`, and its duration is observed although the engine has not ended it yet."""
    finished = 'walk="chat",outcome="finished"'
    before = (metric(server.base, "mstar_requests_total", finished),
              metric(server.base, "mstar_request_duration_seconds_count", 'walk="chat"'))
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "cut"}],
                                           max_tokens=3, stream=stream)
        if stream:
            assert [c.choices[0].finish_reason for c in r if c.choices and c.choices[0].finish_reason] == ["length"]
        else:
            assert r.choices[0].finish_reason == "length"
    after = (metric(server.base, "mstar_requests_total", finished),
             metric(server.base, "mstar_request_duration_seconds_count", 'walk="chat"'))
    assert after == (before[0] + 2, before[1] + 2)


def test_routes_follow_the_plan(tmp_path: Path) -> None:
    """A plan without tts / t2i / edit walks has no such routes (404, not 501)."""
    plain = compile_plan(tmp_path, extra=())
    with serving(plain) as s:
        paths = json.loads(get(s.base + "/openapi.json")[1])["paths"]
        assert "/v1/chat/completions" in paths and "/v1/walks/generate" in paths
        for gone in ("/v1/audio/speech", "/v1/images/generations", "/v1/images/edits"):
            assert gone not in paths
            status, raw = post(s.base + gone, {"model": MODEL, "input": "x", "prompt": "x"})
            assert status == 404 and error_of(raw)


# ----------------------------------------------------------------------------- in-process units
def test_prompt_rendering_system_and_image_inputs() -> None:
    from PIL import Image

    from mstar_runtime.serve.chat import render_prompt
    from mstar_runtime.serve.schemas import ChatCompletionRequest
    from mstar_runtime.serve.server import WalkRole

    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "this?"},
                                     {"type": "image_url", "image_url": {"url": url}}]}])
    qwen_like = WalkRole("chat", "prompt", "text", {
        "prompt": {"name": "prompt", "type": {"kind": "str"}, "default": None},
        "system": {"name": "system", "type": {"kind": "str"}, "default": ""},
        "image": {"name": "image", "type": {"kind": "tensor", "dtype": "u8", "dims": ["Hi", "Wi", 3]}, "default": []},
    }, {"prompt": "prompt", "text": "text", "system": "system", "image": "image"})
    prompt, system, image = render_prompt(body, qwen_like)
    assert (prompt, system) == ("what is this?", "be brief")
    assert image is not None and image.shape == (2, 3, 3) and image[0, 0].tolist() == [1, 2, 3]
    plain = WalkRole("chat", "prompt", "tokens", {"prompt": qwen_like.inputs["prompt"]})
    body.messages[1].content = "hi"
    assert render_prompt(body, plain) == ("system: be brief\nuser: hi\nassistant:", None, None)
    # a `system` input the declaration does not bind is not where system messages go
    unbound = WalkRole("chat", "prompt", "text", qwen_like.inputs, {"prompt": "prompt", "text": "text"})
    assert render_prompt(body, unbound)[1] is None


def test_served_walks_and_loop_limits(tmp_path: Path) -> None:
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.serve.server import loop_limits, served_walks

    plan = load_plan(compile_plan(tmp_path))
    walks = served_walks(plan)
    speech = walks.speech.role
    assert (speech.walk, speech.text_input, speech.output, walks.speech.voice) == ("tts", "text", "audio", "voice")
    assert (walks.chat.text_input, walks.chat.output) == ("prompt", "tokens")
    assert walks.t2i.output == "image" and walks.edit.output == "image" and walks.edit.slots["image"] == "image"
    assert walks.understand is None and walks.spoken is None and walks.transcriptions is None
    assert loop_limits(plan.walk("flow")) == {"steps": 8} and loop_limits(plan.walk("chat")) == {}


def test_cli_serve_usage_and_busy_port(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from test_server_support import ENV, ROOT

    plan = compile_plan(tmp_path, extra=())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "mstar_runtime.cli", str(plan), "--serve", "--port", str(port)],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith(f"mstar-run: error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "mstar_runtime.cli", str(plan), "--walk", "chat",
                        "--shutdown-timeout", "5"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
    assert p.returncode == 2 and "go with --serve" in p.stderr


def _misfit_plan(tmp_path: Path) -> Path:
    """The test family's plan with its chat declaration edited by hand to bind `text` to the
    bool `handoff` (the compiler refuses that: E082), re-encoded with a valid checksum."""
    from mstar_runtime.plan import planfile

    body = planfile.read(compile_plan(tmp_path, extra=()))
    body["walks"]["chat"]["routes"] = [{"route": "chat", "bind": {"text": "handoff"}}]
    planfile.write(tmp_path / "misfit.plan", body)
    return tmp_path / "misfit.plan"


def test_a_walk_that_does_not_fit_its_route_is_refused_at_load(tmp_path: Path) -> None:
    """Before the engine starts (`mstar-run --serve`: one line, exit 1) and in `create_app`,
    naming the walk, the route and the slot."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from test_server_support import ENV, ROOT

    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.plan.routes import RouteMisfit
    from mstar_runtime.serve.server import create_app

    plan = _misfit_plan(tmp_path)
    want = ("walk 'chat' cannot serve route 'chat' (/v1/chat/completions): slot 'text' (the reply) wants an appended "
            "output (emit +=) of str or an int tensor (token ids); output 'handoff' is bool (set)")
    with pytest.raises(RouteMisfit) as info:
        create_app(SimpleNamespace(plan=load_plan(plan)))
    assert str(info.value) == want
    p = subprocess.run([sys.executable, "-m", "mstar_runtime.cli", str(plan), "--serve", "--port", "0"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == f"mstar-run: error: {plan}: {want}", p.stderr


def test_routes_follow_declarations_not_walk_names(tmp_path: Path) -> None:
    """A walk named `tts` that declares nothing serves no speech; a plan from before route
    declarations (schema 1.2) serves only the native routes."""
    from mstar_runtime.plan import planfile
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.serve.server import served_walks

    body = planfile.read(compile_plan(tmp_path))
    body["walks"]["tts"]["routes"] = []
    planfile.write(tmp_path / "silent.plan", body)
    walks = served_walks(load_plan(tmp_path / "silent.plan"))
    assert walks.speech is None and walks.chat is not None and walks.t2i is not None
    body["schema"]["minor"] = 2
    for w in body["walks"].values():
        del w["routes"]
    planfile.write(tmp_path / "old.plan", body)
    walks = served_walks(load_plan(tmp_path / "old.plan"))
    assert walks == type(walks)(all=walks.all) and "tts" in walks.all
