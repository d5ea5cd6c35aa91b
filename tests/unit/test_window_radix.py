"""Window groups behind the page ids (GroupedPageAllocator) and the prefix cache that keeps hitting
on sliding-window models (WindowRadixCache): usable prefixes, tombstones, the two eviction passes,
and the accounting of every group under random operations."""

from __future__ import annotations

import random

import numpy as np
import pytest

from strata.cache.allocator import GroupedPageAllocator
from strata.cache.radix import PrefixCache
from strata.cache.window_radix import WindowRadixCache


def make(
    ps: int = 1, pages: int = 128, groups=((4, 128),)
) -> tuple[GroupedPageAllocator, WindowRadixCache]:
    alloc = GroupedPageAllocator(pages, ps, list(groups))
    return alloc, WindowRadixCache(alloc)


def insert_fresh(alloc, cache, tokens):
    pages = alloc.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    prefix = cache.insert(tokens, pages)
    alloc.free(pages[: prefix // cache.page_size])
    return pages


def tree_pages(cache) -> list[int]:
    return [p for n in cache._nodes() for p in n.value]


def check_groups(alloc, cache, private=()) -> None:
    """Every group page is free, held by the tree, or held by `private` pages; no group page is
    named by two primary pages."""
    held = tree_pages(cache) + list(private)
    assert alloc.num_free_pages + len(held) == alloc.num_pages
    for g in alloc.groups:
        live = (
            g.to_group[np.asarray(held, dtype=np.int64)]
            if held
            else np.array([], dtype=np.int64)
        )
        live = live[live >= 0]
        assert len(set(live.tolist())) == len(live)
        assert g.num_free_pages + len(live) == g.num_pages
        assert (g.to_group[np.setdiff1d(np.arange(alloc.num_pages), held)] == -1).all()


def two_branches():
    """Window 4, page size 1: a (30 tokens) and b (35) sharing 20: a[:20] -> {a[20:], b[20:]}."""
    alloc, cache = make(ps=1)
    a = list(range(100, 130))
    b = a[:20] + list(range(200, 215))
    insert_fresh(alloc, cache, a)
    insert_fresh(alloc, cache, b)
    return alloc, cache, a, b


def test_protocol_conformance():
    _, cache = make()
    assert isinstance(cache, PrefixCache)


def test_alloc_is_all_or_nothing_across_groups():
    alloc = GroupedPageAllocator(8, 1, [(4, 3)])
    assert alloc.alloc(4) is None  # the window group has 3
    assert alloc.num_free_pages == 8 and alloc.groups[0].num_free_pages == 3
    pages = alloc.alloc(3)
    assert alloc.groups[0].num_free_pages == 0 and alloc.alloc(1) is None
    alloc.groups[0].drop(pages[:2])
    assert alloc.alloc(1) is not None
    with pytest.raises(ValueError):
        alloc.free([pages[0], pages[0]])  # nothing freed on a bad call
    alloc.free(pages)
    assert (
        alloc.groups[0].num_free_pages == 2
    )  # the third page's group page went to the alloc(1) above


@pytest.mark.parametrize("ps", [1, 2])
def test_usable_prefix_needs_only_the_window_before_the_end(ps):
    window = 4
    alloc = GroupedPageAllocator(32, ps, [(window, 32)])
    pages = alloc.alloc(8)
    assert alloc.usable_prefix(pages) == 8
    group = alloc.groups[0]
    end = 8 * ps
    first_read = (
        max(0, end - window + 1) // ps
    )  # the query at `end` reads from page first_read on
    group.drop(pages[:first_read])
    assert alloc.usable_prefix(pages) == 8
    group.drop([pages[first_read]])
    k = alloc.usable_prefix(pages)
    assert k < 8
    assert all(
        group.to_group[p] >= 0 for p in pages[max(0, k * ps - window + 1) // ps : k]
    )


def test_two_windows_must_both_cover():
    alloc = GroupedPageAllocator(32, 1, [(2, 32), (6, 32)])
    pages = alloc.alloc(10)
    alloc.groups[0].drop(pages[:8])  # window 2 reads 1 key back: fine at 10
    assert alloc.usable_prefix(pages) == 10
    alloc.groups[1].drop(pages[6:7])  # window 6 at 10 reads 5..9
    assert (
        alloc.usable_prefix(pages) == 0
    )  # at k <= 6 window 2 would need pages alive before 8


def test_match_backs_off_to_a_resumable_prefix():
    alloc, cache = make(ps=1)
    tokens = list(range(100, 120))
    pages = insert_fresh(alloc, cache, tokens)
    alloc.groups[0].drop(pages[:17])  # window 4: a match at 20 reads 17..19
    assert cache.match_prefix(tokens + [1]).cached_len == 20
    alloc.groups[0].drop(pages[17:18])
    m = cache.match_prefix(tokens + [1])
    assert (
        m.cached_len == 0
    )  # everything before 18 is gone: no position in 1..19 can resume
    assert m.pages == []
    check_groups(alloc, cache)


def test_evict_window_reports_what_it_freed():
    alloc, cache, _, _ = two_branches()
    before = alloc.groups[0].num_free_pages
    freed = cache.evict_window([1000])[0]
    assert (
        freed == alloc.groups[0].num_free_pages - before == 45
    )  # interiors, then the unlocked tails
    assert (
        alloc.num_free_pages == alloc.num_pages
    )  # leaves without their tails went whole
    check_groups(alloc, cache)


def test_interior_sweep_then_tails_order():
    alloc, cache, a, b = two_branches()
    group = alloc.groups[0]
    used = group.num_pages - group.num_free_pages
    assert used == 45
    # 20 - 5 + 10 - 5 + 15 - 5 = 30 interior pages; ask for exactly those
    assert cache.evict_window([30]) == [30]
    # each node keeps the 3 pages before its end, all a query at that end reads, one of slack, and
    # W / 4 = 1 more (a match may diverge that far before a guard)
    assert cache.match_prefix(a + [0]).cached_len == 30
    assert cache.match_prefix(b + [0]).cached_len == 35
    assert (
        cache.match_prefix(a[:20] + [0]).cached_len == 20
    )  # the branch point kept its tail
    assert (
        cache.match_prefix(a[:29]).cached_len == 29
    )  # a page before the end: the slack
    assert (
        cache.match_prefix(a[:28] + [0]).cached_len == 28
    )  # two before: the W / 4 band
    assert (
        cache.match_prefix(a[:25] + [0]).cached_len == 20
    )  # mid-node: interior gone, backs off
    check_groups(alloc, cache)


def test_tail_pass_tombstones_inner_nodes_and_keeps_children():
    alloc, cache, a, b = two_branches()
    m = cache.match_prefix(b + [0])
    cache.inc_lock(m.node)  # b's leaf is in use: its tail must stay
    cache.match_prefix(a[:20] + [0])  # refresh the inner node: a's leaf is now the LRU
    freed = cache.evict_window([40])[0]
    assert freed >= 35  # interiors (30, the locked leaf's too), then a's leaf whole (5)
    assert cache.match_prefix(b + [0]).cached_len == 35  # locked leaf untouched
    assert (
        cache.match_prefix(a + [0]).cached_len < 30
    )  # a's leaf went whole (LRU, unlocked)
    assert alloc.groups[0].to_group[m.pages[-1]] >= 0
    cache.dec_lock(m.node)
    # now everything unlocked: the inner node (the branch point) loses its tail but b stays matchable
    cache.match_prefix(b + [0])  # b most recent
    cache.evict_window([3])
    assert cache.match_prefix(b + [0]).cached_len == 35
    check_groups(alloc, cache)


def test_locked_interior_is_swept_but_the_locked_end_is_not():
    alloc, cache = make(ps=1)
    a = list(range(100, 140))
    insert_fresh(alloc, cache, a)
    m = cache.match_prefix(a + [0])
    cache.inc_lock(m.node)
    assert cache.evict_window([1000]) == [
        35
    ]  # interior only: the lock holder reads the last 3 (+ slack, + W / 4)
    assert all(alloc.groups[0].to_group[p] >= 0 for p in m.pages[-3:])
    assert cache.match_prefix(a + [0]).cached_len == 40
    cache.dec_lock(m.node)
    check_groups(alloc, cache)


def test_insert_revives_tombstones_from_the_inserting_copy():
    alloc, cache = make(ps=1)
    a = list(range(100, 110))
    pages = insert_fresh(alloc, cache, a)
    alloc.groups[0].drop(pages)  # everything tombstoned: nothing matchable
    assert cache.match_prefix(a + [0]).cached_len == 0
    fresh = alloc.alloc(10)  # a request recomputed it: its copies hold window KV
    assert cache.insert(a, fresh) == 10
    alloc.free(
        fresh
    )  # the caller frees its duplicates; their window KV moved to the tree's pages
    assert cache.match_prefix(a + [0]).cached_len == 10
    check_groups(alloc, cache)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ps", [1, 2])
def test_random_operations_keep_every_group_accounted(seed, ps):
    rng = random.Random(seed)
    alloc, cache = make(ps=ps, pages=80, groups=((3, 30), (5, 40)))
    locked = []
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 12)
            tokens = [rng.randint(0, 3) for _ in range(n * ps)]
            m = cache.match_prefix(tokens)
            # a matched prefix is resumable in every group
            assert alloc.usable_prefix(m.pages) == len(m.pages)
            need = n - len(m.pages)
            if need and not alloc.can_alloc(need):
                cache.evict(need)
                cache.evict_window([need - g.num_free_pages for g in alloc.groups])
            new = alloc.alloc(need)
            if new is None:
                continue
            pages = m.pages + new
            present = cache.insert(tokens, pages)
            alloc.free(pages[len(m.pages) : max(len(m.pages), present // ps)])
        elif op < 0.6:
            tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 10) * ps)]
            m = cache.match_prefix(tokens)
            cache.inc_lock(m.node)
            locked.append(m)
        elif op < 0.75 and locked:
            m = locked.pop(rng.randrange(len(locked)))
            cache.dec_lock(m.node)
        elif op < 0.9:
            cache.evict_window([rng.randint(0, 10) for _ in alloc.groups])
            for m in locked:  # a lock holder's window before its end survives
                for g in alloc.groups:
                    need = m.pages[max(0, m.cached_len - g.window + 1) // ps :]
                    assert (g.to_group[np.asarray(need, dtype=np.int64)] >= 0).all()
        else:
            cache.evict(rng.randint(0, 10))
        check_groups(alloc, cache)
    for m in locked:
        cache.dec_lock(m.node)
    cache.reset()
    assert alloc.num_free_pages == alloc.num_pages
    assert all(g.num_free_pages == g.num_pages for g in alloc.groups)


def test_nodes_left_by_chunked_inserts_do_not_guard_their_pages():
    """A prefill in chunks inserts a chain of short nodes; only the chain's end guards window KV."""
    alloc, cache = make(ps=1)
    a = list(range(100, 142))
    for end in range(7, 43, 7):  # chunks of 7 tokens
        insert_fresh(alloc, cache, a[:end])
    assert len(list(cache._nodes())) == 7
    assert cache.evict_window([37]) == [
        37
    ]  # every page but the 3 before the chain's end, a page of slack, W / 4
    assert cache.match_prefix(a + [0]).cached_len == 42
    assert cache.match_prefix(a[:21] + [0]).cached_len == 0
    check_groups(alloc, cache)


def test_replay_keeps_full_layer_pages_of_leaves_without_their_window():
    alloc = GroupedPageAllocator(128, 1, [(4, 128)])
    cache = WindowRadixCache(alloc, replay=True)
    a = list(range(100, 130))
    insert_fresh(alloc, cache, a)
    assert cache.evict_window([1000]) == [30]  # every window page, the tail too
    assert alloc.num_free_pages == 98  # the full layers' pages stay cached
    assert (
        cache.match_prefix(a + [0]).cached_len == 30
    )  # matched as is: the scheduler replays
    check_groups(alloc, cache)


# ------------------------------------------------------------- window groups sharing the pool


def check_shared(alloc, cache, private=()) -> None:
    """A shared pool: free + the tree's primary pages + `private` + every group's live pages == all,
    and no page of the pool is named twice (as a primary page or behind one)."""
    held = tree_pages(cache) + list(private)
    idx = np.asarray(held, dtype=np.int64)
    live = [
        g.to_group[idx][g.to_group[idx] >= 0].tolist() if held else []
        for g in alloc.groups
    ]
    named = held + [p for group in live for p in group]
    assert len(set(named)) == len(named)
    assert alloc.num_free_pages + len(named) == alloc.num_pages
    for g in alloc.groups:
        assert (g.to_group[np.setdiff1d(np.arange(alloc.num_pages), held)] == -1).all()


def test_shared_make_room_gives_back_window_interiors_before_whole_conversations():
    """Two cached conversations in a shared pool of 3 parts per page: making room first takes the
    window KV no match reads (pages more than a window before each leaf's end), and only then a
    least recently used leaf; both conversations stay matchable at their ends while interiors last."""
    alloc = GroupedPageAllocator(240, 1, [(4, 240)] * 2, shared=True)
    cache = WindowRadixCache(alloc)
    a, b = list(range(100, 130)), list(range(200, 230))
    insert_fresh(alloc, cache, a)
    insert_fresh(alloc, cache, b)
    assert alloc.page_cost == 3 and alloc.num_free_pages == 240 - 2 * 30 * 3
    assert cache.make_room(
        30
    )  # 90 pages: 60 free + 30 of the 2 x 2 x 26 interior parts
    check_shared(alloc, cache)
    assert alloc.num_free_pages >= 90
    assert (
        cache.match_prefix(a).cached_len == 30
        and cache.match_prefix(b).cached_len == 30
    )
    assert cache.make_room(
        60
    )  # 180 pages: 60 free + all 104 interior parts are not enough
    check_shared(alloc, cache)
    assert sorted(cache.match_prefix(x).cached_len for x in (a, b)) == [
        0,
        30,
    ]  # the older one went


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ps", [1, 2])
def test_shared_pool_random_operations_keep_the_pool_accounted(seed, ps):
    rng = random.Random(seed)
    alloc = GroupedPageAllocator(120, ps, [(3, 120)] * 3, shared=True)
    cache = WindowRadixCache(alloc)
    locked = []
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 12)
            tokens = [rng.randint(0, 3) for _ in range(n * ps)]
            m = cache.match_prefix(tokens)
            assert alloc.usable_prefix(m.pages) == len(m.pages)
            cache.inc_lock(m.node)
            ok = cache.make_room(n - len(m.pages))
            cache.dec_lock(m.node)
            new = alloc.alloc(n - len(m.pages)) if ok else None
            if new is None:
                continue
            pages = m.pages + new
            present = cache.insert(tokens, pages)
            alloc.free(pages[len(m.pages) : max(len(m.pages), present // ps)])
        elif op < 0.6:
            tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 10) * ps)]
            m = cache.match_prefix(tokens)
            cache.inc_lock(m.node)
            locked.append(m)
        elif op < 0.75 and locked:
            cache.dec_lock(locked.pop(rng.randrange(len(locked))).node)
        elif op < 0.9:
            cache.make_room(rng.randint(0, 12))
            for m in locked:  # a lock holder's window before its end survives
                for g in alloc.groups:
                    need = m.pages[max(0, m.cached_len - g.window + 1) // ps :]
                    assert (g.to_group[np.asarray(need, dtype=np.int64)] >= 0).all()
        else:
            cache.evict(rng.randint(0, 10))
        check_shared(alloc, cache)
    for m in locked:
        cache.dec_lock(m.node)
    cache.reset()
    assert alloc.num_free_pages == alloc.num_pages


def test_a_prompt_end_stays_resumable_after_the_answer_extends_it():
    """A conversation's turn (prompt 0..30, answer 30..40) cached as one chain: after a sweep the
    next turn still resumes at the prompt's end when its copy of the answer differs, and a retry
    of the same prompt (matched up to its last token) resumes a page before it."""
    alloc, cache = make(ps=1)
    turn = list(range(100, 140))
    insert_fresh(alloc, cache, turn[:30])
    cache.keep_resumable(cache.match_prefix(turn[:30]).node)
    insert_fresh(alloc, cache, turn)
    cache.evict_window([1000], tails=False)
    check_groups(alloc, cache)
    assert cache.match_prefix(turn + [0]).cached_len == 40
    assert (
        cache.match_prefix(turn[:30] + [7, 7, 7]).cached_len == 30
    )  # the answer re-tokenized
    assert cache.match_prefix(turn[:29]).cached_len == 29  # the same prompt again
    assert (
        cache.match_prefix(turn[:20] + [7]).cached_len == 0
    )  # elsewhere: interior, gone


def test_a_match_just_before_a_guard_resumes_while_far_interiors_last():
    """A system prompt's first reuse diverges at its end, a question's length before the chain's
    guard. Window 8, guard 40: pass 1 first takes what lies more than 2W before the guard (a match
    may then diverge up to W before it), then down to W + W / 4 (2 tokens) and a page of slack."""
    alloc, cache = make(ps=1, groups=((8, 128),))
    a = list(range(100, 140))
    insert_fresh(alloc, cache, a)
    group = alloc.groups[0]
    assert cache.evict_window([24]) == [24]  # pages before 40 - 16
    assert cache.match_prefix(a[:31] + [0]).cached_len == 31  # reads 24..30
    assert cache.match_prefix(a[:30] + [0]).cached_len == 0  # would read 23: gone
    assert cache.evict_window([100], tails=False) == [6]  # then down to the last 10
    assert cache.match_prefix(a[:31] + [0]).cached_len == 0
    assert (
        cache.match_prefix(a[:37] + [0]).cached_len == 37
    )  # 3 before the guard still resumes
    assert cache.match_prefix(a + [0]).cached_len == 40
    assert group.num_pages - group.num_free_pages == 10
    check_groups(alloc, cache)


def test_the_near_band_goes_node_by_node_across_groups():
    """Two groups, two chains: asking for one chain's band between 2W and W + W / 4 before its guard
    takes the least recently used chain's in both groups (a match needs every group), and leaves
    the other chain's whole."""
    alloc, cache = make(ps=1, groups=((8, 128), (8, 128)))
    a, b = list(range(100, 140)), list(range(200, 240))
    insert_fresh(alloc, cache, a)
    insert_fresh(alloc, cache, b)
    cache.match_prefix(b)  # b most recent
    assert cache.evict_window([48, 48]) == [
        48,
        48,
    ]  # both chains' far interiors, every group
    assert cache.evict_window([6, 6]) == [6, 6]
    assert cache.match_prefix(a[:31] + [0]).cached_len == 0
    assert cache.match_prefix(b[:31] + [0]).cached_len == 31
    check_groups(alloc, cache)


def test_a_shared_pool_frees_what_it_was_asked_for_once_not_per_group():
    alloc = GroupedPageAllocator(240, 1, [(8, 240)] * 2, shared=True)
    cache = WindowRadixCache(alloc)
    a = list(range(100, 140))
    insert_fresh(alloc, cache, a)
    free = alloc.num_free_pages
    assert (
        sum(cache.evict_window([10, 10], tails=False)) == 24
    )  # 10 asked: group 0's 24 far pages at once
    assert alloc.num_free_pages == free + 24
    assert cache.match_prefix(a[:31] + [0]).cached_len == 31
