"""Fused elementwise ops for the hot path of model code: RMSNorm, residual + RMSNorm, RoPE, SwiGLU.

A decode step of a 3B Llama at batch 16 is ~1,100 kernels, most of them elementwise ops on a
[16, 3072] tensor that take 2-3 us each however small they are (the profile in BENCHMARKS.md:
about a third of the step). Each function here is the exact eager math of the reference
implementation (Hugging Face's Llama: float32 normalisation cast back before the scale, RoPE
in the activation dtype) and, on a CUDA tensor, runs as one `torch.compile`d kernel instead
of five to ten. Inductor is asked to round every intermediate as eager does
(`emulate_precision_casts`), so fused and eager results agree bit for bit in the common case
and within an ulp of bf16 otherwise.

Compilation happens on first use per shape class (a fixed batch bucket, then one dynamic
compile for the other sizes), which the CUDA-graph runner's warm-up does before capture.
On the CPU, or when compilation is unavailable or fails (no Triton, no C compiler, or
`MSTAR_FUSED=0` in the environment), the eager math runs: same results, more kernels; a
failure is logged once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------- the eager math
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add and the next norm in one pass."""
    h = h + delta
    return h, rms_norm_ref(h, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [N, H, D] and k [N, Hkv, D] with cos/sin [N, 1, D] (HF's rotate_half form)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# ------------------------------------------------------------------------- dispatch
class _Fused:
    """`fn` compiled for CUDA tensors, eager elsewhere; eager for good after a failed compile."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = fn.__name__.removesuffix("_ref")
        self.__doc__ = fn.__doc__
        self._compiled: Callable[..., Any] | None = None
        self._broken = os.environ.get("MSTAR_FUSED", "1") == "0"

    @staticmethod
    def wants_compile(t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def __call__(self, first: torch.Tensor, *args: Any) -> Any:
        if self._broken or not self.wants_compile(first):
            return self.fn(first, *args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, options={"emulate_precision_casts": True})
        try:
            return self._compiled(first, *args)
        except Exception as e:  # a missing toolchain on this machine: the eager math is still right
            if torch.cuda.is_current_stream_capturing():
                raise  # never fall back in the middle of a capture: the graph would be half built
            log.warning("torch.compile of %s failed (%s: %s); using the eager ops", self.__name__,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self._broken = True
            return self.fn(first, *args)


def fuse(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (pure tensor code, its first argument a tensor) run as the ops above are: one
    `torch.compile`d kernel on a CUDA tensor, the eager math elsewhere or when compiling fails;
    for model code's own elementwise chains (`mstar_models.layers.fp8`'s activation quantization)."""
    return _Fused(fn)


rms_norm = _Fused(rms_norm_ref)
add_rms_norm = _Fused(add_rms_norm_ref)
rope = _Fused(rope_ref)
silu_mul = _Fused(silu_mul_ref)
