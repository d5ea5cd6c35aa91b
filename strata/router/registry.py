"""Policy name -> class. `strata router --policy` offers these names; add a policy here."""

from __future__ import annotations

import random

from strata.router.cache_aware import CacheAwarePolicy
from strata.router.policy import (
    LeastLoadPolicy,
    Policy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        CacheAwarePolicy,
        RoundRobinPolicy,
        RandomPolicy,
        LeastLoadPolicy,
        PowerOfTwoPolicy,
    )
}


def make_policy(config, rng: random.Random | None = None) -> Policy:
    """The policy `config.policy` names (a RouterConfig, already validated)."""
    return POLICIES[config.policy](config, rng)
