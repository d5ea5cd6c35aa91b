"""The router over two live `strata serve` replicas (tiny model), started by `strata router --launch 2`.

One subprocess router launches the replicas (the CLI path); in-process routers with other policies
and faster health checks share them. Tests run in file order: the last one kills a replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from router_fakes import RouterThread, free_port

from strata.router.launcher import LocalReplica

pytestmark = pytest.mark.e2e

ENGINE_FLAGS = ["--dtype", "float32", "--num-threads", "1"]
POLICIES = ("round_robin", "random", "least_load", "power_of_two", "cache_aware")


class Cluster:
    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the router's log, closed in close()
            prefix="strata-router-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "strata.router",
            "--port",
            str(self.port),
            "--launch",
            "2",
            "--model",
            str(model_dir),
            *ENGINE_FLAGS,
            "--policy",
            "cache_aware",
            "--health-check-interval",
            "0.5",
            "--load-poll-interval",
            "0.2",
            "--log-level",
            "warning",
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.replacements: list[LocalReplica] = []

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited with {self.proc.returncode}:\n{self.output()}"
                )
            if "strata router: ready at" in self.output():
                return
            time.sleep(0.2)
        raise TimeoutError(f"router not ready after {timeout}s:\n{self.output()}")

    def workers(self) -> list[dict]:
        return (
            httpx.get(self.url + "/workers", timeout=10)
            .raise_for_status()
            .json()["workers"]
        )

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    assert self.proc.wait(60) == 0, self.output()
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    raise
        finally:
            for r in self.replacements:
                r.kill()
            self.log.close()
            os.unlink(self.log.name)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tiny_models import make_model  # tests/conftest.py

    c = Cluster(make_model(tmp_path_factory.mktemp("router") / "tiny-llama", "llama"))
    try:
        c.wait_ready()
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def replica_urls(cluster) -> list[str]:
    return [w["url"] for w in cluster.workers()]


@pytest.fixture
def router_factory():
    routers = []

    def make(urls, **config) -> RouterThread:
        r = RouterThread(worker_urls=tuple(urls), **config).start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()


def completion(
    base_url: str, prompt: str, max_tokens: int = 8, **extra
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def flush(url: str) -> None:
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200


def test_launch_starts_replicas_and_serves(cluster, replica_urls):
    workers = cluster.workers()
    assert len(workers) == 2 and all(
        w["launched"] and w["status"] == "healthy" for w in workers
    )
    assert "policy cache_aware, 2/2 workers healthy" in cluster.output()
    resp = httpx.get(cluster.url + "/get_server_info", timeout=10).json()
    assert resp["role"] == "router" and resp["num_routable_workers"] == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_answers_as_a_single_server_would(
    policy, replica_urls, router_factory
):
    router = router_factory(replica_urls, policy=policy)
    prompts = [f"The quick brown fox {i}" for i in range(6)]
    direct = [
        completion(replica_urls[0], p).json()["choices"][0]["text"] for p in prompts
    ]
    served_by = set()
    for prompt, expected in zip(prompts, direct):
        resp = completion(router.url, prompt)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected
        served_by.add(resp.headers["x-strata-worker"])
    assert served_by <= set(replica_urls)
    if policy == "round_robin":
        assert served_by == set(replica_urls)


def test_chat_generate_and_streaming_through_the_router(cluster, replica_urls):
    client = openai.OpenAI(
        base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60
    )
    messages = [{"role": "user", "content": "Hello world! This is"}]
    whole = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=12, temperature=0
    )
    pieces, usage = [], None
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        usage = chunk.usage or usage
        pieces.extend(c.delta.content or "" for c in chunk.choices)
    assert len([p for p in pieces if p]) > 1  # several chunks, not one buffered blob
    assert "".join(pieces) == whole.choices[0].message.content
    assert (
        usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    )
    native = httpx.post(
        cluster.url + "/generate",
        json={
            "text": "Radix trees",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
        timeout=60,
    )
    assert (
        native.status_code == 200
        and native.json()["meta_info"]["completion_tokens"] == 4
    )
    direct = httpx.post(
        replica_urls[1] + "/generate",
        json={
            "text": "Radix trees",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
        timeout=60,
    )
    assert native.json()["text"] == direct.json()["text"]


def test_embeddings_through_the_router(cluster, replica_urls):
    body = {"model": "tiny-llama", "input": ["Radix trees", "share prefixes"]}
    routed = httpx.post(cluster.url + "/v1/embeddings", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    worker = routed.headers["x-strata-worker"]
    assert worker in replica_urls
    direct = httpx.post(worker + "/v1/embeddings", json=body, timeout=60).json()
    assert [d["embedding"] for d in routed.json()["data"]] == [
        d["embedding"] for d in direct["data"]
    ]
    bad = httpx.post(cluster.url + "/v1/embeddings", json={"input": 3}, timeout=30)
    assert bad.status_code == 400 and "input" in bad.json()["error"]["message"]
    paths = httpx.get(cluster.url + "/openapi.json", timeout=30).json()["paths"]
    assert "/v1/embeddings" in paths and "/v1/responses" not in paths


def test_worker_errors_pass_through_unchanged(cluster):
    bad_json = httpx.post(
        cluster.url + "/v1/completions", content=b"{not json", timeout=30
    )
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    wrong_model = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": "nope", "prompt": "x"},
        timeout=30,
    )
    assert (
        wrong_model.status_code == 404
        and "nope" in wrong_model.json()["error"]["message"]
    )
    assert all(
        w["status"] == "healthy" for w in cluster.workers()
    )  # 4xx are not worker failures


def shared_prefix_workload(num_groups: int, per_group: int) -> list[str]:
    """Round-major order (group 0..G-1, then again): with G odd, round robin alternates each
    group's prompts between two workers."""
    words = [
        "alpha",
        "bravo",
        "charlie",
        "delta",
        "echo",
        "foxtrot",
        "golf",
        "hotel",
        "india",
        "juliet",
    ]
    systems = [
        f"[{g}] " + " ".join(words[(g + i) % len(words)] for i in range(40))
        for g in range(num_groups)
    ]
    return [
        f"{systems[g]} question {r}?"
        for r in range(per_group)
        for g in range(num_groups)
    ]


def hit_rate(router_url: str, prompts: list[str]) -> float:
    prompt_tokens = cached = 0
    for p in prompts:
        usage = (
            completion(router_url, p, max_tokens=2).raise_for_status().json()["usage"]
        )
        prompt_tokens += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    return cached / prompt_tokens


def test_cache_aware_beats_round_robin_on_shared_prefixes(replica_urls, router_factory):
    prompts = shared_prefix_workload(num_groups=7, per_group=3)
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        router = router_factory(replica_urls, policy=policy)
        flush(router.url)  # both replicas start cold
        rates[policy] = hit_rate(router.url, prompts)
        if policy == "cache_aware":
            assert all(
                w["prefix_tree_chars"] > 0 for w in router.workers().values()
            )  # groups spread
    # round robin: 1 of each group's 3 prompts hits; cache_aware: 2 of 3
    assert rates["cache_aware"] > rates["round_robin"] + 0.2, rates
    assert rates["cache_aware"] > 0.5, rates


def test_cache_aware_spreads_load_when_one_worker_is_flooded(
    replica_urls, router_factory
):
    router = router_factory(
        replica_urls,
        policy="cache_aware",
        balance_abs_threshold=4,
        load_poll_interval=0.1,
    )
    prefix = (
        "A shared system prompt for the hot tenant: " + "be concise and exact. " * 6
    )
    home = completion(router.url, prefix + "q0", max_tokens=2).headers[
        "x-strata-worker"
    ]
    other = next(u for u in replica_urls if u != home)
    assert (
        completion(router.url, prefix + "q1", max_tokens=2).headers["x-strata-worker"]
        == home
    )

    # someone else (another gateway replica, a direct client) floods `home`
    flood_body = {
        "prompt": "flood",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
    }
    stop = threading.Event()

    def flood():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                c.post(home + "/v1/completions", json=flood_body)

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    try:
        router.wait_for(
            lambda ws: ws[home]["load"] >= 8,
            timeout=30,
            what="the flood to show in the polled load",
        )
        served = [
            completion(router.url, prefix + f"q{i}", max_tokens=2).headers[
                "x-strata-worker"
            ]
            for i in range(2, 6)
        ]
        assert served.count(other) >= 3, (
            served
        )  # the prefix would say `home`; the load says otherwise
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    router.wait_for(
        lambda ws: ws[home]["load"] == 0, timeout=30, what="the flood to drain"
    )
    assert (
        completion(router.url, prefix + "q9", max_tokens=2).headers["x-strata-worker"]
        in replica_urls
    )
    with httpx.Client() as c:
        text = c.get(router.url + "/metrics").text
    assert 'decision="imbalance"' in text and 'decision="prefix"' in text


def test_killing_a_replica_under_load_loses_no_request(
    cluster, replica_urls, router_factory
):
    router = router_factory(
        replica_urls,
        policy="round_robin",
        health_check_interval=0.3,
        breaker_failure_threshold=2,
        max_retries=3,
    )
    victim, survivor = replica_urls
    # both admitted before the load starts: a victim whose first health check failed (a busy machine)
    # would get none of it until a later check admits it
    router.wait_for(
        lambda ws: all(w["status"] == "healthy" for w in ws.values()),
        what="both replicas",
    )
    info = httpx.get(victim + "/get_server_info", timeout=10).json()
    frontend_pid, engine_pid = info["frontend_pid"], info["engine"]["pid"]
    # long enough that the victim's half of the load is still running when the router is polled (the
    # tiny model writes 8 x 200 tokens in ~0.3 s, a window a busy machine's polls could miss)
    body = {
        "prompt": "Paged attention keeps",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    expected = httpx.post(survivor + "/v1/completions", json=body, timeout=60).json()[
        "choices"
    ][0]["text"]
    num_requests = 32

    def send(_):
        with httpx.Client(timeout=120) as c:
            return c.post(router.url + "/v1/completions", json=body)

    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(send, i) for i in range(num_requests)]
        router.wait_for(
            lambda ws: ws[victim]["in_flight"] >= 3,
            timeout=30,
            what="requests on the victim",
        )
        os.kill(frontend_pid, signal.SIGKILL)
        os.kill(engine_pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    failed = [r.text for r in results if r.status_code != 200]
    assert not failed, failed
    assert all(r.json()["choices"][0]["text"] == expected for r in results)
    router.wait_for(
        lambda ws: ws[victim]["status"] == "unhealthy",
        what="the dead replica to be ejected",
    )
    with httpx.Client() as c:
        metrics = c.get(router.url + "/metrics").text
    retried = next(
        line
        for line in metrics.splitlines()
        if line.startswith(f'strata:router_retries_total{{worker="{victim}"}}')
    )
    # the requests in flight on the victim were retried on the survivor
    assert float(retried.split()[-1]) >= 3

    # the replica comes back on the same port: re-admitted, by this router and the launching one
    port = int(victim.rsplit(":", 1)[1])
    replacement = LocalReplica(
        ["--model", str(cluster.model_dir), *ENGINE_FLAGS], port=port
    )
    cluster.replacements.append(replacement)
    replacement.start()
    replacement.wait_ready(120)
    router.wait_for(
        lambda ws: ws[victim]["status"] == "healthy", timeout=20, what="re-admission"
    )
    served = {
        completion(router.url, f"again {i}").headers["x-strata-worker"]
        for i in range(4)
    }
    assert served == {victim, survivor}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
        w["status"] == "healthy" for w in cluster.workers()
    ):
        time.sleep(0.2)
    assert all(w["status"] == "healthy" for w in cluster.workers()), json.dumps(
        cluster.workers()
    )
