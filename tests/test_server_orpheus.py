"""`/v1/audio/speech` on the Orpheus plan (tiny, random weights) with the real `openai` client.

Random weights almost never sample an audio token, so the backbone would stream no codes
and the speech would be empty; the walk's tiny variant therefore sets `audio_only = true`
(the backbone's benchmark switch: sample only the audio ids of the current code position),
and the test compiles it as it is.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="the conformance tests need the openai client: pip install openai")

from test_server_support import ROOT, Server, serving  # noqa: E402

WINDOW = 2048  # samples per released sliding(28, 7) window of SNAC codes


def _orpheus_plan(out: Path) -> Path:
    """The tiny variant as the corpus has it: it sets `audio_only = true` on the backbone."""
    from mstarc.cli import main as mstarc

    plan = out / "orpheus-tiny.plan"
    assert mstarc(["compile", str(ROOT / "models/orpheus/orpheus.walk"), "--variant", "tiny", "-p",
                   str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    return plan


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = _orpheus_plan(tmp_path_factory.mktemp("orpheus"))
    with serving(plan) as s:  # --weights init: the nodes' own (random) initialisation
        yield s


def test_orpheus_speech_with_the_openai_client(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "orpheus"
    wav = client.audio.speech.create(model=model, voice="tara", input="Hello from M star.", response_format="wav",
                                     extra_body={"max_tokens": 60, "seed": 1})
    with wave.open(io.BytesIO(wav.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        samples = w.getnframes()
    assert samples > 0 and samples % WINDOW == 0
    with client.audio.speech.with_streaming_response.create(
            model=model, voice="tara", input="Hello from M star.", response_format="pcm",
            extra_body={"max_tokens": 60, "seed": 1, "stream": True}) as resp:
        streamed = b"".join(resp.iter_bytes())
    assert streamed == wav.content[44:]  # same seed, same audio, whether streamed or not
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model=model, voice="tara", input="x", extra_body={"temperature": "hot"})
    assert info.value.body["param"] == "temperature"
