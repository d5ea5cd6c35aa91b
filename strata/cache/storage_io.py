"""The L3 side of the KV cache hierarchy: storage I/O on a thread of its own (strata.cache.hicache).

The worker takes jobs from `jobs` and puts results on `results`; the scheduler thread applies them
(`HiCache.poll`). It never touches L1 or L2. A failing backend degrades to recomputation: a failed job
is reported as such, and after repeated failures the backend is left alone for a while.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from strata.cache.storage import StorageBackend

logger = logging.getLogger(__name__)


def storage_key(digest: bytes) -> str:
    """A page's name in L3: its chained hash, which covers the KV layout's namespace."""
    return "strata-kv-" + digest.hex()


@dataclass
class Prefetch:
    rid: str
    keys: list[bytes]  # page digests after what L1/L2 hold, in order
    start_page: int  # page index of keys[0] in the request's sequence
    started: float
    wait_s: float  # the request may be admitted this long after `started`, done or not
    done: bool = False


class StorageWorker(threading.Thread):
    """Runs storage I/O off the scheduler thread. Jobs in, results out; never touches L1/L2."""

    def __init__(
        self,
        backend: StorageBackend,
        page_size: int,
        prefetch_threshold_tokens: int,
        failures_before_pause: int,
        pause_s: float,
    ):
        """A prefetch reads nothing when L3 holds fewer than `prefetch_threshold_tokens` of it (in
        pages of `page_size` tokens); `failures_before_pause` failed jobs in a row leave the backend
        alone for `pause_s`."""
        super().__init__(name="strata-hicache-storage", daemon=True)
        self.backend = backend
        self.page_size = page_size
        self.prefetch_threshold_tokens = prefetch_threshold_tokens
        self.failures_before_pause = failures_before_pause
        self.pause_s = pause_s
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.failures = 0
        self.paused_until = 0.0

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self._run_one(job)
            finally:
                self.jobs.task_done()

    def _run_one(self, job: tuple) -> None:
        if time.monotonic() < self.paused_until:
            self.results.put(("failed", job))
            return
        try:
            self.results.put(self._do(job))
            self.failures = 0
        except Exception as exc:  # noqa: BLE001 - a dead or slow backend degrades to recomputation
            self.failures += 1
            if self.failures >= self.failures_before_pause:
                self.paused_until = time.monotonic() + self.pause_s
            logger.warning("hicache storage %s failed: %s", self.backend.name, exc)
            self.results.put(("failed", job))

    def _do(self, job: tuple) -> tuple:
        kind = job[0]
        if kind == "write":
            items = job[1]
            self.backend.set(items)
            return ("written", items)
        if kind == "prefetch":
            pf: Prefetch = job[1]
            started = time.monotonic()
            names = [storage_key(k) for k in pf.keys]
            present = [bool(p) for p in self.backend.exists(names)][: len(names)]
            missing = [k for k, p in zip(pf.keys, present) if not p]
            hits = next((i for i, p in enumerate(present) if not p), len(present))
            if hits * self.page_size < self.prefetch_threshold_tokens:
                return ("prefetched", pf, [], missing, 0.0)
            blobs = list(self.backend.get(names[:hits]))
            return (
                "prefetched",
                pf,
                list(zip(pf.keys[:hits], blobs)),
                missing,
                time.monotonic() - started,
            )
        raise ValueError(kind)
