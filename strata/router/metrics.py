"""The router's Prometheus metrics (GET /metrics of the router), one registry per router.

Name{labels}, and what it counts:

    strata:router_requests_total{worker,route}            attempts sent to a worker (retries included)
    strata:router_request_errors_total{worker,kind}       failed attempts: connect | disconnect | timeout
                                                          | status_5xx | stream_broken
    strata:router_retries_total{worker}                   requests retried elsewhere after failing here
    strata:router_policy_decisions_total{policy,decision,worker}
                                                          why each request went where it went; for
                                                          cache_aware, decision = prefix | load | imbalance
    strata:router_requests_failed_total{reason}           requests the router itself answered with an
                                                          error: no_worker | all_attempts_failed
    strata:router_time_to_first_byte_seconds{route}       request arrival -> first response byte sent
    strata:router_worker_healthy{worker}                  1 routable, 0 not (ejected or circuit open)
    strata:router_worker_load{worker}                     load as the policies see it
    strata:router_worker_in_flight{worker}                this router's requests open on the worker
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "strata:router_requests_total",
            "Attempts sent to a worker.",
            ["worker", "route"],
            registry=r,
        )
        self.errors = Counter(
            "strata:router_request_errors_total",
            "Failed attempts by kind.",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "strata:router_retries_total",
            "Requests retried on another worker.",
            ["worker"],
            registry=r,
        )
        self.decisions = Counter(
            "strata:router_policy_decisions_total",
            "Routing decisions (cache_aware: prefix | load | imbalance).",
            ["policy", "decision", "worker"],
            registry=r,
        )
        self.failed = Counter(
            "strata:router_requests_failed_total",
            "Requests the router answered with an error.",
            ["reason"],
            registry=r,
        )
        self.ttfb = Histogram(
            "strata:router_time_to_first_byte_seconds",
            "Request arrival to first response byte.",
            ["route"],
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self.healthy = Gauge(
            "strata:router_worker_healthy", "1 if routable.", ["worker"], registry=r
        )
        self.load = Gauge(
            "strata:router_worker_load",
            "Worker load as policies see it.",
            ["worker"],
            registry=r,
        )
        self.in_flight = Gauge(
            "strata:router_worker_in_flight",
            "This router's requests open on the worker.",
            ["worker"],
            registry=r,
        )

    def forget_worker(self, url: str) -> None:
        for gauge in (self.healthy, self.load, self.in_flight):
            try:
                gauge.remove(url)
            except KeyError:
                pass

    def render(self, workers) -> bytes:
        for w in workers:
            self.healthy.labels(w.url).set(1 if w.routable() else 0)
            self.load.labels(w.url).set(w.load)
            self.in_flight.labels(w.url).set(w.in_flight)
        return generate_latest(self.registry)
