"""The paged cache's pages on the host (paged_cache.py holds them on the devices): which sequences
hold each page, which full pages hold which prefix, and which go first when the pool runs short.

A page is free, held (by one sequence, or by several that share a prefix: `refs`), or cached (held by
none, kept with its contents for a later request with the same prefix, until the pool needs it:
least recently released first).

A full page is named by its group (paged_cache.FULL or SLIDING) and a hash chained over every token
from the sequence's start to the page's end (`chain`): two sequences' i-th pages get the same name
exactly when their first (i + 1) P tokens agree (blake2b, 128 bits, so no client can make two
prefixes collide). Only full pages are named, and a named page is never written again, so a
sequence that finds its prefix cached shares those pages read-only and writes from the next page on.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


def chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a page holding `tokens`, after a page named `previous` (b"" for the first)."""
    return hashlib.blake2b(previous + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


def adapter_seed(adapter: int | None, generation: int = 0) -> bytes:
    """The start of the page names' chain of a request under this served adapter (None: the base),
    the `generation`-th put in its entry of the table (Engine.put_adapter)."""
    return b"" if adapter is None else f"adapter {adapter}.{generation}".encode()


def extend_hashes(hashes: list[bytes], tokens: Sequence[int], page_size: int, seed: bytes = b"") -> list[bytes]:
    """Append the names of the full pages of `tokens` past the `len(hashes)` already named -> hashes.
    `seed` starts the chain: a served adapter's (`adapter_seed`), so that pages computed under one
    adapter are never found by a prompt under another, or under none."""
    for i in range(len(hashes), len(tokens) // page_size):
        hashes.append(chain(hashes[-1] if hashes else seed, tokens[i * page_size:(i + 1) * page_size]))
    return hashes


class Pages:
    """`count` page ids: taken, shared, released, named for their prefix, and evicted (see the module)."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"the pool needs at least one page, got {count}")
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = [0] * count
        self._name: list[tuple[int, bytes] | None] = [None] * count
        self._named: dict[tuple[int, bytes], int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached pages, oldest first
        self.evicted = 0

    @property
    def available(self) -> int:
        """Pages a sequence can take now: free, or cached (evicted on the way)."""
        return len(self._free) + len(self._lru)

    @property
    def held(self) -> int:
        return self.count - self.available

    @property
    def cached(self) -> int:
        return len(self._lru)

    def take(self) -> int | None:
        """A page for one sequence (a free one, else the least recently released cached one, whose
        name is forgotten) -> its id, or None when every page is held."""
        if self._free:
            page = self._free.pop()
        elif self._lru:
            page, _ = self._lru.popitem(last=False)
            del self._named[self._name[page]]
            self._name[page] = None
            self.evicted += 1
        else:
            return None
        self._refs[page] = 1
        return page

    def find(self, group: int, name: bytes) -> int | None:
        """The page named so in this group, held or cached (None: not in the pool)."""
        return self._named.get((group, name))

    def share(self, page: int) -> None:
        """One more sequence holds this page (a cached one is held again)."""
        if self._refs[page] == 0:
            del self._lru[page]
        self._refs[page] += 1

    def release(self, page: int) -> None:
        """One sequence fewer holds it; held by none, a named page is cached, any other freed."""
        self._refs[page] -= 1
        assert self._refs[page] >= 0, f"page {page} released more often than taken"
        if self._refs[page] == 0:
            if self._name[page] is None:
                self._free.append(page)
            else:
                self._lru[page] = None

    def name(self, page: int, group: int, name: bytes) -> None:
        """Record that this full page holds the prefix `name` (kept only if no page has that name yet)."""
        key = (group, name)
        if self._name[page] is None and key not in self._named:
            self._named[key] = page
            self._name[page] = key

    def refs(self, page: int) -> int:
        return self._refs[page]

    def free_pages(self) -> list[int]:
        """The free pages (not cached), for tests that fill them with garbage."""
        return list(self._free)
