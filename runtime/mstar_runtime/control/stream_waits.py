"""Walk tasks waiting on stream buffers, and client-fed inputs moved into their buffers.

A task that yields `WaitChunk` waits here until its buffer has a chunk ready (or closes); one
that yields `WaitSpace` until a chunk was taken from a full buffer. A walk input the client
streams in (`requests.InputFeed`) is pumped into the attempt's buffer as its capacity allows,
and again whenever a chunk taken from it made room. A task that may go on is appended to the
conductor's `ready` queue (task, value it resumes with, exception).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from mstar_runtime.control.interpreter import WaitSpace, WalkTask
from mstar_runtime.control.requests import InputFeed, Request
from mstar_runtime.control.streams import StreamBuffer

Ready = deque[tuple[WalkTask, Any, BaseException | None]]


class StreamWaits:
    """Who waits on which stream buffer (keyed by the buffer's id) and which buffers the client feeds."""

    def __init__(self, ready: Ready):
        self.ready = ready
        self._chunk_waiters: dict[int, WalkTask] = {}
        self._chunk_queues: dict[int, deque] = {}
        self._space_waiters: dict[int, list[WalkTask]] = {}
        self._fed: dict[int, tuple[Request, InputFeed]] = {}  # id(stream buffer) -> its client feed

    def wait_chunk(self, task: WalkTask, buffer: StreamBuffer) -> None:
        """Resume `task` with the buffer's next chunk (None once it is closed and empty), now or when one is ready."""
        queue = self._chunk_queues.setdefault(id(buffer), deque())
        if not queue:
            queue.extend(buffer.pop_ready())
        if queue:
            self.ready.append((task, queue.popleft(), None))
            self._wake_space(buffer)
        elif buffer.closed:
            self._chunk_queues.pop(id(buffer), None)
            self.ready.append((task, None, None))
        else:
            self._chunk_waiters[id(buffer)] = task

    def wait_space(self, task: WalkTask, y: WaitSpace) -> None:
        """Resume `task` once the buffer can take `y.items` more (at once if it can now)."""
        if y.buffer.can_push(y.items):
            self.ready.append((task, None, None))
        else:
            self._space_waiters.setdefault(id(y.buffer), []).append(task)

    def changed(self, buffer: StreamBuffer) -> None:
        """Items arrived in `buffer`, or it closed: its chunk waiter (if any) looks again."""
        task = self._chunk_waiters.pop(id(buffer), None)
        if task is not None:
            self.wait_chunk(task, buffer)

    def _wake_space(self, buffer: StreamBuffer) -> None:
        for task in self._space_waiters.pop(id(buffer), []):
            self.ready.append((task, None, None))
        fed = self._fed.get(id(buffer))
        if fed is not None:
            self.pump(*fed)

    def start_feed(self, req: Request, feed: InputFeed, buffer: StreamBuffer) -> None:
        """A new attempt's buffer for a client-fed input: the input is replayed from its first item."""
        feed.buffer, feed.part, feed.offset, feed.pushed = buffer, 0, 0, 0
        self._fed[id(buffer)] = (req, feed)
        self.pump(req, feed)

    def forget(self, buffer: StreamBuffer) -> None:
        """The buffer's attempt is over (its request ended or was preempted)."""
        self._chunk_waiters.pop(id(buffer), None)
        self._chunk_queues.pop(id(buffer), None)
        self._space_waiters.pop(id(buffer), None)
        self._fed.pop(id(buffer), None)

    def pump(self, req: Request, feed: InputFeed) -> None:
        """Move fed items into the attempt's stream buffer as far as its capacity allows (a part
        larger than the room left goes in pieces); close it once the input is closed and in."""
        buf = feed.buffer
        if buf is None or buf.closed:
            return
        moved = 0
        while not feed.drained():
            part = feed.parts[feed.part]
            n = min(buf.capacity - buf.pending, int(part.shape[0]) - feed.offset)
            if n > 0:
                buf.push(part[feed.offset : feed.offset + n])
                feed.offset += n
                moved += n
            if feed.offset < part.shape[0]:
                break  # the buffer is full: the rest follows when a chunk is taken
            feed.part, feed.offset = feed.part + 1, 0
        feed.pushed += moved
        if feed.closed and feed.drained():
            buf.close()
        if moved or buf.closed:
            self.changed(buf)
        on_input = getattr(req.listener, "on_input", None)
        if moved and on_input is not None:
            on_input(req, feed.name, feed.pushed)
