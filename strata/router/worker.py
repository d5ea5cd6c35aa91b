"""One worker (a `strata serve` replica) as the router sees it: health, circuit breaker, load.

A worker is *routable* when its health checks pass and its circuit breaker lets a request through:

    health   pending ──check ok──▶ healthy ──N failed checks──▶ unhealthy ──M good checks──▶ healthy
    breaker  closed ──N consecutive failed requests──▶ open ──cool-down──▶ half-open (one trial)
             half-open ──trial ok──▶ closed;  half-open ──trial failed──▶ open again

Load is what the worker itself reports (running + queued requests, polled from /get_server_info)
plus this router's requests started since that report minus those finished since:

    load = max(in_flight, reported + in_flight - in_flight_at_report)

The correction resets at every poll, so it cannot drift, and several router replicas over the same
workers see (nearly) the same numbers: each one's traffic reaches the others through the reports.

Everything here runs on the router's event loop; nothing is locked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum


class Health(str, Enum):
    PENDING = "pending"  # not checked yet
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_BREAKER_STATUS = {
    BreakerState.CLOSED: "healthy",
    BreakerState.OPEN: "circuit_open",
    BreakerState.HALF_OPEN: "half_open",
}


@dataclass
class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures; lets one trial through after `cooldown_s`."""

    failure_threshold: int
    cooldown_s: float
    consecutive_failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    def state(self, now: float | None = None) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        now = time.monotonic() if now is None else now
        return (
            BreakerState.HALF_OPEN
            if now - self.opened_at >= self.cooldown_s
            else BreakerState.OPEN
        )

    def allows(self, now: float | None = None) -> bool:
        state = self.state(now)
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self.trial_in_flight
        )

    def on_dispatch(self, now: float | None = None) -> None:
        if self.state(now) is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.trial_in_flight = False

    def on_failure(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.consecutive_failures += 1
        if self.trial_in_flight or self.consecutive_failures >= self.failure_threshold:
            self.opened_at = now  # (re)open: a failed trial restarts the cool-down
        self.trial_in_flight = False

    def reset(self) -> None:
        self.on_success()

    def retry_in(self, now: float | None = None) -> float:
        if self.opened_at is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, self.cooldown_s - (now - self.opened_at))


@dataclass
class Worker:
    url: str
    breaker: CircuitBreaker
    launched: bool = False  # started by this router (--launch)
    health: Health = Health.PENDING
    health_failures: int = 0  # consecutive failed health checks
    health_successes: int = 0  # consecutive good health checks
    last_error: str | None = None  # why the last health check or request failed
    in_flight: int = 0  # this router's requests open on the worker now
    reported_load: int | None = (
        None  # running + queued, from the worker's last /get_server_info
    )
    in_flight_at_report: int = 0
    reported_at: float | None = None
    num_requests: int = 0  # attempts sent (including retries)
    num_errors: int = 0

    # ---------------------------------------------------------------- routing

    @property
    def load(self) -> int:
        if self.reported_load is None:
            return self.in_flight
        return max(
            self.in_flight,
            self.reported_load + self.in_flight - self.in_flight_at_report,
        )

    def routable(self, now: float | None = None) -> bool:
        return self.health is Health.HEALTHY and self.breaker.allows(now)

    def status(self, now: float | None = None) -> str:
        """One word for humans and GET /workers: healthy | pending | unhealthy | circuit_open | half_open."""
        if self.health is not Health.HEALTHY:
            return self.health.value
        return _BREAKER_STATUS[self.breaker.state(now)]

    def why_not_routable(self, now: float | None = None) -> str:
        status = self.status(now)
        if status == "pending":
            return "not health-checked yet"
        if status == "unhealthy":
            return f"unhealthy ({self.last_error or 'health check failed'})"
        if status == "circuit_open":
            return (
                f"circuit open after {self.breaker.consecutive_failures} consecutive failures "
                f"({self.last_error}); trial request in {self.breaker.retry_in(now):.1f}s"
            )
        if status == "half_open":
            return "circuit half-open; its trial request is in flight"
        return "routable"

    # ---------------------------------------------------------------- requests

    def on_dispatch(self) -> None:
        self.in_flight += 1
        self.num_requests += 1
        self.breaker.on_dispatch()

    def on_done(self) -> None:
        self.in_flight -= 1

    def on_success(self) -> None:
        self.breaker.on_success()

    def on_failure(self, error: str, *, count_for_breaker: bool = True) -> None:
        self.num_errors += 1
        self.last_error = error
        if count_for_breaker:
            self.breaker.on_failure()
        else:
            self.breaker.trial_in_flight = False

    # ---------------------------------------------------------------- polls

    def on_load_report(self, running: int, queued: int) -> None:
        self.reported_load = running + queued
        self.in_flight_at_report = self.in_flight
        self.reported_at = time.monotonic()

    def on_health_check(
        self,
        ok: bool,
        error: str | None,
        success_threshold: int,
        failure_threshold: int,
    ) -> bool:
        """Record one check; True when the worker just became healthy (admitted or re-admitted)."""
        if ok:
            self.health_failures = 0
            self.health_successes += 1
            if (
                self.health is not Health.HEALTHY
                and self.health_successes >= success_threshold
            ):
                self.health = Health.HEALTHY
                self.breaker.reset()
                return True
            return False
        self.health_successes = 0
        self.health_failures += 1
        self.last_error = error
        if self.health is Health.PENDING or self.health_failures >= failure_threshold:
            self.health = Health.UNHEALTHY
            self.reported_load = None
        return False

    def describe(self, now: float | None = None) -> dict:
        return {
            "url": self.url,
            "status": self.status(now),
            "routable": self.routable(now),
            "healthy": self.health is Health.HEALTHY,
            "circuit": self.breaker.state(now).value,
            "load": self.load,
            "reported_load": self.reported_load,
            "in_flight": self.in_flight,
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "consecutive_failures": self.breaker.consecutive_failures,
            "last_error": self.last_error,
            "launched": self.launched,
        }
