from __future__ import annotations

import random

import pytest

from strata.cache.allocator import GroupedPageAllocator, OutOfPages, PageAllocator


def test_initial_state():
    a = PageAllocator(num_pages=8, page_size=4)
    assert a.num_pages == 8
    assert a.page_size == 4
    assert a.num_free_pages == 8
    assert all(a.is_free(p) for p in range(8))


def test_alloc_free_counts():
    a = PageAllocator(8, 2)
    p = a.alloc(3)
    assert p is not None and len(p) == 3 and len(set(p)) == 3
    assert all(0 <= x < 8 for x in p)
    assert a.num_free_pages == 5
    assert not any(a.is_free(x) for x in p)
    q = a.alloc(5)
    assert q is not None and not set(p) & set(q)
    assert a.num_free_pages == 0
    a.free(p)
    assert a.num_free_pages == 3
    assert all(a.is_free(x) for x in p)
    a.free(iter(q))  # any iterable
    assert a.num_free_pages == 8


def test_alloc_zero():
    a = PageAllocator(2, 1)
    assert a.alloc(0) == []
    assert a.num_free_pages == 2
    a.alloc(2)
    assert a.alloc(0) == []


def test_alloc_all_or_nothing():
    a = PageAllocator(4, 1)
    assert a.alloc(5) is None
    assert a.num_free_pages == 4
    p = a.alloc(3)
    assert a.alloc(2) is None
    assert a.num_free_pages == 1
    assert a.alloc(1) is not None
    assert a.alloc(1) is None
    a.free(p)
    assert a.num_free_pages == 3


def test_alloc_negative_raises():
    with pytest.raises(ValueError):
        PageAllocator(4, 1).alloc(-1)


def test_double_free_raises_and_is_atomic():
    a = PageAllocator(4, 1)
    p = a.alloc(2)
    a.free(p[:1])
    with pytest.raises(ValueError):
        a.free(p[:1])
    # a bad batch takes nothing: p[1] stays allocated
    with pytest.raises(ValueError):
        a.free([p[1], p[0]])
    assert a.num_free_pages == 3
    assert not a.is_free(p[1])
    # duplicates within one call
    with pytest.raises(ValueError):
        a.free([p[1], p[1]])
    assert a.num_free_pages == 3
    a.free([p[1]])
    assert a.num_free_pages == 4


def test_free_never_allocated_raises():
    a = PageAllocator(4, 1)
    with pytest.raises(ValueError):
        a.free([0])


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_free_out_of_range_raises(bad):
    a = PageAllocator(4, 1)
    a.alloc(4)
    with pytest.raises(ValueError):
        a.free([bad])
    assert a.num_free_pages == 0


def test_reset():
    a = PageAllocator(6, 3)
    a.alloc(4)
    a.reset()
    assert a.num_free_pages == 6
    p = a.alloc(6)
    assert sorted(p) == list(range(6))


def test_bad_construction():
    with pytest.raises(ValueError):
        PageAllocator(-1, 1)
    with pytest.raises(ValueError):
        PageAllocator(4, 0)


def test_out_of_pages_is_exception():
    assert issubclass(OutOfPages, Exception)


def test_randomized_against_set():
    rng = random.Random(0)
    a = PageAllocator(32, 1)
    held: set[int] = set()
    for _ in range(3000):
        if rng.random() < 0.5:
            n = rng.randint(0, 6)
            p = a.alloc(n)
            if n > 32 - len(held):
                assert p is None
            else:
                assert p is not None and len(p) == n
                assert not set(p) & held
                held |= set(p)
        elif held:
            k = rng.randint(1, len(held))
            batch = rng.sample(sorted(held), k)
            a.free(batch)
            held -= set(batch)
        assert a.num_free_pages == 32 - len(held)
        assert all(not a.is_free(p) for p in held)


# ------------------------------------------------------------- window groups sharing the pool


def test_shared_pool_page_costs_and_gives_back():
    """With `shared`, a new page takes one page of the pool for the primary group and one per window
    group; a window group's page given back (behind the window) is the pool's again, for any group."""
    a = GroupedPageAllocator(12, 4, [(8, 12), (8, 12)], shared=True)
    assert a.page_cost == 3 and a.num_free_pages == 12
    pages = a.alloc(3)
    assert a.num_free_pages == 3 and not a.can_alloc(2) and a.can_alloc(1)
    behind = [int(g.to_group[pages[0]]) for g in a.groups]
    used = {*pages, *(int(g.to_group[p]) for g in a.groups for p in pages)}
    assert len(used) == 9  # every part is a page of its own
    for g in a.groups:
        assert g.drop([pages[0]]) == 1
    assert (
        a.num_free_pages == 5 and a.usable_prefix(pages) == 3
    )  # a query at 12 reads from 5 on
    more = a.alloc(1)
    assert set(more) | {int(g.to_group[more[0]]) for g in a.groups} <= set(
        range(12)
    ) - (used - set(behind))
    a.free(pages + more)
    assert a.num_free_pages == 12 and all((g.to_group < 0).all() for g in a.groups)
    assert a.alloc(5) is None and a.num_free_pages == 12  # all or nothing
    a.reset()
    assert a.num_free_pages == 12


def test_shared_pool_randomized_accounting():
    """Random allocs, window drops and frees: the pool's free pages plus every group's held pages
    always add up, and no page is handed out twice."""
    rng = random.Random(0)
    a = GroupedPageAllocator(64, 2, [(6, 64)] * 3, shared=True)
    live: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            got = a.alloc(rng.randint(1, 4))
            live += got or []
        elif op < 0.7 and live:
            g = rng.choice(a.groups)
            g.drop(rng.sample(live, min(len(live), rng.randint(1, 3))))
        elif live:
            out = rng.sample(live, min(len(live), rng.randint(1, 3)))
            a.free(out)
            live = [p for p in live if p not in out]
        held = [
            int(g.to_group[p]) for g in a.groups for p in live if g.to_group[p] >= 0
        ]
        assert len(set(held) | set(live)) == len(held) + len(live)
        assert a.num_free_pages + len(live) + len(held) == 64
