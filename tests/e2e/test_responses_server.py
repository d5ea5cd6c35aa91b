"""POST /v1/responses of a live `strata serve` through the official OpenAI client and raw HTTP:
create, stream and parse, a tool round trip over previous_response_id, stored responses, reasoning
items, the same output as /v1/chat/completions for the same conversation, and 400s that name the
field. The model is tiny and random: grammars (text.format, forced tool calls) make its answers
finish."""

from __future__ import annotations

import json
import time

import httpx
import live_server
import openai
import pytest
from live_server import LiveServer, tool_model
from test_structured_output import Person

pytestmark = pytest.mark.e2e

KEY = "responses-key"
CONTEXT = 1024
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
ADD = {
    "type": "function",
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "maximum": 999},
            "b": {"type": "integer", "maximum": 999},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, ADD]


def chat_tools(tools: list[dict]) -> list[dict]:
    return [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in tools
    ]


@pytest.fixture(scope="module")
def model_dir():
    with tool_model("strata-responses-") as path:
        yield path


@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(
        "--served-model-name",
        "tiny",
        "--context-length",
        str(CONTEXT),
        "--responses-store-size",
        "64",
        model_dir=model_dir,
        api_key=KEY,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
    )


def chat_text(oai: openai.OpenAI, messages: list[dict], **kw) -> tuple[str, int]:
    out = oai.chat.completions.create(
        model="tiny", messages=messages, temperature=0, **kw
    )
    return out.choices[0].message.content or "", out.usage.prompt_tokens


# ------------------------------------------------------------------ create


def test_a_string_input_answers_like_chat(oai):
    r = oai.responses.create(
        model="tiny", input="Hello there", temperature=0, max_output_tokens=12
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete" and r.usage.output_tokens == 12
    text, prompt_tokens = chat_text(
        oai, [{"role": "user", "content": "Hello there"}], max_tokens=12
    )
    assert r.output_text == text
    usage = r.usage
    assert usage.input_tokens == prompt_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0


def test_items_and_instructions_answer_like_the_same_chat(oai):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"type": "message", "role": "user", "content": "And 3+3?"},
    ]
    r = oai.responses.create(
        model="tiny",
        input=items,
        instructions="You are a calculator.",
        temperature=0,
        max_output_tokens=16,
        metadata={"run": "1"},
        user="u1",
    )
    messages = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    text, prompt_tokens = chat_text(oai, messages, max_tokens=16)
    assert (r.output_text, r.usage.input_tokens) == (text, prompt_tokens)
    assert r.instructions == "You are a calculator."
    assert r.metadata == {"run": "1"} and r.user == "u1" and r.temperature == 0


def test_previous_response_id_continues_without_the_earlier_instructions(oai):
    first = oai.responses.create(
        model="tiny",
        input="Hello",
        instructions="Be terse.",
        temperature=0,
        max_output_tokens=8,
    )
    second = oai.responses.create(
        model="tiny",
        input="Go on",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id and second.instructions is None
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on"},
    ]
    text, prompt_tokens = chat_text(oai, messages, max_tokens=8)
    assert (second.output_text, second.usage.input_tokens) == (text, prompt_tokens)
    items = oai.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items.data[1].id == first.output[0].id


# ------------------------------------------------------------------ tools


def test_a_tool_round_trip(oai):
    first = oai.responses.create(
        model="tiny",
        input="What is the weather in Paris for 3 days?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=150,
    )
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    spec = {t["name"]: t["parameters"] for t in TOOLS}[call.name]
    assert set(json.loads(call.arguments)) == set(spec["required"])
    second = oai.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        ],
        tools=TOOLS,
        temperature=0,
        max_output_tokens=8,
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.output and second.status in ("completed", "incomplete")
    # the chat path, given the same conversation, answers the same
    messages = [
        {"role": "user", "content": "What is the weather in Paris for 3 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    out = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=chat_tools(TOOLS),
        temperature=0,
        max_tokens=8,
    )
    message = out.choices[0].message
    calls = [(o.name, o.arguments) for o in second.output if o.type == "function_call"]
    assert second.output_text == (message.content or "")
    assert calls == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    assert second.usage.input_tokens == out.usage.prompt_tokens


def test_a_named_tool_choice_calls_that_function(oai):
    r = oai.responses.create(
        model="tiny",
        input="add 2 and 3",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "add"},
        temperature=0,
        max_output_tokens=150,
    )
    assert [(o.type, o.name) for o in r.output] == [("function_call", "add")]
    json.loads(r.output[0].arguments)
    assert r.tool_choice.name == "add" and len(r.tools) == 2


# ------------------------------------------------------------------ streaming


def test_stream_events_come_in_order_and_build_the_final_response(oai):
    kw = dict(
        model="tiny",
        input="Describe someone",
        text_format=Person,
        temperature=0,
        max_output_tokens=150,
    )
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert isinstance(final.output_parsed, Person)
    # the same as created whole, and as stored
    whole = oai.responses.parse(**kw)
    assert whole.output_text == final.output_text
    assert whole.output_parsed == final.output_parsed
    stored = oai.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == "completed"


def test_a_streamed_call_sends_its_arguments_as_they_are_written(oai):
    kw = dict(
        model="tiny",
        input="Weather in Oslo for 2 days?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=150,
    )
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added"
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    fragments = [
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    ]
    assert len(fragments) > 1
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = final.output
    assert "".join(fragments) == done.arguments == call.arguments
    assert call.arguments == whole.output[0].arguments and call.name == "get_weather"
    assert call.parsed_arguments == json.loads(
        call.arguments
    )  # strict: parsed by the client


def test_a_stream_cut_off_ends_incomplete_as_typed_sse(server):
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with server.client() as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = []
    for block in r.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 3
    assert events[-2]["item"]["status"] == "incomplete"


def test_disconnect_mid_stream_aborts(server):
    body = {
        "model": "tiny",
        "input": "Hello",
        "max_output_tokens": 900,
        "temperature": 0,
        "stream": True,
    }
    # as for chat: a run that finished before the disconnect reached the engine is tried again
    for _ in range(3):
        before = wait_idle(server)["num_aborted_requests"]
        with server.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            lines = [line for line, _ in zip(r.iter_lines(), range(15)) if line]
            assert any("output_text.delta" in line for line in lines)
        info = wait_idle(server)
        if info["num_aborted_requests"] == before + 1:
            return
    raise AssertionError("three streams closed early all ran to completion")


def wait_idle(server, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = server.info()
        if info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def test_logprobs_are_included_when_asked_and_are_chats(oai):
    r = oai.responses.create(
        model="tiny",
        input="Hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=5,
        temperature=0,
    )
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 5
    chat = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=5,
        temperature=0,
    )
    expected = chat.choices[0].logprobs.content
    assert [(lp.token, lp.logprob) for lp in lps] == [
        (lp.token, lp.logprob) for lp in expected
    ]
    assert [[t.token for t in lp.top_logprobs] for lp in lps] == [
        [t.token for t in lp.top_logprobs] for lp in expected
    ]


# ------------------------------------------------------------------ stored responses


def test_retrieve_delete_and_store_false(oai, server):
    r = oai.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    assert oai.responses.retrieve(r.id).output_text == r.output_text
    oai.responses.delete(r.id)
    for call in (oai.responses.retrieve, oai.responses.delete):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            call(r.id)
    unstored = oai.responses.create(
        model="tiny", input="Hi", max_output_tokens=4, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    # the same key guards them all
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/responses", json={"input": "x"}).status_code == 401
        assert c.get(f"/v1/responses/{r.id}").status_code == 401


def test_the_store_keeps_the_most_recent_and_a_continuation_its_past(oai):
    """--responses-store-size 64: the oldest goes, a continuation of it keeps the conversation."""
    first = oai.responses.create(model="tiny", input="aa", max_output_tokens=1)
    child = oai.responses.create(
        model="tiny", input="bb", previous_response_id=first.id, max_output_tokens=1
    )
    for _ in range(63):
        oai.responses.create(model="tiny", input="c", max_output_tokens=1, store=True)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    grandchild = oai.responses.create(
        model="tiny", input="dd", previous_response_id=child.id, max_output_tokens=1
    )
    items = oai.responses.input_items.list(grandchild.id, order="asc").data
    texts = [i.content[0].text for i in items if i.role == "user"]
    assert texts == ["aa", "bb", "dd"] and len(items) == 5


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": 5}, "input", "Expected `str | array`"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type", "'computer_call'"),
        (
            {"input": "x", "previous_response_id": "resp_nope"},
            "previous_response_id",
            "'resp_nope' not found",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": "x", "truncation": "auto"}, "truncation", "not supported"),
        ({"input": "x", "temperature": -1}, "temperature", "temperature"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type", "only"),
        (
            {"input": "x", "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "'nope'",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
            "needs a schema",
        ),
        (
            {
                "input": "x",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "n",
                        "schema": {"type": "object", "properties": {"a": {"type": 7}}},
                    }
                },
            },
            "text.format.schema",
            "text.format.schema",
        ),
        (
            {
                "input": "x",
                "tools": [ADD],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "text.format cannot be combined",
        ),
        ({"input": "word " * 2000}, "input", "1024"),
        ({"input": "x", "model": "gpt-9"}, "model", "not served here"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    with server.client() as c:
        r = c.post("/v1/responses", json=body)
    error = r.json()["error"]
    assert r.status_code in (400, 404) and error["param"] == param, r.text
    assert words in error["message"], error["message"]


def test_input_items_pages(oai, server):
    r = oai.responses.create(
        model="tiny",
        input=[{"role": "user", "content": f"m{i}"} for i in range(5)],
        max_output_tokens=1,
    )
    page = oai.responses.input_items.list(r.id, limit=2)  # newest first
    assert [i.content[0].text for i in page.data] == ["m4", "m3"] and page.has_more
    rest = oai.responses.input_items.list(r.id, limit=10, after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["m2", "m1", "m0"]
    assert not rest.has_more
    with server.client() as c:
        bad = c.get(f"/v1/responses/{r.id}/input_items", params={"limit": "0"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


# ------------------------------------------------------------------ reasoning


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    with live_server.reasoning_server(tmp_path_factory.mktemp("reasoning")) as srv:
        yield srv


def test_reasoning_comes_as_a_reasoning_item_streamed_and_not(reasoning_server):
    client = openai.OpenAI(
        base_url=reasoning_server.url + "/v1",
        api_key="none",
        max_retries=0,
        timeout=60,
    )
    kw = dict(
        model=client.models.list().data[0].id,
        input="think",
        temperature=0,
        max_output_tokens=24,
    )
    r = client.responses.create(**kw)
    # the template opened <think>; this random model never closes it: all of it is reasoning
    assert [o.type for o in r.output] == ["reasoning"]
    (item,) = r.output
    assert item.id.startswith("rs_") and item.summary == []
    assert item.content[0].type == "reasoning_text" and item.content[0].text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 24
    assert r.output_text == ""
    chat = client.chat.completions.create(
        model=kw["model"],
        messages=[{"role": "user", "content": "think"}],
        temperature=0,
        max_tokens=24,
    )
    assert item.content[0].text == chat.choices[0].message.reasoning_content
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = "".join(
        e.delta for e in events if e.type == "response.reasoning_text.delta"
    )
    assert deltas == item.content[0].text
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["reasoning"]
    assert events[-1].type == "response.incomplete"
