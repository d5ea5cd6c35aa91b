"""The cache_aware policy: send a prompt where its prefix was sent before, unless load is imbalanced.

For each request, over the routable workers:

    1. imbalanced?  max_load - min_load > balance_abs_threshold  AND  max_load > min_load * balance_rel_threshold
                    -> the least loaded worker                                      (decision "imbalance")
    2. else the worker whose prefix tree matches the prompt longest; if matched / prompt length
       > cache_threshold -> that worker (equal matches: the less loaded)            (decision "prefix")
    3. else the least loaded worker                                                 (decision "load")

then the prompt is inserted into the chosen worker's tree. Loads are worker.load: the worker's
own running + queued count with this router's requests since the last poll on top (worker.py), so
a burst of cache misses spreads at once instead of piling onto one worker (SGLang's failure of
picking "the smallest tree" on a miss), and equal loads are broken at random, not by list order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from strata.router.config import RouterConfig
from strata.router.policy import Choice, Policy, RoutingKey
from strata.router.prefix_tree import PrefixTree
from strata.router.worker import Worker


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random | None = None):
        super().__init__(config, rng)
        self.trees: dict[str, PrefixTree] = {}

    def tree(self, url: str) -> PrefixTree:
        tree = self.trees.get(url)
        if tree is None:
            tree = self.trees[url] = PrefixTree(self.config.max_tree_chars)
        return tree

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.load for w in workers]
        lo, hi = min(loads), max(loads)
        return (
            hi - lo > self.config.balance_abs_threshold
            and hi > lo * self.config.balance_rel_threshold
        )

    def choose(self, workers: Sequence[Worker], key: RoutingKey) -> Choice:
        text = key.text
        if not text:
            return Choice(self.least_loaded(workers), "load")
        if self.imbalanced(workers):
            choice = Choice(self.least_loaded(workers), "imbalance")
        else:
            matches = {w.url: self.tree(w.url).match(text) for w in workers}
            best = max(matches.values())
            if best / len(text) > self.config.cache_threshold:
                choice = Choice(
                    self.least_loaded([w for w in workers if matches[w.url] == best]),
                    "prefix",
                )
            else:
                choice = Choice(self.least_loaded(workers), "load")
        self.tree(choice.worker.url).insert(text)
        return choice

    def remove_worker(self, url: str) -> None:
        self.trees.pop(url, None)

    def reset_worker(self, url: str) -> None:
        if url in self.trees:
            self.trees[url].clear()

    def describe_worker(self, url: str) -> dict:
        tree = self.trees.get(url)
        return {"prefix_tree_chars": tree.num_chars if tree is not None else 0}
