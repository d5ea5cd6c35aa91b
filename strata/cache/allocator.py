"""Page allocator for the paged KV cache.

The KV pool is ``num_pages * page_size`` slots; slot ``page * page_size + offset`` holds the KV of one
token. The allocator only hands out page ids; it knows nothing about what is stored in them.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(Exception):
    """Raised by callers that need pages and cannot get them even after eviction."""


class PageAllocator:
    """Hands out fixed-size pages of KV slots; slot = page * page_size + offset."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        """Mark every page free."""
        # A stack; reversed so a fresh allocator hands out 0, 1, 2, ...
        self._free_list: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self.num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_list)

    def is_free(self, page: int) -> bool:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")
        return bool(self._is_free[page])

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages: all of them, or None (and nothing is taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n == 0:
            return []
        fl = self._free_list
        if n > len(fl):
            return None
        pages = fl[-n:]
        del fl[-n:]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. ValueError (and nothing freed) on an out-of-range, free or repeated page."""
        pages = list(pages)
        is_free = self._is_free
        n = self.num_pages
        for p in pages:
            if not 0 <= p < n:
                raise ValueError(f"page {p} out of range [0, {n})")
            if is_free[p]:
                raise ValueError(f"double free of page {p}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"page freed twice in one call: {pages}")
        for p in pages:
            is_free[p] = 1
        self._free_list.extend(pages)

    def __repr__(self) -> str:
        return f"PageAllocator(free={self.num_free_pages}/{self.num_pages}, page_size={self.page_size})"
