"""One validation rule on every route, and 400s that name their field (issue 17).

- A walk input sent through an OpenAI route (`extra_body`) is checked exactly as the
  native `/v1/walks/<walk>` route checks it (int64, finite floats, strict types): a value
  outside 64 bits is a 400 naming it, where it used to reach the engine (and kill its thread).
- A token-count input (`max_tokens`, `max_new`, ...) above the plan's limit is a 400
  `max_tokens_too_large` naming the field and the limit on every route (speech, chat, its
  extra fields, native), where speech and the native route used to clamp it silently.
- A body that is not JSON by its Content-Type is a 415 naming the Content-Type, not
  "Input should be a valid dictionary"; every 400 for a bad field names it in `param`.

In process (httpx over ASGI, no subprocess): the test family plus `tts`, `t2i`, `edit`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install httpx")

from test_server_support import MODEL, compile_plan  # noqa: E402

INT64_MAX = 2**63 - 1
HI = [{"role": "user", "content": "hi"}]
LIMIT = 33  # the test family (tiny): max_new_tokens 32, plus the prefill's token


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from mstar_runtime.api import MStar
    from mstar_runtime.serve.server import ServeConfig, create_app

    plan = compile_plan(tmp_path_factory.mktemp("validation"), extra=("tts", "t2i", "edit"))
    m = MStar.load(plan, weights="init")
    try:
        yield create_app(m, ServeConfig(weights="init"))
    finally:
        done = threading.Event()
        threading.Thread(target=lambda: (m.close(), done.set()), daemon=True).start()
        assert done.wait(30)


def call(app: Any, path: str, body: Any = None, *, content: bytes | None = None,
         headers: dict[str, str] | None = None, method: str = "POST") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            if content is None and body is not None:
                return await c.request(method, path, json=body, headers=headers)
            return await c.request(method, path, content=content, headers=headers)

    return asyncio.run(go())


def error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ----------------------------------------------------------------------------- one rule for walk inputs
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "max_new": 2**70}, "max_new"),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "max_new": -2**70}, "max_new"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_new": 2**64}, "max_new"),
    ("/v1/images/generations", {"model": MODEL, "prompt": "x", "seed": 2**70}, "seed"),
    ("/v1/walks/chat", {"inputs": {"prompt": "x", "max_new": 2**70}}, "inputs.max_new"),
])
def test_extra_fields_have_the_native_64_bit_bound(app: Any, path: str, body: dict, param: str) -> None:
    r = call(app, path, body)
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["param"] == param and str(INT64_MAX)[:6] in err["message"].replace("-", ""), err
    assert call(app, "/health", method="GET").status_code == 200  # the engine still serves


def test_derived_integers_stay_within_64_bits(app: Any) -> None:
    """Image i's seed is seed + i: the last image's seed must fit in 64 bits too."""
    r = call(app, "/v1/images/generations", {"model": MODEL, "prompt": "x", "seed": INT64_MAX, "n": 2})
    assert r.status_code == 400 and error(r)["param"] == "seed", r.text
    assert call(app, "/health", method="GET").status_code == 200


def test_extra_fields_and_native_inputs_say_the_same(app: Any) -> None:
    """The same bad value gets the same words on the OpenAI route as on the native one."""
    for value in (2**70, 1.5, True, "many", None):
        extra = error(call(app, "/v1/audio/speech", {"model": MODEL, "input": "hi", "max_new": value}))
        native = error(call(app, "/v1/walks/tts", {"inputs": {"text": "hi", "max_new": value}}))
        assert (extra["param"], native["param"]) == ("max_new", "inputs.max_new")
        assert extra["message"].removeprefix("max_new") == native["message"].removeprefix("inputs.max_new"), \
            (extra, native)
        assert extra["code"] == native["code"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "max_new": LIMIT + 1}, "max_new"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": LIMIT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_completion_tokens": 1000},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_new": 1000}, "max_new"),
    ("/v1/walks/chat", {"inputs": {"prompt": "x", "max_new": 1000}, "stream": False}, "inputs.max_new"),
    ("/v1/walks/tts", {"inputs": {"text": "x", "max_new": LIMIT + 1}}, "inputs.max_new"),
])
def test_max_tokens_over_the_limit_is_one_400_everywhere(app: Any, path: str, body: dict, param: str) -> None:
    r = call(app, path, body)
    assert r.status_code == 400, r.text[:200]
    err = error(r)
    assert (err["param"], err["code"]) == (param, "max_tokens_too_large"), err
    assert f"at most {LIMIT} tokens" in err["message"] and err["message"].startswith(param), err


def test_max_tokens_at_the_limit_is_served(app: Any) -> None:
    speech = call(app, "/v1/audio/speech", {"model": MODEL, "input": "hi", "max_new": LIMIT, "response_format": "pcm"})
    assert speech.status_code == 200 and len(speech.content) > 0
    chat = call(app, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": LIMIT})
    assert chat.status_code == 200, chat.text
    native = call(app, "/v1/walks/chat", {"inputs": {"prompt": "x", "max_new": LIMIT}, "stream": False})
    assert native.status_code == 200, native.text


# ----------------------------------------------------------------------------- Content-Type
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/speech", "/v1/walks/chat"])
def test_a_body_that_is_not_json_by_its_content_type_is_415(app: Any, path: str, content_type: str | None) -> None:
    body = {"model": MODEL, "messages": HI, "input": "hi"} if not path.startswith("/v1/walks") else {
        "inputs": {"prompt": "x"}}
    headers = {"Content-Type": content_type} if content_type else {}
    r = call(app, path, content=json.dumps(body).encode(), headers=headers)
    assert r.status_code == 415, r.text
    err = error(r)
    assert err["code"] == "unsupported_media_type" and "Content-Type" in err["message"], err
    assert "application/json" in err["message"] and "valid dictionary" not in err["message"]
    if content_type:
        assert content_type in err["message"]


def test_json_content_types_are_accepted(app: Any) -> None:
    body = json.dumps({"inputs": {"prompt": "x", "max_new": 2}, "stream": False}).encode()
    for ct in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        r = call(app, "/v1/walks/chat", content=body, headers={"Content-Type": ct})
        assert r.status_code == 200, (ct, r.text)


def test_edits_want_a_form(app: Any) -> None:
    r = call(app, "/v1/images/edits", {"model": MODEL, "prompt": "x", "image": "aGk="})
    assert r.status_code == 415 and "multipart/form-data" in error(r)["message"], r.text


# ----------------------------------------------------------------------------- param names the field
@pytest.mark.parametrize(("path", "body", "param"), [
    # a node rejects a port (the token list) the client never named, on a walk with two text inputs
    ("/v1/walks/flow", {"inputs": {"prompt": "x" * 300}, "stream": False}, "inputs"),
    ("/v1/walks/flow", {"inputs": {"prompt": "x", "negative": "y" * 300}, "stream": False}, "inputs"),
    # a node rejects an extra field of chat: blamed on that field, not on `messages`
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_new": 0}, "max_new"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_new": 0, "stream": True}, "max_new"),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi", "max_new": 0}, "max_new"),
    ("/v1/walks/chat", {"inputs": {"prompt": "x", "max_new": 0}}, "inputs.max_new"),
    ("/v1/walks/edit", {"inputs": {"prompt": "x", "image": "aGk="}}, "inputs.image"),
])
def test_every_400_for_a_bad_field_names_it(app: Any, path: str, body: dict, param: str) -> None:
    r = call(app, path, body)
    assert r.status_code == 400, r.text
    assert error(r)["param"] == param, r.text


@pytest.mark.parametrize("content", [b"[1, 2]", b'"x"', b"3", b"{"])
def test_a_body_that_is_no_object_says_so(app: Any, content: bytes) -> None:
    r = call(app, "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = error(r)
    assert err["param"] is None and err["code"] in ("invalid_body", "invalid_json"), err
    assert "valid dictionary" not in err["message"], err


def test_image_errors_do_not_show_object_reprs(app: Any) -> None:
    err = error(call(app, "/v1/walks/edit", {"inputs": {"prompt": "x", "image": "aGk="}}))
    assert " at 0x" not in err["message"], err


@pytest.mark.parametrize(("kind", "text", "want"), [
    ("int", " 12 ", 12), ("int", "-3", -3), ("int", "1.5", "1.5"), ("int", "1_0", "1_0"),
    ("float", "0.25", 0.25), ("float", "1e3", 1000.0), ("float", "fast", "fast"),
    ("bool", "True", True), ("bool", "false", False), ("bool", "1", "1"), (None, " 7", " 7"),
])
def test_a_form_field_reads_as_its_inputs_kind_or_stays_text(kind: str | None, text: str, want: Any) -> None:
    """Multipart fields (image edits, transcriptions) through one reader: text that does not read
    as the kind stays as sent, for the input's check to refuse by name."""
    from mstar_runtime.serve.io import form_value

    got = form_value(kind, text)
    assert got == want and type(got) is type(want)
