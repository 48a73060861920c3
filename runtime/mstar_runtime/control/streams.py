"""Streaming edges at the consumer: chunk policies and the per-(request, stream) buffer.

A producer appends items (tensors with a leading item dim) to a ``StreamBuffer``; its
``ChunkPolicy`` decides when the consumer fires and on which items:

- ``FixedChunkPolicy(size)``: every ``size`` new items (Qwen3-Omni thinker -> talker, K=1).
- ``SlidingWindowChunkPolicy(window, stride)``: once ``window`` items exist, then every
  ``stride`` new items, each chunk the last ``window`` items (Orpheus -> SNAC: windows end
  at item counts 28, 35, 42, ...).
- ``LeftContextChunkPolicy(chunk, left, first=None)``: every ``chunk`` new items (the first
  chunk ``first`` new items when given: a short first window for a low time to first
  audio), preceded by up to ``left`` earlier items as context (causal smoothing of codec
  output).

``Chunk.context`` is the number of leading items of a chunk that already appeared in an
earlier chunk, so the consumer knows which outputs are new.

Close semantics: ``fixed`` and ``left_context`` release the remaining new items (if any)
as a final partial chunk. ``sliding`` releases nothing partial: a window decoder such as
SNAC needs a full window of context to produce correct audio for its middle, so a tail of
fewer than ``stride`` items is dropped, exactly as the Orpheus reference decoder does.
``Chunk.final`` is set on the last chunk when the stream is already closed as it is
popped; a stream closed after its last chunk was popped yields no further chunk, so the
authoritative end signal is ``StreamBuffer.done``.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch


class StreamError(Exception):
    """Base class of stream buffer and chunk policy errors."""


class ChunkPolicyError(StreamError):
    """A chunk policy spec with an unknown kind or bad parameters."""


class StreamFull(StreamError):
    """A push beyond the buffer's capacity; the producer must wait (check ``can_push``)."""


class StreamClosed(StreamError):
    """A push to a closed stream."""


class Span(NamedTuple):
    """Absolute item range ``[start, end)`` of a chunk; ``context`` leading items are history."""

    start: int
    end: int
    context: int


def _positive(kind: str, name: str, value: object, minimum: int = 1) -> int:
    # bool is an int subclass; a spec saying ``window: true`` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ChunkPolicyError(f"{kind} chunk policy: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class ChunkPolicy:
    """When a consumer fires. Stateless: the buffer passes ``consumed``, the end of the new
    items of the last chunk emitted (0 before the first)."""

    kind: ClassVar[str]

    def next_span(self, consumed: int, available: int) -> Span | None:
        """The next full chunk if ``available`` items suffice, else ``None``."""
        raise NotImplementedError

    def final_span(self, consumed: int, available: int) -> Span | None:
        """The partial chunk released on close, if any."""
        raise NotImplementedError

    def end_of_next(self, consumed: int) -> int:
        """The item count at which ``next_span(consumed, ...)`` becomes a chunk (and its new ``consumed``)."""
        raise NotImplementedError

    def history_from(self, consumed: int) -> int:
        """Lowest absolute item index any future chunk can read; older items may be dropped."""
        raise NotImplementedError

    @property
    def min_capacity(self) -> int:
        """Smallest buffer capacity with which the first chunk can ever fire."""
        raise NotImplementedError

    @property
    def max_history(self) -> int:
        """Most already-consumed items the buffer must keep for later chunks."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class FixedChunkPolicy(ChunkPolicy):
    size: int
    kind: ClassVar[str] = "fixed"

    def __post_init__(self) -> None:
        _positive(self.kind, "size", self.size)

    def next_span(self, consumed: int, available: int) -> Span | None:
        end = consumed + self.size
        return Span(consumed, end, 0) if available >= end else None

    def end_of_next(self, consumed: int) -> int:
        return consumed + self.size

    def final_span(self, consumed: int, available: int) -> Span | None:
        return Span(consumed, available, 0) if available > consumed else None

    def history_from(self, consumed: int) -> int:
        return consumed

    @property
    def min_capacity(self) -> int:
        return self.size

    @property
    def max_history(self) -> int:
        return 0

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self.size}


@dataclass(frozen=True, slots=True)
class SlidingWindowChunkPolicy(ChunkPolicy):
    window: int
    stride: int
    kind: ClassVar[str] = "sliding"

    def __post_init__(self) -> None:
        _positive(self.kind, "window", self.window)
        _positive(self.kind, "stride", self.stride)
        if self.stride > self.window:
            raise ChunkPolicyError(
                f"sliding chunk policy: stride ({self.stride}) must be <= window ({self.window}), "
                "else items between windows would never be decoded"
            )

    def next_span(self, consumed: int, available: int) -> Span | None:
        first = consumed == 0
        end = self.end_of_next(consumed)
        if available < end:
            return None
        return Span(end - self.window, end, 0 if first else self.window - self.stride)

    def end_of_next(self, consumed: int) -> int:
        return self.window if consumed == 0 else consumed + self.stride

    def final_span(self, consumed: int, available: int) -> Span | None:
        return None  # a partial window would decode without its context; see module docstring

    def history_from(self, consumed: int) -> int:
        return max(0, consumed + self.stride - self.window) if consumed else 0

    @property
    def min_capacity(self) -> int:
        return self.window

    @property
    def max_history(self) -> int:
        return self.window - self.stride

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "window": self.window, "stride": self.stride}


@dataclass(frozen=True, slots=True)
class LeftContextChunkPolicy(ChunkPolicy):
    chunk: int
    left: int
    first: int | None = None  # the first chunk's new items (None: `chunk`), e.g. a short first window
    kind: ClassVar[str] = "left_context"

    def __post_init__(self) -> None:
        _positive(self.kind, "chunk", self.chunk)
        _positive(self.kind, "left", self.left, minimum=0)
        if self.first is not None:
            _positive(self.kind, "first", self.first)

    def _span(self, consumed: int, end: int) -> Span:
        start = max(0, consumed - self.left)
        return Span(start, end, consumed - start)

    def next_span(self, consumed: int, available: int) -> Span | None:
        end = self.end_of_next(consumed)
        return self._span(consumed, end) if available >= end else None

    def end_of_next(self, consumed: int) -> int:
        return consumed + (self.chunk if consumed or self.first is None else self.first)

    def final_span(self, consumed: int, available: int) -> Span | None:
        return self._span(consumed, available) if available > consumed else None

    def history_from(self, consumed: int) -> int:
        return max(0, consumed - self.left)

    @property
    def min_capacity(self) -> int:
        return max(self.chunk, self.first or 0)

    @property
    def max_history(self) -> int:
        return self.left

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "chunk": self.chunk, "left": self.left}
        return out if self.first is None else {**out, "first": self.first}


POLICIES: dict[str, tuple[type[ChunkPolicy], tuple[str, ...]]] = {
    "fixed": (FixedChunkPolicy, ("size",)),
    "sliding": (SlidingWindowChunkPolicy, ("window", "stride")),
    "left_context": (LeftContextChunkPolicy, ("chunk", "left")),
}
OPTIONAL_PARAMS: dict[str, tuple[str, ...]] = {"left_context": ("first",)}


def policy_from_spec(spec: Mapping[str, Any]) -> ChunkPolicy:
    """Build a policy from a plan spec such as ``{"kind": "sliding", "window": 28, "stride": 7}``."""
    if not isinstance(spec, Mapping):
        raise ChunkPolicyError(f"chunk policy spec must be a mapping, got {type(spec).__name__}")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind not in POLICIES:
        raise ChunkPolicyError(f"unknown chunk policy kind {kind!r}; supported: {', '.join(POLICIES)}")
    cls, params = POLICIES[kind]
    optional = OPTIONAL_PARAMS.get(kind, ())
    given = set(spec) - {"kind"}
    missing, extra = [p for p in params if p not in given], sorted(given - set(params) - set(optional))
    if missing or extra:
        raise ChunkPolicyError(
            f"{kind} chunk policy takes ({', '.join(params + optional)})"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(map(str, extra))}" if extra else "")
        )
    return cls(*(spec[p] for p in params), **{p: spec[p] for p in optional if p in spec})


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """One firing of the consumer: ``items[:context]`` are history, ``items[context:]`` new.
    ``start`` is the absolute index of ``items[0]`` in the stream."""

    index: int
    items: torch.Tensor
    context: int
    final: bool
    start: int


class StreamBuffer:
    """Items of one (request, stream) at the consumer, in a fixed-size ring.

    ``capacity`` bounds the items pushed but not yet consumed by a popped chunk; the ring
    also keeps the ``max_history`` items later chunks re-read, and nothing older, so memory
    is fixed once the first item arrives (its shape, dtype and device fix the stream's).
    """

    def __init__(self, policy: ChunkPolicy, capacity: int) -> None:
        if capacity < policy.min_capacity:
            raise StreamError(
                f"capacity {capacity} is below {policy.min_capacity}, the items {policy.spec()} needs "
                "before its first chunk; the stream would stall"
            )
        self.policy = policy
        self.capacity = capacity
        self._ring: torch.Tensor | None = None
        self._pushed = 0  # absolute count of items ever pushed
        self._consumed = 0  # end of the new items of the last popped chunk
        self._next_index = 0
        self._closed = False
        self._finished = False  # closed and every chunk (incl. the partial one) popped

    @property
    def pushed(self) -> int:
        return self._pushed

    @property
    def pending(self) -> int:
        """Items pushed that no popped chunk has consumed yet (what ``capacity`` bounds)."""
        return self._pushed - self._consumed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def done(self) -> bool:
        """Closed and no chunk left to pop: the consumer has seen everything it will."""
        return self._finished

    def can_push(self, n: int) -> bool:
        return not self._closed and self.pending + n <= self.capacity

    def push(self, items: torch.Tensor) -> None:
        """Append ``items`` (leading dim = item count). Raises ``StreamFull`` past capacity."""
        if self._closed:
            raise StreamClosed("push to a closed stream")
        n = items.shape[0] if items.dim() else -1
        if n < 0:
            raise StreamError("items need a leading item dimension")
        if not self.can_push(n):
            raise StreamFull(
                f"push of {n} item(s) with {self.pending} pending exceeds capacity {self.capacity}"
            )
        if n == 0:
            return
        if self._ring is None:
            size = self.capacity + self.policy.max_history
            self._ring = torch.empty((size, *items.shape[1:]), dtype=items.dtype, device=items.device)
        ring = self._ring
        if items.shape[1:] != ring.shape[1:] or items.dtype != ring.dtype:
            raise StreamError(
                f"stream items are {tuple(ring.shape[1:])} {ring.dtype}; got {tuple(items.shape[1:])} {items.dtype}"
            )
        if items.device != ring.device:
            # one producer, two step paths: a generic step pushes its outputs where they are (a
            # GPU), a decode cohort pushes host items taken from its one readback per step
            items = items.to(ring.device, non_blocking=ring.device.type == "cuda")
        at = self._pushed % ring.shape[0]
        if at + n <= ring.shape[0]:  # the common case, one slice copy (no index tensor to build)
            ring[at : at + n].copy_(items)
        else:
            ring.index_copy_(0, self._positions(self._pushed, self._pushed + n), items)
        self._pushed += n

    def next_ready_at(self, pushed: int) -> int:
        """The item count (> ``pushed``) at which the first chunk not yet within ``pushed`` items is ready."""
        at = self.policy.end_of_next(self._consumed)
        while at <= pushed:
            at = self.policy.end_of_next(at)
        return at

    def close(self) -> None:
        """No more items will come. Idempotent."""
        self._closed = True
        self._finished = self._finished or self._nothing_left()

    def pop_ready(self) -> list[Chunk]:
        """Every chunk ready now, in order (several if a push crossed several boundaries)."""
        spans: list[Span] = []
        while (span := self.policy.next_span(self._consumed, self._pushed)) is not None:
            spans.append(span)
            self._consumed = span.end
        if self._closed and (span := self.policy.final_span(self._consumed, self._pushed)) is not None:
            spans.append(span)
            self._consumed = span.end
        chunks = []
        for i, span in enumerate(spans):
            final = self._closed and i == len(spans) - 1
            assert self._ring is not None  # a span exists only after a push
            items = self._read(span.start, span.end)
            chunks.append(Chunk(self._next_index, items, span.context, final, span.start))
            self._next_index += 1
        if self._closed:
            self._finished = True
        return chunks

    def _nothing_left(self) -> bool:
        return (
            self.policy.next_span(self._consumed, self._pushed) is None
            and self.policy.final_span(self._consumed, self._pushed) is None
        )

    def _read(self, start: int, end: int) -> torch.Tensor:
        """A copy of the items at absolute indices start..end-1 (the ring will be overwritten)."""
        assert self._ring is not None
        at = start % self._ring.shape[0]
        if at + (end - start) <= self._ring.shape[0]:
            return self._ring[at : at + end - start].clone()
        return self._ring.index_select(0, self._positions(start, end))

    def _positions(self, start: int, end: int) -> torch.Tensor:
        assert self._ring is not None
        return torch.arange(start, end, device=self._ring.device) % self._ring.shape[0]
