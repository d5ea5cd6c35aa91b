"""What the scheduler does for a KV pool with window groups (sliding-window layers; see
strata.cache.kv_pool and docs/ARCHITECTURE.md, "KV by layer group"): chunks sized to the free window
pages, window KV given back behind a request's window, and --swa-replay's recomputed windows.
"""

from __future__ import annotations

from collections.abc import Callable

from strata.cache.allocator import PageAllocator
from strata.cache.radix import PrefixCache, WindowCache
from strata.engine.request import Req


class WindowKV:
    """Owned by the `Scheduler`: works on its allocator and prefix cache (`windows`: the same
    cache in its `WindowCache` role). `alloc_for(req, end)` is the scheduler's all-or-nothing
    page allocation for positions [0, end) of a request."""

    def __init__(
        self,
        allocator: PageAllocator,
        cache: PrefixCache,
        windows: WindowCache,
        alloc_for: Callable[[Req, int], bool],
    ):
        self.allocator = allocator
        self.cache = cache
        self.windows = windows
        self.page_size = allocator.page_size
        self.alloc_for = alloc_for

    def alloc_chunk(self, req: Req, n: int, alone: bool) -> int:
        """Allocate pages for the next n tokens of req; returns the tokens allocated for (0: none).

        With window groups a chunk needs window pages for all of itself while its window needs only
        W of them: when those are short, a chunk that fits the free window pages is fed rather than
        one that would first evict the cache's window KV (the tails later requests resume from). With
        no window page free the chunk waits while other requests make progress in this step (their
        windows move on and give pages back); only a request `alone` in its step evicts for one. In a
        shared pool the same holds for the pool's pages (a chunk takes `page_cost` per page while it
        runs): window KV no match reads is given back first, then a chunk that fits is fed rather
        than evicting cached conversations for a longer one."""
        groups, a = self.allocator.groups, self.allocator
        if groups and n > 0:
            if a.shared:
                short = (
                    a.pool_cost(
                        max(0, -(-(req.kv_len + n) // self.page_size) - len(req.pages))
                    )
                    - a.num_free_pages
                )
                if short > 0:
                    self.windows.evict_window([short] * len(groups), tails=False)
                room = a.num_free_pages // a.page_cost
            else:
                room = min(g.num_free_pages for g in groups)
            fits = (
                len(req.pages) + room
            ) * self.page_size - req.kv_len  # tokens whose pages are free now
            if fits <= 0 and not alone:
                return 0
            n = min(n, fits) if fits > 0 else min(n, max(g.window for g in groups))
        while n > 0:
            if self.alloc_for(req, req.kv_len + n):
                return n
            if not self.allocator.groups:
                return 0
            n //= 2
        return 0

    def start_replay(self, req: Req, alone: bool) -> bool:
        """--swa-replay: if the window groups lack the matched prefix's last window, recompute it.

        The request keeps its match (the full layers' KV, locked in the tree) but is fed again from
        replay_from, the page boundary at or before cached_len - W + 1 (W: the largest window): the
        window layers write those positions into pages of their own (`replay_pages`) and read nothing
        before replay_from; the full layers' writes for them go to the pool's scratch page, so the
        cached KV stays as it was. False (nothing held) if the window groups have no room (a request
        not `alone` in its step does not evict window KV for it; see `alloc_chunk`)."""
        ps, end = self.page_size, req.cached_len
        if not end or self.allocator.usable_prefix(req.pages[: end // ps]) * ps == end:
            return True
        start = (
            max(0, end - max(g.window for g in self.allocator.groups) + 1) // ps * ps
        )
        count = (end - start) // ps
        a = self.allocator
        if a.shared:  # count pages in each group, from the one pool
            need = count * len(a.groups)
            if need > a.num_free_pages and not (
                alone and self.cache.make_room(-(-need // a.page_cost))
            ):
                return False
        else:
            short = [count - g.num_free_pages for g in a.groups]
            if any(n > 0 for n in short):
                if not alone:
                    return False
                self.windows.evict_window(short)
                if any(g.num_free_pages < count for g in a.groups):
                    return False
        req.replay_pages = [g.allocator.alloc(count) for g in self.allocator.groups]
        req.replay_from, req.replay_end = start, end
        req.kv_len = start
        return True

    def end_replay(self, req: Req) -> None:
        for group, pages in zip(self.allocator.groups, req.replay_pages):
            group.allocator.free(pages)
        req.replay_from, req.replay_end, req.replay_pages = None, 0, []

    def drop_behind_window(self, req: Req) -> None:
        """Give back the window groups' KV of the request's own pages that no query reads any more.

        Kept: the pages a query at the request's last whole page boundary would read (so its computed
        prefix stays matchable when cached) and everything after it; the next queries, at kv_len and
        beyond, read no further back."""
        ps = self.page_size
        groups = self.allocator.groups
        if len(req.window_dropped) != len(groups):
            req.window_dropped = [0] * len(groups)
        end = req.kv_len // ps * ps
        own_from = req.cached_len // ps
        if (
            req.replay_from is not None
            and end - max(g.window for g in groups) + 1 >= req.replay_end
        ):
            self.end_replay(req)  # every window has moved past the replayed positions
        for i, group in enumerate(groups):
            keep_from = max(0, end - group.window + 1) // ps
            start = max(own_from, req.window_dropped[i])
            if keep_from > start:
                group.drop(req.pages[start:keep_from])
                req.window_dropped[i] = keep_from
