"""Structured output, tool calls and reasoning through a live `strata serve` and the official OpenAI
client. The model is tiny and random: what makes its answers valid JSON is the grammar mask alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import live_server
import openai
import pydantic
import pytest
from live_server import LiveServer, tool_model

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "type": "function",
        "function": {
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
        },
    },
    {
        "type": "function",
        "function": {
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
        },
    },
]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[Annotated[str, pydantic.StringConstraints(max_length=8)]] = (
        pydantic.Field(max_length=3)
    )


@pytest.fixture(scope="module")
def tool_model_dir():
    with tool_model("strata-structured-") as path:
        yield path


@pytest.fixture(scope="module")
def server(tool_model_dir):
    with LiveServer("--served-model-name", "tiny", model_dir=tool_model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120
    )


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# ------------------------------------------------------------------ response_format


def test_parse_returns_a_validated_pydantic_object(oai):
    for seed in range(3):
        out = oai.chat.completions.parse(
            model="tiny",
            messages=ask("Describe someone"),
            response_format=Person,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)
        assert (
            Person.model_validate_json(choice.message.content) == choice.message.parsed
        )


def test_json_object_and_regex_and_ebnf(oai, server):
    out = oai.chat.completions.create(
        model="tiny",
        messages=ask("json"),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut off by max_tokens: still a prefix of JSON, never free text
        assert out.choices[0].message.content.startswith("{")
    out = oai.completions.create(
        model="tiny",
        prompt="Code:",
        extra_body={"regex": r"[A-Z]{2}-[0-9]{3}"},
        max_tokens=20,
        temperature=1.0,
        seed=1,
    )
    import re

    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
    texts = set()
    for seed in range(4):
        out = oai.chat.completions.create(
            model="tiny",
            messages=ask("?"),
            extra_body={"ebnf": lark},
            temperature=1.0,
            seed=seed,
            max_tokens=10,
        )
        texts.add(out.choices[0].message.content)
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", t) for t in texts), texts
    # the native endpoint takes SGLang's keys
    with server.client() as c:
        r = c.post(
            "/generate",
            json={
                "text": "x",
                "sampling_params": {
                    "regex": "(ab)+c",
                    "max_new_tokens": 30,
                    "temperature": 1.0,
                    "seed": 3,
                },
            },
        )
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"(ab)+c", r.json()["text"])


def test_stream_equals_non_stream_and_n_agrees_for_greedy(oai):
    kw = dict(
        model="tiny",
        messages=ask("Describe"),
        temperature=0,
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": Person.model_json_schema()},
        },
    )
    full = oai.chat.completions.create(**kw)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert text == full.choices[0].message.content
    many = oai.chat.completions.create(n=3, **kw)
    assert [c.message.content for c in many.choices] == [
        full.choices[0].message.content
    ] * 3


def test_64_concurrent_requests_with_different_schemas(server):
    async def one(client, i: int):
        schema = {
            "type": "object",
            "properties": {
                f"k{i}": {"type": "integer", "minimum": 0, "maximum": i + 5},
                "s": {"enum": [f"v{i}", "w"]},
            },
            "required": [f"k{i}", "s"],
            "additionalProperties": False,
        }
        out = await client.chat.completions.create(
            model="tiny",
            messages=ask(f"item {i}"),
            temperature=1.0,
            seed=i,
            max_tokens=40,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        value = json.loads(out.choices[0].message.content)
        assert (
            set(value) == {f"k{i}", "s"}
            and 0 <= value[f"k{i}"] <= i + 5
            and value["s"] in (f"v{i}", "w")
        )

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300
        ) as c:
            await asyncio.gather(*(one(c, i) for i in range(64)))

    asyncio.run(main())
    assert server.info()["kv_cache"]["leaked_pages"] == 0


# ------------------------------------------------------------------ 400s


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            },
            "response_format.json_schema.schema",
            "wat",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(("},
                    },
                }
            },
            "response_format.json_schema.schema",
            "regex",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"regex": "a(b"}, "regex", "unclosed group"),
        ({"ebnf": "start: undefined_rule"}, "ebnf", "undefined_rule"),
        ({"regex": "a", "ebnf": 'start: "a"'}, "ebnf", "at most one"),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ],
)
def test_bad_grammars_are_400s_that_name_the_problem(server, extra, param, words):
    body = {"model": "tiny", "messages": ask("hi"), "max_tokens": 4, **extra}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        # the engine is still serving
        assert (
            c.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": ask("hi"), "max_tokens": 2},
            ).status_code
            == 200
        )


def test_native_bad_schema_is_a_400(server):
    with server.client() as c:
        r = c.post(
            "/generate",
            json={"text": "x", "sampling_params": {"json_schema": "{not json"}},
        )
        assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"], (
            r.text
        )


# ------------------------------------------------------------------ tools


def test_required_tool_call_round_trips_through_two_turns(oai):
    messages = ask("What is the weather in Paris for 3 days?")
    first = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=150,
        parallel_tool_calls=False,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[
        call.function.name
    ]
    assert set(args) == set(spec["required"])
    # second turn: the call and its result go back through the chat template
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = oai.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=8
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def stream_calls(oai: openai.OpenAI, **kw) -> tuple[dict[int, dict], str, str | None]:
    """A streamed chat completion as a client that accumulates deltas by index sees it: per call
    index its first delta and its argument fragments after that; the content; the finish_reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    calls[d.index] = {"first": d, "fragments": []}
                else:
                    assert d.id is None and d.function.name is None, d
                    calls[d.index]["fragments"].append(d.function.arguments)
    return calls, content, finish


def streamed_call(entry: dict) -> tuple[str, str]:
    return entry["first"].function.name, "".join(entry["fragments"])


def test_named_tool_choice_and_parallel_calls_stream_like_non_stream(oai):
    named = {"type": "function", "function": {"name": "add"}}
    for choice_kw in (
        dict(tool_choice=named),
        dict(tool_choice="required", parallel_tool_calls=True),
    ):
        kw = dict(
            model="tiny",
            messages=ask("add 2 and 3"),
            tools=TOOLS,
            temperature=0,
            max_tokens=200,
            **choice_kw,
        )
        full = oai.chat.completions.create(**kw).choices[0]
        calls, _, finish = stream_calls(oai, **kw)
        assert finish == full.finish_reason
        # a named choice makes exactly one call and finishes with "stop", as OpenAI's does; parallel
        # calls go on until the model stops, and the calls completed before max_tokens are still calls
        assert full.finish_reason in (
            ("stop",) if choice_kw["tool_choice"] is named else ("tool_calls", "length")
        )
        assert full.message.tool_calls
        streamed = [streamed_call(calls[i]) for i in sorted(calls)]
        assert streamed == [
            (c.function.name, c.function.arguments) for c in full.message.tool_calls
        ]
        if choice_kw["tool_choice"] is named:
            assert [c.function.name for c in full.message.tool_calls] == ["add"]
        for c in full.message.tool_calls:
            json.loads(c.function.arguments)


def test_a_forced_call_streams_its_arguments_while_the_model_writes_them(oai):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        kw = {
            "model": "tiny",
            "messages": ask("Weather in Oslo for 2 days?"),
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "temperature": 0,
            "max_tokens": 150,
            "parallel_tool_calls": False,
        }
        (call,) = oai.chat.completions.create(**kw).choices[0].message.tool_calls
        calls, content, finish = stream_calls(oai, **kw)
        assert list(calls) == [0] and content == ""
        first, fragments = calls[0]["first"], calls[0]["fragments"]
        assert first.id.startswith("call_") and first.type == "function"
        assert (
            first.function.name == call.function.name and first.function.arguments == ""
        )
        assert len(fragments) > 1, (
            fragments
        )  # token by token, not the whole arguments at once
        assert "".join(fragments) == call.function.arguments
        spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[
            call.function.name
        ]
        assert set(json.loads(call.function.arguments)) == set(spec["required"])
        assert finish == ("stop" if tool_choice is named else "tool_calls")


def test_a_forced_call_cut_off_by_max_tokens_is_still_a_call(oai):
    """As OpenAI answers: the call with its arguments as far as they got, and finish_reason "length"."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        kw = {
            "model": "tiny",
            "messages": ask("weather"),
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "temperature": 0,
            "parallel_tool_calls": False,
        }
        whole = oai.chat.completions.create(max_tokens=150, **kw)
        (whole_call,) = whole.choices[0].message.tool_calls
        # greedy: an output cut off is the start of the whole one; cut earlier until inside the arguments
        for max_tokens in range(whole.usage.completion_tokens - 1, 0, -1):
            choice = oai.chat.completions.create(max_tokens=max_tokens, **kw).choices[0]
            assert (
                choice.finish_reason == "length" and choice.message.content is None
            ), choice
            (call,) = choice.message.tool_calls
            assert (
                call.id.startswith("call_")
                and call.function.name == whole_call.function.name
            )
            assert whole_call.function.arguments.startswith(call.function.arguments)
            if 0 < len(call.function.arguments) < len(whole_call.function.arguments):
                break
        else:
            raise AssertionError(f"no max_tokens cut {whole_call} inside its arguments")
        calls, content, finish = stream_calls(oai, max_tokens=max_tokens, **kw)
        assert finish == "length" and content == ""
        streamed = [streamed_call(calls[i]) for i in sorted(calls)]
        assert streamed == [(call.function.name, call.function.arguments)]


# ------------------------------------------------------------------ reasoning


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    with live_server.reasoning_server(tmp_path_factory.mktemp("reasoning")) as srv:
        yield srv


def test_reasoning_is_split_off_streamed_and_not(reasoning_server):
    client = openai.OpenAI(
        base_url=reasoning_server.url + "/v1", api_key="none", max_retries=0, timeout=60
    )
    kw = dict(
        model=client.models.list().data[0].id,
        messages=ask("think"),
        temperature=0,
        max_tokens=24,
    )
    full = client.chat.completions.create(**kw).choices[0].message
    # the template opened <think>; this random model never closes it, so everything is reasoning
    assert full.reasoning_content and not full.content
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (full.reasoning_content, full.content or "")


def test_frontend_validates_grammars_without_torch(server, oai):
    oai.chat.completions.create(
        model="tiny",
        messages=ask("x"),
        response_format={"type": "json_object"},
        max_tokens=4,
    )
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "llguidance" in maps and "libtorch" not in maps


# ------------------------------------------------------------------ speculative decoding


@pytest.fixture(scope="module")
def spec_server(tool_model_dir):
    with LiveServer(
        "--served-model-name",
        "tiny",
        "--speculative-algorithm",
        "ngram",
        "--speculative-fixed-length",
        model_dir=tool_model_dir,
    ) as srv:
        yield srv


def test_greedy_answers_are_the_same_with_speculation(oai, spec_server):
    """Schemas, regexes, forced tool calls and plain chat, n = 2, streamed and not: a server drafting
    tokens (n-gram, fixed length) answers greedy requests exactly as one without."""
    spec = openai.OpenAI(
        base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=120
    )
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": Person.model_json_schema()},
    }
    requests = [
        dict(
            messages=ask("Describe a person. Describe a person."),
            response_format=schema,
            n=2,
        ),
        dict(
            messages=ask("Numbers 0123 0123 0123"),
            extra_body={"regex": "([0-9]{4} ){3,6}[a-z]+"},
        ),
        dict(
            messages=ask("What is the weather in Paris?"),
            tools=TOOLS,
            tool_choice="required",
        ),
        dict(
            messages=ask(
                "The quick brown fox jumps over the lazy dog. The quick brown fox"
            )
        ),
    ]
    for kw in requests:
        kw = dict(model="tiny", temperature=0, max_tokens=80, **kw)
        plain, drafted = (
            oai.chat.completions.create(**kw),
            spec.chat.completions.create(**kw),
        )
        for a, b in zip(plain.choices, drafted.choices, strict=True):
            assert b.message.content == a.message.content
            assert b.finish_reason == a.finish_reason
            assert [
                (c.function.name, c.function.arguments)
                for c in b.message.tool_calls or []
            ] == [
                (c.function.name, c.function.arguments)
                for c in a.message.tool_calls or []
            ]
        if kw.get("n", 1) == 1 and not kw.get("tools"):
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in spec.chat.completions.create(stream=True, **kw)
                if c.choices
            )
            assert streamed == plain.choices[0].message.content
    with spec_server.client() as c:
        info = c.get("/get_server_info").json()
        metrics = c.get("/metrics").text
        body = {
            "text": "ab ab ab ab ab ab",
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 48,
                "ignore_eos": True,
            },
        }
        c.post("/generate", json=body)
        meta = c.post("/generate", json=body).json()[
            "meta_info"
        ]  # drafted from the first answer
    assert meta["spec_verify_steps"] > 0 and meta["spec_accept_length"] >= 1, meta
    assert 'strata:spec_events{kind="accepted_tokens",model_name="tiny"}' in metrics
    assert "strata:spec_accept_length" in metrics
    assert info["speculative"]["verify_steps"] > 0, info["speculative"]
    assert info["speculative"]["accepted_tokens"] > 0, info["speculative"]
