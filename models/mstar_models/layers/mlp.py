"""Feed-forward blocks: the gated MLP (SwiGLU, or Gemma's GeGLU) with gate and up fused, and the two-layer GELU MLP of ViTs.

`GatedMLP` holds `gate_proj` and `up_proj` as row views of one fused buffer (one GEMM; the
checkpoint's names) and a row-parallel `down_proj`: at tensor parallelism it is built with
this rank's intermediate features, and the output is all-reduced over `group` (None at tp 1).
SiLU(gate) * up is `mstar_runtime.ops.fused.silu_mul` (one kernel on a GPU); with
`activation="gelu_tanh"` it is GELU(gate, tanh approximation) * up, Gemma's GeGLU
(`hidden_activation="gelu_pytorch_tanh"`).

`Mlp` is `fc1`, GELU (exact, or tanh-approximated as SigLIP's `gelu_pytorch_tanh`), `fc2`,
both with bias: the MLP of the timm / SigLIP / Whisper-style encoder blocks (V-JEPA 2's,
BAGEL's SigLIP) and of BAGEL's ViT-to-LLM connector (`out`: fc2's width when not `dim`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.linear import FusedRows, RowParallel
from mstar_runtime.ops import fused

ACTIVATIONS = ("silu", "gelu_tanh")


class GatedMLP(FusedRows):
    """down_proj(act(gate_proj x) * up_proj x), act SiLU or tanh-GELU; `intermediate` is this rank's."""

    def __init__(self, hidden: int, intermediate: int, group: Any = None, *, activation: str = "silu",
                 **factory: Any):
        super().__init__({"gate_proj": intermediate, "up_proj": intermediate}, hidden, **factory)
        self.down_proj = RowParallel(hidden, intermediate, group, **factory)
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown gated-MLP activation {activation!r}; choose {', '.join(ACTIVATIONS)}")
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        if self.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(fused.silu_mul(gate, up))


class Mlp(nn.Module):
    """fc2(gelu(fc1 x)): dim -> hidden -> out (dim unless given); `approximate` is F.gelu's ("none" or "tanh")."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none", out: int | None = None, **factory: Any):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, **factory)
        self.fc2 = nn.Linear(hidden, dim if out is None else out, **factory)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
