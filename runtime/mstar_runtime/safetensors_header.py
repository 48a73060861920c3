"""Reading a safetensors file's header without torch: tensor names, dtypes, shapes, and a hash.

Shared by the compiler (which sizes weights and records each file's header hash in the plan)
and the runtime (which checks that hash before loading), so that both hash the same bytes.
A safetensors file starts with an 8-byte little-endian header length and a JSON header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from mstar_runtime import untrusted

MAX_HEADER_BYTES = 100 << 20


class HeaderError(ValueError):
    """A file that is missing, unreadable or not a safetensors file; the message names it."""


def read_header(path: Path) -> tuple[dict[str, dict[str, Any]], str]:
    """(tensor -> {dtype, shape, data_offsets}, sha256 of the raw header), `__metadata__` left out."""
    try:
        with untrusted.open_regular(path) as f:  # a named pipe would block the open
            head = f.read(8)
            if len(head) != 8:
                raise HeaderError(f"'{path}' is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise HeaderError(f"'{path}' claims a {n}-byte header; not a safetensors file")
            raw = f.read(n)
    except FileNotFoundError:
        raise HeaderError(f"checkpoint file '{path}' does not exist") from None
    except OSError as e:
        raise HeaderError(f"cannot read checkpoint file '{path}': {e.strerror or e}") from None
    try:
        header = json.loads(raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        for k, v in tensors.items():
            if not isinstance(v, dict) or not isinstance(v.get("shape"), list) or "dtype" not in v:
                raise ValueError(f"tensor '{k}' has no dtype/shape")
    except (ValueError, AttributeError) as e:
        raise HeaderError(f"'{path}' has a corrupt safetensors header: {e}") from None
    return tensors, hashlib.sha256(raw).hexdigest()
