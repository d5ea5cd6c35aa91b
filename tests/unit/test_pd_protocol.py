"""PD disaggregation's trust boundaries, without a model: the router signs the bootstrap fields it
hands to workers (and draws rooms nobody can predict), the KV inbox caps what it reads before any
MAC is checked, and the wire messages refuse malformed fields instead of raising later."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import msgspec
import pytest
import zmq

from strata.disagg import auth, protocol
from strata.disagg.transport import ZmqTransport

SECRET = b"router-and-workers"


# --------------------------------------------------------------------------- router → worker


def test_bootstrap_signature_binds_room_addr_and_body():
    body = b'{"prompt": "hi", "bootstrap_room": 7, "bootstrap_addr": "10.0.0.1:5000"}'
    sig = auth.sign_bootstrap(SECRET, 7, "10.0.0.1:5000", body)
    assert auth.verify_bootstrap(SECRET, 7, "10.0.0.1:5000", body, sig)
    assert not auth.verify_bootstrap(
        SECRET, 8, "10.0.0.1:5000", body, sig
    )  # another room
    assert not auth.verify_bootstrap(
        SECRET, 7, "evil:5000", body, sig
    )  # another KV address
    other_prompt = body.replace(b"hi", b"ho")
    assert not auth.verify_bootstrap(SECRET, 7, "10.0.0.1:5000", other_prompt, sig)
    assert not auth.verify_bootstrap(b"other secret", 7, "10.0.0.1:5000", body, sig)
    assert not auth.verify_bootstrap(
        None, 7, "10.0.0.1:5000", body, sig
    )  # a worker without a secret
    for bad in (None, "", "é" * 64, sig.upper(), sig[:-1]):
        assert not auth.verify_bootstrap(SECRET, 7, "10.0.0.1:5000", body, bad)
    for room in (-1, 2**63):  # not a room, even when signed
        signed = auth.sign_bootstrap(SECRET, room, None, body)
        assert not auth.verify_bootstrap(SECRET, room, None, body, signed)


def _pd_attempt(
    seed: int, client_headers: list[tuple[bytes, bytes]]
) -> list[httpx.Request]:
    """One PD attempt through PDProxyResponse over mocked workers; returns the requests they got."""
    from strata.router.config import RouterConfig
    from strata.router.metrics import RouterMetrics
    from strata.router.pd import PDProxyResponse
    from strata.router.pool import WorkerPool
    from strata.router.proxy import Forwarder, routing_key
    from strata.router.registry import POLICIES
    from strata.router.worker import CircuitBreaker, Health, Worker

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"text": "ok"})

    async def run() -> None:
        cfg = RouterConfig(
            worker_urls=("http://decode:1",),
            prefill_urls=("http://prefill:1",),
            disaggregation_secret=SECRET.decode(),
        )
        rng = random.Random(seed)
        policy = POLICIES["round_robin"](cfg, rng)
        metrics = RouterMetrics()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            pools = {}
            for url in ("http://decode:1", "http://prefill:1"):
                pools[url] = WorkerPool(cfg, policy, metrics, client)
                pools[url].workers[url] = Worker(
                    url, CircuitBreaker(3, 10.0), health=Health.HEALTHY
                )
            pools["http://prefill:1"].server_info["http://prefill:1"] = {
                "bootstrap_addr": "10.0.0.9:7000"
            }
            fwd = Forwarder(cfg, pools["http://decode:1"], policy, metrics, client, rng)
            body = json.dumps(
                {"model": "m", "prompt": "hello", "max_tokens": 3}
            ).encode()
            resp = PDProxyResponse(
                fwd,
                prefill_pool=pools["http://prefill:1"],
                prefill_policy=policy,
                route="/v1/completions",
                method="POST",
                path="/v1/completions",
                body=body,
                headers=client_headers,
                key=routing_key("/v1/completions", json.loads(body)),
                arrived=time.perf_counter(),
            )
            sent = []

            async def send(message) -> None:
                sent.append(message)

            assert (
                await resp._attempt(
                    pools["http://decode:1"].workers["http://decode:1"], send
                )
                is None
            )
            assert sent[0]["status"] == 200

    asyncio.run(run())
    return seen


def test_router_signs_what_it_hands_each_worker_and_strips_forged_signatures():
    forged = [
        (b"x-strata-bootstrap", b"0" * 64),
        (b"content-type", b"application/json"),
    ]
    seen = _pd_attempt(0, forged)
    assert len(seen) == 2
    by_host = {r.url.host: r for r in seen}
    for host, addr in (("prefill", None), ("decode", "10.0.0.9:7000")):
        request = by_host[host]
        body = json.loads(request.content)
        assert body.get("bootstrap_addr") == addr
        signatures = request.headers.get_list(auth.HEADER)
        assert (
            len(signatures) == 1 and signatures[0] != "0" * 64
        )  # the client's header never passes
        assert auth.verify_bootstrap(
            SECRET, body["bootstrap_room"], addr, request.content, signatures[0]
        )
    rooms = {json.loads(r.content)["bootstrap_room"] for r in seen}
    assert len(rooms) == 1  # both workers got the same room


def test_rooms_do_not_follow_the_routers_seeded_rng():
    rooms = [
        json.loads(_pd_attempt(42, [])[0].content)["bootstrap_room"] for _ in range(2)
    ]
    assert rooms[0] != rooms[1]  # random.Random(42) twice would give the same room


def test_pd_router_needs_the_shared_secret(monkeypatch):
    from strata.redact import REDACTED, redacted
    from strata.router.config import RouterConfig

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="disaggregation-secret"):
        RouterConfig(worker_urls=("http://d:1",), prefill_urls=("http://p:1",))
    RouterConfig(worker_urls=("http://d:1",))  # no prefill workers: no secret needed
    monkeypatch.setenv(auth.SECRET_ENV, "from-env")
    RouterConfig(worker_urls=("http://d:1",), prefill_urls=("http://p:1",))
    shown = redacted(
        RouterConfig(worker_urls=("http://d:1",), disaggregation_secret="hush")
    )
    assert (
        shown["disaggregation_secret"] == REDACTED
    )  # never in the router's /get_server_info


# --------------------------------------------------------------------------- worker ↔ worker messages


def _hello(**kw) -> protocol.Hello:
    fields = {
        "room": 5,
        "kv_endpoint": "tcp://127.0.0.1:4000",
        "prompt_len": 3,
        "namespace": "ab",
        "prompt_digest": protocol.prompt_digest([1, 2, 3]),
        "nonce": protocol.new_nonce(),
    }
    return protocol.Hello(**{**fields, **kw})


def test_signed_messages_round_trip_and_any_change_breaks_the_mac():
    hello = protocol.sign(_hello(), SECRET)
    got = protocol.decode(protocol.encode(hello))
    assert got == hello and protocol.verify(got, SECRET)
    for change in (
        {"room": 6},
        {"prompt_len": 4},
        {"nonce": protocol.new_nonce()},
        {"prompt_digest": protocol.prompt_digest([1, 2, 4])},
        {"kv_endpoint": "tcp://1.2.3.4:1"},
    ):
        assert not protocol.verify(msgspec.structs.replace(got, **change), SECRET)
    assert not protocol.verify(got, b"another secret")
    # a float that JSON would write as null (so the MAC did not cover it) is signed as itself
    kv = protocol.KVHeader(5, got.nonce, 3, 1, None, "float32", [1, 2, 3, 1, 4])
    kv = protocol.sign(kv, SECRET, b"x" * 48)
    assert not protocol.verify(
        msgspec.structs.replace(kv, first_logprob=float("nan")), SECRET, b"x" * 48
    )
    assert not protocol.verify(kv, SECRET, b"y" * 48)


def test_verify_never_raises_on_a_hostile_mac():
    for mac in ("é" * 64, "", "0" * 10_000, "\x00"):
        msg = _hello()
        msg.mac = mac
        assert protocol.verify(msg, SECRET) is False


@pytest.mark.parametrize(
    "change",
    [
        {"room": -1},
        {"room": 2**63},
        {"prompt_len": 0},
        {"kv_endpoint": "ipc:///tmp/x"},
        {"kv_endpoint": "tcp://" + "a" * 400 + ":1"},
        {"nonce": "xyz"},
        {"prompt_digest": "00"},
        {"namespace": "not hex"},
        {"mac": "é"},
    ],
)
def test_malformed_fields_do_not_decode(change):
    fields = msgspec.structs.asdict(protocol.sign(_hello(), SECRET))
    raw = msgspec.msgpack.encode({**fields, "type": "hello", **change})
    with pytest.raises(msgspec.ValidationError):
        protocol.decode(raw)


def test_failure_reasons_are_capped():
    reason = protocol.failure_reason("x" * 100_000)
    assert len(reason) <= protocol.MAX_REASON_CHARS
    raw = msgspec.msgpack.encode(
        {"type": "failed", "room": 1, "nonce": "0" * 32, "reason": "x" * 100_000}
    )
    with pytest.raises(msgspec.ValidationError):
        protocol.decode(raw)


# --------------------------------------------------------------------------- the KV inbox


def test_inbox_drops_oversized_frames_and_truncates_long_messages():
    inbox = ZmqTransport(max_payload_bytes=1 << 16)
    ctx = zmq.Context.instance()
    big, ok = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    try:
        for s in (big, ok):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(inbox.endpoint)
        big.send_multipart(
            [b"h", b"x" * (inbox.max_frame_bytes + 1)]
        )  # over the cap: never read
        ok.send_multipart(
            [b"h"] * 50
        )  # too many frames: read, but only the first few are kept
        ok.send_multipart(
            [b"hello", b"y" * (1 << 16)]
        )  # the largest legitimate payload still arrives
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            frames = inbox.recv()
            if frames is None:
                time.sleep(0.01)
            else:
                got.append(frames)
        assert got[0] == [b"h"] * (protocol.MAX_FRAMES + 1)
        assert got[1] == [b"hello", b"y" * (1 << 16)]
        time.sleep(0.1)
        assert inbox.recv() is None  # the oversized message never showed up
    finally:
        big.close(0)
        ok.close(0)
        inbox.close()


def test_a_bad_peer_address_does_not_raise():
    t = ZmqTransport()
    try:
        t.send(
            "tcp://no port here", [b"x"]
        )  # dropped: the room times out on the other side
        t.send("garbage", [b"x"])
    finally:
        t.close()


def test_invalid_utf8_is_a_decode_error():
    raw = msgspec.msgpack.encode(
        {"type": "failed", "room": 1, "nonce": "0" * 32, "reason": "é"}
    )
    raw = raw.replace("é".encode(), b"\xc3)")
    with pytest.raises(msgspec.DecodeError):
        protocol.decode(raw)
