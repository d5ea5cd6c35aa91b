"""The router over fake workers (tiny FastAPI apps in threads): proxying, streaming, retries, the
circuit breaker, health, runtime membership, auth, load polling, metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_fakes import FakeWorker, RouterThread, free_port

from strata.router.prefix_tree import token_key
from strata.router.proxy import routing_key


@pytest.fixture(scope="module")
def fakes():
    workers = [FakeWorker(name).start() for name in ("a", "b", "c")]
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture(autouse=True)
def fresh_fakes(fakes):
    for w in fakes:
        w.state.reset()
        if not w.server.started or w.server.should_exit:  # a test stopped it
            w.start()
    yield


@pytest.fixture
def router_factory():
    routers = []

    def make(**config) -> RouterThread:
        r = RouterThread(**config).start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()


def complete(client: httpx.Client, prompt: str = "hello", **body) -> httpx.Response:
    return client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, **body}
    )


def test_proxies_the_api_and_says_which_worker_answered(fakes, router_factory):
    a = fakes[0]
    router = router_factory(worker_urls=(a.url,))
    with router.client() as c:
        for path, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        ]:
            resp = c.post(path, json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json() == {"worker": "a", "echo": body}
            assert resp.headers["x-strata-worker"] == a.url
        assert c.get("/v1/models").json()["data"][0]["id"] == "fake"
        assert [r["path"] for r in a.state.requests] == [
            "/v1/completions",
            "/v1/chat/completions",
            "/generate",
        ]
        assert c.get("/nope").status_code == 404
        assert "/v1/chat/completions" in c.get("/nope").json()["error"]["message"]
        wrong_method = c.get("/v1/completions")
        assert (
            wrong_method.status_code == 405
            and "Method Not Allowed" in wrong_method.json()["error"]["message"]
        )


def test_streaming_is_passed_through_chunk_by_chunk(fakes, router_factory):
    a = fakes[0]
    a.state.num_chunks, a.state.chunk_delay_s = 4, 0.4
    router = router_factory(worker_urls=(a.url,))
    arrivals = []
    with (
        router.client() as c,
        c.stream(
            "POST", "/v1/completions", json={"prompt": "x", "stream": True}
        ) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                arrivals.append((time.time(), json.loads(line[6:])))
            elif line == "data: [DONE]":
                arrivals.append((time.time(), None))
    assert [e["i"] for _, e in arrivals[:-1]] == [0, 1, 2, 3] and arrivals[-1][
        1
    ] is None
    for received, event in arrivals[:-1]:
        assert (
            received - event["sent_at"] < 0.3
        )  # each chunk arrives as it is sent, not at the end
    assert arrivals[-2][0] - arrivals[0][0] > 1.0


def test_a_failing_worker_is_retried_elsewhere_then_its_circuit_opens(
    fakes, router_factory
):
    a, b = fakes[0], fakes[1]
    a.state.fail_next = 1000
    router = router_factory(
        worker_urls=(a.url, b.url),
        policy="round_robin",
        breaker_failure_threshold=3,
        breaker_cooldown=0.5,
        health_check_interval=30,
    )
    with router.client() as c:
        for i in range(8):
            resp = complete(c, f"p{i}")
            assert resp.status_code == 200 and resp.json()["worker"] == "b"
    assert len(a.state.requests) == 3  # then its circuit opened and it got no more
    assert router.workers()[a.url]["status"] == "circuit_open"
    a.state.fail_next = 0
    time.sleep(0.6)  # cool-down over: one trial request may go there
    assert router.workers()[a.url]["status"] == "half_open"
    with router.client() as c:
        served = {complete(c, f"q{i}").json()["worker"] for i in range(6)}
    assert served == {"a", "b"}
    assert router.workers()[a.url]["status"] == "healthy"
    with router.client() as c:
        metrics = c.get("/metrics").text
    assert f'strata:router_retries_total{{worker="{a.url}"}} 3.0' in metrics
    assert (
        f'strata:router_request_errors_total{{kind="status_5xx",worker="{a.url}"}} 3.0'
        in metrics
    )


def test_503_is_retried_without_opening_the_circuit(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    a.state.fail_next, a.state.fail_status = 1000, 503
    router = router_factory(
        worker_urls=(a.url, b.url), policy="round_robin", breaker_failure_threshold=2
    )
    with router.client() as c:
        assert all(complete(c).json()["worker"] == "b" for _ in range(6))
    assert router.workers()[a.url]["status"] == "healthy"
    assert (
        len(a.state.requests) == 6
    )  # round robin keeps trying it first: 503 is overload, not breakage


def test_when_every_attempt_fails_the_client_gets_a_clear_error(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    a.state.fail_next = b.state.fail_next = 1000
    router = router_factory(worker_urls=(a.url, b.url), breaker_failure_threshold=100)
    with router.client() as c:
        resp = complete(c)
    assert resp.status_code == 500  # the last worker's own error, as it answered it
    assert "failed on purpose" in resp.json()["error"]["message"]
    assert len(a.state.requests) == len(b.state.requests) == 1  # each worker tried once


def test_a_dead_worker_loses_no_request_and_is_readmitted(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    router = router_factory(
        worker_urls=(a.url, b.url),
        policy="round_robin",
        health_check_interval=0.3,
        health_failure_threshold=2,
        breaker_failure_threshold=2,
    )
    a.stop()  # connection refused from now on
    with router.client() as c:
        for i in range(6):
            resp = complete(c, f"p{i}")
            assert resp.status_code == 200 and resp.json()["worker"] == "b"
    router.wait_for(
        lambda ws: ws[a.url]["status"] == "unhealthy",
        what="the dead worker to be ejected",
    )
    assert "GET /health" in router.workers()[a.url]["last_error"]
    a.start()
    router.wait_for(lambda ws: ws[a.url]["status"] == "healthy", what="re-admission")
    with router.client() as c:
        assert {complete(c, f"q{i}").json()["worker"] for i in range(4)} == {"a", "b"}


def test_no_healthy_worker_is_a_503_saying_why(fakes, router_factory):
    a = fakes[0]
    a.state.healthy = False
    router = router_factory(worker_urls=(a.url,))
    with router.client() as c:
        resp = complete(c)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        message = resp.json()["error"]["message"]
        assert (
            "no healthy workers" in message
            and a.url in message
            and "still loading" in message
        )
        assert c.get("/health").status_code == 503
    empty = router_factory()
    with empty.client() as c:
        resp = complete(c)
        assert (
            resp.status_code == 503
            and "POST /workers" in resp.json()["error"]["message"]
        )


def test_pd_health_needs_a_routable_worker_of_each_role(fakes, router_factory):
    decode, prefill = fakes[0], fakes[1]
    prefill.state.healthy = False
    router = router_factory(
        worker_urls=(decode.url,),
        prefill_urls=(prefill.url,),
        disaggregation_secret="s3cret",
    )

    def health(expected: int) -> httpx.Response:
        """GET /health until it answers `expected` (the health checks run every 0.2 s), or for 5 s."""
        deadline = time.monotonic() + 5
        with router.client() as c:
            while (
                resp := c.get("/health")
            ).status_code != expected and time.monotonic() < deadline:
                time.sleep(0.05)
        return resp

    resp = health(
        503
    )  # every worker was checked once before the router started serving
    message = resp.json()["error"]["message"]
    assert (
        resp.status_code == 503
        and "no routable prefill worker" in message
        and prefill.url in message
    )
    assert "decode" not in message
    prefill.state.healthy = True
    resp = health(200)
    assert resp.status_code == 200
    assert resp.json() == {
        "status": "ok",
        "routable_workers": 1,
        "routable_prefill_workers": 1,
    }
    decode.state.healthy = False
    resp = health(503)
    message = resp.json()["error"]["message"]
    assert (
        resp.status_code == 503
        and "no routable decode worker" in message
        and decode.url in message
    )
    assert "prefill" not in message


def test_workers_are_added_and_removed_at_runtime(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    router = router_factory(worker_urls=(a.url,), policy="round_robin")
    with router.client() as c:
        for bad, why in [
            ("localhost:8000", "http:// or https://"),
            (b.url + "/v1", "without a path"),
            ("http://", "no host"),
            ("http://host:notaport", "malformed"),
        ]:
            resp = c.post("/workers", json={"url": bad})
            assert resp.status_code == 400 and why in resp.json()["error"]["message"], (
                bad,
                resp.text,
            )
        assert c.post("/workers", json={}).status_code == 400
        added = c.post("/workers", json={"url": b.url + "/"})
        assert added.status_code == 200 and added.json()["status"] == "healthy"
        assert c.post("/workers", json={"url": b.url}).status_code == 409
        assert {complete(c, f"p{i}").json()["worker"] for i in range(4)} == {"a", "b"}
        assert c.request("DELETE", "/workers", json={"url": a.url}).status_code == 200
        assert c.delete("/workers", params={"url": a.url}).status_code == 404
        assert {complete(c, f"q{i}").json()["worker"] for i in range(4)} == {"b"}
        assert list(router.workers()) == [b.url]
        dead = f"http://127.0.0.1:{free_port()}"
        resp = c.post("/workers", json={"url": dead})
        assert (
            resp.status_code == 200 and resp.json()["status"] == "unhealthy"
        )  # admitted once it is up


def test_api_keys_for_the_router_and_for_the_workers(fakes, router_factory):
    a = fakes[0]
    a.state.api_key = "worker-secret"
    a.state.running = 7
    router = router_factory(
        worker_urls=(a.url,), api_key="router-secret", worker_api_key="worker-secret"
    )
    url = router.url
    assert httpx.get(url + "/health").status_code == 200  # no key needed
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    bad = httpx.post(
        url + "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer nope"},
    )
    assert (
        bad.status_code == 401 and bad.json()["error"]["message"] == "invalid API key"
    )
    assert httpx.get(url + "/workers").status_code == 401
    with router.client() as c:
        assert complete(c).status_code == 200
        assert (
            a.state.requests[-1]["headers"]["authorization"] == "Bearer worker-secret"
        )
        router.wait_for(
            lambda ws: ws[a.url]["reported_load"] == 7,
            what="the load poll (needs the worker key)",
        )
        info = c.get("/get_server_info").text
        assert (
            "<redacted>" in info
            and "router-secret" not in info
            and "worker-secret" not in info
        )


def test_load_comes_from_the_workers_so_two_routers_agree(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    r1 = router_factory(worker_urls=(a.url, b.url), policy="least_load")
    r2 = router_factory(worker_urls=(a.url, b.url), policy="power_of_two")
    a.state.running, a.state.queued = 30, 5  # e.g. traffic from other gateway replicas
    for r in (r1, r2):
        r.wait_for(
            lambda ws: ws[a.url]["load"] == 35 and ws[b.url]["load"] == 0,
            what="both routers to see it",
        )
        with r.client() as c:
            assert {complete(c).json()["worker"] for _ in range(5)} == {"b"}


def test_slow_requests_count_as_load_until_they_end(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    a.state.delay_s = b.state.delay_s = 1.0
    router = router_factory(
        worker_urls=(a.url, b.url), policy="least_load", load_poll_interval=30
    )
    results = []

    def send(i):
        with router.client() as c:
            results.append(complete(c, f"p{i}").json()["worker"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    loads = {u: w["in_flight"] for u, w in router.workers().items()}
    assert loads == {
        a.url: 4,
        b.url: 4,
    }  # spread by the router's own in-flight count between polls
    for t in threads:
        t.join()
    assert sorted(results) == ["a"] * 4 + ["b"] * 4
    assert all(w["in_flight"] == 0 for w in router.workers().values())


def test_a_client_leaving_mid_stream_closes_the_upstream(fakes, router_factory):
    a = fakes[0]
    a.state.num_chunks, a.state.chunk_delay_s = 50, 0.1
    router = router_factory(worker_urls=(a.url,))
    with (
        router.client() as c,
        c.stream(
            "POST", "/v1/completions", json={"prompt": "x", "stream": True}
        ) as resp,
    ):
        next(resp.iter_lines())
    router.wait_for(
        lambda ws: ws[a.url]["in_flight"] == 0, what="the router to drop the request"
    )
    deadline = time.monotonic() + 5
    while a.state.in_progress and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.state.in_progress == 0  # the worker saw the disconnect too


def test_cache_aware_keeps_conversations_on_one_worker_and_flush_resets(
    fakes, router_factory
):
    router = router_factory(
        worker_urls=tuple(f.url for f in fakes), policy="cache_aware"
    )
    placements: dict[int, set[str]] = {}
    with router.client() as c:
        for turn in range(4):
            for conv in range(6):
                system = f"You are assistant number {conv}. " + "Be brief. " * 20
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"turn {turn}"},
                ]
                resp = c.post("/v1/chat/completions", json={"messages": messages})
                placements.setdefault(conv, set()).add(resp.headers["x-strata-worker"])
        assert all(len(p) == 1 for p in placements.values()), placements
        assert (
            len({next(iter(p)) for p in placements.values()}) == 3
        )  # the 6 conversations spread out
        metrics = c.get("/metrics").text
        assert 'decision="prefix"' in metrics and 'decision="load"' in metrics
        assert any(w["prefix_tree_chars"] > 0 for w in router.workers().values())
        flushed = c.post("/flush_cache")
        assert flushed.status_code == 200 and set(flushed.json()["workers"]) == {
            f.url for f in fakes
        }
        assert all(w["prefix_tree_chars"] == 0 for w in router.workers().values())


def test_metrics_and_server_info(fakes, router_factory):
    a, b = fakes[0], fakes[1]
    a.state.running, b.state.queued = 2, 3
    router = router_factory(worker_urls=(a.url, b.url), policy="random")
    with router.client() as c:
        for _ in range(4):
            complete(c)
        router.wait_for(
            lambda ws: (
                ws[a.url]["reported_load"] == 2 and ws[b.url]["reported_load"] == 3
            )
        )
        text = c.get("/metrics").text
        info = c.get("/get_server_info").json()
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("strata:router_requests_total{")
        and 'route="/v1/completions"' in line
    )
    assert total == 4
    assert f'strata:router_worker_healthy{{worker="{a.url}"}} 1.0' in text
    assert (
        'strata:router_policy_decisions_total{decision="random",policy="random"' in text
    )
    assert "strata:router_time_to_first_byte_seconds_bucket" in text
    assert info["role"] == "router" and info["num_routable_workers"] == 2
    assert info["num_running_reqs"] == 2 and info["num_queue_reqs"] == 3


def test_request_body_limit(fakes, router_factory):
    router = router_factory(worker_urls=(fakes[0].url,), max_request_bytes=1024)
    with router.client() as c:
        resp = complete(c, "x" * 2000)
    assert (
        resp.status_code == 413
        and "--max-request-bytes" in resp.json()["error"]["message"]
    )
    assert fakes[0].state.requests == []


def test_routing_key_reads_each_api():
    chat = routing_key(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    longer = routing_key(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
            ]
        },
    )
    assert chat.text and longer.text.startswith(
        chat.text
    )  # a conversation's key extends its prefix
    assert routing_key("/v1/completions", {"prompt": "abc"}).text == "abc"
    assert routing_key("/v1/completions", {"prompt": ["abc", "d"]}).text == "abc"
    assert routing_key("/v1/completions", {"prompt": [5, 6]}).text == token_key([5, 6])
    assert routing_key("/v1/completions", {"prompt": [[5, 6], [7]]}).text == token_key(
        [5, 6]
    )
    assert routing_key("/generate", {"text": "t"}).text == "t"
    assert routing_key("/generate", {"input_ids": [1, 2]}).text == token_key([1, 2])
    for route, body in [
        ("/v1/completions", None),
        ("/v1/completions", {"prompt": 3}),
        ("/v1/chat/completions", {}),
    ]:
        assert routing_key(route, body).text is None


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["messages", "role", "content", "type", "text", "prompt", "input_ids"]
            )
            | st.text(max_size=4),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]),
    body=JSON,
)
def test_routing_key_is_total_over_any_json(route, body):
    """Found by the fuzz suite: a chat content part with "text": null took the router down (500)."""
    key = routing_key(route, body)
    assert key.text is None or isinstance(key.text, (str, list, tuple))
    routing_key(
        route,
        {"messages": [{"role": None, "content": [{"type": "", "text": None}, body]}]},
    )


def test_a_lone_worker_whose_circuit_opened_still_gets_requests(fakes, router_factory):
    """No other worker to fail over to: an open circuit must not refuse everything for its
    cool-down (a slow spell would become an outage); the healthy worker answers for itself."""
    a = fakes[0]
    a.state.fail_next = 3
    router = router_factory(
        worker_urls=(a.url,),
        breaker_failure_threshold=3,
        breaker_cooldown=60,
        max_retries=0,
        health_check_interval=30,
    )
    with router.client() as c:
        assert [complete(c, f"p{i}").status_code for i in range(3)] == [500] * 3
        assert router.workers()[a.url]["status"] == "circuit_open"
        assert c.get("/health").status_code == 200  # it is up; its circuit is open
        resp = complete(c, "after")  # routed anyway, and it answers now
        assert resp.status_code == 200 and resp.json()["worker"] == "a"
    assert router.workers()[a.url]["status"] == "healthy"
