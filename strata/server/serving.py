"""Serving one HTTP request's generation: the server's shared state, submitting jobs under the
queue limit, collecting or streaming the outputs, and aborting when the client goes away.

Every path that starts a Generation closes it when the HTTP exchange ends, however it ends
(finished, client disconnected, server shutting down); closing aborts what is still running, so
the engine frees that request's KV at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from strata.config import EngineConfig
from strata.disagg import auth as disagg_auth
from strata.engine.outputs import RequestOutput, TokenLogprob
from strata.server.config import ServerConfig
from strata.server.engine_client import (
    EngineClient,
    EngineUnavailable,
    Generation,
    Job,
    RequestRejected,
)
from strata.server.io import EngineInfo
from strata.server.metrics import ServerMetrics
from strata.server.protocol import APIError, error_body
from strata.server.reasoning import REASONING_PARSERS, ReasoningParser
from strata.server.responses_store import ResponseStore
from strata.server.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCallParser,
    detect_tool_call_parser,
)

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
OFFLOAD_BODY_BYTES = (
    64 * 1024
)  # larger bodies are decoded and tokenized off the event loop
LOADING_RETRY_AFTER_S = 5
QUEUE_FULL_RETRY_AFTER_S = 1

_json = msgspec.json.Encoder()
T = TypeVar("T")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(
        _json.encode(obj), status_code=status, media_type="application/json"
    )


def sse(event: Any) -> bytes:
    return b"data: " + _json.encode(event) + b"\n\n"


@dataclass
class ServerState:
    """What every handler needs; one per app (request.app.state.strata)."""

    config: ServerConfig
    engine_config: EngineConfig
    client: EngineClient
    tokenizer: Any  # transformers PreTrainedTokenizerBase | None
    metrics: ServerMetrics
    model_name: str
    model_aliases: frozenset[str]
    model_dir: str
    started_at: float
    _token_texts: dict[int, str] = field(default_factory=dict)
    grammars: Any = None  # strata.grammar.compiler.GrammarCompiler, built by the first structured request
    responses: ResponseStore = field(init=False)  # stored /v1/responses
    batches: Any = None  # strata.server.batch_api.BatchRunner, made by create_app
    _adapters: set[str] | None = (
        None  # LoRA adapters the engine serves (None: as it started)
    )

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.responses_store_size)

    @property
    def tool_call_parser(self) -> ToolCallParser:
        """--tool-call-parser, else the format the chat template shows."""
        if self.config.tool_call_parser is not None:
            return TOOL_CALL_PARSERS[self.config.tool_call_parser]
        return detect_tool_call_parser(getattr(self.tokenizer, "chat_template", None))

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        name = self.config.reasoning_parser
        return REASONING_PARSERS[name] if name is not None else None

    def engine_info(self) -> EngineInfo:
        try:
            self.client.check_available()
        except EngineUnavailable as exc:
            raise APIError(
                503, str(exc), headers={"Retry-After": str(LOADING_RETRY_AFTER_S)}
            ) from None
        assert self.client.info is not None
        return self.client.info

    @property
    def adapters(self) -> set[str]:
        """The LoRA adapters served now: those the engine started with, then as loaded/unloaded."""
        if self._adapters is None:
            info = self.client.info
            if info is None:
                return set()
            self._adapters = set(info.lora_adapters)
        return self._adapters

    def set_adapters(self, names: list[str]) -> None:
        self._adapters = set(names)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for neither."""
        if model is None or model in self.model_aliases:
            return None
        if model in self.adapters:
            return model
        served = [self.model_name, *sorted(self.adapters)]
        raise APIError(
            404,
            f"the model {model!r} is not served here; this server serves {served} (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise APIError(
                400,
                "this model has no tokenizer, so text prompts cannot be used; send token ids",
                param=param,
            )
        return self.tokenizer.encode(text, add_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = (
                self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            )
            self._token_texts[token_id] = text
        return text


_tokenizer_thread = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="strata-tokenize"
)


async def off_loop(num_bytes: int, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` (JSON decoding, chat template, tokenization) on one worker thread when the input is
    large, so a 10 MB prompt does not stall every other stream; small inputs run inline (cheaper)."""
    if num_bytes < OFFLOAD_BODY_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(
        _tokenizer_thread, fn, *args
    )


def get_state(request: Request) -> ServerState:
    return request.app.state.strata


async def read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(
                413,
                f"the request body is larger than this server accepts ({max_bytes} bytes; see --max-request-bytes)",
                code="request_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


def verified_bootstrap(
    state: ServerState, request: Request, body: bytes, req: Any
) -> tuple[int | None, str | None]:
    """`req`'s (bootstrap_room, bootstrap_addr), for a Job: accepted only from the PD router, whose
    X-Strata-Bootstrap header signs them together with this exact body (strata.disagg.auth)."""
    room, addr = req.bootstrap_room, req.bootstrap_addr
    if room is None and addr is None:
        return None, None
    cfg = state.engine_config
    if cfg.disaggregation_mode == "null":
        message = "bootstrap_room and bootstrap_addr are for disaggregated prefill/decode workers"
        raise APIError(400, message + "; this server is not one: drop the fields")
    secret = disagg_auth.shared_secret(cfg.disaggregation_secret)
    if not disagg_auth.verify_bootstrap(
        secret, room, addr, body, request.headers.get(disagg_auth.HEADER)
    ):
        message = (
            "bootstrap_room and bootstrap_addr are accepted only from the PD router: this request has no "
            f"valid {disagg_auth.HEADER.title()} signature over them and its body; send it through "
            "`strata router` started with the workers' --disaggregation-secret"
        )
        raise APIError(403, message)
    return room, addr


async def start_generation(state: ServerState, jobs: list[Job]) -> Generation:
    """Submit the jobs (after the queue-limit check). The caller must close the Generation."""
    client = state.client
    num_choices = sum(job.params.n for job in jobs)
    limit = state.config.max_queued_requests
    if limit is not None and client.num_queued >= limit:
        raise APIError(
            503,
            f"the server is at its queue limit ({limit} requests waiting to start; --max-queued-requests); "
            f"retry in a moment",
            code="queue_full",
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
        )
    gen = Generation(client, num_choices)
    try:
        await client.submit(gen, jobs)
    except RequestRejected as exc:
        gen.close()
        raise APIError(exc.status, str(exc)) from None
    except EngineUnavailable as exc:
        gen.close()
        raise APIError(
            503, str(exc), headers={"Retry-After": str(LOADING_RETRY_AFTER_S)}
        ) from None
    except BaseException:
        gen.close()
        raise
    return gen


@dataclass
class ChoiceResult:
    """One choice's outputs, accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_status: int | None = None  # RequestOutput.error_status
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] = field(
        default_factory=dict
    )  # per cache tier
    spec: dict[str, float] = field(
        default_factory=dict
    )  # speculative decoding (spec_fields), if it drafted

    def add(self, out: RequestOutput) -> None:
        self.text += out.text_delta
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop
            self.error, self.error_status = out.error, out.error_status
            self.prompt_tokens = out.prompt_tokens
            self.cached_tokens = out.cached_tokens
            self.cached_tokens_details = out.cached_tokens_details
            self.spec = spec_fields(out)


def spec_fields(out: RequestOutput) -> dict[str, float]:
    """Speculative decoding's part of a response's meta_info, so far (empty if nothing was drafted):
    steps that verified drafts, tokens drafted and accepted, mean tokens per verifying step, mean draft
    length chosen."""
    steps = out.spec_verify_steps
    if not steps:
        return {}
    return {
        "spec_verify_steps": steps,
        "spec_drafted_tokens": out.spec_drafted_tokens,
        "spec_accepted_tokens": out.spec_accepted_tokens,
        "spec_accept_length": (out.spec_accepted_tokens + steps) / steps,
        "spec_draft_length": out.spec_drafted_tokens / steps,
    }


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def collect(request: Request, gen: Generation) -> list[ChoiceResult]:
    """Wait for every choice to finish; abort (and raise ClientGone) if the client disconnects."""
    results = [ChoiceResult(i) for i in range(gen.num_choices)]

    async def consume() -> None:
        async for index, out in gen:
            results[index].add(out)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        gen.close()
    if not consumer.done() or consumer.cancelled():
        raise ClientGone()
    consumer.result()
    for r in results:
        if r.finish_reason == "error":
            raise APIError(
                r.error_status or 500, r.error or "the engine failed this request"
            )
    return results


def error_event(message: str, status: int = 500) -> bytes:
    return b"data: " + error_body(status, message) + b"\n\n"


class GenerationStream(StreamingResponse):
    """An SSE response whose Generation is closed (unfinished work aborted) however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], gen: Generation):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


def usage_counts(results: list[ChoiceResult], n: int) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens; the n choices of one prompt count the prompt once."""
    prompt = cached = 0
    for start in range(0, len(results), n):
        group = results[start : start + n]
        prompt += max(r.prompt_tokens for r in group)
        cached += max(r.cached_tokens for r in group)
    return prompt, sum(len(r.token_ids) for r in results), cached
