"""The L3 prefetch decisions (see strata.cache.hicache): whether a hit is fetched, rates measured on
this engine, and how long a request may wait for its fetch under the `auto` policy. Torch-free:
the planner's simulated replica (strata.plan.replica) decides with the same functions."""

from __future__ import annotations

from collections import deque


class RateMeter:
    """Units per second over the last `window` samples (their sums' ratio), `prior` until the first."""

    def __init__(self, prior: float, window: int = 16):
        self.prior = prior
        self.samples: deque[tuple[float, float]] = deque(
            maxlen=window
        )  # (amount, seconds)

    def add(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self.samples.append((amount, seconds))

    @property
    def rate(self) -> float:
        if not self.samples:
            return self.prior
        return sum(a for a, _ in self.samples) / sum(s for _, s in self.samples)


def fetches_l3_hit(num_tokens: int, threshold_tokens: int) -> bool:
    """Whether `num_tokens` tokens past what L1 and L2 hold are worth asking L3 for: at least
    `threshold_tokens` (--hicache-prefetch-threshold) of them; fewer are recomputed."""
    return num_tokens >= threshold_tokens


def auto_wait_s(fetch_s: float, recompute_s: float) -> float:
    """The `auto` policy: a request waits for its fetch (expected to take `fetch_s`, its queue
    included) at most as long as recomputing its tokens would take, and only if the fetch is
    expected to be quicker; otherwise it does not wait (and recomputes what has not arrived)."""
    return recompute_s if fetch_s < recompute_s else 0.0


def auto_prefetch_wait_s(
    num_tokens: int,
    num_bytes: int,
    queued_bytes: int,
    read_bytes_per_s: float,
    prefill_tokens_per_s: float,
) -> float:
    """How long the auto policy lets a request wait for an L3 fetch of `num_bytes` (its `num_tokens`
    tokens), behind `queued_bytes` of other fetches: the recompute time if the fetch is expected to
    be quicker than recomputing, else 0 (see the module docstring)."""
    fetch_s = (queued_bytes + num_bytes) / read_bytes_per_s
    recompute_s = num_tokens / prefill_tokens_per_s
    return auto_wait_s(fetch_s, recompute_s)
