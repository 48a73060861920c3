"""`/v1/realtime`: live sessions over a WebSocket in the OpenAI Realtime event protocol, as far
as it applies (docs/serving.md, "/v1/realtime"; events parsed in `serve.realtime_protocol`).

Two kinds of session, by the plan:
- a conversation (a plan with a walk that declares `chat`; audio and speech out through the
  chat walk with spoken replies, `chat.spoken_walk`: Qwen3-Omni's `speech`). The session keeps the
  conversation's items across turns. A walk with a `history` input (Qwen3-Omni's) gets the
  earlier items as its turns and every user clip, resampled from 24 kHz pcm16 to the rate
  its prompt node reads (`media.resample`, once per clip), at the front of its audio input,
  the last (user) item as the prompt: each turn's prompt begins with the turn before's,
  which the prefix cache reuses. Any other walk gets the items rendered as the chat route
  renders the same messages (`chat.render_prompt`: the walk's chat template or the
  plain-text rule) and the last item's audio, when it is the user's. The session's
  `instructions` are the system message.
  The reply streams as `response.audio_transcript.delta` and `response.audio.delta`
  (base64 pcm16 at the plan's rate: 24 kHz for Qwen3-Omni), or `response.text.delta`, then
  `response.done`; the assistant's item joins the conversation (its transcript).
- a transcription (a plan without a chat walk whose walk that declares `transcriptions`
  streams its token ids, or a walk whose audio is a streamed input).
  Committed audio goes to its `file` slot and becomes a user item whose transcript streams as
  `conversation.item.input_audio_transcription.delta` events, then `.completed`. When the
  walk streams its audio input in (`stream transcribe.audio -> ...`), the request is submitted at the first `input_audio_buffer.append` and each append
  is fed to it at once (`RequestHandle.feed`, resampled piece by piece by
  `StreamResampler`), so the model works on the first chunks while the client still
  speaks; `commit` closes the input (`close_input`), `clear` cancels the request.
  A walk that takes its audio whole but has a live twin (`live_twin`: Whisper's
  `transcribe_live` beside `transcribe`) is served by the twin, fed the same way: each of its
  `partial` lines (one per decoded window) is a `.delta` of that window's text, and
  `.completed` carries the twin's final `text`, which is the whole walk's on the same audio
  with timestamps (the twin is asked for them: the audio may pass one 30 s window); a window
  revised at the end is in `.completed` only (deltas are not retracted).

A client event the session cannot take (malformed JSON, an unknown type, a commit of an
empty buffer, `response.create` while a response runs, a field out of range, a value a node
refuses) is answered with an `error` event naming the event and the field; the socket stays
open. A client that disconnects cancels its running request at once (the flight's
disconnect watch, and the session's cleanup), which frees its KV pages. With `--api-key`,
the handshake needs `Authorization: Bearer KEY` or the subprotocol
`openai-insecure-api-key.KEY` (what browsers send); without it the handshake is refused (403).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import torch

from mstar_runtime.api import RequestFailed
from mstar_runtime.ops.node import RequestError
from mstar_runtime.serve.app import (
    MAX_TOKEN_INPUTS,
    check_api_key,
    check_token_limit,
    start_flight,
    walk_extras,
)
from mstar_runtime.serve.chat import (
    Reply,
    SpokenReply,
    audio_input,
    input_rate,
    prompt_inputs,
    render_prompt,
    system_input,
)
from mstar_runtime.serve.common import ApiError, ClientGone
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.realtime_protocol import (
    CLIENT_RATE,
    MAX_BUFFER_SECONDS,
    EventError,
    Item,
    SessionConfig,
    StreamResampler,
    check_modalities,
    error_event,
    field_of,
    max_tokens_of,
    message_item,
    new_id,
    parse_event,
    pcm16_samples,
    session_update,
    temperature_of,
)
from mstar_runtime.serve.realtime_sessions import Served, live_twin, served
from mstar_runtime.serve.schemas import ChatCompletionRequest, ChatMessage
from mstar_runtime.serve.turns import Turn, audio_limit, fit_audio, renders_turns, turn_inputs
from mstar_runtime.serve.web import WebSocket

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState, WalkRole

log = logging.getLogger("mstar_runtime.serve.server")
MIN_COMMIT_SAMPLES = CLIENT_RATE // 10  # 100 ms, OpenAI's minimum for a commit
RESPONSE_FIELDS = frozenset({"modalities", "instructions", "voice", "output_audio_format", "temperature",
                             "max_output_tokens", "max_response_output_tokens", "conversation", "metadata"})


def install(app: FastAPI, state: ServerState) -> None:
    what = served(state)
    if what is None:
        return
    from starlette.websockets import WebSocketDisconnect

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        if state.api_key_digest is not None:
            keys = [p.removeprefix("openai-insecure-api-key.") for p in offered
                    if p.startswith("openai-insecure-api-key.")]
            header = ws.headers.get("authorization")
            presented = header.encode("latin-1") if header else (f"Bearer {keys[0]}".encode() if keys else None)
            if check_api_key(presented, state.api_key_digest) is not None:
                await ws.close(code=1008)  # before accepting: the handshake is refused (HTTP 403)
                return
        await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        session = Session(state, what, ws)
        state.realtime_sessions += 1
        model = ws.query_params.get("model")
        try:
            if model is not None and model != state.model_id:
                await session.send(error_event("model_not_found", f"the model '{model}' does not exist; this server "
                                               f"serves '{state.model_id}'", "model", None))
                await ws.close(code=1008)
                return
            await session.run()
        except WebSocketDisconnect:
            pass
        finally:
            state.realtime_sessions -= 1
            session.end()


class _Peer:
    """What `start_flight` and `Flight` read of a request: `receive`, which answers
    `http.disconnect` once the session's socket has closed (so a flight's disconnect watch
    cancels its request as it does for an HTTP client that hangs up)."""

    def __init__(self, gone: asyncio.Event):
        self._gone = gone

    async def receive(self) -> Mapping[str, Any]:
        await self._gone.wait()
        return {"type": "http.disconnect"}


@dataclasses.dataclass
class _Running:
    """A response in flight."""

    id: str
    flight: Flight
    task: asyncio.Task[None]
    cancelled: bool = False


class Session:
    """One realtime session on one socket (module docstring)."""

    def __init__(self, state: ServerState, what: Served, ws: Any):
        self.state, self.what, self.ws = state, what, ws
        self.id = new_id("sess")
        self.gone = asyncio.Event()
        self.peer = _Peer(self.gone)
        speech = what.speech
        voice = speech.role.inputs[speech.voice].get("default") if speech and speech.voice else None
        self.config = SessionConfig(modalities=what.modalities, voice=voice, served_modalities=what.modalities)
        self.items: list[Item] = []
        self.buffer: list[torch.Tensor] = []  # appended audio, 24 kHz
        self.buffered = 0  # samples in it
        self.response: _Running | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.flights: set[Flight] = set()
        self._lock = asyncio.Lock()
        # a streamed transcription: the request fed since the first append of this buffer
        self.fed: tuple[Flight, StreamResampler, str] | None = None

    # ---- the socket
    async def send(self, event: dict[str, Any]) -> None:
        if self.gone.is_set():
            return
        async with self._lock:
            try:
                await self.ws.send_text(json.dumps(event, separators=(",", ":")))
            except Exception:  # closed under us (WebSocketDisconnect, or a send after close): the session ends
                self.gone.set()

    async def run(self) -> None:
        from starlette.websockets import WebSocketDisconnect

        await self.send({"type": "session.created", "event_id": new_id("event"),
                         "session": self.config.to_json(self.id, self.state.model_id)})
        while True:
            try:
                message = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):
                return
            if message.get("type") == "websocket.disconnect":
                return
            raw = message.get("text")
            raw = raw if raw is not None else message.get("bytes") or b""
            event: dict[str, Any] = {}
            try:
                event = parse_event(raw)
                await self.handle(event)
            except EventError as e:
                await self.send(error_event(e.code, e.message, e.param, e.event_id))
            except ApiError as e:  # a check shared with the HTTP routes (walk inputs, token limits, admission)
                kind = event.get("type", "?")
                await self.send(error_event(e.code or "invalid_value", f"{kind}: {e.message}", e.param,
                                            event.get("event_id"), e.type))
            except Exception:  # a bug: logged once, answered without its details; the session goes on
                log.exception("realtime session %s: event %r failed", self.id, event.get("type"))
                await self.send(error_event("internal_error", f"{event.get('type', '?')}: internal server error (the "
                                            "server log has the details)", None, event.get("event_id"),
                                            "server_error"))

    def end(self) -> None:
        """The socket closed: cancel what still runs (synchronously: its pages go now)."""
        self.gone.set()
        for flight in list(self.flights):
            flight.finish()
        for task in list(self.tasks):
            task.cancel()

    # ---- events
    async def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        eid = event.get("event_id")
        if kind == "session.update":
            self.config = session_update(self.config, event)
            await self.send({"type": "session.updated", "event_id": new_id("event"),
                             "session": self.config.to_json(self.id, self.state.model_id)})
        elif kind == "input_audio_buffer.append":
            await self._append(event)
        elif kind == "input_audio_buffer.commit":
            await self._commit(event)
        elif kind == "input_audio_buffer.clear":
            self._clear()
            await self.send({"type": "input_audio_buffer.cleared", "event_id": new_id("event")})
        elif kind == "conversation.item.create":
            if self.what.transcribe is not None:
                raise EventError("unsupported", "conversation.item.create: this session transcribes audio (the plan "
                                 "has no chat walk); send input_audio_buffer.append and commit", "type", eid)
            item = await asyncio.to_thread(message_item, event)  # base64 audio: off the loop
            if item.audio is not None and not self.what.hears():
                raise EventError("unsupported_modality", "conversation.item.create: this model takes no audio input",
                                 "item.content", eid)
            await self._add(item, event.get("previous_item_id"))
        elif kind == "response.create":
            await self._create_response(event)
        elif kind == "response.cancel":
            running = self.response
            if running is None:
                raise EventError("response_cancel_not_active", "response.cancel: no response is in progress",
                                 None, eid)
            wanted = event.get("response_id")
            if wanted is not None and wanted != running.id:
                raise EventError("invalid_value", f"response.cancel: response '{wanted}' is not the one in "
                                 f"progress ('{running.id}')", "response_id", eid)
            running.cancelled = True
            running.flight.handle.cancel()

    async def _add(self, item: Item, previous: Any = None) -> None:
        prev = self.items[-1].id if self.items else None
        if isinstance(previous, str) and previous != prev:
            at = next((i for i, it in enumerate(self.items) if it.id == previous), None)
            if at is None:
                raise EventError("item_not_found", f"conversation.item.create: previous_item_id '{previous}' is not "
                                 "an item of this conversation", "previous_item_id")
            self.items.insert(at + 1, item)
            prev = previous
        else:
            self.items.append(item)
        await self.send({"type": "conversation.item.created", "event_id": new_id("event"),
                         "previous_item_id": prev, "item": item.to_json()})

    async def _append(self, event: dict[str, Any]) -> None:
        eid = event.get("event_id")
        if not self.what.hears():
            raise EventError("unsupported_modality", "input_audio_buffer.append: this model takes no audio input",
                             "audio", eid)
        data = field_of(event, "audio", str, "audio", required=True)
        samples = await asyncio.to_thread(pcm16_samples, data, "audio", event)
        if (self.buffered + samples.numel()) / CLIENT_RATE > MAX_BUFFER_SECONDS:
            raise EventError("input_audio_buffer_too_large", f"input_audio_buffer.append: the buffer would hold "
                             f"more than {MAX_BUFFER_SECONDS:g} s of audio; commit or clear it", "audio", eid)
        self.buffer.append(samples)
        self.buffered += samples.numel()
        if self.what.streamed:
            await self._feed(samples, event)

    def _clear(self) -> None:
        self.buffer, self.buffered = [], 0
        if self.fed is not None:
            flight, _, _ = self.fed
            self.fed = None
            flight.finish()  # cancels the request the buffer was streaming into

    async def _commit(self, event: dict[str, Any]) -> None:
        eid = event.get("event_id")
        if self.buffered < MIN_COMMIT_SAMPLES:
            raise EventError("input_audio_buffer_commit_empty", f"input_audio_buffer.commit: the buffer holds "
                             f"{1000 * self.buffered / CLIENT_RATE:.0f} ms of audio; at least 100 ms are needed",
                             None, eid)
        audio = torch.cat(self.buffer)
        item_id = self.fed[2] if self.fed is not None else new_id("item")
        item = Item(item_id, "user", audio=audio, parts=[{"type": "input_audio", "transcript": None}])
        self.buffer, self.buffered = [], 0
        prev = self.items[-1].id if self.items else None
        await self.send({"type": "input_audio_buffer.committed", "event_id": new_id("event"),
                         "previous_item_id": prev, "item_id": item.id})
        await self._add(item)
        if self.what.transcribe is None:
            return
        if self.fed is not None:
            flight, resampler, _ = self.fed
            self.fed = None
            try:
                await asyncio.to_thread(self._feed_rest, flight, resampler, self.what.audio)
            except (RequestFailed, RequestError):
                pass  # the transcription task reports the request's failure
            return
        rate = input_rate(self.state, self.what.transcribe)
        samples = await asyncio.to_thread(_resampled, audio, rate)
        audio_in = self.what.audio
        flight = await self._start(self.what.transcribe, {audio_in: samples}, {audio_in: "audio"}, streaming=False)
        self._spawn(self._transcribe(flight, item.id))

    @staticmethod
    def _feed_rest(flight: Flight, resampler: StreamResampler, audio_in: str) -> None:
        rest = resampler.close()
        if rest.numel():
            flight.handle.feed(audio_in, rest)
        flight.handle.close_input(audio_in)

    async def _feed(self, samples: torch.Tensor, event: dict[str, Any]) -> None:
        """Feed an append to the streamed transcription (started by the buffer's first append)."""
        walk = self.what.transcribe
        assert walk is not None
        if self.fed is None:
            fields = {self.what.audio: "audio"} | dict.fromkeys(self.what.fed_inputs, "session")
            flight = await self._start(walk, dict(self.what.fed_inputs), fields, streaming=True)
            self.fed = (flight, StreamResampler(CLIENT_RATE, input_rate(self.state, walk)), new_id("item"))
            self._spawn(self._transcribe(flight, self.fed[2]))
        flight, resampler, _ = self.fed
        piece = await asyncio.to_thread(resampler.push, samples)  # a filter over the piece: off the loop
        if piece.numel():
            try:  # `feed` waits while the engine lags (backpressure): off the loop
                await asyncio.to_thread(flight.handle.feed, self.what.audio, piece)
            except (RequestFailed, RequestError) as e:
                raise EventError("input_audio_buffer_failed", f"input_audio_buffer.append: the transcription "
                                 f"request has ended ({e}); clear the buffer to start another", "audio",
                                 event.get("event_id")) from None

    async def _start(self, walk: str, inputs: dict[str, Any], fields: dict[str, str], streaming: bool,
                     primary: str = "item") -> Flight:
        flight = await start_flight(self.state, self.peer, "realtime", walk, inputs, fields, primary,  # type: ignore[arg-type]
                                    streaming=streaming)
        flight.begin()
        self.flights.add(flight)
        return flight

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _done_with(self, flight: Flight) -> None:
        self.flights.discard(flight)
        flight.finish()

    # ---- transcription
    async def _transcribe(self, flight: Flight, item_id: str) -> None:
        ids: list[int] = []
        sent = ""
        base = {"item_id": item_id, "content_index": 0}
        try:
            async with aclosing(flight.events()) as events:
                async for name, value in events:
                    if name == self.what.partial and isinstance(value, str):
                        for line in value.splitlines():  # a window's text: `transcribe_live`'s partial lines
                            piece = json.loads(line).get("text") or ""
                            if piece:
                                await self.send({"type": "conversation.item.input_audio_transcription.delta",
                                                 "event_id": new_id("event"), **base, "delta": piece})
                        continue
                    if name != self.what.tokens_output or not isinstance(value, torch.Tensor):
                        continue
                    ids.extend(int(t) for t in value.reshape(-1).tolist())
                    text = self._ids_text(ids)
                    if text.endswith("\ufffd") or not text.startswith(sent) or text == sent:
                        continue  # an incomplete character: wait for its other bytes
                    delta, sent = text[len(sent):], text
                    await self.send({"type": "conversation.item.input_audio_transcription.delta",
                                     "event_id": new_id("event"), **base, "delta": delta})
            out = await flight.handle.aresult()
            final = out.get("text")
            text = final if isinstance(final, str) else self._ids_text(ids)
            flight.outcome = "finished"
            self._transcript(item_id, text)
            await self.send({"type": "conversation.item.input_audio_transcription.completed",
                             "event_id": new_id("event"), **base, "transcript": text})
        except RequestFailed as e:
            # cancelled by the session (`clear`, or the socket closing): no item to report on
            ours = e.finish_reason == "cancelled" and (self.gone.is_set() or flight.outcome == "cancelled")
            if not ours:
                err = flight.error_for(e)
                await self.send({"type": "conversation.item.input_audio_transcription.failed",
                                 "event_id": new_id("event"), **base,
                                 "error": {"type": err.type, "code": err.code, "message": err.message,
                                           "param": err.param}})
        except ClientGone:
            pass
        finally:
            self._done_with(flight)

    def _ids_text(self, ids: list[int]) -> str:
        return self.what.text.text(ids) if self.what.text is not None else " ".join(map(str, ids))

    def _transcript(self, item_id: str, text: str) -> None:
        for item in self.items:
            if item.id == item_id:
                item.text = text
                item.parts = [{"type": "input_audio", "transcript": text}]

    # ---- responses
    async def _create_response(self, event: dict[str, Any]) -> None:
        eid = event.get("event_id")
        if self.what.transcribe is not None:
            raise EventError("unsupported", "response.create: this session transcribes audio (the plan has no chat "
                             "walk); its transcripts come after each commit", "type", eid)
        if self.response is not None:
            raise EventError("conversation_already_has_active_response", f"response.create: response "
                             f"'{self.response.id}' is in progress; wait for its response.done or send "
                             "response.cancel", None, eid)
        params = field_of(event, "response", dict, "response") or {}
        conversation = params.get("conversation", "auto")
        if conversation not in ("auto", "none"):
            raise EventError("invalid_value", "response.create: response.conversation must be 'auto' or 'none'",
                             "response.conversation", eid)
        if not self.items:
            raise EventError("conversation_empty", "response.create: the conversation has no items; send "
                             "conversation.item.create or commit the audio buffer first", None, eid)
        scoped = params | {"type": "response.create", "event_id": eid}
        modalities = self.config.modalities if params.get("modalities") is None else \
            check_modalities(params["modalities"], "response.modalities", event, self.what.modalities)
        spoken = "audio" in modalities and self.what.speech is not None
        role = self.what.speech.role if spoken and self.what.speech is not None else self.what.chat
        assert role is not None
        instructions = field_of(scoped, "instructions", str, "response.instructions")
        voice = field_of(scoped, "voice", str, "response.voice") or self.config.voice
        if params.get("output_audio_format") not in (None, "pcm16"):
            raise EventError("unsupported", "response.create: response.output_audio_format must be 'pcm16'",
                             "response.output_audio_format", eid)
        temperature = self.config.temperature
        if params.get("temperature") is not None:
            temperature = temperature_of(params["temperature"], "response.temperature", event)
        limit, limit_param = self.config.max_output_tokens, "session.max_response_output_tokens"
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if params.get(key) is not None:
                limit, limit_param = max_tokens_of(params[key], f"response.{key}", event), f"response.{key}"
        inputs, fields = await self._inputs(role, self.config.instructions if instructions is None else instructions)
        if spoken and self.what.speech is not None and self.what.speech.voice is not None and voice is not None:
            inputs[self.what.speech.voice] = voice
            fields[self.what.speech.voice] = "response.voice" if params.get("voice") else "session.voice"
        if temperature is not None:
            if "temperature" not in role.inputs:
                raise EventError("unsupported", f"response.create: walk '{role.walk}' does not take a temperature "
                                 "(it samples its own way); leave it out", "response.temperature", eid)
            inputs["temperature"], fields["temperature"] = temperature, "response.temperature"
        check_token_limit(self.state, limit_param, limit)
        target = next((n for n in MAX_TOKEN_INPUTS if n in role.inputs), None)
        if limit is not None and target is not None:
            inputs[target], fields[target] = limit, limit_param
        extra = {k: v for k, v in params.items() if k not in RESPONSE_FIELDS}
        try:
            walked = await walk_extras(self.state, role.walk, extra, set(inputs))
        except ApiError as e:
            raise EventError(e.code or "invalid_value", f"response.create: {e.message}",
                             f"response.{e.param}" if e.param else "response", eid) from None
        inputs.update(walked)
        fields.update({k: f"response.{k}" for k in walked})
        flight = await self._start(role.walk, inputs, fields, streaming=False)
        rid = new_id("resp")
        item = Item(new_id("item"), "assistant", status="in_progress")
        keep = conversation == "auto"
        try:
            response = await self._open(rid, item, spoken, keep, modalities, voice)
        except BaseException:
            self._done_with(flight)
            raise
        self.response = _Running(rid, flight, self._spawn(self._reply(rid, flight, role, item, spoken, limit, keep,
                                                                       response)))

    async def _inputs(self, role: WalkRole, instructions: str) -> tuple[dict[str, Any], dict[str, str]]:
        """The walk's text (and audio) inputs from the conversation (module docstring)."""
        if renders_turns(role):
            return await self._turns(role, instructions)
        messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        messages += [{"role": it.role, "content": it.text} for it in self.items]
        # the messages as a chat request holds them (no bound on their number: a session may be long)
        body = ChatCompletionRequest.model_construct(messages=[ChatMessage.model_validate(m) for m in messages])
        prompt, system, _ = await asyncio.to_thread(render_prompt, body, role, self.what.templates.get(role.walk))
        inputs, fields = prompt_inputs(role, prompt, system, "item", "session.instructions")
        last = self.items[-1]
        if last.role == "user" and last.audio is not None:
            name = audio_input(role)
            if name is None:
                raise EventError("unsupported_modality", f"response.create: walk '{role.walk}' takes no audio input",
                                 "item", None)
            inputs[name] = await asyncio.to_thread(_resampled, last.audio, input_rate(self.state, role.walk))
            fields[name] = "audio"
        return inputs, fields

    async def _turns(self, role: WalkRole, instructions: str) -> tuple[dict[str, Any], dict[str, str]]:
        """A walk that takes the conversation's turns (`serve.turns`: Qwen3-Omni's), each clip
        resampled once per session; past the walk's audio limit the oldest clips are left out."""
        rate = input_rate(self.state, role.walk)
        turns = []
        for it in self.items:
            if it.audio is not None and rate not in it.heard:
                it.heard[rate] = await asyncio.to_thread(_resampled, it.audio, rate)
            turns.append(Turn(it.role, it.text, it.heard.get(rate) if it.audio is not None else None))
        codec = self.state.codecs.get(role.walk)
        turns = fit_audio(turns, audio_limit(codec.node if codec is not None else None, rate))
        for it, turn in zip(self.items, turns, strict=True):
            if it.audio is not None and turn.clip is None:  # left out for good: the session holds it no longer
                it.audio = None
                it.heard.clear()
        inputs, fields = turn_inputs(role, turns, instructions, "item", "audio")
        system = system_input(role)
        if system in inputs:
            fields[system] = "session.instructions"
        return inputs, fields

    async def _open(self, rid: str, item: Item, spoken: bool, keep: bool, modalities: tuple[str, ...],
                    voice: str | None) -> dict[str, Any]:
        """The events that open a response, before any of its output: the response object."""
        response = {"id": rid, "object": "realtime.response", "status": "in_progress", "status_details": None,
                    "output": [], "usage": None, "modalities": list(modalities),
                    "voice": voice if spoken else None, "conversation_id": self.id if keep else None}
        await self.send({"type": "response.created", "event_id": new_id("event"), "response": response})
        part_kind = "audio" if spoken else "text"
        item.parts = [{"type": "audio", "transcript": ""} if spoken else {"type": "text", "text": ""}]
        await self.send({"type": "response.output_item.added", "event_id": new_id("event"), "response_id": rid,
                         "output_index": 0, "item": item.to_json()})
        if keep:
            await self._add(item)
        await self.send({"type": "response.content_part.added", "event_id": new_id("event"), "response_id": rid,
                         "item_id": item.id, "output_index": 0, "content_index": 0,
                         "part": {"type": part_kind, **({"transcript": ""} if spoken else {"text": ""})}})
        return response

    async def _reply(self, rid: str, flight: Flight, role: WalkRole, item: Item, spoken: bool, limit: int | None,
                     keep: bool, response: dict[str, Any]) -> None:
        base = {"response_id": rid, "item_id": item.id, "output_index": 0, "content_index": 0}
        said = SpokenReply(self.state, flight, self.what.speech, limit, "pcm16", int(time.time())) \
            if spoken and self.what.speech is not None else None
        reply = said.text if said is not None else Reply(self.state, flight, role, limit)
        text_kind = "response.audio_transcript.delta" if spoken else "response.text.delta"
        status, details = "completed", None
        try:
            async with aclosing(flight.events()) as events:
                async for name, value in events:
                    if said is not None:
                        piece = said.take(name, value)
                        if piece is not None and "data" in piece:
                            await self.send({"type": "response.audio.delta", "event_id": new_id("event"), **base,
                                             "delta": piece["data"]})
                        elif piece is not None:
                            await self.send({"type": text_kind, "event_id": new_id("event"), **base,
                                             "delta": piece["transcript"]})
                        continue
                    text = reply.take(name, value)
                    if text:
                        await self.send({"type": text_kind, "event_id": new_id("event"), **base, "delta": text})
                    if reply.finish is not None:
                        break  # max_output_tokens: the flight's end cancels the rest
            tail = said.end() if said is not None else reply.end()
            if tail:
                await self.send({"type": text_kind, "event_id": new_id("event"), **base, "delta": tail})
            flight.outcome = "finished"
            if (said.finish if said is not None else reply.finish) == "length":
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except RequestFailed as e:
            running = self.response
            if e.finish_reason == "cancelled" and running is not None and running.cancelled:
                status, details = "cancelled", {"type": "cancelled", "reason": "client_cancelled"}
                flight.outcome = "cancelled"
            else:
                err = flight.error_for(e)
                status = "failed"
                details = {"type": "failed", "error": {"type": err.type, "code": err.code, "message": err.message}}
                await self.send(error_event(err.code or "response_failed", f"response.create: {err.message}",
                                            err.param, None, err.type))
        except ClientGone:
            return
        finally:
            self._done_with(flight)
            self.response = None if self.response is not None and self.response.id == rid else self.response
        text = "".join(reply.parts)
        item.text, item.status = text, "completed" if status == "completed" else "incomplete"
        item.parts = [{"type": "audio", "transcript": text} if spoken else {"type": "text", "text": text}]
        if keep and status == "failed" and not text:
            self.items = [it for it in self.items if it.id != item.id]  # nothing said: no turn to remember
        if spoken:
            await self.send({"type": "response.audio.done", "event_id": new_id("event"), **base})
            await self.send({"type": "response.audio_transcript.done", "event_id": new_id("event"), **base,
                             "transcript": text})
        else:
            await self.send({"type": "response.text.done", "event_id": new_id("event"), **base, "text": text})
        await self.send({"type": "response.content_part.done", "event_id": new_id("event"), **base,
                         "part": item.parts[0]})
        await self.send({"type": "response.output_item.done", "event_id": new_id("event"), "response_id": rid,
                         "output_index": 0, "item": item.to_json()})
        usage = reply.usage()
        cached = flight.handle.stats.get("cached_tokens")
        response |= {"status": status, "status_details": details, "output": [item.to_json()],
                     "usage": {"total_tokens": usage["total_tokens"], "input_tokens": usage["prompt_tokens"],
                               "output_tokens": usage["completion_tokens"],
                               # the prompt's tokens whose KV the prefix cache held (earlier turns')
                               "input_token_details": {"cached_tokens": int(cached or 0)}}}
        await self.send({"type": "response.done", "event_id": new_id("event"), "response": response})


def _resampled(samples: torch.Tensor, rate: int) -> torch.Tensor:
    from mstar_runtime.media import resample

    return resample(samples, CLIENT_RATE, rate)


__all__ = ["Served", "Session", "install", "live_twin", "served"]
