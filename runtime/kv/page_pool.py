"""The KV page pool: reference-counted pages and the prefix cache over them.

The scheduler asks this pool for page ids; the K/V tensors themselves live in the attention
backend, indexed by the same ids. A page is in exactly one of three places:

- in use: its reference count is > 0 (several sequences can share a full, cached prefix page;
  chain records and their forks share pages the same way, runtime/chains.py);
- free: on the plain free list, holding nothing anyone can find;
- cached: free, but its content is still reachable through its prefix hash. Cached pages wait in
  an LRU queue and are evicted oldest first, only when the plain free list is empty.

Prefix caching hashes FULL pages in a chain, h_i = H(h_{i-1}, tokens of page i, salt), so a page's
hash names its whole prefix. The salt fingerprints whatever else changes the K/V (model, method).
Each layer has its own pages (one global pool, per-layer page tables): layer l's page of a prefix
is registered under `layer_key(h, l)` (layer 0 under h itself), and a hit gives every layer's page.

Storage classes (runtime/kv/spec.py `StorageClasses`: layers whose KV specs differ): class c owns
the page ids `[first(c), first(c) + sizes[c])`, with its own free list and LRU queue, and its layers
take pages from there (`allocate(n, cls)`, `free_in(cls)`); everything else (references, the prefix
cache, chains) is by page id as with one class. A class's store indexes its pages from 0
(runtime/kv/tables.py `TableCache.local`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq

_DIGEST = 16  # bytes of blake2b: collisions are out of reach, so hits are not re-checked by tokens
_ROOT = bytes(_DIGEST)  # the "previous hash" of the first page


class PoolExhausted(RuntimeError):
    """`allocate` was asked for more pages than are free (an engine bug: check `can_allocate`)."""


class FreeList:
    """Free page ids, first in first out, taken and given back in bulk (slices, not a call per page: a
    128K prompt takes ~400K pages over its layers at once)."""

    __slots__ = ("_items", "_head")

    def __init__(self, pages: Iterable[int]) -> None:
        self._items = list(pages)
        self._head = 0  # pages before it were taken

    def __len__(self) -> int:
        return len(self._items) - self._head

    def __iter__(self) -> Iterator[int]:
        return iter(self._items[self._head:])

    def take(self, n: int) -> list[int]:
        """The n oldest free pages (n <= len)."""
        start = self._head
        self._head = start + n
        pages = self._items[start : self._head]
        if self._head > 4096 and 2 * self._head > len(self._items):  # drop the taken prefix now and then
            del self._items[: self._head]
            self._head = 0
        return pages

    def append(self, page: int) -> None:
        self._items.append(page)

    def extend(self, pages: Iterable[int]) -> None:
        self._items.extend(pages)


class PagePool:
    def __init__(
        self,
        num_pages: int | Seq[int],
        page_size: int,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        prefix_block: int = 0,
    ) -> None:
        sizes = [num_pages] if isinstance(num_pages, int) else list(num_pages)
        if not sizes or min(sizes) < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 (each class) and page_size >= 1, got {num_pages}, {page_size}")
        self.sizes = sizes  # pages of each storage class
        self.starts = [sum(sizes[:c]) for c in range(len(sizes))]  # each class's first page id
        self.num_pages = num_pages = sum(sizes)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # prefixes are shared in whole blocks of this many pages (a spec that writes codes a block at a
        # time: a sequence starting mid-block would need the block's older tokens in its window)
        if prefix_block % page_size:
            raise ValueError(f"prefix_block {prefix_block} is not a multiple of the page size {page_size}")
        self.prefix_pages = max(1, prefix_block // page_size)
        self._salt = hashlib.blake2b(salt, digest_size=_DIGEST).digest()  # fixed width
        self._refs = [0] * num_pages
        self._class = [c for c, n in enumerate(sizes) for _ in range(n)]  # page -> its class
        self._frees = [FreeList(range(a, a + n)) for a, n in zip(self.starts, sizes)]
        self._cacheds: list[OrderedDict[int, None]] = [OrderedDict() for _ in sizes]  # LRU: oldest first
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._hash_page: dict[bytes, int] = {}
        self._queries = 0
        self._hits = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.sizes)

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out (every class): plain free ones plus evictable cached ones."""
        return sum(len(f) for f in self._frees) + sum(len(c) for c in self._cacheds)

    def free_in(self, cls: int) -> int:
        """Free pages of class `cls`."""
        return len(self._frees[cls]) + len(self._cacheds[cls])

    def fits(self, need: Seq[int]) -> bool:
        """Are `need[c]` pages of every class c free?"""
        return all(n <= self.free_in(c) for c, n in enumerate(need))

    def oversized(self, need: Seq[int]) -> int | None:
        """The first class whose whole range is smaller than `need[c]` (None: every class holds it)."""
        return next((c for c, (n, size) in enumerate(zip(need, self.sizes)) if n > size), None)

    def class_of(self, page: int) -> int:
        return self._class[page]

    def count_by_class(self, pages: Iterable[int]) -> list[int]:
        """How many of `pages` each class holds."""
        if len(self.sizes) == 1:
            return [sum(1 for _ in pages)]
        out = [0] * len(self.sizes)
        for page in pages:
            out[self._class[page]] += 1
        return out

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Free pages that still hold a reachable prefix."""
        return sum(len(c) for c in self._cacheds)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def is_shared(self, page: int) -> bool:
        """Must a writer copy this page first? Another holder references it, or the prefix cache
        names its content (copy-on-write)."""
        return self._refs[page] > 1 or self._page_hash[page] is not None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int, cls: int = 0) -> bool:
        return n <= self.free_in(cls)

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int, cls: int = 0) -> list[int]:
        """Takes n fresh pages of class `cls` (refcount 1), evicting its oldest cached pages if needed."""
        free, cached = self._frees[cls], self._cacheds[cls]
        if n > len(free) + len(cached):
            raise PoolExhausted(f"asked for {n} pages, {len(free) + len(cached)} free")
        refs = self._refs
        pages = free.take(min(n, len(free)))
        for page in pages:
            refs[page] = 1
        for _ in range(n - len(pages)):  # then the oldest cached pages
            page, _ = cached.popitem(last=False)
            del self._hash_page[self._page_hash[page]]
            self._page_hash[page] = None
            refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Seq[int]) -> None:
        """Drops one reference from each page; `pages` in sequence order (a page table).

        They are released last to first: a chain's tail then leaves the LRU queue before its
        head, since a tail whose head is gone can never be hit again.
        """
        refs, hashes, classes = self._refs, self._page_hash, self._class
        released: list[int] = []  # unnamed pages whose last reference went, in release order
        for page in reversed(pages):
            left = refs[page] - 1
            if left < 0:
                raise ValueError(f"page {page} freed more often than it was taken")
            refs[page] = left
            if left == 0:
                if hashes[page] is not None:
                    self._cacheds[classes[page]][page] = None
                else:
                    released.append(page)
        if len(self._frees) == 1:
            self._frees[0].extend(released)
        else:
            for page in released:
                self._frees[classes[page]].append(page)

    # ---- prefix cache ------------------------------------------------------------------------
    def page_hash(self, prev: bytes | None, page_tokens: Seq[int], salt: bytes | None = None) -> bytes:
        """Hash of one full page given the hash of the page before it (None for the first); `salt`:
        a lane's (runtime/lanes.py; None: the pool's)."""
        if len(page_tokens) != self.page_size:
            raise ValueError(f"only full pages are hashed ({len(page_tokens)} != {self.page_size})")
        h = hashlib.blake2b(prev or _ROOT, digest_size=_DIGEST)
        h.update(self._salt if salt is None else salt)
        h.update(struct.pack(f"<{len(page_tokens)}q", *page_tokens))
        return h.digest()

    def prefix_hashes(self, token_ids: Seq[int], num_pages: int | None = None,
                      salt: bytes | None = None) -> list[bytes]:
        """Chained hashes of the first `num_pages` full pages of `token_ids` (default: all)."""
        size = self.page_size
        n = len(token_ids) // size if num_pages is None else num_pages
        hashes: list[bytes] = []
        prev = None
        for i in range(n):
            prev = self.page_hash(prev, token_ids[i * size : (i + 1) * size], salt)
            hashes.append(prev)
        return hashes

    def lookup(self, token_ids: Seq[int]) -> list[int]:
        """Cached pages of the longest leading run of full pages (whole prefix blocks); changes nothing.

        At most (len - 1) // page_size pages: the last token is always left to compute, so the
        step that finishes the prompt has a logit to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in self.prefix_hashes(token_ids, (len(token_ids) - 1) // self.page_size):
            page = self._hash_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages[:len(pages) // self.prefix_pages * self.prefix_pages]

    @staticmethod
    def layer_key(page_hash: bytes, layer: int) -> bytes:
        """The key of layer `layer`'s page of the prefix named by `page_hash`."""
        if layer == 0:
            return page_hash
        return hashlib.blake2b(page_hash + struct.pack("<q", layer), digest_size=_DIGEST).digest()

    def lookup_layers(self, token_ids: Seq[int], num_layers: int, salt: bytes | None = None) -> list[list[int]]:
        """Per layer, the cached pages of the longest leading run of full pages that every layer
        still holds (as `lookup`, capped so the last token is computed); changes nothing."""
        tables: list[list[int]] = [[] for _ in range(num_layers)]
        if not self.enable_prefix_caching:
            return tables
        for h in self.prefix_hashes(token_ids, (len(token_ids) - 1) // self.page_size, salt):
            pages = [self._hash_page.get(self.layer_key(h, layer)) for layer in range(num_layers)]
            if any(page is None for page in pages):
                break
            for table, page in zip(tables, pages):
                table.append(page)
        whole = len(tables[0]) // self.prefix_pages * self.prefix_pages  # whole blocks only
        return [table[:whole] for table in tables]

    def match_prefix_layers(self, token_ids: Seq[int], num_layers: int, salt: bytes | None = None) -> list[list[int]]:
        """Like `lookup_layers`, but takes a reference on each hit page and counts the query."""
        tables = self.lookup_layers(token_ids, num_layers, salt)
        for table in tables:
            self.acquire(table)
        if self.enable_prefix_caching:
            self._queries += len(token_ids)
            self._hits += len(tables[0]) * self.page_size
        return tables

    def match_prefix(self, token_ids: Seq[int]) -> list[int]:
        """Like `lookup`, but takes a reference on each hit page and counts the query."""
        pages = self.lookup(token_ids)
        self.acquire(pages)
        if self.enable_prefix_caching:
            self._queries += len(token_ids)
            self._hits += len(pages) * self.page_size
        return pages

    def acquire(self, pages: Iterable[int]) -> None:
        """Takes one more reference on pages that are in use or cached (a prefix hit)."""
        for page in pages:
            if self._refs[page] == 0:
                cached = self._cacheds[self._class[page]]
                if page not in cached:
                    raise ValueError(f"page {page} is neither in use nor cached")
                del cached[page]
            self._refs[page] += 1

    def register(self, page: int, page_hash: bytes) -> bool:
        """Records that an in-use, full, computed page holds the prefix named by `page_hash`.

        Returns False when caching is off or another page already holds that prefix (two
        sequences computed it side by side); this page then stays unnamed and is freed plainly.
        """
        if not self.enable_prefix_caching:
            return False
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not in use; only computed pages can be registered")
        known = self._page_hash[page]
        if known is not None:
            if known != page_hash:
                raise ValueError(f"page {page} is already registered under another prefix")
            return True
        if page_hash in self._hash_page:
            return False
        self._page_hash[page] = page_hash
        self._hash_page[page_hash] = page
        return True

    def is_registered(self, page: int) -> bool:
        return self._page_hash[page] is not None

    def stats(self) -> dict[str, float]:
        """Prefix-cache counters since start, in tokens: looked up at admission, and served."""
        rate = self._hits / self._queries if self._queries else 0.0
        return {"query_tokens": self._queries, "hit_tokens": self._hits, "hit_rate": rate}

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raises AssertionError if the pool's books disagree (for tests and debugging)."""

        def fail(msg: str) -> None:
            raise AssertionError(f"PagePool: {msg}")

        free = {p for f in self._frees for p in f}
        cached = {p for c in self._cacheds for p in c}
        if len(free) != sum(len(f) for f in self._frees):
            fail("a page is twice on the free list")
        if free & cached:
            fail("a page is both free and cached")
        for c, (f, q) in enumerate(zip(self._frees, self._cacheds)):
            if any(self._class[p] != c for p in (*f, *q)):
                fail(f"class {c}'s free list or LRU queue holds another class's page")
        for page in range(self.num_pages):
            ref = self._refs[page]
            places = (ref > 0) + (page in free) + (page in cached)
            if ref < 0:
                fail(f"page {page} has refcount {ref}")
            if places != 1:
                fail(f"page {page} (ref {ref}) is in {places} of: in use, free, cached")
            h = self._page_hash[page]
            if page in free and h is not None:
                fail(f"free page {page} still has a hash")
            if page in cached and h is None:
                fail(f"cached page {page} has no hash")
            if h is not None and self._hash_page.get(h) != page:
                fail(f"page {page}'s hash maps to page {self._hash_page.get(h)}")
        if len(self._hash_page) != sum(h is not None for h in self._page_hash):
            fail("hash map has entries no page claims")
