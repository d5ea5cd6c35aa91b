"""Tool-call and reasoning parsers on hand-written model outputs: what they extract, that the result
does not depend on how the text was cut into streamed pieces, and that streamed calls arrive as
OpenAI sends them (a head with id and name, then argument fragments that add up to the arguments)."""

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
    cuts = sorted(
        rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def tools_only(parser: str):
    return lambda: ChoiceSplitter(None, TOOL_CALL_PARSERS[parser].splitter())


def with_reasoning(reasoning: str, prompt_tail: str = "", tools: str | None = "hermes"):
    return lambda: ChoiceSplitter(
        REASONING_PARSERS[reasoning].splitter(prompt_tail),
        TOOL_CALL_PARSERS[tools].splitter() if tools else None,
    )


CASES = [
    # (factory, text, reasoning, content, [(name, arguments)], finish_reason)
    (
        tools_only("hermes"),
        "Let me check." + "\n" + CALL,
        "",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3})],
        "tool_calls",
    ),
    (
        tools_only("hermes"),
        CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n",
        "",
        None,
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            ("get_weather", {"city": "Oslo", "days": 3}),
        ],
        "tool_calls",
    ),
    (
        tools_only("hermes"),
        "No tools needed: 2 < 3 and <b>bold</b> stays.  ",
        "",
        "No tools needed: 2 < 3 and <b>bold</b> stays.  ",
        [],
        "stop",
    ),
    # invalid JSON inside the tags, and a call cut off: text, never a call
    (
        tools_only("hermes"),
        '<tool_call>\n{"name": "x", "arguments": {oops}\n</tool_call>',
        "",
        '<tool_call>\n{"name": "x", "arguments": {oops}\n</tool_call>',
        [],
        "stop",
    ),
    (
        tools_only("hermes"),
        '<tool_call>\n{"name": "get_weather", "argu',
        "",
        '<tool_call>\n{"name": "get_weather", "argu',
        [],
        "stop",
    ),
    (
        tools_only("json"),
        '{"name": "add", "parameters": {"a": 1}}',
        "",
        None,
        [("add", {"a": 1})],
        "tool_calls",
    ),
    (
        tools_only("json"),
        '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": "{\\"a\\": 2}"}]',
        "",
        None,
        [("add", {"a": 1}), ("add", {"a": 2})],
        "tool_calls",
    ),
    (tools_only("json"), '{"answer": 42}', "", '{"answer": 42}', [], "stop"),
    (tools_only("json"), "Plain {text}", "", "Plain {text}", [], "stop"),
    (
        with_reasoning("qwen3"),
        "<think>\nweigh it: a<b\n</think>\n\nThe answer.",
        "\nweigh it: a<b\n",
        "The answer.",
        [],
        "stop",
    ),
    (with_reasoning("qwen3"), "No thinking here.", "", "No thinking here.", [], "stop"),
    (
        with_reasoning("qwen3"),
        "<think>I should call.</think>" + CALL,
        "I should call.",
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
        "tool_calls",
    ),
    (
        with_reasoning("deepseek_r1"),
        "thinking...</think>Done",
        "thinking...",
        "Done",
        [],
        "stop",
    ),
    (
        with_reasoning("deepseek_r1"),
        "still thinking when cut off",
        "still thinking when cut off",
        "",
        [],
        "stop",
    ),
    (
        with_reasoning(
            "deepseek_r1", prompt_tail="<think>\n\n</think>\n\n", tools=None
        ),
        "Direct.",
        "",
        "Direct.",
        [],
        "stop",
    ),
]


@pytest.mark.parametrize("factory, text, reasoning, content, calls, finish", CASES)
def test_parsers_split_and_are_chunk_invariant(
    factory, text, reasoning, content, calls, finish
):
    whole = run(factory, text)
    assert whole.reasoning == reasoning
    assert (whole.content if whole.content or not whole.calls else None) == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert whole.finish_reason == finish
    rng = random.Random(len(text))
    for _ in range(25):
        pieces = random_pieces(text, rng)
        streamed = run(factory, text, pieces)
        assert (streamed.reasoning, streamed.content) == (
            whole.reasoning,
            whole.content,
        ), pieces
        assert [(c.name, c.arguments) for c in streamed.calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]


def test_incomplete_calls_are_flagged_and_keep_the_engine_finish_reason():
    s = ChoiceSplitter(None, TOOL_CALL_PARSERS["hermes"].splitter())
    s.feed('<tool_call>\n{"name": "a"')
    parts = s.finish()
    assert s.tools.incomplete and not parts.calls
    assert s.finish_reason("length") == "length"


def test_call_ids_are_unique_and_the_parser_follows_the_template():
    parts = run(tools_only("hermes"), CALL + CALL)
    assert len({c.id for c in parts.calls}) == 2
    assert (
        detect_tool_call_parser("{% for t in tools %}<tool_call>{% endfor %}").name
        == "hermes"
    )
    assert detect_tool_call_parser("{{ messages }}").name == "json"
    assert detect_tool_call_parser(None).name == "json"


# ------------------------------------------------------------------ calls streamed piece by piece

TRICKY_ARGS = (
    '{"city": "S\u00e3o Paulo {x}", "opts": {"units": ["C", "F"], "deep": {"k": [1, {"z": null}]}}, '
    '"q": "say \\"hi\\" \\\\ } ] </b> <tool_ \\u00e9 \\n\u65e5\u672c \U0001f600", "days": 3}'
)
STREAM_SAMPLES = [
    # (parser, model output, [(name, arguments text)], content)
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + TRICKY_ARGS
        + "}\n</tool_call>",
        [("get_weather", TRICKY_ARGS)],
        "Let me check.",
    ),
    (
        "hermes",
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, 3]}}}\n</tool_call>\n'
            '<tool_call>\n{"arguments": {"s": "}\\"{"}, "name": "echo"}\n</tool_call>'
        ),
        [("add", '{"a": 1, "b": {"c": [2, 3]}}'), ("echo", '{"s": "}\\"{"}')],
        "",
    ),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', [("now", "{}")], ""),
    (
        "json",
        '[{"name": "add", "arguments": {"a": 1, "b": {"c": "}]"}}}, {"name": "echo", "parameters": '
        + TRICKY_ARGS
        + "}]",
        [("add", '{"a": 1, "b": {"c": "}]"}}'), ("echo", TRICKY_ARGS)],
        "",
    ),
    (
        "json",
        ' {"name": "add", "arguments": "{\\"a\\": 2}"}\n',
        [("add", '{"a": 2}')],
        "",
    ),
]


def stream(
    parser: str,
    pieces: list[str],
    calls_finish: str = "tool_calls",
    engine_finish: str = "stop",
    forced: bool = False,
    forced_name: str | None = None,
):
    """Feed `pieces` as a stream would; returns (parts of every step together, the calls as a client
    that accumulates the pieces by index sees them, finish_reason)."""
    s = ChoiceSplitter(
        None, TOOL_CALL_PARSERS[parser].splitter(forced, forced_name), calls_finish
    )
    total, seen = ChoiceParts(), {}
    for step in [s.feed(p) for p in pieces] + [s.finish()]:
        total.extend(step)
        for piece in step.pieces:
            if (
                piece.index not in seen
            ):  # the first piece of a call: id and name, no arguments yet
                assert (
                    piece.id.startswith("call_")
                    and piece.name
                    and piece.arguments == ""
                ), piece
                assert piece.index == len(seen)
                seen[piece.index] = {
                    "id": piece.id,
                    "name": piece.name,
                    "arguments": "",
                }
            else:
                assert piece.id is None and piece.name is None and piece.arguments, (
                    piece
                )
                seen[piece.index]["arguments"] += piece.arguments
    return total, [seen[i] for i in sorted(seen)], s.finish_reason(engine_finish)


def cuttings(text: str) -> list[list[str]]:
    """Every cut into two pieces, one character per piece, and random cuts into many."""
    rng = random.Random(len(text))
    return (
        [[text[:k], text[k:]] for k in range(1, len(text))]
        + [list(text)]
        + [random_pieces(text, rng) for _ in range(50)]
    )


@pytest.mark.parametrize("parser, text, calls, content", STREAM_SAMPLES)
def test_streamed_argument_fragments_add_up_to_the_whole_calls(
    parser, text, calls, content
):
    whole, _, finish = stream(parser, [text])
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert [json.loads(c.arguments) for c in whole.calls] == [
        json.loads(a) for _, a in calls
    ]
    assert whole.content == content and finish == "tool_calls"
    for pieces in cuttings(text):
        parts, streamed, _ = stream(parser, pieces)
        assert [(c["id"], c["name"], c["arguments"]) for c in streamed] == [
            (c.id, c.name, c.arguments) for c in parts.calls
        ], pieces
        assert [(c.name, c.arguments) for c in parts.calls] == calls, pieces
        assert parts.content == content, pieces


def test_arguments_stream_as_soon_as_they_are_certain():
    text = '<tool_call>\n{"name": "f", "arguments": {"q": "a<b", "n": [1, 2]}}\n</tool_call>'
    args = '{"q": "a<b", "n": [1, 2]}'
    args_at = text.index(args)
    s = TOOL_CALL_PARSERS["hermes"].splitter()
    sent, head_at = "", None
    for k, ch in enumerate(text):
        events = s.feed(ch)
        for piece in events.pieces:
            if piece.id is not None:
                head_at = k
            sent += piece.arguments
        if args_at <= k < args_at + len(args):
            # everything read inside the arguments is out, except a "<" that may start </tool_call>
            expected = args[: k + 1 - args_at]
            assert sent == (expected[:-1] if ch == "<" else expected), k
    assert head_at == text.index(
        '", "arguments"'
    )  # the call starts when the name's string closes
    assert sent == args


def test_a_cut_off_call_streams_its_start_but_is_no_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    parts, streamed, finish = stream(
        "hermes", [text[:30], text[30:]], engine_finish="length"
    )
    assert [c["name"] for c in streamed] == [
        "get_weather"
    ]  # already sent: a client sees it cut off
    assert streamed[0]["arguments"] == '{"city": "Pa'
    assert not parts.calls and parts.content == text and finish == "length"
    # a call that turns out to be invalid JSON is text too, streamed or not
    bad = '<tool_call>\n{"name": "f", "arguments": {"a": 1} junk}\n</tool_call>'
    for pieces in ([bad], list(bad)):
        parts, _, finish = stream("hermes", pieces)
        assert not parts.calls and parts.content == bad and finish == "stop"


FORCED_SAMPLES = [
    # (parser, the forced output written whole, [(name, arguments text)] of its calls)
    (
        "hermes",
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa <x>", "days": 3}}\n'
            "</tool_call>"
        ),
        [("get_weather", '{"city": "Pa <x>", "days": 3}')],
    ),
    (
        "hermes",
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>'
        ),
        [("add", '{"a": 1}'), ("get_weather", '{"days": 3}')],
    ),
    (
        "json",
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "json",
        '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"days": 3}}]',
        [("add", '{"a": 1}'), ("get_weather", '{"days": 3}')],
    ),
]


@pytest.mark.parametrize(
    "parser, text, calls, named",
    [(*sample, False) for sample in FORCED_SAMPLES]
    + [(*s, True) for s in FORCED_SAMPLES if len(s[2]) == 1],
)
def test_a_forced_call_cut_off_is_a_call_as_far_as_it_got(parser, text, calls, named):
    """tool_choice "required" or a named function (one call), max_tokens reached at any point: the call
    the output ended in is a call whose arguments end there (as OpenAI answers), streamed and not, with
    finish "length". Only a "required" call cut off before its name is whole cannot be named: its text
    stays content."""
    name = calls[-1][0] if named else None
    spans = []  # (where each call starts, its name has been read, its arguments start and end) in text
    at = 0
    for call_name, args in calls:
        start = text.index("<tool_call>" if parser == "hermes" else "{", at)
        name_end = text.index(f'"{call_name}"', start) + len(call_name) + 2
        args_at = text.index(args, name_end)
        spans.append((start, name_end, args_at, args_at + len(args)))
        at = args_at + len(args)
    for k in range(1, len(text)):
        prefix = text[:k]
        expected = [
            (call_name, prefix[args_at:args_end] if k > args_at else "")
            for (call_name, _), (start, name_end, args_at, args_end) in zip(
                calls, spans
            )
            if k >= name_end or named
        ]
        started = [start for start, *_ in spans if k > start]
        unnamed = (
            started[len(expected)]
            if expected and len(started) > len(expected)
            else None
        )
        for pieces in ([prefix], list(prefix)):
            parts, streamed, finish = stream(
                parser, pieces, engine_finish="length", forced=True, forced_name=name
            )
            assert finish == "length"
            assert [(c.name, c.arguments) for c in parts.calls] == expected, (
                prefix,
                pieces,
            )
            assert [(c["id"], c["name"], c["arguments"]) for c in streamed] == [
                (c.id, c.name, c.arguments) for c in parts.calls
            ], (prefix, pieces)
            content = (
                prefix[unnamed:] if unnamed is not None else "" if expected else prefix
            )
            assert parts.content.lstrip() == content, (
                prefix,
                pieces,
            )  # whitespace between calls: either


def test_a_forced_call_cut_off_by_a_stop_is_not_a_finished_call():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    for calls_finish, name in (("stop", "f"), ("tool_calls", None)):  # named, required
        parts, _, finish = stream(
            "hermes", [text], calls_finish, forced=True, forced_name=name
        )
        assert [(c.name, c.arguments) for c in parts.calls] == [
            ("f", '{"a": 1')
        ] and finish == "stop"
    # cut off only in the end tag, the call is whole
    parts, _, finish = stream("hermes", [text + "}}\n</tool_"], forced=True)
    assert [(c.name, c.arguments) for c in parts.calls] == [
        ("f", '{"a": 1}')
    ] and finish == "tool_calls"


def test_a_later_call_keeps_its_index_after_a_failed_one():
    good = '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>'
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}, oops}\n</tool_call>' + good
    )
    parts, streamed, finish = stream("hermes", list(text))
    assert [c["name"] for c in streamed] == ["f", "g"]
    assert [(c.index, c.name, c.arguments) for c in parts.calls] == [
        (1, "g", '{"b": 2}')
    ]
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    "parser, text",
    [
        ("json", '{"name": "Bob", "arguments": [1]}'),  # arguments not an object
        ("json", '{"name": "f", "arguments": {"a": 1}} and more'),  # not only calls
        ("json", '[{"name": "f", "arguments": {}}, 5]'),
        ("json", '[{"name": "f", "arguments": {}}'),  # cut off
        ("hermes", '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": "{not json"}\n</tool_call>',
        ),
    ],
)
def test_output_that_is_not_calls_is_content(parser, text):
    for pieces in ([text], list(text)):
        parts, _, finish = stream(parser, pieces)
        assert not parts.calls and parts.content == text and finish == "stop", pieces


def test_a_named_tool_choice_finishes_with_stop_as_openai_does():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert stream("hermes", [call], calls_finish="stop")[2] == "stop"
    assert (
        stream("hermes", [call], calls_finish="stop", engine_finish="length")[2]
        == "length"
    )
    assert stream("hermes", [call])[2] == "tool_calls"
