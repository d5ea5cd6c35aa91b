"""Property-based fuzzing of `strata serve` and `strata router` from the outside, with requests drawn
by schemathesis from the servers' own OpenAPI documents (GET /openapi.json): bodies that fit the
schemas and bodies that break them, on every public endpoint.

Properties: no 5xx for any input; every request answers within a deadline; afterwards the server
still gives the same greedy answers as before, and reports zero leaked KV pages.

STRATA_FUZZ_EXAMPLES (default 20) sets the examples per endpoint and generation mode; the run is
deterministic (derandomized), so a failure reproduces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import LiveServer, free_port
from schemathesis import GenerationMode

from strata.server.openapi import openapi_document

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "20"))
DEADLINE_S = 60.0  # a tiny model answers any accepted request well within this
KEY = "fuzz-key"
GREEDY = {
    "text": "The quick brown fox",
    "sampling_params": {"max_new_tokens": 12, "temperature": 0},
}
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
CASES_RUN = {"server": 0, "router": 0}


def _operations(doc: dict) -> dict[str, object]:
    schema = schemathesis.openapi.from_dict(doc)
    return {
        f"{op.method.upper()} {op.path}": op
        for op in (r.ok() for r in schema.get_all_operations())
    }


SERVER_DOC = openapi_document("Strata", router=False, secured=True)
ROUTER_DOC = openapi_document("Strata router", router=True, secured=True)
SERVER_OPS = _operations(SERVER_DOC)
ROUTER_OPS = _operations(ROUTER_DOC)
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


def _fuzz(operation, mode: GenerationMode, base_url: str, kind: str) -> None:
    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        _check(case, base_url, kind)

    run()


def _check(case, base_url: str, kind: str) -> None:
    CASES_RUN[kind] += 1
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        response = case.call(base_url=base_url, headers=headers, timeout=DEADLINE_S)
    except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection fails the property
        pytest.fail(
            f"{case.method} {case.path} did not answer within {DEADLINE_S}s: {exc!r}\n{case.body!r}"
        )
    elapsed = time.monotonic() - started
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code} {response.text[:500]}\nbody: {case.body!r}"
    )
    assert elapsed < DEADLINE_S


def _greedy(url: str) -> list[int]:
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/generate", json=GREEDY, headers=headers, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _wait_idle_and_check_leaks(url: str) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 60
    while True:
        info = httpx.get(url + "/get_server_info", headers=headers, timeout=30).json()
        idle = (
            info["num_running_reqs"] == 0
            and info["num_queue_reqs"] == 0
            and info["num_waiting_first_token"] == 0
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, f"requests still in flight a minute after fuzzing: {info}"
    assert info["kv_cache"]["leaked_pages"] == 0, info["kv_cache"]
    return info


@pytest.fixture(scope="module")
def server():
    with LiveServer(
        "--context-length", "256", "--max-request-bytes", str(2**20), api_key=KEY
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(server) -> list[int]:
    return _greedy(server.url)


@pytest.fixture(scope="module")
def router(server, baseline):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the router's log, kept for the fixture's life
        prefix="strata-fuzz-router-", suffix=".log", delete=False
    )
    cmd = [
        sys.executable,
        "-m",
        "strata.router",
        "--port",
        str(port),
        "--worker-urls",
        server.url,
        "--log-level",
        "warning",
        "--health-check-interval",
        "0.5",
    ]
    env = {**os.environ, "STRATA_API_KEY": KEY, "STRATA_WORKER_API_KEY": KEY}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while _health(url) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, Path(
                log.name
            ).read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        os.unlink(log.name)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def test_served_documents_are_the_ones_fuzzed(server, router):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert (
        httpx.get(server.url + "/openapi.json", headers=headers, timeout=30).json()
        == SERVER_DOC
    )
    assert (
        httpx.get(router + "/openapi.json", headers=headers, timeout=30).json()
        == ROUTER_DOC
    )


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("label", list(SERVER_OPS))
def test_server_never_fails_or_hangs(label, mode, server, baseline):
    _fuzz(SERVER_OPS[label], mode, server.url, "server")


def test_server_is_intact_after_fuzzing(server, baseline):
    _wait_idle_and_check_leaks(server.url)
    assert _greedy(server.url) == baseline
    print(f"fuzz cases run against the server: {CASES_RUN['server']}")


# /workers changes the router's membership: fuzzed last, then the membership is restored
ROUTER_LABELS = sorted(ROUTER_OPS, key=lambda label: label.endswith("/workers"))


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("label", ROUTER_LABELS)
def test_router_never_fails_or_hangs(label, mode, router):
    _fuzz(ROUTER_OPS[label], mode, router, "router")


def test_router_and_server_are_intact_after_fuzzing(router, server, baseline):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(headers=headers, timeout=30) as c:
        for worker in c.get(router + "/workers").json()[
            "workers"
        ]:  # drop what the fuzzer registered
            if worker["url"] != server.url:
                c.request("DELETE", router + "/workers", json={"url": worker["url"]})
        if server.url not in [
            w["url"] for w in c.get(router + "/workers").json()["workers"]
        ]:
            assert (
                c.post(router + "/workers", json={"url": server.url}).status_code == 200
            )
    deadline = time.monotonic() + 30
    while _health(router) != 200:
        assert time.monotonic() < deadline, "the router did not recover its worker"
        time.sleep(0.2)
    assert _greedy(router) == baseline
    _wait_idle_and_check_leaks(server.url)
    print(f"fuzz cases run against the router: {CASES_RUN['router']}")
