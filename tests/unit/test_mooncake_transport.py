"""The Mooncake KV transport between two workers on loopback (TCP, P2P handshake, no master): a KV
message arrives as the same frames the built-in path delivers and its payload is released once
acknowledged; a payload over the receiver's cap or from a peer that is gone is dropped, counted,
and later transfers still go through."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
from mooncake_master import skip_reason

from strata.disagg.transport import make_transport


@pytest.fixture
def pair():
    if skip_reason():
        pytest.skip(skip_reason())
    a = make_transport(
        "mooncake", "127.0.0.1", 0, max_payload_bytes=0
    )  # a prefill worker
    b = make_transport(
        "mooncake", "127.0.0.1", 0, max_payload_bytes=8 << 20
    )  # a decode worker
    yield a, b
    a.close()
    b.close()


def receive(transport, other, timeout_s: float = 10.0) -> list[bytes] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        frames = transport.recv()
        other.recv()  # the sender takes its acks
        if frames is not None:
            return frames
        time.sleep(0.002)
    return None


def test_kv_frames_arrive_whole_and_the_sender_releases_them(pair):
    a, b = pair
    payload = os.urandom(5 << 20)
    a.send(b.endpoint, [b"header", payload])
    assert len(a.staged) == 1 and a.stats["staged_bytes"] == len(payload)
    assert receive(b, a) == [b"header", payload]
    deadline = time.monotonic() + 5
    while a.staged and time.monotonic() < deadline:
        a.recv()
        time.sleep(0.002)
    assert not a.staged and a.stats["staged_bytes"] == 0
    a.send(b.endpoint, [b"hello only"])  # messages without a payload are plain ZMQ
    assert receive(b, a) == [b"hello only"]


def test_oversized_or_unreachable_payloads_are_dropped_and_later_ones_arrive(pair):
    a, b = pair
    a.send(
        b.endpoint, [b"too big", bytes(9 << 20)]
    )  # over the decode worker's 8 MiB cap
    assert receive(b, a, timeout_s=1.0) is None
    a.session = "127.0.0.1:9"  # a descriptor naming an engine that is not there
    a.send(b.endpoint, [b"lost", b"x" * 100])
    assert receive(b, a, timeout_s=5.0) is None and b.stats["pull_failures"] == 1
    pull = msgspec.msgpack.encode(
        {
            "session": "h:1",
            "address": -1,
            "length": 1,
            "ticket": "0" * 32,
            "ack_endpoint": "tcp://h:1",
        }
    )
    b.zmq.send(b.endpoint, [b"bad descriptor", b"strata-mooncake-pull/1", pull])
    assert receive(b, a, timeout_s=1.0) is None
    a.session = f"127.0.0.1:{a.engine.get_rpc_port()}"
    a.send(b.endpoint, [b"fine", b"y" * 1000])
    assert receive(b, a) == [b"fine", b"y" * 1000]


def test_the_flag_offers_the_registry_and_defaults_to_the_built_in_path():
    import argparse

    from strata.config import EngineConfig, add_engine_args, engine_config_from_args
    from strata.disagg.transport import TRANSFER_BACKENDS

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    action = next(
        a for a in parser._actions if a.dest == "disaggregation_transfer_backend"
    )
    assert list(action.choices) == list(TRANSFER_BACKENDS) == ["tcp", "mooncake"]
    assert (
        engine_config_from_args(parser.parse_args([])).disaggregation_transfer_backend
        == "tcp"
    )
    cfg = engine_config_from_args(
        parser.parse_args(["--disaggregation-transfer-backend", "mooncake"])
    )
    assert cfg.disaggregation_transfer_backend == "mooncake"
    with pytest.raises(
        ValueError, match="disaggregation_transfer_backend must be one of"
    ):
        EngineConfig(disaggregation_transfer_backend="nixl")
