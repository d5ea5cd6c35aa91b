from __future__ import annotations

import random
from collections import Counter

import pytest

from strata.cache.allocator import PageAllocator
from strata.cache.radix import (
    CacheTiers,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    RadixCache,
    WindowCache,
)

PAGE_SIZES = [1, 4]


def seq(ps: int, *syms: int) -> list[int]:
    """One page per symbol: page s is [s*10, s*10+1, ...] (ps tokens)."""
    return [s * 10 + k for s in syms for k in range(ps)]


def make(ps: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, ps)
    return alloc, RadixCache(alloc)


def insert_fresh(
    alloc: PageAllocator, cache: RadixCache, tokens: list[int]
) -> tuple[list[int], int]:
    """Insert with freshly allocated pages; free the duplicates like a caller must."""
    pages = alloc.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    prefix = cache.insert(tokens, pages)
    alloc.free(pages[: prefix // cache.page_size])
    return pages, prefix


def node_path(node) -> tuple[int, ...]:
    parts = []
    while node is not None:
        parts.append(tuple(node.key))
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def check_counts(alloc: PageAllocator, cache) -> None:
    assert cache.evictable_pages + cache.protected_pages == cache.total_pages
    assert alloc.num_free_pages + cache.total_pages == alloc.num_pages


# ---------------------------------------------------------------------------------------------- basics


def test_protocol_conformance():
    alloc = PageAllocator(4, 2)
    for c in (RadixCache(alloc), NoPrefixCache(alloc)):
        assert isinstance(c, PrefixCache) and isinstance(c, WindowCache)
        assert not isinstance(c, CacheTiers)  # tiers are another object's role
        assert c.page_size == 2


class Recorder:
    """A `CacheListener` that keeps what it heard."""

    def __init__(self) -> None:
        self.heard: list[tuple] = []

    def on_insert(self, tokens, pages, new_from):
        self.heard.append(("insert", tuple(tokens), list(pages), new_from))

    def on_evict(self, prefix, tokens, pages):
        self.heard.append(("evict", prefix, tokens, list(pages)))


def test_listeners_hear_what_enters_and_leaves():
    alloc, cache = make(2, num_pages=8)
    rec = Recorder()
    cache.add_listener(rec)
    a = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], a) == 0
    b = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 7, 8], b) == 4  # only (7, 8) is new
    alloc.free(b[:2])
    cache.match_prefix([1, 2, 3, 4])  # a lookup is not news
    assert cache.insert([1, 2], a[:1]) == 2  # nothing new: not heard
    assert rec.heard == [
        ("insert", (1, 2, 3, 4, 5, 6), a, 0),
        ("insert", (1, 2, 3, 4, 7, 8), b, 4),
    ]
    rec.heard.clear()
    cache.match_prefix([1, 2, 3, 4, 7, 8])  # (5, 6) is now the least recent leaf
    assert cache.evict(1) == 1
    assert rec.heard == [("evict", (1, 2, 3, 4), (5, 6), [a[2]])]
    check_counts(alloc, cache)


def test_no_prefix_cache_has_nothing_to_tell():
    alloc = PageAllocator(8, 2)
    cache, rec = NoPrefixCache(alloc), Recorder()
    cache.add_listener(rec)
    pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], pages) == 4 and cache.evict(2) == 0
    assert rec.heard == []


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_empty_match(ps):
    alloc, cache = make(ps)
    m = cache.match_prefix(seq(ps, 1, 2))
    assert isinstance(m, MatchResult)
    assert m.node is cache.root and m.cached_len == 0 and m.pages == []
    assert cache.match_prefix([]).cached_len == 0
    assert cache.total_pages == 0
    check_counts(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_prefix_of_inserted(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3, 4)
    pages, prefix = insert_fresh(alloc, cache, toks)
    assert prefix == 0
    assert cache.total_pages == 4 and cache.evictable_pages == 4
    check_counts(alloc, cache)

    m = cache.match_prefix(toks)
    assert m.cached_len == 4 * ps and m.pages == pages
    assert node_path(m.node) == tuple(toks)

    # longer query: only the cached part matches
    m = cache.match_prefix(toks + seq(ps, 9))
    assert m.cached_len == 4 * ps and m.pages == pages

    # divergent query
    assert cache.match_prefix(seq(ps, 5)).cached_len == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_rounds_down_to_pages(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3)
    pages, _ = insert_fresh(alloc, cache, toks)
    # query of 2.5 pages (for ps>1) -> 2 pages
    q = toks[: 2 * ps + ps // 2]
    m = cache.match_prefix(q)
    assert m.cached_len == 2 * ps and m.pages == pages[:2]
    # mismatch inside the third page -> 2 pages
    q = toks[: 3 * ps - 1] + [999]
    m = cache.match_prefix(q)
    assert m.cached_len == 2 * ps and m.pages == pages[:2]


def test_match_mismatch_mid_page_ps4():
    alloc, cache = make(4)
    pages, _ = insert_fresh(alloc, cache, [1, 1, 1, 1, 2, 2, 2, 2])
    m = cache.match_prefix([1, 1, 1, 1, 2, 2, 9, 9])
    assert m.cached_len == 4 and m.pages == pages[:1]
    m = cache.match_prefix([1, 1, 1, 9])
    assert m.cached_len == 0 and m.pages == [] and m.node is cache.root


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_mid_node_splits(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3, 4)
    pages, _ = insert_fresh(alloc, cache, toks)
    (only,) = cache.root.children.values()
    assert len(only.value) == 4

    m = cache.match_prefix(seq(ps, 1, 2, 7))
    assert m.cached_len == 2 * ps and m.pages == pages[:2]
    # the node was split at the page boundary
    assert m.node.parent is cache.root
    assert tuple(m.node.key) == tuple(toks[: 2 * ps]) and m.node.value == pages[:2]
    (tail,) = m.node.children.values()
    assert tuple(tail.key) == tuple(toks[2 * ps :]) and tail.value == pages[2:]
    assert tail.parent is m.node
    assert cache.total_pages == 4
    check_counts(alloc, cache)

    # everything still matches after the split
    m = cache.match_prefix(toks)
    assert m.cached_len == 4 * ps and m.pages == pages and m.node is tail
    # matching exactly the split point returns the split node, no further split
    m2 = cache.match_prefix(toks[: 2 * ps])
    assert m2.node is tail.parent and m2.pages == pages[:2]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_extension_returns_prefix(ps):
    alloc, cache = make(ps)
    a = seq(ps, 1, 2)
    pa, prefix = insert_fresh(alloc, cache, a)
    assert prefix == 0
    b = seq(ps, 1, 2, 3, 4)
    pb = alloc.alloc(4)
    prefix = cache.insert(b, pb)
    assert prefix == 2 * ps
    alloc.free(pb[:2])  # the duplicates: the tree keeps its own
    m = cache.match_prefix(b)
    assert m.cached_len == 4 * ps and m.pages == pa + pb[2:]
    assert cache.total_pages == 4
    check_counts(alloc, cache)

    # re-inserting something fully present returns its whole length and takes nothing
    pc = alloc.alloc(2)
    assert cache.insert(b[: 2 * ps], pc) == 2 * ps
    alloc.free(pc)
    check_counts(alloc, cache)
    # empty insert
    assert cache.insert([], []) == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_with_matched_pages(ps):
    """The scheduler path: match, reuse the tree's pages, allocate only the rest."""
    alloc, cache = make(ps)
    pa, _ = insert_fresh(alloc, cache, seq(ps, 1, 2, 3))
    toks = seq(ps, 1, 2, 5, 6)
    m = cache.match_prefix(toks)
    assert m.cached_len == 2 * ps
    new = alloc.alloc(2)
    prefix = cache.insert(toks, m.pages + new)
    assert prefix == 2 * ps  # nothing of our own to free
    assert cache.match_prefix(toks).pages == pa[:2] + new
    assert cache.total_pages == 5
    check_counts(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_branching(ps):
    alloc, cache = make(ps)
    a = seq(ps, 1, 2, 3)
    b = seq(ps, 1, 2, 4, 5)
    pa, _ = insert_fresh(alloc, cache, a)
    pb, prefix = insert_fresh(alloc, cache, b)
    assert prefix == 2 * ps
    assert cache.match_prefix(a).pages == pa
    assert cache.match_prefix(b).pages == pa[:2] + pb[2:]
    (mid,) = cache.root.children.values()
    assert mid.value == pa[:2] and len(mid.children) == 2
    assert cache.total_pages == 5
    check_counts(alloc, cache)
    # a third branch off the root
    _, prefix = insert_fresh(alloc, cache, seq(ps, 7))
    assert prefix == 0 and len(cache.root.children) == 2
    check_counts(alloc, cache)


def test_insert_branch_mid_page_ps4():
    alloc, cache = make(4)
    a = [1, 1, 1, 1, 2, 2, 2, 2]
    b = [1, 1, 1, 1, 2, 2, 9, 9]
    pa, _ = insert_fresh(alloc, cache, a)
    pb, prefix = insert_fresh(alloc, cache, b)
    assert prefix == 4
    assert cache.match_prefix(a).pages == pa
    assert cache.match_prefix(b).pages == [pa[0], pb[1]]
    check_counts(alloc, cache)


@pytest.mark.parametrize("ps", [2, 4])
def test_insert_validation(ps):
    alloc, cache = make(ps)
    with pytest.raises(ValueError):
        cache.insert(list(range(ps + 1)), [0])  # not page aligned
    with pytest.raises(ValueError):
        cache.insert(list(range(2 * ps)), [0])  # wrong page count
    with pytest.raises(ValueError):
        NoPrefixCache(alloc).insert(list(range(ps + 1)), [0])
    assert cache.total_pages == 0


# ---------------------------------------------------------------------------------------------- locks


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lock_protects_from_eviction(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3)
    pages, _ = insert_fresh(alloc, cache, toks)
    m = cache.match_prefix(toks)
    cache.inc_lock(m.node)
    assert cache.protected_pages == 3 and cache.evictable_pages == 0
    check_counts(alloc, cache)
    assert cache.evict(10) == 0
    assert cache.match_prefix(toks).pages == pages
    cache.dec_lock(m.node)
    assert cache.protected_pages == 0 and cache.evictable_pages == 3
    assert cache.evict(10) == 3
    assert alloc.num_free_pages == alloc.num_pages
    assert cache.total_pages == 0
    assert cache.match_prefix(toks).cached_len == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lock_partial_path(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3, 4)
    pages, _ = insert_fresh(alloc, cache, toks)
    m = cache.match_prefix(toks[: 2 * ps])  # splits
    cache.inc_lock(m.node)
    assert cache.protected_pages == 2 and cache.evictable_pages == 2
    assert cache.evict(10) == 2  # less than asked: only the unlocked tail goes
    assert all(alloc.is_free(p) for p in pages[2:])
    assert cache.match_prefix(toks).pages == pages[:2]
    check_counts(alloc, cache)
    cache.dec_lock(m.node)
    assert cache.evict(10) == 2
    check_counts(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_nested_locks_and_split_under_lock(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3, 4)
    insert_fresh(alloc, cache, toks)
    deep = cache.match_prefix(toks).node
    cache.inc_lock(deep)
    cache.inc_lock(deep)
    # a later match splits the locked node; counts and locks stay right
    mid = cache.match_prefix(toks[:ps]).node
    assert mid.lock_ref == 2 and deep.lock_ref == 2
    assert cache.protected_pages == 4 and cache.evictable_pages == 0
    cache.inc_lock(mid)
    assert mid.lock_ref == 3 and cache.protected_pages == 4
    cache.dec_lock(deep)
    cache.dec_lock(deep)
    assert cache.protected_pages == 1 and cache.evictable_pages == 3
    assert cache.evict(100) == 3
    cache.dec_lock(mid)
    assert cache.protected_pages == 0 and cache.evictable_pages == 1
    check_counts(alloc, cache)


def test_dec_lock_below_zero_raises():
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2])
    m = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.dec_lock(m.node)
    cache.inc_lock(m.node)
    cache.dec_lock(m.node)
    with pytest.raises(RuntimeError):
        cache.dec_lock(m.node)
    with pytest.raises(RuntimeError):
        cache.dec_lock(cache.root)
    assert cache.evictable_pages == 2 and cache.protected_pages == 0


def test_lock_root_is_harmless():
    alloc, cache = make(1)
    m = cache.match_prefix([5])
    cache.inc_lock(m.node)
    assert cache.protected_pages == 0
    insert_fresh(alloc, cache, [5])
    assert cache.evictable_pages == 1
    cache.dec_lock(m.node)


def test_lock_evicted_node_raises():
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    assert cache.evict(2) == 2
    with pytest.raises(RuntimeError):
        cache.inc_lock(node)
    assert cache.protected_pages == 0


# ---------------------------------------------------------------------------------------------- eviction


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lru_order(ps):
    alloc, cache = make(ps)
    pa, _ = insert_fresh(alloc, cache, seq(ps, 1, 1))
    pb, _ = insert_fresh(alloc, cache, seq(ps, 2, 2))
    pc, _ = insert_fresh(alloc, cache, seq(ps, 3, 3))
    cache.match_prefix(seq(ps, 1, 1, 9))  # touch all of A: B is now the oldest
    assert cache.evict(2) == 2
    assert all(alloc.is_free(p) for p in pb)
    assert not any(alloc.is_free(p) for p in pa + pc)
    assert cache.evict(2) == 2
    assert all(alloc.is_free(p) for p in pc)
    assert cache.match_prefix(seq(ps, 1, 1)).pages == pa
    check_counts(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_refreshes_lru(ps):
    alloc, cache = make(ps)
    pa, _ = insert_fresh(alloc, cache, seq(ps, 1))
    pb, _ = insert_fresh(alloc, cache, seq(ps, 2))
    insert_fresh(alloc, cache, seq(ps, 1))  # already present, but touched
    assert cache.evict(1) == 1
    assert all(alloc.is_free(p) for p in pb)
    assert not alloc.is_free(pa[0])


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_partial_match_refreshes_only_prefix(ps):
    alloc, cache = make(ps)
    pa, _ = insert_fresh(alloc, cache, seq(ps, 1, 1))
    pb, _ = insert_fresh(alloc, cache, seq(ps, 2))
    cache.match_prefix(seq(ps, 1))  # splits A; only its first page is touched
    assert cache.evict(1) == 1
    assert alloc.is_free(pa[1])  # A's tail is still the least recently used leaf
    assert cache.evict(1) == 1
    assert alloc.is_free(pb[0])
    assert cache.match_prefix(seq(ps, 1, 1)).pages == pa[:1]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_parent_evicted_after_children(ps):
    alloc, cache = make(ps)
    pa, _ = insert_fresh(alloc, cache, seq(ps, 1, 2))
    pb, _ = insert_fresh(alloc, cache, seq(ps, 1, 3))
    # B's insert split A: parent [1] and leaf [2] (A's old timestamp), leaf [3] (newest)
    assert (
        cache.evict(1) == 1
    )  # leaf A's tail (oldest leaf); the parent is not a leaf yet
    assert alloc.is_free(pa[1]) and not alloc.is_free(pa[0])
    assert cache.evict(1) == 1  # leaf B's tail
    assert alloc.is_free(pb[1])
    # the parent is now a leaf and evictable
    assert cache.evictable_pages == 1
    assert cache.evict(1) == 1
    assert alloc.is_free(pa[0])
    assert cache.total_pages == 0 and not cache.root.children
    check_counts(alloc, cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_all_in_one_call(ps):
    alloc, cache = make(ps)
    insert_fresh(alloc, cache, seq(ps, 1, 2))
    insert_fresh(alloc, cache, seq(ps, 1, 3, 4))
    insert_fresh(alloc, cache, seq(ps, 5))
    assert cache.total_pages == 5
    assert cache.evict(100) == 5
    assert alloc.num_free_pages == alloc.num_pages
    assert not cache.root.children
    assert cache.evict(1) == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_trims_leaf_tail(ps):
    alloc, cache = make(ps)
    toks = seq(ps, 1, 2, 3, 4)
    pages, _ = insert_fresh(alloc, cache, toks)
    assert cache.evict(1) == 1  # exactly what was asked, not the whole node
    assert alloc.is_free(pages[3]) and alloc.num_free_pages == alloc.num_pages - 3
    assert cache.match_prefix(toks).pages == pages[:3]
    assert cache.evict(0) == 0
    check_counts(alloc, cache)


def test_pages_freed_exactly_once():
    alloc, cache = make(2, num_pages=16)
    insert_fresh(alloc, cache, seq(2, 1, 2, 3))
    insert_fresh(alloc, cache, seq(2, 1, 2, 4))
    insert_fresh(alloc, cache, seq(2, 1, 5))
    freed: list[int] = []
    orig_free = alloc.free

    def spy(pages):
        pages = list(pages)
        freed.extend(pages)
        orig_free(pages)

    alloc.free = spy  # type: ignore[method-assign]
    for _ in range(10):
        cache.evict(1)
    assert sorted(freed) == sorted(set(freed)) and len(freed) == 5
    assert alloc.num_free_pages == 16


# ---------------------------------------------------------------------------------------------- reset / misc


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_reset(ps):
    alloc, cache = make(ps)
    insert_fresh(alloc, cache, seq(ps, 1, 2))
    insert_fresh(alloc, cache, seq(ps, 1, 3))
    m = cache.match_prefix(seq(ps, 1, 2))
    cache.inc_lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock(m.node)
    cache.reset()
    assert cache.total_pages == 0 and alloc.num_free_pages == alloc.num_pages
    assert cache.match_prefix(seq(ps, 1, 2)).cached_len == 0
    insert_fresh(alloc, cache, seq(ps, 1, 2))
    assert cache.total_pages == 2


def test_pretty():
    alloc, cache = make(2)
    insert_fresh(alloc, cache, seq(2, 1, 2))
    insert_fresh(alloc, cache, seq(2, 1, 3))
    cache.inc_lock(cache.match_prefix(seq(2, 1, 2)).node)
    s = cache.pretty()
    assert isinstance(s, str) and s.count("\n") >= 3
    assert isinstance(NoPrefixCache(alloc).pretty(), str)


def test_no_prefix_cache():
    alloc = PageAllocator(8, 2)
    cache = NoPrefixCache(alloc)
    toks = [1, 2, 3, 4]
    pages = alloc.alloc(2)
    assert cache.insert(toks, pages) == 4  # "all present": caller frees all its pages
    alloc.free(pages)
    m = cache.match_prefix(toks)
    assert m.cached_len == 0 and m.pages == [] and m.node is cache.root
    cache.inc_lock(m.node)
    assert cache.evict(5) == 0
    assert cache.evictable_pages == cache.protected_pages == cache.total_pages == 0
    cache.dec_lock(m.node)
    with pytest.raises(RuntimeError):
        cache.dec_lock(m.node)
    cache.reset()
    assert alloc.num_free_pages == 8


# ---------------------------------------------------------------------------------------------- randomized


class Model:
    """Brute force: the cache is a prefix-closed dict {page-aligned token prefix: page id}."""

    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.pages: dict[tuple[int, ...], int] = {}
        self.ts: dict[tuple[int, ...], int] = {}
        self.tick = 0

    def longest(self, toks) -> int:
        k = 0
        while (k + 1) * self.ps <= len(toks) and tuple(
            toks[: (k + 1) * self.ps]
        ) in self.pages:
            k += 1
        return k * self.ps

    def touch(self, toks, n: int) -> None:
        self.tick += 1
        for i in range(n // self.ps):
            self.ts[tuple(toks[: (i + 1) * self.ps])] = self.tick


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    ps = cache.page_size
    out: dict[tuple[int, ...], int] = {}
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert len(child.key) > 0 and len(child.key) % ps == 0
            assert len(child.value) * ps == len(child.key)
            assert tuple(child.key[:ps]) == tuple(first)
            assert child.lock_ref <= node.lock_ref
            p = prefix
            for i, page in enumerate(child.value):
                p = p + tuple(child.key[i * ps : (i + 1) * ps])
                assert p not in out
                out[p] = page
            stack.append((child, p))
    return out


def all_nodes(cache: RadixCache):
    stack = [cache.root]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def run_random(seed: int, ps: int, num_pages: int = 40, n_ops: int = 2000) -> None:
    rng = random.Random(seed * 1000 + ps)
    alloc = PageAllocator(num_pages, ps)
    cache = RadixCache(alloc)
    model = Model(ps)
    held: list[tuple[object, tuple[int, ...]]] = []  # (locked node, its token path)
    history: list[list[int]] = [[]]
    alphabet = rng.choice([1, 3])  # tokens 0..alphabet

    def gen(aligned: bool) -> list[int]:
        base = rng.choice(history)
        cut = rng.randint(0, len(base))
        toks = base[:cut] + [
            rng.randint(0, alphabet) for _ in range(rng.randint(0, 3 * ps + 2))
        ]
        if rng.random() < 0.3:
            toks = [rng.randint(0, alphabet) for _ in range(rng.randint(0, 6 * ps))]
        toks = toks[: 8 * ps]
        if aligned:
            toks = toks[: len(toks) // ps * ps]
        return toks

    def locked_prefixes() -> set[tuple[int, ...]]:
        out = set()
        for _, path in held:
            for i in range(len(path) // ps):
                out.add(path[: (i + 1) * ps])
        return out

    def check_match(toks) -> MatchResult:
        expect = model.longest(toks)
        m = cache.match_prefix(toks)
        assert m.cached_len == expect
        assert m.pages == [
            model.pages[tuple(toks[: (i + 1) * ps])] for i in range(expect // ps)
        ]
        assert node_path(m.node) == tuple(toks[:expect])
        if expect:
            model.touch(toks, expect)
        return m

    def do_evict(n: int) -> None:
        ev = cache.evictable_pages
        before = alloc.num_free_pages
        freed = cache.evict(n)
        assert freed == min(n, ev)
        assert alloc.num_free_pages == before + freed
        gone = {p for p, page in model.pages.items() if alloc.is_free(page)}
        assert len(gone) == freed
        assert not gone & locked_prefixes(), "a locked page was evicted"
        if gone:
            # LRU: nothing evicted is newer than anything unlocked that stays
            locked = locked_prefixes()
            stay = [
                model.ts[p] for p in model.pages if p not in gone and p not in locked
            ]
            if stay:
                assert max(model.ts[p] for p in gone) <= min(stay)
        for p in gone:
            del model.pages[p]
            del model.ts[p]

    def alloc_or_evict(n: int) -> list[int] | None:
        pages = alloc.alloc(n)
        if pages is None:
            do_evict(n - alloc.num_free_pages)
            pages = alloc.alloc(n)
        return pages

    def do_insert(toks, pages) -> int:
        expect = model.longest(toks)
        prefix = cache.insert(toks, pages)
        assert prefix == expect
        for i in range(prefix // ps, len(pages)):
            model.pages[tuple(toks[: (i + 1) * ps])] = pages[i]
        model.touch(toks, len(toks))
        history.append(list(toks))
        return prefix

    for _ in range(n_ops):
        op = rng.random()
        if op < 0.3:  # insert with all-fresh pages
            toks = gen(aligned=True)
            pages = alloc_or_evict(len(toks) // ps)
            if pages is not None:
                prefix = do_insert(toks, pages)
                alloc.free(pages[: prefix // ps])
        elif (
            op < 0.45
        ):  # scheduler style: match, lock, allocate the rest, maybe race, insert
            toks = gen(aligned=True)
            m = check_match(toks)
            cache.inc_lock(m.node)
            held.append((m.node, tuple(toks[: m.cached_len])))
            k = m.cached_len // ps
            new = alloc_or_evict(len(toks) // ps - k)
            if new is not None:
                if (
                    rng.random() < 0.4
                ):  # another request with the same prompt finishes first
                    other = alloc_or_evict(len(toks) // ps)
                    if other is not None:
                        p2 = do_insert(toks, other)
                        alloc.free(other[: p2 // ps])
                prefix = do_insert(toks, m.pages + new)
                assert prefix >= m.cached_len
                alloc.free(new[: prefix // ps - k])  # only our own duplicates
            held.pop()
            cache.dec_lock(m.node)
        elif op < 0.65:
            check_match(gen(aligned=False))
        elif op < 0.75:  # lock a matched node
            toks = gen(aligned=False)
            m = check_match(toks)
            cache.inc_lock(m.node)
            held.append((m.node, tuple(toks[: m.cached_len])))
        elif op < 0.85:
            if held:
                node, _ = held.pop(rng.randrange(len(held)))
                cache.dec_lock(node)
        else:
            do_evict(rng.randint(0, 8))

        # invariants
        assert alloc.num_free_pages + cache.total_pages == num_pages
        assert cache.evictable_pages + cache.protected_pages == cache.total_pages
        assert tree_contents(cache) == model.pages
        assert not any(alloc.is_free(p) for p in model.pages.values())
        locked = locked_prefixes()
        assert cache.protected_pages == len(locked)
        expect_ref: Counter[int] = Counter()
        for node, _ in held:
            n = node
            while n is not None:
                expect_ref[id(n)] += 1
                n = n.parent
            assert n is None
        for n in all_nodes(cache):
            assert n.lock_ref == expect_ref[id(n)]

    while held:
        cache.dec_lock(held.pop()[0])
    assert cache.protected_pages == 0
    cache.reset()
    assert alloc.num_free_pages == num_pages and cache.total_pages == 0


@pytest.mark.parametrize("ps", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_randomized_against_brute_force(seed, ps):
    run_random(seed, ps)
