"""What every HTTP route shares: OpenAI-style errors, and a request in flight (`Flight`).

Errors. Every failure a client can cause or see is an `ApiError`: an HTTP status and the
OpenAI body `{"error": {"message", "type", "param", "code"}}`, where `param` names the
request field at fault in the route's own vocabulary (`messages`, `input`, `inputs.prompt`),
not the walk's port names. `submit_error` maps what `MStar.submit` raises and
`failure_error` what a request that already ran ended with (`RequestFailed`). What is not
the client's business stays in the server log: a dead engine or a lost worker reaches
clients as one stable message (`ENGINE_STOPPED`, `ENGINE_PROCESS_STOPPED`, `WORKER_LOST`), never with the worker's
pid, exit status and stderr or the transport's source paths, peer addresses and ports; an
internal error (a node bug) as a message naming only the request id.

Flight. One submitted request as a route serves it: it counts as in flight (the drain on
SIGTERM waits for it), streams the handle's appended outputs while watching the client's
connection (a client that hangs up cancels the request, so its KV pages are freed at once
rather than when the walk would have ended), and on exit records its outcome and timings
(first item of each output, the gaps between a token or text output's items) in the metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from mstar_runtime.api import EngineClosed, RequestFailed, RequestHandle
from mstar_runtime.ops.node import RequestError
from mstar_runtime.outputs import is_audio_name
from mstar_runtime.plan.loader import UnknownWalk

if TYPE_CHECKING:
    from mstar_runtime.serve.state import ServerState

INVALID = "invalid_request_error"
SERVER = "server_error"
NOT_FOUND = "not_found_error"
T = TypeVar("T")

# what clients are told about a dead engine or worker (`ServerState.engine_problem`)
ENGINE_STOPPED = "the engine thread stopped"
ENGINE_PROCESS_STOPPED = "the engine process stopped"  # --engine-process: the child process died
WORKER_LOST = "a worker process was lost"

log = logging.getLogger("mstar_runtime.serve.server")

Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error body; text the client sent that is not valid Unicode (a lone
        surrogate in an unknown key it echoes) is escaped, so the body can always be encoded."""
        return {"error": {"message": _printable(self.message), "type": self.type,
                          "param": None if self.param is None else _printable(self.param), "code": self.code}}


def _printable(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


class ClientGone(Exception):
    """The client closed its connection before the request ended."""


def api_key_digest(key: str) -> bytes:
    """What a presented API key is compared with: its SHA-256, so the constant-time comparison
    (`secrets.compare_digest`) does not depend on the key's length either."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def engine_unavailable(message: str) -> ApiError:
    """503 `engine_unavailable`: `message` holds only the stable words of `engine_problem`."""
    return ApiError(503, f"{message}; restart the server (the details are in its log)", type=SERVER,
                    code="engine_unavailable")


def submit_error(e: Exception, fields: Mapping[str, str], engine_problem: str | None = None) -> ApiError:
    """What `MStar.submit` raised, as the route's error. `fields` maps walk inputs to request fields."""
    if isinstance(e, UnknownWalk):
        return ApiError(404, str(e), type=NOT_FOUND, param="walk", code="walk_not_found")
    if isinstance(e, RequestError):
        return bad_request(str(e), fields.get(e.field or "", e.field))
    if isinstance(e, EngineClosed):  # its text is the engine's own (a traceback's last line): log only
        log.warning("a request was refused: the engine is closed (%s)", e)
        return engine_unavailable(f"the engine is not serving: {engine_problem or 'it is closed'}")
    raise e


def failure_error(e: RequestFailed, fields: Mapping[str, str], primary: str | None,
                  engine_problem: str | None, client_timeout: bool = False) -> ApiError:
    """A request that ended without its outputs, as an HTTP error.

    A node's `RequestError` (field set) is the client's fault: 400, naming the request field
    (a node port the client never named, such as the token list built from a prompt, is
    blamed on the route's `primary` field). The conductor's "can never fit" and a KV context
    that would outgrow its tag's `max_len` (an input longer than the walk allows, e.g. audio
    past a cross context's frames; no field: the API has no structured kind for them, so
    their wording is matched) are 413. Timeouts,
    shutdowns and a dead engine are 504/503 (a timeout the client chose itself is its 408);
    anything else is the server's fault, 500. Neither a 503 for a dead engine nor a 500
    carries the engine's message (see the module docstring): `Flight.error_for` logs it.
    """
    if e.finish_reason == "timeout":
        if client_timeout:
            return ApiError(408, f"{e.message} (the request's own timeout)", param="timeout", code="timeout")
        return ApiError(504, e.message, type=SERVER, code="timeout")
    if e.finish_reason == "shutdown":
        return ApiError(503, "the server shut down before the request finished", type=SERVER, code="shutdown")
    if e.finish_reason == "cancelled":
        return ApiError(499, e.message, type=SERVER, code="cancelled")
    if e.field is not None:
        return bad_request(e.message, fields.get(e.field, primary))
    if "can never fit" in e.message or "more than the max_len" in e.message:
        return ApiError(413, e.message, param=primary, code="request_too_large")
    if engine_problem is not None:
        return engine_unavailable(f"the engine failed while running the request: {engine_problem}")
    return ApiError(500, f"request {e.request_id} failed inside the engine (an internal error; the server "
                    "log has the details)", type=SERVER, code="internal_error")


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has hung up (uvicorn answers `http.disconnect` from then on)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def audio_samples(value: Any) -> int:
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0


def is_token_item(value: Any) -> bool:
    """A streamed item of text: a string piece, or integer token ids."""
    if isinstance(value, str):
        return True
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
        and value.dtype != torch.bool and value.dim() <= 1


class Flight:
    """One request in flight on behalf of one HTTP request; use as `async with`."""

    def __init__(self, state: ServerState, handle: RequestHandle, route: str, receive: Receive,
                 fields: Mapping[str, str], primary: str | None, submitted_at: float):
        self.state, self.handle, self.route = state, handle, route
        self.walk = handle.walk
        self._receive = receive
        self.fields, self.primary = fields, primary
        self.t0 = submitted_at
        self.first_at: dict[str, float] = {}  # output name -> seconds from submit to its first item
        self.items: dict[str, int] = {}
        self.audio_samples = 0
        self.outcome: str | None = None  # set by a route that ends the request on purpose ("finished")
        self.client_timeout = False  # the request carries the client's own `timeout`
        self.tokens = 0  # completion tokens, counted by the chat route
        self.prompt_tokens = 0
        self.token_gaps: list[float] = []  # seconds between consecutive items of a token or text output
        self.token_counts: dict[str, int] = {}  # output name -> tokens received (ids, or one per text piece)
        self._last_token_at: dict[str, float] = {}  # output name -> perf_counter of its latest item
        self.first_token_s: float | None = None  # seconds from submit to the first / latest token or text item
        self.last_token_s: float | None = None

    async def __aenter__(self) -> Flight:
        self.begin()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.finish()

    def begin(self) -> None:
        self.state.flights.add(self)

    def finish(self) -> None:
        """Cancel the request if it still runs, record it. Synchronous on purpose: a streaming
        body's cleanup runs while Starlette cancels it, where an await could be interrupted."""
        if self not in self.state.flights:
            return
        self.state.flights.discard(self)
        if not self.handle.done:  # a client that left, a route that stopped early, a server bug
            self.handle.cancel()
            if self.outcome is None:
                self.outcome = "cancelled"
        self.state.metrics.observe_flight(self, self._final_outcome())
        self.state.flight_ended()

    def _final_outcome(self) -> str:
        if self.outcome is not None:
            return self.outcome
        summary = self.handle.summary()
        if summary["finish_reason"] in ("timeout", "shutdown"):
            return str(summary["finish_reason"])
        if summary["state"] == "failed" and summary.get("field") is not None:
            return "rejected"  # a node refused the client's input: a 400, as those refused before running
        return str(summary["state"])

    def error_for(self, e: RequestFailed) -> ApiError:
        """The error to answer for `e`; what the client is not told goes to the log."""
        err = failure_error(e, self.fields, self.primary, self.state.engine_problem(), self.client_timeout)
        if err.status == 500:
            log.error("request %s (walk '%s') failed: %s", e.request_id, self.walk, e.message)
        elif err.code == "engine_unavailable":  # unless it is the engine's fault, logged already
            self.state.log_fault(e.message, f"request {e.request_id} (walk '{self.walk}') failed: {e.message}")
        return err

    def answer_for(self, e: RequestFailed | ClientGone) -> ApiError:
        """The error to answer for a request that failed, or whose client left (a 499)."""
        if isinstance(e, ClientGone):
            return ApiError(499, "client closed the request", code="cancelled")
        return self.error_for(e)

    def fail_early(self, e: RequestFailed | ClientGone) -> ApiError:
        """End a request that failed (or whose client left) before its response started: the error to send."""
        self.finish()
        return self.answer_for(e)

    async def whole(self, reading: Awaitable[T]) -> T:
        """Run the flight (as `async with`) while `reading` (a coroutine over `outputs()` or
        `events()`) takes the request to its end: what it returns, the outcome "finished". A
        request that fails, or a client that leaves, raises the `ApiError` to answer instead
        (the app's handler sends it)."""
        async with self:
            try:
                result = await reading
            except (RequestFailed, ClientGone) as e:
                raise self.answer_for(e) from None
            self.outcome = "finished"
        return result

    async def head(self, events: AsyncIterator[tuple[str, Any]], keep: Callable[[str, Any], T | None]) -> list[T]:
        """Begin the flight and read `events` up to the first item `keep` turns into a value
        (or to the end): what a streaming route holds before it commits to a 200. A request
        that fails, or a client that leaves, before then raises the `ApiError` to answer
        instead (the flight has ended); anything else ends the flight and propagates."""
        self.begin()
        try:
            async for name, value in events:
                kept = keep(name, value)
                if kept is not None:
                    return [kept]
        except (RequestFailed, ClientGone) as e:
            raise self.fail_early(e) from None
        except BaseException:
            self.finish()
            raise
        return []

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """The request's appended outputs as they are produced. Raises `RequestFailed` at the
        end if it failed, `ClientGone` as soon as the client hangs up (and cancels the request)."""
        # One queue fed by two tasks, so waiting is a plain `get`: no task per item, and
        # cleanup is synchronous (cancel both), which matters because Starlette cancels a
        # streaming body through anyio, whose cancellation would interrupt any await here.
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        pump = asyncio.ensure_future(self._pump(queue))
        gone = asyncio.ensure_future(self._watch(queue))
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "item":
                    self._saw(*payload)
                    yield payload
                elif kind == "end":
                    return
                elif kind == "failed":
                    raise payload
                else:
                    self.handle.cancel()
                    self.outcome = "cancelled"
                    raise ClientGone()
        finally:
            pump.cancel()
            gone.cancel()

    async def _pump(self, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        try:
            async for item in self.handle.astream():
                queue.put_nowait(("item", item))
        except RequestFailed as e:
            queue.put_nowait(("failed", e))
        else:
            queue.put_nowait(("end", None))

    async def _watch(self, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        await _disconnected(self._receive)
        queue.put_nowait(("gone", None))

    async def outputs(self) -> dict[str, Any]:
        """Wait for the whole request (still watching the client); the final outputs."""
        async for _ in self.events():
            pass
        return await self.handle.aresult()

    def _saw(self, name: str, value: Any) -> None:
        now = time.perf_counter()
        if name not in self.first_at:
            self.first_at[name] = now - self.t0
        self.items[name] = self.items.get(name, 0) + 1
        if is_audio_name(name):
            self.audio_samples += audio_samples(value)
        elif is_token_item(value):  # inter-token latency: the gap since this output's previous item
            self.token_counts[name] = self.token_counts.get(name, 0) + (1 if isinstance(value, str) else value.numel())
            last = self._last_token_at.get(name)
            if last is not None:
                self.token_gaps.append(now - last)
            self._last_token_at[name] = now
            if self.first_token_s is None:
                self.first_token_s = now - self.t0
            self.last_token_s = now - self.t0


__all__ = ["ENGINE_PROCESS_STOPPED", "ENGINE_STOPPED", "WORKER_LOST", "ApiError", "ClientGone", "Flight", "api_key_digest", "bad_request",
           "engine_unavailable", "failure_error", "is_token_item", "submit_error"]
