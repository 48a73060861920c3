"""FP8 (E4M3) weights: per-output-channel quantization at load, and the GEMM that reads them.

A weight W [out, in] is stored as `q = round_e4m3(W / s)` with one float32 scale per output
row, `s = amax(|W[row]|) / 448` (448 is E4M3's largest finite value), so every row uses the
format's whole range and W ~= q * s[:, None]. The checkpoint keeps its bf16 tensors and names:
quantizing is a transform the loader applies after filling the weights
(`mstar_runtime.weights.load_weights`, when the plan's node has `quantized`).

Activations are quantized dynamically *per token* (one scale per row of x, from that row's
amax), not per tensor: a per-tensor scale is the amax of the whole batch, so one request's
outlier would coarsen every other request's rounding and a request's outputs would depend on
its batchmates; per token, each row's math is its own (as `sampling` keeps each request's
draws its own), and an outlier costs only its own row. With both scales per row / per
column the product is `y[m, n] = xs[m] * s[n] * sum_k xq[m, k] q[n, k]`, which is what
`torch._scaled_mm`'s row-wise scaling computes on Hopper (float32 accumulation, bf16 out).

Where that GEMM does not run (the CPU, a float32 model, a GPU without FP8 tensor cores), the
same quantized operands are dequantized and multiplied in float32: the same math up to the
GEMM's accumulation order, so CPU tests measure the format's error, not an imitation of it.

On a GPU the activations' quantization (row amax, scale, scaled cast: five eager kernels) runs
as one compiled kernel (`mstar_runtime.ops.fused.fuse`, as the norms do; compiled in the
CUDA-graph runner's warm-up): at batch 1 a step has 112 of these GEMMs, and five 2-3 us
kernels each would cost more than FP8 saves on the weight reads.

A module conversion after quantizing (`.to(dtype)`, `.half()`, `.float()`) must not reach the
FP8 weights or their scales: E4M3 values cast to bf16 are no longer what the FP8 GEMM reads,
and float32 scales cast to bf16 or fp16 lose digits (small ones underflow in fp16), so every
output row would be off. `keeping(fn, tensors)` is the conversion the quantized modules apply
(`Weight._apply`, `FusedRows._apply` in layers/linear.py): those tensors move to the
conversion's device and keep their dtype; everything else converts as asked.

`torch._scaled_mm` needs its second operand column-major (q is [out, in] row-major, so q.t()
is) and `in` and `out` multiples of 16 (every Llama projection is); other shapes take the
dequantized path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from mstar_runtime.ops import fused

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# added to every scale: an all-zero row quantizes to zeros (not 0 / 0), and |x / s| stays <= 448
_TINY = 1e-12
_SCALED_MM_ALIGN = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] -> (E4M3 values [..., k], float32 scales [..., 1]) with x ~= values * scales,
    one scale per row (the amax of its row over 448). Five kernels when run eagerly (the row
    amax, an inf-norm; the scale's multiply and add; the divide and the cast); on a GPU
    `quantize_activations` runs it as one compiled kernel."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.mul(1.0 / FP8_MAX).add_(_TINY)
    return torch.div(x, scale).to(FP8), scale


# the activations' per-token quantization: one kernel on a GPU, the same eager math elsewhere
quantize_activations = fused.fuse(quantize_rows)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_rows`: values [..., k] * scales [..., 1], in `dtype`."""
    return (q.to(torch.float32) * scale).to(dtype)


def _scaled_mm_fits(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` takes these operands: bf16 activations on a GPU with FP8
    tensor cores (compute capability 8.9 or later), k and n multiples of 16."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if q.shape[0] % _SCALED_MM_ALIGN or q.shape[1] % _SCALED_MM_ALIGN:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] (bf16 or float32) by the E4M3 weight q [n, k] with its scales [n, 1] -> [..., n]
    in x's dtype: x quantized per token, then one FP8 GEMM (`torch._scaled_mm`) or, where that
    does not run, the same operands dequantized and multiplied in float32."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], q.shape[0])
    xq, xs = quantize_activations(rows)
    if _scaled_mm_fits(x, q):
        # q.t() is [k, n] column-major, as _scaled_mm wants its second operand; row-wise scales
        # are [m, 1] and [1, n] float32
        # row-major xq (a compiled kernel keeps its input's strides: a strided x would give a strided xq)
        out = torch._scaled_mm(xq.contiguous(), q.t(), scale_a=xs.contiguous(), scale_b=scale.t(),
                               out_dtype=torch.bfloat16)
    else:
        out = (dequantize_rows(xq, xs) @ dequantize_rows(q, scale).t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], q.shape[0])


def keeping(fn: Callable[[torch.Tensor], torch.Tensor], kept: Collection[torch.Tensor]
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` (a `Module._apply` conversion) for every tensor but those of `kept` (FP8 weights and
    their scales): where `fn` would change one's dtype, it moves to `fn`'s device and keeps its
    dtype (module docstring); a conversion that keeps the dtype (a device move, `to_empty`,
    `share_memory_`) applies as it is."""
    ids = {id(t) for t in kept}

    def apply(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in ids:
            return fn(t)
        probe = fn(t.new_empty(0))  # what fn does to this dtype, without converting the tensor
        return fn(t) if probe.dtype == t.dtype else t.to(probe.device)

    return apply
