"""The soak's load: a bounded number of clients, each sending one request after another, of mixed
kinds, and judging every answer.

Each request ends as exactly one outcome:

    answered    a valid answer (for a bad request: its 400 with a message)
    failed      a clear error: 4xx/5xx whose body says what went wrong, or a streamed error event
    cancelled   the client itself left on purpose (mid-stream disconnect, abort)
    lost        no answer (the connection dropped), or a wrong one: invalid JSON for a structured
                request, a missing tool call, a bad request that did not get its 400, an error
                without a message, a stream that ended without [DONE] or an error event
    hung        nothing complete within the request timeout
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from strata.bench.soak_config import LoadConfig

KINDS = (
    "chat",
    "completion",
    "chat_stream",
    "completion_stream",
    "structured",
    "tool_call",
    "n_choices",
    "disconnect",
    "abort",
    "too_long",
    "bad_type",
)
# how often each kind is drawn (relative)
WEIGHTS = {
    "chat": 4,
    "completion": 3,
    "chat_stream": 4,
    "completion_stream": 2,
    "structured": 2,
    "tool_call": 2,
    "n_choices": 2,
    "disconnect": 2,
    "abort": 2,
    "too_long": 1,
    "bad_type": 1,
}
OUTCOMES = ("answered", "failed", "cancelled", "lost", "hung")

COLORS = ["red", "green", "blue"]
CITIES = ["Paris", "Lima", "Oslo"]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": COLORS}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": CITIES}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
WORDS = [
    "river",
    "stone",
    "cloud",
    "paper",
    "garden",
    "engine",
    "silver",
    "window",
    "morning",
    "orange",
    "violin",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "signal",
    "forest",
    "candle",
    "bridge",
    "planet",
    "thunder",
    "marble",
    "pepper",
    "ticket",
]


@dataclass
class Record:
    kind: str
    target: str  # "dp" (the router over the replicas) or "pd"
    started: float  # monotonic seconds since the soak's start
    ended: float
    outcome: str
    status: int | None = None  # the HTTP status, if one came
    detail: str = ""


class Load:
    """`await load.run(stop)`: clients send until `stop` is set; `records` holds every finished request."""

    def __init__(
        self,
        config: LoadConfig,
        dp_url: str,
        pd_url: str,
        model: str,
        context_len: int,
        t0: float,
    ):
        self.config = config
        self.urls = {"dp": dp_url, "pd": pd_url}
        self.model = model
        self.context_len = context_len
        self.t0 = t0
        self.records: list[Record] = []
        self.in_flight = 0
        rng = random.Random(config.seed)
        words = min(
            config.shared_prefix_words, context_len // 16
        )  # a small model's prompts must still fit
        self.system_prompts = [" ".join(rng.choices(WORDS, k=words)) for _ in range(3)]

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=self.config.concurrency * 2)
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.request_timeout_s), limits=limits
        ) as http:
            await asyncio.gather(
                *(self._client(i, http, stop) for i in range(self.config.concurrency))
            )

    async def _client(
        self, index: int, http: httpx.AsyncClient, stop: asyncio.Event
    ) -> None:
        rng = random.Random(self.config.seed * 1000 + index + 1)
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        while not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            target = "pd" if rng.random() < self.config.pd_share else "dp"
            started = self.now()
            self.in_flight += 1
            try:
                outcome, status, detail = await self._one(
                    http, kind, self.urls[target], rng
                )
            finally:
                self.in_flight -= 1
            self.records.append(
                Record(kind, target, started, self.now(), outcome, status, detail[:300])
            )

    # ------------------------------------------------------------------ one request

    async def _one(
        self, http: httpx.AsyncClient, kind: str, base: str, rng: random.Random
    ) -> tuple[str, int | None, str]:
        path, body = self._request(kind, rng)
        stream = kind not in ("too_long", "bad_type") and body.get("stream") is True
        timeout = self.config.request_timeout_s
        try:
            if (
                kind == "abort"
            ):  # the client gives up before the answer: its connection closes
                try:
                    return await asyncio.wait_for(
                        self._post(http, base + path, body, kind), rng.uniform(0.2, 1.5)
                    )
                except asyncio.TimeoutError:
                    return "cancelled", None, "aborted by the client"
            if stream:
                return await asyncio.wait_for(
                    self._stream(http, base + path, body, kind), timeout
                )
            return await asyncio.wait_for(
                self._post(http, base + path, body, kind), timeout
            )
        except asyncio.TimeoutError:
            return "hung", None, f"no complete answer within {timeout:.0f}s"
        except httpx.TimeoutException as exc:
            return "hung", None, f"timed out: {type(exc).__name__}"
        except httpx.HTTPError as exc:
            return "lost", None, f"no answer: {type(exc).__name__}: {exc}"

    async def _post(
        self, http: httpx.AsyncClient, url: str, body: Any, kind: str
    ) -> tuple[str, int | None, str]:
        resp = await http.post(url, json=body)
        status = resp.status_code
        if kind in ("too_long", "bad_type"):
            if status == 400 and error_message(resp):
                return "answered", status, ""
            if status >= 500 and error_message(resp):
                return "failed", status, error_message(resp)
            return (
                "lost",
                status,
                f"a bad request got {status} instead of 400: {resp.text[:200]}",
            )
        if status != 200:
            message = error_message(resp)
            return (
                ("failed", status, message)
                if message
                else ("lost", status, f"{status} without a message: {resp.text[:200]}")
            )
        try:
            data = resp.json()
        except ValueError:
            return "lost", status, f"200 whose body is not JSON: {resp.text[:200]}"
        wrong = check_answer(kind, data)
        return ("lost", status, wrong) if wrong else ("answered", status, "")

    async def _stream(
        self, http: httpx.AsyncClient, url: str, body: dict, kind: str
    ) -> tuple[str, int | None, str]:
        async with http.stream("POST", url, json=body) as resp:
            status = resp.status_code
            if status != 200:
                await resp.aread()
                message = error_message(resp)
                return (
                    ("failed", status, message)
                    if message
                    else ("lost", status, f"{status} without a message")
                )
            finish = None
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    if finish is None:
                        return (
                            "lost",
                            status,
                            "the stream ended with [DONE] but no finish_reason",
                        )
                    return "answered", status, ""
                try:
                    event = json.loads(payload)
                except ValueError:
                    return (
                        "lost",
                        status,
                        f"a stream event that is not JSON: {payload[:200]}",
                    )
                if isinstance(event, dict) and "error" in event:
                    error = event["error"]
                    detail = error.get("message") if isinstance(error, dict) else error
                    return (
                        ("failed", status, str(detail))
                        if detail
                        else ("lost", status, "an empty error event")
                    )
                chunks += 1
                for choice in event.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                if kind == "disconnect" and chunks >= 2:
                    return "cancelled", status, "disconnected mid-stream"
            if kind == "disconnect" and finish is not None:
                return "answered", status, ""  # finished before the client could leave
            return "lost", status, "the stream ended without [DONE] or an error event"

    # ------------------------------------------------------------------ request bodies

    def _prompt(self, rng: random.Random) -> str:
        question = " ".join(rng.choices(WORDS, k=rng.randint(4, 16)))
        return (
            question
            if rng.random() < 0.5
            else f"{rng.choice(self.system_prompts)}\n{question}"
        )

    def _request(self, kind: str, rng: random.Random) -> tuple[str, Any]:
        cfg = self.config
        temperature = rng.choice([0.0, 0.8])
        max_tokens = rng.randint(max(1, cfg.max_tokens // 4), cfg.max_tokens)
        common = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        messages = [{"role": "user", "content": self._prompt(rng)}]
        if kind in ("chat", "chat_stream", "disconnect"):
            body = {**common, "messages": messages}
            if kind != "chat":
                body.update(stream=True, max_tokens=max(max_tokens, 8))
            return "/v1/chat/completions", body
        if kind in ("completion", "completion_stream"):
            return "/v1/completions", {
                **common,
                "prompt": self._prompt(rng),
                "stream": kind == "completion_stream",
            }
        if kind == "structured":
            fmt = {
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
            }
            return "/v1/chat/completions", {
                **common,
                "messages": messages,
                "response_format": fmt,
                "max_tokens": 64,
            }
        if kind == "tool_call":
            choice = {"type": "function", "function": {"name": "get_weather"}}
            return "/v1/chat/completions", {
                **common,
                "messages": messages,
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 128,
            }
        if kind == "n_choices":
            return "/v1/chat/completions", {
                **common,
                "messages": messages,
                "n": 3,
                "temperature": 0.8,
            }
        if kind == "abort":
            return "/v1/chat/completions", {
                **common,
                "messages": messages,
                "max_tokens": 4 * cfg.max_tokens,
            }
        if kind == "too_long":
            if rng.random() < 0.5:  # token ids: no tokenizing cost for the server
                return "/v1/completions", {
                    **common,
                    "prompt": [
                        rng.randint(10, 200) for _ in range(self.context_len + 8)
                    ],
                }
            words = " ".join(
                rng.choices(WORDS, k=self.context_len + 8)
            )  # each word is at least one token
            return "/v1/chat/completions", {
                **common,
                "messages": [{"role": "user", "content": words}],
            }
        if kind == "bad_type":
            bad: dict[str, Any] = rng.choice(
                [
                    {"max_tokens": "ten"},
                    {"temperature": "hot"},
                    {"messages": "hello"},
                    {"n": [2]},
                    {"stream": "yes"},
                    {"stop": 7},
                ]
            )
            return "/v1/chat/completions", {**common, "messages": messages, **bad}
        raise ValueError(kind)


def error_message(resp: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body ({"error": {"message"}}), or '' if there is none."""
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):
        return ""
    if isinstance(error, dict):
        return str(error.get("message") or "")
    return str(error or "")


def check_answer(kind: str, data: Any) -> str:
    """'' for a valid answer of this kind, else what is wrong with it."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        return f"no choices in the answer: {str(data)[:200]}"
    first = choices[0]
    if kind == "completion":
        return "" if isinstance(first.get("text"), str) else "a completion without text"
    if kind == "n_choices":
        indices = sorted(c.get("index") for c in choices)
        return (
            ""
            if indices == [0, 1, 2]
            else f"n=3 answered with choice indices {indices}"
        )
    message = first.get("message") or {}
    if first.get("finish_reason") == "length":
        return (
            ""  # cut off by its own max_tokens: partial output is the documented answer
        )
    if kind == "structured":
        try:
            value = json.loads(message.get("content") or "")
        except ValueError:
            return f"a structured answer is not JSON: {message.get('content')!r}"
        ok = (
            isinstance(value, dict)
            and set(value) == {"color", "ok"}
            and value["color"] in COLORS
        )
        return (
            ""
            if ok and isinstance(value["ok"], bool)
            else f"a structured answer breaks its schema: {value!r}"
        )
    if kind == "tool_call":
        calls = message.get("tool_calls") or []
        if not calls or calls[0].get("function", {}).get("name") != "get_weather":
            return f"a forced tool call is missing: {str(message)[:200]}"
        try:
            args = json.loads(calls[0]["function"].get("arguments") or "")
        except ValueError:
            return f"tool call arguments are not JSON: {calls[0]['function'].get('arguments')!r}"
        return (
            ""
            if isinstance(args, dict) and args.get("city") in CITIES
            else f"tool call arguments break the schema: {args!r}"
        )
    if first.get("finish_reason") not in ("stop", "length"):
        return f"finish_reason {first.get('finish_reason')!r}"
    return ""
