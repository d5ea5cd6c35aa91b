"""Routing policies on in-memory workers (no HTTP): what each picks, and cache_aware's rules."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from strata.router.config import POLICY_NAMES, RouterConfig
from strata.router.policy import RoutingKey
from strata.router.registry import POLICIES, make_policy
from strata.router.worker import CircuitBreaker, Health, Worker


def make_workers(n: int) -> list[Worker]:
    workers = [
        Worker(f"http://127.0.0.1:{9000 + i}", CircuitBreaker(3, 10.0))
        for i in range(n)
    ]
    for w in workers:
        w.health = Health.HEALTHY
    return workers


def policy(name: str, **kw):
    return make_policy(RouterConfig(policy=name, **kw), random.Random(0))


def test_registry_names_every_policy():
    assert tuple(POLICIES) == POLICY_NAMES  # what RouterConfig accepts
    assert set(POLICIES) == {
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "cache_aware",
    }
    with pytest.raises(ValueError, match="policy must be one of"):
        RouterConfig(policy="nope")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_uses_every_worker_when_idle(name):
    workers = make_workers(3)
    p = policy(name)
    seen = Counter(
        p.choose(workers, RoutingKey(f"prompt {i} " + "x" * i)).worker.url
        for i in range(60)
    )
    assert set(seen) == {w.url for w in workers}


def test_round_robin_cycles():
    workers = make_workers(3)
    p = policy("round_robin")
    assert [p.choose(workers, RoutingKey("a")).worker for _ in range(6)] == workers * 2


def test_least_load_and_power_of_two_avoid_the_loaded_worker():
    workers = make_workers(2)
    workers[0].on_load_report(running=50, queued=10)
    for name in ("least_load", "power_of_two"):
        p = policy(name)
        assert {p.choose(workers, RoutingKey("a")).worker.url for _ in range(20)} == {
            workers[1].url
        }


def test_load_is_reported_plus_own_requests_since_the_report():
    (w,) = make_workers(1)
    w.on_dispatch()
    w.on_dispatch()
    assert w.load == 2  # no report yet: our own in-flight requests
    w.on_load_report(
        running=5, queued=1
    )  # the worker counts ours and other routers' requests
    assert w.load == 6
    w.on_dispatch()
    assert w.load == 7  # one more since the report
    w.on_done()
    w.on_done()
    assert w.load == 5  # two finished since the report
    w.on_load_report(
        running=1, queued=0
    )  # the correction resets at every report: no drift
    assert w.load == 1
    w.on_done()
    assert w.load == 0 and w.in_flight == 0


def shared_prefix_prompts(
    num_groups: int, per_group: int, rng: random.Random
) -> list[tuple[int, str]]:
    systems = [
        f"System prompt of group {g}: " + "lorem ipsum " * 20 for g in range(num_groups)
    ]
    prompts = [
        (g, systems[g] + f"question {q}")
        for g in range(num_groups)
        for q in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def test_cache_aware_sends_each_group_to_one_worker_and_spreads_groups():
    workers = make_workers(2)
    p = policy("cache_aware")
    placement: dict[int, set[str]] = {}
    decisions = Counter()
    for group, prompt in shared_prefix_prompts(8, 10, random.Random(0)):
        choice = p.choose(workers, RoutingKey(prompt))
        placement.setdefault(group, set()).add(choice.worker.url)
        decisions[choice.decision] += 1
        choice.worker.on_dispatch()  # requests stay open: load builds up as it would under traffic
    assert all(len(urls) == 1 for urls in placement.values()), placement
    per_worker = Counter(next(iter(urls)) for urls in placement.values())
    assert (
        len(per_worker) == 2
    )  # misses went to the least loaded worker, not all to one
    assert decisions["load"] == 8 and decisions["prefix"] == 72


def test_cache_aware_a_burst_of_misses_spreads_evenly():
    """SGLang's failure: every cache miss sent to one worker. Misses go to the least loaded one,
    counting requests this router has just dispatched."""
    workers = make_workers(4)
    p = policy("cache_aware")
    for i in range(40):
        p.choose(workers, RoutingKey(f"{i:04d} unique prompt {i}")).worker.on_dispatch()
    assert [w.in_flight for w in workers] == [10, 10, 10, 10]


def test_cache_aware_imbalance_overrides_the_prefix_match():
    workers = make_workers(2)
    p = policy("cache_aware", balance_abs_threshold=8, balance_rel_threshold=1.5)
    hot = "the hot shared system prompt " * 10
    first = p.choose(workers, RoutingKey(hot + "q0")).worker
    other = workers[1] if first is workers[0] else workers[0]
    # another router (or direct clients) floods `first`: it reports the load; we see it
    first.on_load_report(running=20, queued=5)
    choice = p.choose(workers, RoutingKey(hot + "q1"))
    assert (choice.worker, choice.decision) == (other, "imbalance")
    # within the thresholds the prefix wins even against a somewhat busier worker
    first.on_load_report(running=6, queued=0)
    choice = p.choose(workers, RoutingKey(hot + "q2"))
    assert choice.decision == "prefix"


def test_cache_aware_low_match_rate_goes_by_load():
    workers = make_workers(2)
    p = policy("cache_aware", cache_threshold=0.5)
    w = p.choose(workers, RoutingKey("abcdefghij")).worker
    w.on_load_report(running=3, queued=0)
    choice = p.choose(workers, RoutingKey("abcd" + "z" * 20))  # 4/24 matched < 0.5
    assert choice.decision == "load" and choice.worker is not w


def test_cache_aware_forgets_a_reset_worker():
    workers = make_workers(2)
    p = policy("cache_aware")
    prompt = "a long shared prefix " * 10
    w = p.choose(workers, RoutingKey(prompt)).worker
    assert p.describe_worker(w.url)["prefix_tree_chars"] == len(prompt)
    p.reset_worker(w.url)
    assert p.describe_worker(w.url)["prefix_tree_chars"] == 0
    p.remove_worker(w.url)
    assert p.describe_worker(w.url)["prefix_tree_chars"] == 0


def test_circuit_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(failure_threshold=2, cooldown_s=5.0)
    b.on_failure(now=0.0)
    assert b.allows(now=0.0)
    b.on_failure(now=1.0)
    assert b.state(now=1.0).value == "open" and not b.allows(now=5.9)
    assert b.state(now=6.0).value == "half_open" and b.allows(now=6.0)
    b.on_dispatch(now=6.0)
    assert not b.allows(now=6.1)  # one trial at a time
    b.on_failure(now=6.5)  # the trial failed: open again, cool-down restarts
    assert not b.allows(now=11.0) and b.allows(now=11.5)
    b.on_dispatch(now=11.5)
    b.on_success()
    assert b.state(now=11.6).value == "closed" and b.consecutive_failures == 0


def test_health_ejects_after_threshold_and_readmits():
    (w,) = make_workers(1)
    assert not w.on_health_check(
        False, "down", success_threshold=1, failure_threshold=2
    )
    assert w.health is Health.HEALTHY  # one failure is not enough
    w.on_health_check(False, "down", 1, 2)
    assert w.health is Health.UNHEALTHY and not w.routable()
    assert w.on_health_check(True, None, 1, 2)  # re-admitted
    assert w.routable()
