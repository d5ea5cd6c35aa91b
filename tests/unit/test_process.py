"""settle_heap: start-up objects frozen out of later collections; slow collections are logged."""

from __future__ import annotations

import gc
import logging

from strata.process import GCPauseLog, settle_heap, unsettle_heap


def test_settle_heap_freezes_startup_objects_and_watches_collections():
    keep = [[i] for i in range(10_000)]  # start-up state a process keeps
    try:
        log = settle_heap()
        assert gc.get_freeze_count() >= len(keep)
        assert (
            settle_heap() is log and gc.callbacks.count(log) == 1
        )  # again: no second callback
        before = log.collections
        gc.collect()
        assert log.collections == before + 1
        assert all(
            o is not keep[0] for o in gc.get_objects(generation=2)
        )  # frozen: no collection walks it
    finally:
        unsettle_heap()
    assert gc.get_freeze_count() == 0 and all(
        not isinstance(cb, GCPauseLog) for cb in gc.callbacks
    )


def test_slow_collections_are_logged_at_most_once_a_minute(caplog):
    now = [0.0]
    log = GCPauseLog(slow_s=0.05, every_s=60.0, clock=lambda: now[0])

    def collect(generation: int, seconds: float) -> None:
        log("start", {"generation": generation})
        now[0] += seconds
        log("stop", {"generation": generation, "collected": 7})

    with caplog.at_level(logging.WARNING, logger="strata.process"):
        collect(0, 0.001)
        collect(2, 0.2)  # logged
        collect(2, 0.1)  # within the minute: counted, not logged
        collect(2, 0.1)
        now[0] += 60.0
        collect(1, 0.08)  # logged, with the two it held back
    assert log.collections == 5 and log.slow == 4 and abs(log.pause_s - 0.481) < 1e-9
    first, second = (r.getMessage() for r in caplog.records)
    assert "generation 2" in first and "200 ms" in first and "more since" not in first
    assert (
        "generation 1" in second
        and "80 ms" in second
        and "2 more since the last report" in second
    )
