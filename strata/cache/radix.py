"""Radix prefix cache: a radix tree over token ids whose values are KV page ids.

Everything is page-aligned. A node's key is a tuple of token ids whose length is a multiple of
``page_size``; its value holds ``len(key) // page_size`` page ids, page ``i`` holding the KV of tokens
``key[i*ps:(i+1)*ps]``. Children are keyed by the tuple of their first page of tokens, so a lookup
step is one dict access. Prefixes shorter than a page are never shared.

Example with page_size 2. ``insert([1,2,3,4,5,6], [a,b,c])`` on an empty tree::

    root ── (1,2,3,4,5,6) [a,b,c]

``match_prefix([1,2,3,4,9,9])`` matches two pages, so it splits the node at that page boundary and
returns the front half (cached_len 4, pages [a,b]); the tail keeps page c::

    root ── (1,2,3,4) [a,b] ── (5,6) [c]
            ^ MatchResult.node

``insert([1,2,3,4,7,8], [x,y,z])`` returns prefix_len 4 and adds a branch. The tree takes z; the
caller still owns x and y (duplicates of a and b) and frees them::

    root ── (1,2,3,4) [a,b] ─┬─ (5,6) [c]
                             └─ (7,8) [z]

Locks count on a node and all its ancestors (``lock_ref`` of a node = locks held on it or below), so
an unlocked node has only unlocked descendants. Eviction frees unlocked leaves least recently used
first; a parent left childless becomes a candidate. Eviction trims a leaf's tail pages when only part
of it is needed, so ``evict(n)`` frees exactly ``min(n, evictable_pages)`` pages (a tree over
sliding-window KV takes whole leaves instead: a leaf cut short would end where its window is gone).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from strata.cache.allocator import GroupedPageAllocator, PageAllocator


class TreeNode:
    __slots__ = (
        "children",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "pins",
        "resume",
        "value",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        value: list[int],
        parent: TreeNode | None,
        last_access: int,
        node_id: int,
    ) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.pins = 0  # locks taken on this node itself (a request whose cached prefix ends here)
        self.resume = False  # a request's prompt ended here: a later one may resume here (`keep_resumable`)
        self.last_access = last_access  # value of a monotonic counter, not wall time
        self.id = node_id  # creation order; breaks LRU ties deterministically

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages={self.value}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    node: TreeNode  # deepest matched node (the root when nothing matched); lock this
    cached_len: int  # matched tokens, a multiple of page_size
    pages: list[int]  # page ids of the matched prefix, len == cached_len // page_size
    # tokens of cached_len that `load_prefix` just brought up from a slower tier, by tier name
    loaded: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class PrefixCache(Protocol):
    """What the scheduler asks of a prefix cache: lookup, locking, insertion, eviction.

    - ``match_prefix(token_ids)``: the longest prefix of token_ids the device pages hold, rounded
      down to whole pages. Refreshes the last-access time of the matched path; may split a node;
      does not lock.
    - ``insert(token_ids, pages)``: ``len(token_ids)`` must be a multiple of page_size and equal
      ``len(pages) * page_size`` (ValueError otherwise). Returns prefix_len, the number of leading
      tokens that were already in the tree. The tree takes ownership of ``pages[prefix_len // ps:]``.
      The caller still owns ``pages[:prefix_len // ps]`` and must free those it allocated itself
      (i.e. not the tree's own pages that it got from an earlier match).
    - ``inc_lock(node)`` / ``dec_lock(node)``: +1 / -1 lock on node and every ancestor. Locked nodes are
      never evicted. dec_lock raises RuntimeError if a count would go negative.
    - ``evict(n)``: frees up to n pages of unlocked leaves to the allocator, least recently used
      first; returns the number freed.
    - ``make_room(n)``: evicts until n pages can be allocated in every KV group (in a shared pool:
      n times its page cost); True if they can.
    - ``evictable_pages`` (unlocked), ``protected_pages`` (locked), ``total_pages`` (both).
    - ``reset()``: drop everything, freeing all pages to the allocator (RuntimeError while locked).
    - ``add_listener(listener)``: a `CacheListener` hears of every insertion and eviction from now on.

    What else a cache may be told lives in narrower roles: `WindowCache` (the KV of sliding-window
    layers) and `CacheTiers` (slower tiers behind the device cache, and the request events they
    act on).
    """

    page_size: int
    allocator: PageAllocator  # where evicted pages go

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult: ...
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int: ...
    def inc_lock(self, node: TreeNode) -> None: ...
    def dec_lock(self, node: TreeNode) -> None: ...
    def evict(self, num_pages: int) -> int: ...
    def make_room(self, num_pages: int, present: np.ndarray | None = None) -> bool: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def protected_pages(self) -> int: ...
    @property
    def total_pages(self) -> int: ...
    def reset(self) -> None: ...
    def add_listener(self, listener: CacheListener) -> None: ...


class CacheListener(Protocol):
    """Hears what enters and leaves a `PrefixCache` (a slower tier behind it: `HiCache`). Both are
    called on the scheduler thread, before the cache's own call returns.

    - ``on_insert(tokens, pages, new_from)``: ``tokens[new_from:]`` just entered the tree with
      ``pages[new_from // page_size:]`` (``tokens[:new_from]`` were there already).
    - ``on_evict(prefix, tokens, pages)``: ``pages`` (holding ``tokens``, which follow ``prefix`` on
      their path from the root) are about to be freed.
    """

    def on_insert(
        self, tokens: Sequence[int], pages: Sequence[int], new_from: int
    ) -> None: ...
    def on_evict(
        self, prefix: tuple[int, ...], tokens: tuple[int, ...], pages: list[int]
    ) -> None: ...


@runtime_checkable
class WindowCache(Protocol):
    """What the scheduler tells a prefix cache over window groups (`GroupedPageAllocator`: the
    KV of sliding-window layers). A cache over full-attention KV only answers with no-ops.

    - ``keep_resumable(node)``: a request's prompt ended at the end of ``node``, so its next turn (or
      a retry) resumes there even when the text that follows re-tokenizes differently: a window cache
      keeps what resuming there reads, as it does at leaf ends and branch points (only the latest
      prompt end on a path: an earlier turn's is passed by the later one).
    - ``evict_window(wanted, tails=True)``: frees up to wanted[g] pages of each window group
      (only KV no match reads unless ``tails``); returns the count per group (zeros elsewhere).
    - ``window_pages()``: per window group, the pages the cache holds (walks the tree).
    """

    def keep_resumable(self, node: TreeNode) -> None: ...
    def evict_window(self, wanted: Sequence[int], tails: bool = True) -> list[int]: ...
    def window_pages(self) -> list[int]: ...


@runtime_checkable
class CacheTiers(Protocol):
    """Slower tiers behind the device's `PrefixCache` (`HiCache`: host memory, storage), and the
    request events they act on, all on the scheduler thread. `DeviceOnly` is the empty one.

    - ``load_prefix(token_ids)``: what admission calls instead of the device cache's
      ``match_prefix``: that match, extended by the pages a slower tier holds (copied into fresh
      device pages and inserted, unlocked; this may evict). ``MatchResult.loaded`` counts the
      tokens each tier gave.
    - ``on_arrival(rid, token_ids)``: a request arrived; the tiers may start fetching its pages.
    - ``ready(rid)``: False while the request should wait for such a fetch before admission.
    - ``on_admitted(query_len, hits)``: a request's first admission reused ``hits`` tokens per
      tier ("device", "host", "storage") of the ``query_len`` it could have reused.
    - ``on_finished(rid)``: the request is gone.
    - ``poll()``: once per step: apply background work that finished (fetched pages land).
    - ``fetching()``: True while a fetch a waiting request may wait for is in flight.
    - ``reset()``: drop what the tiers of this engine alone hold (after the device cache's reset).
    """

    def load_prefix(self, token_ids: Sequence[int]) -> MatchResult: ...
    def on_arrival(self, rid: str, token_ids: Sequence[int]) -> None: ...
    def ready(self, rid: str) -> bool: ...
    def on_admitted(self, query_len: int, hits: dict[str, int]) -> None: ...
    def on_finished(self, rid: str) -> None: ...
    def poll(self) -> None: ...
    def fetching(self) -> bool: ...
    def reset(self) -> None: ...


class DeviceOnly:
    """The `CacheTiers` of a device cache with nothing behind it: lookups only match."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def load_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return self.cache.match_prefix(token_ids)

    def on_arrival(self, rid: str, token_ids: Sequence[int]) -> None:
        pass

    def ready(self, rid: str) -> bool:
        return True

    def on_admitted(self, query_len: int, hits: dict[str, int]) -> None:
        pass

    def on_finished(self, rid: str) -> None:
        pass

    def poll(self) -> None:
        pass

    def fetching(self) -> bool:
        return False

    def reset(self) -> None:
        pass


class RoomMaker:
    """`make_room` for the device caches, over their own eviction (`evict`, `evict_window`)."""

    allocator: PageAllocator

    if TYPE_CHECKING:  # the cache this is mixed into provides them

        def evict(self, num_pages: int) -> int: ...
        def evict_window(
            self, wanted: Sequence[int], tails: bool = True
        ) -> list[int]: ...

    def make_room(self, num_pages: int, present: np.ndarray | None = None) -> bool:
        if self.allocator.shared:
            return self._make_shared_room(num_pages, present)
        short = num_pages - self.allocator.num_free_pages
        if short > 0:
            self.evict(short)
        groups = self.allocator.groups
        if groups and any(g.num_free_pages < num_pages for g in groups):
            self.evict_window([num_pages - g.num_free_pages for g in groups])
        return self.allocator.can_alloc(num_pages)

    def _make_shared_room(self, num_pages: int, present: np.ndarray | None) -> bool:
        """make_room for window groups that share the primary pool: each new page takes `page_cost`
        of it (or 1 + its `present` parts). Frees, in order, window KV no match reads (interiors),
        least recently used cached leaves whole (every group's part with them), then inner nodes'
        window KV."""
        a = self.allocator
        assert isinstance(a, GroupedPageAllocator)  # only it shares the pool
        need = a.pool_cost(num_pages, present)
        if need > a.num_free_pages:
            self.evict_window([need - a.num_free_pages] * len(a.groups), tails=False)
        self._free_leaves(need)
        if need > a.num_free_pages:
            self.evict_window([need - a.num_free_pages] * len(a.groups))
        return a.can_alloc(num_pages, present)

    def _free_leaves(self, need: int) -> None:
        """Shared pool: least recently used leaves whole until `need` pool pages are free
        (WindowRadixCache may give back a leaf's band instead)."""
        a = self.allocator
        assert isinstance(a, GroupedPageAllocator)  # only it shares the pool
        while need > a.num_free_pages and self.evict(
            -(-(need - a.num_free_pages) // a.page_cost)
        ):
            pass


def _check_insert_args(token_ids: Sequence[int], pages: Sequence[int], ps: int) -> None:
    n = len(token_ids)
    if n % ps or len(pages) * ps != n:
        raise ValueError(
            f"insert of {n} tokens with {len(pages)} pages of size {ps}: must be page-aligned"
        )


class RadixCache(RoomMaker):
    """PrefixCache (and a full-attention `WindowCache`) over a radix tree; evicted pages go back
    to ``allocator``. Its listeners hear of every insertion, and of evicted pages just before they
    are freed (a slower tier behind this cache copies them there)."""

    trims_leaves = (
        True  # evict may take a leaf's tail pages alone (False: whole leaves only)
    )

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.listeners: list[CacheListener] = []
        self._clock = 0
        self._next_id = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = self._new_node((), [], None)
        self._evictable = 0
        self._protected = 0

    def _new_node(
        self, key: tuple[int, ...], value: list[int], parent: TreeNode | None
    ) -> TreeNode:
        self._next_id += 1
        return TreeNode(key, value, parent, self._clock, self._next_id)

    # -------------------------------------------------------------------------------- lookup / insert

    def _descend(self, tokens: tuple[int, ...]) -> tuple[TreeNode, int, list[int]]:
        """Follow page-aligned ``tokens`` from the root while whole pages match, splitting the node in
        which the match ends. Refreshes the matched path. Returns (node, matched tokens, pages)."""
        ps = self.page_size
        self._clock += 1
        now = self._clock
        node, pos, pages = self.root, 0, []
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            key = child.key
            if tokens[pos : pos + len(key)] == key:  # fast path: the whole node matches
                m = len(key)
            else:
                lim = min(len(key), n - pos)
                m = ps  # the first page matched through the dict lookup
                while m < lim and key[m : m + ps] == tokens[pos + m : pos + m + ps]:
                    m += ps
            if m < len(key):
                child = self._split(child, m)
            child.last_access = now
            pages.extend(child.value)
            node = child
            pos += m
            if m < len(key):
                break
        return node, pos, pages

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens (a page boundary); return the new front node (on the
        path being matched, so the caller refreshes its last access)."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key) and m % ps == 0
        front = self._new_node(child.key[:m], child.value[: m // ps], parent)
        front.lock_ref = child.lock_ref  # every lock below child is below front too
        parent.children[child.key[:ps]] = front
        child.key = child.key[m:]
        child.value = child.value[m // ps :]
        child.parent = front
        front.children[child.key[:ps]] = child
        return front

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        n = len(token_ids) // self.page_size * self.page_size
        node, pos, pages = self._descend(tuple(token_ids[:n]))
        return MatchResult(node, pos, pages)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        ps = self.page_size
        _check_insert_args(token_ids, pages, ps)
        tokens = tuple(token_ids)
        node, pos, present = self._descend(tokens)
        self._on_present(present, pages[: pos // ps])
        if pos < len(tokens):
            leaf = self._new_node(tokens[pos:], list(pages[pos // ps :]), node)
            node.children[tokens[pos : pos + ps]] = leaf
            self._evictable += len(leaf.value)
            for listener in self.listeners:
                listener.on_insert(tokens, pages, pos)
        return pos

    def add_listener(self, listener: CacheListener) -> None:
        self.listeners.append(listener)

    def _on_present(self, cached: list[int], given: Sequence[int]) -> None:
        """An insert found ``given`` already cached as ``cached`` (the caller frees its copies)."""

    # -------------------------------------------------------------------------------- locks

    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        n: TreeNode | None = node
        while n is not None:
            path.append(n)
            last, n = n, n.parent
        if last is not self.root:
            raise RuntimeError(f"{node!r} is not in the tree (evicted or reset)")
        return path

    def inc_lock(self, node: TreeNode) -> None:
        path = self._path(node)
        node.pins += 1
        for n in path:
            if n.lock_ref == 0:
                k = len(n.value)
                self._evictable -= k
                self._protected += k
            n.lock_ref += 1

    def dec_lock(self, node: TreeNode) -> None:
        path = self._path(node)
        if node.lock_ref <= 0:  # ancestors hold at least as many locks as node
            raise RuntimeError(f"dec_lock on unlocked {node!r}")
        node.pins -= 1
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                k = len(n.value)
                self._evictable += k
                self._protected -= k

    # -------------------------------------------------------------------------------- eviction

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _lru_leaves(self) -> Iterator[TreeNode]:
        """Unlocked leaves, least recently used first. When the caller removes the leaf it was just
        given (`_remove_leaf`) and that leaves its parent an unlocked leaf, the parent joins in turn."""
        heap = [
            (n.last_access, n.id, n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0 and n is not self.root
        ]
        heapq.heapify(heap)
        while heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            yield node
            if (
                node.parent is None
                and parent is not None
                and not parent.children
                and parent.lock_ref == 0
                and parent is not self.root
            ):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def evict(self, num_pages: int) -> int:
        if num_pages <= 0 or self._evictable == 0:
            return 0
        ps = self.page_size
        freed = 0
        for node in self._lru_leaves():
            if freed >= num_pages:
                break
            want = num_pages - freed
            if (
                self.trims_leaves and len(node.value) > want
            ):  # only part of this leaf is needed: drop its tail
                keep = len(node.value) - want
                self._before_free(node, keep)
                self.allocator.free(node.value[keep:])
                node.value = node.value[:keep]
                node.key = node.key[: keep * ps]
                freed += want
                self._evictable -= want
                break
            freed += self._remove_leaf(node)
        return freed

    def keep_resumable(self, node: TreeNode) -> None:
        pass  # a full-attention tree resumes anywhere (WindowRadixCache keeps what resuming reads)

    def evict_window(self, wanted: Sequence[int], tails: bool = True) -> list[int]:
        return [0] * len(wanted)  # no window groups (WindowRadixCache has them)

    def window_pages(self) -> list[int]:
        """Per window group of the allocator, the pages the tree still holds (walks the tree)."""
        return self.allocator.group_pages_held(
            p for n in self._nodes() for p in n.value
        )

    def _remove_leaf(self, node: TreeNode) -> int:
        """Free an unlocked leaf's pages and detach it. Returns the pages freed."""
        self._before_free(node, 0)
        self.allocator.free(node.value)
        self._evictable -= len(node.value)
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key[: self.page_size]]
        node.parent = None  # detached: locking it now raises
        return len(node.value)

    def _before_free(self, node: TreeNode, keep_pages: int) -> None:
        """Tell the listeners about node.value[keep_pages:] before those pages are freed."""
        if not self.listeners:
            return
        keys = []
        n = node.parent
        while n is not None and n is not self.root:
            keys.append(n.key)
            n = n.parent
        cut = keep_pages * self.page_size
        prefix = tuple(t for key in reversed(keys) for t in key) + node.key[:cut]
        for listener in self.listeners:
            listener.on_evict(prefix, node.key[cut:], node.value[keep_pages:])

    # -------------------------------------------------------------------------------- accounting

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> None:
        if self.root.lock_ref:
            raise RuntimeError(f"reset with {self.root.lock_ref} lock(s) held")
        self.allocator.free([p for n in self._nodes() for p in n.value])
        self._new_tree()

    def pretty(self) -> str:
        lines = [
            f"root lock={self.root.lock_ref} evictable={self._evictable} protected={self._protected}"
        ]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key):
                key = child.key if len(child.key) <= 8 else child.key[:8] + ("...",)
                lines.append(
                    f"{'  ' * depth}{key} pages={child.value} lock={child.lock_ref} t={child.last_access}"
                )
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)


class NoPrefixCache(RoomMaker):
    """PrefixCache (and `WindowCache`) that caches nothing (``--disable-radix-cache``).

    match_prefix never matches; insert reports every token as already present, so the caller frees all
    of its pages; nothing is ever held, so evict frees nothing, every count is 0 and a listener
    never hears anything.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = TreeNode((), [], None, 0, 0)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(self.root, 0, [])

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        _check_insert_args(token_ids, pages, self.page_size)
        return len(token_ids)

    def add_listener(self, listener: CacheListener) -> None:
        pass  # nothing enters or leaves

    def inc_lock(self, node: TreeNode) -> None:
        node.lock_ref += 1

    def dec_lock(self, node: TreeNode) -> None:
        if node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock on unlocked {node!r}")
        node.lock_ref -= 1

    def evict(self, num_pages: int) -> int:
        return 0

    def keep_resumable(self, node: TreeNode) -> None:
        pass

    def evict_window(self, wanted: Sequence[int], tails: bool = True) -> list[int]:
        return [0] * len(wanted)

    def window_pages(self) -> list[int]:
        return [0] * len(self.allocator.groups)

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0

    @property
    def total_pages(self) -> int:
        return 0

    def reset(self) -> None:
        if self.root.lock_ref:
            raise RuntimeError(f"reset with {self.root.lock_ref} lock(s) held")

    def pretty(self) -> str:
        return f"NoPrefixCache(page_size={self.page_size})"
