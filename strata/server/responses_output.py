"""A response's output items, built from what chat's splitter makes of the model's text
(chat_output.py: reasoning, content, calls), and the typed stream events that build them.

`OutputBuilder` is fed `ChoiceParts`: a whole answer once, or a stream once per engine output, then
`finish`ed. Items are written one after another, as OpenAI streams them: an item is opened when text
of another kind starts, and closed (its `.done` events, then `response.output_item.done`) when the
next one opens or the output ends.

    reasoning text      -> reasoning item (rs_...), content [reasoning_text]
    content             -> message item (msg_...), content [output_text]
    a call's first piece -> function_call item (fc_..., call_id call_..., name), arguments ""
    its later pieces    -> its arguments, as response.function_call_arguments.delta
    a complete call     -> its arguments as the parser read them, status completed

Within one feed, reasoning comes before content and content before calls, so a whole answer is
[reasoning, message, calls...]; a stream has the same items unless the model wrote text after a
call (then a second message follows the call). An item still open when the output is cut off by
max_output_tokens is "incomplete", and so is a call the parser never completed (a malformed call
in "auto" mode, whose text then follows as content). An output with no item at all is one empty
message, so `output_text` is "" rather than missing.

Events are encoded as they happen (`event:` and `data:` lines, numbered by `sequence_number`), so
each carries the item as it was then.
"""

from __future__ import annotations

from typing import Any

import msgspec

from strata.server.chat_output import ChoiceParts
from strata.server.protocol import ChatTokenLogprob
from strata.server.responses_input import new_item_id
from strata.server.responses_protocol import (
    FunctionCallItem,
    Item,
    ItemStatus,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)

_json = msgspec.json.Encoder()


def sse_event(kind: str, sequence_number: int, fields: dict[str, Any]) -> bytes:
    data = _json.encode({"type": kind, "sequence_number": sequence_number, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class OutputBuilder:
    def __init__(self, stream: bool):
        self.items: list[Item] = []
        self.reasoning = ""  # all reasoning text, for the usage's reasoning_tokens
        self._stream = stream
        self._events: list[bytes] = []
        self._sequence = 0
        self._open: Item | None = None  # the item being written: always the last one
        # the splitter's call index -> the call's item and its output index
        self._calls: dict[int, tuple[FunctionCallItem, int]] = {}
        self._complete: set[str] = set()  # item ids of the calls the parser completed

    # -------------------------------------------------------------- events

    def event(self, kind: str, **fields: Any) -> None:
        """Record one stream event (nothing when building a whole answer)."""
        if self._stream:
            self._events.append(sse_event(kind, self._sequence, fields))
            self._sequence += 1

    def drain(self) -> bytes:
        out, self._events = b"".join(self._events), []
        return out

    # -------------------------------------------------------------- items

    def feed(
        self, parts: ChoiceParts, logprobs: list[ChatTokenLogprob] | None = None
    ) -> None:
        if parts.reasoning:
            item = self._writing(ReasoningItem, "rs")
            self.reasoning += parts.reasoning
            item.content[0].text += parts.reasoning
            self.event(
                "response.reasoning_text.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=parts.reasoning,
            )
        if parts.content or logprobs:
            message = self._writing(MessageItem, "msg")
            part = message.content[0]
            assert isinstance(part, OutputText)
            part.text += parts.content
            part.logprobs += logprobs or []
            self.event(
                "response.output_text.delta",
                item_id=message.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=parts.content,
                logprobs=logprobs or [],
            )
        for piece in parts.pieces:
            if piece.id is not None:  # a call starts
                self._start_call(piece.index, piece.id, piece.name or "")
                continue
            call, output_index = self._calls[piece.index]
            call.arguments += piece.arguments
            self.event(
                "response.function_call_arguments.delta",
                item_id=call.id,
                output_index=output_index,
                delta=piece.arguments,
            )
        for done in parts.calls:
            if done.index not in self._calls:
                self._start_call(done.index, done.id, done.name)
            call = self._calls[done.index][0]
            call.arguments = done.arguments
            self._complete.add(call.id)

    def finish(self, cut_off: bool) -> None:
        """Close the last item ("incomplete" when `cut_off` by max_output_tokens)."""
        if not self.items:
            self._writing(MessageItem, "msg")
        self._close("incomplete" if cut_off else "completed")

    # -------------------------------------------------------------- opening and closing

    def _writing(self, kind: type[MessageItem | ReasoningItem], prefix: str) -> Any:
        """The open item if it is of `kind`, else a new one (the open one closed first)."""
        if isinstance(self._open, kind):
            return self._open
        self._close("completed")
        item_id = new_item_id(prefix)
        part: OutputText | ReasoningText
        if kind is MessageItem:
            message = MessageItem(id=item_id, role="assistant", content=[])
            self._add(message)  # announced with no content part yet
            part = OutputText("")
            message.content.append(part)
        else:
            reasoning = ReasoningItem(id=item_id)
            self._add(reasoning)
            part = ReasoningText("")
            reasoning.content.append(part)
        self.event(
            "response.content_part.added",
            item_id=item_id,
            output_index=len(self.items) - 1,
            content_index=0,
            part=part,
        )
        return self._open

    def _start_call(self, index: int, call_id: str, name: str) -> None:
        self._close("completed")
        call = FunctionCallItem(
            id=new_item_id("fc"), call_id=call_id, name=name, arguments=""
        )
        self._add(call)
        self._calls[index] = call, len(self.items) - 1

    def _add(self, item: Item) -> None:
        item.status = "in_progress"
        self.items.append(item)
        self._open = item
        self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item
        )

    def _close(self, status: ItemStatus) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        output_index = len(self.items) - 1  # the open item is the last one
        where = {"item_id": item.id, "output_index": output_index}
        if isinstance(item, MessageItem):
            part = item.content[0]
            assert isinstance(part, OutputText)
            self.event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part.text,
                logprobs=part.logprobs,
            )
            self.event(
                "response.content_part.done", **where, content_index=0, part=part
            )
        elif isinstance(item, ReasoningItem):
            text = item.content[0]
            self.event(
                "response.reasoning_text.done", **where, content_index=0, text=text.text
            )
            self.event(
                "response.content_part.done", **where, content_index=0, part=text
            )
        elif isinstance(item, FunctionCallItem):
            if item.id not in self._complete:
                status = "incomplete"
            self.event(
                "response.function_call_arguments.done",
                **where,
                arguments=item.arguments,
            )
        item.status = status
        self.event("response.output_item.done", output_index=output_index, item=item)
