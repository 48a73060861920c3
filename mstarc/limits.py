"""Input limits: what the compiler accepts before it refuses with a diagnostic.

Every input of `mstarc` is bounded, so that a mistyped or hostile file fails fast with a
coded diagnostic instead of a Python traceback, a stall or a plan holding values the runtime
cannot represent. The limits are far above what a real model needs (the corpus's largest
file is 21 KB and about 2,600 tokens, its deepest walk nests 4 blocks and its deepest
expression 3 operators, its largest node has about 19,000 weight tensors). They are
documented in docs/diagnostics.md (E005, E006, E025, E023, E055) and docs/walk-language.md
(section 12).

`read_text_capped` is how every text file is read: a size check before reading the bytes,
then UTF-8 decoding; too large is E006 naming the file and the cap.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mstar_runtime import untrusted
from mstarc.diagnostics import CompileError, Diagnostic, Span

KIB = 1 << 10
MIB = 1 << 20

# ---- files (E006)
MAX_WALK_BYTES = 1 * MIB  # a .walk file
MAX_WALK_TOKENS = 100_000  # tokens of a .walk file (parsing time is linear in them)
MAX_PLACEMENT_BYTES = 256 * KIB  # a placement file (1024 explicit devices take about 60 KiB)
MAX_JSON_BYTES = 64 * MIB  # a checkpoint's config or index JSON (`from_checkpoint`, --weights)

# ---- nesting (E005)
MAX_BLOCK_DEPTH = 64  # nested blocks: a walk body, loop bodies, branches, stream blocks
MAX_EXPR_DEPTH = 128  # nested operators, negations, lists and function calls in one expression

# ---- values (E025)
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1  # config integers are signed 64-bit
MAX_VALUE_ITEMS = 1_000_000  # characters of a string, items of a (nested) list value

# ---- sizes of what the compiler builds (E023, E055)
MAX_ARCH_TENSORS = 200_000  # weight tensors of one node's arch
MAX_DEVICES = 1024  # devices (ranks) of a placement


def too_large(file: str, size: int, cap: int, what: str = "bytes") -> CompileError:
    return CompileError([Diagnostic(
        "E006", f"'{file}' is too large: {size} {what}, over the cap of {cap} {what}", Span(file, 0, 0),
        "a model or placement file is far smaller; check that this is the file you meant")])


def read_bytes_capped(path: str | Path, file: str, cap: int) -> bytes:
    """The bytes of the regular file `path`, at most `cap`; E006 when larger. OSError passes
    through (the caller reports it as E004 or its own code), also for a named pipe or a
    device, which are refused without blocking (`mstar_runtime.untrusted.read_file`)."""
    try:
        return untrusted.read_file(path, cap)
    except untrusted.FileTooLarge as e:
        raise too_large(file, e.size, cap) from None


def decode_text(data: bytes) -> str:
    """UTF-8 text with universal newlines, as `Path.read_text` gives it, without a leading
    byte-order mark (editors on Windows write one; columns count from after it).
    UnicodeDecodeError passes through."""
    return data.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def read_text_capped(path: str | Path, file: str, cap: int) -> str:
    """`read_bytes_capped`, decoded as `decode_text` does."""
    return decode_text(read_bytes_capped(path, file, cap))


# A tokenizer mirroring grammar/walk.lark's terminals: a string, a comment, a float, a name or
# an integer, the two-character operators, any other character. Only used to refuse a file
# with too many tokens before Lark parses it.
_TOKENS = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|#[^\n]*'
                     r'|(?:[0-9][0-9_]*\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9][0-9_]*[eE][+-]?[0-9]+'
                     r'|[A-Za-z0-9_]+|->|\+=|\S')


def count_tokens(text: str, stop: int) -> int:
    """The number of tokens of `text`, counting at most `stop` (comments do not count)."""
    n = 0
    for m in _TOKENS.finditer(text):
        first = text[m.start()]
        if first == "#" or text.startswith("//", m.start()):
            continue
        n += 1
        if n >= stop:
            break
    return n


def int_fits(v: int) -> bool:
    return INT_MIN <= v <= INT_MAX


def float_fits(v: float) -> bool:
    return math.isfinite(v)
