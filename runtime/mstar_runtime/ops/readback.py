"""Moving small values between host and device without making the host wait for the GPU.

A CUDA copy from pageable host memory, and any read of a device value (`.item()`,
`.tolist()`, `bool(t)`), waits for *all* work queued on the stream. In a decode loop that
serialises host and GPU: the host cannot prepare step N+1 while step N runs. This module
holds the three tools the hot path uses instead:

- `upload(values, dtype, device)`: a host list on the device through pinned memory and a
  non-blocking copy (the caching host allocator keeps the pinned block alive until the copy
  has run, so the list may be dropped at once).
- `Readback`: a device tensor copied to pinned host memory without waiting, with an event
  recorded after the copy; `values()` waits for that event only, i.e. for the work queued
  *before* the copy, never for the steps launched after it.
- `Lazy`: a value computed from a readback on first use (`resolve`). Nodes return `Lazy`
  outputs whose value depends on device results (Orpheus' `done` flag, the 0-or-1-item
  `code`); the interpreter binds them like any value and resolves them one step late
  (runtime/mstar_runtime/control/interpreter.py, "lanes"), when the next step of the same task has been launched.

On the CPU everything is immediate (no pinned memory, no events); the same code path runs,
so the CPU tests exercise the deferral logic too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def upload(values: list[int] | list[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small host list as a tensor on `device`, without a stream synchronisation on a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def upload_tensor(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory on a GPU (no stream synchronisation)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return pinned(t).to(device, non_blocking=True)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory (itself if it is already): the source of a non-blocking upload."""
    return t if t.is_pinned() else t.pin_memory()


class Readback:
    """The values of a device tensor, fetched in the background: a non-blocking copy into pinned
    host memory now, a wait for that copy (and only what was queued before it) on a read
    (`values()`, `array()`, `tensor()`)."""

    __slots__ = ("_host", "_event", "_values")

    def __init__(self, tensor: torch.Tensor):
        self._values: list[Any] | None = None
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.detach()

    @property
    def ready(self) -> bool:
        """Whether `values()` would return without waiting."""
        return self._values is not None or self._event is None or self._event.query()

    def array(self) -> Any:
        """The tensor as a numpy array over the host copy (no Python per element), waiting for its copy if needed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()

    def tensor(self) -> torch.Tensor:
        """The host copy as a tensor (any dtype, bf16 too, which numpy lacks), waiting for its copy if needed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def values(self) -> list[Any]:
        """The tensor as nested Python lists (`tolist`), waiting for its copy if needed."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self._values


class Lazy:
    """A value computed on first use, at most once: `Lazy(fn).get()` is `fn()`, cached.

    `fn` typically reads a `Readback`; a lazy value that is never resolved costs no wait.
    `device`, where given, is the device tensor the value is read from (a flag's: its one
    element is nonzero where the value is true), for a consumer that can use it where it
    is without reading it (a chain's join, engine/cohort_chain.py)."""

    __slots__ = ("_fn", "_value", "_done", "device")

    def __init__(self, fn: Callable[[], Any], device: torch.Tensor | None = None):
        self._fn: Callable[[], Any] | None = fn
        self._value: Any = None
        self._done = False
        self.device = device

    @property
    def resolved(self) -> bool:
        """Whether `get()` has run (its value read)."""
        return self._done

    def get(self) -> Any:
        if not self._done:
            assert self._fn is not None
            self._value, self._done, self._fn = self._fn(), True, None
        return self._value

    def __repr__(self) -> str:
        return f"Lazy({self._value!r})" if self._done else "Lazy(<pending>)"

    def __bool__(self) -> bool:
        # an object is truthy, so `if flag:` on an unresolved flag would silently say yes
        raise TypeError("the truth of a Lazy value: resolve() it first (interpreter.read_flag does)")


def resolve(value: Any) -> Any:
    """`value`, or its computed value if it is `Lazy`."""
    return value.get() if isinstance(value, Lazy) else value


def is_lazy(value: Any) -> bool:
    return isinstance(value, Lazy)
