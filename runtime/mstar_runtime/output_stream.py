"""What every request handle's readers share: `OutputStream` (the appended output items in
order, the end, and the ways to wait for them) and `RequestFailed`, what they raise when the
request ended without its outputs. The Python API's `RequestHandle` (api.py) and the engine
process client's `ClientHandle` (engine_process.py) are its subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from mstar_runtime.control.requests import FINISHED


class RequestFailed(Exception):
    """A request ended without its outputs: failed, cancelled, timed out or shut down."""

    def __init__(self, request_id: str, message: str, field: str | None = None, finish_reason: str = "error"):
        super().__init__(message)
        self.request_id = request_id
        self.message = message
        self.field = field
        self.finish_reason = finish_reason



def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop was closed: nobody is waiting any more
        pass


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # the awaiting task may have been cancelled meanwhile
        fut.set_result(None)


class OutputStream:
    """What a request handle's readers share: the appended output items in order, the end, and
    the ways to wait for them (`result`, `stream`, `aresult`, `astream`, `add_done_callback`).

    A subclass appends to `_chunks` and ends it under `_cond` (setting `_outputs`, then
    `_end()`), and once `_cond` is released wakes `_watchers` and calls `_done_callbacks`
    (`_after_end`); it provides `state` and `_failure()`.
    `_readers` counts the streams reading now and `_read(i)` hears that a stream has read `i`
    items (a no-op here: the engine-process client acknowledges them)."""

    id: str  # the request's id (set by the subclass)

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._chunks: list[tuple[str, Any]] = []
        self._watchers: list[Callable[[], None]] = []  # wake-ups on every chunk and at the end
        self._done_callbacks: list[Callable[[Any], None]] = []
        self._readers = 0
        self._done = False
        self._outputs: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        return self._done

    @property
    def state(self) -> str:
        raise NotImplementedError

    def _failure(self) -> RequestFailed:
        raise NotImplementedError

    def _read(self, i: int) -> None:
        """A stream has read `i` items."""

    def _end(self) -> tuple[list[Callable[[], None]], list[Callable[[Any], None]]]:
        """Under `_cond`: the request has ended; wakes the threads waiting on `_cond` and hands
        back the wake-ups and the done callbacks, for `_after_end` once `_cond` is released."""
        self._done = True
        watchers, callbacks = list(self._watchers), self._done_callbacks
        self._done_callbacks = []
        self._cond.notify_all()
        return watchers, callbacks

    def _after_end(self, ended: tuple[list[Callable[[], None]], list[Callable[[Any], None]]],
                   log: logging.Logger) -> None:
        """Outside `_cond`: run what `_end` handed back. A callback that raises is logged to `log`
        and passed over: a client's callback must not take down the thread that ended the request."""
        watchers, callbacks = ended
        for wake in watchers:
            wake()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("done callback of request '%s' raised", self.id)

    def _outcome(self) -> dict[str, Any]:
        if self.state != FINISHED:
            raise self._failure()
        return dict(self._outputs)

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The outputs, once the request finishes. Raises `RequestFailed` if it did not, and
        `TimeoutError` if `timeout` seconds pass first (the request goes on)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request '{self.id}' did not finish within {timeout} s")
        return self._outcome()

    @contextlib.contextmanager
    def _reading(self, wake: Callable[[], None] | None = None) -> Iterator[None]:
        """Count a stream as reading (`_readers`) while it reads, with `wake` among the
        `_watchers` where it has one (an asyncio reader's wake-up)."""
        with self._cond:
            self._readers += 1
            if wake is not None:
                self._watchers.append(wake)
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if wake in self._watchers:
                    self._watchers.remove(wake)

    def _hand_out(self, items: list[tuple[str, Any]], start: int) -> Iterator[tuple[str, Any]]:
        """Yield `items` (the chunks from index `start` on), each counted as read (`_read`) once
        the stream asks for the next: the reader has taken it."""
        for i, item in enumerate(items, start + 1):
            yield item
            self._read(i)

    def stream(self) -> Iterator[tuple[str, Any]]:
        """`(output name, value)` for each appended output item, in order, as it is produced
        (from the start of the request, whenever iteration starts). Ends with the request;
        raises `RequestFailed` at the end if it failed."""
        with self._reading():
            i = 0
            while True:
                with self._cond:
                    while i >= len(self._chunks) and not self._done:
                        self._cond.wait()
                    items, done = self._chunks[i:], self._done
                yield from self._hand_out(items, i)
                i += len(items)
                if done:
                    break
        if self.state != FINISHED:
            raise self._failure()

    async def aresult(self) -> dict[str, Any]:
        """`result()` for asyncio: awaits without blocking the event loop (or polling)."""
        if not self._done:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            self.add_done_callback(lambda _h: _call_in_loop(loop, _resolve, fut))
            await fut
        return self._outcome()

    async def astream(self) -> AsyncIterator[tuple[str, Any]]:
        """`stream()` for asyncio: `async for name, value in handle.astream()`."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            _call_in_loop(loop, changed.set)

        with self._reading(wake):
            i = 0
            while True:
                # clear before reading: a chunk that lands after the read sets it again
                changed.clear()
                with self._cond:
                    items, done = self._chunks[i:], self._done
                for item in self._hand_out(items, i):
                    yield item
                i += len(items)
                if done:
                    break
                if not items:
                    await changed.wait()
        if self.state != FINISHED:
            raise self._failure()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call `fn(handle)` once the request ends: on the thread that ends it, or right here if
        it already has. Keep it short: that thread waits for it."""
        with self._cond:
            if not self._done:
                self._done_callbacks.append(fn)
                return
        fn(self)
