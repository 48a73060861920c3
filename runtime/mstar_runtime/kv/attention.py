"""Paged KV storage and the plain-PyTorch paged attention that defines what GPU kernels compute.

``KVPool`` owns the KV tensor of one node: ``[layers, num_pages, 2, page_size, kv_heads,
head_dim]``. One layer's slice ``pool.data[layer]`` is FlashInfer's combined paged layout
(``[num_pages, 2, page_size, kv_heads, head_dim]``, "NHD"), so the GPU path can hand it to
FlashInfer without a copy. Slots are ``page * page_size + offset``, as ``kv_cache.BlockManager``
hands them out.

``paged_attention`` is the CPU reference over a MIXED batch: prefill chunks of many tokens
and single-token decodes in one call, each sequence with its own mask kind. Every GPU path
must compute the same function (tests compare against it). ``dense_attention`` is an
independent single-sequence reference over unpaged tensors, used by the tests.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

MaskKind = Literal["causal", "full", "block_causal"]
MASK_KINDS: tuple[str, ...] = ("causal", "full", "block_causal")


class AttentionError(ValueError):
    """Inconsistent attention inputs: shapes, lengths, page tables or mask parameters."""


def _as_index(slots: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.long)
    return torch.as_tensor(list(slots), dtype=torch.long, device=device)


class KVPool:
    """The KV tensor of one KV node; written by slot, read by page table."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        # zeros, not empty: a stray read of an unwritten slot then gives finite numbers.
        self.data = torch.zeros(
            (num_layers, num_pages, 2, page_size, kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: Sequence[int] | torch.Tensor
    ) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) of ``n`` new tokens at ``slots``."""
        idx = _as_index(slots, self.device)
        expect = (idx.numel(), self.kv_heads, self.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise AttentionError(
                f"write expects k and v of shape {expect}, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        pages, offsets = idx // self.page_size, idx % self.page_size
        self.data[layer, pages, 0, offsets] = k.to(self.dtype)
        self.data[layer, pages, 1, offsets] = v.to(self.dtype)

    def copy_slots(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy K and V of every layer from ``src[i]`` to ``dst[i]`` (the copy-on-write of a fork)."""
        s, d = _as_index(src, self.device), _as_index(dst, self.device)
        if s.numel() != d.numel():
            raise AttentionError(
                f"copy_slots needs as many sources as destinations, got {s.numel()} and {d.numel()}"
            )
        ps = self.page_size
        # The right-hand gather materialises a copy first, so overlapping slots cannot alias.
        self.data[:, d // ps, :, d % ps] = self.data[:, s // ps, :, s % ps]

    def gather(
        self, layer: int, page_table: Sequence[int] | torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence's first ``kv_len`` tokens, each ``[kv_len, kv_heads, head_dim]``."""
        n_pages = -(-kv_len // self.page_size)
        pages = _as_index(page_table, self.device)
        if pages.numel() < n_pages:
            raise AttentionError(f"page table has {pages.numel()} page(s), {kv_len} tokens need {n_pages}")
        # One index_select each for K and V: the gather yields [n_pages, page_size, H, D]
        # contiguous, so flattening the pages into token order is free.
        pages = pages[:n_pages]
        k = self.data[layer, :, 0].index_select(0, pages).view(-1, self.kv_heads, self.head_dim)
        v = self.data[layer, :, 1].index_select(0, pages).view(-1, self.kv_heads, self.head_dim)
        return k[:kv_len], v[:kv_len]

    def gather_rows(self, layer: int, pages: torch.Tensor, rows: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` sequences of ``kv_len`` tokens each, in one index_select each:
        `pages` is [rows * ceil(kv_len / page_size)] on the device, each row's pages in order;
        each result is ``[rows, kv_len, kv_heads, head_dim]``."""
        n_pages = -(-kv_len // self.page_size)
        if pages.numel() != rows * n_pages:
            raise AttentionError(f"{pages.numel()} page(s) for {rows} rows of {kv_len} tokens ({n_pages} pages each)")
        shape = (rows, n_pages * self.page_size, self.kv_heads, self.head_dim)
        k = self.data[layer, :, 0].index_select(0, pages).view(shape)
        v = self.data[layer, :, 1].index_select(0, pages).view(shape)
        return k[:, :kv_len], v[:, :kv_len]


@dataclass(frozen=True, slots=True)
class SequenceAttention:
    """One sequence of a batch: ``q_len`` new query tokens whose K/V are already in the pool,
    ``kv_len`` tokens in the context after this step (so the queries sit at absolute positions
    ``kv_len - q_len .. kv_len - 1``)."""

    q_len: int
    kv_len: int
    page_table: tuple[int, ...]
    mask: MaskKind = "causal"
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.q_len <= self.kv_len:
            raise AttentionError(f"need 1 <= q_len <= kv_len, got q_len={self.q_len} kv_len={self.kv_len}")
        if self.mask not in MASK_KINDS:
            raise AttentionError(f"unknown mask kind {self.mask!r}; supported: {', '.join(MASK_KINDS)}")
        if (self.mask == "block_causal") != (self.block_size is not None):
            raise AttentionError("block_size is required for mask 'block_causal' and only for it")
        if self.block_size is not None and self.block_size < 1:
            raise AttentionError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """A mixed prefill/decode batch; queries are packed in ``seqs`` order."""

    seqs: tuple[SequenceAttention, ...]

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        masks: Sequence[MaskKind] | MaskKind = "causal",
        block_sizes: Sequence[int | None] | None = None,
    ) -> "AttentionMetadata":
        n = len(q_lens)
        if not len(kv_lens) == len(page_tables) == n:
            raise AttentionError("q_lens, kv_lens and page_tables must have one entry per sequence")
        kinds = [masks] * n if isinstance(masks, str) else list(masks)
        blocks = list(block_sizes) if block_sizes is not None else [None] * n
        if len(kinds) != n or len(blocks) != n:
            raise AttentionError("masks and block_sizes must have one entry per sequence")
        return cls(
            tuple(
                SequenceAttention(q, kv, tuple(pt), m, b)
                for q, kv, pt, m, b in zip(q_lens, kv_lens, page_tables, kinds, blocks, strict=True)
            )
        )

    @property
    def num_tokens(self) -> int:
        return sum(s.q_len for s in self.seqs)

    def q_indptr(self) -> list[int]:
        """Offsets of each sequence's queries in the packed batch (FlashInfer's ``qo_indptr``)."""
        out = [0]
        for s in self.seqs:
            out.append(out[-1] + s.q_len)
        return out

    def paged_kv_arrays(self, page_size: int) -> tuple[list[int], list[int], list[int]]:
        """``(kv_indptr, kv_indices, kv_last_page_len)`` in FlashInfer's paged-KV convention."""
        indptr, indices, last = [0], [], []
        for s in self.seqs:
            n_pages = -(-s.kv_len // page_size)
            indices.extend(s.page_table[:n_pages])
            indptr.append(len(indices))
            last.append(s.kv_len - (n_pages - 1) * page_size)
        return indptr, indices, last


def attention_mask(
    q_len: int,
    kv_len: int,
    kind: MaskKind = "causal",
    block_size: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Boolean ``[q_len, kv_len]`` mask (True = may attend) or ``None`` for "full".

    Queries sit at absolute positions ``kv_len - q_len + i`` (bottom-right aligned), so a
    decode token sees the whole context and a prefill chunk continues an existing one.
    """
    if kind == "full":
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    if kind == "causal":
        return k_pos <= q_pos
    if kind == "block_causal":
        if block_size is None or block_size < 1:
            raise AttentionError("mask 'block_causal' needs block_size >= 1")
        # V-JEPA's frame-causal mask: a token sees every token of its own and earlier frames.
        return (k_pos // block_size) <= (q_pos // block_size)
    raise AttentionError(f"unknown mask kind {kind!r}; supported: {', '.join(MASK_KINDS)}")


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of one sequence: q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]``."""
    lq, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # Head h reads KV head h // group (repeat_interleave order), without materialising repeats.
    qg = q.reshape(lq, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * lq, dim)
    scores = torch.matmul(qg, k.permute(1, 2, 0)).mul_(scale)  # [Hkv, G*Lq, Lk]
    if mask is not None:
        scores = (
            scores.view(kv_heads, group, lq, -1)
            .masked_fill_(~mask, float("-inf"))
            .view(kv_heads, group * lq, -1)
        )
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(1, 0, 2))  # [Hkv, G*Lq, D]
    return out.view(kv_heads, group, lq, dim).permute(2, 0, 1, 3).reshape(lq, heads, dim)


def paged_attention(
    q: torch.Tensor, pool: KVPool, layer: int, meta: AttentionMetadata, scale: float | None = None
) -> torch.Tensor:
    """Attention of packed queries ``[sum q_len, heads, head_dim]`` over their paged contexts.

    The K/V of the queries themselves must already be written to the pool. Returns the
    same layout and dtype as ``q``. Half-precision inputs are computed in float32.
    """
    if q.dim() != 3 or q.shape[0] != meta.num_tokens:
        raise AttentionError(f"q must be [{meta.num_tokens}, heads, head_dim], got {tuple(q.shape)}")
    heads, dim = q.shape[1], q.shape[2]
    if dim != pool.head_dim or heads % pool.kv_heads:
        raise AttentionError(
            f"q has {heads} heads of dim {dim}; pool has {pool.kv_heads} KV heads of dim {pool.head_dim}"
        )
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    start = 0
    for s in meta.seqs:
        k, v = pool.gather(layer, s.page_table, s.kv_len)
        mask = attention_mask(s.q_len, s.kv_len, s.mask, s.block_size, device=q.device)
        qs = q[start : start + s.q_len].to(compute)
        out[start : start + s.q_len] = _attend(qs, k.to(compute), v.to(compute), mask, scale).to(q.dtype)
        start += s.q_len
    return out


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskKind = "causal",
    block_size: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference attention of one sequence over unpaged K/V (tests only).

    q ``[q_len, heads, D]``, k/v ``[kv_len, kv_heads, D]``; built on
    ``scaled_dot_product_attention`` with explicitly repeated KV heads, so it shares no
    arithmetic with ``paged_attention``.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise AttentionError(f"{heads} query heads is not a multiple of {kv_heads} KV heads")
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    m = attention_mask(q.shape[0], k.shape[0], mask, block_size, device=q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=m, scale=scale
    )
    return out.transpose(0, 1)
