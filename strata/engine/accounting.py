"""Where the scheduler's KV pages are: free, held by the prefix cache, or held by requests.

Invariant after every step, per group of the pool (the primary pages, and each window group's):
free + cached + held by requests == the group's pages. `leaked_pages` is what breaks it (0 unless
accounting broke; the server reports it), `check_no_leaks` asserts it in tests and debug runs.
"""

from __future__ import annotations


class KVAccounting:
    """Mixed into `Scheduler`, whose allocator, prefix cache, running and reserved requests it reads."""

    def private_pages(self) -> int:
        """Pages held by requests outside the prefix cache (running, or reserved for a PD transfer)."""
        private = sum(len(r.pages) - r.cached_len // self.page_size for r in self.running)
        return private + sum(len(r.pages) for r in self.prealloc.values())

    def kv_bytes_in_use(self) -> int:
        """KV memory in pages that are not free, over every group of the pool."""
        used = [self.allocator.num_pages - self.allocator.num_free_pages]
        used += [g.num_pages - g.num_free_pages for g in self.allocator.groups]
        return sum(u * b for u, b in zip(used, self.runner.kv.bytes_by_group()))

    def _private_page_ids(self) -> list[int]:
        ps = self.page_size
        ids = [p for r in self.running for p in r.pages[r.cached_len // ps :]]
        return ids + [p for r in self.prealloc.values() for p in r.pages]

    def window_group_usage(self) -> list[dict[str, int]]:
        """Per window group of the KV pool: its window, pages, and how many are free, held by the
        prefix cache and held by requests (walks the cache: for stats on request and tests)."""
        cached = self.cache.window_pages()
        private = self.allocator.group_pages_held(self._private_page_ids())
        for r in self.running:  # windows being replayed
            private = [n + len(pages) for n, pages in zip(private, r.replay_pages or [[]] * len(private))]
        return [
            {"window": g.window, "num_pages": g.num_pages, "num_free_pages": g.num_free_pages,
             "num_cached_pages": c, "num_request_pages": p}
            for g, c, p in zip(self.allocator.groups, cached, private)
        ]

    def leaked_pages(self, window_groups: bool = False) -> int:
        """Pages that are neither free, nor cached, nor held by a request: 0 unless accounting broke
        (reported in the server's stats, so a test from outside can check the invariant). With
        window_groups, each window group's pages are counted too (walks the prefix cache)."""
        accounted = self.allocator.num_free_pages + self.cache.total_pages + self.private_pages()
        leaked = self.allocator.num_pages - accounted
        if window_groups:
            for g in self.window_group_usage():
                leaked += g["num_pages"] - g["num_free_pages"] - g["num_cached_pages"] - g["num_request_pages"]
        return leaked

    def check_no_leaks(self) -> None:
        """Assert the page-accounting invariant (used by tests and debug runs)."""
        if self.leaked_pages(window_groups=True):
            raise AssertionError(
                f"page leak: free {self.allocator.num_free_pages} + cached {self.cache.total_pages} "
                f"+ private {self.private_pages()} != {self.allocator.num_pages}; "
                f"window groups {self.window_group_usage()}"
            )
