"""The native route of a streamed input, `POST /v1/walks/<walk>/stream` (serve/live.py), on
Whisper's `transcribe_live` (the tiny config of tests/test_whisper.py, its perturbed weights):

- a chunked WAV body (16-bit, pieces of uneven sizes, one cutting the header and some a
  sample) and a raw f32le body at 8 kHz answer NDJSON: a `partial` line per window, then
  `done` with the segments and text of `transcribe` on the same samples;
- over a real socket, the first window's partial line arrives while the body is still open
  (the rest is sent only after it);
- bad input is a 400 naming the field: the Content-Type, the format, the rate, the WAV
  header, a body that ends inside a sample, an empty body, `inputs` (not JSON, an unknown
  input, a mistyped one, the streamed input itself), and a node's refusal of the audio.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import torch
from test_server_support import ndjson_lines, serving
from test_whisper import _audio, plan, reference  # noqa: F401 - fixtures

from mstar_runtime.api import MStar
from mstar_runtime.media import resample

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

ROUTE = "/v1/walks/transcribe_live/stream"
SETTINGS: dict[str, Any] = {"timestamps": True, "max_tokens": 40}
QUERY = "?inputs=" + json.dumps(SETTINGS)


@pytest.fixture(scope="module")
def engine(reference: tuple, plan: Path) -> Iterator[MStar]:  # noqa: F811 - the imported fixtures
    with MStar.load(plan, weights=reference[1]) as m:
        yield m


@pytest.fixture(scope="module")
def client(engine: MStar, reference: tuple) -> Iterator[Any]:  # noqa: F811
    from starlette.testclient import TestClient

    from mstar_runtime.serve.server import ServeConfig, create_app

    with TestClient(create_app(engine, ServeConfig(weights=str(reference[1])))) as c:
        yield c


def _wav_header(rate: int = 16000, channels: int = 1, bits: int = 16, code: int = 1) -> bytes:
    fmt = struct.pack("<HHIIHH", code, channels, rate, rate * channels * bits // 8, channels * bits // 8, bits)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt \
        + b"data" + struct.pack("<I", 0xFFFFFFFF)  # a streaming writer's sizes: unknown


def _pieces(data: bytes, sizes: tuple[int, ...] = (7, 30_001, 64_000, 111, 250_003)) -> Iterator[bytes]:
    at, k = 0, 0
    while at < len(data):
        n = sizes[k % len(sizes)]
        yield data[at : at + n]
        at, k = at + n, k + 1


def _pcm16(seconds: float) -> tuple[bytes, torch.Tensor]:
    """16-bit samples of `_audio` (a burst in its first second: the loudest part is heard first),
    and the float samples the route makes of them."""
    x = _audio(seconds, seed=3)
    x[8000:8400] *= 3
    ints = np.clip(np.round(x * 32767), -32768, 32767).astype("<i2")
    return ints.tobytes(), torch.from_numpy((ints.astype(np.float64) / 2.0**15).astype(np.float32))


def _done(lines: list[dict[str, Any]]) -> dict[str, Any]:
    assert lines[-1]["type"] == "done", lines[-1]
    return lines[-1]["outputs"]


def test_a_chunked_wav_body_transcribes_as_the_whole_file(client: Any, engine: MStar) -> None:
    data, samples = _pcm16(65.0)
    r = client.post(ROUTE + QUERY, content=_pieces(_wav_header() + data), headers={"Content-Type": "audio/wav"})
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    partial = [line["value"] for line in lines if line["type"] == "output" and line["output"] == "partial"]
    whole = engine.submit("transcribe", {"audio": samples, **SETTINGS}).result(timeout=300)
    out = _done(lines)
    assert out["segments"] == whole["segments"] and out["text"] == whole["text"]
    assert out["tokens"] == whole["tokens"].tolist()
    seeks = sorted({s["seek"] for s in json.loads(whole["segments"])})
    assert len(seeks) >= 3 and [json.loads(p)["start"] for p in partial] == [round(s / 100, 2) for s in seeks]


def test_raw_float_samples_at_another_rate_are_resampled(client: Any, engine: MStar) -> None:
    x = torch.from_numpy(_audio(8.0, seed=6)[::2].copy())  # 8 kHz
    body = x.numpy().astype("<f4").tobytes()
    r = client.post(ROUTE + "?format=f32le&rate=8000", content=_pieces(body, (4_001, 999, 20_000)),
                    headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    out = _done([json.loads(line) for line in r.text.splitlines()])
    whole = engine.submit("transcribe", {"audio": resample(x, 8000, 16000)}).result(timeout=300)
    assert out["segments"] == whole["segments"] and out["text"] == whole["text"]


def test_partial_text_arrives_while_the_body_is_still_open(plan: Path, reference: tuple) -> None:  # noqa: F811
    data, _ = _pcm16(40.0)
    body = _wav_header() + data
    first = 44 + 2 * (16000 * 31)  # the header and 31 s: the first window's audio and a chunk more
    with serving(plan, "--weights", str(reference[1])) as server:
        host, port = server.base.removeprefix("http://").split(":")
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(f"POST {ROUTE}?inputs={quote(json.dumps(SETTINGS))} HTTP/1.1\r\nHost: {host}\r\n"
                  "Content-Type: audio/wav\r\nTransfer-Encoding: chunked\r\n\r\n".encode())

        def chunk(part: bytes) -> None:
            s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")

        for part in _pieces(body[:first], (65_536,)):
            chunk(part)
        got = b""
        while b'"output":"partial"' not in got:  # the first window's line, before the rest is sent
            try:
                more = s.recv(1 << 16)
            except TimeoutError:
                raise AssertionError(f"no partial line; got {got[:2000]!r}\n{server.output()[-3000:]}") from None
            assert more, got
            got += more
        assert got.startswith(b"HTTP/1.1 200")
        for part in _pieces(body[first:], (65_536,)):
            chunk(part)
        s.sendall(b"0\r\n\r\n")
        while not got.endswith(b"0\r\n\r\n"):
            try:
                more = s.recv(1 << 16)
            except TimeoutError:
                raise AssertionError(f"the response did not end; got {got[-2000:]!r}\n{server.output()[-3000:]}") from None
            assert more
            got += more
        s.close()
    lines = ndjson_lines(got.split(b"\r\n\r\n", 1)[1])
    assert lines[0]["output"] == "partial" and json.loads(lines[0]["value"])["start"] == 0.0
    assert lines[-1]["type"] == "done" and lines[-1]["outputs"]["segments"]


@pytest.mark.parametrize(("query", "headers", "body", "param"), [
    ("", {"Content-Type": "text/plain"}, b"abc", "Content-Type"),
    ("?format=u8", {"Content-Type": "audio/pcm"}, b"\0\0", "format"),
    ("?rate=0", {"Content-Type": "audio/pcm"}, b"\0\0", "rate"),
    ("?rate=8000", {"Content-Type": "audio/wav"}, b"\0\0", "rate"),
    ("", {"Content-Type": "audio/wav"}, b"RIFX" + b"\0" * 60, "body"),
    ("", {"Content-Type": "audio/wav"}, _wav_header(bits=8), "body"),
    ("", {"Content-Type": "audio/wav"}, _wav_header(rate=0), "body"),
    ("", {"Content-Type": "audio/wav"}, _wav_header()[:30], "body"),
    ("", {"Content-Type": "audio/pcm"}, b"\0" * 3201, "body"),  # ends inside a sample
    ("", {"Content-Type": "audio/pcm"}, b"", "body"),  # no audio
    ("?inputs=nope", {"Content-Type": "audio/pcm"}, b"\0\0", "inputs"),
    ("?inputs=[1]", {"Content-Type": "audio/pcm"}, b"\0\0", "inputs"),
    ('?inputs={"colour":1}', {"Content-Type": "audio/pcm"}, b"\0\0", "inputs.colour"),
    ('?inputs={"max_tokens":"many"}', {"Content-Type": "audio/pcm"}, b"\0\0", "inputs.max_tokens"),
    ('?inputs={"audio":[0.0]}', {"Content-Type": "audio/pcm"}, b"\0\0", "inputs.audio"),
    ('?inputs={"language":"klingon"}', {"Content-Type": "audio/pcm"}, b"\0" * 3200, "inputs.language"),
    ("", {"Content-Type": "audio/pcm"}, b"\0" * (2 * 16000 * 31), "inputs.timestamps"),  # over 30 s
])
def test_bad_input_is_a_400_naming_the_field(client: Any, query: str, headers: dict[str, str], body: bytes,
                                             param: str) -> None:
    r = client.post(ROUTE + query, content=_pieces(body), headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
