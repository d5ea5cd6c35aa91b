"""The radix prefix cache of a model with sliding-window layers: it keeps hitting past the window.

The tree is the full-attention tree of `RadixCache` (keys: tokens; values: primary page ids, which
hold the full layers' KV); behind each page, each window group may or may not still hold its own
KV (`GroupedPageAllocator`). A cached prefix of length P is usable when the full layers cover it
(every node on the path does) and each window group still holds its last W - 1 tokens, the keys a
query at P reads; `match_prefix` returns the longest such prefix.

Where a match may end matters, not every page boundary: the end of a leaf (the next turn of a
conversation continues it), a branch point (a shared system prompt), the end of a locked node (a
running request resumes there), and the end of a request's prompt (`keep_resumable`: a retry, or a
next turn whose copy of the answer re-tokenizes differently, diverges between it and the leaf's end). A node with one child ends only where an earlier insert or
prefill chunk happened to stop. So each node's guard is the end of the first such node at or
below it, and its pages wholly before guard - W - W / 4 + 1 - page_size are its interior: no match
worth keeping reads them (the page of slack lets a match end one page before a guard: a retried prompt
matches up to its last token, not through it). When a window group runs short (`evict_window`),
the cache gives its KV back in two passes:

1. interiors, least recently used nodes first, in two rounds: the pages more than 2W before the
   guard, then down to W + W / 4 (`NEAR_BANDS`). That last W / 4, the band, lets a match that
   diverges a little before a guard resume (a system prompt reused by another question diverges
   at the system prompt's end, a question's length before the guard of the chain its first request
   cached). Safe on locked nodes too: a running request's prefix ends at a locked node, at or below
   the guard, and it reads nothing before that end - W.
2. what is left, on unlocked nodes, least recently used first: a leaf goes whole (its full-layer
   pages too: without its tail it can no longer be matched at its end), unless its path's band
   alone covers what is short (then only the band goes, `_band`; in a shared pool `make_room` asks
   the same of each leaf it would evict, `_free_leaves`); an inner node becomes a
   tombstone and its children stay matchable (a branch is never lost because a node above it gave
   up its window KV). With `replay` (--swa-replay) leaves become tombstones too: the scheduler
   recomputes a hit's window, so the full layers' pages keep their value.

Example, window 4, page size 2, a branch point at 10 (two children) and a leaf ending at 22::

    a (0..10)  [p0 .. p4]    guard 10: interior = pages wholly before 4 -> p0 p1
    b (10..14) [p5 p6]       one child, guard 22: interior = pages wholly before 16 -> all of b
    c (14..22) [p7 .. p10]   leaf, guard 22: interior = p7

After pass 1 the tree still matches at 10 and at 22 (and at 20); a request diverging at 12
matches 10 tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from strata.cache.allocator import GroupedPageAllocator, WindowGroup
from strata.cache.radix import MatchResult, RadixCache, TreeNode

# Pass 1's rounds: each keeps W (1 + extra) before every guard, the window KV farthest from the
# guards going first across the whole tree. The last keeps W / 4 more than a match at the guard
# reads, so one diverging up to W / 4 before it resumes too (a shared system prompt's first reuse by
# another question): a cost of W / 4 per cached chain, which an LRU chain gives back when it goes.
NEAR_BANDS = (1.0, 0.25)


class WindowRadixCache(RadixCache):
    """PrefixCache for a `GroupedPageAllocator`: matches only prefixes every window group can resume
    from, and frees window-group KV the tree no longer needs (`evict_window`)."""

    # a leaf's remainder would end where its window KV is gone (interiors are swept first): unmatchable
    trims_leaves = False

    def __init__(self, allocator: GroupedPageAllocator, replay: bool = False) -> None:
        super().__init__(allocator)
        self.allocator: GroupedPageAllocator = allocator
        self.replay = replay  # --swa-replay: match what the full layers cover; the caller replays windows

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        match = super().match_prefix(token_ids)
        if self.replay:
            return match
        usable = self.allocator.usable_prefix(match.pages)
        if usable == len(match.pages):
            return match
        # back off to the longest prefix each window group can resume from (splits the node there)
        node, pos, pages = self._descend(tuple(token_ids[: usable * self.page_size]))
        return MatchResult(node, pos, pages)

    def keep_resumable(self, node: TreeNode) -> None:
        """Mark node's end; the prompt ends above it on its path are a conversation's earlier turns,
        which this one continues past: they stop being kept."""
        if node is self.root:
            return
        node.resume = True
        up = node.parent
        while up is not None and up is not self.root:
            up.resume = False
            up = up.parent

    def _on_present(self, cached: list[int], given: Sequence[int]) -> None:
        # the inserting request's copies still hold window KV the tree may have dropped: keep it
        self.allocator.adopt(cached, given)

    def evict_window(self, wanted: Sequence[int], tails: bool = True) -> list[int]:
        """Free up to wanted[g] pages of window group g (only interiors unless `tails`). In a shared
        pool every group's pages are the pool's: wanted is one figure, and a page any group gives
        back counts for all. Returns the pages freed per group.

        Interiors go in two rounds (`NEAR_BANDS`): first what lies more than 2W before a guard, then
        down to W + W / 4 before it."""
        groups = self.allocator.groups
        shared = self.allocator.shared
        want = [max(wanted)] * len(groups) if shared else list(wanted)
        freed = [0] * len(groups)

        def took(g: int, got: int) -> None:
            freed[g] += got
            for k in range(len(want)) if shared else (g,):
                want[k] -= got

        if any(w > 0 for w in want):
            ends = self._ends()
            for extra in NEAR_BANDS:
                self._sweep_interiors(want, took, ends, extra)
        if tails:
            for g, group in enumerate(groups):
                if (
                    want[g] > 0
                ):  # a tail pass changes the tree: ends again for each group
                    took(g, self._evict_tails(group, want[g], self._ends()))
        return freed

    def _ends(self) -> dict[TreeNode, tuple[int, int]]:
        """(end, guard) of every node: the position after its last token, and the end of the first
        node at or below it where a match is worth keeping: a leaf, a branch point, or a node a
        request has locked (a node with one child is only where an earlier insert or chunk stopped)."""
        order, stack = [], [(self.root, 0)]
        while stack:
            node, start = stack.pop()
            end = start + len(node.key)
            order.append((node, end))
            stack.extend((child, end) for child in node.children.values())
        ends: dict[TreeNode, tuple[int, int]] = {}
        for node, end in reversed(order):  # children before their parents
            if node.pins or node.resume or len(node.children) != 1:
                ends[node] = (end, end)
            else:
                ends[node] = (end, ends[next(iter(node.children.values()))][1])
        return ends

    def _sweep_interiors(
        self, want: list[int], took, ends: dict[TreeNode, tuple[int, int]], extra: float
    ) -> None:
        """Pass 1, one round: interiors, the pages wholly before guard - (1 + extra) W + 1 (less a
        page of slack), least recently used nodes first, every group of a node before the next node
        (a match needs all of them)."""
        heap = [
            (n.last_access, -e[0], n.id, n)
            for n, e in ends.items()
            if n is not self.root
        ]
        heapq.heapify(heap)
        while heap and any(w > 0 for w in want):
            node = heapq.heappop(heap)[3]
            end, guard = ends[node]
            start = end - len(node.key)
            for g, group in enumerate(self.allocator.groups):
                deep = self._pages_before(guard, start, group.window, extra)
                if deep > 0 and want[g] > 0:
                    took(g, group.drop(node.value[:deep]))

    def _pages_before(self, guard: int, start: int, window: int, extra: float) -> int:
        """How many pages of a node starting at `start` lie wholly before guard - (1 + extra) W + 1,
        less a page of slack: those no match worth keeping reads (with extra 0: none at all)."""
        ps = self.page_size
        return (guard - window - int(extra * window) + 1 - ps - start) // ps

    def _band(
        self, leaf: TreeNode, groups, ends: dict[TreeNode, tuple[int, int]]
    ) -> list[tuple[WindowGroup, list[int]]]:
        """The live pages of `groups` more than W before the guards on the unlocked nodes of leaf's
        unbranched path (after pass 1: the W / 4 band): what the leaf's conversation gives back first."""
        band = []
        node, guard = (
            leaf,
            ends[leaf][0],
        )  # a leaf guards its end (ends' guards may predate a removal)
        while node is not self.root and len(node.children) <= 1 and node.lock_ref == 0:
            end = ends[node][0]
            guard = end if node.pins or node.resume else guard
            start = end - len(node.key)
            for group in groups:
                deep = self._pages_before(guard, start, group.window, 0.0)
                if deep > 0:
                    pages = [
                        p
                        for p, alive in zip(
                            node.value[:deep], group.alive(node.value[:deep])
                        )
                        if alive
                    ]
                    if pages:
                        band.append((group, pages))
            assert node.parent is not None  # below the root
            node = node.parent
        return band

    def _free_leaves(self, need: int) -> None:
        """Shared pool: least recently used leaves go whole until `need` pool pages are free, but a
        leaf whose path's band alone covers what is still short gives back only that (and stays)."""
        a = self.allocator
        if need <= a.num_free_pages:
            return
        ends = (
            self._ends()
        )  # the positions hold through removals; _band works out guards itself
        for node in self._lru_leaves():
            band = self._band(node, a.groups, ends)
            if sum(len(pages) for _, pages in band) >= need - a.num_free_pages:
                for group, pages in band:
                    group.drop(pages)
                return
            self._remove_leaf(node)
            if need <= a.num_free_pages:
                return

    def _evict_tails(
        self, group: WindowGroup, want: int, ends: dict[TreeNode, tuple[int, int]]
    ) -> int:
        """Pass 2: what is left on unlocked nodes, least recently used first (deeper first among
        equals); leaves go whole, inner nodes become tombstones."""
        heap = [
            (n.last_access, -e[0], n.id, n)
            for n, e in ends.items()
            if n is not self.root and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < want:
            node = heapq.heappop(heap)[3]
            if (
                node.parent is None
            ):  # queued twice (again when it became a leaf) and already removed
                continue
            if (
                node.children or self.replay
            ):  # with replay a leaf without its window stays usable
                freed += group.drop(node.value)
                continue
            band = self._band(node, [group], ends)
            if (
                sum(len(pages) for _, pages in band) >= want - freed
            ):  # its band is enough: the leaf stays
                freed += sum(group.drop(pages) for _, pages in band)
                break
            held = int(group.alive(node.value).sum())
            parent = node.parent
            self._remove_leaf(node)
            freed += held
            if not parent.children and parent is not self.root and parent.lock_ref == 0:
                heapq.heappush(
                    heap, (parent.last_access, -ends[parent][0], parent.id, parent)
                )
        return freed
