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


def test_speech_sse_usage_counts_the_prompt_and_the_codes(server: Server) -> None:
    """`speech.audio.done` reports the prompt's tokens in and the audio codes the backbone
    generated out (the same seeded request on the native route gives the codes), not 0 and
    the number of audio chunks."""
    import json
    import urllib.request

    from test_server_support import post

    from mstar_models.orpheus.prompt import BUNDLED_TOKENIZER, PREFIX, SUFFIX, load_tokenizer

    text, seed = "Hello from M star.", 1
    body = {"model": "orpheus", "input": text, "voice": "leah", "stream_format": "sse", "response_format": "pcm",
            "max_tokens": 60, "seed": seed}
    req = urllib.request.Request(server.base + "/v1/audio/speech", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and len(events) > 2
    usage = events[-1]["usage"]
    status, raw = post(server.base + "/v1/walks/tts", {"inputs": {"text": text, "voice": "leah", "max_tokens": 60,
                                                                 "seed": seed}, "stream": False})
    assert status == 200, raw
    codes = json.loads(raw)["outputs"]["codes"]
    ids = load_tokenizer(BUNDLED_TOKENIZER).encode(f"leah: {text}").ids
    prompt = len(PREFIX) + len(ids) + (0 if ids and ids[0] == 128000 else 1) + len(SUFFIX)  # BOS added if missing
    assert usage == {"input_tokens": prompt, "output_tokens": len(codes), "total_tokens": prompt + len(codes)}
    assert len(codes) != len(events) - 1  # codes, not audio chunks
