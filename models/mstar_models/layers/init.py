"""Deterministic weights for a node's `init` weights source, the same at any tensor-parallel degree.

`seeded_init_` fills every parameter from a generator seeded by the node's name (one per
device): N(0, 0.02) matrices (transformers' `initializer_range` default), unit norm gains,
zero biases and gates. `dummy` weights and checkpoints overwrite them. Fused and stacked
parameters are views of one buffer, so filling them fills the buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Split = Callable[[str], tuple[int, int, int] | None]


def name_seed(name: str) -> int:
    """A seed from a node name that does not depend on PYTHONHASHSEED."""
    return sum(ord(c) * 31**i for i, c in enumerate(name)) % (2**31)


def seeded_init_(module: nn.Module, name: str, split: Split | None = None) -> None:
    """Fill `module`'s parameters in `named_parameters` order (see the module docstring).

    `split(parameter name)` -> (dim, parts, part) for a tensor-parallel shard (None: whole,
    e.g. `tp.MegatronLayout.split_of`): the full matrix is drawn, in the same order, and this
    rank keeps its part, so tp N holds the values of tp 1."""
    seed = name_seed(name)
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for pname, p in module.named_parameters():
            if p.device.type == "meta":  # shapes only (a size check): nothing to fill
                continue
            if p.dim() < 2:
                p.fill_(1.0 if "norm" in pname and not pname.endswith("bias") else 0.0)
                continue
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            cut = split(pname) if split is not None else None
            if cut is None:
                p.normal_(0.0, 0.02, generator=gen)
                continue
            dim, parts, part = cut
            full = list(p.shape)
            full[dim] *= parts
            values = torch.empty(full, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=gen)
            p.copy_(values.narrow(dim, part * p.shape[dim], p.shape[dim]))
