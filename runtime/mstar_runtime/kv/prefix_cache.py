"""Prefix caching: full KV pages keyed by their content, kept after their sequence ends.

A page is named by a *block hash*: a chained hash over the content keys of its tokens and of
every token before it in its sequence (`block_hashes`), so two pages with one hash hold the
K/V of the same tokens at the same positions after the same prefix. A content key is an int
per token, given by the node (`KVNode.prefix_content`): a token id, or for a position that
holds an image's or an audio clip's embedding the hash of those bytes (`media_key`, with bit
62 set so that it never equals a token id).

`PrefixIndex` is what `BlockManager` keeps of them: hash -> page for the pages whose step
has finished (`register`; a page still being written is never found), and, among those, the
pages no sequence holds any more (refcount 0) in least-recently-used order. Those still
count as free: `BlockManager` hands out a never-cached free page first and otherwise evicts
the least recently used cached one (`evict`), so a cached page costs nothing until the pool
runs out. `lookup` finds the longest run of leading blocks that are cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ROOT = b"mstar-prefix-v1"  # the parent of a sequence's first block
MEDIA_BIT = 1 << 62  # set in every media key; token ids are far below it


def block_hashes(parent: bytes, keys: Sequence[int], page_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of `keys` (a partial last block has none): block i's
    is blake2b(block i-1's hash, block i's keys as int64)."""
    out: list[bytes] = []
    if len(keys) < page_size:
        return out
    arr = np.asarray(keys[: len(keys) // page_size * page_size], dtype=np.int64).reshape(-1, page_size)
    for row in arr:
        parent = hashlib.blake2b(parent + row.tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


def token_keys(value: Any) -> list[int] | None:
    """The content keys of a prefill's token ids (a 1-D tensor): the ids themselves; None for
    anything else (a prefill of no such input is not cached)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        return None
    return [int(t) for t in value.tolist()]


def media_key(tensor: torch.Tensor, *extra: int) -> int:
    """The content key of every position that holds rows of `tensor` (an image's or a clip's
    embedding): the hash of its bytes, shape and `extra` ints (a grid, say). One read of the
    tensor to the host."""
    t = tensor.detach().contiguous().reshape(-1)
    data = t.view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    head = np.asarray([*tensor.shape, *extra], dtype=np.int64).tobytes() + str(tensor.dtype).encode()
    digest = hashlib.blake2b(head + data, digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (MEDIA_BIT - 1)) | MEDIA_BIT


class PrefixIndex:
    """Cached pages by block hash, and the unheld ones in least-recently-used order (module docstring)."""

    def __init__(self) -> None:
        self.page_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.unheld: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached pages, oldest first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.hash_of)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of leading `hashes` that are cached."""
        pages = []
        for h in hashes:
            page = self.page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, page: int, h: bytes) -> None:
        """`page` (fully written) holds the block `h`; a hash cached already keeps its page."""
        if h not in self.page_of and page not in self.hash_of:
            self.page_of[h] = page
            self.hash_of[page] = h

    def forget(self, page: int) -> None:
        """`page` is about to be written again: it names no block any more."""
        h = self.hash_of.pop(page, None)
        if h is not None:
            del self.page_of[h]
        self.unheld.pop(page, None)

    def release(self, page: int) -> bool:
        """No sequence holds `page` now: True when it is cached (it waits, most recent, in the
        LRU order), False when it goes back to the plain free pages."""
        if page in self.hash_of:
            self.unheld[page] = None
            return True
        return False

    def evict(self) -> int:
        """Take the least recently used unheld cached page for reuse (it names no block any more)."""
        page, _ = self.unheld.popitem(last=False)
        self.forget(page)
        self.evictions += 1
        return page


__all__ = ["MEDIA_BIT", "ROOT", "PrefixIndex", "block_hashes", "media_key"]
