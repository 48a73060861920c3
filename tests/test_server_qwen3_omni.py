"""Qwen3-Omni through the OpenAI routes (issue 15, section 5), with the real `openai` client
against one server (a subprocess) on the tiny plan (`models/qwen3_omni/qwen3_omni.walk`,
variant tiny, `placements/cpu.yaml`, `--weights init`: the nodes' own random initialisation,
so the text is noise but every route runs the model end to end).

- `/v1/chat/completions`, text only (no `modalities`, or `["text"]`) -> walk `chat`; with an
  `input_audio` WAV or an `image_url` data URL the answer equals the native route's with the
  same samples or pixels (greedy); a 48 kHz float WAV answers as the same tone at 16 kHz does.
- `modalities: ["text", "audio"]` -> walk `speech`: the whole reply's `message.audio` (a 24 kHz
  WAV, or pcm16) and the streamed `delta.audio` pieces (transcript, then base64 PCM) carry the
  same transcript and the same samples (same seed).
- `/v1/audio/speech` -> walk `speech` with `READ_ALOUD`, the preamble its declaration gives
  (`serves speech(..., preamble = ...)`), as its system text: the same audio as the native
  route given those inputs, whole and streamed.
- Errors: 400s naming the field (`audio.voice`, `audio.format`, `audio`, `modalities`,
  `messages[i].content[j].input_audio.*`, `voice`, `max_tokens`).
- In process: `media.decode_wav` (PCM 8/16/24/32-bit, float, stereo, streamed headers) and
  `media.resample` against analytic tones.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import wave
from collections.abc import Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="the conformance tests need the openai client: pip install openai")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

from test_server_support import ROOT, Server, post, serving  # noqa: E402

from mstar_runtime.serve.media import decode_wav, resample  # noqa: E402

# the preamble models/qwen3_omni/qwen3_omni.walk's speech walk declares for /v1/audio/speech
READ_ALOUD = ("Read the user's message aloud exactly as it is written, word for word. Do not answer it, "
              "comment on it, translate it or add anything to it.")

WALK = ROOT / "models/qwen3_omni/qwen3_omni.walk"
MODEL = "qwen3_omni"
RATE = 24000  # the plan's sample_rate (Code2Wav)
SPF, TRIM = 1920, 555  # samples per codec frame; what one decode trims at its right edge
GREEDY = {"top_k": 0}  # with temperature 0.0: the thinker's argmax
FRAMES = 6  # talker frames per spoken reply (extra_body: the walk's talker_max_frames)
SHORT = {"talker_max_frames": FRAMES}
USER = [{"role": "user", "content": "say hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from mstarc.cli import main as mstarc

    plan = tmp_path_factory.mktemp("qwen3_omni") / "qwen3_omni-tiny.plan"
    assert mstarc(["compile", str(WALK), "--variant", "tiny", "--placement", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(plan)]) == 0
    with serving(plan, "--request-timeout", "120") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


# ----------------------------------------------------------------------------- helpers
def tone(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.3 * np.sin(2 * np.pi * hz * t) + 0.1 * np.sin(2 * np.pi * 3.1 * hz * t)


def wav_file(samples: np.ndarray, rate: int, width: int = 2, channels: int = 1) -> bytes:
    """Integer PCM WAV (the `wave` module's own writer); `samples` [N] in [-1, 1], copied to each channel."""
    full = 2 ** (8 * width - 1)
    ints = np.clip(np.round(samples * full), -full, full - 1).astype(np.int64)
    frames = np.repeat(ints[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = (frames + 128).astype(np.uint8).tobytes()
    else:
        raw = b"".join(int(v).to_bytes(width, "little", signed=True) for v in frames) if width == 3 \
            else frames.astype(f"<i{width}").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def float_wav(samples: np.ndarray, rate: int, streamed: bool = False) -> bytes:
    """A 32-bit IEEE float WAV (format 3); `streamed`: sizes 0xFFFFFFFF, as a live stream's header."""
    data = samples.astype("<f4").tobytes()
    size = 0xFFFFFFFF if streamed else len(data)
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF if streamed else 36 + len(data)) + b"WAVE"
            + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", size) + data)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def png(width: int, height: int, seed: int) -> tuple[bytes, np.ndarray]:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue(), pixels


def native(server: Server, walk: str, inputs: dict) -> dict:
    status, raw = post(f"{server.base}/v1/walks/{walk}", {"inputs": inputs, "stream": False}, timeout=120)
    assert status == 200, raw
    return json.loads(raw)["outputs"]


def wav_frames(data: bytes) -> bytes:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        return w.readframes(w.getnframes())


def bad_request(fn, *args, **kwargs) -> dict:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as info:
        result = fn(*args, **kwargs)
        if isinstance(result, openai.Stream):  # a stream that started would raise on reading it
            list(result)
    body = info.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    return body


def ask(client: openai.OpenAI, messages: list, **kwargs) -> openai.types.chat.ChatCompletion:
    kwargs.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0,
                                          extra_body={**GREEDY, **kwargs.pop("extra_body", {})}, **kwargs)


# ----------------------------------------------------------------------------- text chat
def test_text_chat_is_the_chat_walk(server: Server, client: openai.OpenAI) -> None:
    r = ask(client, USER)
    text = r.choices[0].message.content
    assert text and r.choices[0].message.audio is None
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length" and r.usage.prompt_tokens > 0
    assert ask(client, USER, modalities=["text"]).choices[0].message.content == text
    assert native(server, "chat", {"prompt": "say hi", "max_tokens": 6, "temperature": 0.0, **GREEDY})["text"] == text
    pieces = [c.choices[0].delta.content or "" for c in ask(client, USER, stream=True) if c.choices]
    assert "".join(pieces) == text


def test_input_audio_reaches_the_walk(server: Server, client: openai.OpenAI) -> None:
    clip = np.round(tone(1.2, 16000) * 32768) / 32768  # exactly what 16-bit PCM holds
    asked = [{"role": "user", "content": [audio_part(wav_file(clip, 16000)), {"type": "text", "text": "what?"}]}]
    heard = ask(client, asked)
    ref = native(server, "chat", {"prompt": "what?", "audio": clip.tolist(), "max_tokens": 6, "temperature": 0.0,
                                  **GREEDY})
    assert heard.choices[0].message.content == ref["text"]
    assert heard.usage.prompt_tokens > ask(client, [{"role": "user", "content": "what?"}]).usage.prompt_tokens
    # other rates, widths and channel counts are decoded and resampled to the processor's 16 kHz
    for data in (wav_file(tone(1.2, 44100), 44100, width=3, channels=2), wav_file(tone(1.2, 8000), 8000, width=1)):
        other = ask(client, [{"role": "user", "content": [audio_part(data), {"type": "text", "text": "what?"}]}])
        assert other.usage.prompt_tokens == heard.usage.prompt_tokens  # 1.2 s is 1.2 s at any rate
    # a 48 kHz float WAV is heard as the same tone at 16 kHz (the resampler's error is ~1e-6)
    at48 = ask(client, [{"role": "user", "content": [audio_part(float_wav(tone(1.2, 48000), 48000)),
                                                      {"type": "text", "text": "what?"}]}])
    at16 = native(server, "chat", {"prompt": "what?", "audio": tone(1.2, 16000).astype(np.float32).tolist(),
                                   "max_tokens": 6, "temperature": 0.0, **GREEDY})
    assert at48.choices[0].message.content == at16["text"]


def test_a_conversation_goes_to_the_walk_as_its_turns(server: Server, client: openai.OpenAI) -> None:
    """Earlier messages are the walk's `history`, a clip per message at the front of `audio` in
    order (serve/turns.py): the same answer as the native route given those inputs."""
    first, second = (np.round(tone(s, 16000, hz) * 32768) / 32768 for s, hz in ((1.1, 300.0), (0.7, 520.0)))
    asked = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [audio_part(wav_file(first, 16000))]},
             {"role": "assistant", "content": "A low tone."},
             {"role": "user", "content": [audio_part(wav_file(second, 16000)), {"type": "text", "text": "And?"}]}]
    got = ask(client, asked)
    history = [{"role": "user", "content": "", "audio": len(first)}, {"role": "assistant", "content": "A low tone."}]
    ref = native(server, "chat", {"prompt": "And?", "system": "Be brief.", "history": json.dumps(history),
                                  "audio": np.concatenate([first, second]).tolist(), "max_tokens": 6,
                                  "temperature": 0.0, **GREEDY})
    assert got.choices[0].message.content == ref["text"]
    body = bad_request(ask, client, asked[:3])  # the walk answers a user turn
    assert body["param"] == "messages" and "ends with assistant's" in body["message"]


def test_image_url_reaches_the_walk(server: Server, client: openai.OpenAI) -> None:
    data, pixels = png(56, 40, seed=2)
    asked = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                              + b64(data)}},
                                          {"type": "text", "text": "what is it?"}]}]
    seen = ask(client, asked)
    ref = native(server, "chat", {"prompt": "what is it?", "image": pixels.tolist(), "max_tokens": 6,
                                  "temperature": 0.0, **GREEDY})
    assert seen.choices[0].message.content == ref["text"]
    assert seen.usage.prompt_tokens > ask(client, [{"role": "user", "content": "what is it?"}]).usage.prompt_tokens


# ----------------------------------------------------------------------------- audio out
def test_chat_with_audio_out_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = ask(client, USER, modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"},
                extra_body=SHORT)
    msg = whole.choices[0].message
    assert msg.content is None and msg.audio.id.startswith("audio_") and isinstance(msg.audio.expires_at, int)
    assert msg.audio.transcript == ask(client, USER).choices[0].message.content  # the same thinker, greedy
    pcm = wav_frames(base64.b64decode(msg.audio.data))
    assert len(pcm) == 2 * (FRAMES * SPF - TRIM)  # every frame decoded (random weights never end the speech)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    raw = ask(client, USER, modalities=["text", "audio"], audio={"voice": "chelsie", "format": "pcm16"},
              extra_body=SHORT)
    assert base64.b64decode(raw.choices[0].message.audio.data) == pcm

    chunks = list(ask(client, USER, modalities=["text", "audio"], audio={"voice": "chelsie", "format": "pcm16"},
                      extra_body=SHORT, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    audio = [d.audio for d in deltas if d.audio is not None]
    assert audio[0].id.startswith("audio_")
    assert all(a.id is None for a in audio[1:])
    assert "".join(a.transcript or "" for a in audio) == msg.audio.transcript
    streamed = b"".join(base64.b64decode(a.data) for a in audio if a.data)
    assert streamed == pcm  # the same samples, in pieces as Code2Wav decoded them
    assert sum(1 for a in audio if a.data) == 2  # tiny: windows of 4 frames (4 + 2)
    last = audio[-1].model_dump(exclude_none=True)
    assert set(last) == {"expires_at"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_voices_change_the_audio(client: openai.OpenAI) -> None:
    said = {v: ask(client, USER, modalities=["text", "audio"], audio={"voice": v, "format": "pcm16"},
                   extra_body=SHORT).choices[0].message.audio for v in ("Ethan", "aiden")}
    assert said["Ethan"].transcript == said["aiden"].transcript and said["Ethan"].data != said["aiden"].data


# ----------------------------------------------------------------------------- /v1/audio/speech
def test_speech_route_reads_the_input_aloud(server: Server, client: openai.OpenAI) -> None:
    extra = {"max_tokens": 5, **SHORT}
    wav = client.audio.speech.create(model=MODEL, voice="aiden", input="Hello from M star.", response_format="wav",
                                     extra_body=extra)
    pcm = wav_frames(wav.content)
    assert len(pcm) == 2 * (FRAMES * SPF - TRIM)
    ref = native(server, "speech", {"prompt": "Hello from M star.", "system": READ_ALOUD, "speaker": "aiden",
                                    **extra})
    assert base64.b64decode(ref["audio_out"]["data"]) == pcm
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="aiden", input="Hello from M star.", response_format="pcm",
            extra_body={**extra, "stream": True}) as resp:
        assert resp.headers["x-sample-rate"] == str(RATE)
        assert b"".join(resp.iter_bytes()) == pcm
    told = client.audio.speech.create(model=MODEL, voice="aiden", input="Hello from M star.", response_format="pcm",
                                      instructions="Whisper.", extra_body=extra)
    ref = native(server, "speech", {"prompt": "Hello from M star.", "system": READ_ALOUD + "\n\nWhisper.",
                                    "speaker": "aiden", **extra})
    assert told.content == base64.b64decode(ref["audio_out"]["data"])


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_field(client: openai.OpenAI) -> None:
    spoken = {"modalities": ["text", "audio"]}
    for stream in (False, True):  # a voice the talker does not know: a 400 before any text is sent
        body = bad_request(ask, client, USER, audio={"voice": "alloy", "format": "pcm16"}, stream=stream, **spoken)
        assert body["param"] == "audio.voice" and "chelsie" in body["message"]
    assert bad_request(ask, client, USER, audio={"voice": "ethan", "format": "mp3"}, **spoken)["param"] == \
        "audio.format"
    body = bad_request(ask, client, USER, audio={"voice": "ethan", "format": "wav"}, stream=True, **spoken)
    assert (body["param"], body["code"]) == ("audio.format", "unsupported")
    assert bad_request(ask, client, USER, **spoken)["param"] == "audio"
    assert bad_request(ask, client, USER, audio={"voice": "ethan", "format": "wav"})["param"] == "audio"
    assert bad_request(ask, client, USER, modalities=["audio"], audio={"voice": "ethan", "format": "wav"})[
        "param"] == "modalities"
    assert bad_request(ask, client, USER, max_tokens=1000)["code"] == "max_tokens_too_large"
    assert bad_request(client.audio.speech.create, model=MODEL, voice="alloy", input="hi")["param"] == "voice"

    def part(p: dict) -> dict:
        return bad_request(ask, client, [{"role": "user", "content": [{"type": "text", "text": "hi"}, p]}])

    clip = wav_file(tone(0.5, 16000), 16000)
    assert part(audio_part(clip, "mp3"))["param"] == "messages[0].content[1].input_audio.format"
    body = part({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}})
    assert (body["param"], body["code"]) == ("messages[0].content[1].input_audio.data", "invalid_audio")
    assert part(audio_part(b"RIFF....WAVEjunk"))["code"] == "invalid_audio"
    body = part(audio_part(wav_file(tone(0.5, 2000), 2000)))  # below the rates the resampler takes
    assert body["param"] == "messages[0].content[1].input_audio.data" and "2000 Hz" in body["message"]
    body = part(audio_part(wav_file(tone(0.005, 16000), 16000)))  # 80 samples: the processor refuses it
    assert body["param"] == "messages[0].content[1]" and "samples" in body["message"]
    body = bad_request(ask, client, [{"role": "user", "content": [audio_part(clip), audio_part(clip)]}])
    assert (body["param"], body["code"]) == ("messages[0].content[1]", "too_many_audio_inputs")
    body = part({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})
    assert (body["param"], body["code"]) == ("messages[0].content[1].image_url.url", "invalid_image")


# ----------------------------------------------------------------------------- in process
@pytest.mark.parametrize(("width", "channels"), [(1, 1), (2, 1), (2, 2), (3, 1), (4, 2)])
def test_decode_wav_reads_integer_pcm(width: int, channels: int) -> None:
    clip = tone(0.1, 22050)
    samples, rate = decode_wav(wav_file(clip, 22050, width, channels))
    assert rate == 22050 and samples.dtype == torch.float32 and samples.shape == (len(clip),)
    assert float((samples.double() - torch.from_numpy(clip)).abs().max()) <= 1.0 / 2 ** (8 * width - 1) + 1e-7


def test_decode_wav_reads_float_and_streamed_headers() -> None:
    clip = tone(0.1, 16000)
    for streamed in (False, True):
        samples, rate = decode_wav(float_wav(clip, 16000, streamed))
        assert rate == 16000 and torch.allclose(samples.double(), torch.from_numpy(clip), atol=1e-7)
    for bad, why in ((b"OggS" + bytes(40), "not a WAV"), (wav_file(clip, 16000)[:40], "no data chunk"),
                     (float_wav(clip, 16000).replace(b"\x03\x00\x01\x00", b"\x02\x00\x01\x00", 1), "format code 2")):
        with pytest.raises(ValueError, match=why):
            decode_wav(bad)


@pytest.mark.parametrize(("orig", "new", "hz", "tol"), [
    (48000, 16000, 1000.0, 1e-5), (44100, 16000, 440.0, 1e-4), (22050, 16000, 3000.0, 1e-4),
    (8000, 16000, 300.0, 1e-4), (16000, 24000, 5000.0, 1e-4),
])
def test_resample_matches_the_tone_at_the_new_rate(orig: int, new: int, hz: float, tol: float) -> None:
    x = torch.sin(2 * math.pi * hz * torch.arange(2 * orig, dtype=torch.float64) / orig).float()
    y = resample(x, orig, new)
    assert y.shape == (math.ceil(2 * orig * new / orig),)
    want = torch.sin(2 * math.pi * hz * torch.arange(y.numel(), dtype=torch.float64) / new)
    inner = slice(new // 10, -new // 10)  # away from the zero padding at the ends
    assert float((y[inner].double() - want[inner]).abs().max()) < tol


def test_resample_removes_what_the_new_rate_cannot_hold() -> None:
    x = torch.sin(2 * math.pi * 10000 * torch.arange(96000, dtype=torch.float64) / 48000).float()  # > 8 kHz
    y = resample(x, 48000, 16000)
    assert float(y[1600:-1600].pow(2).mean().sqrt()) < 0.002  # from 0.707: about -55 dB
    assert torch.equal(resample(x, 16000, 16000), x)
    assert float((resample(torch.ones(4410), 44100, 16000)[50:-50] - 1).abs().max()) < 1e-6
