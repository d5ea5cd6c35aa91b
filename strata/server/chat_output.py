"""One chat choice's output text split into reasoning, content and tool calls.

`ChoiceSplitter` chains the reasoning splitter (reasoning.py) and the tool-call splitter
(tool_calls.py): text after the reasoning goes to the tool-call splitter. Streaming feeds it each
text delta, a non-streamed answer feeds it the whole text; both then call `finish`. Because both
stages are chunk-invariant, the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.server.reasoning import ReasoningSplitter
from strata.server.tool_calls import ToolCall, ToolCallSplitter


@dataclass
class ChoiceParts:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: ChoiceParts) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceSplitter:
    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallSplitter | None):
        self.reasoning = reasoning
        self.tools = tools
        self.num_calls = 0

    def _content(self, text: str) -> ChoiceParts:
        if self.tools is None:
            return ChoiceParts(content=text)
        events = self.tools.feed(text) if text else None
        parts = ChoiceParts(content=events.content, calls=events.calls) if events else ChoiceParts()
        self.num_calls += len(parts.calls)
        return parts

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
            events = self.tools.finish()
            parts.content += events.content
            parts.calls.extend(events.calls)
            self.num_calls += len(events.calls)
        return parts

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after making calls; the engine's otherwise
        ("length" when a call was cut off: it is then text, not a call)."""
        if engine_reason == "stop" and self.num_calls:
            return "tool_calls"
        return engine_reason
