"""Untrusted input: files and JSON text read with bounds, text made safe to print. What every
reader of a plan, a `.walk` file, a placement or a request's JSON goes through.

- `read_file`: regular files only (a named pipe would block `open` until a writer comes, a
  device such as `/dev/zero` or a terminal never ends), opened without blocking, and at most
  `cap` bytes read (a file that grows while it is read is still cut off);
- `loads_json`: JSON text whose nesting is bounded (`MAX_JSON_DEPTH`): deeper text is a
  `ValueError` saying so, never a `RecursionError` from the decoder or from the code that
  walks the value afterwards;
- `printable`: text from a file (a `.walk` comment, a plan's strings) as it may go to a
  terminal: control characters, line separators and bidirectional overrides escaped
  (`\x1b`, `\u2028`), so a file cannot move the cursor, recolour the terminal or reorder
  what the reader sees.

Imports neither torch nor the compiler: both command lines and the server use it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Any, BinaryIO

# Nesting of any JSON the runtime reads: a plan body nests about 4 levels per block of the
# walk (at most 64 blocks, mstarc/limits.py), a request's tensor about one per dimension.
MAX_JSON_DEPTH = 400

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class FileTooLarge(Exception):
    """A file over the reader's cap; `size` is its size (or what was read of it)."""

    def __init__(self, size: int, cap: int):
        self.size, self.cap = size, cap
        super().__init__(f"{size} bytes, over the cap of {cap} bytes")


def _open_regular_fd(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """A read-only descriptor of `path` and its status, when it is a regular file; OSError
    ("not a regular file (a named pipe)") otherwise. Opened without blocking on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(os.fspath(path), flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "a special file")
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for reading in binary, when it is a regular file.

    Raises OSError as `read_file` does ("not a regular file (a named pipe)"), without blocking
    on a FIFO: for what is read in parts (a safetensors header) rather than whole."""
    fd, _ = _open_regular_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(path: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of the regular file `path`, at most `cap`.

    Raises OSError (its `strerror` says why: missing, unreadable, or "not a regular file
    (a named pipe)") and `FileTooLarge`. Never blocks on a FIFO and never reads past `cap`."""
    fd, st = _open_regular_fd(path)
    try:
        if st.st_size > cap:
            raise FileTooLarge(st.st_size, cap)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise FileTooLarge(len(data), cap)
    return data


class JSONTooDeep(ValueError):
    """JSON text nested deeper than the reader takes."""

    def __init__(self, max_depth: int):
        super().__init__(f"JSON nests too deeply (over {max_depth} levels)")


class JSONConstant(ValueError):
    """`NaN`, `Infinity` or `-Infinity` in JSON text: Python's reader takes them; JSON has none."""

    def __init__(self, name: str):
        super().__init__(f"{name} is not JSON (write a finite number, or null)")


def loads_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` of standard JSON, refusing text nested deeper than `max_depth`
    (`JSONTooDeep`, a ValueError) and `NaN`/`Infinity` (`JSONConstant`, a ValueError;
    `json.JSONDecodeError` for malformed text, as `json.loads` raises)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise JSONTooDeep(max_depth) from None
    if nesting_exceeds(value, max_depth):
        raise JSONTooDeep(max_depth)
    return value


def _no_constant(name: str) -> Any:
    raise JSONConstant(name)


def nesting_exceeds(value: Any, max_depth: int) -> bool:
    """Whether lists and objects in `value` nest deeper than `max_depth` (iterative: no
    recursion however deep the value is)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


# C0 and C1 controls but tab and newline, DEL, the Unicode line and paragraph separators and
# the bidirectional embeddings, overrides and isolates.
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """`text` with every character that would act on a terminal escaped (tab and newline kept)."""
    return _UNPRINTABLE.sub(_escape, text)
