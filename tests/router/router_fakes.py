"""In-process HTTP servers for router tests: fake workers (tiny FastAPI apps) and a router, each
served by uvicorn in a thread on a free port."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from strata.ports import free_port
from strata.router.app import Gateway, create_app
from strata.router.config import RouterConfig


class ThreadServer:
    """uvicorn serving `app` in a daemon thread; stop() and start() again on the same port."""

    def __init__(self, app, port: int | None = None):
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> ThreadServer:
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=30,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)


@dataclass
class FakeState:
    """What a fake worker does; tests change it between requests."""

    name: str
    healthy: bool = True
    running: int = 0  # reported in /get_server_info
    queued: int = 0
    fail_next: int = 0  # answer this many generation requests with `fail_status`
    fail_status: int = 500
    delay_s: float = 0.0  # before answering a generation request
    chunk_delay_s: float = 0.0  # between SSE chunks
    num_chunks: int = 3
    api_key: str | None = None
    # {"path", "body", "headers"} of each generation request
    requests: list[dict] = field(default_factory=list)
    in_progress: int = 0
    max_in_progress: int = 0
    disconnected: int = 0  # streams the client left early

    def reset(self) -> None:
        fresh = FakeState(self.name)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(fresh, f.name))


def fake_worker_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def unauthorized(request: Request) -> Response | None:
        if (
            state.api_key
            and request.headers.get("authorization") != f"Bearer {state.api_key}"
        ):
            return Response(
                b'{"error": {"message": "invalid API key"}}',
                401,
                media_type="application/json",
            )
        return None

    @app.get("/health")
    async def health() -> Response:
        if state.healthy:
            return Response(b'{"status": "ok"}', media_type="application/json")
        return Response(
            b'{"error": {"message": "the model is still loading"}}',
            503,
            media_type="application/json",
        )

    @app.get("/get_server_info")
    async def info(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        body = {
            "model": "fake",
            "num_running_reqs": state.running,
            "num_queue_reqs": state.queued,
        }
        return Response(json.dumps(body), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(
            json.dumps(
                {"object": "list", "data": [{"id": "fake", "owned_by": state.name}]}
            ),
            media_type="application/json",
        )

    @app.post("/flush_cache")
    async def flush() -> Response:
        return Response(b'{"message": "flushed"}', media_type="application/json")

    async def generate(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        state.requests.append(
            {"path": request.url.path, "body": body, "headers": dict(request.headers)}
        )
        if state.fail_next > 0:
            state.fail_next -= 1
            return Response(
                json.dumps({"error": {"message": f"{state.name} failed on purpose"}}),
                state.fail_status,
                media_type="application/json",
                headers={"Retry-After": "7"},
            )
        state.in_progress += 1
        state.max_in_progress = max(state.max_in_progress, state.in_progress)
        try:
            await asyncio.sleep(state.delay_s)
        except asyncio.CancelledError:
            state.in_progress -= 1
            raise
        if not body.get("stream"):
            state.in_progress -= 1
            return Response(
                json.dumps({"worker": state.name, "echo": body}),
                media_type="application/json",
            )

        async def events():
            try:
                for i in range(state.num_chunks):
                    if i:
                        await asyncio.sleep(state.chunk_delay_s)
                    yield f"data: {json.dumps({'worker': state.name, 'i': i, 'sent_at': time.time()})}\n\n"
                yield "data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                state.disconnected += 1
                raise
            finally:
                state.in_progress -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.add_api_route(path, generate, methods=["POST"])
    return app


class FakeWorker(ThreadServer):
    def __init__(self, name: str, port: int | None = None):
        self.state = FakeState(name)
        super().__init__(fake_worker_app(self.state), port)


class RouterThread(ThreadServer):
    """A router (create_app over a Gateway) served in-process; `.gateway` for white-box checks."""

    def __init__(self, seed: int | None = 0, **config):
        config.setdefault("health_check_interval", 0.2)
        config.setdefault("load_poll_interval", 0.1)
        config.setdefault("retry_backoff", 0.01)
        self.config = RouterConfig(**config)
        self.gateway = Gateway(self.config, seed=seed)
        super().__init__(create_app(self.gateway))

    def client(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", 30)
        headers = (
            {"Authorization": f"Bearer {self.config.api_key}"}
            if self.config.api_key
            else {}
        )
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False, **kw)

    def workers(self) -> dict[str, dict]:
        with self.client() as c:
            return {
                w["url"]: w
                for w in c.get("/workers").raise_for_status().json()["workers"]
            }

    def wait_for(
        self, predicate, timeout: float = 10.0, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.workers()):
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {self.workers()}")
