"""The server's frame: error handlers, the middleware every request passes (API key, body
size, response counts, the access log), `/health`, `/v1/models`, `/metrics`, the OpenAPI
touches, and `start_flight`, which every generation route uses to admit and submit a request.

With an API key (`--api-key`, `$MSTAR_API_KEY`) every route but `/health` wants the header
`Authorization: Bearer <key>` and answers 401 `invalid_api_key` without it, as OpenAI and
vLLM do; the key is compared by its SHA-256 in constant time. The access log
(`--no-access-log` turns it off) has one line per request, written when its response ends.

Every error leaves as the OpenAI body (`server_common.ApiError`): FastAPI's validation
errors become 400 naming the field (`messages[0].content`; a body that is missing or not
an object is `invalid_body`, with no field), a body whose Content-Type is not the route's
(JSON, or a form for image edits) 415, unknown routes 404, wrong methods 405, uncaught
exceptions 500 with the exception's type only (details go to the log).

Walk inputs follow one rule on every route (`check_inputs`): the extra keys of an OpenAI
body are typed as the native route types them (`schemas.input_annotation`: int64, finite
floats, ...), loop counts stay within their loop's bound, and a token-count input
(`MAX_TOKEN_INPUTS`) above the plan's limit is a 400 `max_tokens_too_large` that names the
field and the limit.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mstar_runtime.api import RequestHandle
from mstar_runtime.control.bounds import out_of_bounds
from mstar_runtime.ops.node import RequestError
from mstar_runtime.serve.common import (
    INVALID,
    NOT_FOUND,
    SERVER,
    ApiError,
    api_key_digest,
    bad_request,
    submit_error,
)
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.io import decode_image_text
from mstar_runtime.serve.schemas import INT64_MAX, INT64_MIN
from mstar_runtime.serve.state import default_voice
from mstar_runtime.serve.web import Request

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState

log = logging.getLogger("mstar_runtime.serve.server")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    for code, desc in ((400, "invalid input; `error.param` names the field"),
                       (404, "unknown model or walk"),
                       (408, "the request ran past its own `timeout`"),
                       (413, "the request can never fit (the message gives the limit)"),
                       (415, "the body's Content-Type is not the route's (application/json; edits: a form)"),
                       (500, "the engine failed the request"),
                       (503, "draining, overloaded, or the engine is dead"))
}

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def error_response(e: ApiError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


# pydantic's names for the members of a union in an error's location: not request fields
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes", "dict", "list"})


def _union_tag(part: str) -> bool:
    # `list[int]` is a tag; a form field named `image[]` (a repeated field) is not
    return (part in _UNION_TAGS or ("[" in part and not part.endswith("[]"))
            or part.startswith(("function-", "constrained-")))


def param_of(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """A pydantic error location as a request field: ("body", "messages", 0, "content") -> messages[0].content.
    Union-member tags are dropped (`str`, `list[...]`), and so is the tag value that follows a
    discriminated union's (`tagged-union[...]`, then the member's `type`); a field whose name
    merely starts like a tag (`stream`, `stream_options`, `integer`) stays."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "form"):
        parts = parts[1:]
    out = ""
    tag_next = False  # the next name is a discriminated union's tag value
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _union_tag(str(p)):
            tag_next = tag_next or "tagged-union[" in str(p)
        elif tag_next:
            tag_next = False
        else:
            out += f".{p}" if out else str(p)
    return out or None


def validation_error(errors: list[Mapping[str, Any]]) -> ApiError:
    """The 400 for pydantic's errors: the one at the most specific field (a union's members
    each report; the deepest is the one the client meant), the first among equals."""
    first = max(errors, key=lambda e: len(param_of(e.get("loc", ())) or ""),
                default={"msg": "invalid request", "loc": (), "type": "invalid"})
    kind = str(first.get("type", "invalid"))
    if kind == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                           None, "invalid_json")
    param = param_of(first.get("loc", ()))
    if kind == "string_unicode":  # pydantic-core's words for a lone surrogate, in a value or a key
        return bad_request(f"{param or 'a key of the body'}: the text holds a lone surrogate: it is not valid "
                           "Unicode", param)
    if param is None:  # the body as a whole: no field to name
        if kind == "missing":
            return bad_request("a request body is required (a JSON object)", None, "invalid_body")
        got = first.get("input")
        what = ("null" if got is None else "true or false" if isinstance(got, bool) else "an array"
                if isinstance(got, list) else "a string" if isinstance(got, str) else "a number"
                if isinstance(got, int | float) else type(got).__name__)
        return bad_request(f"the request body must be a JSON object, got {what}", None, "invalid_body")
    if kind == "extra_forbidden":
        return bad_request(f"unknown field '{param}'", param, "unknown_field")
    if kind == "missing":
        return bad_request(f"'{param}' is required", param, "missing")
    message = str(first.get("msg", "invalid value"))
    if kind == "value_error" and "Expected UploadFile" in message:  # FastAPI's words for a text field in a file's place
        name = param.split("[", 1)[0]  # `image[][0]`: the form field is `image`
        return bad_request(f"{name}: expected a file (a file part of the multipart form, with a filename), got a "
                           "text field", name, "invalid_image")
    return bad_request(f"{param}: {message}", param)


def _media(content_type: str | None) -> tuple[str, str]:
    """(type, subtype) of a Content-Type header, lower case, without parameters."""
    main, _, sub = (content_type or "").split(";", 1)[0].strip().lower().partition("/")
    return main, sub


def content_type_error(request: Request, errors: list[Mapping[str, Any]]) -> ApiError | None:
    """The 415 for a body that failed validation because its Content-Type is not the route's
    (FastAPI then validates the raw bytes: "Input should be a valid dictionary"), or None."""
    from fastapi import params

    route = request.scope.get("route")
    body = list(getattr(getattr(route, "dependant", None), "body_params", None) or [])
    if not body or any(e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",) for e in errors):
        return None  # no body expected, or none sent: the 400 says that
    form = any(isinstance(f.field_info, params.Form) for f in body)  # File is a Form
    raw = request.headers.get("content-type")
    main, sub = _media(raw)
    if form:
        if (main, sub) in (("multipart", "form-data"), ("application", "x-www-form-urlencoded")):
            return None
        want = "multipart/form-data"
    else:
        if main == "application" and (sub == "json" or sub.endswith("+json")):
            return None
        want = "application/json"
    got = f"Content-Type is '{raw}'" if raw else "there is no Content-Type header"
    return ApiError(415, f"{got}; {request.method} {request.url.path} takes a body of type {want} (send the header "
                    f"Content-Type: {want})", code="unsupported_media_type")


def install(app: FastAPI, state: ServerState) -> None:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Any:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Any:
        errors = list(e.errors())
        return error_response(content_type_error(request, errors) or validation_error(errors))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> Any:
        kind = NOT_FOUND if e.status_code == 404 else INVALID if e.status_code < 500 else SERVER
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        code = "invalid_body" if e.status_code == 400 else None  # FastAPI's "error parsing the body" (a form)
        return error_response(ApiError(e.status_code, message, type=kind, code=code,
                                       headers=dict(e.headers or {})))

    # no handler for Exception: Starlette's would log the traceback twice and drop the
    # connection; `_Frame` answers an uncaught exception itself (logged once, a plain 500)
    app.add_middleware(_Frame, state=state)

    # HEAD too (probes send it), kept out of the schema: one operation per path and method
    # would give the two the same operation id
    @app.head("/health", include_in_schema=False)
    @app.get("/health", tags=["server"], summary="200 while serving; 503 while draining or when the engine is dead",
             responses={503: {"description": "draining or unhealthy"}})
    async def health() -> Any:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        problem = state.engine_problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        return {"status": "ok"}

    voice = default_voice(state)

    @app.get("/v1/models", tags=["openai"], summary="The served model (one), with the plan's walks")
    async def models() -> Any:
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": state.created, "owned_by": "mstar",
            "walks": list(state.walks.all),
            "variant": state.plan.variant,
            "default_voice": voice,
        }]}

    @app.get("/v1/models/{model}", tags=["openai"], summary="One served model", responses=ERROR_RESPONSES)
    async def model(model: str) -> Any:
        check_model(state, model)
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mstar"}

    @app.get("/metrics", tags=["server"], response_class=PlainTextResponse,
             summary="Prometheus text format 0.0.4, or OpenMetrics if the Accept header asks (docs/serving.md)")
    async def metrics(request: Request) -> Any:
        from fastapi.responses import Response

        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})


class _Frame:
    """Pure ASGI middleware around every HTTP request: the API key (401 without it, except on
    `UNAUTHENTICATED` paths), request framing (400 for both Content-Length and
    Transfer-Encoding, which proxies may read differently), oversized bodies (413: refused
    before they are read when Content-Length says so, else a chunked body is read up to the
    limit before the app sees it; not on a path whose body is a streamed walk input, which
    the route reads as it arrives), uncaught exceptions (logged once; a 500 without their
    details, and the connection stays usable), the response count by route template and
    status for `/metrics`, and the access log line."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status, sent = [0], [0]

        async def counting_send(message: Mapping[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                status[0] = int(message["status"])
            elif message.get("type") == "http.response.body":
                sent[0] += len(message.get("body", b""))
            await send(message)

        route = "other"
        try:
            headers = dict(scope.get("headers") or [])
            streamed = scope.get("path") in self.state.streamed_paths
            refusal = self._refusal(scope, headers, streamed)
            if refusal is None and not streamed and b"content-length" not in headers and b"transfer-encoding" in headers:
                receive, refusal = await self._buffered(receive)
            if refusal is not None:
                await error_response(refusal)(scope, receive, counting_send)
                return
            try:
                await self.app(scope, receive, counting_send)
            except Exception:
                log.exception("%s %s failed", scope.get("method"), scope.get("path"))
                if status[0]:  # the response had started: nothing more can be said on it
                    return
                await error_response(ApiError(500, "internal server error (the server log has the details)",
                                              type=SERVER, code="internal_error"))(scope, receive, counting_send)
            route = getattr(scope.get("route"), "path", None) or "other"
        finally:
            self.state.metrics.response(route, status[0] or 500)
            if self.state.config.access_log:
                access_line(scope, status[0] or 500, sent[0], time.perf_counter() - t0)

    def _refusal(self, scope: Mapping[str, Any], headers: Mapping[bytes, bytes], streamed: bool) -> ApiError | None:
        """The 401, 400 or 413 that answers this request before the app sees it, or None."""
        digest = self.state.api_key_digest
        if digest is not None and scope.get("path") not in UNAUTHENTICATED:
            problem = check_api_key(headers.get(b"authorization"), digest)
            if problem is not None:
                return ApiError(401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" in headers:
            return bad_request("the request has both Content-Length and Transfer-Encoding headers; send one "
                               "(RFC 9112, section 6.3)", None, "invalid_framing")
        if length is not None and not length.isdigit():
            return self._too_large()
        if length is not None and not streamed and int(length) > self.state.config.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.state.config.max_body_bytes} bytes",
                        code="body_too_large")

    async def _buffered(self, receive: Any) -> tuple[Any, ApiError | None]:
        """Read a body of unknown length (chunked) up to the limit: (a receive that replays it
        and then waits on the connection, None), or the 413 once it passes the limit."""
        limit, chunks, size = self.state.config.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message.get("type") != "http.request":  # the client left: replay the disconnect
                chunks = [message]
                break
            size += len(message.get("body", b""))
            if size > limit:
                return receive, self._too_large()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                chunks = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break
        pending = list(chunks)

        async def replay() -> Mapping[str, Any]:
            return pending.pop() if pending else await receive()

        return replay, None


# a load balancer's or orchestrator's probe carries no key, and the API's description is no
# secret (vLLM guards only /v1/*; here /metrics, which shows the traffic, wants the key too)
UNAUTHENTICATED = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
access_log = logging.getLogger("mstar_runtime.serve.access")


def check_api_key(header: bytes | None, digest: bytes) -> str | None:
    """Why an `Authorization` header does not carry the server's key (None when it does).
    The key is compared by its SHA-256 in constant time (`common.api_key_digest`)."""
    if not header:
        return "this server needs an API key: send the header Authorization: Bearer <key>"
    scheme, _, token = header.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "the Authorization header must be 'Bearer <key>'"
    if not secrets.compare_digest(api_key_digest(token.strip()), digest):
        return "incorrect API key"
    return None


def access_line(scope: Mapping[str, Any], status: int, sent: int, seconds: float) -> None:
    """One access-log line per request, once its response has ended (a stream's at its end):
    client, request line, status, body bytes sent, seconds from the request to the end."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = scope.get("path", "")
    query = scope.get("query_string", b"")
    target = f"{path}?{query.decode('latin-1')}" if query else path
    access_log.info('%s "%s %s HTTP/%s" %d %d %.3fs', who, scope.get("method", "-"), target,
                    scope.get("http_version", "1.1"), status, sent, seconds)


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_id:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{state.model_id}'",
                       type=NOT_FOUND, param="model", code="model_not_found")


async def walk_extras(state: ServerState, walk: str, extra: Mapping[str, Any] | None,
                      taken: set[str]) -> dict[str, Any]:
    """A body's extra keys as walk inputs (the openai client's `extra_body`), typed exactly as
    the native route types them (`schemas.input_annotation`: int64, finite floats, strict
    types, images as base64, decoded off the event loop); other keys are a 400 naming them."""
    from pydantic import ValidationError

    adapters = state.input_types[walk]
    out: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if key not in adapters or key in taken:
            usable = sorted(set(adapters) - taken)
            raise bad_request(f"unknown field '{key}' (extra fields must be inputs of walk '{walk}': "
                              f"{', '.join(usable) or 'none'})", key, "unknown_field")
        try:
            out[key] = adapters[key].validate_python(value)
        except ValidationError as e:
            errors = [{**err, "loc": ("body", key, *err.get("loc", ()))} for err in e.errors(include_url=False)]
            raise validation_error(errors) from None
    return await decode_images(state.plan.walk(walk), out, {k: k for k in out})


async def decode_images(program: Mapping[str, Any], values: Mapping[str, Any],
                        fields: Mapping[str, str]) -> dict[str, Any]:
    """Image inputs given as base64 text (or a data: URL) as the walk's RGB uint8 tensors; a
    frames input (u8 [N, H, W, 3]) given as a list of them, stacked.
    Decoding runs off the event loop (a large PNG takes seconds; `/health` and the other
    requests must not wait for it); its pixel count is bounded before it is decoded
    (`io.decode_image`)."""
    types = {p["name"]: p["type"] for p in program["inputs"]}
    out = dict(values)
    for name, value in values.items():
        t = types.get(name, {})
        param = fields.get(name, name)
        if t.get("kind") == "image" and isinstance(value, str):
            try:
                out[name] = await asyncio.to_thread(decode_image_text, value)
            except ValueError as e:
                raise bad_request(f"{param}: {e}", param, "invalid_image") from None
        elif t.get("kind") == "tensor" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            out[name] = await asyncio.to_thread(_decode_frames, value, param)
    return out


def _decode_frames(texts: list[str], param: str) -> Any:
    """A list of base64 images of one size as RGB frames [N, H, W, 3] (π0.5's cameras, V-JEPA's frames)."""
    import torch

    frames = []
    for i, text in enumerate(texts):
        try:
            frames.append(decode_image_text(text))
        except ValueError as e:
            raise bad_request(f"{param}[{i}]: {e}", f"{param}[{i}]", "invalid_image") from None
    sizes = sorted({(int(f.shape[1]), int(f.shape[0])) for f in frames})
    if len(sizes) > 1:
        raise bad_request(f"{param}: images of different sizes ({', '.join(f'{w}x{h}' for w, h in sizes)})",
                          param, "invalid_image")
    return torch.stack(frames)


MAX_TOKEN_INPUTS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "max_new", "max_length")


def token_limit(state: ServerState) -> int | None:
    """Tokens a walk of this plan decodes at most, or None when the plan has no such bound:
    its `max_new_tokens` (the bound of every decode loop) plus the prefill's token, or its
    `max_text_tokens` (BAGEL: the bound of its text loops, which emit every token they decode)."""
    return _token_bound(state)[0]


def _token_bound(state: ServerState) -> tuple[int | None, str]:
    """(the limit, how the plan sets it)."""
    config = state.plan.config
    bound = config.get("max_new_tokens")
    if isinstance(bound, int) and not isinstance(bound, bool):
        return bound + 1, f"its max_new_tokens {bound}, plus the prefill's token"
    bound = config.get("max_text_tokens")
    if isinstance(bound, int) and not isinstance(bound, bool):
        return bound, f"its max_text_tokens {bound}"
    return None, ""


def check_token_limit(state: ServerState, param: str, value: Any) -> None:
    """The 400 for a token count above the plan's limit, on every route alike (a walk would
    clamp it silently at its loop's bound)."""
    most, why = _token_bound(state)
    if most is not None and isinstance(value, int) and not isinstance(value, bool) and value > most:
        raise bad_request(f"{param} is {value}, but this plan decodes at most {most} tokens per walk ({why})",
                          param, "max_tokens_too_large")


def check_inputs(state: ServerState, walk: str, inputs: Mapping[str, Any], fields: Mapping[str, str]) -> None:
    """The route-independent checks of walk inputs the engine would not report by field:
    integers outside 64 bits (also those the server derives, such as image i's seed + i),
    loop counts outside their loop's bound, token counts above the plan's limit, and the
    bounds of image-generation inputs (`control.bounds`: sizes, flow steps, CFG), all at once."""
    program = state.plan.walk(walk)
    for p in program["inputs"]:
        value = inputs.get(p["name"])
        if p["type"]["kind"] == "int" and isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            param = fields.get(p["name"], p["name"])
            raise bad_request(f"{param} is {value}, outside the 64-bit integers ({INT64_MIN} to {INT64_MAX})",
                              param, "out_of_range")
    for name, most in state.loop_limits.get(walk, {}).items():
        value = inputs.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= most:
            param = fields.get(name, name)
            raise bad_request(f"{param} must be between 0 and {most} (the bound of walk '{walk}'s loop), "
                              f"got {value}", param, "out_of_range")
    for name in MAX_TOKEN_INPUTS:
        if name in inputs and name in state.input_types[walk]:
            check_token_limit(state, fields.get(name, name), inputs[name])
    found = out_of_bounds(state.plan.config, program, inputs)
    if found:  # all of them in one 400, named by the request's fields; `param` is the first's
        def field(name: str) -> str:
            return fields.get(name, name)

        raise bad_request("; ".join(p.render(field) for p in found), field(found[0].names[0]), found[0].code)


async def start_flight(state: ServerState, request: Request, route: str, walk: str, inputs: Mapping[str, Any],
                       fields: Mapping[str, str], primary: str | None, timeout: float | None = None,
                       streaming: bool = False, receive: Any = None) -> Flight:
    """Check, admit and submit one request; the `Flight` to run it under (`async with`), with
    its prompt's token count. A value the walk's prompt node refuses (an unknown voice) is
    the 400 it would be after running, but at once rather than behind the engine's queue.
    `streaming`: the walk's streamed inputs left out of `inputs` are fed through the handle
    (`/v1/realtime`'s audio, `serve.live`'s request body). `receive`: what the flight's
    disconnect watch reads instead of `request.receive` (a route that reads the body itself)."""
    codec = state.codecs.get(walk)
    try:
        check_inputs(state, walk, inputs, fields)
        # the prompt node tokenizes: off the event loop (a long prompt takes a while)
        prompt_tokens = 0 if codec is None else await asyncio.to_thread(codec.count, inputs)
    except ApiError:
        state.metrics.rejected(walk)
        raise
    except RequestError as e:
        state.metrics.rejected(walk)
        raise bad_request(str(e), fields.get(e.field or "", primary)) from None
    state.admit(walk)
    t0 = time.perf_counter()
    try:
        handle: RequestHandle = (state.m.submit(walk, inputs, timeout=timeout, streaming=True) if streaming
                                 else state.m.submit(walk, inputs, timeout=timeout))
    except Exception as e:
        state.metrics.rejected(walk)
        raise submit_error(e, fields, state.engine_problem()) from None
    flight = Flight(state, handle, route, receive or request.receive, fields, primary, t0)
    flight.client_timeout = timeout is not None
    flight.prompt_tokens = prompt_tokens
    return flight


def finish_openapi(app: FastAPI, state: ServerState) -> None:
    """Add the error body schema, and pin every `model` field to the served id, so the schema
    says exactly what this server accepts (and Schemathesis explores past the model check)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps["ErrorBody"] = _ERROR_SCHEMA
        for comp in comps.values():
            model = comp.get("properties", {}).get("model")
            if isinstance(model, dict) and model.get("type") == "string":
                model["enum"] = [state.model_id]
        if state.api_key_digest is not None:  # --api-key: every operation but /health wants it
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            for path in UNAUTHENTICATED:
                for op in schema.get("paths", {}).get(path, {}).values():
                    op["security"] = []
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["ERROR_RESPONSES", "MAX_TOKEN_INPUTS", "check_inputs", "check_model", "check_token_limit",
           "content_type_error", "decode_images", "error_response", "install", "param_of", "start_flight",
           "token_limit", "validation_error", "walk_extras"]
