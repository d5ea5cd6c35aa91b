"""The KV cache hierarchy: L1 (the engine's KV pool + radix tree) → L2 (host memory) → L3 (storage).

`HiCache` is the scheduler's `CacheTiers` and a listener of the device's `PrefixCache`.
Pages are named across tiers by a chained hash: the digest of page i covers the layout namespace
(model identity, dtype, page size, shapes), page i-1's digest and page i's token ids, so a key
names a whole prefix and never collides across models, dtypes or page sizes.

    L1 radix evicts a leaf ─▶ demote: copy its pages into L2 (host pool, LRU by hash)
    admission (load_prefix): radix match ends at token m ─▶ promote: consecutive L2 hits after m are copied
        into fresh L1 pages and inserted into the radix tree, then matched and locked as usual
    L3 writes (background thread): write_through (when pages enter the tree),
        write_through_selective (once a page has been hit twice), write_back (when L2 drops it)
    L3 prefetch (background thread): on arrival, if L3 holds >= threshold tokens beyond L1/L2,
        its pages are fetched into L2; the request waits per the prefetch policy
        (auto: while fetching is expected to beat recomputing, best_effort: never,
        wait_complete: until done, timeout: up to a fixed deadline)

The auto policy is a rent-or-buy decision. Before a request waits it compares

    fetch_s     = (bytes of prefetches queued ahead + its own bytes) / L3 read bytes/s
    recompute_s = its tokens / prefill tokens/s

both rates measured on this engine (recent L3 reads; admission to cached prompt for prefills of
>= 64 tokens), with priors (a slow disk, a CPU's prefill) until the first measurement. It waits only if
fetch_s < recompute_s, and at most recompute_s: a fetch that overruns its estimate then costs at
most twice the recomputation, and one that keeps its estimate saves recompute_s - fetch_s.

Every stored page carries its key, the layout namespace and a checksum; a corrupt, truncated or
foreign entry (or anything a backend returns that is not such a page) is counted and treated as a
miss (the tokens are recomputed). A failing backend is treated as a miss too, and after repeated
failures it is left alone for a while. Backends bound their size and age (strata.cache.storage), so
a page written once may be gone later: one a prefetch finds missing is written again when computed.
All tier bookkeeping runs on the scheduler thread; only storage I/O runs on the worker thread.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from strata.cache.allocator import PageAllocator
from strata.cache.host_pool import HostKVPool
from strata.cache.kv_pool import KVPool
from strata.cache.pages import (
    HEADER_BYTES,
    CorruptPage,
    PageHasher,
    decode_page,
    encode_page,
)
from strata.cache.prefetch import RateMeter, auto_prefetch_wait_s, fetches_l3_hit
from strata.cache.radix import MatchResult, PrefixCache
from strata.cache.storage import StorageBackend
from strata.cache.storage_io import Prefetch, StorageWorker, storage_key

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")
MIN_PREFILL_SAMPLE_TOKENS = (
    64  # shorter prefills measure step overhead more than throughput
)


@dataclass(frozen=True)
class HiCacheConfig:
    host_pages: int
    write_policy: str = "write_through"
    prefetch_policy: str = "auto"
    prefetch_threshold_tokens: int = 256
    prefetch_timeout_s: float = 2.0
    storage_failures_before_pause: int = 3
    storage_pause_s: float = 10.0
    storage_ttl_s: float | None = (
        None  # pages written longer ago may be gone from L3: write them again
    )
    # the auto policy's rates until measured: a slow shared disk and a CPU's prefill rate; they wait
    # for small models' pages (small per token) and recompute large models' ones (a GPU's case)
    storage_read_bytes_per_s_prior: float = 256 * 2**20
    prefill_tokens_per_s_prior: float = 2048.0


@dataclass
class HiCacheStats:
    """Counters for /metrics and /get_server_info (tokens and bytes, monotonic)."""

    hit_tokens: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "storage": 0}
    )
    query_tokens: int = 0
    demoted_pages: int = 0
    promoted_pages: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    storage_written_pages: int = 0
    storage_read_pages: int = 0
    bytes_to_storage: int = 0
    bytes_from_storage: int = 0
    storage_errors: int = 0
    corrupt_pages: int = 0
    # host (L2) memory: its pages are allocated lazily by the OS, so the engine's resident memory
    # grows by one page's bytes the first time each host page is written, up to host_bytes
    host_bytes: int = 0
    host_touched_bytes: int = (
        0  # bytes of the host pages up to the highest one ever written
    )

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_tokens"] = dict(self.hit_tokens)
        q = max(self.query_tokens, 1)
        d["hit_rate"] = {tier: n / q for tier, n in self.hit_tokens.items()}
        return d


# --------------------------------------------------------------------------- the controller


class HiCache:
    """The `CacheTiers` behind a device cache (L1: a radix tree over the KV pool): L2 host pages
    and L3 storage. Lookup, locking and eviction stay the device cache's; this listens to it
    (`CacheListener`: demotion on eviction, L3 writes on insertion) and adds promotion
    (`load_prefix`) and L3 prefetch (the request events)."""

    def __init__(
        self,
        config: HiCacheConfig,
        l1: KVPool,
        device: PrefixCache,
        namespace: bytes,
        storage: StorageBackend | None = None,
    ):
        if config.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache write policy must be one of {WRITE_POLICIES}, got {config.write_policy!r}"
            )
        if config.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"hicache prefetch policy must be one of {PREFETCH_POLICIES}"
            )
        self.config = config
        self.l1, self.device = l1, device
        self.allocator = device.allocator
        self.page_size = l1.page_size
        self.namespace = hashlib.sha256(namespace).digest()
        self.hasher = PageHasher(self.page_size, namespace)
        self.host = HostKVPool(l1, config.host_pages)
        self.host_allocator = PageAllocator(config.host_pages, self.page_size)
        self.l2: OrderedDict[bytes, int] = (
            OrderedDict()
        )  # digest -> host page, least recent first
        self.l2_from_storage: set[bytes] = (
            set()
        )  # L2 entries that came from L3 (for per-tier hit counts)
        self.pinned: set[bytes] = set()  # being promoted: L2 must not drop them
        self._promoting = False  # inserting promoted pages into the device cache
        self.stats = HiCacheStats(host_bytes=config.host_pages * self.host.page_bytes)
        self._host_touched_pages = 0
        self.storage = storage
        # digests written to (or read from) L3, with when (monotonic); least recent first, bounded
        self.in_storage: OrderedDict[bytes, float] = OrderedDict()
        self.hit_counts: dict[bytes, int] = {}  # write_through_selective
        self.prefetches: dict[str, Prefetch] = {}
        # the auto prefetch policy's measurements (scheduler thread)
        self.read_rate = RateMeter(config.storage_read_bytes_per_s_prior)  # L3 bytes/s
        self.prefill_rate = RateMeter(
            config.prefill_tokens_per_s_prior
        )  # tokens/s, admission to cached
        # last page digest of a request's reusable prompt -> (admitted at, tokens it must compute)
        self.prefilling: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self.worker = (
            StorageWorker(
                storage,
                self.page_size,
                config.prefetch_threshold_tokens,
                config.storage_failures_before_pause,
                config.storage_pause_s,
            )
            if storage is not None
            else None
        )
        if self.worker is not None:
            self.worker.start()
        device.add_listener(self)

    def reset(self) -> None:
        """Drop L2 (the device cache resets itself; L3 is shared and stays)."""
        self.l2.clear()
        self.l2_from_storage.clear()
        self.host_allocator.reset()

    @property
    def payload_bytes(self) -> int:
        return self.host.page_bytes

    def storage_key(self, digest: bytes) -> str:
        return storage_key(digest)

    # ----------------------------------------------------------------- L1 -> L2

    def on_evict(
        self, prefix: tuple[int, ...], tokens: tuple[int, ...], pages: list[int]
    ) -> None:
        """The device cache evicts: back the pages up in L2 before L1 frees them."""
        prev = self.hasher.hashes(prefix)[-1] if prefix else None
        digests = self.hasher.hashes(tokens, prev)
        todo = [(d, p) for d, p in zip(digests, pages) if d not in self.l2]
        for d in digests:
            if d in self.l2:
                self.l2.move_to_end(d)
        if not todo:
            return
        host_pages = self._host_alloc(len(todo))
        if host_pages is None:
            return
        self.host.copy_from_l1(self.l1, [p for _, p in todo], host_pages)
        for (d, _), hp in zip(todo, host_pages):
            self.l2[d] = hp
        self.stats.demoted_pages += len(todo)
        self.stats.bytes_to_host += len(todo) * self.payload_bytes

    def _host_alloc(self, n: int) -> list[int] | None:
        if n > self.config.host_pages:
            return None
        while self.host_allocator.num_free_pages < n:
            victim = next((d for d in self.l2 if d not in self.pinned), None)
            if victim is None:
                return None
            hp = self.l2.pop(victim)
            if self.config.write_policy == "write_back" and not self._known_stored(
                victim
            ):
                self._write([(victim, self.host.page_payload(hp))])
            self.l2_from_storage.discard(victim)
            self.host_allocator.free([hp])
        pages = self.host_allocator.alloc(n)
        if pages:
            touched = max(self._host_touched_pages, max(pages) + 1)
            self._host_touched_pages = touched
            self.stats.host_touched_bytes = touched * self.host.page_bytes
        return pages

    # ----------------------------------------------------------------- L2 -> L1 (admission)

    def load_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The L1 match, extended with the consecutive L2 pages that follow it (promoted into fresh
        L1 pages; making room evicts L1, which demotes into L2). `loaded` counts the promoted tokens
        that were in L2 ("host") and that came from L3 ("storage"). Called at admission, so it also
        starts the clock on the prefill of the rest (see `on_insert`)."""
        tokens = token_ids
        digests = self.hasher.hashes(
            tokens[: len(tokens) // self.page_size * self.page_size]
        )
        new_match, host_len, storage_len = self._promote(
            tokens, digests, self.device.match_prefix(tokens)
        )
        new_match.loaded = {"host": host_len, "storage": storage_len}
        if digests and len(tokens) - new_match.cached_len >= MIN_PREFILL_SAMPLE_TOKENS:
            self.prefilling[digests[-1]] = (
                time.monotonic(),
                len(tokens) - new_match.cached_len,
            )
            self.prefilling.move_to_end(digests[-1])
            if (
                len(self.prefilling) > 1024
            ):  # aborted or retracted requests never finish their prefill
                self.prefilling.popitem(last=False)
        return new_match

    def _promote(
        self, tokens: Sequence[int], digests: list[bytes], match: MatchResult
    ) -> tuple[MatchResult, int, int]:
        ps = self.page_size
        start = match.cached_len // ps
        hits: list[bytes] = []
        for d in digests[start:]:
            if d not in self.l2:
                break
            hits.append(d)
        self._count_hits(digests[:start], match.pages, hits)
        if not hits:
            return match, 0, 0
        self.pinned.update(hits)
        self.device.inc_lock(match.node)  # keep the matched prefix while making room
        try:
            host_pages = [self.l2[d] for d in hits]
            parts = (
                self.host.presence(host_pages) if self.allocator.groups else None
            )  # window KV they carry
            if not self.device.make_room(len(hits), parts):
                return match, 0, 0
            l1_pages = self.allocator.alloc(len(hits), parts)
            if l1_pages is None:
                return match, 0, 0
            self.host.copy_to_l1(self.l1, host_pages, l1_pages)
            end = match.cached_len + len(hits) * ps
            self._promoting = True  # pages from L2 are not new KV (`on_insert`)
            try:
                present = self.device.insert(tokens[:end], match.pages + l1_pages)
            finally:
                self._promoting = False
            # only pages past `present` now belong to the tree; anything before it was already there
            dup = l1_pages[: max(0, (present - match.cached_len) // ps)]
            self.allocator.free(dup)
        finally:
            self.device.dec_lock(match.node)
            self.pinned.difference_update(hits)
        from_storage = sum(1 for d in hits if d in self.l2_from_storage)
        for d in hits:
            self.l2.move_to_end(d)
        self.stats.promoted_pages += len(hits)
        self.stats.bytes_from_host += len(hits) * self.payload_bytes
        new_match = self.device.match_prefix(tokens[:end])
        return new_match, (len(hits) - from_storage) * ps, from_storage * ps

    def _count_hits(
        self, l1_digests: list[bytes], l1_pages: list[int], l2_digests: list[bytes]
    ) -> None:
        """write_through_selective: a page goes to L3 on its second hit, from whichever tier holds it."""
        if (
            self.config.write_policy != "write_through_selective"
            or self.storage is None
        ):
            return
        from_l1: list[tuple[bytes, int]] = []
        from_l2: list[bytes] = []
        for i, d in enumerate(l1_digests + l2_digests):
            n = self.hit_counts.get(d, 0) + 1
            self.hit_counts[d] = n
            if n == 2 and not self._known_stored(d):
                if i < len(l1_digests):
                    from_l1.append((d, l1_pages[i]))
                else:
                    from_l2.append(d)
        if from_l1:
            payloads = self.host.l1_payloads(self.l1, [p for _, p in from_l1])
            self._write([(d, payload) for (d, _), payload in zip(from_l1, payloads)])
        self._write([(d, self.host.page_payload(self.l2[d])) for d in from_l2])
        if len(self.hit_counts) > 1_000_000:
            self.hit_counts.clear()

    def on_admitted(self, query_len: int, hits: dict[str, int]) -> None:
        self.stats.query_tokens += query_len
        for tier, n in hits.items():
            self.stats.hit_tokens[tier] += n

    # ----------------------------------------------------------------- L1 -> L3 (write_through)

    def on_insert(
        self, tokens: Sequence[int], pages: Sequence[int], new_from: int
    ) -> None:
        """Pages tokens[new_from:] just entered the device cache: a prompt admitted by `load_prefix`
        is computed when its last page does (a prefill rate sample); write_through backs them up in
        L3. Pages promoted from L2 (`_promote`) are neither."""
        if self._promoting:
            return
        write = self.storage is not None and self.config.write_policy == "write_through"
        if not write and not self.prefilling:
            return
        ps = self.page_size
        digests = self.hasher.hashes(tokens)
        first = new_from // ps
        now = time.monotonic()
        for d in digests[first:] if self.prefilling else ():
            admitted = self.prefilling.pop(d, None)
            if admitted is not None:
                self.prefill_rate.add(admitted[1], now - admitted[0])
        if not write:
            return
        todo = [
            (d, p)
            for d, p in zip(digests[first:], pages[first:])
            if not self._known_stored(d)
        ]
        if not todo:
            return
        payloads = self.host.l1_payloads(self.l1, [p for _, p in todo])
        self._write([(d, payload) for (d, _), payload in zip(todo, payloads)])

    def _write(self, items: list[tuple[bytes, bytes]]) -> None:
        if self.worker is None or not items:
            return
        encoded = [
            (self.storage_key(d), encode_page(d, self.namespace, payload))
            for d, payload in items
        ]
        for d, _ in items:
            self._remember_stored(d)
        self.worker.jobs.put(("write", encoded))

    def _remember_stored(self, digest: bytes) -> None:
        self.in_storage[digest] = time.monotonic()
        self.in_storage.move_to_end(digest)
        if len(self.in_storage) > 1_000_000:
            self.in_storage.popitem(last=False)

    def _known_stored(self, digest: bytes) -> bool:
        """Written to L3 recently enough that its TTL cannot have removed it (size eviction can:
        a prefetch that finds a page missing forgets it, so the next computation writes it again)."""
        stored_at = self.in_storage.get(digest)
        ttl = self.config.storage_ttl_s
        return stored_at is not None and (
            ttl is None or time.monotonic() - stored_at < ttl
        )

    # ----------------------------------------------------------------- L3 -> L2 (prefetch)

    def on_arrival(self, rid: str, token_ids: Sequence[int]) -> None:
        """Look past what L1 and L2 hold; ask the worker for the rest from L3."""
        if self.worker is None:
            return
        ps = self.page_size
        digests = self.hasher.hashes(token_ids[: len(token_ids) // ps * ps])
        l1_pages = self.device.match_prefix(token_ids).cached_len // ps
        start = l1_pages
        while start < len(digests) and digests[start] in self.l2:
            start += 1
        rest = digests[start:]
        if not fetches_l3_hit(len(rest) * ps, self.config.prefetch_threshold_tokens):
            return
        wait_s = self._wait_s(rest)
        pf = Prefetch(
            rid=rid,
            keys=rest,
            start_page=start,
            started=time.monotonic(),
            wait_s=wait_s,
        )
        self.prefetches[rid] = pf
        self.worker.jobs.put(("prefetch", pf))

    def _wait_s(self, keys: list[bytes]) -> float:
        """How long a request may wait for the prefetch of `keys`, per the prefetch policy."""
        policy = self.config.prefetch_policy
        if policy == "best_effort":
            return 0.0
        if policy == "wait_complete":
            return float("inf")
        if policy == "timeout":
            return self.config.prefetch_timeout_s
        stored_page_bytes = self.payload_bytes + HEADER_BYTES
        queued_pages = sum(
            len(pf.keys) for pf in self.prefetches.values() if not pf.done
        )
        return auto_prefetch_wait_s(
            len(keys) * self.page_size,
            len(keys) * stored_page_bytes,
            queued_pages * stored_page_bytes,
            self.read_rate.rate,
            self.prefill_rate.rate,
        )

    def ready(self, rid: str) -> bool:
        """May this request be admitted now, per the prefetch policy?"""
        pf = self.prefetches.get(rid)
        return pf is None or pf.done or time.monotonic() - pf.started >= pf.wait_s

    def fetching(self) -> bool:
        return any(not pf.done for pf in self.prefetches.values())

    def on_finished(self, rid: str) -> None:
        self.prefetches.pop(rid, None)

    def poll(self) -> None:
        """Apply finished storage jobs (scheduler thread): prefetched pages land in L2."""
        if self.worker is None:
            return
        while True:
            try:
                result = self.worker.results.get_nowait()
            except queue.Empty:
                return
            kind = result[0]
            if kind == "written":
                n = len(result[1])
                self.stats.storage_written_pages += n
                self.stats.bytes_to_storage += sum(len(b) for _, b in result[1])
            elif kind == "prefetched":
                _, pf, blobs, missing, seconds = result
                for d in (
                    missing
                ):  # evicted from L3 (or never written): write it when next computed
                    self.in_storage.pop(d, None)
                self._land(pf, blobs, seconds)
            elif kind == "failed":
                self.stats.storage_errors += 1
                job = result[1]
                if job[0] == "prefetch":
                    job[1].done = True
                elif job[0] == "write":
                    for key, _ in job[1]:
                        self.in_storage.pop(
                            bytes.fromhex(key.removeprefix("strata-kv-")), None
                        )

    def _land(
        self,
        pf: Prefetch,
        blobs: list[tuple[bytes, bytes | None]],
        seconds: float = 0.0,
    ) -> None:
        pf.done = True
        expected = self.payload_bytes
        self.read_rate.add(
            sum(len(b) for _, b in blobs if isinstance(b, (bytes, bytearray))), seconds
        )
        good: list[tuple[bytes, bytes]] = []
        for digest, blob in blobs:
            if blob is None:
                break
            try:
                good.append(
                    (digest, decode_page(blob, digest, self.namespace, expected))
                )
            except CorruptPage as exc:
                self.stats.corrupt_pages += 1
                logger.warning(
                    "hicache: ignoring corrupt storage page %s: %s",
                    digest.hex()[:16],
                    exc,
                )
                break  # a prefix is only usable up to its first bad page
        todo = [(d, p) for d, p in good if d not in self.l2]
        host_pages = self._host_alloc(len(todo)) if todo else []
        if host_pages is None:
            return
        for (d, payload), hp in zip(todo, host_pages):
            self.host.load_payload(hp, payload)
            self.l2[d] = hp
            self.l2_from_storage.add(d)
            self._remember_stored(d)
        self.stats.storage_read_pages += len(good)
        self.stats.bytes_from_storage += len(good) * (expected + HEADER_BYTES)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.jobs.put(None)
            self.worker.join(timeout=5)
            assert self.storage is not None  # the worker runs only with a backend
            self.storage.close()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until queued storage writes are done (tests, shutdown)."""
        if self.worker is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.worker.jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
            self.poll()
        self.poll()
