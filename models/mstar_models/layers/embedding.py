"""Vocab-parallel token embedding and LM head.

Both hold this rank's rows [start, start + rows) of the vocabulary (all of it at tp 1) under
the checkpoint's `<name>.weight`. The lookup is `mstar_runtime.ops.tp.embed_vocab_parallel`
(each rank looks up the ids in its rows, zeroes the others, an all-reduce adds one row to
zeros: exact). The head's logits are computed in the weights' dtype, as transformers does,
all-gathered over the group, so every rank holds the same full row and samples the same
token, then widened to float32. A tied head reads the embedding's weight (`lm_logits`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_runtime.ops import tp


class VocabEmbedding(nn.Module):
    """`embed_tokens`: rows [start, start + rows) of the table; `group` None at tp 1."""

    def __init__(self, rows: int, hidden: int, start: int = 0, group: Any = None, **factory: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden, **factory), requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [N] -> embeddings [N, hidden] (summed over the group's vocab parts)."""
        return tp.embed_vocab_parallel(ids, self.weight, self.start, self.group)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, group: Any = None, parts: int = 1) -> torch.Tensor:
    """Float32 logits [N, vocab] of hidden [N, hidden] by a head of this rank's vocab rows
    `weight`, gathered over the `parts` ranks of `group` (nothing to gather at tp 1)."""
    return tp.all_gather_last(F.linear(hidden, weight), group, parts).float()


class LMHead(nn.Module):
    """`lm_head` (untied): this rank's vocab rows; forward gives every rank the full float32 logits."""

    def __init__(self, rows: int, hidden: int, group: Any = None, parts: int = 1, **factory: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden, **factory), requires_grad=False)
        self.group, self.parts = group, parts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.weight, self.group, self.parts)
