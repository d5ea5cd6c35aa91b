"""The HTTP wire format: OpenAI and native request/response schemas, errors, and their validation.

Schemas are msgspec Structs: decoding a body checks its types and names the offending field
("Expected `float | null`, got `str` - at `$.temperature`"), and responses encode without a
second serializer. Fields OpenAI defines but Strata does not implement are rejected with a 400
that says so (echo, suffix, best_of > n), never silently ignored; other unknown fields are ignored,
as OpenAI's own server does. Structured output (response_format, tools, and the regex / ebnf
extensions) is translated into a grammar by structured.py.

Default max_tokens (as vLLM and SGLang do): chat completions run to the end of the context
(context length - prompt length, also bounded by the KV pool); legacy completions default to 16,
as in OpenAI's API; native /generate defaults to max_new_tokens 128 (SGLang's default).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from strata.engine.limits import LimitError, SizeLimits
from strata.sampling_params import SamplingParams

MAX_CHOICES = 256  # prompts x n in one request
LOGPROB_FLOOR = -9999.0  # -inf logprobs are reported as this (JSON has no infinity)

# ------------------------------------------------------------------ errors

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error a client should see, as OpenAI shapes it: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
) -> bytes:
    kind = ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "internal_server_error"
    )
    return msgspec.json.encode(ErrorResponse(ErrorInfo(message, kind, param, code)))


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: bytes, schema: type[Any]) -> Any:
    """Decode a JSON request body into `schema`, turning every failure into a 400 that names the field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})",
        ) from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = match.group(1) if match else None
        if param is None and (
            missing := re.search(r"missing required field `(\w+)`", text)
        ):
            param = missing.group(1)
        raise APIError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


# ------------------------------------------------------------------ requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCallIn(msgspec.Struct, kw_only=True):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": which call this is the result of


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = (
        None  # accepted; arguments are always constrained when a call is forced
    )


class ToolDef(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None  # None: any JSON object
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # text | json_object | json_schema
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """What chat and legacy completions share. top_k .. skip_special_tokens are vLLM/SGLang extensions;
    logit_bias is checked against the vocabulary with the rest of SamplingParams."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = (
        None  # token id (a string) -> bias in [-100, 100]
    )
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = (
        0  # vLLM's extension: lower is scheduled first (batch jobs run above 0)
    )
    bootstrap_room: int | None = None  # PD disaggregation: injected by the router
    bootstrap_addr: str | None = None
    # structured output: at most one of these (vLLM/SGLang extensions: regex, ebnf = a Lark grammar)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = (
        None  # none | auto | required | a named function
    )
    parallel_tool_calls: bool = True


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang's native /generate: one of text / input_ids (single or batch) and a sampling_params dict."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: Any = (
        None  # accepted for SGLang compatibility; the server names requests itself
    )
    bootstrap_room: int | None = None  # PD disaggregation: injected by the router
    bootstrap_addr: str | None = None


class CreateBatchRequest(msgspec.Struct, kw_only=True):
    """OpenAI's POST /v1/batches (strata.server.batch_api)."""

    input_file_id: str  # a file uploaded with purpose "batch"
    endpoint: str  # /v1/chat/completions, /v1/completions or /v1/embeddings
    completion_window: str  # "24h"
    metadata: dict[str, str] | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings request; `pooling` and `normalize` are Strata's extensions."""

    input: Any  # a string, a list of strings, a list of token ids, or a list of token-id lists
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # keep the first N values, then normalise
    user: str | None = None  # accepted and ignored
    # the last token's final hidden state, or the mean over the tokens
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True  # L2-normalised


# ------------------------------------------------------------------ responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # None when the answer is only tool calls
    reasoning_content: str | None = None  # --reasoning-parser: the model's thinking
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    matched_stop: str | int | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One piece of a streamed call: the first names it (id, type, name, arguments ""), the next
    carry its arguments text, all under the same index."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float]] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    matched_stop: str | int | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: str = "embedding"
    index: int
    # a str with encoding_format "base64": the little-endian float32 bytes
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    root: str
    object: str = "model"
    owned_by: str = "strata"
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRARequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str  # a PEFT adapter directory the server can read


class UnloadLoRARequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# ------------------------------------------------------------------ validation helpers

# SamplingParams field -> the name a client of this API used for it
OPENAI_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def make_sampling_params(
    fields: dict[str, Any], vocab_size: int, param_names: dict[str, str] | None = None
) -> SamplingParams:
    """Convert (typed: a float where an int belongs is an error) and validate SamplingParams; a bad
    field becomes a 400 naming the client's own name for it."""
    param_names = param_names or {}
    try:
        params = SamplingParams.from_dict(fields)
        params.validate(vocab_size)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        name = param_names.get(field, field)
        if name != field:
            message = name + message[len(field) :]
        known = field in SamplingParams.__struct_fields__
        raise APIError(400, message, param=name if known else None) from None
    return params


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    context_len: int,
    pool_tokens: int,
    *,
    default: int | None,
    param: str = "max_tokens",
    prompt_param: str = "messages",
) -> int:
    """The output budget of one prompt: `requested`, or `default` (None: to the end of the context).

    The limits and their error texts are the engine's (strata.engine.limits), checked here first so
    a client hears about them before anything is queued.
    """
    limits = SizeLimits(context_len, pool_tokens)
    if requested is not None and requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    budget = requested
    if budget is None:
        limit = limits.max_new(prompt_len)
        budget = max(limit if default is None else min(default, limit), 1)
    try:
        limits.check(prompt_len, budget, param=param, prompt_param=prompt_param)
    except LimitError as exc:
        code = "context_length_exceeded" if prompt_len else None
        raise APIError(400, str(exc), param=exc.param, code=code) from None
    return budget


def clamp_logprob(value: float) -> float:
    return max(LOGPROB_FLOOR, value)
