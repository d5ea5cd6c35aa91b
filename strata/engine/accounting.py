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
        private = sum(
            len(r.pages) - r.cached_len // self.page_size for r in self.running
        )
        return private + sum(len(r.pages) for r in self.prealloc.values())

    def kv_bytes_in_use(self) -> int:
        """KV memory in pages that are not free, over every group of the pool."""
        a = self.allocator
        used = [a.num_pages - a.num_free_pages]
        if not a.shared:  # (shared: the window groups' pages are among those)
            used += [g.num_pages - g.num_free_pages for g in a.groups]
        return sum(u * b for u, b in zip(used, self.runner.kv.bytes_by_group()))

    def _private_page_ids(self) -> list[int]:
        ps = self.page_size
        ids = [p for r in self.running for p in r.pages[r.cached_len // ps :]]
        return ids + [p for r in self.prealloc.values() for p in r.pages]

    def _replay_pages(self) -> list[int]:
        """Per window group, the pages of windows being replayed (--swa-replay)."""
        held = [0] * len(self.allocator.groups)
        for r in self.running:
            held = [
                n + len(pages)
                for n, pages in zip(held, r.replay_pages or [[]] * len(held))
            ]
        return held

    def window_group_usage(self) -> list[dict[str, int]]:
        """Per window group of the KV pool: its window, pages, and how many are free, held by the
        prefix cache and held by requests (walks the cache: for stats on request and tests). In a
        shared pool `num_pages` / `num_free_pages` are the pool's and `num_held_pages` the group's."""
        cached = self.windows.window_pages()
        private = self.allocator.group_pages_held(self._private_page_ids())
        private = [n + m for n, m in zip(private, self._replay_pages())]
        usage = [
            {
                "window": g.window,
                "num_pages": g.num_pages,
                "num_free_pages": g.num_free_pages,
                "num_cached_pages": c,
                "num_request_pages": p,
            }
            for g, c, p in zip(self.allocator.groups, cached, private)
        ]
        if self.allocator.shared:
            for u, held in zip(usage, self._shared_held()):
                u["num_held_pages"] = held
        return usage

    def _shared_held(self) -> list[int]:
        """Per window group of a shared pool, the pages it holds (behind primary pages or replaying)."""
        mapped = [int((g.to_group >= 0).sum()) for g in self.allocator.groups]
        return [n + m for n, m in zip(mapped, self._replay_pages())]

    def leaked_pages(self, window_groups: bool = False) -> int:
        """Pages that are neither free, nor cached, nor held by a request: 0 unless accounting broke
        (reported in the server's stats, so a test from outside can check the invariant). With
        window_groups, each window group's pages are counted too (walks the prefix cache)."""
        a = self.allocator
        accounted = a.num_free_pages + self.cache.total_pages + self.private_pages()
        if a.shared:  # the groups' pages are the pool's too
            accounted += sum(self._shared_held())
        leaked = a.num_pages - accounted
        if window_groups:
            for g in self.window_group_usage():
                held = (
                    g["num_held_pages"]
                    if a.shared
                    else g["num_pages"] - g["num_free_pages"]
                )
                leaked += held - g["num_cached_pages"] - g["num_request_pages"]
        return leaked

    def check_no_leaks(self) -> None:
        """Assert the page-accounting invariant (used by tests and debug runs)."""
        if self.leaked_pages(window_groups=True):
            raise AssertionError(
                f"page leak: free {self.allocator.num_free_pages} + cached {self.cache.total_pages} "
                f"+ private {self.private_pages()} != {self.allocator.num_pages}; "
                f"window groups {self.window_group_usage()}"
            )
