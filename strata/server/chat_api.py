"""POST /v1/chat/completions: messages through the chat template (with tools), structured output,
tool calls and reasoning, answered whole or streamed as SSE chunks ending in `data: [DONE]`.

Output text is split per choice by `ChoiceSplitter` (chat_output.py) when the request has tools
(tool_choice other than "none") or the server has a --reasoning-parser; otherwise it is the content
as the engine detokenized it. Calls come back as `message.tool_calls`. Streamed, they come as
OpenAI streams them, while the model writes them: the first delta of a call's index carries id,
type "function", function.name and arguments "", the later ones only the index and the next
fragment of function.arguments; the fragments concatenate to the arguments of the non-streamed
answer. A forced call (tool_choice "required" or a named function), response_format, regex and
ebnf constrain decoding with a grammar, armed after the reasoning ends for a reasoning model.

finish_reason follows OpenAI's: "tool_calls" when the model stopped after making calls with
tool_choice "auto" or "required", but "stop" for a named tool_choice (OpenAI answers a forced
`{"type": "function", "function": {"name": ...}}` with "stop", streamed or not); "length" when
max_tokens cut the output, also inside a call. A forced call cut off is among `tool_calls`, its
arguments as far as they got (streamed: its last pieces), as OpenAI answers; with tool_choice
"auto" such a call is not among `tool_calls` but content (streamed, the pieces of it already sent
stay sent, and its text follows as content).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from strata.engine.outputs import TokenLogprob
from strata.grammar.spec import GrammarSpec
from strata.server.chat_output import ChoiceParts, ChoiceSplitter
from strata.server.engine_client import Generation, Job
from strata.server.openai_api import new_id, sampling_fields, usage
from strata.server.protocol import (
    OPENAI_PARAM_NAMES,
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    FunctionCallOut,
    FunctionDelta,
    NamedToolChoice,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobEntry,
    Usage,
    clamp_logprob,
    decode_body,
    make_sampling_params,
    resolve_max_tokens,
)
from strata.server.reasoning import ReasoningParser
from strata.server.serving import (
    SSE_DONE,
    GenerationStream,
    ServerState,
    collect,
    error_event,
    get_state,
    json_response,
    off_loop,
    read_body,
    sse,
    start_generation,
    verified_bootstrap,
)
from strata.server.structured import (
    check_spec,
    check_tools,
    format_spec,
    reasoning_trigger,
    template_messages,
    tool_choice_of,
    tool_spec,
)
from strata.server.tool_calls import ToolCallParser

router = APIRouter()

PROMPT_TAIL_TOKENS = (
    8  # decoded to see whether the template opened or closed a reasoning block
)


def chat_prompt_ids(
    state: ServerState,
    req: ChatCompletionRequest,
    tools: list[dict[str, Any]],
    param: str = "messages",
) -> list[int]:
    """The conversation through the chat template, as token ids; `param` is the field a client
    sent it in (messages; input for /v1/responses)."""
    if not req.messages:
        raise APIError(
            400,
            "messages must be a non-empty list of {role, content} objects",
            param=param,
        )
    messages = template_messages(req)
    if state.tokenizer is None:
        raise APIError(
            400,
            "this model has no tokenizer, so chat messages cannot be used; use /generate with input_ids",
        )
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(
            400,
            "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
        )
    from jinja2 import TemplateError

    from strata.tokenizer import apply_chat_template

    try:
        return apply_chat_template(state.tokenizer, messages, tools)
    except (
        TemplateError,
        ValueError,
        TypeError,
        KeyError,
    ) as exc:  # the template may reject a conversation
        raise APIError(
            400, f"the chat template rejected these messages: {exc}", param=param
        ) from None


def chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in lps:
        text = state.token_text(lp.token_id)
        top = [
            TopLogprobEntry(
                t := state.token_text(a.token_id),
                clamp_logprob(a.logprob),
                list(t.encode()),
            )
            for a in lp.top
        ]
        content.append(
            ChatTokenLogprob(text, clamp_logprob(lp.logprob), list(text.encode()), top)
        )
    return ChatLogprobs(content)


@dataclass
class ChatPlan:
    """How a request's output is parsed: which tool-call parser (None: no tool parsing), whether
    reasoning is split off, and the tail of the prompt as text (for the reasoning splitter)."""

    tool_parser: ToolCallParser | None = None
    reasoning: ReasoningParser | None = None
    prompt_tail: str = ""
    calls_finish: str = (
        "tool_calls"  # the finish reason when the model stopped after calls
    )
    forced: bool = (
        False  # tool_choice "required" or a named function: the output is only calls
    )
    forced_name: str | None = None  # the named function

    def splitter(self) -> ChoiceSplitter | None:
        if self.tool_parser is None and self.reasoning is None:
            return None
        reasoning = (
            self.reasoning.splitter(self.prompt_tail)
            if self.reasoning is not None
            else None
        )
        tools = (
            None
            if self.tool_parser is None
            else self.tool_parser.splitter(self.forced, self.forced_name)
        )
        return ChoiceSplitter(reasoning, tools, self.calls_finish)


def chat_plan(
    state: ServerState,
    choice: str | NamedToolChoice,
    tools: list[dict[str, Any]],
    input_ids: list[int],
) -> ChatPlan:
    """How the output of a conversation with these tools and this tool_choice is parsed."""
    uses_tools = bool(tools) and choice != "none"
    plan = ChatPlan(
        state.tool_call_parser if uses_tools else None, state.reasoning_parser
    )
    plan.forced = uses_tools and (
        choice == "required" or isinstance(choice, NamedToolChoice)
    )
    if isinstance(choice, NamedToolChoice):
        plan.calls_finish = "stop"  # as OpenAI answers a named tool_choice
        plan.forced_name = choice.function.name
    if plan.reasoning is not None:
        plan.prompt_tail = state.tokenizer.decode(input_ids[-PROMPT_TAIL_TOKENS:])
    return plan


async def structured_fields(
    state: ServerState,
    plan: ChatPlan,
    tools: list[dict[str, Any]],
    choice: str | NamedToolChoice,
    fmt: tuple[GrammarSpec, str] | None,
    parallel_tool_calls: bool,
) -> dict[str, Any]:
    """The SamplingParams field for the grammar the request asks for ({} for none), validated (400):
    `fmt` is the output format asked for and the field that asked (structured.format_spec), the
    forced calls come from `choice`."""
    forced = (
        tool_spec(choice, tools, plan.tool_parser, parallel_tool_calls)
        if plan.tool_parser
        else None
    )
    if fmt is not None and forced is not None:
        raise APIError(
            400,
            f"{fmt[1]} cannot be combined with a forced tool_choice (required or a named function)",
            param="tool_choice",
        )
    spec, param = fmt if fmt is not None else (forced, "tool_choice")
    if spec is None:
        return {}
    if plan.reasoning is not None and not plan.reasoning.prompt_closes_reasoning(
        plan.prompt_tail
    ):
        spec = msgspec.structs.replace(
            spec, start_after=reasoning_trigger(state, plan.reasoning)
        )
    await check_spec(state, spec, param)
    return {"structured": msgspec.to_builtins(spec)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, state.config.max_request_bytes)
    req: ChatCompletionRequest = await off_loop(
        len(body), decode_body, body, ChatCompletionRequest
    )
    lora = state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    info = state.engine_info()
    tools = check_tools(req)
    choice = tool_choice_of(req)
    input_ids = await off_loop(len(body), chat_prompt_ids, state, req, tools)
    plan = chat_plan(state, choice, tools, input_ids)
    requested = (
        req.max_completion_tokens
        if req.max_completion_tokens is not None
        else req.max_tokens
    )
    param = (
        "max_completion_tokens"
        if req.max_completion_tokens is not None
        else "max_tokens"
    )
    max_tokens = resolve_max_tokens(
        requested,
        len(input_ids),
        info.context_len,
        info.num_kv_tokens,
        default=None,
        param=param,
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {**OPENAI_PARAM_NAMES, "max_new_tokens": param, "logprobs": "top_logprobs"}
    fields = sampling_fields(req, max_tokens, logprobs)
    fmt = format_spec(req)
    fields.update(
        await structured_fields(
            state, plan, tools, choice, fmt, req.parallel_tool_calls
        )
    )
    params = make_sampling_params(fields, info.vocab_size, names)
    bootstrap = verified_bootstrap(state, request, body, req)
    gen = await start_generation(state, [Job(input_ids, params, *bootstrap, lora=lora)])
    rid, created = new_id("chatcmpl"), int(time.time())
    if req.stream:
        include_usage = (
            req.stream_options is not None and req.stream_options.include_usage
        )
        return GenerationStream(
            chat_stream(
                state, gen, rid, created, req.logprobs, include_usage, plan, lora
            ),
            gen,
        )
    results = await collect(request, gen)
    choices = []
    for r in results:
        splitter = plan.splitter()
        message, finish = ChatResponseMessage("assistant", r.text), r.finish_reason
        if splitter is not None:
            parts = splitter.feed(r.text)
            parts.extend(splitter.finish())
            message = response_message(parts)
            finish = splitter.finish_reason(r.finish_reason)
        logprobs_out = chat_logprobs(state, r.logprobs) if req.logprobs else None
        choices.append(
            ChatChoice(r.index, message, logprobs_out, finish, r.matched_stop)
        )
    return json_response(
        ChatCompletionResponse(
            rid, created, lora or state.model_name, choices, usage(results, req.n)
        )
    )


def response_message(parts: ChoiceParts) -> ChatResponseMessage:
    calls = [
        ToolCallOut(c.id, FunctionCallOut(c.name, c.arguments)) for c in parts.calls
    ]
    content = parts.content if parts.content or not calls else None
    return ChatResponseMessage(
        "assistant", content, parts.reasoning or None, calls or None
    )


def delta_chunks(parts: ChoiceParts) -> list[ChatDelta]:
    """The deltas of one step's parts: text (reasoning and content) first, then one per call piece."""
    deltas = []
    if parts.reasoning or parts.content:
        deltas.append(
            ChatDelta(
                content=parts.content or None, reasoning_content=parts.reasoning or None
            )
        )
    for piece in parts.pieces:
        if piece.id is not None:  # a call starts
            call = ToolCallDelta(
                piece.index, piece.id, "function", FunctionDelta(piece.name, "")
            )
        else:
            call = ToolCallDelta(
                piece.index, function=FunctionDelta(arguments=piece.arguments)
            )
        deltas.append(ChatDelta(tool_calls=[call]))
    return deltas


async def chat_stream(
    state: ServerState,
    gen: Generation,
    rid: str,
    created: int,
    logprobs: bool,
    include_usage: bool,
    plan: ChatPlan,
    lora: str | None = None,
) -> AsyncIterator[bytes]:
    model = lora or state.model_name  # the name the request asked for
    splitters = [plan.splitter() for _ in range(gen.num_choices)]
    for i in range(gen.num_choices):
        yield sse(
            ChatCompletionChunk(
                rid,
                created,
                model,
                [ChatChunkChoice(i, ChatDelta(role="assistant", content=""))],
            )
        )
    prompt_tokens = cached_tokens = completion_tokens = 0
    async for index, out in gen:
        if out.finish_reason == "error":
            yield error_event(out.error or "the engine failed this request")
            break
        splitter = splitters[index]
        finish = out.finish_reason if out.finished else None
        if splitter is None:
            deltas = [ChatDelta(content=out.text_delta)] if out.text_delta else []
        else:
            parts = splitter.feed(out.text_delta) if out.text_delta else ChoiceParts()
            if out.finished:
                parts.extend(splitter.finish())
                finish = splitter.finish_reason(out.finish_reason)
            deltas = delta_chunks(parts)
        lps = chat_logprobs(state, out.logprobs) if logprobs and out.logprobs else None
        if not deltas and (out.finished or lps is not None):
            deltas = [ChatDelta()]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = ChatChunkChoice(
                index,
                delta,
                lps if k == 0 else None,
                finish if last else None,
                out.matched_stop if last and out.finished else None,
            )
            yield sse(ChatCompletionChunk(rid, created, model, [choice]))
        if out.finished:
            prompt_tokens = max(prompt_tokens, out.prompt_tokens)
            cached_tokens = max(cached_tokens, out.cached_tokens)
            completion_tokens += out.completion_tokens
    else:
        if include_usage:
            total = prompt_tokens + completion_tokens
            u = Usage(
                prompt_tokens,
                completion_tokens,
                total,
                PromptTokensDetails(cached_tokens),
            )
            yield sse(ChatCompletionChunk(rid, created, model, [], u))
    yield SSE_DONE
