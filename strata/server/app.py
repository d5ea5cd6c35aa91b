"""The FastAPI app: the guard (API key, body size), OpenAI-shaped errors, and the admin endpoints.

    GET  /health            200 once the model is loaded and its engine answers; 503 before, after a
                            failure, or while the engine is stopped or stuck (never needs the API key)
    GET  /health_generate   200 after a 1-token generation succeeds, 503 otherwise
    GET  /get_server_info   config, KV cache usage (free / total / cached pages), load, hit rate, expert load
    POST /flush_cache       empty the prefix cache; 409 while requests are in flight
    GET  /metrics           Prometheus text format (a MoE model's: fresh per-expert counts from the engine)
    GET  /                  the web page: chat playground and live dashboard (strata/web; no key needed)
    + /v1/* (openai_api.py, chat_api.py, embeddings_api.py, responses_api.py, batch_api.py: files
      and batches) and /generate (native_api.py)

Every error a client sees has the OpenAI shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os

from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from strata.redact import redacted, scrub, secret_values
from strata.sampling_params import SamplingParams
from strata.server import (
    batch_api,
    chat_api,
    embeddings_api,
    lora_api,
    native_api,
    openai_api,
    responses_api,
)
from strata.server.api_keys import current_key, load_api_keys
from strata.server.batch_api import (
    INTERNAL_HEADER,
    KEY_NAME_HEADER,
    BatchRunner,
)
from strata.server.batch_store import BatchStore
from strata.server.engine_client import EngineUnavailable, Job
from strata.server.metrics import ServerMetrics
from strata.server.openapi import openapi_document
from strata.server.protocol import APIError, error_body
from strata.server.serving import (
    ClientGone,
    ServerState,
    collect,
    get_state,
    json_response,
    start_generation,
)
from strata.web import PAGE_PATHS, add_page_routes

logger = logging.getLogger(__name__)

PUBLIC_PATHS = (
    frozenset({"/health"}) | PAGE_PATHS
)  # the page holds no secret; its API calls need the key
HEALTH_GENERATE_TIMEOUT_S = 60.0


class Guard:
    """ASGI middleware: the API key (all paths but /health) and the declared body size, before any
    parsing. `api_keys`: key -> the name its usage is counted under (strata.server.api_keys; empty:
    no authentication)."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: dict[str, str],
        max_request_bytes: int,
        metrics: ServerMetrics | None = None,
        internal_token: str | None = None,
    ):
        self.app = app
        # the batch runner's own requests carry this process's token and the name of the key
        # whose batch they belong to (strata.server.batch_api)
        self.internal = internal_token.encode() if internal_token else None
        self.expected = [(f"Bearer {k}".encode(), name) for k, name in api_keys.items()]
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics

    def _key_name(self, given: bytes) -> str | None:
        """The name of the key `given` carries (every key compared, in constant time each)."""
        found = None
        for expected, name in self.expected:
            if hmac.compare_digest(given, expected):
                found = name
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        internal = headers.get(INTERNAL_HEADER.encode())
        if (
            internal is not None
            and self.internal is not None
            and hmac.compare_digest(internal, self.internal)
        ):
            name = headers.get(KEY_NAME_HEADER.encode(), b"").decode() or None
            current_key.set(name)
            if self.metrics is not None and name is not None:
                self.metrics.on_key_request(name)
        elif self.expected and scope["path"] not in PUBLIC_PATHS:
            given = headers.get(b"authorization", b"")
            name = self._key_name(given)
            if name is None:
                message = (
                    "invalid API key"
                    if given
                    else "missing API key: send the header 'Authorization: Bearer <key>'"
                )
                return await _send_error(
                    send, 401, message, code="invalid_api_key", www_authenticate=True
                )
            current_key.set(name)
            if self.metrics is not None:
                self.metrics.on_key_request(name)
        length = headers.get(b"content-length")
        if (
            length is not None
            and length.isdigit()
            and int(length) > self.max_request_bytes
        ):
            return await _send_error(
                send,
                413,
                f"the request body is {int(length)} bytes; this server accepts at most {self.max_request_bytes} "
                "(see --max-request-bytes)",
                code="request_too_large",
            )
        await self.app(scope, receive, send)


async def _send_error(
    send: Send, status: int, message: str, *, code: str, www_authenticate: bool = False
) -> None:
    body = error_body(status, message, code=code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if www_authenticate:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 413:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Strata", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.strata = state
    secrets = secret_values(
        state.config, state.engine_config
    )  # scrubbed from any error message
    api_keys = load_api_keys(state.config.api_key, state.config.api_key_file)
    secrets = sorted({*secrets, *api_keys}, key=len, reverse=True)
    if state.batches is None:
        state.batches = BatchRunner(
            BatchStore(state.config.batch_dir),
            state.config.batch_concurrency,
            state.config.batch_priority,
        )
    app.add_middleware(
        Guard,
        api_keys=api_keys,
        max_request_bytes=state.config.max_request_bytes,
        metrics=state.metrics,
        internal_token=state.batches.token,
    )

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return Response(
            exc.body(),
            status_code=exc.status,
            media_type="application/json",
            headers=exc.headers,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += " (endpoints: /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/batches, /v1/files, /v1/models, /generate, /health, ...)"
        return Response(
            error_body(exc.status_code, message),
            status_code=exc.status_code,
            media_type="application/json",
        )

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(
            status_code=499
        )  # nobody is listening; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.error(
            "internal error serving %s %s",
            request.method,
            request.url.path,
            exc_info=exc,
        )
        body = error_body(
            500, scrub(f"internal server error: {type(exc).__name__}: {exc}", secrets)
        )
        return Response(body, status_code=500, media_type="application/json")

    app.include_router(openai_api.router)
    app.include_router(chat_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(responses_api.router)
    app.include_router(native_api.router)
    app.include_router(batch_api.router)
    app.include_router(lora_api.router)
    add_page_routes(app)  # GET /: the playground and dashboard (strata/web)

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = get_state(request)
        client = state.client
        if client.failure is not None:
            return Response(
                error_body(503, client.failure),
                status_code=503,
                media_type="application/json",
            )
        stalled = client.stalled()
        if stalled is not None:
            return Response(
                error_body(503, stalled), status_code=503, media_type="application/json"
            )
        if client.info is None:
            body = error_body(503, "the model is still loading")
            return Response(
                body,
                status_code=503,
                media_type="application/json",
                headers={"Retry-After": "5"},
            )
        return json_response({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        state = get_state(request)
        info = state.engine_info()
        token = info.bos_token_id if info.bos_token_id is not None else 0
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        gen = await start_generation(state, [Job([token], params)])
        try:
            results = await asyncio.wait_for(
                collect(request, gen), HEALTH_GENERATE_TIMEOUT_S
            )
        except asyncio.TimeoutError:
            raise APIError(
                503,
                f"a 1-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:.0f}s",
            ) from None
        finally:
            gen.close()
        return json_response({"status": "ok", "output_ids": results[0].token_ids})

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        state = get_state(request)
        client = state.client
        stats = await client.fetch_stats() if client.serving else client.stats
        return json_response(
            {
                "model": state.model_name,
                "model_dir": state.model_dir,
                "ready": client.serving,
                "failure": client.failure,
                "engine_config": redacted(state.engine_config),
                "server_config": redacted(state.config),
                "engine": client.info,
                "kv_cache": {
                    "page_size": stats.page_size,
                    "total_pages": stats.num_pages,
                    "free_pages": stats.num_free_pages,
                    "cached_pages": stats.num_cached_pages,
                    "evictable_cached_pages": stats.num_evictable_pages,
                    "token_usage": stats.token_usage,
                    "leaked_pages": stats.leaked_pages,
                    "window_groups": stats.window_groups,
                },
                "disaggregation": {
                    "mode": client.info.disaggregation_mode
                    if client.info
                    else state.engine_config.disaggregation_mode,
                    "bootstrap_addr": client.info.bootstrap_addr
                    if client.info
                    else None,
                },
                "num_running_reqs": stats.num_running,
                "num_queue_reqs": stats.num_waiting,
                "num_waiting_first_token": client.num_queued,
                "num_retractions": stats.num_retractions,
                "num_preemptions": stats.num_preemptions,
                "hicache": stats.hicache,  # per-tier hit tokens and rates, bytes moved (None: off)
                "speculative": stats.spec,  # drafted / accepted tokens, the policy's choices (None: off)
                # per MoE layer since start: tokens routed, the busiest expert, max / mean (None: dense)
                "expert_load": stats.expert_load_summary,
                "parallel": stats.parallel,  # --tp-size/--ep-size: workers, health, rows per rank (None: one rank)
                "step_threads": stats.step_threads,  # CPU: threads per size of step, as measured (None: off)
                "num_aborted_requests": client.num_aborted,
                # /v1/batches not yet ended, and their lines (total, answered)
                "batches": state.batches.summary() if state.batches else None,
                "cache_hit_rate": state.metrics.hit_rate,
                "frontend_pid": os.getpid(),
            }
        )

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        state = get_state(request)
        state.engine_info()
        result = await state.client.flush_cache()
        if not result.ok:
            raise APIError(409, result.message, code="requests_in_flight")
        return json_response({"message": result.message})

    openapi = openapi_document("Strata", router=False, secured=bool(api_keys))

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return json_response(openapi)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        state = get_state(request)
        client = state.client
        if client.serving and client.info.num_experts:
            # a MoE model's per-expert counts (58 layers x 256 experts for DeepSeek-V3) never ride
            # along with outputs: each scrape asks for them; the reply sets the gauges as it arrives
            with contextlib.suppress(
                EngineUnavailable
            ):  # it just died: serve the last figures
                await client.fetch_stats(expert_load=True)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
