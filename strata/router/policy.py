"""Routing policies: the `Policy` interface and the simple ones.

    round_robin   each routable worker in turn
    random        uniformly at random
    least_load    the smallest load (ties broken at random, so equal loads do not all go to one worker)
    power_of_two  two distinct workers at random, the less loaded of them
    cache_aware   cache_aware.py: longest routed-prefix match unless load is imbalanced

Registry (name -> class) is registry.py; `strata router --policy` offers its names.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from strata.router.config import RouterConfig
from strata.router.worker import Worker


@dataclass(frozen=True)
class RoutingKey:
    """What a policy may look at: the prompt as a string key (characters, or token ids via
    prefix_tree.token_key), or None when the request has no prompt (GET /v1/models) or could not
    be parsed (the worker will answer its error)."""

    text: str | None = None


@dataclass(frozen=True)
class Choice:
    worker: Worker
    decision: str  # why, for metrics: the policy name, or cache_aware's prefix | load | imbalance


class Policy(ABC):
    """Picks one worker for a request.

    Contract: `choose` gets a non-empty list of routable workers (those already tried for this
    request are left out) and returns one of them. It runs on the router's event loop, never
    concurrently with itself, so policy state needs no lock. A policy may keep state per worker
    URL; the pool calls `remove_worker` when a worker leaves and `reset_worker` when its cache
    was emptied (flushed, or re-admitted after failing — probably restarted). Nothing may raise
    for a valid input; a policy never blocks or does I/O.
    """

    name: ClassVar[str]

    def __init__(self, config: RouterConfig, rng: random.Random | None = None):
        self.config = config
        self.rng = rng or random.Random()

    @abstractmethod
    def choose(self, workers: Sequence[Worker], key: RoutingKey) -> Choice: ...

    def remove_worker(self, url: str) -> None:  # noqa: B027 - optional hook
        """Forget a worker's per-worker state (default: none kept)."""

    def reset_worker(self, url: str) -> None:  # noqa: B027 - optional hook
        """Clear a worker's per-worker state after it restarted (default: none kept)."""

    def describe_worker(self, url: str) -> dict:
        """Extra per-worker fields for GET /workers."""
        return {}

    def least_loaded(self, workers: Sequence[Worker]) -> Worker:
        lowest = min(w.load for w in workers)
        return self.rng.choice([w for w in workers if w.load == lowest])


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, config: RouterConfig, rng: random.Random | None = None):
        super().__init__(config, rng)
        self.counter = 0

    def choose(self, workers: Sequence[Worker], key: RoutingKey) -> Choice:
        worker = workers[self.counter % len(workers)]
        self.counter += 1
        return Choice(worker, self.name)


class RandomPolicy(Policy):
    name = "random"

    def choose(self, workers: Sequence[Worker], key: RoutingKey) -> Choice:
        return Choice(self.rng.choice(list(workers)), self.name)


class LeastLoadPolicy(Policy):
    name = "least_load"

    def choose(self, workers: Sequence[Worker], key: RoutingKey) -> Choice:
        return Choice(self.least_loaded(workers), self.name)


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def choose(self, workers: Sequence[Worker], key: RoutingKey) -> Choice:
        if len(workers) == 1:
            return Choice(workers[0], self.name)
        a, b = self.rng.sample(list(workers), 2)
        return Choice(a if a.load <= b.load else b, self.name)
