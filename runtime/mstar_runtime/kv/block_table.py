"""Device block tables for cohort rows, and the decode attention that reads them.

The generic path hands every entry of every step its whole page table as a host list and
builds the attention metadata from those lists (four forms of one table per step). A
cohort keeps its rows' tables as one `[rows, max_pages]` int32 tensor on the device
(`BlockTable.device`), with a host mirror of the same numbers (`BlockTable.host`, numpy);
a table is written only when a row joins, moves or gains a page, never per step. The pages
themselves still come from the conductor's `BlockManager`.

Per step the attention needs, for the n active rows with context lengths `kv_lens`:
- on the CPU, `decode_attention`: one query (or a block of them) per row over its paged context, gathered
  through the device table for all rows at once (no Python per row). It computes the same
  function as `attention.paged_attention` for single-token decodes (tests compare);
- on a GPU, FlashInfer's paged decode, whose plan takes host indptr / indices /
  last_page_len: `BlockTable.flashinfer_arrays` makes them from the host mirror with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from mstar_runtime.kv.attention import AttentionError, KVPool


class BlockTable:
    """Page tables of `rows` cohort rows, `max_pages` pages each, on the device and mirrored on the host."""

    def __init__(self, rows: int, max_pages: int, device: torch.device | str, fill_page: int = 0):
        self.rows, self.max_pages = rows, max_pages
        self.fill_page = fill_page  # what unused entries hold: a page every row may read (never attended)
        self.host = np.full((rows, max_pages), fill_page, dtype=np.int32)
        self.device = torch.full((rows, max_pages), fill_page, dtype=torch.int32, device=device)

    def set_rows(self, first: int, tables: Sequence[Sequence[int]]) -> None:
        """The tables of rows `first`, `first + 1`, ...: checked first (nothing written when one
        is too long), then one upload from pinned memory that does not wait for the device."""
        longest = max((len(pages) for pages in tables), default=0)
        if longest > self.max_pages:
            raise AttentionError(f"a row holds at most {self.max_pages} pages, got {longest}")
        end = first + len(tables)
        block = self.host[first:end]
        block[:] = self.fill_page
        for i, pages in enumerate(tables):
            block[i, : len(pages)] = pages
        self.device[first:end].copy_(pinned(block), non_blocking=True)

    def add_pages(self, rows: np.ndarray, cols: np.ndarray, pages: np.ndarray) -> None:
        """`table[rows[i], cols[i]] = pages[i]` for a few rows at once: one upload from pinned
        memory that does not wait for the device, and one scatter (this runs between steps)."""
        if rows.size == 0:
            return
        if int(cols.max()) >= self.max_pages:
            raise AttentionError(f"a row holds at most {self.max_pages} pages")
        self.host[rows, cols] = pages
        flat = rows.astype(np.int64) * self.max_pages + cols.astype(np.int64)
        up = pinned(np.concatenate([flat, pages.astype(np.int64)])).to(self.device.device, non_blocking=True)
        k = rows.size
        self.device.view(-1).index_copy_(0, up[:k], up[k:].to(torch.int32))

    def move_row(self, src: int, dst: int) -> None:
        self.host[dst] = self.host[src]
        self.device[dst].copy_(self.device[src])

    def flashinfer_arrays(self, kv_lens: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(kv_indptr, kv_indices, kv_last_page_len)` of rows 0..len(kv_lens)-1, as int32 numpy arrays."""
        n = kv_lens.shape[0]
        pages = (kv_lens + page_size - 1) // page_size
        indptr = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        mask = np.arange(self.max_pages)[None, :] < pages[:, None]
        indices = self.host[:n][mask]
        last = (kv_lens - (pages - 1) * page_size).astype(np.int32)
        return indptr, indices, last


def pinned(a: np.ndarray) -> torch.Tensor:
    """A host array in pinned memory (where CUDA is), so that its upload need not wait for the device."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if torch.cuda.is_available() else t


def decode_attention(
    q: torch.Tensor, pool: KVPool, layer: int, table: torch.Tensor, kv_lens: torch.Tensor, max_len: int,
    scale: float | None = None, tokens: int = 1,
) -> torch.Tensor:
    """Queries q `[n * tokens, heads, D]`, `tokens` per row, each over its row's first
    `kv_lens[i]` tokens (a decode with 1; a block that sees its whole context and itself,
    with no causal mask inside it, with more).

    `table` `[n, >= ceil(max_len / page_size)]` holds the rows' pages; `max_len` (a host int,
    the largest of `kv_lens`) sizes the gather. The new tokens' K/V must already be in the
    pool. Half-precision inputs are computed in float32, as `paged_attention` does.
    """
    rows, heads, dim = q.shape
    n = rows // tokens
    kv_heads, ps = pool.kv_heads, pool.page_size
    if heads % kv_heads or dim != pool.head_dim:
        raise AttentionError(f"q has {heads} heads of dim {dim}; pool has {kv_heads} KV heads of dim {pool.head_dim}")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    n_pages = -(-max_len // ps)
    pages = table[:n, :n_pages].long()  # [n, P]
    compute = torch.promote_types(q.dtype, torch.float32)
    k = pool.data[layer, :, 0][pages].reshape(n, n_pages * ps, kv_heads, dim).to(compute)
    v = pool.data[layer, :, 1][pages].reshape(n, n_pages * ps, kv_heads, dim).to(compute)
    group = heads // kv_heads
    qg = q.to(compute).reshape(n, tokens, kv_heads, group, dim)
    scores = torch.einsum("nthgd,nlhd->nthgl", qg, k).mul_(scale)
    valid = torch.arange(n_pages * ps, device=q.device)[None, :] < kv_lens[:, None]  # [n, L]
    scores.masked_fill_(~valid[:, None, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nthgl,nlhd->nthgd", probs, v)
    return out.reshape(rows, heads, dim).to(q.dtype)


__all__ = ["BlockTable", "decode_attention", "pinned"]
