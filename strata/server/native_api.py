"""The native API, SGLang-style: POST /generate.

    {"text": "Hello" | ["a", "b"], or "input_ids": [1, 2] | [[1, 2], [3]],
     "sampling_params": {"max_new_tokens": 128, "temperature": 0, "stop": ["\\n"], ...},
     "stream": false, "return_logprob": false, "top_logprobs_num": 0}

answers {"text", "output_ids", "meta_info": {id, prompt_tokens, completion_tokens, cached_tokens,
finish_reason: {"type": "stop"|"length"|"abort", "matched"?: ..., "length"?: ...}, e2e_latency, and
spec_* when speculative decoding drafted for it (strata.server.serving.spec_fields)}};
a list of those for a batch or n > 1. Streaming sends `data: {...}` events carrying the text so far
(cumulative, as SGLang does) and an "index", then `data: [DONE]`. sampling_params are the
SamplingParams fields; unknown keys are a 400 listing the accepted ones. Structured output: SGLang's
`json_schema` (a JSON string or object), `regex` or `ebnf` (a Lark grammar) in sampling_params, or
the typed `structured` field ({"kind", "source"}); an invalid one is a 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from strata.engine.outputs import RequestOutput
from strata.grammar.spec import GrammarKind, GrammarSpec, json_schema_spec
from strata.sampling_params import SamplingParams
from strata.server.engine_client import Generation, Job
from strata.server.protocol import (
    MAX_CHOICES,
    APIError,
    GenerateRequest,
    clamp_logprob,
    decode_body,
    make_sampling_params,
)
from strata.server.serving import (
    SSE_DONE,
    ChoiceResult,
    GenerationStream,
    ServerState,
    collect,
    error_event,
    get_state,
    json_response,
    off_loop,
    read_body,
    spec_fields,
    sse,
    start_generation,
    verified_bootstrap,
)
from strata.server.structured import check_spec

router = APIRouter()

# SGLang's structured-output keys of sampling_params -> GrammarSpec kinds (at most one per request)
GRAMMAR_KEYS: dict[str, GrammarKind] = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "lark",
}
SAMPLING_KEYS = frozenset(SamplingParams.__struct_fields__) | frozenset(GRAMMAR_KEYS)


def generate_prompts(
    state: ServerState, req: GenerateRequest
) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the request was a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "send exactly one of text or input_ids", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [state.encode(req.text, "text")], False
        if not req.text:
            raise APIError(
                400,
                "text must be a string or a non-empty list of strings",
                param="text",
            )
        return [state.encode(t, "text") for t in req.text], True
    ids = req.input_ids

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        )

    if ids and is_ids(ids):
        return [list(ids)], False
    if ids and all(is_ids(p) and p for p in ids):
        return [list(p) for p in ids], True
    raise APIError(
        400,
        "input_ids must be a non-empty list of token ids or a list of such lists",
        param="input_ids",
    )


def grammar_field(fields: dict[str, Any]) -> tuple[GrammarSpec, str] | None:
    """Pop SGLang's json_schema (a JSON string or object) / regex / ebnf (Lark) keys into one spec."""
    asked = [
        (key, fields.pop(key)) for key in GRAMMAR_KEYS if fields.get(key) is not None
    ]
    for key in GRAMMAR_KEYS:
        fields.pop(key, None)
    if len(asked) > 1:
        raise APIError(
            400,
            f"send at most one of json_schema, regex, ebnf (got {[k for k, _ in asked]})",
            param=f"sampling_params.{asked[1][0]}",
        )
    if not asked:
        return None
    key, value = asked[0]
    param = f"sampling_params.{key}"
    if key == "json_schema" and not isinstance(value, str):
        if not isinstance(value, (dict, bool)):
            raise APIError(
                400,
                f"{param} must be a JSON schema (an object, or a JSON string of one)",
                param=param,
            )
        return json_schema_spec(value), param
    if not isinstance(value, str):
        raise APIError(400, f"{param} must be a string", param=param)
    spec = GrammarSpec(kind=GRAMMAR_KEYS[key], source=value)
    try:
        spec.validate_shape()
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return spec, param


def sampling_params(
    req: GenerateRequest, vocab_size: int
) -> tuple[SamplingParams, str]:
    """The request's SamplingParams, and the field a grammar in them came from (structured, or one
    of SGLang's keys), for the caller to validate."""
    fields = dict(req.sampling_params or {})
    unknown = sorted(set(fields) - SAMPLING_KEYS)
    if unknown:
        raise APIError(
            400,
            f"unknown sampling_params {unknown}; accepted: {sorted(SAMPLING_KEYS)}",
            param=f"sampling_params.{unknown[0]}",
        )
    if req.return_logprob and fields.get("logprobs") is None:
        fields["logprobs"] = req.top_logprobs_num
    asked = grammar_field(fields)
    if asked is not None:
        fields["structured"] = msgspec.to_builtins(asked[0])
    params = make_sampling_params(fields, vocab_size)
    return params, asked[1] if asked else "sampling_params.structured"


def finish_reason(
    r: ChoiceResult | RequestOutput, num_tokens: int
) -> dict[str, Any] | None:
    if r.finish_reason is None:
        return None
    reason: dict[str, Any] = {"type": r.finish_reason}
    if r.finish_reason == "stop" and r.matched_stop is not None:
        reason["matched"] = r.matched_stop
    elif r.finish_reason == "length":
        reason["length"] = num_tokens
    return reason


def logprob_fields(state: ServerState, lps) -> dict[str, Any]:
    return {
        "output_token_logprobs": [
            [clamp_logprob(lp.logprob), lp.token_id, None] for lp in lps
        ],
        "output_top_logprobs": [
            [[clamp_logprob(a.logprob), a.token_id, None] for a in lp.top] for lp in lps
        ],
    }


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, state.config.max_request_bytes)
    req: GenerateRequest = await off_loop(len(body), decode_body, body, GenerateRequest)
    info = state.engine_info()
    prompts, is_batch = await off_loop(len(body), generate_prompts, state, req)
    params, grammar_param = sampling_params(req, info.vocab_size)
    if params.structured is not None:
        await check_spec(state, params.structured, grammar_param)
    if len(prompts) * params.n > MAX_CHOICES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={params.n} is more than {MAX_CHOICES} choices per request",
        )
    bootstrap = verified_bootstrap(state, request, body, req)
    jobs = [Job(ids, params, *bootstrap) for ids in prompts]
    rid = uuid.uuid4().hex
    gen = await start_generation(state, jobs)
    if req.stream:
        return GenerationStream(
            generate_stream(state, gen, rid, req.return_logprob), gen
        )
    results = await collect(request, gen)
    latency = time.perf_counter() - gen.created
    answers = []
    for r in results:
        meta = {
            "id": f"{rid}-{r.index}" if len(results) > 1 else rid,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": len(r.token_ids),
            "cached_tokens": r.cached_tokens,
            "cached_tokens_details": r.cached_tokens_details,
            "finish_reason": finish_reason(r, len(r.token_ids)),
            "e2e_latency": latency,
            **r.spec,
        }
        if req.return_logprob:
            meta.update(logprob_fields(state, r.logprobs))
        answers.append({"text": r.text, "output_ids": r.token_ids, "meta_info": meta})
    return json_response(answers if is_batch or params.n > 1 else answers[0])


async def generate_stream(
    state: ServerState, gen: Generation, rid: str, return_logprob: bool
) -> AsyncIterator[bytes]:
    results = [ChoiceResult(i) for i in range(gen.num_choices)]
    async for index, out in gen:
        if out.finish_reason == "error":
            yield error_event(out.error or "the engine failed this request")
            break
        r = results[index]
        r.add(out)
        if not (out.text_delta or out.new_token_ids or out.finished):
            continue
        meta = {
            "id": f"{rid}-{index}" if gen.num_choices > 1 else rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "cached_tokens_details": out.cached_tokens_details,
            "finish_reason": finish_reason(out, out.completion_tokens),
            "e2e_latency": time.perf_counter() - gen.created,
            **spec_fields(out),
        }
        if return_logprob:
            meta.update(logprob_fields(state, r.logprobs))
        yield sse(
            {
                "text": r.text,
                "output_ids": r.token_ids,
                "meta_info": meta,
                "index": index,
            }
        )
    yield SSE_DONE
