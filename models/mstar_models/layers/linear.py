"""Linear weights under the checkpoint's names: one weight, several fused into one GEMM, stacked tables, row-parallel.

Every class here holds its parameters under the names a checkpoint stores (`<name>.weight`,
`<name>.bias`), so `mstar_runtime.weights` loads a Hugging Face folder without a rename map:
where several checkpoint tensors are read by one matmul (q/k/v, gate/up), they are row views
of one fused buffer, the assembly happens at load by filling the views in place, and the
names do not change.

Tensor parallelism (nano-vllm's vocabulary; the cuts are `mstar_runtime.ops.tp.MegatronLayout`'s,
and the loader narrows each checkpoint tensor to this rank's part by the plan's shard specs):
- column-parallel: a `FusedRows` or `Weight` built with this rank's output rows; its outputs
  are this rank's features and need no collective;
- row-parallel: `RowParallel`, built with this rank's input columns; its output is a partial
  sum, all-reduced over the node's TP group (a no-op at tp 1, where the group is None).

FP8 weights (`mstar_models.layers.fp8`): `quantize_fp8_()` on a `Weight` or a `FusedRows`
turns its loaded weights into E4M3 values with one float32 scale per output row (buffers
`weight_scale`, `fused{key}_scale`); their forwards then run `fp8.fp8_linear`, and a later
`.to(dtype)` of the module moves those but keeps their dtypes (`fp8.keeping`). The
checkpoint names keep pointing at the weights (now E4M3 views), so a loader can tell which
tensors were quantized. A row-parallel weight's scales are whole on every rank (its rows
are not split), a column-parallel one's are this rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers import fp8
from mstar_runtime.ops import tp


class Weight(nn.Module):
    """A module holding one `weight` parameter (and `bias` when given), forward `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("weight_scale", None, persistent=False)  # [rows, 1] once quantized to FP8

    @staticmethod
    def empty(rows: int, cols: int, bias: bool = False, **factory: Any) -> Weight:
        """A [rows, cols] weight (and [rows] bias) with uninitialised storage."""
        return Weight(torch.empty(rows, cols, **factory), torch.empty(rows, **factory) if bias else None)

    def quantize_fp8_(self) -> None:
        """Replace the weight by its E4M3 values and keep one float32 scale per row (fp8.quantize_rows)."""
        q, scale = fp8.quantize_rows(self.weight.data)
        self.weight.data = q
        self.register_buffer("weight_scale", scale, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Weight:
        # once quantized, a dtype conversion must leave the E4M3 weight and its scales as they are
        if self.weight_scale is not None:
            fn = fp8.keeping(fn, (self.weight, self.weight_scale))
        return super()._apply(fn, recurse)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias): the FP8 GEMM once quantized."""
        if self.weight_scale is not None:
            return fp8.fp8_linear(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class RowParallel(Weight):
    """`o_proj` / `down_proj`: this rank's input columns; the output summed over `group`."""

    def __init__(self, rows: int, cols: int, group: Any = None, **factory: Any):
        super().__init__(torch.empty(rows, cols, **factory))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(self.linear(x, None), self.group)


class FusedRows(nn.Module):
    """Weights one matmul reads together: the children named in `parts` (each the checkpoint's
    `<part>.weight` [rows_i, cols], and `<part>.bias` with `bias`) are row slices of one buffer
    `fused` [sum rows_i, cols] (the biases of `bias`, all parts or the ones named, likewise
    slices of `fused_bias`), so loading fills the buffer and a step runs one GEMM where it
    would run several (q/k/v, gate/up). At decode batch sizes a GEMM is a weight read plus a
    fixed cost, so fewer, larger GEMMs are faster (on an H200 the q/k/v and gate/up GEMMs of a
    3B Llama ran as separate split-K kernels well above the read floor).

    A module may hold several such groups side by side (`fuse(key, ...)`: buffers `fused{key}`
    and `fused{key}_bias`), for checkpoints that keep two sets of projections under one
    module (BAGEL's `q_proj` and `q_proj_moe_gen`); `parts=None` starts with none."""

    def __init__(self, parts: dict[str, int] | None = None, cols: int = 0, bias: bool | Collection[str] = False,
                 **factory: Any):
        super().__init__()
        self._groups: dict[str, list[str]] = {}
        self._sizes: dict[str, list[int]] = {}
        self._biased: dict[str, set[str]] = {}
        if parts is not None:
            self.fuse("", parts, cols, bias, **factory)

    @property
    def sizes(self) -> list[int]:
        """Rows of each part of the default group."""
        return self._sizes[""]

    def fuse(self, key: str, parts: dict[str, int], cols: int, bias: bool | Collection[str] = False,
             **factory: Any) -> None:
        """Add the group `key`: children `parts` as row views of the buffer `fused{key}`. `bias`
        True gives every part a bias; a collection of part names only those (Whisper's k_proj has
        none): the others' slices of the fused bias stay zero, so one GEMM still serves them all."""
        biased = set(parts) if bias is True else set(bias or ())
        if biased - set(parts):
            raise ValueError(f"bias names parts that are not fused here: {sorted(biased - set(parts))}")
        self._groups[key], self._sizes[key], self._biased[key] = list(parts), list(parts.values()), biased
        rows = sum(parts.values())
        self.register_buffer(f"fused{key}", torch.empty(rows, cols, **factory), persistent=False)
        self.register_buffer(f"fused{key}_bias", torch.zeros(rows, **factory) if biased else None, persistent=False)
        for name, (w, b) in zip(parts, self._views(key), strict=True):
            setattr(self, name, Weight(w, b))

    def fused_weight(self, key: str = "") -> torch.Tensor:
        """The [sum rows_i, cols] storage of group `key`."""
        return getattr(self, f"fused{key}")

    def scale_of(self, key: str = "") -> torch.Tensor | None:
        """Group `key`'s float32 scales [sum rows_i, 1] once quantized to FP8, else None."""
        return getattr(self, f"fused{key}_scale", None)

    def quantize_fp8_(self) -> None:
        """Quantize every fused group (one scale per output row, so each part keeps its own
        rows' scales) and every other `Weight` child (o_proj, down_proj) to FP8; the parts'
        weights become E4M3 views of the fused buffer, and the bf16 storage is freed."""
        for key, names in self._groups.items():
            q, scale = fp8.quantize_rows(self.fused_weight(key))
            self.register_buffer(f"fused{key}", q, persistent=False)
            self.register_buffer(f"fused{key}_scale", scale, persistent=False)
            for name in names:  # a part called alone (a cross-attention's k/v) runs the FP8 GEMM too
                getattr(self, name).register_buffer("weight_scale", None, persistent=False)
            self._point_parts(key)
        parts = {name for names in self._groups.values() for name in names}
        for name, child in self.named_children():
            if isinstance(child, Weight) and name not in parts:
                child.quantize_fp8_()

    def _views(self, key: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        ws = self.fused_weight(key).split(self._sizes[key])
        fb = getattr(self, f"fused{key}_bias")
        bs = fb.split(self._sizes[key]) if fb is not None else [None] * len(ws)
        biased = self._biased[key]
        return [(w, b if name in biased else None) for name, w, b in zip(self._groups[key], ws, bs, strict=True)]

    def _point_parts(self, key: str) -> None:
        """Point group `key`'s parts' parameters (and FP8 scales) back at their rows of the fused storage."""
        scale = self.scale_of(key)
        scales = scale.split(self._sizes[key]) if scale is not None else [None] * len(self._groups[key])
        for name, (w, b), sc in zip(self._groups[key], self._views(key), scales, strict=True):
            part = getattr(self, name)
            part.weight.data = w
            if b is not None:
                part.bias.data = b
            if sc is not None:
                part.weight_scale = sc

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedRows:
        # a conversion (.to, .to_empty) gives each parameter storage of its own: point them back;
        # a dtype conversion leaves the quantized groups' E4M3 buffers and scales as they are
        quantized = [t for key in self._groups if (sc := self.scale_of(key)) is not None
                     for t in (self.fused_weight(key), sc)]
        super()._apply(fp8.keeping(fn, quantized) if quantized else fn, recurse)
        for key, names in self._groups.items():
            self._point_parts(key)
            fb = getattr(self, f"fused{key}_bias")
            if fb is not None and len(self._biased[key]) < len(names):
                # .to_empty leaves the bias-less parts' slices undefined: they must add nothing
                with torch.no_grad():
                    for name, b in zip(names, fb.split(self._sizes[key]), strict=True):
                        if name not in self._biased[key]:
                            b.zero_()
        return self

    def project(self, x: torch.Tensor, key: str = "") -> tuple[torch.Tensor, ...]:
        """x [..., cols] -> one output per part of group `key`, from one matmul (FP8 once quantized)."""
        w, b, scale = self.fused_weight(key), getattr(self, f"fused{key}_bias"), self.scale_of(key)
        y = F.linear(x, w, b) if scale is None else fp8.fp8_linear(x, w, scale, b)
        return tuple(y.split(self._sizes[key], dim=-1))


class StackedWeights(nn.ModuleList):
    """`{g}.weight` for g < n, each a view of one [n, rows, cols] buffer `stacked`, so a batch can
    gather every entry's table or head with one index (Qwen3-Omni's code predictor's 15
    embeddings and heads)."""

    def __init__(self, n: int, rows: int, cols: int, **factory: Any):
        stacked = torch.empty(n, rows, cols, **factory)
        super().__init__(Weight(stacked[g]) for g in range(n))
        self.register_buffer("stacked", stacked, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> StackedWeights:
        super()._apply(fn, recurse)
        for g, w in enumerate(self):
            w.weight.data = self.stacked[g]
        return self
