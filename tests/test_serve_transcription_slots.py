"""The transcription route on a walk that binds only its required slots (models/asr/asr.walk:
`serves transcriptions(file = audio, tokens = text)`, its `text` output being token ids): the
transcript is its ids (no `text` slot, no detokenize), and a field whose slot the walk does not
bind is a 400 naming the field, never ignored. In process (httpx over ASGI)."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install httpx")
soundfile = pytest.importorskip("soundfile", reason="pip install soundfile")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from mstar_runtime.api import MStar
    from mstar_runtime.serve.server import ServeConfig, create_app
    from mstarc.cli import main as mstarc

    plan = tmp_path_factory.mktemp("asr") / "asr.plan"
    assert mstarc(["compile", str(ROOT / "models/asr/asr.walk"), "--variant", "tiny",
                   "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    m = MStar.load(plan, weights="dummy")
    try:
        yield create_app(m, ServeConfig())
    finally:
        done = threading.Event()
        threading.Thread(target=lambda: (m.close(), done.set()), daemon=True).start()
        assert done.wait(30)


def _wav(seconds: float = 0.1) -> bytes:  # the tiny variant's cross context holds 100 ms
    buf = io.BytesIO()
    samples = np.random.default_rng(1).uniform(-0.5, 0.5, int(16000 * seconds)).astype(np.float32)
    soundfile.write(buf, samples, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def post(app: Any, fields: dict[str, str], seconds: float = 0.1) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await c.post("/v1/audio/transcriptions", data={"model": "asr", **fields},
                                files={"file": ("a.wav", _wav(seconds), "audio/wav")})

    return asyncio.run(go())


def test_the_transcript_is_the_token_ids(app: Any) -> None:
    r = post(app, {})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text and all(t.isdigit() for t in text.split()), text


@pytest.mark.parametrize("fields,param", [
    ({"language": "en"}, "language"), ({"prompt": "hello"}, "prompt"), ({"temperature": "0.5"}, "temperature"),
    ({"response_format": "srt"}, "response_format"), ({"response_format": "verbose_json"}, "response_format"),
])
def test_a_field_without_a_slot_is_refused(app: Any, fields: dict[str, str], param: str) -> None:
    r = post(app, fields)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (400, param, "unsupported"), r.text
    assert "walk 'transcribe'" in err["message"] and "slot" in err["message"]


def test_audio_longer_than_the_cross_context_is_413_naming_the_file(app: Any) -> None:
    """One second outgrows the tiny variant's 100 ms cross context: the client's input is too
    long for the walk (413 on the file, as a request that can never fit), not a server error."""
    r = post(app, {}, seconds=1.0)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (413, "file", "request_too_large"), r.text
    assert "max_len" in err["message"] and "cross" in err["message"], err


def test_no_translation_route(app: Any) -> None:
    routes = {getattr(r, "path", "") for r in app.routes}
    assert "/v1/audio/transcriptions" in routes and "/v1/audio/translations" not in routes
    assert "/v1/chat/completions" not in routes and "/v1/audio/speech" not in routes
