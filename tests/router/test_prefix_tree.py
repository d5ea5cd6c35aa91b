"""The approximate prefix tree behind cache_aware routing."""

from __future__ import annotations

import random

from strata.router.prefix_tree import PrefixTree, common_prefix_len, token_key


def test_common_prefix_len_matches_naive():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        naive = next(
            (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
        )
        assert common_prefix_len(a, b) == naive


def test_match_after_inserts_and_splits():
    tree = PrefixTree(max_chars=10_000)
    assert tree.match("anything") == 0
    tree.insert("You are a helpful assistant. Q1")
    tree.insert("You are a helpful bot. Q2")  # splits the first edge
    assert tree.match("You are a helpful assistant. Q1") == len(
        "You are a helpful assistant. Q1"
    )
    assert tree.match("You are a helpful assistant. Q9") == len(
        "You are a helpful assistant. Q"
    )
    assert tree.match("You are a helpful bot. Q3") == len("You are a helpful bot. Q")
    assert tree.match("You are a grumpy bot") == len("You are a ")
    assert tree.match("Something else") == 0
    # size counts distinct characters stored, shared prefixes once
    assert tree.num_chars == len("You are a helpful ") + len("assistant. Q1") + len(
        "bot. Q2"
    )


def test_tree_matches_a_reference_set_of_strings():
    rng = random.Random(1)
    tree = PrefixTree(max_chars=10**9)
    keys = []
    for _ in range(300):
        base = rng.choice(keys) if keys and rng.random() < 0.7 else ""
        key = base[: rng.randrange(0, len(base) + 1)] + "".join(
            rng.choice("xyz") for _ in range(rng.randrange(1, 8))
        )
        tree.insert(key)
        keys.append(key)
    for _ in range(300):
        probe = "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 20)))
        best = max(common_prefix_len(probe, k) for k in keys)
        assert tree.match(probe) == best


def test_eviction_keeps_the_bound_and_drops_least_recently_used():
    tree = PrefixTree(max_chars=100, evict_to=0.5)
    tree.insert("old-" + "a" * 40)
    tree.insert("new-" + "b" * 40)
    tree.insert("old-" + "a" * 40)  # touch: "old" is now the most recent
    tree.insert("third-" + "c" * 40)  # 138 chars > 100: evict down to 50
    assert tree.num_chars <= 50
    assert tree.match("third-" + "c" * 40) == 46  # most recent survives
    assert tree.match("new-" + "b" * 40) == 0  # least recent went first
    assert tree.num_chars == sum(len(n.edge) for n in tree._nodes())


def test_token_keys_never_match_text_keys():
    tree = PrefixTree(max_chars=1000)
    tree.insert(token_key([1, 2, 3, 4]))
    assert tree.match(token_key([1, 2, 3, 9])) == len(token_key([1, 2, 3]))
    assert tree.match("\x01\x02\x03") == 0
    assert token_key([10**7]) != token_key([])  # huge ids wrap instead of failing
