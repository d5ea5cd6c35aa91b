"""`RouterConfig`: every knob of `strata router`, one default each; and worker URL validation.

The CLI (cli.py) reads its defaults from here. Values discovered while running (which workers are
healthy, their load) live in the WorkerPool, never in the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from strata.disagg.auth import SECRET_ENV, shared_secret
from strata.redact import SECRET, secret

LOG_LEVELS = ("debug", "info", "warning", "error")
SERVICE_DISCOVERY = (None, "k8s")  # None: only --worker-urls and POST /workers
# the routing policies, by the `name` of their class in strata.router.registry.POLICIES (same order)
POLICY_NAMES = ("cache_aware", "round_robin", "random", "least_load", "power_of_two")


def normalize_worker_url(url: str) -> str:
    """`http(s)://host:port` with no path, query or credentials; returns it without a trailing slash.

    Raises ValueError saying what is wrong, e.g. for `localhost:30000` (no scheme) or
    `http://h:1/v1` (a path: give the server's root, the router adds /v1/... itself).
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(
            f"a worker URL must be a non-empty string like http://127.0.0.1:30000, got {url!r}"
        )
    raw = url.strip()
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"worker URL {raw!r} is malformed ({exc}); expected http://host:port"
        ) from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"worker URL {raw!r} must start with http:// or https:// (e.g. http://127.0.0.1:30000)"
        )
    if not parts.hostname:
        raise ValueError(f"worker URL {raw!r} has no host; expected http://host:port")
    if parts.username or parts.password:
        raise ValueError(
            f"worker URL {raw!r} must not carry credentials; use --worker-api-key"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"worker URL {raw!r} must be the server's root (http://host:port), without a path or query"
        )
    host = parts.hostname
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme}://{netloc}"


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    worker_urls: tuple[str, ...] = ()  # workers at start-up; more via POST /workers
    policy: str = "cache_aware"  # see strata.router.registry.POLICIES
    # PD disaggregation: with prefill workers, worker_urls are the decode workers
    prefill_urls: tuple[str, ...] = ()
    prefill_policy: str = "least_load"
    # the prefill/decode workers' shared secret (or $STRATA_DISAGG_SECRET): needed with prefill_urls
    disaggregation_secret: str | None = field(
        default=None, metadata=secret(SECRET_ENV)
    )  # PD workers' secret
    api_key: str | None = field(
        default=None, metadata=SECRET
    )  # clients must send `Authorization: Bearer <key>` (all but /health)
    worker_api_key: str | None = field(
        default=None, metadata=SECRET
    )  # sent to workers as `Authorization: Bearer <key>`
    # health and load
    health_check_interval: float = 2.0  # seconds between GET /health of each worker
    health_check_timeout: float = (
        3.0  # seconds; a slower answer counts as a failed check
    )
    health_failure_threshold: int = 2  # consecutive failed checks that eject a worker
    health_success_threshold: int = 1  # consecutive good checks that (re-)admit it
    load_poll_interval: float = (
        0.5  # seconds between GET /get_server_info (running + queued) of each worker
    )
    # retries and circuit breaker
    max_retries: int = (
        3  # retries on other workers of a request that failed before its first byte
    )
    retry_backoff: float = (
        0.05  # seconds before the first retry; doubles per retry (with jitter)
    )
    retry_backoff_max: float = 1.0  # seconds, cap of the retry backoff
    breaker_failure_threshold: int = (
        3  # consecutive failed requests that open a worker's circuit
    )
    breaker_cooldown: float = (
        10.0  # seconds an open circuit waits before letting one trial request through
    )
    connect_timeout: float = 5.0  # seconds to connect to a worker
    request_timeout: float = (
        600.0  # seconds a worker may take to answer (between bytes when streaming)
    )
    max_request_bytes: int = 16 * 2**20  # larger request bodies get 413
    # cache_aware policy
    cache_threshold: float = (
        0.3  # route by prefix when matched/prompt length is above this
    )
    balance_abs_threshold: int = 64  # load is imbalanced when max - min > this ...
    balance_rel_threshold: float = (
        1.5  # ... and max > min * this; then the least loaded worker wins
    )
    max_tree_chars: int = (
        2**22
    )  # per-worker prefix tree bound (characters or token ids); LRU eviction
    # service discovery (strata.router.k8s_discovery): workers join and leave as pods become Ready / go away
    service_discovery: str | None = (
        None  # k8s: workers are the Ready pods matching --selector
    )
    selector: str | None = (
        None  # label selector of the worker pods, e.g. app=strata,component=replica
    )
    k8s_namespace: str | None = None  # default: the router pod's own namespace
    k8s_port: int | None = (
        None  # the workers' port; default: each pod's container port named 'http'
    )
    k8s_api_url: str | None = (
        None  # default: the in-cluster API server ($KUBERNETES_SERVICE_HOST)
    )
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(
                f"policy must be one of {POLICY_NAMES}, got {self.policy!r}"
            )
        if self.prefill_policy not in POLICY_NAMES:
            raise ValueError(
                f"prefill_policy must be one of {POLICY_NAMES}, got {self.prefill_policy!r}"
            )
        object.__setattr__(
            self,
            "prefill_urls",
            tuple(normalize_worker_url(u) for u in self.prefill_urls),
        )
        if set(self.prefill_urls) & {normalize_worker_url(u) for u in self.worker_urls}:
            raise ValueError("a worker cannot be both a prefill and a decode worker")
        if self.prefill_urls and not shared_secret(self.disaggregation_secret):
            raise ValueError(
                "PD dispatch signs what it hands the workers: give the router the workers' secret "
                f"(--disaggregation-secret, or {SECRET_ENV})"
            )
        for name in ("api_key", "worker_api_key", "disaggregation_secret"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ValueError(f"{name} must not be empty; omit the flag instead")
        object.__setattr__(
            self,
            "worker_urls",
            tuple(normalize_worker_url(u) for u in self.worker_urls),
        )
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError(
                f"worker_urls lists a worker twice: {list(self.worker_urls)}"
            )
        positive = (
            "health_check_interval",
            "health_check_timeout",
            "load_poll_interval",
            "connect_timeout",
            "request_timeout",
            "breaker_cooldown",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{name} must be > 0 seconds, got {getattr(self, name)}"
                )
        for name in (
            "health_failure_threshold",
            "health_success_threshold",
            "breaker_failure_threshold",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0 or self.retry_backoff < 0 or self.retry_backoff_max < 0:
            raise ValueError(
                "max_retries, retry_backoff and retry_backoff_max must be >= 0"
            )
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(
                f"cache_threshold must be in [0, 1], got {self.cache_threshold}"
            )
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError(
                "balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1"
            )
        if self.max_tree_chars < 1:
            raise ValueError(f"max_tree_chars must be >= 1, got {self.max_tree_chars}")
        if self.max_request_bytes < 1024:
            raise ValueError(
                f"max_request_bytes must be >= 1024, got {self.max_request_bytes}"
            )
        if self.service_discovery not in SERVICE_DISCOVERY:
            raise ValueError(
                f"service_discovery must be one of {SERVICE_DISCOVERY[1:]}, got {self.service_discovery!r}"
            )
        if self.service_discovery == "k8s" and not self.selector:
            raise ValueError(
                "--service-discovery k8s needs --selector, e.g. --selector app=strata,component=replica"
            )
        if self.selector and self.service_discovery is None:
            raise ValueError("--selector is for --service-discovery k8s; give that too")
        if self.k8s_port is not None and not 0 < self.k8s_port <= 65535:
            raise ValueError(f"k8s_port must be in [1, 65535], got {self.k8s_port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )
