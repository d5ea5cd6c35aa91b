"""The set of workers, and the background loops that keep their health and load current.

Each worker has two loops on the router's event loop:

    health  GET /health every health_check_interval; `health_failure_threshold` failures in a row
            eject it, `health_success_threshold` successes (re-)admit it. A re-admitted worker
            probably restarted with an empty KV cache, so the policy forgets what it routed there.
    load    GET /get_server_info every load_poll_interval (healthy workers only): running + queued
            requests as the worker counts them, which every router replica sees alike.

Workers can be added and removed while requests run; a removed worker's requests in flight finish
normally (they hold the Worker object), it just gets no new ones.

A circuit breaker exists to send traffic elsewhere while a worker fails. When every healthy worker
of a pool has its circuit open (or half-open with its trial in flight), there is no elsewhere:
refusing everything would turn a slow spell (requests timing out on an overloaded worker) into a
total outage for the cool-down, and a half-open trial into a queue of refusals. `routable` then
returns the healthy workers anyway (Envoy's "panic" routing), so clients get the workers' real
answers; a worker that fails its health checks is never routed to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from strata.router.config import RouterConfig, normalize_worker_url
from strata.router.metrics import RouterMetrics
from strata.router.policy import Policy
from strata.router.worker import CircuitBreaker, Health, Worker

logger = logging.getLogger("strata.router")


def describe_error(exc: BaseException) -> str:
    """A short, human reason for a transport failure ("connection refused", "timed out", ...)."""
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc or 'connection refused'})"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the worker closed the connection ({exc})"
    return f"{type(exc).__name__}: {exc}"


class WorkerPool:
    def __init__(
        self,
        config: RouterConfig,
        policy: Policy,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
    ):
        self.config = config
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.workers: dict[str, Worker] = {}  # url -> worker, in order of addition
        self.server_info: dict[
            str, dict[str, Any]
        ] = {}  # url -> a few fields of its last /get_server_info
        self._tasks: dict[str, list[asyncio.Task]] = {}

    @property
    def worker_headers(self) -> dict[str, str]:
        key = self.config.worker_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ---------------------------------------------------------------- membership

    async def add(self, url: str, *, launched: bool = False) -> Worker:
        """Register a worker (ValueError: bad URL; KeyError: already registered), check it once, and
        start its loops. Returns it healthy or not: a worker that is down now is admitted when it
        comes up."""
        url = normalize_worker_url(url)
        if url in self.workers:
            raise KeyError(f"worker {url} is already registered")
        worker = Worker(
            url,
            CircuitBreaker(
                self.config.breaker_failure_threshold, self.config.breaker_cooldown
            ),
            launched=launched,
        )
        self.workers[url] = worker
        await self.check_health(worker)
        if worker.health is Health.HEALTHY:
            await self.poll_load(worker)
        self._tasks[url] = [
            asyncio.ensure_future(self._health_loop(worker)),
            asyncio.ensure_future(self._load_loop(worker)),
        ]
        logger.info("worker %s added (%s)", url, worker.status())
        return worker

    async def remove(self, url: str) -> Worker:
        """Unregister a worker (KeyError if unknown); its requests in flight run to the end."""
        url = normalize_worker_url(url)
        worker = self.workers.pop(url)
        for task in self._tasks.pop(url, []):
            task.cancel()
        self.server_info.pop(url, None)
        self.policy.remove_worker(url)
        self.metrics.forget_worker(url)
        logger.info("worker %s removed", url)
        return worker

    def routable(
        self, exclude: set[str] | frozenset[str] = frozenset()
    ) -> list[Worker]:
        candidates = [w for w in self.workers.values() if w.url not in exclude]
        ready = [w for w in candidates if w.routable()]
        if ready:
            return ready
        return [w for w in candidates if w.health is Health.HEALTHY]  # panic routing

    def why_none_routable(self) -> str:
        if not self.workers:
            return 'no workers are registered; add one with POST /workers {"url": "http://host:port"}'
        reasons = "; ".join(
            f"{w.url}: {w.why_not_routable()}" for w in self.workers.values()
        )
        return f"no healthy workers ({len(self.workers)} registered: {reasons})"

    async def close(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    # ---------------------------------------------------------------- checks

    async def check_health(self, worker: Worker) -> None:
        error = None
        try:
            resp = await self.client.get(
                worker.url + "/health", timeout=self.config.health_check_timeout
            )
            if resp.status_code != 200:
                error = (
                    f"GET /health answered {resp.status_code}: {_error_message(resp)}"
                )
        except httpx.HTTPError as exc:
            error = f"GET /health: {describe_error(exc)}"
        was = worker.health
        admitted = worker.on_health_check(
            error is None,
            error,
            self.config.health_success_threshold,
            self.config.health_failure_threshold,
        )
        if worker.url not in self.workers:
            return  # removed meanwhile
        if admitted:
            if was is Health.UNHEALTHY:
                self.policy.reset_worker(
                    worker.url
                )  # it probably restarted: its cache is empty
                logger.warning("worker %s is healthy again; re-admitted", worker.url)
            else:
                logger.info("worker %s is healthy", worker.url)
        elif was is not Health.UNHEALTHY and worker.health is Health.UNHEALTHY:
            logger.warning("worker %s ejected: %s", worker.url, error)

    async def poll_load(self, worker: Worker) -> None:
        try:
            resp = await self.client.get(
                worker.url + "/get_server_info",
                headers=self.worker_headers,
                timeout=self.config.health_check_timeout,
            )
            if resp.status_code != 200:
                logger.debug(
                    "GET %s/get_server_info answered %d", worker.url, resp.status_code
                )
                return
            info = resp.json()
            running, queued = (
                int(info.get("num_running_reqs") or 0),
                int(info.get("num_queue_reqs") or 0),
            )
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
            logger.debug("load poll of %s failed: %s", worker.url, exc)
            return
        worker.on_load_report(running, queued)
        if worker.url in self.workers:
            self.server_info[worker.url] = {
                "model": info.get("model"),
                "num_running_reqs": running,
                "num_queue_reqs": queued,
                "cache_hit_rate": info.get("cache_hit_rate"),
                "token_usage": (info.get("kv_cache") or {}).get("token_usage"),
                # a disaggregated prefill worker's KV inbox (host:port), for PD dispatch
                "bootstrap_addr": (info.get("disaggregation") or {}).get(
                    "bootstrap_addr"
                ),
            }

    async def _health_loop(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.check_health(worker)

    async def _load_loop(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self.config.load_poll_interval)
            if worker.health is Health.HEALTHY:
                await self.poll_load(worker)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]
