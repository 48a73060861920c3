"""The wire between the conductor and its worker processes: frames, values, tensors.

Both sides of `runtime/mstar_runtime/worker/remote.py`'s protocol (its module docstring tells the whole
conversation): a frame is a 4-byte big-endian length and one typed msgpack message
(`messages.py`); a step's tensors travel as one flat byte buffer per direction over
torch.distributed point-to-point, cut up by the message's `TensorMeta`s; small tensors and
Python scalars ride inside the message. Nothing here is pickled.
"""

from __future__ import annotations

import hashlib
import os
import select
import struct
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist

from mstar_runtime.engine.cohort_chain import ChainResult
from mstar_runtime.engine.cohort_engine import CohortResult
from mstar_runtime.kv.block_manager import SlotCopy
from mstar_runtime.ops.readback import resolve
from mstar_runtime.plan.loader import Plan
from mstar_runtime.plan.planfile import dump_body
from mstar_runtime.worker import messages as m

INLINE_BYTES = 64  # token ids and flags ride in the message; activations over torch.distributed
# a cohort step's packed readback rides in its answer up to this size (the conductor reads it
# on the host anyway); a larger one (hidden states of a big batch) goes over torch.distributed
READBACK_INLINE_BYTES = m.MAX_INLINE_TENSOR_BYTES
FRAME = struct.Struct(">I")
POLL_S = 0.25  # how often a wait for an answer also checks that the process is alive


class ProtocolError(Exception):
    """A frame that is too long, cut short, or not the message expected at this point."""


# ------------------------------------------------------------------------------- frames
def write_frame(out: IO[bytes], msg: m.Message) -> None:
    write_encoded(out, m.encode(msg))


def write_encoded(out: IO[bytes], data: bytes) -> None:
    """Write one frame of a message already encoded (`messages.encode`): a caller that must
    tell an unencodable message from a broken stream encodes first, then writes."""
    out.write(FRAME.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> m.Message | None:
    """The next message from a blocking stream; None at a clean EOF (between frames)."""
    head = inp.read(FRAME.size)
    if not head:
        return None
    if len(head) < FRAME.size:
        raise ProtocolError("the stream ended inside a frame header")
    (n,) = FRAME.unpack(head)
    if n > m.MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a frame of {n} bytes is over the {m.MAX_MESSAGE_BYTES}-byte limit")
    data = inp.read(n)
    if len(data) < n:
        raise ProtocolError(f"the stream ended inside a frame ({len(data)} of {n} bytes)")
    return m.decode(data)


class FrameReader:
    """Frames from a pipe's fd, with a deadline (select + os.read), for the conductor side."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, bytearray()
        self.eof = False  # the pipe ended; what is buffered may still hold whole frames
        self.error: OSError | None = None  # why it ended, when a socket broke (a reset, a timeout)

    def read(self, timeout: float, alive: Any) -> m.Message | None:
        """The next message; None at EOF; TimeoutError after `timeout` seconds (the pipe is
        looked at once even when `timeout` is 0). `alive()` is polled while waiting, so a
        dead process that left its pipe open (a grandchild holding it) is still noticed."""
        deadline = time.monotonic() + timeout
        while True:
            if self._complete():
                return self._take()
            if self.eof:
                if self.buf:
                    raise ProtocolError(f"the pipe ended inside a frame ({len(self.buf)} bytes)")
                return None
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(0.0, min(left, POLL_S)))
            if not ready:
                if not alive():
                    return None
                if left <= 0:
                    raise TimeoutError
                continue
            self._fill()

    def poll(self) -> bool:
        """True when `read` would return without waiting: a whole frame is buffered, or the
        pipe ended. Reads what the pipe holds, never blocks."""
        while not self._complete() and not self.eof:
            ready, _, _ = select.select([self.fd], [], [], 0)
            if not ready:
                return False
            self._fill()
        return True

    def _complete(self) -> bool:
        """A whole frame is buffered (or a header too long to be one: `_take` says so)."""
        if len(self.buf) < FRAME.size:
            return False
        (n,) = FRAME.unpack_from(self.buf)
        return n > m.MAX_MESSAGE_BYTES or len(self.buf) >= FRAME.size + n

    def _take(self) -> m.Message:
        (n,) = FRAME.unpack_from(self.buf)
        if n > m.MAX_MESSAGE_BYTES:
            raise ProtocolError(f"a frame of {n} bytes is over the {m.MAX_MESSAGE_BYTES}-byte limit")
        data = bytes(self.buf[FRAME.size : FRAME.size + n])
        del self.buf[: FRAME.size + n]
        return m.decode(data)

    def _fill(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:  # a socket that select called readable had nothing after all
            return
        except OSError as e:  # a socket reset or timed out by its peer's host: the end, with a reason
            self.error, chunk = e, b""
        if chunk:
            self.buf += chunk
        else:
            self.eof = True


# ------------------------------------------------------------------------------- values
Packed = tuple[list[m.TensorMeta], dict[str, torch.Tensor], dict[str, m.Scalar], list[torch.Tensor]]


def pack_values(values: Mapping[str, Any], inline_bytes: int, what: str) -> Packed:
    """Split one entry's values for the wire: (metas and tensors for torch.distributed, inline
    tensors, scalars). Anything else cannot cross ranks: a TypeError naming the value."""
    metas: list[m.TensorMeta] = []
    tensors: list[torch.Tensor] = []
    inline: dict[str, torch.Tensor] = {}
    scalars: dict[str, m.Scalar] = {}
    for name, value in values.items():
        value = resolve(value)  # a node's lazy output (readback.Lazy) crosses as its value
        if isinstance(value, torch.Tensor):
            dtype = m.dtype_name(value.dtype)  # an unsupported dtype is a MessageError (a ValueError)
            if value.numel() == 0 or value.numel() * value.element_size() <= inline_bytes:
                inline[name] = value  # empty tensors always: a zero-byte transfer buys nothing
            else:
                metas.append(m.TensorMeta(name, dtype, list(value.shape)))
                tensors.append(value)
        elif value is None or isinstance(value, bool | int | float | str):
            scalars[name] = value
        else:
            raise TypeError(
                f"{what} '{name}' is a {type(value).__name__}, which cannot cross ranks "
                "(tensors, bool, int, float, str and None can)"
            )
    return metas, inline, scalars, tensors


def unpack_values(
    metas: Sequence[m.TensorMeta],
    tensors: Sequence[torch.Tensor],
    inline: Mapping[str, torch.Tensor],
    scalars: Mapping[str, m.Scalar],
    device: torch.device,
) -> dict[str, Any]:
    out: dict[str, Any] = dict(scalars)
    out.update({k: v.to(device) for k, v in inline.items()})
    out.update({meta.name: t for meta, t in zip(metas, tensors, strict=True)})
    return out


def _nbytes(meta: m.TensorMeta) -> int:
    n = m.TENSOR_DTYPES[meta.dtype].itemsize
    for d in meta.shape:
        n *= d
    return n


def send_tensors(tensors: Sequence[torch.Tensor], dst: int, comm_device: torch.device) -> None:
    """All of a step's tensors as one flat byte buffer: one transfer, whatever their dtypes
    (bytes also sidestep Gloo's gaps, bool and bfloat16)."""
    if not tensors:
        return
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).to(comm_device) for t in tensors]
    dist.send(torch.cat(parts), dst=dst)


def recv_tensors(
    metas: Sequence[m.TensorMeta], src: int, comm_device: torch.device, device: torch.device
) -> list[torch.Tensor]:
    sizes = [_nbytes(meta) for meta in metas]
    if not sizes:
        return []
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=comm_device)
    dist.recv(buf, src=src)
    out, off = [], 0
    for meta, n in zip(metas, sizes):
        # clone: each value owns aligned storage (a dtype view needs it) and no value aliases another
        t = buf[off : off + n].clone().view(m.TENSOR_DTYPES[meta.dtype]).reshape(meta.shape)
        out.append(t.to(device))
        off += n
    return out


def copy_to_wire(copy: SlotCopy) -> m.SlotCopy:
    src, dst = copy.src, copy.dst
    if len(src) != len(dst) or (len(src) and (src.step != 1 or dst.step != 1)):
        raise ValueError(f"a slot copy must map one contiguous range onto another, got {copy}")
    return m.SlotCopy(src.start, dst.start, len(src))


def copy_from_wire(copy: m.SlotCopy) -> SlotCopy:
    return SlotCopy(
        range(copy.src_start, copy.src_start + copy.count), range(copy.dst_start, copy.dst_start + copy.count)
    )


def readback_values(result: CohortResult | ChainResult) -> tuple[list[m.PackedPort], dict[str, torch.Tensor]]:
    """A cohort step's packed readback as an answer's layout and values (`ints`, `floats`), on
    the host: waits for the readback's copy only (never for later work). A chained step's
    links are one readback: their blocks side by side, their ports named `k.port`."""
    parts = result.parts if isinstance(result, ChainResult) else [("", result)]
    layout: list[m.PackedPort] = []
    blocks: dict[str, list[np.ndarray]] = {"ints": [], "floats": []}
    for prefix, part in parts:
        layout += [m.PackedPort(prefix + k, f, w) for k, f, w in part.layout]
        for name, rb in (("ints", part.ints), ("floats", part.floats)):
            if rb is not None:
                blocks[name].append(rb.array())  # [n, width]
    values = {name: torch.from_numpy(np.ascontiguousarray(bs[0] if len(bs) == 1 else np.concatenate(bs, axis=1)))
              for name, bs in blocks.items() if bs}
    return layout, values


def plan_digest(plan: Plan) -> str:
    """The hash of the plan's canonical body: both sides must have loaded the same plan."""
    return hashlib.sha256(dump_body(dict(plan.body))).hexdigest()


def comm_device(device: torch.device) -> torch.device:
    """Where torch.distributed buffers live: the host for Gloo, this rank's GPU for NCCL."""
    return device if device.type == "cuda" else torch.device("cpu")
