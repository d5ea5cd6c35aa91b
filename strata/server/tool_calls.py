"""Tool-call parsers: find a model's function calls in its output text, and constrain it to make them.

Each model family writes calls its own way (its chat template says how); `--tool-call-parser` picks
one from `TOOL_CALL_PARSERS`, or `detect_tool_call_parser` guesses from the template:

- `hermes` (Hermes, Qwen 2.5 / 3, and templates that show `<tool_call>`): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside the tags is content;
- `json` (Llama 3.x style, the fallback): the whole output is one JSON call object
  `{"name": ..., "arguments" | "parameters": {...}}`, or a JSON list of them.

A parser makes per-choice `ToolCallSplitter`s, fed the output text in whatever pieces the engine
streams it. Each call is read by a `CallReader` as its text arrives, and the splitter reports:

- `content`: text outside calls (a possible tag start, or whitespace before a call, is held back);
- `pieces`: the streamed form of the calls, numbered 0, 1, ... in the order they start. A call's
  first piece, sent as soon as its name is known, carries its id and name; the next ones carry
  fragments of its arguments text, each sent once certain: read inside the arguments value, and
  before anything that may be the end tag;
- `calls`: each call once it is complete and valid JSON with a string name and object arguments.

A call's `arguments` is the model's own text of the arguments object (or, for a model that writes
it as a JSON string, that string's contents), so the fragments of a call concatenate to exactly its
`arguments`, and the calls and content do not depend on how the text was cut. A block that turns out
not to be a call (cut off, or invalid JSON) is never passed off as one: it is not among `calls`, its
text is content, and `incomplete` says so. Streamed, its first pieces may already have been sent
(they cannot be taken back); its text then follows as content too, and a call cut off by max_tokens
ends the stream with finish_reason "length", never "tool_calls" (chat_output.py).

Forced calls (a splitter made with `forced=True`: tool_choice "required" or a named function, whose
grammar admits nothing but calls) are the exception, as in OpenAI's API: a call the output ended in
(max_tokens, a stop) is among `calls` with its arguments as far as they got, its last pieces are
sent, and `cut_off` says so. `forced_name`, a named tool_choice's function, names a call cut off
before its name was written; with "required" such a call has no name, and its text stays content.

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
    index: int  # the call's number in the choice's stream (0, 1, ...: in the order calls started)
    id: str
    name: str
    arguments: str  # the arguments object as JSON text, as the model wrote it


@dataclass
class CallPiece:
    """A piece of a streamed call: the first of an index has its id and name, later ones arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolEvents:
    content: str = ""
    pieces: list[CallPiece] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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


# ------------------------------------------------------------------ one call object, read as it arrives

WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


class CallReader:
    """Reads one call object, `{"name": "f", "arguments": {...}}`, as its text arrives.

    It follows the object's structure, not every rule of JSON: strings and their escapes, nesting,
    and where each top-level key and value starts and ends; `complete()` checks the whole with
    `json.loads` once the object has closed. The first "name" (a string) and the first "arguments" /
    "parameters" (an object, or a string holding one) count; other keys are skipped.

        {"name": "f", "arguments": {"city": "Pa
                                   ^args_start  ^len(text): all of text[args_start:] is certain,
                                                 since the value ends only at its matching brace
    """

    def __init__(self, index: int):
        self.index = index
        self.text = (
            ""  # the object's text (from leading whitespace up to its closing brace)
        )
        # open -> key -> colon -> value -> comma -> (key ...) -> done; key_token / value_token while
        # scanning one; bad once the text cannot be a call
        self.state = "open"
        self.key = ""  # the key whose value is being read
        self.token_start = 0  # where the key or value being scanned starts in text
        self.scalar = (
            False  # that value is a number / true / false / null (ends at a delimiter)
        )
        self.depth = 0  # brackets open inside it
        self.in_string = self.escaped = False
        self.name: str | None = None
        self.args_start: int | None = (
            None  # the arguments object's span in text (end: None while open)
        )
        self.args_end: int | None = None
        self.args_text: str | None = (
            None  # arguments written as a JSON string: its contents
        )
        self.id: str | None = None  # set with the first piece
        self.sent = 0  # length of the arguments text sent as pieces

    @property
    def closed(self) -> bool:
        return self.state == "done"

    @property
    def started(self) -> bool:
        return self.id is not None

    def feed(self, text: str) -> str:
        """Read more of the object; returns the text after its closing brace ("" until it closes)."""
        if self.state == "done":
            return text
        if self.state == "bad":
            return ""
        i = len(self.text)
        self.text += text
        while i < len(self.text) and self.state not in ("done", "bad"):
            i = self._step(i)
        rest = self.text[i:] if self.state == "done" else ""
        self.text = self.text[:i] if self.state == "done" else self.text
        return rest

    def fail(self) -> None:
        self.state = "bad"

    def take_pieces(self) -> list[CallPiece]:
        """The pieces that became certain since the last call."""
        pieces: list[CallPiece] = []
        if self.state == "bad":
            return pieces
        if self.id is None and self.name is not None:
            self.id = new_call_id()
            pieces.append(CallPiece(self.index, id=self.id, name=self.name))
        args = self.arguments() if self.id is not None else ""
        if len(args) > self.sent:
            pieces.append(CallPiece(self.index, args[self.sent :]))
            self.sent = len(args)
        return pieces

    def arguments(self) -> str:
        """The arguments text known so far ("{}" for a closed call that has none)."""
        if self.args_text is not None:
            return self.args_text
        if self.args_start is not None:
            return self.text[self.args_start : self.args_end]
        return "{}" if self.closed else ""

    def complete(self) -> bool:
        """True when the object closed as valid JSON with a string name and object arguments."""
        if not (self.closed and self.started):
            return False
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return True

    def result(self) -> ToolCall:
        assert self.id is not None and self.name is not None
        return ToolCall(self.index, self.id, self.name, self.arguments())

    def cut_off(self, name: str | None) -> tuple[list[CallPiece], ToolCall] | None:
        """A forced call the output ended in: its pieces not yet sent, and the call with its arguments
        as far as they got. `name` stands in for a name not read whole. None when it cannot be a call
        (no name, or text that is not a call object)."""
        if self.state == "bad" or (self.closed and not self.complete()):
            return None
        self.name = self.name if self.name is not None else name
        if self.name is None:
            return None
        return self.take_pieces(), self.result()

    def _step(self, i: int) -> int:
        """Read the character at i; returns where to read next."""
        if self.state in ("key_token", "value_token"):
            return self._scan_token(i)
        c = self.text[i]
        if c in WHITESPACE:
            return i + 1
        if (self.state, c) in (("open", "{"), ("comma", ",")):
            self.state = "key"
        elif (self.state, c) == ("colon", ":"):
            self.state = "value"
        elif (self.state, c) == ("key", '"') or (
            self.state == "value" and c not in ",:]}"
        ):
            return self._begin_token(i)
        elif (
            self.state in ("key", "comma") and c == "}"
        ):  # json.loads judges `{"a": 1,}` at the end
            self.state = "done"
        else:
            self.state = "bad"
        return i + 1

    def _begin_token(self, i: int) -> int:
        c = self.text[i]
        self.state = "key_token" if self.state == "key" else "value_token"
        self.token_start, self.scalar = i, c not in '"{['
        self.depth, self.in_string, self.escaped = 0, False, False
        if (
            self.state == "value_token"
            and self.key in ARGUMENT_KEYS
            and c == "{"
            and not self._has_args()
        ):
            self.args_start = i
        return self._scan_token(i)

    def _scan_token(self, i: int) -> int:
        c = self.text[i]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 0:
                    return self._end_token(i + 1)
        elif self.scalar:
            if c in WHITESPACE or c in ",}]":
                return self._end_token(
                    i
                )  # the delimiter is read again, outside the value
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                return self._end_token(i + 1)
        return i + 1

    def _end_token(self, end: int) -> int:
        raw, key_token = self.text[self.token_start : end], self.state == "key_token"
        try:
            if key_token:
                self.key, ok = json.loads(raw), True
            else:
                ok = self._take_value(raw, end)
        except ValueError:
            ok = False
        self.state = ("colon" if key_token else "comma") if ok else "bad"
        return end

    def _has_args(self) -> bool:
        return self.args_start is not None or self.args_text is not None

    def _take_value(self, raw: str, end: int) -> bool:
        """A top-level value has been read: the name, the arguments, or another key's (skipped).
        False when it shows the object is not a call."""
        if self.key == "name" and self.name is None:
            name = json.loads(raw)
            self.name = name if isinstance(name, str) else None
            return self.name is not None
        if self.key not in ARGUMENT_KEYS:
            return True
        if self.args_start == self.token_start:
            self.args_end = end
        elif not self._has_args():
            text = json.loads(
                raw
            )  # the arguments written as a JSON string (or not a call at all)
            if not (isinstance(text, str) and isinstance(_loads_or_none(text), dict)):
                return False
            self.args_text = text
        return True


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ------------------------------------------------------------------ splitters and parsers


class ToolCallSplitter:
    """Splits one choice's content stream into text and tool calls. `forced`: the output can only be
    calls (a cut-off call is still a call); `forced_name`: the one function it calls, if named."""

    def __init__(self, forced: bool = False, forced_name: str | None = None) -> None:
        self.forced = forced
        self.forced_name = forced_name
        self.incomplete = False  # a call was started but not completed as valid JSON
        self.cut_off = (
            False  # forced: the output ended inside a call, reported as far as it got
        )

    def feed(self, text: str) -> ToolEvents:
        raise NotImplementedError

    def finish(self) -> ToolEvents:
        """Everything held back; call once at the end of the output."""
        raise NotImplementedError


class ToolCallParser:
    name: str = ""

    def splitter(
        self, forced: bool = False, forced_name: str | None = None
    ) -> ToolCallSplitter:
        raise NotImplementedError

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        raise NotImplementedError


# ------------------------------------------------------------------ hermes: <tool_call>{json}</tool_call>


class HermesSplitter(ToolCallSplitter):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, forced: bool = False, forced_name: str | None = None) -> None:
        super().__init__(forced, forced_name)
        # undecided text: outside a call, a possible start tag or whitespace (a call may follow);
        # inside one, a possible start of the end tag
        self.pending = ""
        self.call: CallReader | None = None  # the call between the tags, if inside one
        self.body = (
            ""  # its text so far (what it stays, as content, if it is not a call)
        )
        self.num_started = 0
        self.num_calls = 0

    def feed(self, text: str) -> ToolEvents:
        self.pending += text
        out = ToolEvents()
        while True:
            if self.call is not None:
                end = self.pending.find(self.END)
                cut = (
                    end
                    if end >= 0
                    else len(self.pending) - _partial_suffix(self.pending, self.END)
                )
                self._read(self.pending[:cut], out)
                if end < 0:
                    self.pending = self.pending[cut:]
                    return out
                self.pending = self.pending[end + len(self.END) :]
                self._close(out)
                continue
            start = self.pending.find(self.START)
            if start >= 0:
                before = self.pending[:start]
                if before.strip():
                    out.content += before.rstrip()
                # whitespace around calls is dropped
                self.pending = self.pending[start + len(self.START) :]
                self.call, self.body = CallReader(self.num_started), ""
                continue
            keep = _partial_suffix(self.pending, self.START)
            head, tail = (
                self.pending[: len(self.pending) - keep],
                self.pending[len(self.pending) - keep :],
            )
            if (
                head.strip()
            ):  # text: emit it, but hold back trailing whitespace (a call may follow)
                stripped = head.rstrip()
                out.content += stripped
                self.pending = head[len(stripped) :] + tail
            return out

    def _read(self, text: str, out: ToolEvents) -> None:
        """More of the call's text, certain to come before its end tag."""
        self.body += text
        call = self.call
        assert call is not None  # inside a call's tags
        if call.feed(text).strip():  # something after the object, inside the tags
            call.fail()
        out.pieces.extend(call.take_pieces())

    def _close(self, out: ToolEvents) -> None:
        """The end tag came: the call is complete, or its block stays text."""
        call, self.call = self.call, None
        assert call is not None  # inside a call's tags
        self.num_started += call.started
        if call.complete():
            out.calls.append(call.result())
            self.num_calls += 1
        else:
            out.content += self.START + self.body + self.END
            self.incomplete = True

    def finish(self) -> ToolEvents:
        out = ToolEvents()
        if self.forced and self._cut_off_call(out):
            pass
        elif self.call is not None:  # cut off inside a call
            out.content = self.START + self.body + self.pending
            self.incomplete = True
        elif self.num_calls == 0 or self.pending.strip():
            out.content = self.pending
        self.pending, self.call = "", None
        return out

    def _cut_off_call(self, out: ToolEvents) -> bool:
        """Forced calls: the call the output ended in (or, named, whose start tag it ended in), as far
        as it got, into `out`. False when there is none, or it cannot be a call."""
        if self.call is None:
            if not (
                self.forced_name and self.pending.strip()
            ):  # not inside a start tag either
                return False
            self.call = CallReader(self.num_started)
        elif (
            not self.call.closed
        ):  # held back as a possible end tag, it was the call's text
            self._read(self.pending, out)
            self.pending = ""
        got = self.call.cut_off(self.forced_name)
        if got is None:
            return False
        pieces, call = got
        out.pieces.extend(pieces)
        out.calls.append(call)
        self.cut_off = not self.call.complete()
        return True


class HermesParser(ToolCallParser):
    name = "hermes"

    def splitter(
        self, forced: bool = False, forced_name: str | None = None
    ) -> ToolCallSplitter:
        return HermesSplitter(forced, forced_name)

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
    """The output is calls if it is one call object or a list of them, and nothing else. Calls are
    read (and their pieces sent) as they arrive; whether the whole output is calls, or is content
    after all, is known at the end, so content is held until then."""

    def __init__(self, forced: bool = False, forced_name: str | None = None) -> None:
        super().__init__(forced, forced_name)
        self.text = ""  # all the output, in json mode
        self.mode = (
            "start"  # start (undecided) -> json (read calls) | text (stream as content)
        )
        self.is_list = False
        self.reading = True  # still looking for call objects (a list's items)
        self.call: CallReader | None = None  # the call object being read
        self.closed: list[CallReader] = []  # the call objects read whole

    def feed(self, text: str) -> ToolEvents:
        if self.mode == "text":
            return ToolEvents(content=text)
        self.text += text
        if self.mode == "start":
            stripped = self.text.lstrip()
            if not stripped:
                return ToolEvents()
            if stripped[0] not in "{[":
                self.mode, content, self.text = "text", self.text, ""
                return ToolEvents(content=content)
            self.mode, self.is_list = "json", stripped[0] == "["
            text = stripped[1:] if self.is_list else stripped
        out = ToolEvents()
        while text and self.reading:
            if self.call is None:  # between a list's items
                text = text.lstrip(
                    WHITESPACE + ","
                )  # the separators are checked at the end
                if not text or text[0] != "{":
                    self.reading = not text  # the list ended, or holds something else
                    break
                self.call = CallReader(sum(c.started for c in self.closed))
            text = self.call.feed(text)
            out.pieces.extend(self.call.take_pieces())
            if self.call.closed:
                self.closed.append(self.call)
                self.call, self.reading = None, self.is_list
        return out

    def finish(self) -> ToolEvents:
        text, self.text = self.text, ""
        if self.mode != "json":
            return ToolEvents(content=text)
        try:
            parsed = json.loads(text)
        except ValueError:
            cut = self._cut_off_calls() if self.forced else None
            if cut is not None:
                return cut
            self.incomplete = True
            return ToolEvents(content=text)
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or self.call is not None or len(self.closed) != len(items):
            return ToolEvents(content=text)  # JSON, but not calls: it is the answer
        if not all(c.complete() for c in self.closed):
            return ToolEvents(content=text)
        return ToolEvents(calls=[c.result() for c in self.closed])

    def _cut_off_calls(self) -> ToolEvents | None:
        """Forced calls, the output cut off: the calls read whole and the one it ended in, as far as it
        got (content if it cannot be named). None when it holds no call, or something that is not one."""
        if not all(c.complete() for c in self.closed):
            return None
        out = ToolEvents(calls=[c.result() for c in self.closed])
        if self.call is not None:
            got = self.call.cut_off(self.forced_name)
            if got is None:
                out.content = self.call.text
            else:
                out.pieces, call = got
                out.calls.append(call)
                self.cut_off = not self.call.complete()
        return out if out.calls else None


class JsonParser(ToolCallParser):
    name = "json"

    def splitter(
        self, forced: bool = False, forced_name: str | None = None
    ) -> ToolCallSplitter:
        return JsonSplitter(forced, forced_name)

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


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "json": JsonParser(),
}


def detect_tool_call_parser(chat_template: str | None) -> ToolCallParser:
    """The parser a chat template implies: hermes if it shows `<tool_call>` tags, else json."""
    if chat_template and "<tool_call>" in chat_template:
        return TOOL_CALL_PARSERS["hermes"]
    return TOOL_CALL_PARSERS["json"]
