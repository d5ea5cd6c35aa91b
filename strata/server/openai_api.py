"""OpenAI-compatible endpoints: GET /v1/models, POST /v1/completions, and what chat completions
(chat_api.py) shares with them.

Each handler: decode + validate the body (protocol.py), tokenize, resolve max_tokens against the
context, validate any grammar (response_format / regex / ebnf: structured.py), submit, then either
collect the choices into one response or stream SSE chunks ending in `data: [DONE]`. Text comes
from the engine already detokenized, with stop strings cut; logprob token strings are single-token
decodes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from strata.engine.outputs import TokenLogprob
from strata.server.engine_client import Generation, Job
from strata.server.protocol import (
    MAX_CHOICES,
    OPENAI_PARAM_NAMES,
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    Usage,
    clamp_logprob,
    decode_body,
    make_sampling_params,
    resolve_max_tokens,
)
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
    usage_counts,
    verified_bootstrap,
)
from strata.server.structured import check_spec, format_spec

router = APIRouter()

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = get_state(request)
    info = state.client.info
    context = info.context_len if info is not None else 0
    card = ModelCard(
        id=state.model_name,
        created=int(state.started_at),
        max_model_len=context,
        root=state.model_dir,
    )
    adapters = [
        ModelCard(
            id=name,
            created=int(state.started_at),
            max_model_len=context,
            root=name,
            parent=state.model_name,
        )
        for name in sorted(state.adapters)
    ]
    return json_response(ModelList([card, *adapters]))


# ------------------------------------------------------------------ shared conversion


def sampling_fields(
    req: SamplingFields, max_tokens: int, logprobs: int | None
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": req.min_tokens,
        "n": req.n,
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "priority": req.priority,
        "skip_special_tokens": req.skip_special_tokens,
        "seed": req.seed,
        "logprobs": logprobs,
    }
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "logit_bias": req.logit_bias,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return fields


def usage(results, n: int) -> Usage:
    prompt, completion, cached = usage_counts(results, n)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(
            400,
            f"{num_prompts} prompts x n={n} is {num_prompts * n} choices; at most {MAX_CHOICES} per request",
            param="n",
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ legacy completions


def completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""

    def is_ids(x: Any) -> bool:
        return (
            isinstance(x, list)
            and bool(x)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(prompt, str):
        return [state.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [state.encode(p) for p in prompt]
        if is_ids(prompt):
            return [list(prompt)]
        if all(is_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise APIError(
        400,
        "prompt must be a non-empty string, a list of strings, a list of token ids, or a list of token-id lists",
        param="prompt",
    )


class CompletionLogprobBuilder:
    """Legacy completions logprobs for one choice; text_offset counts characters of the output."""

    def __init__(self, state: ServerState):
        self.state = state
        self.offset = 0

    def build(self, lps: list[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            text = self.state.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(clamp_logprob(lp.logprob))
            out.top_logprobs.append(
                {
                    self.state.token_text(a.token_id): clamp_logprob(a.logprob)
                    for a in lp.top
                }
            )
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, state.config.max_request_bytes)
    req: CompletionRequest = await off_loop(
        len(body), decode_body, body, CompletionRequest
    )
    lora = state.check_model(req.model)
    if req.echo:
        raise APIError(400, "echo is not supported by this server", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (use n)", param="best_of")
    info = state.engine_info()
    prompts = await off_loop(len(body), completion_prompts, state, req.prompt)
    names = {**OPENAI_PARAM_NAMES, "logprobs": "logprobs"}
    structured: dict[str, Any] = {}
    if (asked := format_spec(req)) is not None:
        spec, param = asked
        await check_spec(state, spec, param)
        structured["structured"] = msgspec.to_builtins(spec)
    jobs, bootstrap = [], verified_bootstrap(state, request, body, req)
    for ids in prompts:
        max_tokens = resolve_max_tokens(
            req.max_tokens,
            len(ids),
            info.context_len,
            info.num_kv_tokens,
            default=COMPLETIONS_DEFAULT_MAX_TOKENS,
            prompt_param="prompt",
        )
        jobs.append(
            Job(
                ids,
                make_sampling_params(
                    {**sampling_fields(req, max_tokens, req.logprobs), **structured},
                    info.vocab_size,
                    names,
                ),
                *bootstrap,
                lora=lora,
            )
        )
    check_choices(len(prompts), req.n)
    gen = await start_generation(state, jobs)
    rid, created = new_id("cmpl"), int(time.time())
    want_logprobs = req.logprobs is not None
    if req.stream:
        include_usage = (
            req.stream_options is not None and req.stream_options.include_usage
        )
        return GenerationStream(
            completion_stream(
                state, gen, rid, created, req.n, want_logprobs, include_usage, lora
            ),
            gen,
        )
    results = await collect(request, gen)
    choices = [
        CompletionChoice(
            r.index,
            r.text,
            CompletionLogprobBuilder(state).build(r.logprobs)
            if want_logprobs
            else None,
            r.finish_reason,
            r.matched_stop,
        )
        for r in results
    ]
    return json_response(
        CompletionResponse(
            rid, created, lora or state.model_name, choices, usage(results, req.n)
        )
    )


async def completion_stream(
    state: ServerState,
    gen: Generation,
    rid: str,
    created: int,
    n: int,
    logprobs: bool,
    include_usage: bool,
    lora: str | None = None,
) -> AsyncIterator[bytes]:
    model = lora or state.model_name  # the name the request asked for
    builders = [CompletionLogprobBuilder(state) for _ in range(gen.num_choices)]
    prompt_tokens = [0] * gen.num_choices
    cached_tokens = [0] * gen.num_choices
    completion_tokens = 0
    async for index, out in gen:
        if out.finish_reason == "error":
            yield error_event(out.error or "the engine failed this request")
            break
        if not (out.text_delta or out.finished or (logprobs and out.logprobs)):
            continue
        choice = CompletionChoice(
            index,
            out.text_delta,
            builders[index].build(out.logprobs) if logprobs else None,
            out.finish_reason if out.finished else None,
            out.matched_stop if out.finished else None,
        )
        yield sse(CompletionResponse(rid, created, model, [choice]))
        if out.finished:
            prompt_tokens[index], cached_tokens[index] = (
                out.prompt_tokens,
                out.cached_tokens,
            )
            completion_tokens += out.completion_tokens
    else:
        if include_usage:
            prompt = sum(
                max(prompt_tokens[s : s + n]) for s in range(0, len(prompt_tokens), n)
            )
            cached = sum(
                max(cached_tokens[s : s + n]) for s in range(0, len(cached_tokens), n)
            )
            u = Usage(
                prompt,
                completion_tokens,
                prompt + completion_tokens,
                PromptTokensDetails(cached),
            )
            yield sse(CompletionResponse(rid, created, model, [], u))
    yield SSE_DONE
