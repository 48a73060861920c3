"""The native routes: `POST /v1/walks/<walk>` for every walk of the plan, and `GET /v1/walks`.

Each walk gets its own route and request schema, built from its typed inputs, so
`/openapi.json` documents every input with its type and default:

    {"inputs": {"prompt": "hi", "max_new": 8}, "stream": true, "timeout": 30}

str, int (int64), float (finite), bool as JSON; a tensor as nested lists of its rank; an
image as base64 or a `data:image/...;base64,` URL (never a path or a URL to fetch).

The response (`stream: true`, the default) is NDJSON, one object per line, as produced:

    {"type": "output", "output": "tokens", "index": 0, "value": [17]}
    {"type": "output", "output": "audio", "index": 0, "value": {"encoding": "pcm_s16le_base64", ...}}
    {"type": "done", "finish_reason": "stop", "outputs": {"handoff": true}, "stats": {...}}

`done` carries the outputs that were set rather than streamed. A request that fails after
the stream began ends with `{"type": "error", "finish_reason": ..., "error": {...}}`; one
that fails before its first output gets a plain 4xx/5xx. `stream: false` answers one JSON
object with every output (appended ones concatenated) once the request ends.
Values: tensors as lists, audio as base64 16-bit PCM, images as base64 PNG (`server_io`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from mstar_runtime.api import RequestFailed
from mstar_runtime.serve.app import ERROR_RESPONSES, decode_images, error_response, start_flight
from mstar_runtime.serve.common import NOT_FOUND, ApiError, ClientGone
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.io import wire_value
from mstar_runtime.serve.schemas import WalkRequestBase, input_annotation
from mstar_runtime.serve.web import Request

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState


def request_model(walk: str, program: Mapping[str, Any]) -> Any:
    """The pydantic body of walk `walk`: {"inputs": {...typed...}, "stream", "timeout"}."""
    from pydantic import ConfigDict, Field, create_model

    fields: dict[str, Any] = {}
    required = False
    for p in program["inputs"]:
        ann, default = input_annotation(p["type"]), p["default"]
        if default is None:
            required = True
            fields[p["name"]] = (ann, Field(...))
        else:
            fields[p["name"]] = (ann, Field(default))
    inputs = create_model(f"Walk_{walk}_Inputs", __config__=ConfigDict(extra="forbid"), **fields)
    spec = Field(...) if required else Field(default_factory=inputs)
    return create_model(f"Walk_{walk}_Request", __base__=WalkRequestBase, inputs=(inputs, spec))


def _line(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


class _Wire:
    def __init__(self, state: ServerState, walk: str):
        program = state.plan.walk(walk)
        self.declared = {o["name"]: o["type"] for o in program["outputs"]}
        self.appended = {o["name"] for o in program["outputs"] if o["mode"] == "append"}
        self.rate = state.sample_rate

    def value(self, name: str, value: Any) -> Any:
        return wire_value(name, value, self.declared.get(name), self.rate)


def _stats(flight: Flight) -> dict[str, Any]:
    st = dict(flight.handle.stats)
    st["items"] = dict(flight.items)
    return st


def install(app: FastAPI, state: ServerState) -> None:
    from fastapi.responses import StreamingResponse

    for walk in state.walks.all:
        _install_walk(app, state, walk, StreamingResponse)

    @app.get("/v1/walks", tags=["native"], summary="The plan's walks with their typed inputs and outputs")
    async def walks() -> Any:
        return {"object": "list", "data": [
            {"walk": w, "inputs": state.plan.walk(w)["inputs"], "outputs": state.plan.walk(w)["outputs"],
             "route": f"/v1/walks/{w}"} for w in state.walks.all]}

    @app.post("/v1/walks/{walk}", tags=["native"], responses=ERROR_RESPONSES,
              summary="Any other walk name: 404 with the list of walks")
    async def unknown_walk(walk: str, request: Request) -> Any:
        raise ApiError(404, f"unknown walk '{walk}'; this plan serves: {', '.join(state.walks.all)}",
                       type=NOT_FOUND, param="walk", code="walk_not_found")


def _install_walk(app: FastAPI, state: ServerState, walk: str, streaming: Any) -> None:

    program = state.plan.walk(walk)
    body_model = request_model(walk, program)
    wire = _Wire(state, walk)
    fields = {p["name"]: f"inputs.{p['name']}" for p in program["inputs"]}
    # a node that rejects a port the client never named (the token list a prompt became)
    # blames the walk's text input when it has exactly one, else `inputs` as a whole
    texts = [p["name"] for p in program["inputs"] if p["type"]["kind"] == "str"]
    primary = f"inputs.{texts[0]}" if len(texts) == 1 else "inputs"

    async def run_walk(body: Any, request: Request) -> Any:
        raw = body.inputs.model_dump(exclude_unset=True)
        inputs = await decode_images(program, raw, fields)
        flight = await start_flight(state, request, "walk", walk, inputs, fields, primary, timeout=body.timeout)
        if not body.stream:
            return await _whole(flight, wire)
        return await _streamed(flight, wire, streaming)

    run_walk.__annotations__["body"] = body_model  # a per-walk class: no name to write in the signature
    app.post(f"/v1/walks/{walk}", tags=["native"], responses=ERROR_RESPONSES, name=f"walk_{walk}",
             summary=f"Run walk '{walk}': NDJSON stream of its outputs (stream=false: one JSON object)")(run_walk)


async def _whole(flight: Flight, wire: _Wire) -> Any:
    outputs = await flight.whole(flight.outputs())
    return {"walk": flight.walk, "finish_reason": "stop",
            "outputs": {k: wire.value(k, v) for k, v in outputs.items()}, "stats": _stats(flight)}


async def _streamed(flight: Flight, wire: _Wire, streaming: Any) -> Any:
    events = flight.events()
    try:  # the first output (or the end) before the 200
        first = await flight.head(events, lambda name, value: (name, value))
    except ApiError as e:
        return error_response(e)

    async def lines() -> AsyncIterator[str]:
        index: dict[str, int] = {}
        try:
            try:
                async with aclosing(_chain(first, events)) as items:
                    async for name, value in items:
                        i = index[name] = index.get(name, -1) + 1
                        yield _line({"type": "output", "output": name, "index": i, "value": wire.value(name, value)})
                outputs = await flight.handle.aresult()  # already ended: never suspends
            except RequestFailed as e:
                yield _line({"type": "error", "finish_reason": e.finish_reason, **flight.error_for(e).body()})
                return
            flight.outcome = "finished"
            final = {k: wire.value(k, v) for k, v in outputs.items() if k not in wire.appended and k not in index}
            yield _line({"type": "done", "finish_reason": "stop", "outputs": final, "stats": _stats(flight)})
        except ClientGone:  # the client left mid-stream: nobody to tell; the flight cancels the request
            return
        finally:
            await events.aclose()
            flight.finish()

    return streaming(lines(), media_type="application/x-ndjson", headers={"Cache-Control": "no-cache"})


async def _chain(first: list[tuple[str, Any]], rest: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    for item in first:
        yield item
    async for item in rest:
        yield item


__all__ = ["install", "request_model"]
