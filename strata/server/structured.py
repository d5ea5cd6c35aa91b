"""Structured output on the frontend: a request's response_format / regex / ebnf / tool_choice
becomes one `GrammarSpec`, validated here so that a bad schema, regex or grammar is the client's
400 (naming the problem) before the engine ever sees it.

The frontend keeps its own `GrammarCompiler` for the served tokenizer (built on the first
structured request); the engine compiles again from its own cache. Both compile each distinct
grammar once.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from strata.grammar.spec import GrammarSpec, json_schema_spec
from strata.server.protocol import (
    APIError,
    ChatCompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from strata.server.reasoning import ReasoningParser
from strata.server.tool_calls import ToolCallParser

TOOL_CHOICES = ("none", "auto", "required")


def format_spec(req: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The grammar response_format, regex or ebnf asks for, and the field that asked (None: free text)."""
    asked: list[tuple[GrammarSpec, str]] = []
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_object":
            asked.append((GrammarSpec(kind="json_object"), "response_format"))
        elif rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(
                    400,
                    'response_format of type "json_schema" needs a json_schema object',
                    param="response_format",
                )
            schema = rf.json_schema.schema
            spec = (
                GrammarSpec(kind="json_object")
                if schema is None
                else json_schema_spec(schema)
            )
            asked.append((spec, "response_format.json_schema.schema"))
        elif rf.type != "text":
            raise APIError(
                400,
                f"response_format type {rf.type!r} is not one of text, json_object, json_schema",
                param="response_format.type",
            )
    if req.regex is not None:
        asked.append((GrammarSpec(kind="regex", source=req.regex), "regex"))
    if req.ebnf is not None:
        asked.append((GrammarSpec(kind="lark", source=req.ebnf), "ebnf"))
    if len(asked) > 1:
        names = ", ".join(param.split(".")[0] for _, param in asked)
        raise APIError(
            400,
            f"send at most one of response_format, regex and ebnf (got {names})",
            param=asked[1][1],
        )
    return asked[0] if asked else None


def tool_choice_of(req: ChatCompletionRequest) -> str | NamedToolChoice:
    """The request's tool_choice, checked against its tools (default: auto with tools, none without)."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(
                400,
                f"tool_choice {choice!r} is not one of {', '.join(TOOL_CHOICES)} or a named function",
                param="tool_choice",
            )
        if choice == "required" and not req.tools:
            raise APIError(
                400, 'tool_choice "required" needs tools', param="tool_choice"
            )
        return choice
    names = [t.function.name for t in req.tools or []]
    if choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not among the tools {names}",
            param="tool_choice",
        )
    return choice


def check_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools as plain OpenAI dicts (for the chat template and the call grammar)."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise APIError(
                400,
                f"tools[{i}] has type {tool.type!r}; only function tools are supported",
                param=f"tools[{i}].type",
            )
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise APIError(
                400,
                f"tools[{i}].function.parameters must be a JSON schema of an object",
                param=f"tools[{i}].function.parameters",
            )
        function = {
            k: v for k, v in msgspec.to_builtins(tool.function).items() if v is not None
        }
        tools.append({"type": "function", "function": function})
    return tools


def tool_spec(
    choice: str | NamedToolChoice,
    tools: list[dict[str, Any]],
    parser: ToolCallParser,
    parallel: bool,
) -> GrammarSpec | None:
    """The grammar that forces calls: tool_choice "required" (any listed function) or a named one."""
    if choice == "required":
        functions = [t["function"] for t in tools]
    elif isinstance(choice, NamedToolChoice):
        functions = [
            t["function"]
            for t in tools
            if t["function"]["name"] == choice.function.name
        ]
        parallel = False
    else:
        return None
    return parser.grammar(functions, parallel)


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template expects it: text parts joined, tool calls of earlier
    assistant turns with their arguments parsed into objects (templates render them as JSON)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}] has a {part.type!r} content part; this server accepts text parts only",
                        param=f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        message: dict[str, Any] = {
            "role": m.role,
            "content": content if content is not None else "",
        }
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": _args(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        messages.append(message)
    return messages


def _args(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def reasoning_trigger(state: Any, parser: ReasoningParser | None) -> list[int]:
    """The token ids after which a grammar is armed for a reasoning model (its end tag); [] without one."""
    if parser is None or state.tokenizer is None:
        return []
    return list(state.tokenizer.encode(parser.end_tag, add_special_tokens=False))


async def check_spec(state: Any, spec: GrammarSpec, param: str) -> None:
    """Raise a 400 naming `param` unless the grammar compiles for the served tokenizer. Runs on the
    tokenizer thread when building the compiler (~1 s for a large vocabulary, once) or the grammar is
    large; a cached grammar answers inline."""
    from strata.server.serving import OFFLOAD_BODY_BYTES, off_loop

    size = len(spec.source) if state.grammars is not None else OFFLOAD_BODY_BYTES
    await off_loop(size, validate_spec, state, spec, param)


def validate_spec(state: Any, spec: GrammarSpec, param: str) -> None:
    """Raise a 400 naming `param` unless the grammar compiles for the served tokenizer."""
    from strata.grammar.compiler import GrammarCompiler, GrammarError

    try:
        if state.grammars is None:
            info = state.engine_info()
            state.grammars = GrammarCompiler(
                state.tokenizer, info.vocab_size, info.eos_token_ids
            )
        state.grammars.validate(spec)
    except GrammarError as exc:
        raise APIError(
            400, f"{param}: {exc}", param=param, code="invalid_grammar"
        ) from None
