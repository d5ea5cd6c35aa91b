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
        assert settle_heap() is log and gc.callbacks.count(log) == 1  # again: no second callback
        before = log.collections
        gc.collect()
        assert log.collections == before + 1
        assert all(o is not keep[0] for o in gc.get_objects(generation=2))  # frozen: no collection walks it
    finally:
        unsettle_heap()
    assert gc.get_freeze_count() == 0 and all(not isinstance(cb, GCPauseLog) for cb in gc.callbacks)


def test_slow_collections_are_logged(caplog):
    now = [0.0]
    log = GCPauseLog(slow_s=0.05, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="strata.process"):
        log("start", {"generation": 0})
        now[0] += 0.001
        log("stop", {"generation": 0, "collected": 3})
        log("start", {"generation": 2})
        now[0] += 0.2
        log("stop", {"generation": 2, "collected": 7})
    assert log.collections == 2 and log.slow == 1 and abs(log.pause_s - 0.201) < 1e-9
    (record,) = caplog.records
    assert "generation 2" in record.getMessage() and "200 ms" in record.getMessage()
