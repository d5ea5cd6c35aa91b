"""A tiny fake OpenAI-compatible server for the serving-benchmark tests.

It streams `max_tokens` fake tokens ("tok0 tok1 ...") on /v1/completions and
/v1/chat/completions, with a configurable delay per token, optional usage, and injected failures:
`fail_every=k` answers every k-th request with HTTP 500, `error_every=k` sends an error event
mid-stream on every k-th request. It simulates a prefix cache (cached tokens = the longest
word-prefix shared with an earlier prompt) and exposes /get_server_info and /metrics like Strata.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import (
    FastAPI,
    Request,
)  # module level: FastAPI resolves the string annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from strata.ports import free_port


@dataclass
class FakeState:
    token_delay_s: float = 0.002
    fail_every: int = 0
    error_every: int = 0
    include_usage: bool = True
    count: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    prompts: list[list[str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, int, float]] = field(
        default_factory=list
    )  # (start|end, request number, time)
    prompt_total: int = 0
    cached_total: int = 0


def _words(body: dict[str, Any]) -> list[str]:
    if "messages" in body:
        return " ".join(
            f"{m['role']}: {m['content']}" for m in body["messages"]
        ).split()
    prompt = body.get("prompt", "")
    return [str(t) for t in prompt] if isinstance(prompt, list) else str(prompt).split()


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_fake_app(state: FakeState):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/get_server_info")
    async def info():
        rate = state.cached_total / state.prompt_total if state.prompt_total else 0.0
        return {
            "cache_hit_rate": rate,
            "frontend_pid": os.getpid(),
        }  # it serves from the test's process

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            f"# TYPE fake:prompt_tokens_total counter\nfake:prompt_tokens_total {state.prompt_total}\n"
            f"fake:cached_tokens_total {state.cached_total}\n"
        )

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state.count += 1
        number = state.count
        state.bodies.append(body)
        if state.fail_every and number % state.fail_every == 0:
            return JSONResponse(
                {"error": {"message": "injected failure"}}, status_code=500
            )
        words = _words(body)
        cached = max((_common_prefix(words, p) for p in state.prompts), default=0)
        state.prompts.append(words)
        state.prompt_total += len(words)
        state.cached_total += cached
        n = int(body.get("max_tokens", 16))

        def chunk(text: str | None, finish: str | None = None, usage=None) -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": text or "", "finish_reason": finish}]
            obj: dict[str, Any] = {
                "id": f"r{number}",
                "choices": [] if usage else choices,
            }
            if usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n".encode()

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            state.events.append(("start", number, time.perf_counter()))
            try:
                if chat:
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n".encode()
                for i in range(n):
                    await asyncio.sleep(state.token_delay_s)
                    if state.error_every and number % state.error_every == 0 and i == 2:
                        yield b'data: {"error": {"message": "injected stream error"}}\n\n'
                        yield b"data: [DONE]\n\n"
                        return
                    yield chunk(f"tok{i} ", "length" if i == n - 1 else None)
                if state.include_usage and (body.get("stream_options") or {}).get(
                    "include_usage"
                ):
                    usage = {
                        "prompt_tokens": len(words),
                        "completion_tokens": n,
                        "total_tokens": len(words) + n,
                        "prompt_tokens_details": {"cached_tokens": cached},
                    }
                    yield chunk(None, usage=usage)
                yield b"data: [DONE]\n\n"
            finally:
                state.in_flight -= 1
                state.events.append(("end", number, time.perf_counter()))

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    def __init__(self):
        import uvicorn

        self.state = FakeState()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            make_fake_app(self.state),
            host="127.0.0.1",
            port=self.port,
            log_level="error",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def reset(self, **changes) -> FakeState:
        self.state.__init__(**changes)  # type: ignore[misc]
        return self.state

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(llama_dir):
    from strata.tokenizer import load_tokenizer

    return load_tokenizer(llama_dir)
