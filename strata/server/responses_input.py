"""A /v1/responses request as the chat path takes it: input items become chat messages, flat
function tools become chat tools, `text.format` becomes the output format's grammar.

    input item                                  chat message
    message (user / system / assistant)         {role, content: the text parts joined}
    message (developer)                         {role: "system", ...}
    instructions                                {role: "system"}, first (never carried over)
    function_call (call_id, name, arguments)    a tool call of the assistant message before it,
                                                or of a new assistant message
    function_call_output (call_id, output)      {role: "tool", tool_call_id, content}
    reasoning                                   none: chat templates show no earlier reasoning

Items are first normalised (`input_items`) into the tagged structs of responses_protocol.py, each
with an id, which is also how a conversation is stored: a continuation (previous_response_id) maps
the stored items and its own the same way. Every shape error is a 400 naming the field as the client
sent it (`input[2].call_id`, `tools[0].parameters`, `text.format.type`).
"""

from __future__ import annotations

import uuid
from typing import Any, NoReturn

from strata.grammar.spec import GrammarSpec, json_schema_spec
from strata.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
    ToolDef,
)
from strata.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolIn,
    InputItem,
    InputText,
    Item,
    MessageItem,
    OutputText,
    PartIn,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    SummaryText,
    TextConfigIn,
    ToolChoiceIn,
)

ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"
# what `include` may ask for: logprobs; reasoning.encrypted_content is accepted for the clients that
# always ask (there is no encryption here: reasoning items carry their text, and come back as sent)
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ what the request asks for


def check_supported(req: ResponsesRequest) -> None:
    """Refuse, by name, what this server does not do (400)."""
    if req.background:
        _refuse(
            "background",
            "background responses are not supported; stream instead (stream: true)",
        )
    if req.conversation is not None:
        _refuse(
            "conversation",
            "conversations are not supported; continue a response with previous_response_id",
        )
    if req.prompt is not None:
        _refuse(
            "prompt", "stored prompt templates are not supported; send input instead"
        )
    if req.truncation == "auto":
        _refuse(
            "truncation",
            'truncation "auto" is not supported: an input longer than the context is a 400 '
            '(truncation "disabled")',
        )
    if req.truncation != "disabled":
        _refuse("truncation", f'truncation must be "disabled", got {req.truncation!r}')
    for i, name in enumerate(req.include or []):
        if name not in INCLUDABLE:
            _refuse(
                "include",
                f"include[{i}] {name!r} is not supported; this server can include {list(INCLUDABLE)}",
            )
    if req.top_logprobs is not None and LOGPROBS not in (req.include or []):
        _refuse("top_logprobs", f"top_logprobs needs include: [{LOGPROBS!r}]")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        _refuse(
            "text.verbosity",
            f"text.verbosity {req.text.verbosity!r} is not supported (only the model's own, "
            '"medium")',
        )
    for key, value in (req.metadata or {}).items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            _refuse(
                "metadata",
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                f"{MAX_METADATA_VALUE_CHARS}; {key[:80]!r} is not",
            )
    if len(req.metadata or {}) > MAX_METADATA_KEYS:
        _refuse("metadata", f"metadata has at most {MAX_METADATA_KEYS} keys")


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS in (req.include or [])


def _refuse(param: str, message: str) -> NoReturn:
    raise APIError(400, message, param=param)


# ------------------------------------------------------------------ input items


def input_items(raw: str | list[InputItem]) -> list[Item]:
    """The request's `input` as items with ids: a string is one user message."""
    if isinstance(raw, str):
        return [
            MessageItem(id=new_item_id("msg"), role="user", content=[InputText(raw)])
        ]
    if not raw:
        _refuse("input", "input must be a string or a non-empty list of items")
    return [_item(item, f"input[{i}]") for i, item in enumerate(raw)]


def _item(item: InputItem, where: str) -> Item:
    if item.type == "message":
        role = item.role
        if role is None or role not in ROLES:
            _refuse(
                f"{where}.role",
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
            )
        if item.content is None:
            _refuse(f"{where}.content", f"{where} is a message without content")
        text = _text(item.content, f"{where}.content")
        part = OutputText(text) if role == "assistant" else InputText(text)
        return MessageItem(id=item.id or new_item_id("msg"), role=role, content=[part])
    if item.type == "function_call":
        call_id = _required(item.call_id, where, "call_id")
        name = _required(item.name, where, "name")
        arguments = _required(item.arguments, where, "arguments")
        return FunctionCallItem(
            id=item.id or new_item_id("fc"),
            call_id=call_id,
            name=name,
            arguments=arguments,
        )
    if item.type == "function_call_output":
        call_id = _required(item.call_id, where, "call_id")
        output = _required(item.output, where, "output")
        return FunctionCallOutputItem(
            id=item.id or new_item_id("fco"),
            call_id=call_id,
            output=_text(output, f"{where}.output"),
        )
    if item.type == "reasoning":
        summary = [SummaryText(p.text or "") for p in item.summary or []]
        content = item.content if isinstance(item.content, list) else []
        return ReasoningItem(
            id=item.id or new_item_id("rs"),
            summary=summary,
            content=[ReasoningText(p.text or "") for p in content],
            encrypted_content=item.encrypted_content,
        )
    if item.type == "item_reference":
        _refuse(
            f"{where}.type",
            f"{where} is an item_reference, which this server does not resolve; send the item "
            "itself, or continue with previous_response_id",
        )
    _refuse(
        f"{where}.type",
        f"{where}.type {item.type!r} is not one of {', '.join(ITEM_TYPES)}",
    )


def _required(value: Any, where: str, name: str) -> Any:
    if value is None:
        _refuse(f"{where}.{name}", f"{where} of this type needs {name}")
    return value


def _text(content: str | list[PartIn], where: str) -> str:
    """A message's content (or a function call's output) as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        else:
            _refuse(
                f"{where}[{j}]",
                f"{where}[{j}] is a {part.type!r} part; this server accepts text parts only "
                f"({', '.join(TEXT_PARTS)}, refusal)",
            )
    return "".join(texts)


# ------------------------------------------------------------------ the chat request


def chat_messages(items: list[Item], instructions: str | None) -> list[ChatMessage]:
    """The conversation as chat messages (see the table above)."""
    messages = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    calls: set[str] = set()
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            text = "".join(part.text for part in item.content)
            messages.append(ChatMessage(role=role, content=text))
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = ToolCallIn(
                id=item.call_id,
                function=FunctionCallIn(name=item.name, arguments=item.arguments),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(
                    ChatMessage(role="assistant", content=None, tool_calls=[call])
                )
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                _refuse(
                    "input",
                    f"the function_call_output for call_id {item.call_id!r} follows no function_call "
                    "with that call_id in the conversation",
                )
            messages.append(
                ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
            )
    return messages


def chat_tools(tools: list[FunctionToolIn] | None) -> list[ToolDef] | None:
    """Flat function tools as chat's {type, function: {...}}; any other kind of tool is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            _refuse(
                f"tools[{i}].type",
                f"tools[{i}] has type {tool.type!r}; only function tools are supported "
                "(this server runs no built-in tools)",
            )
        name = _required(tool.name, f"tools[{i}]", "name")
        params = tool.parameters
        if params is not None and params.get("type", "object") != "object":
            _refuse(
                f"tools[{i}].parameters",
                f"tools[{i}].parameters must be a JSON schema of an object",
            )
        function = FunctionDef(
            name=name,
            description=tool.description,
            parameters=params,
            strict=tool.strict,
        )
        out.append(ToolDef(function=function))
    return out


def chat_tool_choice(
    choice: str | ToolChoiceIn | None,
) -> str | NamedToolChoice | None:
    """none / auto / required as they are (checked with chat's rules), {type: function, name} named."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        _refuse(
            "tool_choice.type",
            f"tool_choice of type {choice.type!r} is not supported; send none, auto, required or "
            '{"type": "function", "name": ...}',
        )
    name = _required(choice.name, "tool_choice", "name")
    return NamedToolChoice(function=NamedFunction(name=name))


def text_format_spec(text: TextConfigIn | None) -> tuple[GrammarSpec, str] | None:
    """The grammar `text.format` asks for and the field that asked (None: free text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(kind="json_object"), "text.format"
    if fmt.type == "json_schema":
        if fmt.schema is None:
            _refuse(
                "text.format.schema", 'text.format of type "json_schema" needs a schema'
            )
        return json_schema_spec(fmt.schema), "text.format.schema"
    _refuse(
        "text.format.type",
        f"text.format.type {fmt.type!r} is not one of text, json_object, json_schema",
    )


def chat_request(req: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    """The chat completion the chat path runs for this conversation (the earlier items and this
    request's own, in order)."""
    return ChatCompletionRequest(
        messages=chat_messages(items, req.instructions),
        temperature=req.temperature,
        top_p=req.top_p,
        user=req.user,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
    )
