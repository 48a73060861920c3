"""`/v1/realtime` (issue 28, part 1) with a real WebSocket client (`websockets`) against servers
in subprocesses: the test family (tiny; text, with an API key), the tiny Qwen3-Omni (voice in,
voice and text out; `--weights init`, so the words are noise but every node runs), the
streaming recogniser of models/asr/asr.walk (its `transcribe` walk streams its audio
input in, so the transcript starts before the client commits), and the tiny Whisper (served by
its `transcribe_live` walk, fed each append).

- a two-turn voice conversation whose second turn's prompt holds the first's history: each
  turn's audio and transcript equal the native `/v1/walks/speech` route's given the prompt
  the chat route's plain-text rule makes of the conversation (greedy thinker, seeded talker);
  a text conversation equals `/v1/chat/completions` over the same messages;
- cancel (`response.done` status `cancelled`), disconnect mid-response (the KV pages and the
  request are freed within seconds), out-of-order and malformed events (each an `error` event
  naming the event and the field, the session going on), `session.update`, the API key;
- the streamed transcription equals the walk given the whole audio, and its first delta comes
  before the commit; Whisper's first window's text comes before the commit of 36 s, and its
  completed transcript is `transcribe`'s on the whole audio; clear and disconnect cancel the
  live request and free its pages; out-of-order events are `error` events;
- the second text turn's prefill finds the first turn's prompt pages in the prefix cache
  (`usage.input_token_details.cached_tokens`);
- tools/bench/realtime.py against the Qwen3-Omni server, and against a scripted server: its TTFT
  counts the first non-empty text delta, and a turn whose `.done` text is empty has none;
- in process: `StreamResampler` pieces join to `media.resample` of the whole (to float32 rounding).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
websockets = pytest.importorskip("websockets", reason="the realtime tests need the websockets client")

from test_server_support import ROOT, Server, compile_plan, metric, post, serving, wait_for  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from mstar_runtime.media import resample  # noqa: E402
from mstar_runtime.serve.realtime_protocol import StreamResampler  # noqa: E402
from mstar_runtime.serve.turns import Turn, audio_limit, fit_audio  # noqa: E402

KEY = "sk-realtime"
GREEDY = {"temperature": 0.0, "top_k": 0}
SHORT = {"talker_max_frames": 6, "max_output_tokens": 6}
INSTRUCTIONS = "You are brief."


# ----------------------------------------------------------------------------- servers and helpers
def _compile(walk: Path, out: Path) -> Path:
    from mstarc.cli import main as mstarc

    assert mstarc(["compile", str(walk), "--variant", "tiny", "--placement", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = compile_plan(tmp_path_factory.mktemp("rt-family"), extra=())
    with serving(plan, "--api-key", KEY, "--prefix-caching", "--prefix-chunk", "16") as s:
        yield s


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = _compile(ROOT / "models/qwen3_omni/qwen3_omni.walk", tmp_path_factory.mktemp("rt-omni") / "q.plan")
    with serving(plan, "--request-timeout", "120", "--prefix-caching", "--prefix-chunk", "16") as s:
        yield s


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = _compile(ROOT / "models/whisper/whisper.walk", tmp_path_factory.mktemp("rt-whisper") / "w.plan")
    with serving(plan) as s:
        yield s


@pytest.fixture(scope="module")
def asr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = _compile(ROOT / "models/asr/asr.walk", tmp_path_factory.mktemp("rt-asr") / "asr.plan")
    with serving(plan) as s:
        yield s


class Session:
    """A realtime session: JSON events out, JSON events in (with a bounded wait)."""

    def __init__(self, server: Server, key: str | None = None, **kwargs: object):
        url = server.base.replace("http://", "ws://") + "/v1/realtime"
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self.ws = connect(url, additional_headers=headers, open_timeout=30, **kwargs).__enter__()  # type: ignore[arg-type]
        self.created = self.recv()
        assert self.created["type"] == "session.created"

    def send(self, **event: object) -> None:
        self.ws.send(json.dumps(event))

    def recv(self, timeout: float = 120.0) -> dict:
        return json.loads(self.ws.recv(timeout=timeout))

    def until(self, kind: str, timeout: float = 120.0) -> list[dict]:
        """Events up to and including the first of type `kind`."""
        out = []
        while True:
            out.append(self.recv(timeout))
            if out[-1]["type"] == kind:
                return out

    def error(self, **event: object) -> dict:
        """Send `event`; the `error` event it gets (the session must answer nothing else first)."""
        self.send(**event)
        got = self.recv(30)
        assert got["type"] == "error", got
        return got["error"]

    def alive(self) -> None:
        """The session still answers (a bad event did not close it)."""
        self.send(type="session.update", session={})
        assert self.recv(30)["type"] == "session.updated"

    def close(self) -> None:
        self.ws.close()


def pcm(samples: np.ndarray) -> str:
    return base64.b64encode(np.round(samples * 32767).astype("<i2").tobytes()).decode()


def tone(seconds: float, hz: float, rate: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.3 * np.sin(2 * np.pi * hz * t) + 0.1 * np.sin(2 * np.pi * 2.3 * hz * t)


def heard(samples: np.ndarray, rate: int = 16000) -> list[float]:
    """What the server hands the walk for `samples` sent as pcm16 at 24 kHz: their 16-bit
    values, resampled to the walk's rate by the resampler the chat route uses."""
    ints = np.round(samples * 32767).astype(np.int16)
    return resample(torch.from_numpy(ints.astype(np.float32) / 32768.0), 24000, rate).tolist()


def speak(s: Session, samples: np.ndarray, pieces: int = 4) -> str:
    """Append `samples` in `pieces`, commit; the committed item's id."""
    for part in np.array_split(samples, pieces):
        s.send(type="input_audio_buffer.append", audio=pcm(part))
    s.send(type="input_audio_buffer.commit")
    committed = s.recv()
    assert committed["type"] == "input_audio_buffer.committed", committed
    created = s.recv()
    assert created["type"] == "conversation.item.created" and created["item"]["id"] == committed["item_id"]
    assert created["item"]["role"] == "user" and created["item"]["content"][0]["type"] == "input_audio"
    return str(committed["item_id"])


def reply(s: Session, **response: object) -> tuple[list[dict], str, bytes]:
    """`response.create`; its events, the text (transcript) deltas joined, the audio deltas joined."""
    s.send(type="response.create", response=response)
    events = s.until("response.done")
    text = "".join(e["delta"] for e in events if e["type"] in ("response.audio_transcript.delta",
                                                                 "response.text.delta"))
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    return events, text, audio


def native(server: Server, walk: str, inputs: dict) -> dict:
    status, raw = post(f"{server.base}/v1/walks/{walk}", {"inputs": inputs, "stream": False}, timeout=120)
    assert status == 200, raw
    return json.loads(raw)["outputs"]


def pages_back(server: Server, sessions: int = 1) -> None:
    """The KV pages and requests free within seconds; `sessions` sockets still open."""
    wait_for(lambda: metric(server.base, "mstar_kv_pages_in_use") == 0
             and metric(server.base, "mstar_requests_active") == 0, 10, "the KV pages and requests to be freed")
    wait_for(lambda: metric(server.base, "mstar_realtime_sessions") == sessions, 10, f"{sessions} open sessions")


# ----------------------------------------------------------------------------- in process
@pytest.mark.parametrize("sizes", [[480], [1, 7, 2399, 13, 4800, 333], [10**6]])
@pytest.mark.parametrize("rates", [(24000, 16000), (24000, 44100), (16000, 16000)])
def test_stream_resampler_joins_to_the_whole(sizes: list[int], rates: tuple[int, int]) -> None:
    x = torch.from_numpy(np.random.default_rng(1).uniform(-0.5, 0.5, 24000 + 17).astype(np.float32))
    r, outs, at, k = StreamResampler(*rates), [], 0, 0
    while at < x.numel():
        outs.append(r.push(x[at:at + sizes[k % len(sizes)]]))
        at, k = at + sizes[k % len(sizes)], k + 1
    outs.append(r.close())
    joined, whole = torch.cat(outs), resample(x, *rates)
    assert joined.shape == whole.shape and (joined - whole).abs().max() <= 1e-6  # float32 rounding of the dot products


def test_fit_audio_leaves_out_the_oldest_clips() -> None:
    clip = torch.zeros
    turns = [Turn("user", "a", clip(100)), Turn("assistant", "b"), Turn("user", "c", clip(200)),
             Turn("assistant", "d"), Turn("user", "e", clip(300))]
    kept = [t.clip.numel() if t.clip is not None else 0 for t in fit_audio(turns, 500)]
    assert kept == [0, 0, 200, 0, 300] and [t.text for t in fit_audio(turns, 500)] == list("abcde")
    assert fit_audio(turns, None) == turns and fit_audio(turns, 600) == turns
    assert [t.clip is not None for t in fit_audio(turns, 10)] == [False, False, False, False, True]  # the new turn's stays
    assert audio_limit(type("P", (), {"features": type("F", (), {"max_audio_seconds": 300.0})()})(), 16000) == 4800000


# ----------------------------------------------------------------------------- the test family (text)
def test_session_update_and_its_errors(family: Server) -> None:
    s = Session(family, KEY)
    assert s.created["session"]["modalities"] == ["text"] and s.created["session"]["voice"] is None
    s.send(type="session.update", session={"instructions": "Be kind.", "temperature": 0.5,
                                           "max_response_output_tokens": 4})
    updated = s.recv()
    assert updated["type"] == "session.updated"
    assert updated["session"]["instructions"] == "Be kind." and updated["session"]["max_response_output_tokens"] == 4
    cases = [
        ({"voice": "alloy"}, "session.voice", "unsupported"),  # the test family does not speak
        ({"modalities": ["text", "audio"]}, "session.modalities[1]", "unsupported_modality"),
        ({"modalities": "text"}, "session.modalities", "invalid_value"),
        ({"colour": "red"}, "session.colour", "unknown_parameter"),
        ({"turn_detection": {"type": "server_vad"}}, "session.turn_detection", "unsupported"),
        ({"input_audio_format": "g711_ulaw"}, "session.input_audio_format", "unsupported"),
        ({"temperature": 3}, "session.temperature", "invalid_value"),
        ({"max_response_output_tokens": 0}, "session.max_response_output_tokens", "invalid_value"),
        ({"instructions": 5}, "session.instructions", "invalid_value"),
    ]
    for session, param, code in cases:
        err = s.error(type="session.update", session=session, event_id="ev-1")
        assert (err["param"], err["code"], err["event_id"]) == (param, code, "ev-1"), err
        assert err["type"] == "invalid_request_error" and "session.update" in err["message"]
    assert s.error(type="session.update")["param"] == "session"
    s.alive()
    s.close()


def test_out_of_order_and_malformed_events_are_errors(family: Server) -> None:
    s = Session(family, KEY)
    s.ws.send("{not json")
    assert s.recv()["error"]["code"] == "invalid_json"
    s.ws.send("[1, 2]")
    assert s.recv()["error"]["code"] == "invalid_event"
    assert s.error(event_id="e0")["param"] == "type"
    err = s.error(type="conversation.item.frobnicate", event_id="e1")
    assert (err["code"], err["param"], err["event_id"]) == ("unknown_event", "type", "e1")
    assert "conversation.item.frobnicate" in err["message"]
    assert s.error(type="conversation.item.truncate")["code"] == "unsupported_event"
    err = s.error(type="input_audio_buffer.commit", event_id="e2")
    assert (err["code"], err["event_id"]) == ("input_audio_buffer_commit_empty", "e2") and "commit" in err["message"]
    err = s.error(type="input_audio_buffer.append", audio=pcm(tone(0.2, 440)))
    assert (err["code"], err["param"]) == ("unsupported_modality", "audio")  # the test family hears nothing
    assert s.error(type="response.cancel")["code"] == "response_cancel_not_active"
    assert s.error(type="response.create")["code"] == "conversation_empty"
    bad_items = [
        ({"type": "message", "role": "user", "content": [{"type": "input_text"}]}, "item.content[0].text"),
        ({"type": "message", "role": "user", "content": [{"type": "text", "text": "x"}]}, "item.content[0].type"),
        ({"type": "message", "role": "robot", "content": [{"type": "input_text", "text": "x"}]}, "item.role"),
        ({"type": "message", "role": "user", "content": []}, "item.content"),
        ({"type": "function_call", "role": "user", "content": []}, "item.type"),
    ]
    for item, param in bad_items:
        assert s.error(type="conversation.item.create", item=item)["param"] == param
    s.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "hi"}]})
    assert s.recv()["type"] == "conversation.item.created"
    err = s.error(type="response.create", response={"max_output_tokens": 1000})
    assert (err["code"], err["param"]) == ("max_tokens_too_large", "response.max_output_tokens")  # over 33
    err = s.error(type="response.create", response={"colour": 1})
    assert (err["code"], err["param"]) == ("unknown_field", "response.colour")
    err = s.error(type="response.create", response={"temperature": 0.5})  # the family's chat is greedy
    assert (err["code"], err["param"]) == ("unsupported", "response.temperature")
    # a second response.create while the first runs: an error, and the first goes on to its end
    s.send(type="response.create", response={"max_output_tokens": 30})
    s.send(type="response.create", event_id="again")
    events = s.until("response.done")
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("conversation_already_has_active_response", "again")]
    assert events[-1]["response"]["status"] in ("completed", "incomplete")
    s.alive()
    s.close()


def test_text_conversation_keeps_its_history(family: Server) -> None:
    import urllib.error
    import urllib.request

    def chat(messages: list[dict], max_tokens: int) -> dict:
        req = urllib.request.Request(family.base + "/v1/chat/completions", data=json.dumps(
            {"model": "testfamily", "messages": messages, "max_tokens": max_tokens}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback test server
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(e.read().decode()) from None

    s = Session(family, KEY)
    # the tiny family's context is 96 bytes (its tokens): short turns, short replies, no instructions
    history: list[dict] = []
    cached, prompts = [], []
    for turn, text in enumerate(("hello", "ok")):
        s.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": text}]})
        assert s.recv()["item"]["content"] == [{"type": "input_text", "text": text}]
        events, said, _ = reply(s, max_output_tokens=3)
        history.append({"role": "user", "content": text})
        ref = chat(history, 3)
        assert said == ref["choices"][0]["message"]["content"], turn  # the same prompt: the whole conversation
        done = events[-1]["response"]
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
        assert done["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
        cached.append(done["usage"]["input_token_details"]["cached_tokens"])
        prompts.append(done["usage"]["input_tokens"])
        assert done["output"][0]["content"] == [{"type": "text", "text": said}]
        kinds = [e["type"] for e in events]
        assert kinds[:4] == ["response.created", "response.output_item.added", "conversation.item.created",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.text.done", "response.content_part.done", "response.output_item.done",
                              "response.done"]
        history.append({"role": "assistant", "content": said})
    # the second turn's prompt begins with the first's: the prefix cache holds the first's full
    # pages (16 tokens on placements/cpu.yaml) and the second prefill skips them
    assert cached == [0, prompts[0] // 16 * 16] and cached[1] > 0
    # an out-of-band response (conversation "none") is not kept
    events, _, _ = reply(s, max_output_tokens=2, conversation="none")
    assert events[-1]["response"]["conversation_id"] is None
    assert not any(e["type"] == "conversation.item.created" for e in events)
    _, third, _ = reply(s, max_output_tokens=1)
    assert third == chat(history, 1)["choices"][0]["message"]["content"]
    s.close()


def test_api_key_and_model(family: Server) -> None:
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        Session(family)
    assert e.value.response.status_code == 403
    with pytest.raises(websockets.exceptions.InvalidStatus):
        Session(family, "sk-wrong")
    s = Session(family, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"])  # as browsers send it
    assert s.ws.subprotocol == "realtime"
    s.close()
    url = family.base.replace("http://", "ws://") + "/v1/realtime?model=gpt-4o-realtime-preview"
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}, open_timeout=30) as ws:
        err = json.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and (err["error"]["code"], err["error"]["param"]) == ("model_not_found", "model")


# ----------------------------------------------------------------------------- Qwen3-Omni (voice)
def test_two_turn_voice_conversation(omni: Server) -> None:
    s = Session(omni)
    assert s.created["session"]["modalities"] == ["text", "audio"] and s.created["session"]["voice"] == "ethan"
    s.send(type="session.update", session={"voice": "chelsie", "instructions": INSTRUCTIONS})
    assert s.recv()["session"]["voice"] == "chelsie"
    first, second = tone(0.6, 440), tone(0.5, 330)
    speak(s, first)
    events, said1, audio1 = reply(s, **GREEDY, **SHORT, seed=3)
    kinds = {e["type"] for e in events}
    assert {"response.audio_transcript.delta", "response.audio.delta", "response.audio.done",
            "response.audio_transcript.done"} <= kinds
    done = events[-1]["response"]
    assert done["voice"] == "chelsie" and done["output"][0]["content"] == [{"type": "audio", "transcript": said1}]
    inputs = {"system": INSTRUCTIONS, "speaker": "chelsie", "seed": 3, "max_tokens": 6, "talker_max_frames": 6,
              **GREEDY}
    ref = native(omni, "speech", {**inputs, "prompt": "", "audio": heard(first)})  # one audio message: no text
    assert said1 == ref["text"] and audio1 == base64.b64decode(ref["audio_out"]["data"]) and audio1
    speak(s, second)
    events, said2, audio2 = reply(s, **GREEDY, **SHORT, seed=3)
    # the second turn: the first as the walk's history (its clip at the front of `audio`), then the new clip
    history = [{"role": "user", "content": "", "audio": len(heard(first))}, {"role": "assistant", "content": said1}]
    ref = native(omni, "speech", {**inputs, "prompt": "", "history": json.dumps(history),
                                  "audio": heard(first) + heard(second)})
    assert said2 == ref["text"] and audio2 == base64.b64decode(ref["audio_out"]["data"])
    assert events[-1]["response"]["usage"]["input_tokens"] > done["usage"]["input_tokens"] + 10  # both clips
    # text out only: the chat walk, with the same history
    s.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "why?"}]})
    s.recv()
    events, said3, audio3 = reply(s, **GREEDY, modalities=["text"], max_output_tokens=5)
    assert audio3 == b"" and any(e["type"] == "response.text.delta" for e in events)
    history += [{"role": "user", "content": "", "audio": len(heard(second))}, {"role": "assistant", "content": said2}]
    assert said3 == native(omni, "chat", {"prompt": "why?", "system": INSTRUCTIONS, "history": json.dumps(history),
                                          "audio": heard(first) + heard(second), "max_tokens": 5, **GREEDY})["text"]
    s.close()
    pages_back(omni, sessions=0)


def test_voice_in_text_out_reuses_the_turn_before(omni: Server) -> None:
    """Each turn's prompt begins with the turn before's, its clip keyed by its own rows: the
    second text reply's prefill finds the first's prompt pages cached (the chat walk's prefill is
    keyed whole; the speech walk's only up to its first clip, by the prefix cache's rule)."""
    s = Session(omni)
    # instructions no other test sends: nothing of this conversation is cached before it
    s.send(type="session.update", session={"modalities": ["text"], "instructions": "Answer in one word, please."})
    s.recv()
    used = []
    for clip in (tone(1.3, 200), tone(1.1, 260)):  # over 1 s: a clip's rows do not depend on the others
        speak(s, clip)
        events, _, _ = reply(s, **GREEDY, max_output_tokens=4)
        used.append(events[-1]["response"]["usage"])
    assert used[0]["input_token_details"]["cached_tokens"] == 0
    assert used[1]["input_token_details"]["cached_tokens"] >= used[0]["input_tokens"] // 16 * 16 > 0
    s.close()


def test_voice_errors(omni: Server) -> None:
    s = Session(omni)
    s.send(type="session.update", session={"voice": "nobody"})
    s.recv()
    speak(s, tone(0.3, 440), pieces=1)
    events, _, _ = reply(s, **SHORT)
    err = next(e["error"] for e in events if e["type"] == "error")
    assert err["param"] == "session.voice" and "nobody" in err["message"]
    assert events[-1]["response"]["status"] == "failed"
    assert s.error(type="input_audio_buffer.append", audio="not base64!")["param"] == "audio"
    assert s.error(type="input_audio_buffer.append", audio=base64.b64encode(b"abc").decode())["code"] == \
        "invalid_audio"  # an odd number of bytes
    s.send(type="input_audio_buffer.append", audio=pcm(tone(0.05, 440)))
    err = s.error(type="input_audio_buffer.commit")
    assert err["code"] == "input_audio_buffer_commit_empty" and "50 ms" in err["message"]
    s.send(type="input_audio_buffer.clear")
    assert s.recv()["type"] == "input_audio_buffer.cleared"
    assert s.error(type="input_audio_buffer.commit")["code"] == "input_audio_buffer_commit_empty"
    err = s.error(type="response.create", response={"modalities": ["audio"]})
    assert err["param"] == "response.modalities"
    s.alive()
    s.close()


def test_cancel(omni: Server) -> None:
    s = Session(omni)
    speak(s, tone(0.4, 440), pieces=2)
    s.send(type="response.create", response={**GREEDY, "talker_max_frames": 64})
    seen = s.until("response.audio.delta")
    rid = seen[0]["response"]["id"]
    s.send(type="response.cancel", response_id="resp_other")  # deltas of the reply may come first
    assert s.until("error")[-1]["error"]["param"] == "response_id"
    s.send(type="response.cancel", response_id=rid)
    done = s.until("response.done")[-1]["response"]
    assert done["id"] == rid and done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    pages_back(omni)
    # the session goes on: the cancelled reply's words stay in the conversation as the assistant's
    # turn, which Qwen3-Omni's walks cannot answer (they answer a user turn): an error says so
    err = s.error(type="response.create", response=SHORT)
    assert err["code"] == "invalid_value" and "ends with assistant's" in err["message"]
    s.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "go on"}]})
    s.recv()
    events, _, audio = reply(s, **GREEDY, **SHORT)
    assert events[-1]["response"]["status"] in ("completed", "incomplete") and audio
    s.close()


def test_disconnect_frees_the_request_and_its_pages(omni: Server) -> None:
    before = metric(omni.base, "mstar_requests_total", 'walk="speech",outcome="cancelled"')
    s = Session(omni)
    speak(s, tone(0.4, 440), pieces=2)
    s.send(type="response.create", response={**GREEDY, "talker_max_frames": 64})
    s.until("response.audio.delta")
    assert metric(omni.base, "mstar_kv_pages_in_use") > 0 and metric(omni.base, "mstar_realtime_sessions") == 1
    t0 = time.monotonic()
    s.ws.close()
    pages_back(omni, sessions=0)
    assert time.monotonic() - t0 < 10
    assert metric(omni.base, "mstar_requests_total", 'walk="speech",outcome="cancelled"') == before + 1


# ----------------------------------------------------------------------------- streamed transcription
def test_streamed_transcription_starts_before_the_commit(asr: Server) -> None:
    s = Session(asr)
    sound = np.random.default_rng(4).uniform(-0.5, 0.5, 3600)  # 150 ms at 24 kHz: 100 ms at the walk's 16 kHz
    parts = np.array_split(sound, 6)
    for part in parts[:3]:
        s.send(type="input_audio_buffer.append", audio=pcm(part))
    first = s.recv()
    assert first["type"] == "conversation.item.input_audio_transcription.delta"  # before any commit
    for part in parts[3:]:
        s.send(type="input_audio_buffer.append", audio=pcm(part))
    s.send(type="input_audio_buffer.commit")
    events = s.until("conversation.item.input_audio_transcription.completed")
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert committed["item_id"] == first["item_id"]
    deltas = [first["delta"]] + [e["delta"] for e in events
                                 if e["type"] == "conversation.item.input_audio_transcription.delta"]
    text = events[-1]["transcript"]
    assert "".join(deltas) == text
    whole = native(asr, "transcribe", {"audio": heard(sound)})["text"]
    assert text == " ".join(map(str, whole))
    err = s.error(type="response.create")
    assert err["code"] == "unsupported"
    # clear cancels the request the buffer was streaming into
    s.send(type="input_audio_buffer.append", audio=pcm(parts[0]))
    s.send(type="input_audio_buffer.clear")
    got = s.until("input_audio_buffer.cleared")
    assert all(e["type"] != "error" for e in got)
    pages_back(asr)
    s.close()


LIVE = "conversation.item.input_audio_transcription"


def append_all(s: Session, samples: np.ndarray, seconds: float = 2.0) -> None:
    """Append `samples` in pieces of `seconds`, as a client streaming a microphone does."""
    step = int(seconds * 24000)
    for at in range(0, len(samples), step):
        s.send(type="input_audio_buffer.append", audio=pcm(samples[at:at + step]))


def test_whisper_transcribes_live_before_the_commit(whisper: Server) -> None:
    """The plan's `transcribe_live` is fed each append: the first window's text arrives before
    the commit, and the completed transcript is `transcribe`'s on the whole audio."""
    s = Session(whisper)
    sound = tone(36.0, 300)  # over one 30 s window (and the second of audio that completes it)
    append_all(s, sound)
    first = s.recv(300)
    assert first["type"] == f"{LIVE}.delta" and first["delta"], first  # no commit sent yet
    s.send(type="input_audio_buffer.commit")
    events = s.until(f"{LIVE}.completed", 300)
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert committed["item_id"] == first["item_id"] == events[-1]["item_id"]
    whole = native(whisper, "transcribe", {"audio": heard(sound), "timestamps": True})
    assert events[-1]["transcript"] == whole["text"]
    # out of order: a response (the session transcribes), an empty commit, a chat item
    assert s.error(type="response.create")["code"] == "unsupported"
    assert s.error(type="input_audio_buffer.commit")["code"] == "input_audio_buffer_commit_empty"
    assert s.error(type="conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}]})["code"] == "unsupported"
    s.alive()
    s.close()
    pages_back(whisper, sessions=0)


def test_whisper_live_clear_and_disconnect_free_the_request(whisper: Server) -> None:
    cancelled = 'walk="transcribe_live",outcome="cancelled"'
    before = metric(whisper.base, "mstar_requests_total", cancelled)
    s = Session(whisper)
    append_all(s, tone(3.0, 300))
    wait_for(lambda: metric(whisper.base, "mstar_requests_active") == 1, 10, "the live request")
    s.send(type="input_audio_buffer.clear")
    got = s.until("input_audio_buffer.cleared")
    assert all(e["type"] != "error" for e in got), got
    pages_back(whisper)
    append_all(s, tone(33.0, 200))  # the first window decodes: its pages are held
    assert s.recv(300)["type"] == f"{LIVE}.delta"
    s.ws.close()
    pages_back(whisper, sessions=0)
    assert metric(whisper.base, "mstar_requests_total", cancelled) == before + 2


# ----------------------------------------------------------------------------- the benchmark
def test_the_benchmark_measures_ttfa(omni: Server, tmp_path: Path) -> None:
    from support import load_script

    bench = load_script("tools/bench/realtime.py", "bench_realtime")
    out = tmp_path / "realtime.json"
    url = omni.base.replace("http://", "ws://") + "/v1/realtime"
    assert bench.main(["--url", url, "--sessions", "1,2", "--turns", "2", "--seconds", "0.3", "--warmup", "0",
                       "--extra", json.dumps({**SHORT, "seed": 1}), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["sessions"], r["turns"], r["ok"], r["failed"]) for r in runs] == [(1, 2, 2, 0), (2, 4, 4, 0)]
    for r in runs:
        assert r["ttfa"]["n"] == r["turns"] and r["ttfa_first_turn"]["n"] == r["sessions"]
        assert r["ttft"]["n"] == r["turns"] and r["empty_transcripts"] == 0  # the tiny vocabulary decodes
        assert 0 < r["ttfa"]["min"] <= r["ttfa"]["max"] <= r["turn"]["max"] and r["audio_s_per_s"] > 0
    source = (ROOT / "tools/bench/realtime.py").read_text()
    assert "import mstar_runtime" not in source and "from mstar_runtime" not in source  # any server's protocol


def test_the_benchmark_times_the_first_text(tmp_path: Path) -> None:
    """A scripted server: turn 1 sends an empty transcript delta, then after 0.2 s the text;
    turn 2 only empty deltas and an empty `.done` (random weights' ids that decode to nothing)."""
    import asyncio

    from support import load_script
    from websockets.asyncio.server import serve

    bench = load_script("tools/bench/realtime.py", "bench_realtime")
    turn = {"n": 0}

    async def script(ws: object) -> None:
        async def send(kind: str, **event: object) -> None:
            await ws.send(json.dumps({"type": kind, **event}))  # type: ignore[attr-defined]

        await send("session.created")
        async for raw in ws:  # type: ignore[attr-defined]
            kind = json.loads(raw)["type"]
            if kind == "session.update":
                await send("session.updated")
            elif kind == "response.create":
                said = "hi" if turn["n"] == 0 else ""
                turn["n"] += 1
                await send("response.audio_transcript.delta", delta="")
                await send("response.audio.delta", delta=base64.b64encode(bytes(480)).decode())
                await asyncio.sleep(0.2)
                await send("response.audio_transcript.delta", delta=said)
                await send("response.audio_transcript.done", transcript=said)
                await send("response.done", response={"status": "completed"})

    async def measure() -> dict:
        async with serve(script, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            args = bench.parse_args(["--url", f"ws://127.0.0.1:{port}/v1/realtime", "--turns", "2",
                                     "--seconds", "0.2", "--timeout", "30"])
            return await bench.run(args, 1, [bench.voiced(0.2, 140.0)], {})

    r = asyncio.run(measure())
    assert (r["ok"], r["empty_transcripts"], r["ttfa"]["n"], r["ttft"]["n"]) == (2, 1, 2, 1)
    assert r["ttft"]["min"] >= 0.2 > r["ttfa"]["max"]
