"""Host free list with reference counts for one page pool.

A page's refcount is the number of holders: radix-tree nodes that list it, plus the one request
that owns it while it is still private. Page 0 is the padding sink: padded slots of a scatter and
padded page-table entries point at it, so it is never handed out and its content is garbage.
"""

from __future__ import annotations

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a pool needs at least the sink page, got num_pages={num_pages}")
        self.num_pages = num_pages  # sink included
        self.refcount = np.zeros(num_pages, np.int32)  # [num_pages]
        # A stack: popping from the top hands out low page ids first, which keeps tests readable.
        self._free = np.arange(num_pages - 1, 0, -1, dtype=np.int32)  # [num_pages - 1]
        self._top = num_pages - 1  # free pages are _free[:_top]

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_usable - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """n fresh pages with refcount 1, or None (and nothing taken) if fewer than n are free."""
        if n > self._top:
            return None
        pages = self._free[self._top - n : self._top][::-1].copy()  # [n] int32
        self._top -= n
        self.refcount[pages] = 1
        return pages

    # inc_ref / dec_ref take distinct pages (any one page table or node lists a page once), so
    # plain fancy indexing is enough: no np.add.at + np.unique, much slower on thousands of pages.

    def inc_ref(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, np.int32)
        if np.any(self.refcount[pages] <= 0):
            raise ValueError(f"inc_ref on a free page: {pages[self.refcount[pages] <= 0].tolist()}")
        self.refcount[pages] += 1

    def dec_ref(self, pages: np.ndarray) -> int:
        """Drop one reference from each page; pages reaching zero go back to the free list."""
        pages = np.asarray(pages, np.int32)
        if pages.size == 0:
            return 0
        self.refcount[pages] -= 1
        left = self.refcount[pages]
        if np.any(left < 0) or np.any(pages == 0):
            self.refcount[pages] += 1
            raise ValueError(f"page freed twice (or the sink freed): {pages.tolist()}")
        freed = pages[left == 0]
        self._free[self._top : self._top + freed.size] = freed
        self._top += freed.size
        return int(freed.size)

    def check(self) -> None:
        free = self._free[: self._top]
        assert self.refcount[0] == 0, "the sink page was handed out"
        assert np.all(self.refcount >= 0), "negative refcount"
        assert np.unique(free).size == free.size, "a page is on the free list twice"
        assert not np.any(free == 0), "the sink page is on the free list"
        assert np.all(self.refcount[free] == 0), "a referenced page is on the free list"
        assert int(np.count_nonzero(self.refcount)) == self.num_used, "a page leaked"
