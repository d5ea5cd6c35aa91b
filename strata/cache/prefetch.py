"""The `auto` L3 prefetch decision (see strata.cache.hicache): rates measured on this engine, and how
long a request may wait for its fetch."""

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
    return recompute_s if fetch_s < recompute_s else 0.0
