"""Forwarding one request: pick a worker, send, retry elsewhere before the first byte, stream.

One request's life in the router:

    body read (≤ max_request_bytes) ─▶ routing key (the prompt) ─▶ attempt 1 ─▶ ... ─▶ attempt 1+max_retries
    attempt:  policy picks among routable workers not tried yet ─▶ send ─▶ wait for the status line
              ├─ transport error / 5xx, nothing sent to the client yet ─▶ record failure, back off, next attempt
              ├─ SSE (text/event-stream): wait for the first chunk (still retryable), then commit and
              │    pass every chunk through as it arrives; a worker dying mid-stream ends the stream
              │    with an SSE error event (tokens were sent: it cannot be retried)
              └─ anything else: read the whole body (still retryable), then send it

The client leaving at any point closes the upstream request, so the worker aborts it and frees
its KV. A read timeout (the worker accepted the request but is too slow) is not retried: the
request may still be running there; the client gets 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import httpx
import msgspec
from starlette.responses import Response

from strata.router.config import RouterConfig
from strata.router.metrics import RouterMetrics
from strata.router.policy import Policy, RoutingKey
from strata.router.pool import WorkerPool, describe_error
from strata.router.prefix_tree import token_key
from strata.router.worker import Worker

logger = logging.getLogger("strata.router")

# never forwarded, either way (hop-by-hop, or recomputed by the next hop)
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_REQUEST_DROP = _HOP_BY_HOP | {"authorization", "accept-encoding"}
_RESPONSE_DROP = _HOP_BY_HOP | {"content-encoding", "date", "server"}
WORKER_HEADER = "x-strata-worker"  # on every proxied response: which worker answered

_json = msgspec.json.Encoder()


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """The OpenAI error shape, as `strata serve` answers it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status in (401, 403):
        kind = "authentication_error"
    elif status == 404:
        kind = "not_found_error"
    return _json.encode(
        {
            "error": {
                "message": message,
                "type": kind,
                "param": None,
                "code": code or status,
            }
        }
    )


# ------------------------------------------------------------------ routing key


def _message_text(message: Any) -> str:
    """Total over any JSON: whatever the client sent, the worker (not the router) judges it."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    role = message.get("role")
    return f"{role if isinstance(role, str) else ''}\n{content if isinstance(content, str) else ''}\x1e"


def _is_ids(x: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def routing_key(route: str, body: Any) -> RoutingKey:
    """The prompt as a prefix-tree key: chat messages (role + content, in order, approximating the
    chat template), a completions `prompt`, or /generate `text` / `input_ids`. For a batch, the first
    prompt stands for the request. None when there is no prompt to look at."""
    if not isinstance(body, dict):
        return RoutingKey(None)
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list) and messages:
            return RoutingKey("".join(_message_text(m) for m in messages))
        return RoutingKey(None)
    prompt = body.get("prompt") if route == "/v1/completions" else body.get("text")
    if route == "/generate" and prompt is None:
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and not _is_ids(prompt):
        prompt = prompt[0]  # a batch: strings or id lists
    if isinstance(prompt, str) and prompt:
        return RoutingKey(prompt)
    if _is_ids(prompt):
        return RoutingKey(token_key(prompt))
    return RoutingKey(None)


# ------------------------------------------------------------------ one request


@dataclass
class Failure:
    """An attempt that failed before anything reached the client."""

    worker: Worker
    kind: str  # connect | disconnect | timeout | status_5xx
    message: str
    status: int | None = None  # the worker's status, when it answered
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class ClientGone(Exception):
    pass


class Forwarder:
    """What every proxied request shares: config, workers, policy, metrics, the HTTP client."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        policy: Policy,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        rng: random.Random | None = None,
    ):
        self.config = config
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.rng = rng or random.Random()

    def upstream_headers(
        self, headers: list[tuple[bytes, bytes]]
    ) -> list[tuple[str, str]]:
        """Client headers minus hop-by-hop ones. Authorization: the --worker-api-key if set; else the
        client's own header passes through when this router has no key of its own (the workers may
        check it); a key meant for this router is never forwarded."""
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in headers
            if k.decode("latin-1").lower() not in _REQUEST_DROP
        ]
        if self.config.worker_api_key:
            out.append(("authorization", f"Bearer {self.config.worker_api_key}"))
        elif not self.config.api_key:
            out.extend(
                (k.decode("latin-1"), v.decode("latin-1"))
                for k, v in headers
                if k.lower() == b"authorization"
            )
        out.append(("accept-encoding", "identity"))
        return out

    def backoff_s(self, retry: int) -> float:
        base = min(
            self.config.retry_backoff_max, self.config.retry_backoff * 2 ** (retry - 1)
        )
        return base * self.rng.uniform(0.5, 1.0)


class ProxyResponse(Response):
    """An ASGI response that does the forwarding itself (it needs `receive` to notice the client
    leaving and `send` to stream). Returned by the app's handlers."""

    def __init__(
        self,
        fwd: Forwarder,
        *,
        route: str,
        method: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        key: RoutingKey,
        arrived: float,
    ):
        self.fwd = fwd
        self.route = route
        self.method = method
        self.path = path  # with the query string
        self.body: bytes = body
        self.forward_headers = fwd.upstream_headers(headers)
        self.key = key
        self.arrived = arrived
        self.started = False  # response start sent to the client
        self.background = None  # FastAPI attaches background tasks here

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.ensure_future(self._run(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if (
                not task.done()
            ):  # the client left: cancelling closes the upstream request
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ClientGone):
                await task

    # ---------------------------------------------------------------- attempts

    async def _run(self, send) -> None:
        fwd, cfg = self.fwd, self.fwd.config
        tried: set[str] = set()
        failures: list[Failure] = []
        for attempt in range(1 + cfg.max_retries):
            candidates = fwd.pool.routable(exclude=tried)
            if not candidates:
                break
            if attempt:
                fwd.metrics.retries.labels(failures[-1].worker.url).inc()
                await asyncio.sleep(fwd.backoff_s(attempt))
                candidates = (
                    fwd.pool.routable(exclude=tried) or candidates
                )  # it may have changed meanwhile
            choice = fwd.policy.choose(candidates, self.key)
            worker = choice.worker
            tried.add(worker.url)
            fwd.metrics.decisions.labels(
                fwd.policy.name, choice.decision, worker.url
            ).inc()
            failure = await self._attempt(worker, send)
            if failure is None:
                return
            failures.append(failure)
            logger.info(
                "%s %s: attempt %d on %s failed (%s)%s",
                self.method,
                self.route,
                attempt + 1,
                worker.url,
                failure.message,
                "; retrying elsewhere" if attempt < cfg.max_retries else "",
            )
        await self._give_up(send, failures)

    async def _attempt(self, worker: Worker, send) -> Failure | None:
        """One try on one worker; None when the client got an answer (then nothing is retried)."""
        fwd = self.fwd
        fwd.metrics.requests.labels(worker.url, self.route).inc()
        worker.on_dispatch()
        try:
            return await self._exchange(worker, send)
        finally:
            worker.on_done()

    def _fail(self, worker: Worker, kind: str, message: str, **kw) -> Failure:
        self.fwd.metrics.errors.labels(worker.url, kind).inc()
        # a worker answering 503 is overloaded or still loading, not broken: its health check says which
        worker.on_failure(message, count_for_breaker=kw.get("status") != 503)
        return Failure(worker, kind, message, **kw)

    async def _exchange(self, worker: Worker, send) -> Failure | None:
        fwd = self.fwd
        request = fwd.client.build_request(
            self.method,
            worker.url + self.path,
            content=self.body or None,
            headers=self.forward_headers,
        )
        try:
            resp = await fwd.client.send(request, stream=True)
        except httpx.ReadTimeout:
            await self._timed_out(worker, send)
            return None
        except httpx.TransportError as exc:
            kind = (
                "connect"
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                else "disconnect"
            )
            return self._fail(worker, kind, describe_error(exc))
        try:
            headers = _response_headers(resp, worker)
            is_sse = resp.headers.get("content-type", "").startswith(
                "text/event-stream"
            )
            try:
                if resp.status_code >= 500 or not is_sse:
                    first = await resp.aread()
                else:
                    chunks = resp.aiter_raw()
                    first = await anext(chunks, b"")
            except httpx.ReadTimeout:
                await self._timed_out(worker, send)
                return None
            except httpx.TransportError as exc:
                return self._fail(worker, "disconnect", describe_error(exc))
            if resp.status_code >= 500:
                return self._fail(
                    worker,
                    "status_5xx",
                    f"answered {resp.status_code}: {_snippet(first)}",
                    status=resp.status_code,
                    body=first,
                    headers=headers,
                )
            # committed: from here on the client has bytes, so nothing is retried
            worker.on_success()
            await self._send(send, resp.status_code, headers, first, more=is_sse)
            if not is_sse:
                return None
            try:
                async for chunk in chunks:
                    await _send_body(send, chunk, more=True)
            except httpx.TransportError as exc:
                message = (
                    f"the worker {worker.url} failed mid-stream ({describe_error(exc)})"
                )
                fwd.metrics.errors.labels(worker.url, "stream_broken").inc()
                worker.on_failure(message)
                logger.warning("%s %s: %s", self.method, self.route, message)
                await _send_body(
                    send,
                    b"data: " + error_body(502, message, "worker_failed") + b"\n\n",
                    more=True,
                )
            await _send_body(send, b"", more=False)
            return None
        finally:
            await resp.aclose()

    async def _timed_out(self, worker: Worker, send) -> None:
        """The worker accepted the request but did not answer in time: it may still be running it
        there, so it is not retried elsewhere."""
        timeout = self.fwd.config.request_timeout
        self.fwd.metrics.errors.labels(worker.url, "timeout").inc()
        worker.on_failure(f"no answer within {timeout:.0f}s")
        await self._send_error(
            send,
            504,
            f"the worker {worker.url} did not answer within {timeout:.0f}s (--request-timeout)",
            "worker_timeout",
        )

    async def _give_up(self, send, failures: list[Failure]) -> None:
        fwd = self.fwd
        if not failures:
            fwd.metrics.failed.labels("no_worker").inc()
            await self._send_error(
                send,
                503,
                fwd.pool.why_none_routable(),
                "no_healthy_workers",
                retry_after=1,
            )
            return
        fwd.metrics.failed.labels("all_attempts_failed").inc()
        last = failures[-1]
        if last.status is not None:
            # the worker's own error (e.g. 503 queue full, with its Retry-After) says the most
            await self._send(send, last.status, last.headers, last.body, more=False)
            return
        tried = "; ".join(f"{f.worker.url}: {f.message}" for f in failures)
        await self._send_error(
            send,
            502,
            f"{len(failures)} attempt(s) failed and no other worker is left to try ({tried})",
            "all_workers_failed",
            retry_after=1,
        )

    # ---------------------------------------------------------------- sending

    async def _send_error(
        self, send, status: int, message: str, code: str, retry_after: int | None = None
    ):
        headers = [(b"content-type", b"application/json")]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        await self._send(
            send, status, headers, error_body(status, message, code), more=False
        )

    async def _send(
        self,
        send,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        more: bool,
    ):
        if not more:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        try:
            await send(
                {"type": "http.response.start", "status": status, "headers": headers}
            )
        except OSError:
            raise ClientGone() from None
        self.started = True
        self.fwd.metrics.ttfb.labels(self.route).observe(
            time.perf_counter() - self.arrived
        )
        await _send_body(send, body, more)


async def _send_body(send, body: bytes, more: bool) -> None:
    try:
        await send({"type": "http.response.body", "body": body, "more_body": more})
    except (
        OSError
    ):  # uvicorn raises ClientDisconnected (an OSError) once the client is gone
        raise ClientGone() from None


async def _wait_disconnect(receive: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _response_headers(
    resp: httpx.Response, worker: Worker
) -> list[tuple[bytes, bytes]]:
    out = [
        (k, v)
        for k, v in resp.headers.raw
        if k.decode("latin-1").lower() not in _RESPONSE_DROP
    ]
    out.append((WORKER_HEADER.encode(), worker.url.encode()))
    return out


def _snippet(content: bytes, limit: int = 200) -> str:
    try:
        return str(msgspec.json.decode(content)["error"]["message"])[:limit]
    except (msgspec.DecodeError, KeyError, TypeError):
        return content[:limit].decode("utf-8", "replace")
