"""A request in flight (`Flight`): one submitted request as an HTTP route serves it.

It counts as in flight (the drain on SIGTERM waits for it), streams the handle's appended
outputs while watching the client's connection (a client that hangs up cancels the request,
so its KV pages are freed at once rather than when the walk would have ended), and on exit
records its outcome and timings (first item of each output, the gaps between a token or text
output's items) in the metrics (`Metrics.observe_flight`).

It is built on the server's state (serve/state.py): `ServerState` admits it and counts it in
and out (`in_flight`, what admission, the drain and the gauges read), and never names it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import torch

from mstar_runtime.api import RequestFailed, RequestHandle
from mstar_runtime.outputs import is_audio_name
from mstar_runtime.serve.common import ApiError, ClientGone, failure_error
from mstar_runtime.serve.state import ServerState

T = TypeVar("T")
log = logging.getLogger("mstar_runtime.serve.server")

Receive = Callable[[], Awaitable[Mapping[str, Any]]]


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
        self._open = False  # counted in flight by the state (between `begin` and `finish`)

    async def __aenter__(self) -> Flight:
        self.begin()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.finish()

    def begin(self) -> None:
        if not self._open:  # `head` begins it, and so may the `async with` around it
            self._open = True
            self.state.flight_began()

    def finish(self) -> None:
        """Cancel the request if it still runs, record it. Synchronous on purpose: a streaming
        body's cleanup runs while Starlette cancels it, where an await could be interrupted."""
        if not self._open:
            return
        self._open = False
        try:
            if not self.handle.done:  # a client that left, a route that stopped early, a server bug
                self.handle.cancel()
                if self.outcome is None:
                    self.outcome = "cancelled"
            self.state.metrics.observe_flight(self, self._final_outcome())
        finally:
            self.state.flight_ended()  # counted out whatever happened, or the drain would wait for it

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


__all__ = ["Flight", "Receive", "is_token_item"]
