"""L3 storage without a model: backends stay within their size and age bounds (also when replicas
share them and delete under each other), any damage to a stored page is a miss and never a wrong
page, and the auto prefetch policy waits exactly while fetching beats recomputing."""

from __future__ import annotations

import argparse
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from strata.cache.allocator import PageAllocator
from strata.cache.hicache import HiCache, HiCacheConfig
from strata.cache.kv_pool import MHAKVPool
from strata.cache.pages import CorruptPage, decode_page, encode_page
from strata.cache.prefetch import RateMeter, auto_prefetch_wait_s
from strata.cache.radix import CacheTiers, PrefixCache, RadixCache
from strata.cache.storage import make_storage_backend
from strata.cache.storage.file import FileStorage
from strata.config import add_engine_args, engine_config_from_args


def key(i: int) -> str:
    return f"strata-kv-{i:064x}"


def page_files(root: Path) -> list[Path]:
    return list(root.rglob("strata-kv-*"))


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in page_files(root))


# --------------------------------------------------------------------------- bounds: file


def test_file_storage_stays_under_its_size_bound_evicting_least_recently_used(tmp_path):
    store = make_storage_backend("file", str(tmp_path), max_bytes=10_000, ttl_s=None)
    try:
        store.set([(key(i), bytes(1000)) for i in range(10)])
        assert store.get([key(0)]) == [
            bytes(1000)
        ]  # a hit: page 0 is now the most recently used
        store.set([(key(10), bytes(1000))])
        assert store.exists([key(0), key(1), key(10)]) == [True, False, True]
        for i in range(11, 60):
            store.set([(key(i), bytes(1000))])
            assert dir_bytes(tmp_path) <= 10_000
        assert store.exists([key(i) for i in range(50, 60)]) == [True] * 10
    finally:
        store.close()


def test_file_storage_write_on_a_full_disk_fails_and_leaves_no_partial_file(
    tmp_path, monkeypatch
):
    """ENOSPC mid-write: the write fails (the storage worker degrades to recomputation) and its
    half-written temp file is removed at once, not left to keep the disk full until the stale sweep."""
    import errno

    store = FileStorage(tmp_path, max_bytes=10**9)
    real_write = Path.write_bytes

    def full_disk(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        monkeypatch.setattr(Path, "write_bytes", full_disk)
        with pytest.raises(OSError, match="No space"):
            store.set([(key(1), bytes(4000))])
        monkeypatch.undo()
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
        assert store.exists([key(1)]) == [False] and store.total_bytes == 0
        store.set([(key(1), bytes(4000))])  # space again: writes work
        assert store.get([key(1)]) == [bytes(4000)]
    finally:
        store.close()


def test_file_storage_shared_by_replicas_learns_their_pages_and_tolerates_deletions(
    tmp_path,
):
    a = FileStorage(tmp_path, max_bytes=10**9)
    b = FileStorage(tmp_path, max_bytes=8_000)
    user_file = tmp_path / "notes.txt"
    user_file.write_text("not a page")
    stale_tmp = (
        tmp_path / "0a" / ".strata-kv-0a.deadbeef.tmp"
    )  # a crashed writer's leftover
    stale_tmp.parent.mkdir()
    stale_tmp.write_bytes(b"half a page")
    os.utime(stale_tmp, (time.time() - 3600, time.time() - 3600))
    try:
        a.set([(key(i), bytes(1000)) for i in range(20)])  # within a's bound, over b's
        b.rescan()  # b learns the pages a wrote ...
        b.sweep()  # ... and deletes the least recently used down to its bound
        assert dir_bytes(tmp_path) <= 8_000
        assert user_file.exists() and not stale_tmp.exists()
        for p in page_files(
            tmp_path
        ):  # every page vanishes under both (another replica, an operator)
            p.unlink()
        assert b.get([key(19), key(18)]) == [None, None]
        assert b.exists([key(19)]) == [False]
        a.set(
            [(key(100), bytes(3000)), (key(101), bytes(3000))]
        )  # evicting vanished files is fine
        b.set([(key(102), bytes(3000)), (key(103), bytes(3000))])
        b.rescan()
        b.sweep()
        assert dir_bytes(tmp_path) <= 8_000 and b.total_bytes == dir_bytes(tmp_path)
        assert b.exists([key(103)]) == [True]
    finally:
        a.close()
        b.close()


def test_file_storage_treats_idle_pages_as_misses_and_its_cleaner_deletes_them(
    tmp_path,
):
    store = FileStorage(
        tmp_path, max_bytes=10**9, ttl_s=2.0
    )  # the cleaner sweeps every second
    try:
        store.set([(key(0), b"used"), (key(1), b"idle"), (key(2), b"old")])
        old = store._path(key(2))
        os.utime(
            old, (time.time() - 60, time.time() - 60)
        )  # as if written a minute ago
        assert store.exists([key(2)]) == [False] and store.get([key(2)]) == [None]
        deadline = time.monotonic() + 15
        # key 0 is read, key 1 is not; one sweep deletes key 1 and the old page, one after the other
        while (
            store._path(key(1)).exists() or old.exists()
        ) and time.monotonic() < deadline:
            assert store.get([key(0)]) == [b"used"]
            time.sleep(0.1)
        assert store.exists([key(0), key(1)]) == [True, False]
        assert (
            not store._path(key(1)).exists() and not old.exists()
        )  # deleted, not just hidden
    finally:
        store.close()


# --------------------------------------------------------------------------- bounds: redis


def test_redis_pages_expire_unless_used(redis_server):
    _, redis_url = redis_server
    import redis

    client = redis.Redis.from_url(redis_url)
    store = make_storage_backend("redis", redis_url, max_bytes=1, ttl_s=60)
    try:
        store.set([(key(0), b"page"), (key(1), b"other")])
        assert 0 < client.pttl(key(0)) <= 60_000
        client.pexpire(key(0), 500)  # about to expire ...
        assert store.get([key(0), key(2)]) == [b"page", None]
        assert client.pttl(key(0)) > 50_000  # ... but a hit renews it
        client.pexpire(key(1), 1)
        time.sleep(0.05)
        assert store.exists([key(1)]) == [False] and store.get([key(1)]) == [None]
    finally:
        store.close()


# --------------------------------------------------------------------------- flags


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_storage_is_bounded_and_prefetch_is_auto_by_default():
    cfg = parse()
    assert cfg.hicache_prefetch_policy == "auto"
    assert (
        0 < cfg.hicache_storage_max_gib <= 64
        and 0 < cfg.hicache_storage_ttl < float("inf")
    )
    cfg = parse("--hicache-storage-max-gib", "0.5", "--hicache-storage-ttl", "600")
    assert (cfg.hicache_storage_max_gib, cfg.hicache_storage_ttl) == (0.5, 600)


@pytest.mark.parametrize(
    "flag, value", [("--hicache-storage-max-gib", "0"), ("--hicache-storage-ttl", "-5")]
)
def test_storage_bound_flags_must_be_positive(flag, value):
    with pytest.raises(ValueError, match=flag):
        parse(flag, value)


# --------------------------------------------------------------------------- the page decoder


# a page's header: magic [0, 4), key [4, 36), namespace [36, 68), crc [68, 72), payload length [72, 80)
HEADER = len(encode_page(bytes(32), bytes(32), b""))


def mutate(rng: random.Random, page: bytes) -> object:
    """`page` damaged the way a disk, a network, a peer or a bug might damage it."""
    kind = rng.randrange(9)
    if kind == 0:  # random bytes, any length
        lengths = [
            0,
            1,
            20,
            HEADER - 1,
            HEADER,
            HEADER + 1,
            len(page),
            rng.randrange(2 * len(page)),
        ]
        return rng.randbytes(rng.choice(lengths))
    if kind == 1:  # truncated
        return page[: rng.randrange(len(page))]
    if kind == 2:  # bit flips anywhere
        data = bytearray(page)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 3:  # a length field that lies, up to absurd
        length = rng.choice(
            [
                0,
                1,
                len(page) - HEADER - 1,
                len(page) - HEADER + 1,
                2**31,
                2**63,
                2**64 - 1,
            ]
        )
        return page[:72] + struct.pack("<Q", length) + page[80:]
    if kind == 4:  # extra bytes after the payload
        return page + rng.randbytes(rng.randint(1, 64))
    if (
        kind == 5
    ):  # a checksum recomputed over a damaged payload, as a buggy writer would
        return page[:68] + rng.randbytes(4) + page[72:]
    if kind == 6:  # the header of one page glued to a payload of the right length
        return page[:HEADER] + rng.randbytes(len(page) - HEADER)
    if kind == 7:  # not bytes at all
        return rng.choice(["a string", 42, 3.5, [1, 2], {"k": 1}, object()])
    return (
        bytearray(page) if rng.random() < 0.5 else memoryview(page)
    )  # undamaged, other buffer types


def test_decoder_turns_any_damage_into_a_miss():
    rng = random.Random(1234)
    ns, other_ns = bytes(range(32)), bytes(32)
    deadline = time.monotonic() + 3.0
    n = 0
    while time.monotonic() < deadline and n < 20_000:
        n += 1
        k = rng.randbytes(32)
        payload = rng.randbytes(rng.choice([1, 16, 512, 2048]))
        page = encode_page(k, ns, payload)
        data = mutate(rng, page)
        foreign = [(rng.randbytes(32), ns), (k, other_ns)]
        want_key, want_ns = (k, ns) if rng.random() < 0.8 else rng.choice(foreign)
        try:
            got = decode_page(data, want_key, want_ns, len(payload))
        except CorruptPage:
            continue
        intact = (
            isinstance(data, (bytes, bytearray, memoryview)) and bytes(data) == page
        )
        assert intact and (want_key, want_ns) == (k, ns) and got == payload, (n, data)
    assert n > 1000


class FuzzedStore:
    """An L3 holding `pages` and damaging some of them on the way out (or failing outright)."""

    name = "fuzzed"

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.pages: dict[str, bytes] = {}
        self.damage = 0.0

    def exists(self, keys: list[str]) -> list[bool]:
        if self.rng.random() < 0.02:
            raise OSError("backend down")
        return [k in self.pages for k in keys]

    def get(self, keys: list[str]) -> list[object]:
        if self.rng.random() < 0.02:
            raise TimeoutError("backend slow")
        out = [self.pages.get(k) for k in keys]
        return [
            mutate(self.rng, b)
            if b is not None and self.rng.random() < self.damage
            else b
            for b in out
        ]

    def set(self, items: list[tuple[str, bytes]]) -> None:
        self.pages.update(items)

    def close(self) -> None:
        pass


def make_hicache(storage, page_size: int = 4, **config) -> HiCache:
    l1 = MHAKVPool(2, 2, 8, 32, page_size, torch.float32, torch.device("cpu"))
    allocator = PageAllocator(32, page_size)
    defaults = {
        "host_pages": 64,
        "prefetch_threshold_tokens": 4,
        "storage_failures_before_pause": 10**9,
    }
    config = defaults | config
    return HiCache(
        HiCacheConfig(**config), l1, RadixCache(allocator), b"test-layout", storage
    )


def finish(hc: HiCache, rid: str) -> None:
    pf = hc.prefetches[rid]
    deadline = time.monotonic() + 10
    while not pf.done and time.monotonic() < deadline:
        hc.poll()
        time.sleep(0.001)
    assert pf.done


def test_prefetch_installs_only_intact_pages_whatever_the_backend_returns():
    rng = random.Random(99)
    store = FuzzedStore(rng)
    hc = make_hicache(store, prefetch_policy="wait_complete")
    tokens = [rng.randrange(1000) for _ in range(40)]
    truth = {}
    for d in hc.hasher.hashes(tokens):
        payload = rng.randbytes(hc.payload_bytes)
        truth[d] = payload
        store.pages[hc.storage_key(d)] = encode_page(d, hc.namespace, payload)
    installed = 0
    for i in range(300):
        store.damage = rng.choice([0.0, 0.1, 0.5, 1.0])
        hc.on_arrival(f"r{i}", tokens)
        finish(hc, f"r{i}")
        for d, host_page in hc.l2.items():
            assert hc.host.page_payload(host_page) == truth[d]
        installed += len(hc.l2)
        hc.on_finished(f"r{i}")
        hc.device.reset()
        hc.reset()
    assert hc.worker.is_alive()
    assert installed > 0 and hc.stats.corrupt_pages > 0 and hc.stats.storage_errors > 0
    hc.close()


# --------------------------------------------------------------------------- the auto prefetch policy


def test_auto_waits_only_while_fetching_beats_recomputing():
    # 1000 tokens in 10 MB: 0.1 s from a 100 MB/s L3 against 0.5 s of prefill at 2000 tokens/s
    assert auto_prefetch_wait_s(1000, 10**7, 0, 1e8, 2000) == pytest.approx(0.5)
    assert (
        auto_prefetch_wait_s(1000, 10**7, 0, 1e7, 2000) == 0
    )  # 1 s to fetch: recompute
    assert (
        auto_prefetch_wait_s(1000, 10**7, 5 * 10**7, 1e8, 2000) == 0
    )  # behind 0.5 s of other fetches
    assert (
        auto_prefetch_wait_s(1000, 10**7, 0, 1e8, 50_000) == 0
    )  # a fast prefill: 0.02 s


def test_rate_meter_uses_its_prior_until_measured_then_recent_samples():
    meter = RateMeter(prior=100.0, window=2)
    assert meter.rate == 100.0
    meter.add(0, 1.0)  # nothing moved: no sample
    assert meter.rate == 100.0
    meter.add(30, 1.0)
    meter.add(10, 1.0)
    assert meter.rate == 20.0
    meter.add(50, 1.0)  # the oldest falls out of the window
    assert meter.rate == 30.0


class SlowStore(FuzzedStore):
    """Reads take `delay_s`, or until `release` is set."""

    def __init__(self, delay_s: float):
        super().__init__(random.Random(0))
        self.delay_s = delay_s
        self.release = threading.Event()

    def exists(self, keys):
        return [k in self.pages for k in keys]

    def get(self, keys):
        self.release.wait(self.delay_s)
        return [self.pages.get(k) for k in keys]


def stored_prompt(hc: HiCache, store: FuzzedStore, num_tokens: int) -> list[int]:
    tokens = list(range(7, 7 + num_tokens))
    for d in hc.hasher.hashes(tokens):
        store.pages[hc.storage_key(d)] = encode_page(
            d, hc.namespace, bytes(hc.payload_bytes)
        )
    return tokens


def seconds_until_ready(hc: HiCache, rid: str) -> float:
    start = time.monotonic()
    while not hc.ready(rid):
        hc.poll()
        time.sleep(0.002)
    return time.monotonic() - start


def test_auto_policy_waits_up_to_the_recompute_time_then_gives_up():
    store = SlowStore(delay_s=30.0)  # much slower than the prior says
    # 200 tokens at 400 tokens/s: 0.5 s to recompute; the prior L3 rate says they fetch in microseconds
    hc = make_hicache(store, prefill_tokens_per_s_prior=400.0)
    tokens = stored_prompt(hc, store, 200)
    hc.on_arrival("a", tokens)
    waited = seconds_until_ready(hc, "a")
    assert 0.45 <= waited < 5 and not hc.prefetches["a"].done
    time.sleep(1.0)
    store.release.set()
    finish(hc, "a")  # the fetch lands late (50 pages in >= 1.5 s); it is measured ...
    assert hc.read_rate.rate < 50 / 1.5 * (hc.payload_bytes + HEADER)
    hc.device.reset()
    hc.reset()
    hc.on_arrival("b", tokens)  # ... so the next request does not wait at all
    assert hc.prefetches["b"].wait_s == 0 and hc.ready("b")
    hc.close()


def test_auto_policy_does_not_wait_when_prefill_is_faster():
    store = SlowStore(delay_s=0.5)
    hc = make_hicache(store, prefill_tokens_per_s_prior=1e9)
    hc.on_arrival("a", stored_prompt(hc, store, 200))
    assert hc.ready("a") and not hc.prefetches["a"].done
    hc.close()


def test_auto_policy_waits_for_a_fetch_that_beats_recomputing():
    store = SlowStore(delay_s=0.05)
    hc = make_hicache(
        store, prefill_tokens_per_s_prior=100.0
    )  # 2 s to recompute 200 tokens
    hc.on_arrival("a", stored_prompt(hc, store, 200))
    assert seconds_until_ready(hc, "a") < 1.5
    assert hc.prefetches["a"].done and len(hc.l2) == 50
    hc.close()


def test_a_page_gone_from_storage_is_written_again_when_next_computed():
    store = FuzzedStore(random.Random(0))
    store.exists = lambda keys: [k in store.pages for k in keys]  # a healthy backend
    hc = make_hicache(store, prefetch_policy="wait_complete")
    tokens = list(range(5, 45))

    def compute_and_cache() -> None:
        hc.device.reset()
        hc.reset()
        assert hc.device.insert(tokens, hc.allocator.alloc(10)) == 0  # write_through
        hc.flush()

    compute_and_cache()
    assert len(store.pages) == 10
    store.pages.clear()  # evicted by the backend's size bound (or another replica's)
    compute_and_cache()
    assert len(store.pages) == 0  # this replica still believes they are stored ...
    hc.device.reset()
    hc.reset()
    hc.on_arrival("r", tokens)
    finish(hc, "r")  # ... until a prefetch finds them missing
    compute_and_cache()
    assert len(store.pages) == 10
    hc.close()


# --------------------------------------------------------------------------- the CacheTiers contract


def test_hicache_is_the_tiers_behind_a_prefix_cache_and_brings_back_what_l1_evicted():
    hc = make_hicache(None)
    assert isinstance(hc, CacheTiers) and not isinstance(hc, PrefixCache)
    assert hc in hc.device.listeners  # demotes what the device cache evicts
    tokens = list(range(100, 140))  # 10 pages of 4
    pages = hc.allocator.alloc(10)
    for t in hc.l1.k + hc.l1.v:
        t.normal_()
    before, _ = hc.l1.read_pages(pages)
    assert hc.device.insert(tokens, pages) == 0
    assert (
        hc.device.evict(10) == 10 and hc.allocator.num_free_pages == 32
    )  # demoted into L2, freed in L1
    assert hc.device.match_prefix(tokens).cached_len == 0  # L1 alone has nothing
    match = hc.load_prefix(tokens + [7])
    assert match.cached_len == 40 and match.loaded == {"host": 40, "storage": 0}
    after, _ = hc.l1.read_pages(match.pages)
    assert torch.equal(before, after)
    assert hc.device.total_pages == 10 and hc.device.evictable_pages == 10
    hc.device.inc_lock(match.node)
    assert (
        hc.device.make_room(32) is False and hc.device.protected_pages == 10
    )  # locked pages stay
    hc.device.dec_lock(match.node)
    hc.device.reset()
    hc.reset()
    assert (
        hc.device.total_pages == 0
        and not hc.l2
        and hc.load_prefix(tokens).cached_len == 0
    )
