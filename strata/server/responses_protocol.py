"""The wire format of /v1/responses, OpenAI's Responses API: the request with its input items, the
Response object with its output items, and the items a conversation is stored as.

A request's `input` items decode into one permissive `InputItem` (a message may leave out its
`type`, which a msgspec tagged union cannot), checked per type by responses_input.py. What comes out
are tagged structs, each encoding its own `type`: `MessageItem` (a message, in or out),
`FunctionCallItem`, `FunctionCallOutputItem` and `ReasoningItem`; the same structs hold a stored
conversation, so `GET /v1/responses/{id}/input_items` lists what the model was given.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from strata.server.protocol import ChatTokenLogprob

# ------------------------------------------------------------------ requests


class PartIn(msgspec.Struct, kw_only=True):
    """A content part of an input message (input_text, output_text, refusal), a function call's
    output part, or a reasoning item's summary / content part."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`, of any type: message (role, content), function_call (call_id, name,
    arguments), function_call_output (call_id, output) or reasoning (summary, content)."""

    type: str = "message"
    id: str | None = None
    status: str | None = None
    role: str | None = None
    content: str | list[PartIn] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[PartIn] | None = None
    summary: list[PartIn] | None = None
    encrypted_content: str | None = None


class FunctionToolIn(msgspec.Struct, kw_only=True):
    """A tool, in the Responses API's flat shape: {type: function, name, description, parameters, strict}."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceIn(msgspec.Struct, kw_only=True):
    """A tool_choice object: {type: function, name} forces that function."""

    type: str
    name: str | None = None


class TextFormatIn(msgspec.Struct, kw_only=True):
    type: str  # text | json_object | json_schema
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfigIn(msgspec.Struct, kw_only=True):
    format: TextFormatIn | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = (
        None  # accepted; the model reasons as its chat template lets it
    )
    summary: str | None = None  # accepted; no summaries are written (summary: [])


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses. Fields OpenAI defines for hosted features (background, conversation,
    prompt) are decoded so that they can be refused by name; other unknown fields are ignored."""

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: str | ToolChoiceIn | None = None
    parallel_tool_calls: bool = True
    text: TextConfigIn | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None


# ------------------------------------------------------------------ items (output, and stored conversations)


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type"):
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: str  # user | system | developer | assistant
    content: list[InputText | OutputText]
    status: ItemStatus = "completed"


class FunctionCallItem(
    msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"
):
    id: str  # fc_...
    call_id: str  # call_...: what a function_call_output names
    name: str
    arguments: str  # JSON text
    status: ItemStatus = "completed"


class FunctionCallOutputItem(
    msgspec.Struct, kw_only=True, tag="function_call_output", tag_field="type"
):
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    id: str  # rs_...
    summary: list[SummaryText] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: str | None = None
    status: ItemStatus = "completed"


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# ------------------------------------------------------------------ the Response object


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str  # max_output_tokens


class ResponseError(msgspec.Struct):
    code: str  # server_error
    message: str


class Response(msgspec.Struct, kw_only=True):
    id: str  # resp_...
    object: str = "response"
    created_at: int
    status: str  # in_progress | completed | incomplete | failed
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[Item] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"format": {"type": "text"}}
    )
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    background: bool = False


class ResponseDeleted(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


class ItemList(msgspec.Struct):
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"
