"""/v1/responses without a server: input items as the chat messages the chat path gets, the 400s
that name the field, the store's LRU and conversation chain, and the output items built the same
from a whole answer and from a stream."""

from __future__ import annotations

import json

import msgspec
import pytest

from strata.server.chat_output import ChoiceSplitter
from strata.server.protocol import APIError, ChatCompletionRequest, decode_body
from strata.server.reasoning import REASONING_PARSERS
from strata.server.responses_input import (
    chat_request,
    chat_tool_choice,
    check_supported,
    input_items,
    text_format_spec,
)
from strata.server.responses_output import OutputBuilder
from strata.server.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    Response,
    ResponsesRequest,
)
from strata.server.responses_store import ResponseStore, StoredResponse
from strata.server.structured import check_tools, template_messages
from strata.server.tool_calls import TOOL_CALL_PARSERS


def request(**body) -> ResponsesRequest:
    return decode_body(json.dumps(body).encode(), ResponsesRequest)


def messages_of(req: ResponsesRequest) -> list[dict]:
    """What the chat template is given for this request."""
    return template_messages(chat_request(req, input_items(req.input)))


def refused(param: str, **body) -> str:
    with pytest.raises(APIError) as e:
        req = request(**body)
        check_supported(req)
        chat = chat_request(req, input_items(req.input))
        check_tools(chat)
        text_format_spec(req.text)
    assert e.value.status == 400 and e.value.param == param, (
        e.value.param,
        e.value.message,
    )
    return e.value.message


def test_a_string_is_one_user_message_and_instructions_a_system_one_before_it():
    assert messages_of(request(input="hi")) == [{"role": "user", "content": "hi"}]
    assert messages_of(request(input="hi", instructions="be brief")) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_a_tool_round_trip_maps_to_the_chat_conversation_of_the_same_turns():
    items = [
        {"role": "developer", "content": "use tools"},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "weather "},
                {"type": "input_text", "text": "in Oslo?"},
            ],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Checking.", "annotations": []}
            ],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "get_time",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
    ]
    chat = {
        "messages": [
            {"role": "system", "content": "use tools"},
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Oslo"}',
                        },
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        ]
    }
    expected = template_messages(
        decode_body(json.dumps(chat).encode(), ChatCompletionRequest)
    )
    assert messages_of(request(input=items)) == expected
    # a call with no assistant text before it opens an assistant message of its own
    calls_only = messages_of(request(input=[items[1], items[4], items[6]]))
    assert calls_only[1]["role"] == "assistant" and calls_only[1]["content"] == ""
    assert [c["id"] for c in calls_only[1]["tool_calls"]] == ["call_1"]


def test_items_get_ids_and_keep_the_ones_they_came_with():
    items = input_items(
        request(
            input=[
                {"role": "user", "content": "a"},
                {
                    "type": "function_call",
                    "id": "fc_x",
                    "call_id": "c",
                    "name": "f",
                    "arguments": "{}",
                },
            ]
        ).input
    )
    assert items[0].id.startswith("msg_") and items[1].id == "fc_x"
    assert isinstance(items[0], MessageItem) and isinstance(items[1], FunctionCallItem)


@pytest.mark.parametrize(
    ("param", "body", "words"),
    [
        ("input", {"input": 3}, "Expected `str | array`"),
        ("input", {"input": []}, "non-empty list"),
        (
            "input[1].type",
            {"input": [{"role": "user", "content": "hi"}, {"type": "x"}]},
            None,
        ),
        (
            "input[0].type",
            {"input": [{"type": "bogus"}]},
            "'bogus' is not one of message, function_call",
        ),
        ("input[0].role", {"input": [{"content": "x"}]}, "role must be one of"),
        ("input[0].role", {"input": [{"role": "tool", "content": "x"}]}, "got 'tool'"),
        ("input[0].content", {"input": [{"role": "user"}]}, "without content"),
        (
            "input[0].content[1]",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_image", "image_url": "x"},
                        ],
                    }
                ]
            },
            "text parts only",
        ),
        (
            "input[0].call_id",
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "needs call_id",
        ),
        (
            "input[0].output",
            {"input": [{"type": "function_call_output", "call_id": "c"}]},
            "needs output",
        ),
        (
            "input[0].type",
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            "previous_response_id",
        ),
        (
            "input",
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": "x"}
                ]
            },
            "follows no function_call",
        ),
        (
            "tools[0].type",
            {"input": "x", "tools": [{"type": "web_search"}]},
            "only function tools",
        ),
        (
            "tools[0].name",
            {"input": "x", "tools": [{"type": "function"}]},
            "needs name",
        ),
        (
            "tools[0].parameters",
            {
                "input": "x",
                "tools": [
                    {"type": "function", "name": "f", "parameters": {"type": "array"}}
                ],
            },
            "object",
        ),
        (
            "tool_choice.type",
            {"input": "x", "tool_choice": {"type": "web_search_preview"}},
            "not supported",
        ),
        (
            "text.format.type",
            {"input": "x", "text": {"format": {"type": "xml"}}},
            "'xml'",
        ),
        (
            "text.format.schema",
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "needs a schema",
        ),
        (
            "text.verbosity",
            {"input": "x", "text": {"verbosity": "low"}},
            "not supported",
        ),
        ("truncation", {"input": "x", "truncation": "auto"}, '"auto" is not supported'),
        (
            "include",
            {
                "input": "x",
                "include": ["reasoning.encrypted_content", "file_search_call.results"],
            },
            "include[1] 'file_search_call.results'",
        ),
        ("top_logprobs", {"input": "x", "top_logprobs": 3}, "needs include"),
        ("background", {"input": "x", "background": True}, "background"),
        (
            "conversation",
            {"input": "x", "conversation": "conv_1"},
            "previous_response_id",
        ),
        (
            "metadata",
            {"input": "x", "metadata": {str(i): "v" for i in range(17)}},
            "at most 16 keys",
        ),
        (
            "max_output_tokens",
            {"input": "x", "max_output_tokens": "9"},
            "Expected `int | null`",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(param, body, words):
    message = refused(param, **body)
    if words is not None:
        assert words in message, message


def test_tool_choice_and_text_format_become_chats():
    named = chat_tool_choice(
        request(input="x", tool_choice={"type": "function", "name": "f"}).tool_choice
    )
    assert (
        named is not None and not isinstance(named, str) and named.function.name == "f"
    )
    assert (
        chat_tool_choice(request(input="x", tool_choice="required").tool_choice)
        == "required"
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec, param = text_format_spec(
        request(
            input="x",
            text={
                "format": {
                    "type": "json_schema",
                    "name": "A",
                    "schema": schema,
                    "strict": True,
                }
            },
        ).text
    )
    assert (spec.kind, json.loads(spec.source), param) == (
        "json_schema",
        schema,
        "text.format.schema",
    )
    assert (
        text_format_spec(request(input="x", text={"format": {"type": "text"}}).text)
        is None
    )
    tools = check_tools(
        chat_request(
            request(
                input="x",
                tools=[
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": schema,
                        "strict": True,
                    }
                ],
            ),
            [],
        )
    )
    assert tools == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": schema, "strict": True},
        }
    ]


# ------------------------------------------------------------------ the store


def stored(rid: str, previous: StoredResponse | None = None) -> StoredResponse:
    items = input_items(f"to {rid}")
    out = [MessageItem(id=f"msg_{rid}", role="assistant", content=[])]
    return StoredResponse(
        Response(id=rid, created_at=0, status="completed", model="m", output=out),
        items,
        previous,
    )


def test_the_store_drops_the_least_recently_used_and_a_chain_outlives_it():
    store = ResponseStore(2)
    first = stored("a")
    store.put(first)
    store.put(stored("b"))
    assert store.get("a") is first  # now the most recent
    store.put(stored("c", previous=first))
    assert store.get("b") is None and len(store) == 2
    third = store.get("c")
    assert third is not None
    store.delete("a")
    assert store.get("a") is None
    # the continuation still holds the conversation before it
    texts = [
        item.content[0].text if item.content else item.id
        for item in third.conversation()
    ]
    assert texts == ["to a", "msg_a", "to c", "msg_c"]
    assert [i.id for i in third.input_context()] == [
        i.id for i in third.conversation()[:3]
    ]
    none = ResponseStore(0)
    none.put(stored("x"))
    assert none.get("x") is None


# ------------------------------------------------------------------ output items


TEXT = 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def build(
    text: str,
    pieces: list[str],
    cut_off: bool = False,
    reasoning: bool = False,
    forced: bool = False,
) -> OutputBuilder:
    parser = TOOL_CALL_PARSERS["hermes"]
    think = REASONING_PARSERS["qwen3"].splitter() if reasoning else None
    splitter = ChoiceSplitter(think, parser.splitter(forced))
    builder = OutputBuilder(stream=True)
    for piece in pieces:
        builder.feed(splitter.feed(piece))
    builder.feed(splitter.finish())
    builder.finish(cut_off)
    return builder


def shape(builder: OutputBuilder) -> list[dict]:
    items = msgspec.to_builtins(builder.items)
    for item in items:
        item.pop("id")
        item.pop("call_id", None)
    return items


def events(builder: OutputBuilder) -> list[dict]:
    raw = builder.drain().decode().strip().split("\n\n")
    out = []
    for block in raw:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == "event: " + event["type"]
        out.append(event)
    return out


def test_a_stream_and_a_whole_answer_make_the_same_items():
    text = "<think>add them</think>" + TEXT
    whole = build(text, [text], reasoning=True)
    streamed = build(text, list(text), reasoning=True)
    assert shape(whole) == shape(streamed)
    assert [item["type"] for item in shape(whole)] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert shape(whole)[1]["content"][0]["text"] == "Sure."
    call = shape(whole)[2]
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == (
        "add",
        {"a": 1, "b": 2},
        "completed",
    )
    assert whole.reasoning == "add them"


def test_events_open_and_close_each_item_in_order():
    got = events(build(TEXT, list(TEXT)))
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    kinds = [e["type"] for e in got]
    assert kinds[:3] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.output_item.done"
    )
    first_done = kinds.index("response.output_item.done")
    assert (
        kinds[first_done + 1] == "response.output_item.added"
    )  # the call opens after the message closed
    call_added = got[first_done + 1]["item"]
    assert (call_added["type"], call_added["arguments"], call_added["status"]) == (
        "function_call",
        "",
        "in_progress",
    )
    deltas = "".join(
        e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"
    )
    done = next(e for e in got if e["type"] == "response.function_call_arguments.done")
    assert deltas == done["arguments"] == '{"a": 1, "b": 2}'
    assert (
        kinds[-1] == "response.output_item.done"
        and got[-1]["item"]["status"] == "completed"
    )
    added = [
        e["output_index"] for e in got if e["type"] == "response.output_item.added"
    ]
    closed = [
        e["output_index"] for e in got if e["type"] == "response.output_item.done"
    ]
    assert added == closed == [0, 1]


def test_a_cut_off_output_is_incomplete_and_an_empty_one_is_one_empty_message():
    forced_text = TEXT.removeprefix("Sure.")
    cut = forced_text[: forced_text.index('"b"')]
    forced = build(cut, list(cut), cut_off=True, forced=True)
    assert [(i["type"], i["status"]) for i in shape(forced)] == [
        ("function_call", "incomplete")
    ]
    assert shape(forced)[0]["arguments"] == '{"a": 1, '
    # "auto": a call cut off is no call; its text follows as content, the call's item is incomplete
    cut = TEXT[: TEXT.index('"b"')]
    auto = build(cut, list(cut), cut_off=True)
    assert [(i["type"], i["status"]) for i in shape(auto)] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
        ("message", "incomplete"),
    ]
    empty = build("", [])
    assert shape(empty) == [
        {
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ],
            "status": "completed",
        }
    ]
