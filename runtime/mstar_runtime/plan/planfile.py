"""The plan file container: magic, version, size cap, checksum, canonical JSON body.

Owned by the runtime (the consumer); the compiler writes plans through this module too, so
there is exactly one codec. No torch, no pickle: a plan is data, never code.

Layout (all integers little-endian):

    offset  size  field
    0       8     magic b"MSTARPLN"
    8       2     container version (1)
    10      2     flags (0; reserved)
    12      8     body length in bytes (<= MAX_BODY_BYTES)
    20      32    SHA-256 of the body
    52      n     body: canonical JSON, UTF-8 (sorted keys, no whitespace, no NaN)

The body's `schema.major` must equal `SCHEMA_MAJOR`; a newer minor is accepted (fields are
only ever added within a major). `dump_body` is canonical, so equal plans are equal bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mstar_runtime import untrusted

MAGIC = b"MSTARPLN"
CONTAINER_VERSION = 1
SCHEMA_MAJOR = 1
# 1.1: `cohort` on every loop op; 1.2: no `placement.nodes` (each node's `ranks` and `shard.tp` say it);
# 1.3: `routes` on every walk (the OpenAI routes it serves)
SCHEMA_MINOR = 3
MAX_BODY_BYTES = 64 << 20  # a plan references weights and never embeds them: 64 MiB is ample
_HEADER = struct.Struct("<8sHHQ32s")
HEADER_BYTES = _HEADER.size


class PlanFileError(Exception):
    """A plan that cannot be used: corrupt, truncated, too large, or of an unknown version."""

    def __init__(self, path: str, message: str, kind: str = "corrupt"):
        self.path = path
        self.message = message
        self.kind = kind  # "corrupt" | "version" | "size" | "io"
        super().__init__(f"{path}: {message}")


def dump_body(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def encode(body: dict[str, Any]) -> bytes:
    raw = dump_body(body)
    if len(raw) > MAX_BODY_BYTES:
        raise PlanFileError("<plan>", f"plan body is {len(raw)} bytes, over the {MAX_BODY_BYTES}-byte cap", "size")
    return _HEADER.pack(MAGIC, CONTAINER_VERSION, 0, len(raw), hashlib.sha256(raw).digest()) + raw


def decode(data: bytes, path: str = "<plan>") -> dict[str, Any]:
    """Bytes -> body, checking in order: header, size, checksum, JSON, schema version."""
    if len(data) < HEADER_BYTES:
        raise PlanFileError(path, f"not a plan file: {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, flags, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PlanFileError(path, "not a plan file (bad magic bytes); was it written by `mstarc compile`?")
    if version != CONTAINER_VERSION:
        raise PlanFileError(path, f"plan container version {version} is not supported (this runtime reads "
                            f"version {CONTAINER_VERSION}); recompile the plan with a matching mstarc", "version")
    if flags != 0:
        raise PlanFileError(path, f"plan header has unknown flags {flags:#06x}: corrupt, or written by a newer mstarc")
    if length > MAX_BODY_BYTES:
        raise PlanFileError(path, f"plan body claims {length} bytes, over the {MAX_BODY_BYTES}-byte cap", "size")
    raw = data[HEADER_BYTES:]
    if len(raw) != length:
        raise PlanFileError(path, f"plan file is truncated or padded: body has {len(raw)} bytes, header says {length}")
    if hashlib.sha256(raw).digest() != digest:
        raise PlanFileError(path, "plan checksum mismatch: the file is corrupt")
    try:
        body = untrusted.loads_json(raw.decode("utf-8"))
    except untrusted.JSONTooDeep as e:  # deeper than any plan mstarc writes
        raise PlanFileError(path, f"plan body: {e}; the file is corrupt") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise PlanFileError(path, f"plan body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise PlanFileError(path, "plan body is not a JSON object")
    schema = body.get("schema")
    major = schema.get("major") if isinstance(schema, dict) else None
    if isinstance(major, bool) or not isinstance(major, int):  # `true` is not version 1
        raise PlanFileError(path, "plan body has no schema version")
    if major != SCHEMA_MAJOR:
        raise PlanFileError(path, f"plan schema version {major}.x is not supported (this runtime reads "
                            f"{SCHEMA_MAJOR}.x); recompile the plan with a matching mstarc", "version")
    return body


def read(path: str | Path) -> dict[str, Any]:
    """A plan file's body: a regular file of at most the size cap (never blocks on a named
    pipe, never reads a device without end), decoded and checked by `decode`."""
    try:
        data = untrusted.read_file(path, MAX_BODY_BYTES + HEADER_BYTES)
    except untrusted.FileTooLarge as e:
        raise PlanFileError(str(path), f"file is {e.size} bytes, over the plan size cap", "size") from None
    except OSError as e:
        raise PlanFileError(str(path), f"cannot read plan: {e.strerror or e}", "io") from None
    return decode(data, str(path))


def write(path: str | Path, body: dict[str, Any]) -> int:
    data = encode(body)
    Path(path).write_bytes(data)
    return len(data)


def iter_ops(region: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every op of a walk's step program (docs/plan-format.md), pre-order."""
    yield region
    op = region.get("op")
    if op == "seq":
        for item in region.get("body", ()):
            yield from iter_ops(item)
    elif op == "parallel":
        for branch in region.get("branches", ()):
            yield from iter_ops(branch["body"])
    elif op in ("loop", "on_stream"):
        yield from iter_ops(region["body"])


def cohort_links(mark: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The single-call marks of a (non-null) `cohort` mark: its `links` for a chain (a body of
    several calls), else the mark itself (docs/plan-format.md, "Cohort loops")."""
    return list(mark["links"]) if "links" in mark else [mark]


def cohort_call(loop: Mapping[str, Any]) -> dict[str, Any]:
    """The call a loop's (non-null) `cohort` mark names: the one call of its body, which may
    start with value transfers into it (docs/plan-format.md, "Cohort loops"); a chain's first."""
    call_id = cohort_links(loop["cohort"])[0]["call"]
    return next(op for op in loop["body"]["body"] if op.get("op") == "call" and op.get("id") == call_id)
