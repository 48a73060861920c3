"""The native route of a walk with a streamed input: `POST /v1/walks/<walk>/stream`, whose
request body is that input, read while the walk runs (a chunked body: live audio).

    curl -N -H 'Content-Type: audio/wav' -T - \\
      'http://host/v1/walks/transcribe_live/stream?inputs={"timestamps":true}' < microphone.wav

- Body: the audio, as `serve.pcm_stream` reads it (a WAV stream, or raw `s16le` / `f32le`
  mono samples with the query's `format` and `rate`), resampled to the rate the walk reads it
  at (`media.input_rate`) piece by piece (`StreamResampler`), and fed to the request as it
  arrives (`RequestHandle.feed`, which waits while the engine lags: the body is read no
  faster than the walk takes it); the end of the body closes the input (`close_input`).
- Query: `inputs`, a JSON object of the walk's other inputs (typed as on `/v1/walks/<walk>`),
  `timeout`, `stream` (true: NDJSON as produced; false: one JSON object at the end), and for
  raw samples `format` and `rate`.
- Response: the native route's (`serve.walks`): NDJSON lines `{"type": "output", ...}` as the
  walk appends them (`transcribe_live`'s `partial` lines while the audio still arrives), then
  `done` with the outputs that were set.

Errors: 400 naming the field: `inputs` (not JSON, or a value the walk's types refuse:
`inputs.<name>`), `format`, `rate`, `Content-Type`, and `body` for audio that does not
decode (not a WAV stream, a format not read, a body that ends inside a sample, no audio):
at once when the header is wrong, else as the request's failure; a node's refusal of the
audio (too long, NaN) names `body` too. A request that fails after its first output ends its
NDJSON with an `error` line, as on the native route.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from mstar_runtime.api import RequestFailed
from mstar_runtime.control.requests import stream_inputs
from mstar_runtime.media import input_rate
from mstar_runtime.serve.app import ERROR_RESPONSES, error_response, start_flight, validation_error
from mstar_runtime.serve.common import ApiError, bad_request
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.pcm_stream import PcmStream
from mstar_runtime.serve.realtime_protocol import StreamResampler
from mstar_runtime.serve.walks import _streamed, _whole, _Wire
from mstar_runtime.serve.web import Query, Request, StreamingResponse

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState

BODY = "body"  # the field a problem with the streamed input (the request body) is named by
FEED_SAMPLES = 4000  # samples gathered before a feed (a quarter second at 16 kHz): not one feed per TCP read


def install(app: FastAPI, state: ServerState) -> None:
    import inspect

    if "streaming" not in inspect.signature(state.m.submit).parameters:
        return  # an engine in its own process takes inputs whole
    for walk in state.walks.all:
        streamed = stream_inputs(state.plan.walk(walk))
        if len(streamed) == 1:
            _install(app, state, walk, next(iter(streamed)))
            state.streamed_paths.add(f"/v1/walks/{walk}/stream")


def _inputs_model(walk: str, program: Mapping[str, Any], streamed: str) -> Any:
    """The pydantic model of the walk's inputs other than the streamed one."""
    from pydantic import ConfigDict, Field, create_model

    from mstar_runtime.serve.schemas import input_annotation

    fields: dict[str, Any] = {}
    for p in program["inputs"]:
        if p["name"] != streamed:
            ann, default = input_annotation(p["type"]), p["default"]
            fields[p["name"]] = (ann, Field(...) if default is None else Field(default))
    return create_model(f"Walk_{walk}_StreamInputs", __config__=ConfigDict(extra="forbid"), **fields)


def _install(app: FastAPI, state: ServerState, walk: str, streamed: str) -> None:
    from pydantic import ValidationError

    program = state.plan.walk(walk)
    model = _inputs_model(walk, program, streamed)
    wire = _Wire(state, walk)
    fields = {p["name"]: f"inputs.{p['name']}" for p in program["inputs"]}
    fields[streamed] = BODY
    rate = input_rate(state.plan, walk, streamed, state.config.weights)

    # the query's `rate` is `rate_hz` here: `rate` is the walk's own
    async def run_stream(request: Request, inputs: str = "{}", format: str | None = None,
                         rate_hz: int | None = Query(None, alias="rate"), timeout: float | None = None,
                         stream: bool = True) -> Any:
        try:
            raw = json.loads(inputs)
        except ValueError as e:
            raise bad_request(f"inputs is not valid JSON: {e}", "inputs", "invalid_json") from None
        if not isinstance(raw, dict):
            raise bad_request("inputs must be a JSON object of the walk's inputs", "inputs")
        if streamed in raw:
            raise bad_request(f"'{streamed}' is the request body; leave it out of inputs", f"inputs.{streamed}")
        try:
            values = model.model_validate(raw).model_dump(exclude_unset=True)
        except ValidationError as e:
            raise validation_error([{**err, "loc": ("inputs", *err["loc"])} for err in e.errors()]) from None
        if timeout is not None and not 0 < timeout <= 86400:
            raise bad_request(f"timeout must lie in (0, 86400] seconds, got {timeout}", "timeout")
        body = _Body(request, _decoder(request, format, rate_hz), rate)
        await body.header()
        flight = await start_flight(state, request, "walk", walk, values, fields, BODY, timeout=timeout,
                                    streaming=True, receive=body.receive)
        body.start(flight, streamed)

        def streaming(content: Any, **kw: Any) -> Any:
            return _AfterBody(content, body.read, **kw)

        response = await (_whole(flight, wire) if not stream else _streamed(flight, wire, streaming))
        if body.error is not None and getattr(response, "status_code", 200) >= 400:
            return error_response(body.error)  # the body's own fault, not the cancellation it caused
        return response

    app.post(f"/v1/walks/{walk}/stream", tags=["native"], responses=ERROR_RESPONSES, name=f"walk_{walk}_stream",
             summary=f"Run walk '{walk}' with its input '{streamed}' streamed in as the request body "
                     "(audio/wav or raw PCM, chunked): NDJSON of its outputs as produced")(run_stream)


class _AfterBody(StreamingResponse):  # type: ignore[misc,valid-type]
    """A streamed response whose disconnect watch waits until the body has been read:
    Starlette's reads the connection's messages while the response streams, and would take
    the request body's pieces from the reader that feeds them."""

    def __init__(self, content: Any, read: asyncio.Event, **kw: Any):
        super().__init__(content, **kw)
        self._read = read

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def after_body() -> Any:
            await self._read.wait()
            return await receive()

        await super().__call__(scope, after_body, send)


def _decoder(request: Request, fmt: str | None, rate: int | None) -> PcmStream:
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    try:
        return PcmStream(content_type, fmt, rate)
    except ValueError as e:
        param = "Content-Type" if "Content-Type" in str(e) else "rate" if "rate" in str(e) else "format"
        raise bad_request(str(e), param) from None


class _Body:
    """The request body read into the request's streamed input (module docstring)."""

    def __init__(self, request: Request, decoder: PcmStream, rate: int):
        self.request, self.decoder, self.rate = request, decoder, rate
        self.chunks: AsyncIterator[bytes] = request.stream()
        self.first: list[torch.Tensor] = []  # samples decoded before the request was submitted
        self.read = asyncio.Event()  # set once the whole body was read (or reading stopped)
        self.error: ApiError | None = None
        self.task: asyncio.Task[None] | None = None
        self.resampler: StreamResampler | None = None

    async def header(self) -> None:
        """Read until the audio's format is known: a bad header is a 400 before anything runs."""
        try:
            while not self.decoder.ready:
                data = await anext(self.chunks, None)
                if data is None:
                    self.decoder.close()
                self.first.append(self.decoder.push(data or b""))
        except ValueError as e:
            raise bad_request(str(e), BODY) from None

    async def receive(self) -> Mapping[str, Any]:
        """The flight's disconnect watch: the body is read here, so the watch waits until it has been."""
        await self.read.wait()
        return await self.request.receive()

    def start(self, flight: Flight, name: str) -> None:
        assert self.decoder.rate is not None
        self.resampler = StreamResampler(self.decoder.rate, self.rate)
        self.task = asyncio.ensure_future(self._feed(flight, name))

    async def _feed(self, flight: Flight, name: str) -> None:
        assert self.resampler is not None
        pending = list(self.first)
        try:
            try:
                async for data in self.chunks:
                    pending.append(self.decoder.push(data))
                    if sum(p.numel() for p in pending) >= FEED_SAMPLES:
                        await self._send(flight, name, pending)
                        pending = []
                self.decoder.close()
            except ValueError as e:
                self.error = bad_request(str(e), BODY)
                flight.handle.cancel()
                return
            await self._send(flight, name, pending)
            rest = self.resampler.close()
            if rest.numel():
                await asyncio.to_thread(flight.handle.feed, name, rest)
            await asyncio.to_thread(flight.handle.close_input, name)
        except RequestFailed:
            return  # the request ended (a node refused the audio, a timeout): its response says so
        except Exception:  # noqa: BLE001 - the client left mid-body (ClientDisconnect): nobody to answer
            flight.handle.cancel()
        finally:
            self.read.set()

    async def _send(self, flight: Flight, name: str, pieces: list[torch.Tensor]) -> None:
        assert self.resampler is not None
        samples = self.resampler.push(torch.cat(pieces)) if pieces else torch.zeros(0)
        if samples.numel():
            await asyncio.to_thread(flight.handle.feed, name, samples)  # waits while the engine lags


__all__ = ["install"]
