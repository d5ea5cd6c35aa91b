"""Tool-call and reasoning parsers on hand-written model outputs: what they extract, and that the
result does not depend on how the text was cut into streamed pieces."""

from __future__ import annotations

import json
import random

import pytest

from strata.server.chat_output import ChoiceParts, ChoiceSplitter
from strata.server.reasoning import REASONING_PARSERS
from strata.server.tool_calls import TOOL_CALL_PARSERS, detect_tool_call_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def run(splitter_factory, text: str, pieces: list[str] | None = None) -> ChoiceParts:
    s = splitter_factory()
    out = ChoiceParts()
    for piece in pieces if pieces is not None else [text]:
        out.extend(s.feed(piece))
    out.extend(s.finish())
    out.finish_reason = s.finish_reason("stop")
    return out


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def tools_only(parser: str):
    return lambda: ChoiceSplitter(None, TOOL_CALL_PARSERS[parser].splitter())


def with_reasoning(reasoning: str, prompt_tail: str = "", tools: str | None = "hermes"):
    return lambda: ChoiceSplitter(
        REASONING_PARSERS[reasoning].splitter(prompt_tail), TOOL_CALL_PARSERS[tools].splitter() if tools else None
    )


CASES = [
    # (factory, text, reasoning, content, [(name, arguments)], finish_reason)
    (tools_only("hermes"), "Let me check." + "\n" + CALL, "", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 3})], "tool_calls"),
    (tools_only("hermes"), CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n", "", None,
     [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "days": 3})], "tool_calls"),
    (tools_only("hermes"), "No tools needed: 2 < 3 and <b>bold</b> stays.  ", "",
     "No tools needed: 2 < 3 and <b>bold</b> stays.  ", [], "stop"),
    # invalid JSON inside the tags, and a call cut off: text, never a call
    (tools_only("hermes"), "<tool_call>\n{\"name\": \"x\", \"arguments\": {oops}\n</tool_call>", "",
     "<tool_call>\n{\"name\": \"x\", \"arguments\": {oops}\n</tool_call>", [], "stop"),
    (tools_only("hermes"), '<tool_call>\n{"name": "get_weather", "argu', "", '<tool_call>\n{"name": "get_weather", "argu',
     [], "stop"),
    (tools_only("json"), '{"name": "add", "parameters": {"a": 1}}', "", None, [("add", {"a": 1})], "tool_calls"),
    (tools_only("json"), '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": "{\\"a\\": 2}"}]', "",
     None, [("add", {"a": 1}), ("add", {"a": 2})], "tool_calls"),
    (tools_only("json"), '{"answer": 42}', "", '{"answer": 42}', [], "stop"),
    (tools_only("json"), "Plain {text}", "", "Plain {text}", [], "stop"),
    (with_reasoning("qwen3"), "<think>\nweigh it: a<b\n</think>\n\nThe answer." , "\nweigh it: a<b\n", "The answer.", [],
     "stop"),
    (with_reasoning("qwen3"), "No thinking here.", "", "No thinking here.", [], "stop"),
    (with_reasoning("qwen3"), "<think>I should call.</think>" + CALL, "I should call.", None,
     [("get_weather", {"city": "Paris", "days": 3})], "tool_calls"),
    (with_reasoning("deepseek_r1"), "thinking...</think>Done", "thinking...", "Done", [], "stop"),
    (with_reasoning("deepseek_r1"), "still thinking when cut off", "still thinking when cut off", "", [], "stop"),
    (with_reasoning("deepseek_r1", prompt_tail="<think>\n\n</think>\n\n", tools=None), "Direct.", "", "Direct.", [],
     "stop"),
]


@pytest.mark.parametrize("factory, text, reasoning, content, calls, finish", CASES)
def test_parsers_split_and_are_chunk_invariant(factory, text, reasoning, content, calls, finish):
    whole = run(factory, text)
    assert whole.reasoning == reasoning
    assert (whole.content if whole.content or not whole.calls else None) == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert whole.finish_reason == finish
    rng = random.Random(len(text))
    for _ in range(25):
        pieces = random_pieces(text, rng)
        streamed = run(factory, text, pieces)
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content), pieces
        assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_incomplete_calls_are_flagged_and_keep_the_engine_finish_reason():
    s = ChoiceSplitter(None, TOOL_CALL_PARSERS["hermes"].splitter())
    s.feed('<tool_call>\n{"name": "a"')
    parts = s.finish()
    assert s.tools.incomplete and not parts.calls
    assert s.finish_reason("length") == "length"


def test_call_ids_are_unique_and_the_parser_follows_the_template():
    parts = run(tools_only("hermes"), CALL + CALL)
    assert len({c.id for c in parts.calls}) == 2
    assert detect_tool_call_parser("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert detect_tool_call_parser("{{ messages }}").name == "json"
    assert detect_tool_call_parser(None).name == "json"
