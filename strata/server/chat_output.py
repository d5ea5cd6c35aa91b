"""One chat choice's output text split into reasoning, content and tool calls.

`ChoiceSplitter` chains the reasoning splitter (reasoning.py) and the tool-call splitter
(tool_calls.py): text after the reasoning goes to the tool-call splitter. Streaming feeds it each
text delta and sends the parts' `pieces` (calls as they are written); a non-streamed answer feeds
it the whole text and uses the parts' `calls` (calls once complete); both then call `finish`.
Because both stages are chunk-invariant, the two agree: each call's pieces concatenate to the
arguments of the complete call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.server.reasoning import ReasoningSplitter
from strata.server.tool_calls import CallPiece, ToolCall, ToolCallSplitter, ToolEvents


@dataclass
class ChoiceParts:
    reasoning: str = ""
    content: str = ""
    pieces: list[CallPiece] = field(default_factory=list)  # calls as they stream
    calls: list[ToolCall] = field(default_factory=list)  # calls completed

    def extend(self, other: ChoiceParts) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.pieces.extend(other.pieces)
        self.calls.extend(other.calls)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.pieces or self.calls)


class ChoiceSplitter:
    def __init__(
        self,
        reasoning: ReasoningSplitter | None,
        tools: ToolCallSplitter | None,
        calls_finish: str = "tool_calls",
    ):
        self.reasoning = reasoning
        self.tools = tools
        self.calls_finish = (
            calls_finish  # the finish reason of an output that made calls
        )
        self.num_calls = 0

    def _tool_parts(self, events: ToolEvents) -> ChoiceParts:
        self.num_calls += len(events.calls)
        return ChoiceParts(
            content=events.content, pieces=events.pieces, calls=events.calls
        )

    def _content(self, text: str) -> ChoiceParts:
        if self.tools is None:
            return ChoiceParts(content=text)
        return self._tool_parts(self.tools.feed(text)) if text else ChoiceParts()

    def feed(self, text: str) -> ChoiceParts:
        if self.reasoning is None:
            return self._content(text)
        reasoning, content = self.reasoning.feed(text)
        parts = self._content(content)
        parts.reasoning = reasoning
        return parts

    def finish(self) -> ChoiceParts:
        parts = ChoiceParts()
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            parts = self._content(content)
            parts.reasoning = reasoning
        if self.tools is not None:
            parts.extend(self._tool_parts(self.tools.finish()))
        return parts

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`calls_finish` when the model stopped after making calls; the engine's otherwise ("length"
        when a call was cut off, never "tool_calls": the call is then text, or, forced, a call whose
        arguments end where the output did)."""
        cut_off = self.tools is not None and self.tools.cut_off
        if engine_reason == "stop" and self.num_calls and not cut_off:
            return self.calls_finish
        return engine_reason
