"""A split replica whose worker rank dies or stalls fails with `RankFailure` within --dist-timeout
(never hangs), and closing an engine leaves no worker process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from tiny_models import make_model

from strata import Engine, SamplingParams
from strata.distributed import runtime
from strata.distributed.errors import RankFailure

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp("rank_failure") / "llama", "llama", tokenizer=False
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def test_a_killed_worker_fails_the_next_step_and_close_leaves_no_process(llama):
    engine = Engine(
        str(llama), dtype="float32", kv_cache_tokens=256, tp_size=2, dist_timeout=5
    )
    try:
        (worker,) = [p.pid for p in engine.parallel.procs]
        assert worker in children(os.getpid())
        assert len(engine.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 4
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            engine.generate([[4, 5, 6]], GREEDY)
        assert time.monotonic() - start < 5
        assert not engine.parallel.healthy
    finally:
        engine.close()
    assert not alive(worker)


def test_a_stalled_worker_times_out_instead_of_hanging(llama):
    engine = Engine(
        str(llama), dtype="float32", kv_cache_tokens=256, tp_size=2, dist_timeout=2
    )
    (worker,) = [p.pid for p in engine.parallel.procs]
    try:
        os.kill(
            worker, signal.SIGSTOP
        )  # alive but never answers: only the timeout can tell
        start = time.monotonic()
        with pytest.raises(RankFailure):
            engine.generate([[4, 5, 6]], GREEDY)
        assert time.monotonic() - start < 15
    finally:
        engine.close()  # kills the stopped worker
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)


def test_close_stops_the_workers_cleanly(llama):
    engine = Engine(str(llama), dtype="float32", kv_cache_tokens=256, tp_size=2)
    procs = list(engine.parallel.procs)
    engine.generate([[1, 2, 3]], GREEDY)
    engine.close()
    assert [p.returncode for p in procs] == [0]  # a Stop message, not a kill


@pytest.mark.parametrize("dead_before_init", [False, True])
def test_a_worker_that_cannot_start_fails_the_engine_at_once(
    llama, monkeypatch, dead_before_init
):
    monkeypatch.setenv(
        "PYTHONHOME", "/nonexistent"
    )  # the worker's interpreter dies before any import
    if (
        dead_before_init
    ):  # it is gone before its init message is written (a broken pipe)
        spawn = subprocess.Popen

        def spawn_and_wait(*args, **kwargs):
            proc = spawn(*args, **kwargs)
            proc.wait()
            return proc

        monkeypatch.setattr(runtime.subprocess, "Popen", spawn_and_wait)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="failed to start"):
        Engine(str(llama), dtype="float32", kv_cache_tokens=256, tp_size=2)
    assert time.monotonic() - start < 30
