"""Prefill/decode dispatch: each request goes to a prefill worker and a decode worker at once.

    client ─▶ router ─┬─ prefill worker: body + {bootstrap_room}, non-streaming (computes the
                      │     prompt's KV and first token, pushes the KV to the decode worker)
                      └─ decode worker: body + {bootstrap_room, bootstrap_addr}; its answer (streamed
                            or not) is the client's answer

Both bodies are signed: the router draws the room from `secrets` and sends each worker
`X-Strata-Bootstrap`, an HMAC (strata.disagg.auth, keyed by the workers' shared secret) over the
room, the KV address and that exact body; a worker refuses bootstrap fields without it. A client's
own X-Strata-Bootstrap header is never forwarded.

Each side is chosen by its own policy over its own pool (so prefill load spreads; it never
"always picks the first prefill worker"). The prefill worker's KV inbox address comes from its
/get_server_info (`disaggregation.bootstrap_addr`), polled with its load. If the prefill side fails
before the decode side has answered, the decode request is cancelled (freeing its reserved KV
slots at once) and the attempt fails: a 4xx from prefill goes to the client as is, anything else
is retried on other workers like any failure before the first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import msgspec

from strata.disagg import auth
from strata.router.pool import WorkerPool, describe_error
from strata.router.proxy import Failure, ProxyResponse
from strata.router.worker import Worker

logger = logging.getLogger("strata.router")

_json = msgspec.json.Encoder()


class PrefillFailed(Exception):
    def __init__(self, failure: Failure, client_error: bool):
        super().__init__(failure.message)
        self.failure, self.client_error = failure, client_error


class PDProxyResponse(ProxyResponse):
    """A ProxyResponse whose every attempt pairs the decode worker with a prefill worker."""

    def __init__(self, *args, prefill_pool: WorkerPool, prefill_policy, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill_pool = prefill_pool
        self.prefill_policy = prefill_policy
        try:
            self.parsed = msgspec.json.decode(self.body) if self.body else None
        except msgspec.DecodeError:
            self.parsed = None
        self.original_body = self.body
        self.forward_headers = [
            (k, v) for k, v in self.forward_headers if k.lower() != auth.HEADER
        ]
        self.original_headers = self.forward_headers
        self.secret = auth.shared_secret(self.fwd.config.disaggregation_secret)

    async def _attempt(self, worker: Worker, send) -> Failure | None:
        if not isinstance(
            self.parsed, dict
        ):  # not a JSON object: the decode worker explains the 400
            return await super()._attempt(worker, send)
        prefill = self._pick_prefill()
        if prefill is None:
            return Failure(
                worker,
                "no_prefill",
                self.prefill_pool.why_none_routable() or "no prefill worker",
            )
        addr = (self.prefill_pool.server_info.get(prefill.url) or {}).get(
            "bootstrap_addr"
        )
        if not addr:
            return Failure(
                prefill,
                "no_bootstrap",
                f"the prefill worker {prefill.url} has not reported its KV "
                "bootstrap address yet (is it started with --disaggregation-mode prefill?)",
            )
        room = auth.new_room()
        self.body = _json.encode(
            {**self.parsed, "bootstrap_room": room, "bootstrap_addr": addr}
        )
        self.forward_headers = self._signed_headers(room, addr, self.body)
        prefill_body = _json.encode(
            {**self.parsed, "bootstrap_room": room, "stream": False}
        )
        prefill_headers = self._signed_headers(room, None, prefill_body)
        p_task = asyncio.ensure_future(
            self._prefill(prefill, prefill_body, prefill_headers)
        )
        d_task = asyncio.ensure_future(super()._attempt(worker, send))
        try:
            done, _ = await asyncio.wait(
                {p_task, d_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if d_task in done and p_task not in done:
                p_task.add_done_callback(_log_prefill_outcome)
                return d_task.result()
            exc = p_task.exception()
            if exc is None:  # prefill done: the decode side continues on its own
                return await d_task
            if (
                self.started
            ):  # the decode side already answered: its stream reports the outcome
                return await d_task
            d_task.cancel()  # closes the decode request: its reserved slots are freed now
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await d_task
            assert isinstance(exc, PrefillFailed)
            if exc.client_error:
                f = exc.failure
                # a client error is a status the worker answered
                assert f.status is not None
                await self._send(send, f.status, f.headers, f.body, more=False)
                return None
            return exc.failure
        finally:
            self.body, self.forward_headers = self.original_body, self.original_headers

    def _signed_headers(
        self, room: int, addr: str | None, body: bytes
    ) -> list[tuple[str, str]]:
        assert self.secret is not None  # RouterConfig requires it with prefill workers
        return [
            *self.original_headers,
            (auth.HEADER, auth.sign_bootstrap(self.secret, room, addr, body)),
        ]

    def _pick_prefill(self) -> Worker | None:
        candidates = self.prefill_pool.routable()
        if not candidates:
            return None
        return self.prefill_policy.choose(candidates, self.key).worker

    async def _prefill(
        self, worker: Worker, body: bytes, headers: list[tuple[str, str]]
    ) -> None:
        fwd = self.fwd
        fwd.metrics.requests.labels(worker.url, self.route).inc()
        worker.on_dispatch()
        try:
            resp = await fwd.client.post(
                worker.url + self.path, content=body, headers=headers
            )
        except httpx.TransportError as exc:
            worker.on_failure(describe_error(exc))
            fwd.metrics.errors.labels(worker.url, "prefill").inc()
            raise PrefillFailed(
                Failure(
                    worker,
                    "prefill",
                    f"prefill worker {worker.url}: {describe_error(exc)}",
                ),
                client_error=False,
            ) from None
        finally:
            worker.on_done()
        if resp.status_code >= 400:
            fwd.metrics.errors.labels(worker.url, "prefill").inc()
            if resp.status_code >= 500:
                worker.on_failure(f"answered {resp.status_code}")
            failure_headers = [(b"content-type", b"application/json")]
            failure = Failure(
                worker,
                "prefill",
                f"prefill worker {worker.url} answered {resp.status_code}",
                status=resp.status_code,
                body=resp.content,
                headers=failure_headers,
            )
            raise PrefillFailed(failure, client_error=resp.status_code < 500)
        worker.on_success()


def _log_prefill_outcome(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning(
            "prefill side failed after the decode side answered: %s", task.exception()
        )
