"""Tool-call parsers: find a model's function calls in its output text, and constrain it to make them.

Each model family writes calls its own way (its chat template says how); `--tool-call-parser` picks
one from `TOOL_CALL_PARSERS`, or `detect_tool_call_parser` guesses from the template:

- `hermes` (Hermes, Qwen 2.5 / 3, and templates that show `<tool_call>`): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside the tags is content;
- `json` (Llama 3.x style, the fallback): the whole output is one JSON call object
  `{"name": ..., "arguments" | "parameters": {...}}`, or a JSON list of them.

A parser makes per-choice `ToolCallSplitter`s, which are incremental and chunk-invariant: the
calls and content they produce do not depend on how the text was cut into pieces, so a streamed
answer and a non-streamed one agree. A call is emitted only once it is complete and valid JSON with
a string name and object arguments; a block the model did not finish, or wrote as invalid JSON,
stays text (`incomplete` says so) and is never passed off as a call.

`grammar(functions, parallel)` is the constraint for tool_choice "required" or a named function:
output that is exactly one or more calls of the listed functions whose arguments match each
function's parameters schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from strata.grammar.spec import JSON_FORMAT, GrammarSpec, json_schema_spec


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text (re-serialised compactly: {"a": 1})


@dataclass
class ToolEvents:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_from_json(obj: Any) -> ToolCall | None:
    """A call from a parsed {"name", "arguments" | "parameters"} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call of any of `functions` (OpenAI function objects)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


class ToolCallSplitter:
    """Splits one choice's content stream into text and tool calls."""

    def feed(self, text: str) -> ToolEvents:
        raise NotImplementedError

    def finish(self) -> ToolEvents:
        """Everything held back; call once at the end of the output."""
        raise NotImplementedError

    incomplete: bool = False  # a call was started but not completed as valid JSON


class ToolCallParser:
    name: str = ""

    def splitter(self) -> ToolCallSplitter:
        raise NotImplementedError

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        raise NotImplementedError


# ------------------------------------------------------------------ hermes: <tool_call>{json}</tool_call>


class HermesSplitter(ToolCallSplitter):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending = ""  # undecided text: a possible tag start, whitespace, or an open call
        self.in_call = False
        self.num_calls = 0
        self.incomplete = False

    def feed(self, text: str) -> ToolEvents:
        self.pending += text
        out = ToolEvents()
        while True:
            if self.in_call:
                end = self.pending.find(self.END)
                if end < 0:
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(self.END) :]
                self.in_call = False
                call = self._parse(body)
                if call is None:  # invalid JSON inside the tags: it stays text
                    out.content += self.START + body + self.END
                    self.incomplete = True
                else:
                    out.calls.append(call)
                    self.num_calls += 1
                continue
            start = self.pending.find(self.START)
            if start >= 0:
                before = self.pending[:start]
                if before.strip():
                    out.content += before.rstrip()
                # whitespace around calls is dropped
                self.pending = self.pending[start + len(self.START) :]
                self.in_call = True
                continue
            keep = _partial_suffix(self.pending, self.START)
            head, tail = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
            if head.strip():  # text: emit it, but hold back trailing whitespace (a call may follow)
                stripped = head.rstrip()
                out.content += stripped
                self.pending = head[len(stripped) :] + tail
            return out

    def finish(self) -> ToolEvents:
        out = ToolEvents()
        if self.in_call:
            out.content = self.START + self.pending
            self.incomplete = True
        elif self.num_calls == 0 or self.pending.strip():
            out.content = self.pending
        self.pending, self.in_call = "", False
        return out

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            return _call_from_json(json.loads(body))
        except ValueError:
            return None


class HermesParser(ToolCallParser):
    name = "hermes"

    def splitter(self) -> ToolCallSplitter:
        return HermesSplitter()

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        schema = {**call_schema(functions), "x-guidance": JSON_FORMAT}
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = (
            f"start: call{repeat}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n"  # key order kept: "name" is written first
        )
        return GrammarSpec(kind="lark", source=lark)


# ------------------------------------------------------------------ json: the whole output is the call(s)


class JsonSplitter(ToolCallSplitter):
    def __init__(self) -> None:
        self.pending = ""
        self.mode = "start"  # start (undecided) -> json (buffer all) | text (stream as content)
        self.incomplete = False

    def feed(self, text: str) -> ToolEvents:
        if self.mode == "text":
            return ToolEvents(content=text)
        self.pending += text
        if self.mode == "start":
            stripped = self.pending.lstrip()
            if not stripped:
                return ToolEvents()
            if stripped[0] in "{[":
                self.mode = "json"
            else:
                self.mode, content, self.pending = "text", self.pending, ""
                return ToolEvents(content=content)
        return ToolEvents()

    def finish(self) -> ToolEvents:
        text, self.pending = self.pending, ""
        if self.mode != "json":
            return ToolEvents(content=text)
        try:
            parsed = json.loads(text)
        except ValueError:
            self.incomplete = True
            return ToolEvents(content=text)
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call_from_json(item) for item in items]
        if not items or any(c is None for c in calls):
            return ToolEvents(content=text)  # JSON, but not calls: it is the answer
        return ToolEvents(calls=calls)


class JsonParser(ToolCallParser):
    name = "json"

    def splitter(self) -> ToolCallSplitter:
        return JsonSplitter()

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        one = call_schema(functions)
        schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
        return json_schema_spec(schema)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "json": JsonParser()}


def detect_tool_call_parser(chat_template: str | None) -> ToolCallParser:
    """The parser a chat template implies: hermes if it shows `<tool_call>` tags, else json."""
    if chat_template and "<tool_call>" in chat_template:
        return TOOL_CALL_PARSERS["hermes"]
    return TOOL_CALL_PARSERS["json"]
