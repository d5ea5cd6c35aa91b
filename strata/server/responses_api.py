"""OpenAI's Responses API over the chat path:

    POST   /v1/responses                          create (streamed with stream: true)
    GET    /v1/responses/{id}                     a stored response
    DELETE /v1/responses/{id}                     forget it
    GET    /v1/responses/{id}/input_items         the items the model was given (limit, order, after)

A request becomes a chat completion (responses_input.py): the stored conversation it continues
(previous_response_id) and its own input items as chat messages through the chat template, its
function tools and tool_choice as chat's, `text.format` as the grammar. It then runs as chat runs
(chat_api.py's plan, grammar and sampling fields, the same engine request), and chat's splitter
parses the output into reasoning, content and calls, which responses_output.py makes output items
of. So a conversation gets the same output here as from /v1/chat/completions.

Status: "completed"; "incomplete" (incomplete_details.reason "max_output_tokens") when cut off;
"failed" (error.code "server_error") when the engine failed it. Streamed, the events are OpenAI's
typed ones, `event:` and `data:` lines numbered by sequence_number: response.created,
response.in_progress, each item's events, then response.completed / .incomplete / .failed. A client
that disconnects aborts the request, as for chat. A response with `store` (the default) is kept by
responses_store.py once it has finished.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from strata.server.chat_api import (
    ChatPlan,
    chat_logprobs,
    chat_plan,
    chat_prompt_ids,
    structured_fields,
)
from strata.server.chat_output import ChoiceParts
from strata.server.engine_client import Generation, Job
from strata.server.openai_api import sampling_fields
from strata.server.protocol import (
    APIError,
    decode_body,
    make_sampling_params,
    resolve_max_tokens,
)
from strata.server.responses_input import (
    LOGPROBS,
    chat_request,
    check_supported,
    input_items,
    text_format_spec,
    wants_logprobs,
)
from strata.server.responses_output import OutputBuilder
from strata.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    Item,
    ItemList,
    OutputTokensDetails,
    ReasoningConfig,
    ResponseDeleted,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
)
from strata.server.responses_protocol import Response as ResponseObject
from strata.server.responses_store import StoredResponse
from strata.server.serving import (
    GenerationStream,
    ServerState,
    collect,
    get_state,
    json_response,
    off_loop,
    read_body,
    start_generation,
)
from strata.server.structured import check_tools, tool_choice_of

router = APIRouter()

PARAM_NAMES = {"max_new_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20


@dataclass
class ResponseRun:
    """One request on its way: what its Response says before the output, and how it is stored."""

    state: ServerState
    base: ResponseObject  # status "in_progress", no output yet
    input: list[Item]  # the request's own input items
    previous: StoredResponse | None
    plan: ChatPlan
    logprobs: bool

    def finished(
        self,
        items: list[Item],
        reasoning: str,
        finish_reason: str | None,
        usage: tuple[int, int, int],
        error: str | None = None,
    ) -> ResponseObject:
        """The final Response (stored if the request asked to be); `usage`: (input, cached, output)
        tokens."""
        input_len, cached_len, output_len = usage
        status, incomplete, failure = "completed", None, None
        if finish_reason == "length":
            status, incomplete = "incomplete", IncompleteDetails("max_output_tokens")
        elif finish_reason != "stop":
            status = "failed"
            message = error or f"the request ended early ({finish_reason})"
            failure = ResponseError("server_error", message)
        response = msgspec.structs.replace(
            self.base,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=failure,
            incomplete_details=incomplete,
            output=items,
            usage=ResponseUsage(
                input_len,
                InputTokensDetails(cached_len),
                output_len,
                OutputTokensDetails(self.reasoning_len(reasoning, output_len)),
                input_len + output_len,
            ),
        )
        if response.store and status != "failed":
            self.state.responses.put(
                StoredResponse(response, self.input, self.previous)
            )
        return response

    def reasoning_len(self, reasoning: str, output_len: int) -> int:
        """Reasoning tokens, counted by tokenizing the reasoning text again (its tags not included)."""
        if not reasoning or self.state.tokenizer is None:
            return 0
        ids = self.state.tokenizer.encode(reasoning, add_special_tokens=False)
        return min(len(ids), output_len)


def base_response(state: ServerState, req: ResponsesRequest) -> ResponseObject:
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice
    return ResponseObject(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=int(time.time()),
        status="in_progress",
        model=state.model_name,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        reasoning=req.reasoning or ReasoningConfig(),
        store=req.store,
        temperature=1.0 if req.temperature is None else req.temperature,
        text={"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}},
        tool_choice=msgspec.to_builtins(choice) if choice is not None else "auto",
        tools=[msgspec.to_builtins(t) for t in req.tools or []],
        top_logprobs=req.top_logprobs,
        top_p=1.0 if req.top_p is None else req.top_p,
        truncation=req.truncation,
        user=req.user,
        metadata=req.metadata or {},
    )


def stored_or_404(state: ServerState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(
            404,
            f"no stored response with id {response_id!r}: it was not stored (store: false), was "
            f"deleted, or is older than the {state.config.responses_store_size} most recent this "
            "server keeps (--responses-store-size)",
        )
    return stored


def choice_parts(splitter: Any, text: str, finished: bool) -> ChoiceParts:
    """One piece of output text split by chat's splitter (None: all content)."""
    if splitter is None:
        return ChoiceParts(content=text)
    parts = splitter.feed(text) if text else ChoiceParts()
    if finished:
        parts.extend(splitter.finish())
    return parts


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, state.config.max_request_bytes)
    req: ResponsesRequest = await off_loop(
        len(body), decode_body, body, ResponsesRequest
    )
    lora = state.check_model(req.model)
    check_supported(req)
    previous = None
    if req.previous_response_id is not None:
        previous = state.responses.get(req.previous_response_id)
        if previous is None:
            raise APIError(
                400,
                f"Previous response with id {req.previous_response_id!r} not found: it was not "
                "stored (store: false), was deleted, or is older than the "
                f"{state.config.responses_store_size} most recent this server keeps",
                param="previous_response_id",
                code="previous_response_not_found",
            )
    items = input_items(req.input)
    history = previous.conversation() if previous is not None else []
    chat = await off_loop(len(body), chat_request, req, history + items)
    info = state.engine_info()
    tools = check_tools(chat)
    choice = tool_choice_of(chat)
    input_ids = await off_loop(len(body), chat_prompt_ids, state, chat, tools, "input")
    plan = chat_plan(state, choice, tools, input_ids)
    logprobs = wants_logprobs(req)
    if logprobs and plan.splitter() is not None:
        raise APIError(
            400,
            f"include {LOGPROBS!r} is not supported with tools or a --reasoning-parser (the "
            "tokens of the message are not told apart from the others)",
            param="include",
        )
    max_tokens = resolve_max_tokens(
        req.max_output_tokens,
        len(input_ids),
        info.context_len,
        info.num_kv_tokens,
        default=None,
        param="max_output_tokens",
        prompt_param="input",
    )
    fields = sampling_fields(
        chat, max_tokens, (req.top_logprobs or 0) if logprobs else None
    )
    fmt = text_format_spec(req.text)
    fields.update(
        await structured_fields(
            state, plan, tools, choice, fmt, req.parallel_tool_calls
        )
    )
    params = make_sampling_params(fields, info.vocab_size, PARAM_NAMES)
    run = ResponseRun(state, base_response(state, req), items, previous, plan, logprobs)
    gen = await start_generation(state, [Job(input_ids, params, lora=lora)])
    if req.stream:
        return GenerationStream(response_events(run, gen), gen)
    (result,) = await collect(request, gen)
    builder = OutputBuilder(stream=False)
    parts = choice_parts(plan.splitter(), result.text, finished=True)
    lps = chat_logprobs(state, result.logprobs).content if logprobs else None
    builder.feed(parts, lps)
    builder.finish(cut_off=result.finish_reason == "length")
    usage = (result.prompt_tokens, result.cached_tokens, len(result.token_ids))
    response = run.finished(
        builder.items, builder.reasoning, result.finish_reason, usage, result.error
    )
    return json_response(response)


async def response_events(run: ResponseRun, gen: Generation) -> AsyncIterator[bytes]:
    builder = OutputBuilder(stream=True)
    builder.event("response.created", response=run.base)
    builder.event("response.in_progress", response=run.base)
    yield builder.drain()
    splitter = run.plan.splitter()
    async for _, out in gen:
        if out.finished and out.finish_reason not in ("stop", "length"):
            usage = (out.prompt_tokens, out.cached_tokens, out.completion_tokens)
            failed = run.finished(
                builder.items, builder.reasoning, out.finish_reason, usage, out.error
            )
            builder.event("response.failed", response=failed)
            yield builder.drain()
            return
        parts = choice_parts(splitter, out.text_delta, out.finished)
        lps = None
        if run.logprobs and out.logprobs:
            lps = chat_logprobs(run.state, out.logprobs).content
        builder.feed(parts, lps)
        if out.finished:
            builder.finish(cut_off=out.finish_reason == "length")
            usage = (out.prompt_tokens, out.cached_tokens, out.completion_tokens)
            response = run.finished(
                builder.items, builder.reasoning, out.finish_reason, usage
            )
            kind = (
                "response.completed"
                if response.status == "completed"
                else "response.incomplete"
            )
            builder.event(kind, response=response)
        yield builder.drain()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    state = get_state(request)
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(
            400,
            "streaming a stored response again is not supported; leave out stream",
            param="stream",
        )
    return json_response(stored_or_404(state, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    state = get_state(request)
    stored_or_404(state, response_id)
    state.responses.delete(response_id)
    return json_response(ResponseDeleted(response_id))


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> Response:
    state = get_state(request)
    query = request.query_params
    limit_text = query.get("limit", str(DEFAULT_LIST_LIMIT))
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
        raise APIError(
            400,
            f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit_text!r}",
            param="limit",
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(
            400, f'order must be "asc" or "desc", got {order!r}', param="order"
        )
    items = stored_or_404(state, response_id).input_context()
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise APIError(
                400,
                f"after names no input item of {response_id!r}: {after!r}",
                param="after",
            )
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    first = page[0].id if page else None
    last = page[-1].id if page else None
    return json_response(ItemList(page, first, last, len(items) > len(page)))
