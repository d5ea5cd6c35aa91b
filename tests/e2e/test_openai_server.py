"""`strata serve` through the official OpenAI client and raw HTTP: one live server (tiny model, API key)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer, tiny_model_dir

pytestmark = pytest.mark.e2e

KEY = "test-key"
MAX_BODY = 256 * 1024
PROMPTS = [
    "The quick brown fox",
    "Hello world! This is",
    "Paged attention keeps",
    "Radix trees share prefixes",
    "Numbers 0123456789 and",
    "Schedulers batch them.",
    "A tiny tokenizer for",
    "The lazy dog",
]


@pytest.fixture(scope="module")
def server():
    with LiveServer(
        "--max-request-bytes", str(MAX_BODY), "--served-model-name", "tiny", api_key=KEY
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60
    )


def chat(oai, content: str, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], **kw
    )


def stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else (choice.text or "")
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_models_lists_the_served_name(oai, server):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # the model directory's name is accepted too
    out = oai.completions.create(
        model=server.info()["model_dir"], prompt="Hello", max_tokens=2, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_equals_non_stream(oai):
    full = chat(oai, "Hello there", max_tokens=16)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    u = full.usage
    assert (
        u.completion_tokens >= 1
        and u.prompt_tokens > 3
        and u.total_tokens == u.prompt_tokens + u.completion_tokens
    )
    text, finish, usage = stream_text(
        chat(
            oai,
            "Hello there",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert (
        usage.completion_tokens == u.completion_tokens
        and usage.prompt_tokens == u.prompt_tokens
    )


def test_completion_stream_equals_non_stream(oai):
    full = oai.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=20, temperature=0
    )
    text, finish, _ = stream_text(
        oai.completions.create(
            model="tiny",
            prompt="The quick brown",
            max_tokens=20,
            temperature=0,
            stream=True,
        )
    )
    assert text == full.choices[0].text and finish == full.choices[0].finish_reason
    assert full.usage.completion_tokens <= 20


def test_default_max_tokens(oai):
    out = oai.completions.create(
        model="tiny", prompt="Hello", temperature=0, extra_body={"ignore_eos": True}
    )
    assert (
        out.usage.completion_tokens == 16
    )  # legacy completions default, as in OpenAI's API


def test_n_choices_with_seed(oai):
    out = chat(oai, "Tell me", n=3, temperature=1.0, seed=7, max_tokens=8)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == sum(
        len(c.logprobs.content)
        for c in chat(
            oai, "Tell me", n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=True
        ).choices
    )
    again = chat(oai, "Tell me", n=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in out.choices
    ]
    # streamed n > 1: every index gets a finish reason
    finishes = {}
    for chunk in chat(oai, "Tell me", n=2, max_tokens=6, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert set(finishes) == {0, 1}


def test_stop_strings(oai):
    base = (
        oai.completions.create(
            model="tiny",
            prompt="Hello world",
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    # a stop string that first occurs part-way through the greedy answer
    k = next(
        i
        for i in range(2, len(base))
        if base[i].isprintable() and base[i] not in base[:i]
    )
    stop = base[k]
    out = oai.completions.create(
        model="tiny", prompt="Hello world", max_tokens=24, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == base[:k]
    assert out.choices[0].finish_reason == "stop"
    text, finish, _ = stream_text(
        oai.completions.create(
            model="tiny",
            prompt="Hello world",
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
        )
    )
    assert (text, finish) == (base[:k], "stop")


def test_logprobs(oai):
    out = chat(
        oai,
        "Hello",
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for lp in content:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.logprob == pytest.approx(
            lp.top_logprobs[0].logprob, abs=1e-5
        )  # greedy takes the top one
    comp = oai.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2
    )
    lps = comp.choices[0].logprobs
    assert (
        len(lps.tokens)
        == len(lps.token_logprobs)
        == len(lps.text_offset)
        == comp.usage.completion_tokens
    )
    assert all(1 <= len(top) <= 2 for top in lps.top_logprobs)


def test_cached_tokens_on_repeated_prefix(oai):
    prompt = "Radix trees share prefixes between requests; schedulers batch them. " * 3
    first = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0
    )
    second = oai.completions.create(
        model="tiny", prompt=prompt + " More", max_tokens=2, temperature=0
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        >= first.usage.prompt_tokens - 1
    )


def test_api_key_is_enforced(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for path in ("/v1/models", "/get_server_info", "/metrics", "/health_generate"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(
        server.url + "/generate",
        json={"text": "hi"},
        headers={"Authorization": "Bearer nope"},
    )
    assert r.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


async def _stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    text = ""
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
    return text


def test_64_concurrent_streams_match_greedy(oai, server):
    expected = {
        p: oai.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    }

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(
                *(_stream_one(client, PROMPTS[i % len(PROMPTS)]) for i in range(64))
            )

    texts = asyncio.run(run())
    assert texts == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(64)]


GOOD_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}
BAD_INPUTS = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        None,
    ),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 10**12}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_completion_tokens": 100000},
        400,
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {**GOOD_CHAT, "n": 1000}, 400, "n"),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "top_logprobs": 50, "logprobs": True},
        400,
        "top_logprobs",
    ),
    ("/v1/chat/completions", {**GOOD_CHAT, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-4"}, 404, "model"),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "tools": [{"type": "function"}]},
        400,
        "tools[0]",
    ),  # no function
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "user", "content": "x " * 600}]},
        400,
        "messages",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi " * 40, "max_tokens": 500},
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": [10**9], "max_tokens": 2},
        400,
        None,
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "", "max_tokens": 2}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": {"x": 1}}, 400, "prompt"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stop_token_ids": [99999]},
        400,
        None,
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 600}},
        400,
        None,
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"temprature": 0}},
        400,
        "sampling_params.temprature",
    ),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    # typed conversion and bounds: each of these once hung a request, failed a batch or answered 500
    (
        "/generate",
        {"text": "hi", "sampling_params": {"logprobs": 1.5}},
        400,
        "logprobs",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"seed": "abc"}}, 400, "seed"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**64}}, 400, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 100000}}, 400, "top_k"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2**70}},
        400,
        "max_new_tokens",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [1]}}, 400, "stop"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"repetition_penalty": 1e-30}},
        400,
        "repetition_penalty",
    ),
    ("/generate", {"input_ids": [1, 2**70]}, 400, None),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "top_k": 2**63},
        400,
        "top_k",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * (MAX_BODY + 10)}, 413, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS)
def test_bad_input_gets_a_clear_error(server, path, body, status, param):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param, error
        assert (
            c.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 200
        )  # still serving
        assert (
            c.get("/get_server_info").json()["num_waiting_first_token"] == 0
        )  # nothing left queued


def test_oversized_body_without_content_length(server):
    def chunks():
        for _ in range(10):
            yield b" " * (MAX_BODY // 4)

    with server.client() as c:
        r = c.post(
            "/v1/completions",
            content=chunks(),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 413
        assert "max-request-bytes" in r.json()["error"]["message"]


def test_large_prompt_is_tokenized_off_the_event_loop_and_rejected_clearly(server):
    content = (
        "The quick brown fox jumps over the lazy dog. " * 2500
    )  # ~110 KB: tokenized on the worker thread
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={**GOOD_CHAT, "messages": [{"role": "user", "content": content}]},
        )
        assert (
            r.status_code == 400
            and r.json()["error"]["code"] == "context_length_exceeded"
        )
        assert "512" in r.json()["error"]["message"]
        r = c.post(
            "/v1/completions",
            json={
                "prompt": ["Hello", "World", "Hello"],
                "max_tokens": 3,
                "temperature": 0,
            },
        )
        choices = r.json()["choices"]  # a batch of prompts: one choice each, in order
        assert [ch["index"] for ch in choices] == [0, 1, 2] and choices[0][
            "text"
        ] == choices[2]["text"]
        assert c.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 200


def test_context_error_says_the_numbers(server):
    with server.client() as c:
        r = c.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 100000},
        )
    message = r.json()["error"]["message"]
    assert "100000" in message and "512" in message


def _wait_idle(server, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = server.info()
        kv = info["kv_cache"]
        idle = info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0
        if (
            idle
            and kv["free_pages"] + kv["evictable_cached_pages"] == kv["total_pages"]
        ):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not go idle: {info}")
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_kv(server):
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 480,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    # the tiny model writes 480 tokens in ~0.3 s: on a loaded machine the request can finish before
    # the disconnect reaches the engine, so a run that ends unaborted (its KV freed all the same) is
    # tried again; three in a row would mean disconnects are not acted on
    for _ in range(3):
        before = _wait_idle(server)["num_aborted_requests"]
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = [line for line, _ in zip(lines, range(4)) if line]
            assert received
        start = time.monotonic()
        info = _wait_idle(server)
        assert time.monotonic() - start < 10
        if info["num_aborted_requests"] == before + 1:
            return
        assert info["num_aborted_requests"] == before
    raise AssertionError(
        "three streams closed after 4 chunks all ran to completion: disconnects were not aborted"
    )


def test_non_stream_disconnect_aborts(server):
    """A client that leaves while its non-streamed request runs gets it aborted, every choice.

    The client leaves only once the engine runs the request: a client that times out before the
    server has even read its request leaves nothing to abort (a busy server may not have)."""
    before = _wait_idle(server)["num_aborted_requests"]
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 480,
            "n": 16,
            "ignore_eos": True,
        }
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while server.info()["num_running_reqs"] < 16:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
    info = _wait_idle(server)
    assert info["num_aborted_requests"] == before + 16


def test_logit_bias_steers_every_api_and_bad_ids_are_400s(server, oai):
    from transformers import AutoTokenizer

    vocab = json.loads((tiny_model_dir() / "config.json").read_text())["vocab_size"]
    greedy = {"max_new_tokens": 4, "temperature": 0}
    with server.client() as c:
        plain = c.post(
            "/generate", json={"text": "Hello", "sampling_params": greedy}
        ).json()
        forced = next(t for t in range(100, 200) if t not in plain["output_ids"])
        bias = {str(forced): 100}
        body = {"text": "Hello", "sampling_params": {**greedy, "logit_bias": bias}}
        native = c.post("/generate", json=body).json()
        assert native["output_ids"] == [forced] * 4
        # a bias of +100 makes greedy write that token whatever the prompt: the same text everywhere
        done = oai.completions.create(
            model="tiny", prompt="Hello", logit_bias=bias, max_tokens=4, temperature=0
        )
        assert done.choices[0].text == native["text"]
        answer = chat(oai, "Hi there", max_tokens=4, logit_bias=bias).choices[0].message
        assert answer.content == native["text"]
        # what `strata bench serving --length-control logit_bias` sends: -100 on the special tokens
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
        special = {
            str(t): -100 for t in {*tokenizer.all_special_ids, tokenizer.eos_token_id}
        }
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "logit_bias": special}
        assert c.post("/v1/completions", json=body).status_code == 200
        bad = [
            (
                {str(vocab): 5},
                f"token id {vocab}, which is outside the vocabulary [0, {vocab})",
            ),
            ({"-1": 5}, "token id -1"),
            ({"one": 5}, "'one' is not a token id"),
            ({"7": 100.5}, "token id 7 must be a number in [-100, 100], got 100.5"),
        ]
        completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        for path, good in [
            ("/v1/completions", completion),
            ("/v1/chat/completions", GOOD_CHAT),
        ]:
            for logit_bias, words in bad:
                r = c.post(path, json={**good, "logit_bias": logit_bias})
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == "logit_bias", r.text
                assert words in error["message"], r.text


def test_native_generate(server):
    with server.client() as c:
        r = c.post(
            "/generate",
            json={
                "text": "Hello",
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            },
        )
        out = r.json()
        assert r.status_code == 200
        meta = out["meta_info"]
        assert meta["completion_tokens"] == len(out["output_ids"]) <= 5
        assert (
            meta["finish_reason"]["type"] in ("stop", "length")
            and meta["e2e_latency"] > 0
        )
        ids = c.post(
            "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}},
        ).json()
        assert ids["meta_info"]["prompt_tokens"] == 3
        batch = c.post(
            "/generate",
            json={
                "text": ["Hello", "World"],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            },
        ).json()
        assert (
            isinstance(batch, list)
            and len(batch) == 2
            and batch[0]["text"] == out["text"][: len(batch[0]["text"])]
        )
        events = []
        body = {
            "text": "Hello",
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        }
        with c.stream("POST", "/generate", json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        assert (
            events[-1]["text"] == out["text"]
            and events[-1]["output_ids"] == out["output_ids"]
        )


def test_admin_endpoints(server):
    with server.client() as c:
        assert c.get("/health_generate").status_code == 200
        _wait_idle(server)
        r = c.post("/flush_cache")
        assert r.status_code == 200
        assert server.info()["kv_cache"]["cached_pages"] == 0
        body = {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        with c.stream("POST", "/v1/completions", json=body) as s:
            lines = (
                s.iter_lines()
            )  # keep it referenced: a dropped iterator closes the connection
            next(lines)
            busy = c.post("/flush_cache")
            assert (
                busy.status_code == 409
                and "in flight" in busy.json()["error"]["message"]
            )
        info = _wait_idle(server)
        assert (
            info["engine"]["context_len"] == 512
            and info["server_config"]["api_key"] == "<redacted>"
        )
        assert (
            info["engine"]["num_experts"] == 0 and info["expert_load"] is None
        )  # a dense model


def test_frontend_process_never_loads_torch(server, oai):
    chat(oai, "Hello")  # tokenized, detokenized and streamed by the frontend
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, "the HTTP frontend loaded torch"


def test_metrics_move_after_traffic(server, oai):
    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers=server.headers).text
        values = {}
        for line in text.splitlines():
            if line.startswith("strata:"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    before = scrape()
    oai.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape()
    for name in (
        "strata:num_requests_total",
        "strata:prompt_tokens_total",
        "strata:time_to_first_token_seconds_count",
        "strata:e2e_request_latency_seconds_count",
    ):
        assert after[name] > before[name], name
    assert (
        after["strata:generation_tokens_total"]
        == before["strata:generation_tokens_total"] + 5
    )
    assert (
        after["strata:inter_token_latency_seconds_count"]
        >= before["strata:inter_token_latency_seconds_count"] + 4
    )
    for gauge in (
        "strata:num_running_reqs",
        "strata:num_queue_reqs",
        "strata:token_usage",
        "strata:cache_hit_rate",
    ):
        assert gauge in after
    assert (
        "strata:moe_expert_tokens" not in after
    )  # a dense model has no experts to count


def test_server_info_reports_the_threads_each_size_of_step_ran_on(server):
    body = {
        "text": "Count: one, two",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    with server.client() as c:
        assert c.post("/generate", json=body).status_code == 200
        info = c.get("/get_server_info").json()
    assert info["server_config"]["engine_wait"] == "bounded"
    decode = info["step_threads"][
        "tokens 1"
    ]  # a CPU engine with --step-threads auto (the default)
    timed = {k for k in decode if k.startswith("us_per_token_")}
    if (
        len(os.sched_getaffinity(0)) > 1
    ):  # both options timed by the 8 decode steps, and one chosen
        assert timed == {
            "us_per_token_1t",
            f"us_per_token_{len(os.sched_getaffinity(0))}t",
        }, decode
        assert decode["threads"] in (1, len(os.sched_getaffinity(0)))
