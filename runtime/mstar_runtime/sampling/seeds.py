"""A row's only randomness: one uniform number, a counter-based hash of (seed, step).

`uniform(seed, step)` is splitmix64 applied three times to the seed and the step, computed
on the host; `uniforms` computes the same bits with int64 tensor ops on any device (inside a
captured step too). So the same (seed, step) gives the same draw on any device, in any batch,
and again after a request is recomputed. `derive_seed` gives nodes of one request that share
its seed unrelated streams of it.
"""

from __future__ import annotations

import secrets

import torch

_M64 = 0xFFFFFFFFFFFFFFFF


def signed64(x: int) -> int:
    """The int64 whose two's-complement bits are `x mod 2**64` (how a 64-bit key lives in a tensor)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_seed(seed: int, stream: int) -> int:
    """A seed for stream `stream` of `seed` (64 bits): nodes of one request that share the
    request's seed draw from different streams of it, so that their draws at the same step are
    unrelated numbers, as `uniform(seed, step)` of one seed would not be."""
    return _splitmix64((seed & _M64) ^ _splitmix64(stream & _M64))


def uniform(seed: int | None, step: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, step): a row's only randomness.

    A missing seed draws from the OS (not reproducible). `uniforms` computes the same bits
    on tensors."""
    s = secrets.randbits(64) if seed is None else seed & _M64
    key = _splitmix64(_splitmix64(_splitmix64(s) ^ (step & _M64)))
    return (key >> 11) * 2.0**-53


_GAMMA, _MUL1, _MUL2 = (signed64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic: mask the sign copies)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """`_splitmix64` on int64 tensors: adds and multiplies wrap modulo 2**64 on CPU and CUDA."""
    x = x + _GAMMA
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def uniforms(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`uniform(seed[r], step[r])` for every r, float64, computed on the tensors' device.

    The top 53 bits of the key, exactly representable in float64, so the value is in [0, 1)."""
    key = _splitmix64_t(_splitmix64_t(_splitmix64_t(seed) ^ step))
    return _shr(key, 11).to(torch.float64) * 2.0**-53
