"""Start-up, back-pressure and shutdown of `strata serve` (each test starts its own server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import LiveServer, pid_alive

pytestmark = pytest.mark.e2e


def test_health_is_503_until_ready_and_sigterm_lets_streams_finish():
    srv = LiveServer("--grace-period", "30")
    try:
        seen = srv.wait_ready()
        assert 503 in seen, f"/health never answered 503 while loading: {seen}"
        assert "ready at " + srv.url in srv.output()
        engine_pid = srv.info()["engine"]["pid"]
        assert pid_alive(engine_pid)

        body = {
            "prompt": "Hello",
            "max_tokens": 60,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        chunks: list[dict] = []
        with (
            httpx.Client(base_url=srv.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    break
            srv.proc.send_signal(
                signal.SIGTERM
            )  # the request in flight must still complete
            time.sleep(0.5)
            with pytest.raises(
                httpx.ConnectError
            ):  # no new connections during the grace period
                httpx.get(srv.url + "/health", timeout=2)
            done = False
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0
        deadline = time.monotonic() + 5
        while pid_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(engine_pid), "engine process outlived the server"
    finally:
        srv.close()


def test_queue_limit_answers_503_with_retry_after_and_grace_period_is_bounded():
    srv = LiveServer("--max-queued-requests", "2", "--grace-period", "1")
    try:
        srv.wait_ready()
        engine_pid = srv.info()["engine"]["pid"]
        body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}

        def post(_):
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(24) as pool:
            responses = list(pool.map(post, range(24)))
        codes = [r.status_code for r in responses]
        assert 200 in codes and 503 in codes, codes
        assert set(codes) <= {200, 503}
        rejected = next(r for r in responses if r.status_code == 503)
        assert (
            rejected.headers["Retry-After"]
            and "queue" in rejected.json()["error"]["message"]
        )
        assert (
            post(0).status_code == 200
        )  # once the queue drains, requests are accepted again

        # a stream that would run far longer than --grace-period 1 is cut off, and the server still exits
        long = {
            "prompt": "Hello",
            "max_tokens": 480,
            "stream": True,
            "ignore_eos": True,
        }
        got_first = threading.Event()

        def stream():
            try:
                with httpx.stream(
                    "POST", srv.url + "/v1/completions", json=long, timeout=60
                ) as r:
                    for _ in r.iter_lines():
                        got_first.set()
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=stream)
        t.start()
        assert got_first.wait(30)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0
        assert time.monotonic() - start < 12
        t.join(10)
        time.sleep(0.5)
        assert not pid_alive(engine_pid)
    finally:
        srv.close()


def test_engine_death_fails_requests_and_exits_the_server():
    srv = LiveServer()
    try:
        srv.wait_ready()
        engine_pid = srv.info()["engine"]["pid"]
        subprocess.run(["kill", "-9", str(engine_pid)], check=True)
        assert srv.proc.wait(20) == 1
    finally:
        srv.close()


def test_bad_flags_fail_fast_with_a_clear_message(tmp_path):
    run = [sys.executable, "-m", "strata.server", "--port", "0"]
    r = subprocess.run(
        [*run, "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "config.json" in r.stderr
    r = subprocess.run(
        [*run, "--page-size", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "page_size" in r.stderr


def test_health_says_503_while_the_engine_is_stopped_and_200_once_it_runs_again():
    srv = LiveServer("--health-stall-timeout", "1.5")
    try:
        srv.wait_ready()
        engine_pid = srv.info()["engine"]["pid"]
        time.sleep(4)  # idle for longer than the stall timeout: heartbeats keep it 200
        assert srv.health_status() == 200
        with ThreadPoolExecutor(1) as pool, srv.client() as c:
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                # a request sent while the engine is stopped waits; it is not lost
                pending = pool.submit(
                    c.post,
                    "/v1/completions",
                    json={"prompt": "hello", "max_tokens": 8, "temperature": 0},
                )
                stopped_at = time.monotonic()
                while srv.health_status() != 503:
                    assert time.monotonic() - stopped_at < 10, "/health stayed 200"
                    time.sleep(0.1)
                body = httpx.get(srv.url + "/health", timeout=2).json()
                assert "has not been heard from" in body["error"]["message"]
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            resumed_at = time.monotonic()
            while srv.health_status() != 200:
                assert time.monotonic() - resumed_at < 10, "/health stayed 503"
                time.sleep(0.1)
            r = pending.result(timeout=60)
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        srv.close()
