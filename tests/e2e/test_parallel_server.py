"""`strata serve --tp-size 2`: serves, stops every rank on exit, and a worker rank that dies fails
the request in flight with an error and the health check (the server then exits, as on any engine
failure) instead of hanging; no process outlives the server."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from live_server import LiveServer, pid_alive

pytestmark = pytest.mark.e2e


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def test_tp2_server_answers_and_stops_every_rank():
    srv = LiveServer("--tp-size", "2")
    try:
        srv.wait_ready()
        engine_pid = srv.info()["engine"]["pid"]
        workers = children(engine_pid)
        assert len(workers) == 1  # rank 1; rank 0 is the engine process
        parallel = srv.info()["parallel"]
        assert (parallel["tp_size"], parallel["worker_pids"], parallel["healthy"]) == (
            2,
            workers,
            True,
        )
        with srv.client() as c:
            r = c.post(
                "/v1/completions",
                json={"prompt": "Hello", "max_tokens": 8, "temperature": 0},
            )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
            "length",
            "stop",
        )
        assert srv.stop() == 0
        assert wait_gone([engine_pid, *workers]) == []
    finally:
        srv.close()


def test_a_dead_worker_rank_fails_the_request_and_the_health_check():
    srv = LiveServer("--tp-size", "2", "--dist-timeout", "5")
    try:
        srv.wait_ready()
        engine_pid = srv.info()["engine"]["pid"]
        (worker,) = children(engine_pid)
        body = {
            "prompt": "Hello",
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        chunks: list[dict] = []
        start = time.monotonic()
        with (
            httpx.Client(base_url=srv.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    os.kill(worker, signal.SIGKILL)  # mid-generation
                    break
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        assert time.monotonic() - start < 30  # failed, not hung
        assert any("error" in chunk for chunk in chunks), chunks[-1]
        assert "rank" in json.dumps(chunks[-1])
        assert srv.health_status() != 200
        assert srv.proc.wait(30) == 1  # the server reports the failed engine and exits
        assert wait_gone([engine_pid, worker]) == []
    finally:
        srv.close()


def test_a_worker_rank_dying_while_idle_fails_the_health_check():
    srv = LiveServer("--tp-size", "2")
    try:
        srv.wait_ready()
        engine_pid = srv.info()["engine"]["pid"]
        (worker,) = children(engine_pid)
        os.kill(
            worker, signal.SIGKILL
        )  # no request in flight: the idle engine notices on its own
        deadline = time.monotonic() + 15
        while srv.health_status() == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.health_status() != 200
        assert srv.proc.wait(30) == 1
        assert "rank 1" in srv.output()
        assert wait_gone([engine_pid, worker]) == []
    finally:
        srv.close()


def test_expert_parallel_server_rebalances_between_steps(tmp_path):
    from tiny_models import make_model

    model = make_model(tmp_path / "mixtral", "mixtral")
    srv = LiveServer(
        "--ep-size",
        "2",
        "--ep-num-redundant-experts",
        "2",
        "--eplb-interval",
        "4",
        model_dir=model,
    )
    try:
        srv.wait_ready()
        with srv.client() as c:
            for i in range(3):
                r = c.post(
                    "/v1/completions",
                    json={"prompt": f"Hello {i}", "max_tokens": 6, "temperature": 0},
                )
                assert r.status_code == 200
        parallel = srv.info()["parallel"]
        assert parallel["ep_size"] == 2 and parallel["rebalances"] >= 1
        assert set(parallel["rank_load"]) == {
            "0",
            "1",
        }  # both MoE layers, rows per rank since the last placement
    finally:
        srv.close()
