"""The Mooncake L3 backend against a real `mooncake_master` on loopback (TCP, no RDMA): pages of any
size round-trip, replicas see each other's pages, a removed page is a miss, an oversized page fails
alone, and a dead or absent master is a clear StorageError within the timeout, never a hang."""

from __future__ import annotations

import os
import time

import pytest

from strata.cache.storage import StorageError, make_storage_backend
from strata.cache.storage.mooncake import mooncake_config


def key(i: int) -> str:
    return f"strata-kv-{i:064x}"


def backend(url: str, timeout_s: float = 2.0, **query):
    params = "&".join(
        f"{k}={v}" for k, v in ({"global_segment_size": 64 << 20} | query).items()
    )
    store = make_storage_backend("mooncake", f"{url}?{params}", max_bytes=1, ttl_s=None)
    store.timeout_s = timeout_s
    return store


def test_pages_round_trip_and_are_shared_between_clients(mooncake_master):
    a, b = backend(mooncake_master.url), backend(mooncake_master.url)
    try:
        pages = [
            (key(i), os.urandom(size))
            for i, size in enumerate([1, 2128, 1 << 20, 3 << 20])
        ]
        a.set(pages)
        assert a.exists([k for k, _ in pages] + [key(99)]) == [True] * 4 + [False]
        assert b.get([k for k, _ in pages] + [key(99)]) == [v for _, v in pages] + [
            None
        ]  # another replica
        a.set(
            pages[:1]
        )  # a page written again (another replica computed it too) is no error
        a.delete([key(1)])  # gone: a miss for everyone, never an error
        assert b.exists([key(0), key(1)]) == [True, False] and b.get([key(1)]) == [None]
        assert a.exists([]) == [] and a.get([]) == []
    finally:
        a.close()
        b.close()


def test_a_page_larger_than_the_store_fails_alone(mooncake_master):
    store = backend(mooncake_master.url, global_segment_size=16 << 20)
    try:
        with pytest.raises(StorageError, match="mooncake put"):
            store.set([(key(1), bytes(32 << 20))])
        store.set([(key(2), b"fits")])
        assert store.get([key(1), key(2)]) == [None, b"fits"]
    finally:
        store.close()


def test_a_dead_master_is_a_clear_error_within_the_timeout(mooncake_master):
    store = backend(mooncake_master.url, timeout_s=2.0)
    try:
        store.set([(key(0), b"page")])
        mooncake_master.kill()
        for call in (
            lambda: store.exists([key(0)]),
            lambda: store.get([key(0)]),
            lambda: store.set([(key(1), b"x")]),
        ):
            start = time.monotonic()
            try:
                call()  # may still answer from what this client holds ...
            except StorageError as exc:  # ... or fail, naming the master
                assert mooncake_master.address in str(exc) or "mooncake" in str(exc)
            assert time.monotonic() - start < 2.0 + 1.0
    finally:
        store.close()


def test_an_absent_master_fails_each_call_clearly(tmp_path):
    from mooncake_master import free_port, skip_reason

    if skip_reason():
        pytest.skip(skip_reason())
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    store = backend(f"mooncake://{address}")
    store.connect_timeout_s = 10.0
    try:
        start = time.monotonic()
        with pytest.raises(StorageError, match=address):
            store.exists([key(0)])
        assert time.monotonic() - start < 10.0 + 1.0
    finally:
        store.close()


def test_config_from_a_url_or_a_file(tmp_path):
    cfg = mooncake_config(
        "mooncake://10.0.0.7:50051?local_hostname=10.0.0.8&global_segment_size=1073741824"
    )
    assert (
        cfg["master_server_address"] == "10.0.0.7:50051"
        and cfg["local_hostname"] == "10.0.0.8"
    )
    assert (
        cfg["global_segment_size"] == 1 << 30
        and cfg["metadata_server"] == "P2PHANDSHAKE"
    )
    path = tmp_path / "mooncake.json"
    path.write_text(
        '{"master_server_address": "m:1", "protocol": "rdma", "device_name": "mlx5_0"}'
    )
    assert mooncake_config(str(path))["protocol"] == "rdma"
    for bad, why in [
        ("mooncake://nohost", "HOST:PORT"),
        ("mooncake://h:1?sgement=1", "unknown"),
        ("mooncake://h:1?global_segment_size=4096", "at least"),
        (str(tmp_path / "missing.json"), "cannot read"),
    ]:
        with pytest.raises(ValueError, match=why):
            mooncake_config(bad)
