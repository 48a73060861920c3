"""Byte sizes: the binary units and the one way a size is written for a human.

Shared by the compiler (diagnostics, `mstarc explain`) and the runtime (the plan loader's
memory errors), so the runtime keeps no copy and imports nothing from `mstarc`.
"""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

_UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))


def human_bytes(n: int | float, digits: int = 1) -> str:
    """`n` bytes in the largest unit it reaches, with `digits` decimals: `27.5 GiB`,
    `102.4 MiB`, `4.0 KiB`, `12 B`. A size below 1 GiB is never written as `0.0 GiB`."""
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"
