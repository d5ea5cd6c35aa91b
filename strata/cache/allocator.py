"""Page allocator for the paged KV cache.

The KV pool is ``num_pages * page_size`` slots; slot ``page * page_size + offset`` holds the KV of one
token. The allocator only hands out page ids; it knows nothing about what is stored in them.
A model with sliding-window layers gets a `GroupedPageAllocator`: the same page ids, and behind each
one a page of every window group's, which can be given back on its own once the positions it holds
fall out of the window. The window groups' pages come from pools of their own (`split`) or, with
`shared`, from the same pool as the primary pages: a page a window gave back can hold a full layer's
KV next, so the split between the groups follows the workload instead of a fixed ratio.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


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

    # sliding-window groups behind the page ids (GroupedPageAllocator)
    groups: Sequence[WindowGroup] = ()

    @property
    def num_free_pages(self) -> int:
        return len(self._free_list)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free_list)

    def group_pages_held(self, pages: Iterable[int]) -> list[int]:
        """Per window group, how many of these (primary) pages still hold that group's KV."""
        idx = np.asarray(list(pages), dtype=np.int64)
        return [
            int((g.to_group[idx] >= 0).sum()) if len(idx) else 0 for g in self.groups
        ]

    def held_pages(self, pages: int, sequences: int = 1) -> int:
        """Pages of the pool that `pages` primary pages of `sequences` requests hold."""
        return pages

    def pool_cost(self, n: int, present: np.ndarray | None = None) -> int:
        """Pages of the pool that allocating n pages takes (`present`: see GroupedPageAllocator)."""
        return n

    def tail_parts(self, num_pages: int, end: int) -> np.ndarray | None:
        """Which window groups' parts n pages ending at token `end` need (None: no groups)."""
        return None

    shared = False  # window groups drawing from this pool (GroupedPageAllocator)

    def is_free(self, page: int) -> bool:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")
        return bool(self._is_free[page])

    def alloc(self, n: int, present: np.ndarray | None = None) -> list[int] | None:
        """Take ``n`` pages: all of them, or None (and nothing is taken). (`present`: for window
        groups, GroupedPageAllocator.)"""
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

    def grow(self, pages: list[int], tokens: int) -> bool:
        """Extend `pages` (a sequence's, in order) to hold `tokens` slots: True, or False (and
        nothing taken) when the pool is short."""
        more = self.alloc(max(0, math.ceil(tokens / self.page_size) - len(pages)))
        if more is None:
            return False
        pages.extend(more)
        return True

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
        # back on the stack so that the next alloc hands them out in the order they came: a sequence
        # that frees its last pages (rejected drafts) and grows again keeps its slots in ascending order
        self._free_list.extend(reversed(pages))

    def __repr__(self) -> str:
        return f"PageAllocator(free={self.num_free_pages}/{self.num_pages}, page_size={self.page_size})"


class WindowGroup:
    """The KV pages of one sliding-window layer group, addressed through the primary page ids.

    Primary page p backs positions [i * page_size, (i + 1) * page_size) of whichever sequence holds it;
    the group's KV for those positions is in group page ``to_group[p]`` (-1: none, a tombstone: the
    positions fell out of every window that still reads them, and the group page went back).
    """

    def __init__(
        self, window: int, num_pages: int, num_primary_pages: int, page_size: int
    ) -> None:
        self.window = window
        self.allocator: PageAllocator | _SharedPages = PageAllocator(
            num_pages, page_size
        )
        self.to_group = np.full(num_primary_pages, -1, dtype=np.int64)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    def alive(self, pages: Sequence[int]) -> np.ndarray:
        return self.to_group[np.asarray(pages, dtype=np.int64)] >= 0

    def drop(self, pages: Iterable[int]) -> int:
        """Tombstone the primary pages' group KV (those that still have it). Returns the count freed."""
        idx = np.asarray(list(pages), dtype=np.int64)
        if not len(idx):
            return 0
        held = self.to_group[idx]
        live = held >= 0
        self.allocator.free(held[live].tolist())
        self.to_group[idx[live]] = -1
        return int(live.sum())


class _SharedPages:
    """A window group's view of the pool it shares with the primary pages (`GroupedPageAllocator`
    with `shared`): its pages are the primary pool's, taken and given back there."""

    def __init__(self, pool: GroupedPageAllocator) -> None:
        self.pool = pool

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def alloc(self, n: int) -> list[int] | None:
        return PageAllocator.alloc(self.pool, n)

    def free(self, pages: Iterable[int]) -> None:
        PageAllocator.free(self.pool, pages)

    def reset(self) -> None:
        pass  # the pool resets itself


class GroupedPageAllocator(PageAllocator):
    """Pages of a model whose layers attend differently: one page id space (the primary group: the
    full-attention layers, or no storage at all when every layer is windowed) and a `WindowGroup`
    per group of window layers. Allocating a page allocates it in every group; freeing it frees what
    each group still holds; `drop` frees a group's part alone while the full layers keep theirs.

    The prefix cache and the scheduler deal in primary pages as before; this class keeps each
    group's own pages behind them. With `shared` every group draws from the primary pool (pages of
    one size: each group has as many layers as the primary one, see `MHAKVPool`), so a primary page
    costs `page_cost` pages of the pool while all its groups hold their part.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        groups: Sequence[tuple[int, int]],
        shared: bool = False,
    ) -> None:
        """groups: (window, group pages) per window group (with `shared` the pages are ignored)."""
        self.shared = shared
        self.groups = [
            WindowGroup(w, 0 if shared else n, num_pages, page_size) for w, n in groups
        ]
        if shared:
            for g in self.groups:
                g.allocator = _SharedPages(self)
        super().__init__(num_pages, page_size)

    @property
    def page_cost(self) -> int:
        """Pages of the pool one newly allocated primary page takes (1 unless `shared`)."""
        return 1 + len(self.groups) if self.shared else 1

    def reset(self) -> None:
        super().reset()
        for g in self.groups:
            g.allocator.reset()
            g.to_group[:] = -1

    def can_alloc(self, n: int, present: np.ndarray | None = None) -> bool:
        if self.shared:
            return self.pool_cost(n, present) <= self.num_free_pages
        wanted = (
            [n] * len(self.groups) if present is None else present.sum(axis=0).tolist()
        )
        return n <= self.num_free_pages and all(
            k <= g.num_free_pages for k, g in zip(wanted, self.groups)
        )

    def pool_cost(self, n: int, present: np.ndarray | None = None) -> int:
        if not self.shared:
            return n
        return n * self.page_cost if present is None else n + int(present.sum())

    def alloc(self, n: int, present: np.ndarray | None = None) -> list[int] | None:
        """n primary pages and, behind each, a page of every window group, or only of the groups
        `present[i, g]` names (the rest start as tombstones: pages whose window KV is not needed,
        such as a promoted page that lacks it or one before a transferred prompt's last window)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if present is not None and present.shape != (n, len(self.groups)):
            raise ValueError(
                f"present must be [{n}, {len(self.groups)}], got {list(present.shape)}"
            )
        if not self.can_alloc(n, present):
            return None
        pages = super().alloc(n)
        if n:
            idx = np.asarray(pages, dtype=np.int64)
            for gi, g in enumerate(self.groups):
                rows = idx if present is None else idx[present[:, gi]]
                if len(rows):
                    got = g.allocator.alloc(len(rows))
                    assert got is not None  # can_alloc said every group has room
                    g.to_group[rows] = got
        return pages

    def tail_parts(self, num_pages: int, end: int) -> np.ndarray:
        """[num_pages, groups]: the pages of a sequence's first `end` tokens that a query at `end`
        reads in each group (those covering [end - W + 1, end)); the others need no window KV."""
        first = np.arange(num_pages)[:, None]
        starts = np.array(
            [max(0, end - g.window + 1) // self.page_size for g in self.groups]
        )
        return first >= starts[None, :]

    def held_pages(self, pages: int, sequences: int = 1) -> int:
        """Pages of the pool that `pages` primary pages of `sequences` requests hold once each has
        given back what fell out of its windows (shared; otherwise the primary pages alone)."""
        if not self.shared:
            return pages
        window_pages = max(g.window for g in self.groups) // self.page_size + 2
        return pages + len(self.groups) * min(pages, sequences * window_pages)

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        super().free(pages)  # validates first: nothing of a bad call is freed
        for g in self.groups:
            g.drop(pages)

    def usable_prefix(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` (a cached prefix, in order) can be reused: the longest k such that
        each group still holds the pages a query at position k * page_size reads, those covering
        its window's cached part [k * page_size - window + 1, k * page_size)."""
        ps = self.page_size
        k = len(pages)
        if not self.groups or not k:
            return k
        ends = np.arange(1, k + 1)  # candidate lengths in pages
        ok = np.ones(k, dtype=bool)
        for g in self.groups:
            dead = ~g.alive(pages)
            # first page of the run of live pages ending at page e - 1, for each candidate e
            run_start = np.maximum.accumulate(np.where(dead, ends, 0))
            ok &= run_start <= np.maximum(0, ends * ps - g.window + 1) // ps
        usable = np.flatnonzero(ok)
        return int(usable[-1]) + 1 if len(usable) else 0

    def adopt(self, kept: Sequence[int], duplicates: Sequence[int]) -> None:
        """``duplicates[i]`` holds the same KV as ``kept[i]`` and is about to be freed: where a group
        dropped kept's part and the duplicate still has one, move it over (revives tombstones)."""
        for g in self.groups:
            for a, b in zip(kept, duplicates):
                if a != b and g.to_group[a] < 0 <= g.to_group[b]:
                    g.to_group[a], g.to_group[b] = g.to_group[b], -1

    def __repr__(self) -> str:
        if self.shared:
            groups = ", ".join(
                f"W{g.window}: {int((g.to_group >= 0).sum())} held" for g in self.groups
            )
            return f"GroupedPageAllocator(shared, free={self.num_free_pages}/{self.num_pages}, {groups}, page_size={self.page_size})"
        groups = ", ".join(
            f"W{g.window}: {g.num_free_pages}/{g.num_pages}" for g in self.groups
        )
        return f"GroupedPageAllocator(free={self.num_free_pages}/{self.num_pages}, {groups}, page_size={self.page_size})"
