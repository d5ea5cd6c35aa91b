"""What every long-lived Strata process does at start: die with its parent, and keep the garbage
collector from stalling it.

A serving process holds a few million Python objects once torch, transformers and a model are
loaded. A full (generation 2) collection walks all of them (0.17-0.21 s measured in an engine
process on a 2-core server), during which every thread of the process waits for the GIL (a decode
step, an L3 prefetch, the event loop). `settle_heap` collects once after start-up and freezes what survives, so later collections
only walk what was allocated since; collections that still pause the process for long are logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
SLOW_GC_S = 0.05  # a collection pausing the process this long is logged
SLOW_GC_LOG_EVERY_S = (
    60.0  # at most one such line per minute (it counts the ones it did not log)
)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the parent dies, so no child outlives its server."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: callers' own parent checks still apply
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class GCPauseLog:
    """A `gc.callbacks` entry that counts collections and their pauses, and logs those longer than
    `slow_s` (one line per `every_s` at most, saying how many it did not log)."""

    def __init__(
        self,
        slow_s: float = SLOW_GC_S,
        every_s: float = SLOW_GC_LOG_EVERY_S,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.slow_s, self.every_s, self.clock = slow_s, every_s, clock
        self.started = 0.0
        self.collections = 0
        self.pause_s = 0.0
        self.slow = 0
        self._logged_at = float("-inf")
        self._unlogged = 0  # slow collections since the last line

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = self.clock()
            return
        took = self.clock() - self.started
        self.collections += 1
        self.pause_s += took
        if took < self.slow_s:
            return
        self.slow += 1
        now = self.clock()
        if now - self._logged_at < self.every_s:
            self._unlogged += 1
            return
        since = (
            f" ({self._unlogged} more since the last report)" if self._unlogged else ""
        )
        logger.warning(
            "a garbage collection (generation %d, %d objects freed) paused this process for %.0f ms%s",
            info.get("generation", -1),
            info.get("collected", 0),
            took * 1e3,
            since,
        )
        self._logged_at, self._unlogged = now, 0


_pause_log: GCPauseLog | None = None


def settle_heap() -> GCPauseLog:
    """Collect once, freeze the survivors (start-up objects are never walked again) and log slow
    collections from now on. Call when the process has loaded what it keeps; calling again freezes
    what was loaded since."""
    global _pause_log
    gc.collect()
    gc.freeze()
    if _pause_log is None:
        _pause_log = GCPauseLog()
        gc.callbacks.append(_pause_log)
    return _pause_log


def unsettle_heap() -> None:
    """Undo `settle_heap` (tests)."""
    global _pause_log
    gc.unfreeze()
    if _pause_log is not None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(_pause_log)
        _pause_log = None
