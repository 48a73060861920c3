"""Paged KV page allocation: one page table per (request, tag) over one shared pool.

``BlockManager`` owns the bookkeeping only (which page belongs to which sequence, how
many tokens each sequence holds, page refcounts); the tensors live in
``attention.KVPool``. A sequence is keyed by ``(request_id, tag)`` so that the several
KV contexts of one request (BAGEL's ``gen`` / ``cfg_text`` / ``cfg_img``) share one pool
and are freed together.

Invariant that keeps copy-on-write simple: only *full* pages are ever shared. ``fork``
shares the full pages of the source by refcount and gives the destination a private copy
of the partial last page at once, returning the slot copy the engine must perform. An
append therefore only ever writes into a page its sequence owns alone.

Allocation is deterministic: the lowest-numbered free page is handed out first, so a run
is reproducible and tests can pin page numbers.

Content versions: ``version(key)`` names what a sequence holds, so that two contexts known to
hold the same tokens can be told apart from two that merely have the same length. A fork's
destination takes its source's version; an append gives a new one; a truncation back to a
length the sequence had before restores the version it had then (a not-kept query block, as
BAGEL's denoise, appends and truncates every step and leaves the version as it was). The
engine uses it to compute a not-kept query once for contexts that hold the same content
(BAGEL's text-to-image `cfg_img`, a fork of `gen` that neither writes again).
"""

import heapq
from typing import NamedTuple

SeqKey = tuple[str, str]
"""``(request_id, tag)``: one KV context of one request."""


class KVCacheError(Exception):
    """Base class of every error the KV page allocator raises."""


class OutOfPages(KVCacheError):
    """The pool has fewer free pages than an append or fork needs; nothing was changed."""


class UnknownSequence(KVCacheError):
    """A page-table operation named a ``(request_id, tag)`` that holds no pages."""


class SequenceExists(KVCacheError):
    """``fork`` was asked to create a sequence that already exists."""


class SlotCopy(NamedTuple):
    """Slots the engine must copy (all layers, K and V) after a ``fork``: ``src[i] -> dst[i]``."""

    src: range
    dst: range


class BlockManager:
    """Allocates fixed-size KV pages to ``(request_id, tag)`` sequences, with refcounted sharing."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise KVCacheError(f"need num_pages >= 1 and page_size >= 1, got {num_pages=} {page_size=}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        # A min-heap gives "lowest free page first" in O(log n) per page.
        self._free = list(range(num_pages))
        self._tables: dict[SeqKey, list[int]] = {}
        self._lens: dict[SeqKey, int] = {}
        # Insertion-ordered tags per request, so free_request needs no scan of all sequences.
        self._tags: dict[str, dict[str, None]] = {}
        # Per sequence, (length, version) at each append, lengths non-decreasing: the last one is
        # the current version; a truncation pops back to an earlier length (module docstring).
        self._versions: dict[SeqKey, list[tuple[int, int]]] = {}
        self._next_version = 1

    # ----------------------------------------------------------------- queries
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens from an empty sequence."""
        if n_tokens < 0:
            raise KVCacheError(f"n_tokens must be >= 0, got {n_tokens}")
        return -(-n_tokens // self.page_size)

    def __contains__(self, key: SeqKey) -> bool:
        return key in self._tables

    def version(self, key: SeqKey) -> int:
        """The content version of a sequence (0: empty or unknown); equal versions, equal tokens."""
        history = self._versions.get(key)
        return history[-1][1] if history else 0

    def _new_version(self, key: SeqKey, length: int) -> None:
        self._versions.setdefault(key, []).append((length, self._next_version))
        self._next_version += 1

    def seq_len(self, key: SeqKey) -> int:
        return self._lens[self._known(key)]

    def page_table(self, key: SeqKey) -> list[int]:
        """A copy of the sequence's page list, in token order."""
        return list(self._tables[self._known(key)])

    def tags(self, request_id: str) -> list[str]:
        """The tags of ``request_id`` that hold a sequence, in creation order."""
        return list(self._tags.get(request_id, ()))

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def can_append(self, key: SeqKey, n_tokens: int) -> bool:
        return self._growth(key, n_tokens) <= len(self._free)

    def can_fork(self, src_key: SeqKey) -> bool:
        return self._lens[self._known(src_key)] % self.page_size == 0 or len(self._free) >= 1

    # ----------------------------------------------------------------- updates
    def append(self, key: SeqKey, n_tokens: int) -> list[int]:
        """Reserve room for ``n_tokens`` more tokens; returns their slots (``page * page_size + offset``).

        A key not seen before starts an empty sequence. Raises ``OutOfPages`` (and changes
        nothing) when the pool cannot hold them.
        """
        growth = self._growth(key, n_tokens)
        if growth > len(self._free):
            raise OutOfPages(
                f"sequence {key} needs {growth} more page(s) for {n_tokens} token(s); "
                f"{len(self._free)} of {self.num_pages} free"
            )
        if key not in self._tables:
            self._tables[key] = []
            self._lens[key] = 0
            self._tags.setdefault(key[0], {})[key[1]] = None
        table = self._tables[key]
        table.extend(self._take(growth))
        start = self._lens[key]
        self._lens[key] = start + n_tokens
        if n_tokens:
            self._new_version(key, start + n_tokens)
        ps = self.page_size
        return [table[pos // ps] * ps + pos % ps for pos in range(start, start + n_tokens)]

    def add_page(self, key: SeqKey) -> int:
        """One more page at the end of an existing sequence's table, its length unchanged (a
        cohort row about to write the page's first token); returns the page. Raises
        ``OutOfPages`` (changing nothing) when none is free. ``set_length`` then records the
        tokens the row wrote."""
        table = self._tables[self._known(key)]
        if not self._free:
            raise OutOfPages(f"sequence {key} needs 1 more page; 0 of {self.num_pages} free")
        (page,) = self._take(1)
        table.append(page)
        return page

    def set_length(self, key: SeqKey, n_tokens: int) -> None:
        """Record that the sequence holds ``n_tokens`` tokens (written by a cohort through pages
        ``add_page`` gave it): at most what its pages hold. To shrink it, ``truncate`` (which
        returns the pages it no longer needs and unshares a shared last page)."""
        table = self._tables[self._known(key)]
        if not 0 <= n_tokens <= len(table) * self.page_size:
            raise KVCacheError(f"{key} cannot hold {n_tokens} tokens in {len(table)} page(s)")
        if n_tokens != self._lens[key]:
            self._truncate_versions(key, min(n_tokens, self._lens[key]))
            if n_tokens > self._lens[key]:
                self._new_version(key, n_tokens)
        self._lens[key] = n_tokens

    def fork(self, src_key: SeqKey, dst_key: SeqKey) -> SlotCopy | None:
        """Start ``dst_key`` as a copy of ``src_key`` sharing its full pages.

        The partial last page (if any) is copied, not shared, so both sequences can grow
        independently: a fresh page is allocated for ``dst_key`` and the returned
        ``SlotCopy`` names the slots the engine must copy before either sequence is used.
        Returns ``None`` when the source ends on a page boundary (nothing to copy).
        """
        table = self._tables[self._known(src_key)]
        if dst_key in self._tables:
            raise SequenceExists(f"cannot fork {src_key} into {dst_key}: it already exists")
        n = self._lens[src_key]
        partial = n % self.page_size
        if partial and not self._free:
            raise OutOfPages(f"fork {src_key} -> {dst_key} needs 1 page for its partial last page; none free")
        shared = table[: n // self.page_size]
        for page in shared:
            self._refcount[page] += 1
        copy = None
        new_table = list(shared)
        if partial:
            (page,) = self._take(1)
            new_table.append(page)
            src0, dst0 = table[-1] * self.page_size, page * self.page_size
            copy = SlotCopy(range(src0, src0 + partial), range(dst0, dst0 + partial))
        self._tables[dst_key] = new_table
        self._lens[dst_key] = n
        self._versions[dst_key] = list(self._versions.get(src_key, ()))
        self._tags.setdefault(dst_key[0], {})[dst_key[1]] = None
        return copy

    def truncate(self, key: SeqKey, new_len: int) -> SlotCopy | None:
        """Shrink a sequence to its first ``new_len`` tokens, returning pages it no longer needs.

        Used to drop the KV of a wasted speculative step and of queries that attend but are not
        kept (BAGEL's denoise block). If the new last page is partial and shared with a fork,
        it is copied first (the ``SlotCopy`` the engine must apply), so the other sequence's
        tokens on that page are never overwritten by later appends.
        """
        table = self._tables[self._known(key)]
        n = self._lens[key]
        if not 0 <= new_len <= n:
            raise KVCacheError(f"cannot truncate {key} of {n} tokens to {new_len}")
        keep = self.pages_needed(new_len)
        for page in table[keep:]:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                heapq.heappush(self._free, page)
        del table[keep:]
        self._lens[key] = new_len
        self._truncate_versions(key, new_len)
        partial = new_len % self.page_size
        if partial and table and self._refcount[table[-1]] > 1:
            if not self._free:
                raise OutOfPages(f"truncate {key} needs 1 page to unshare its last page; none free")
            (page,) = self._take(1)
            old = table[-1]
            self._refcount[old] -= 1
            table[-1] = page
            src0, dst0 = old * self.page_size, page * self.page_size
            return SlotCopy(range(src0, src0 + partial), range(dst0, dst0 + partial))
        return None

    def free(self, key: SeqKey) -> int:
        """Drop one sequence; returns how many pages went back to the pool (shared ones may not)."""
        table = self._tables.pop(self._known(key))
        del self._lens[key]
        self._versions.pop(key, None)
        tags = self._tags[key[0]]
        del tags[key[1]]
        if not tags:
            del self._tags[key[0]]
        released = 0
        for page in table:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                heapq.heappush(self._free, page)
                released += 1
        return released

    def free_request(self, request_id: str) -> int:
        """Drop every tag of ``request_id``; returns the pages released. Unknown ids are a no-op,
        so cancellation and preemption may call it more than once."""
        return sum(self.free((request_id, tag)) for tag in list(self._tags.get(request_id, ())))

    # ----------------------------------------------------------------- helpers
    def _truncate_versions(self, key: SeqKey, new_len: int) -> None:
        """Versions of lengths above `new_len` are gone; a cut inside an append is new content."""
        history = self._versions.get(key, [])
        while history and history[-1][0] > new_len:
            history.pop()
        if new_len and (not history or history[-1][0] != new_len):
            self._new_version(key, new_len)

    def _known(self, key: SeqKey) -> SeqKey:
        if key not in self._tables:
            raise UnknownSequence(f"no KV sequence for request {key[0]!r} tag {key[1]!r}")
        return key

    def _growth(self, key: SeqKey, n_tokens: int) -> int:
        if n_tokens < 0:
            raise KVCacheError(f"n_tokens must be >= 0, got {n_tokens}")
        have = self._lens.get(key, 0)
        return self.pages_needed(have + n_tokens) - len(self._tables.get(key, ()))

    def _take(self, n: int) -> list[int]:
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for page in pages:
            self._refcount[page] = 1
        return pages
