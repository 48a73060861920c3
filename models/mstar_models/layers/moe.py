"""The sparse MoE block: top-k router, SwiGLU experts as grouped GEMMs, an optional gated shared expert.

Qwen3-Omni's thinker and talker use it (the talker with the shared expert). Parameters carry
the checkpoint's names (`mlp.gate.weight` [E, H] is the router, `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` per expert,
`mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight` [1, H] in
the talker), so `mstar_runtime.weights` loads the per-expert tensors as stored. Every
per-expert parameter is a view into one of two fused buffers, `gate_up` [E, 2I, H] (gate rows,
then up rows, as transformers >= 5 fuses them) and `down` [E, H, I]: loading fills them in
place, and a step reads each expert's weights from one tensor.

Routing (transformers 5.24 `Qwen3OmniMoe*TextTopKRouter`): router logits in the activation
dtype, softmax in float32, top-k, renormalised over the k when `norm_topk_prob` (true in the
released thinker and talker configs), cast back to the logits' dtype.

Experts (`grouped_experts`): the step's (token, expert) pairs are sorted by expert, the rows
gathered once, and each projection runs as one grouped GEMM over the sorted rows with
per-expert offsets (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`); the rows go
back to their (token, slot) places and a weighted sum over the k slots gives each token's
output (a reduction: an index_add with repeated indices adds in a varying order on CUDA).
Nothing reads a device value, so a step can be captured in a CUDA graph and replays its eager
result bit for bit. Where the grouped kernel is missing or refuses the dtype,
`padded_experts` runs the active experts as one batched matmul over groups
padded to the largest one (it reads the group sizes on the host). `loop_experts` is the
simple per-expert loop in transformers' order: the test reference, never a serving path.
docs/moe.md has the measured speeds.

Tensor parallelism (`group`, the thinker's): every expert's intermediate features are cut, so
each rank's output is a partial sum, all-reduced over the group (None at tp 1: no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.linear import Weight
from mstar_models.layers.mlp import GatedMLP
from mstar_runtime.ops import tp

GroupedMM = Callable[..., torch.Tensor]


def _grouped_mm_fn() -> GroupedMM | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn  # type: ignore[no-any-return]


_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM kernel runs for (device type, dtype) here: tried once on a tiny
    problem (an exception or a wrong answer means no) and remembered, so a step never probes."""
    dev = torch.device(device)
    key = (dev.type, dtype)
    if key not in _SUPPORT:
        fn = _grouped_mm_fn()
        ok = False
        if fn is not None:
            try:
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(6, 16, generator=gen).to(dev, dtype)
                w = torch.randn(3, 16, 8, generator=gen).to(dev, dtype)
                offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=dev)
                out = fn(x, w, offs=offs).float()
                ref = torch.cat([x[:2].float() @ w[0].float(), x[2:].float() @ w[2].float()])
                ok = bool(torch.allclose(out, ref, rtol=2e-2, atol=2e-2))
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                ok = False
        _SUPPORT[key] = ok
    return _SUPPORT[key]


# ------------------------------------------------------------------------------- routing
def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in x's dtype, expert ids [N, k] int64) of tokens x [N, H]; router [E, H]."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


# ------------------------------------------------------------------------------- experts
def grouped_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for every token, by grouped GEMMs.

    x [N, H]; ids, weights [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H] in x's dtype."""
    fn = _grouped_mm_fn()
    assert fn is not None, "grouped_experts needs torch's grouped_mm (check grouped_mm_supported first)"
    k = ids.shape[1]
    experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs of one expert together, in token order
    tokens = order // k
    rows = x.index_select(0, tokens)
    # per-expert pair counts without a host read (bincount would size its output on the host)
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    # out = rows @ W^T per group: the [E, K, N] view of W is column-major, as the kernels want it
    gu = fn(rows, gate_up.transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    y = fn(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    return _combine(y, order, weights, x.dtype)


def _combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs of the sorted pairs y [N * k, H] -> [N, H]: each pair's row back in its
    (token, slot) place, scaled by its routing weight, summed over the k slots. A reduction, not
    an index_add: CUDA's index_add with repeated indices adds in a varying order (atomics), so a
    step would not repeat itself bit for bit, nor a graph replay its eager run."""
    n, k = weights.shape
    rows = torch.empty_like(y).index_copy_(0, order, y)  # unique indices: deterministic
    return (rows.view(n, k, -1) * weights[:, :, None]).sum(dim=1).to(dtype)


def padded_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
) -> torch.Tensor:
    """`grouped_experts` without the grouped kernel: the active experts' rows padded to the
    largest group and run as batched matmuls. Reads the group sizes on the host (one sync)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat.index_select(0, order)
    tokens = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    active = torch.nonzero(counts).reshape(-1)  # host sync: the padded shapes depend on it
    sizes = counts.index_select(0, active)
    cap = int(sizes.max())
    # slot of each sorted pair: its active-expert index and its rank inside the group
    group = torch.searchsorted(active, sorted_ids)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.arange(flat.numel(), device=x.device) - starts.index_select(0, group)
    buf = x.new_zeros(active.numel(), cap, x.shape[1])
    buf[group, rank] = x.index_select(0, tokens)
    gu = torch.bmm(buf, gate_up.index_select(0, active).transpose(1, 2))
    gate, up = gu.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down.index_select(0, active).transpose(1, 2))[group, rank]
    return _combine(y, order, weights, x.dtype)


def loop_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
) -> torch.Tensor:
    """The test reference: one Python iteration per expert hit, in expert order (transformers'
    eager `Qwen3OmniMoe*TextExperts.forward`). Never used to serve."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


# ------------------------------------------------------------------------------- modules
class Expert(nn.Module):
    """`experts.{e}`: views of expert e's rows of the fused buffers."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj = Weight(gate)
        self.up_proj = Weight(up)
        self.down_proj = Weight(down)


class SparseMoE(nn.Module):
    """`mlp` of one MoE layer: router `gate`, `experts.{e}`, and (talker) the gated `shared_expert`.

    `kernel`: "auto" (grouped GEMMs where the kernel runs, else padded batched matmuls),
    "grouped", "padded" or "loop" (the reference)."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        intermediate: int,
        top_k: int,
        normalize: bool,
        shared_intermediate: int | None = None,
        *,
        kernel: str = "auto",
        group: Any = None,
        **factory: Any,
    ):
        super().__init__()
        if not 0 < top_k <= experts:
            raise ValueError(f"top_k ({top_k}) must be in [1, experts ({experts})]")
        self.top_k, self.normalize, self.intermediate = top_k, normalize, intermediate
        self.group = group
        self.gate = Weight(torch.empty(experts, hidden, **factory))
        self.register_buffer("gate_up", torch.empty(experts, 2 * intermediate, hidden, **factory), persistent=False)
        self.register_buffer("down", torch.empty(experts, hidden, intermediate, **factory), persistent=False)
        self.experts = nn.ModuleList(
            Expert(self.gate_up[e, :intermediate], self.gate_up[e, intermediate:], self.down[e]) for e in range(experts)
        )
        if shared_intermediate is not None:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, **factory)
            self.shared_expert_gate = Weight(torch.empty(1, hidden, **factory))
        self.set_kernel(kernel)

    def set_kernel(self, kernel: str) -> None:
        if kernel == "auto":
            kernel = "grouped" if grouped_mm_supported(self.gate_up.device, self.gate_up.dtype) else "padded"
        table = {"grouped": grouped_experts, "padded": padded_experts, "loop": loop_experts}
        if kernel not in table:
            raise ValueError(f"unknown MoE kernel {kernel!r}; choose auto, {', '.join(table)}")
        self.kernel = kernel
        self._experts_fn = table[kernel]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> SparseMoE:
        # `.to()`, `.to_empty()` etc. convert buffers and parameters one by one, which would give
        # every expert parameter storage of its own: point them back into the converted buffers
        # (the values agree: both came from the same storage through the same conversion).
        super()._apply(fn, recurse)
        i = self.intermediate
        for e, expert in enumerate(self.experts):
            expert.gate_proj.weight.data = self.gate_up[e, :i]
            expert.up_proj.weight.data = self.gate_up[e, i:]
            expert.down_proj.weight.data = self.down[e]
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.gate.weight, self.top_k, self.normalize)
        out = self._experts_fn(x, ids, weights, self.gate_up, self.down)
        if hasattr(self, "shared_expert"):
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(x)
        return tp.all_reduce(out, self.group)
