"""The router's FastAPI app: the workers' API proxied, plus the router's own endpoints.

    POST /v1/chat/completions, /v1/completions, /generate, /v1/embeddings   proxied (SSE streamed through)
    GET  /v1/models, /health_generate                        proxied to one routable worker
    GET  /health             200 while at least one worker is routable (PD: one prefill and one decode
                             worker), else 503 saying which role has none and why (no key)
    GET  /get_server_info    the router's config, every worker's state and load, summed counts
    POST /flush_cache        flushes every healthy worker, and the policy's record of their caches
    GET  /metrics            the router's Prometheus metrics (strata:router_*)
    GET  /                   the web page: chat playground and dashboard with per-worker load (no key)
    GET  /workers            workers with health, circuit, load, counts
    POST /workers            {"url": "http://host:port"}: add one (400 bad URL, 409 already there)
    DELETE /workers          {"url": ...} or ?url=...: remove one (404 if unknown)
    (with --service-discovery k8s, Ready pods matching --selector join and leave by themselves)

Every error has the OpenAI shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata.redact import redacted
from strata.router.config import RouterConfig
from strata.router.metrics import RouterMetrics
from strata.router.pd import PDProxyResponse
from strata.router.pool import WorkerPool, describe_error
from strata.router.proxy import Forwarder, ProxyResponse, error_body, routing_key
from strata.router.registry import POLICIES, make_policy
from strata.router.worker import Health
from strata.server.openapi import openapi_document
from strata.web import PAGE_PATHS, add_page_routes

if TYPE_CHECKING:
    from strata.router.k8s_discovery import K8sDiscovery

logger = logging.getLogger("strata.router")

PUBLIC_PATHS = (
    frozenset({"/health"}) | PAGE_PATHS
)  # the page holds no secret; its API calls need the key
PROXIED_POST = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/embeddings",
)
# answered by one worker even behind a prefill/decode pair (no KV to hand over): the decode side's
ONE_WORKER_POST = frozenset({"/v1/embeddings"})
PROXIED_GET = ("/v1/models", "/health_generate")
MAX_CONNECTIONS = 4096

_json = msgspec.json.Encoder()


class RouterError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(
        _json.encode(obj), status_code=status, media_type="application/json"
    )


class Gateway:
    """Everything one router owns; started and stopped with the app (its lifespan)."""

    def __init__(
        self,
        config: RouterConfig,
        launched_urls: frozenset[str] = frozenset(),
        seed: int | None = None,
    ):
        self.config = config
        self.launched_urls = launched_urls
        self.rng = random.Random(seed)
        self.metrics = RouterMetrics()
        self.policy = make_policy(config, self.rng)
        self.client: httpx.AsyncClient | None = None
        self.pool: WorkerPool | None = (
            None  # the workers that answer clients (decode workers in PD mode)
        )
        self.forwarder: Forwarder | None = None
        # PD mode: prefill workers, with their own policy
        self.prefill_policy = (
            POLICIES[config.prefill_policy](config, self.rng)
            if config.prefill_urls
            else None
        )
        self.prefill_pool: WorkerPool | None = None
        self.discovery: K8sDiscovery | None = None  # with --service-discovery k8s
        self.started_at = time.time()

    async def start(self) -> None:
        cfg = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout),
            # idle connections expire before a worker drops them (uvicorn: 5 s), so none is reused half-closed
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS,
                max_keepalive_connections=256,
                keepalive_expiry=2.0,
            ),
            trust_env=False,  # workers are reached directly, never through an HTTP proxy
        )
        self.pool = WorkerPool(cfg, self.policy, self.metrics, self.client)
        self.forwarder = Forwarder(
            cfg, self.pool, self.policy, self.metrics, self.client, self.rng
        )
        await asyncio.gather(
            *(
                self.pool.add(u, launched=u in self.launched_urls)
                for u in cfg.worker_urls
            )
        )
        if self.prefill_policy is not None:
            self.prefill_pool = WorkerPool(
                cfg, self.prefill_policy, self.metrics, self.client
            )
            await asyncio.gather(*(self.prefill_pool.add(u) for u in cfg.prefill_urls))
        if cfg.service_discovery == "k8s":
            from strata.router.k8s_discovery import K8sDiscovery

            assert cfg.selector is not None  # RouterConfig requires it with k8s
            self.discovery = K8sDiscovery.in_cluster(
                cfg.selector,
                add=self.pool.add,
                remove=self.pool.remove,
                namespace=cfg.k8s_namespace,
                port=cfg.k8s_port,
                api_url=cfg.k8s_api_url,
            )
            self.discovery.start()

    def role_pools(self) -> dict[str, WorkerPool | None]:
        """The pool of each role a request needs, by role name ("" when the router has one role).
        A pool is None until the router has started."""
        if self.prefill_policy is None:
            return {"": self.pool}
        return {"prefill": self.prefill_pool, "decode": self.pool}

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        if self.prefill_pool is not None:
            await self.prefill_pool.close()
        if self.pool is not None:
            await self.pool.close()
        if self.client is not None:
            await self.client.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await self.start()
        try:
            yield
        finally:
            await self.close()


class Guard:
    """ASGI middleware: the router's API key on every path but /health."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and self.expected is not None
            and scope["path"] not in PUBLIC_PATHS
        ):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = (
                    "invalid API key"
                    if given
                    else "missing API key: send 'Authorization: Bearer <key>'"
                )
                body = error_body(401, message, "invalid_api_key")
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ]
                await send(
                    {"type": "http.response.start", "status": 401, "headers": headers}
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(
        title="Strata router",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    app.add_middleware(Guard, api_key=gateway.config.api_key)
    add_page_routes(app)  # GET /: the playground and dashboard (strata/web)
    cfg = gateway.config

    @app.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> Response:
        return Response(
            error_body(exc.status, exc.message, exc.code),
            exc.status,
            media_type="application/json",
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += (
                f" (the router serves {', '.join(PROXIED_POST)}, {', '.join(PROXIED_GET)}, /health, "
                "/get_server_info, /flush_cache, /metrics, /workers)"
            )
        return Response(
            error_body(exc.status_code, message),
            exc.status_code,
            media_type="application/json",
        )

    async def read_body(request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_request_bytes:
                raise RouterError(
                    413,
                    f"the request body is larger than {cfg.max_request_bytes} bytes (--max-request-bytes)",
                    "request_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def proxy(request: Request) -> Response:
        arrived = time.perf_counter()
        route = request.url.path
        body = await read_body(request) if request.method == "POST" else b""
        try:
            parsed = msgspec.json.decode(body) if body else None
        except msgspec.DecodeError:
            parsed = None  # forwarded as is: the worker answers the precise 400
        path = route + (f"?{request.url.query}" if request.url.query else "")
        assert gateway.forwarder is not None
        common = dict(
            route=route,
            method=request.method,
            path=path,
            body=body,
            headers=request.scope["headers"],
            key=routing_key(route, parsed),
            arrived=arrived,
        )
        if (
            gateway.prefill_pool is not None
            and request.method == "POST"
            and route not in ONE_WORKER_POST
        ):
            return PDProxyResponse(
                gateway.forwarder,
                prefill_pool=gateway.prefill_pool,
                prefill_policy=gateway.prefill_policy,
                **common,
            )
        return ProxyResponse(gateway.forwarder, **common)

    for route in PROXIED_POST:
        app.add_api_route(route, proxy, methods=["POST"], include_in_schema=False)
    for route in PROXIED_GET:
        app.add_api_route(route, proxy, methods=["GET"], include_in_schema=False)

    @app.get("/health")
    async def health() -> Response:
        # every role a request needs must have a routable worker (PD: a prefill and a decode worker)
        missing = []
        for role, pool in gateway.role_pools().items():
            if pool is None:
                missing = ["the router is starting"]
                break
            if not pool.routable():
                why = pool.why_none_routable()
                missing.append(f"no routable {role} worker: {why}" if role else why)
        if missing:
            body = error_body(503, "; ".join(missing), "no_healthy_workers")
            return Response(body, 503, media_type="application/json")
        assert gateway.pool is not None
        status: dict[str, Any] = {
            "status": "ok",
            "routable_workers": len(gateway.pool.routable()),
        }
        if gateway.prefill_pool is not None:
            status["routable_prefill_workers"] = len(gateway.prefill_pool.routable())
        return json_response(status)

    def describe_workers() -> list[dict[str, Any]]:
        assert gateway.pool is not None
        return [
            {
                **w.describe(),
                **gateway.policy.describe_worker(w.url),
                "server_info": gateway.pool.server_info.get(w.url),
            }
            for w in gateway.pool.workers.values()
        ]

    openapi = openapi_document(
        "Strata router", router=True, secured=cfg.api_key is not None
    )

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return json_response(openapi)

    @app.get("/workers")
    async def list_workers() -> Response:
        return json_response({"policy": cfg.policy, "workers": describe_workers()})

    async def url_from(request: Request) -> str:
        url = request.query_params.get("url")
        if url is None:
            body = await read_body(request)
            try:
                data = msgspec.json.decode(body) if body else {}
            except msgspec.DecodeError as exc:
                raise RouterError(
                    400,
                    f'the body must be JSON like {{"url": "http://host:port"}} ({exc})',
                ) from None
            url = data.get("url") if isinstance(data, dict) else None
        if not isinstance(url, str):
            raise RouterError(
                400,
                'give the worker as {"url": "http://host:port"} in the body or as ?url=',
            )
        return url

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        assert gateway.pool is not None
        url = await url_from(request)
        try:
            worker = await gateway.pool.add(url)
        except ValueError as exc:
            raise RouterError(400, str(exc), "invalid_worker_url") from None
        except KeyError as exc:
            raise RouterError(409, exc.args[0], "worker_exists") from None
        return json_response(
            {**worker.describe(), **gateway.policy.describe_worker(worker.url)}
        )

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        assert gateway.pool is not None
        url = await url_from(request)
        try:
            worker = await gateway.pool.remove(url)
        except ValueError as exc:
            raise RouterError(400, str(exc), "invalid_worker_url") from None
        except KeyError:
            known = ", ".join(gateway.pool.workers) or "none"
            raise RouterError(
                404,
                f"no worker {url} is registered (registered: {known})",
                "worker_not_found",
            ) from None
        return json_response({"removed": worker.url, "in_flight": worker.in_flight})

    @app.get("/get_server_info")
    async def server_info() -> Response:
        assert gateway.pool is not None
        config = redacted(cfg)
        workers = describe_workers()
        infos = [
            w["server_info"] for w in workers if w["routable"] and w["server_info"]
        ]
        return json_response(
            {
                "role": "router",
                "router_config": config,
                "workers": workers,
                "num_workers": len(workers),
                "num_routable_workers": sum(w["routable"] for w in workers),
                "num_running_reqs": sum(i["num_running_reqs"] for i in infos),
                "num_queue_reqs": sum(i["num_queue_reqs"] for i in infos),
                "started_at": gateway.started_at,
            }
        )

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        pool = gateway.pool
        assert pool is not None and gateway.client is not None
        targets = [w for w in pool.workers.values() if w.health is Health.HEALTHY]
        if not targets:
            raise RouterError(503, pool.why_none_routable(), "no_healthy_workers")

        client = gateway.client
        assert client is not None  # set at startup

        async def flush(url: str) -> tuple[str, int, str]:
            try:
                resp = await client.post(
                    url + "/flush_cache", headers=pool.worker_headers, timeout=30
                )
            except httpx.HTTPError as exc:
                return url, 502, describe_error(exc)
            if resp.status_code == 200:
                gateway.policy.reset_worker(url)
            return url, resp.status_code, resp.text[:300]

        results = await asyncio.gather(*(flush(w.url) for w in targets))
        status = max(code for _, code, _ in results)
        body = {
            "workers": {
                url: {"status": code, "body": text} for url, code, text in results
            }
        }
        return json_response(body, 200 if status == 200 else status)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        workers = gateway.pool.workers.values() if gateway.pool is not None else []
        return Response(gateway.metrics.render(workers), media_type=CONTENT_TYPE_LATEST)

    return app
