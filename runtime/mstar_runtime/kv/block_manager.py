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

Prefix caching (`prefix_caching=True`; kv/prefix_cache.py): an append may carry the content
keys of its tokens (`append(..., content=keys)`). While every token of a sequence has a known
key, each of its full pages gets a chained block hash; `commit` (called once the step that
wrote them has finished) makes them findable. `append_cached` first looks the new tokens'
full blocks up, from a page boundary of a sequence whose tokens are all known, and shares the
cached pages it finds (refcount, as a fork does; with `align`, only as many as end the sequence
at a multiple of it: the prefix chunk) instead of new ones; only the rest is reserved. A page no sequence holds stays cached, counted free, until a new page is needed
and no never-cached page is left: then the least recently used one is evicted. A truncation
that cuts into a cached page this sequence alone holds makes it uncached (it is about to be
written again); a shared one is copied first, as always, and stays cached. Appends without
content (a decode's sampled tokens, a not-kept query) end the known run of the sequence's
keys until a truncation takes it back there. With `prefix_caching=False` content is ignored
and nothing is hashed.
"""

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from mstar_runtime.kv.prefix_cache import ROOT, PrefixIndex, block_hashes

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

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False) -> None:
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
        # prefix caching: per sequence the content keys of its first tokens (all of them while
        # the sequence's content is known), the hashes of the full blocks they cover, and how
        # many of those hashes `commit` has offered to the index
        self.prefix: PrefixIndex | None = PrefixIndex() if prefix_caching else None
        self._keys: dict[SeqKey, list[int]] = {}
        self._hashes: dict[SeqKey, list[bytes]] = {}
        self._committed: dict[SeqKey, int] = {}
        self.query_tokens = 0  # tokens of appends that looked the cache up
        self.hit_tokens = 0  # of those, tokens found cached (not computed)

    # ----------------------------------------------------------------- queries
    @property
    def free_pages(self) -> int:
        """Pages an append may take: never-cached free ones and cached ones no sequence holds."""
        return len(self._free) + (len(self.prefix.unheld) if self.prefix is not None else 0)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        """Pages that name a cached block (held by a sequence or not)."""
        return len(self.prefix) if self.prefix is not None else 0

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
        return self._growth(key, n_tokens) <= self.free_pages

    def can_fork(self, src_key: SeqKey) -> bool:
        return self._lens[self._known(src_key)] % self.page_size == 0 or self.free_pages >= 1

    # ----------------------------------------------------------------- updates
    def append(self, key: SeqKey, n_tokens: int, content: Sequence[int] | None = None) -> list[int]:
        """Reserve room for ``n_tokens`` more tokens; returns their slots (``page * page_size + offset``).

        A key not seen before starts an empty sequence. ``content``: the tokens' content keys
        (prefix caching, module docstring). Raises ``OutOfPages`` (and changes nothing) when
        the pool cannot hold them.
        """
        growth = self._growth(key, n_tokens)
        if growth > self.free_pages:
            raise OutOfPages(
                f"sequence {key} needs {growth} more page(s) for {n_tokens} token(s); "
                f"{self.free_pages} of {self.num_pages} free"
            )
        if content is not None and len(content) != n_tokens:
            raise KVCacheError(f"sequence {key}: {len(content)} content keys for {n_tokens} token(s)")
        self._start(key)
        table = self._tables[key]
        table.extend(self._take(growth))
        start = self._lens[key]
        self._lens[key] = start + n_tokens
        if n_tokens:
            self._new_version(key, start + n_tokens)
            self._extend_keys(key, start, content)
        ps = self.page_size
        return [table[pos // ps] * ps + pos % ps for pos in range(start, start + n_tokens)]

    def append_cached(self, key: SeqKey, content: Sequence[int], max_cached: int,
                      n_tokens: int | None = None, align: int = 0) -> tuple[int, list[int]]:
        """``append`` of ``n_tokens`` tokens (default ``len(content)``; ``content`` keys the
        leading ones, the others have none) that first shares the cached pages of their leading
        full blocks (at most ``max_cached`` tokens of them; module docstring). ``align`` (a
        multiple of the page size, 0: none): the cached run is cut back so that the context
        then ends at a multiple of it (the prefix chunk, docs/runtime.md "Prefix caching").
        Returns the tokens found cached and the slots of the others. Raises ``OutOfPages`` (and
        changes nothing) when the pool cannot hold the rest."""
        n, ps, prefix = len(content) if n_tokens is None else n_tokens, self.page_size, self.prefix
        if not 0 <= len(content) <= n:
            raise KVCacheError(f"sequence {key}: {len(content)} content keys for {n} token(s)")
        max_cached = min(max_cached, len(content))
        have = self._lens.get(key, 0)
        hashes: list[bytes] = []
        pages: list[int] = []
        if prefix is not None and have % ps == 0 and len(self._keys.get(key, ())) == have:
            mine = self._hashes.get(key, [])
            hashes = block_hashes(mine[-1] if mine else ROOT, content[: min(n, max_cached) // ps * ps], ps)
            pages = prefix.lookup(hashes)
            if align and pages:  # end the cached run at a chunk boundary (absolute positions)
                pages = pages[: max(0, (have + len(pages) * ps) // align * align - have) // ps]
        cached = len(pages) * ps
        growth = self.pages_needed(have + n) - len(self._tables.get(key, ())) - len(pages)
        free = self.free_pages - sum(1 for p in pages if self._refcount[p] == 0)
        if growth > free:
            raise OutOfPages(f"sequence {key} needs {growth} more page(s) for {n - cached} token(s) after "
                             f"{cached} cached; {free} of {self.num_pages} free")
        if prefix is not None:
            self.query_tokens += n
            self.hit_tokens += cached
        if pages:
            self._start(key)
            for p in pages:
                if self._refcount[p] == 0:
                    assert prefix is not None
                    prefix.unheld.pop(p, None)
                self._refcount[p] += 1
            self._tables[key].extend(pages)
            self._lens[key] = have + cached
            self._new_version(key, have + cached)
            committed = self._committed.get(key, 0) == len(self._hashes.get(key, ()))
            self._keys.setdefault(key, []).extend(content[:cached])
            self._hashes.setdefault(key, []).extend(hashes[: len(pages)])
            if committed:  # these are in the index already
                self._committed[key] = len(self._hashes[key])
        slots = self.append(key, len(content) - cached, content[cached:])
        if n > len(content):  # the tokens without keys end the sequence's known run
            slots += self.append(key, n - len(content))
        return cached, slots

    def commit(self, key: SeqKey) -> None:
        """The step that wrote the sequence's tokens finished: its hashed full pages become
        findable by ``append_cached`` (a no-op without prefix caching or for an unknown key)."""
        if self.prefix is None or key not in self._tables:
            return
        hashes, table = self._hashes.get(key, []), self._tables[key]
        for i in range(self._committed.get(key, 0), len(hashes)):
            self.prefix.register(table[i], hashes[i])
        self._committed[key] = len(hashes)

    def add_page(self, key: SeqKey) -> int:
        """One more page at the end of an existing sequence's table, its length unchanged (a
        cohort row about to write the page's first token); returns the page. Raises
        ``OutOfPages`` (changing nothing) when none is free. ``set_length`` then records the
        tokens the row wrote."""
        table = self._tables[self._known(key)]
        if not self.free_pages:
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
            else:
                self._cut_keys(key, n_tokens)
                if n_tokens % self.page_size and self.prefix is not None:
                    self.prefix.forget(table[n_tokens // self.page_size])  # to be written again
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
        if partial and not self.free_pages:
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
        if src_key in self._keys:  # the shared pages are the source's to commit
            self._keys[dst_key] = list(self._keys[src_key])
            self._hashes[dst_key] = list(self._hashes[src_key])
            self._committed[dst_key] = len(self._hashes[dst_key])
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
        for page in reversed(table[keep:]):
            self._release(page)
        del table[keep:]
        self._lens[key] = new_len
        self._truncate_versions(key, new_len)
        self._cut_keys(key, new_len)
        partial = new_len % self.page_size
        if partial and table and self._refcount[table[-1]] > 1:
            if not self.free_pages:
                raise OutOfPages(f"truncate {key} needs 1 page to unshare its last page; none free")
            (page,) = self._take(1)
            old = table[-1]
            self._refcount[old] -= 1
            table[-1] = page
            src0, dst0 = old * self.page_size, page * self.page_size
            return SlotCopy(range(src0, src0 + partial), range(dst0, dst0 + partial))
        if partial and table and self.prefix is not None:
            self.prefix.forget(table[-1])  # its tail is about to be written again
        return None

    def free(self, key: SeqKey) -> int:
        """Drop one sequence; returns how many pages went back to the pool (shared ones may not)."""
        table = self._tables.pop(self._known(key))
        del self._lens[key]
        self._versions.pop(key, None)
        for d in (self._keys, self._hashes, self._committed):
            d.pop(key, None)
        tags = self._tags[key[0]]
        del tags[key[1]]
        if not tags:
            del self._tags[key[0]]
        # the last page first: a chain's deepest blocks are evicted before the ones they extend
        return sum(self._release(page) for page in reversed(table))

    def rename(self, src_key: SeqKey, dst_key: SeqKey) -> None:
        """``dst_key`` takes ``src_key``'s pages, length, versions and content keys (whatever it held is freed)
        and ``src_key`` is gone; nothing is allocated or copied. An unknown source leaves the
        destination empty. (A speculative fork undone: its backup becomes the context again.)"""
        if dst_key in self._tables:
            self.free(dst_key)
        if src_key not in self._tables:
            return
        self._tables[dst_key] = self._tables.pop(src_key)
        self._lens[dst_key] = self._lens.pop(src_key)
        self._versions[dst_key] = self._versions.pop(src_key, [])
        for d in (self._keys, self._hashes, self._committed):  # its prefix-cache content keys
            if src_key in d:
                d[dst_key] = d.pop(src_key)  # type: ignore[index]
        tags = self._tags[src_key[0]]
        del tags[src_key[1]]
        if not tags:
            del self._tags[src_key[0]]
        self._tags.setdefault(dst_key[0], {})[dst_key[1]] = None

    def free_request(self, request_id: str) -> int:
        """Drop every tag of ``request_id``; returns the pages released. Unknown ids are a no-op,
        so cancellation and preemption may call it more than once."""
        return sum(self.free((request_id, tag)) for tag in list(self._tags.get(request_id, ())))

    # ----------------------------------------------------------------- helpers
    def _start(self, key: SeqKey) -> None:
        if key not in self._tables:
            self._tables[key] = []
            self._lens[key] = 0
            self._tags.setdefault(key[0], {})[key[1]] = None
            if self.prefix is not None:
                self._keys[key], self._hashes[key], self._committed[key] = [], [], 0

    def _extend_keys(self, key: SeqKey, start: int, content: Sequence[int] | None) -> None:
        """Tokens from `start` were appended: their keys extend a fully known sequence's, and
        blocks they fill get hashes; unknown content ends the known run."""
        keys = self._keys.get(key)
        if keys is None or len(keys) != start or content is None:
            return
        ps = self.page_size
        hashes = self._hashes[key]
        done = len(hashes) * ps
        keys.extend(content)
        hashes.extend(block_hashes(hashes[-1] if hashes else ROOT, keys[done:], ps))

    def _cut_keys(self, key: SeqKey, new_len: int) -> None:
        keys = self._keys.get(key)
        if keys is None:
            return
        del keys[new_len:]
        blocks = len(keys) // self.page_size
        del self._hashes[key][blocks:]
        self._committed[key] = min(self._committed[key], blocks)

    def _release(self, page: int) -> int:
        """One holder less of `page`; 1 when it went back to the pool (cached or not)."""
        self._refcount[page] -= 1
        if self._refcount[page]:
            return 0
        if self.prefix is None or not self.prefix.release(page):
            heapq.heappush(self._free, page)
        return 1

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
        """`n` pages for one holder: never-cached free pages first (lowest first), then the
        least recently used cached ones no sequence holds."""
        pages = [heapq.heappop(self._free) if self._free else self.prefix.evict()  # type: ignore[union-attr]
                 for _ in range(n)]
        for page in pages:
            self._refcount[page] = 1
        return pages
