"""PD disaggregation through live servers and the router: 1 prefill + 1 decode worker answer like a
single server; killing the prefill worker fails the affected requests clearly and leaks no slots."""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from live_server import LiveServer, free_port

pytestmark = pytest.mark.e2e

SECRET = ["--disaggregation-secret", "pd-test-secret"]
PROMPTS = [
    "The quick brown fox",
    "Radix trees share",
    "Hello world! This is",
    "Numbers 0123",
]


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def cluster():
    single = LiveServer()
    prefill = LiveServer("--disaggregation-mode", "prefill", *SECRET)
    decode = LiveServer(
        "--disaggregation-mode", "decode", "--disaggregation-timeout", "5", *SECRET
    )
    for s in (single, prefill, decode):
        s.wait_ready()
    port = free_port()
    router = subprocess.Popen(  # the router signs what it hands the workers with their shared secret
        [
            sys.executable,
            "-m",
            "strata.router",
            "--port",
            str(port),
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--health-check-interval",
            "0.5",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "STRATA_DISAGG_SECRET": SECRET[1]},
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    deadline = (
        time.monotonic() + 30
    )  # the router learns the prefill worker's KV address from its info
    while time.monotonic() < deadline:
        workers = httpx.get(url + "/get_server_info", timeout=5).json()
        if "bootstrap_addr" in str(workers):
            break
        time.sleep(0.2)
    yield single, prefill, decode, url
    router.terminate()
    router.wait(10)
    for s in (single, prefill, decode):
        s.close()


def complete(base: str, prompt: str, stream: bool = False) -> str:
    body = {"model": "x", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body["model"] = model
        if not stream:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        text += chunk["choices"][0].get("text", "")
        return text


def test_pd_answers_equal_a_single_server(cluster):
    single, _, decode, router = cluster
    expected = [complete(single.url, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(router, p), PROMPTS))
    assert got == expected
    assert complete(router, PROMPTS[0], stream=True) == expected[0]
    info = decode.info()
    assert info["disaggregation"]["mode"] == "decode"


def test_embeddings_through_the_pd_router_come_from_one_worker(cluster):
    single, _, decode, router = cluster
    model = httpx.get(router + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "input": "Radix trees share prefixes"}
    got = httpx.post(router + "/v1/embeddings", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.headers["x-strata-worker"] == decode.url  # no prefill side to pair
    want = httpx.post(single.url + "/v1/embeddings", json=body, timeout=60).json()
    assert got.json()["data"][0]["embedding"] == want["data"][0]["embedding"]


def test_direct_requests_to_a_disaggregated_worker_are_refused(cluster):
    _, _, decode, _ = cluster
    with decode.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post(
            "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4}
        )
    assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]


def test_bootstrap_fields_need_the_routers_signature(cluster):
    single, prefill, decode, _ = cluster
    room, addr = 12345, "127.0.0.1:1"
    bodies = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 4},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        },
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
    }
    for server, fields in (
        (decode, {"bootstrap_room": room, "bootstrap_addr": addr}),
        (prefill, {"bootstrap_room": room}),
    ):
        with server.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for path, body in bodies.items():
                raw = json.dumps({"model": model, **body, **fields}).encode()
                tampered = raw.replace(b'"hi"', b'"ho"')
                signed = sign(room, fields.get("bootstrap_addr"), raw)
                for content, headers in (
                    (raw, {}),
                    (raw, {"X-Strata-Bootstrap": "0" * 64}),
                    (tampered, {"X-Strata-Bootstrap": signed}),  # another prompt
                    (raw, {"X-Strata-Bootstrap": sign(room, "10.9.9.9:1", raw)}),
                ):
                    headers["content-type"] = "application/json"
                    r = c.post(path, content=content, headers=headers)
                    assert r.status_code == 403, (path, r.text)
                    assert "X-Strata-Bootstrap" in r.json()["error"]["message"]
    with (
        prefill.client() as c
    ):  # the router's signature over exactly this body is accepted
        body = {
            "text": "hi",
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_room": room,
        }
        raw = json.dumps(body).encode()
        headers = {
            "X-Strata-Bootstrap": sign(room, None, raw),
            "content-type": "application/json",
        }
        r = c.post("/generate", content=raw, headers=headers)
        assert r.status_code == 200, r.text
    with (
        single.client() as c
    ):  # not a disaggregated worker: the fields make no sense here
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post(
            "/v1/completions",
            json={"model": model, "prompt": "hi", "bootstrap_room": room},
        )
    assert r.status_code == 400 and "disaggregat" in r.json()["error"]["message"]
    assert decode.info()["disaggregation"]["mode"] == "decode"  # still serving


def sign(room: int, addr: str | None, body: bytes) -> str:
    """What the router sends as X-Strata-Bootstrap (strata.disagg.auth), spelled out independently."""
    signed = json.dumps(
        ["strata-bootstrap/1", room, addr, hashlib.sha256(body).hexdigest()],
        separators=(",", ":"),
    ).encode()
    return hmac.new(SECRET[1].encode(), signed, hashlib.sha256).hexdigest()


def test_a_request_the_decode_worker_refuses_gets_400_and_the_worker_keeps_serving(
    cluster,
):
    """n > 1 is refused by the decode side; its refusal once stayed registered and failed every later
    engine step until the decode worker gave up (found by `strata bench soak`)."""
    single, _, decode, router = cluster
    with httpx.Client(base_url=router, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "n": 3,
        }
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"], r.text
    time.sleep(1.0)  # several engine steps
    assert decode.health_status() == 200
    assert complete(router, PROMPTS[0]) == complete(single.url, PROMPTS[0])


def test_killing_the_prefill_worker_fails_clearly_without_leaks(cluster):
    _, prefill, decode, router = cluster
    total = decode.info()["kv_cache"]
    prefill.proc.kill()
    prefill.proc.wait()
    with httpx.Client(base_url=router, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post(
            "/v1/completions",
            json={"model": model, "prompt": "The quick brown fox", "max_tokens": 8},
        )
    assert r.status_code >= 500
    assert "prefill" in r.text or "worker" in r.text
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        kv = decode.info()["kv_cache"]
        if kv == total:
            break
        time.sleep(0.3)
    assert decode.info()["kv_cache"] == total  # no reserved slots left behind
