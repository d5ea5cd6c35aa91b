"""A killed kernel build never stalls a later start: the build lock dies with its holder, and torch's
lock file that a killed build leaves in the build directory is removed at once by the next builder;
a process that waits for a live build says whose (pid) and which lock, again and again."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from strata import kernels

# a builder: takes the lock, makes torch's baton as a build in progress has it, then builds forever
HOLDER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from strata.kernels import build_lock\n"
    "build_dir = Path(sys.argv[1])\n"
    "with build_lock(build_dir):\n"
    "    (build_dir / 'lock').touch()\n"
    "    print('building', flush=True)\n"
    "    time.sleep(600)\n"
)


@pytest.fixture
def holder(tmp_path):
    """A live builder of tmp_path/build: (its process, the build directory)."""
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(build_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "building"
        yield proc, build_dir
    finally:
        proc.kill()
        proc.wait()


def in_thread(fn) -> threading.Thread:
    """Runs fn in a daemon thread (a wait that never ends cannot hang the test run)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def take_lock(build_dir: Path, taken: threading.Event) -> threading.Thread:
    def run():
        with kernels.build_lock(build_dir):
            taken.set()

    return in_thread(run)


def test_a_killed_builders_locks_are_taken_over_at_once(holder):
    proc, build_dir = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (build_dir / "lock").exists()  # torch's baton, left behind
    taken = threading.Event()
    start = time.monotonic()
    take_lock(build_dir, taken)
    assert taken.wait(10), "the next build waited on a dead builder's lock"
    assert time.monotonic() - start < 2
    assert not (build_dir / "lock").exists()


def test_a_waiter_reports_the_live_builder_until_it_is_gone(
    holder, monkeypatch, caplog
):
    proc, build_dir = holder
    monkeypatch.setattr(kernels, "WAIT_REPORT_S", 0.2)
    taken = threading.Event()
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        take_lock(build_dir, taken)
        time.sleep(1.0)
        assert not taken.is_set()  # a live build is waited for
        assert (build_dir / "lock").exists()  # and its baton left alone
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert len(waits) >= 2, waits  # again and again, not once
        assert (
            f"pid {proc.pid}" in waits[-1]
            and str(build_dir.with_name("build.lock")) in waits[-1]
        )
        proc.kill()
        assert taken.wait(10)


def test_a_build_after_a_killed_one_does_not_wait_on_its_lock_file(
    tmp_path, monkeypatch
):
    """The whole _build path, with torch's load replaced by its lock handling (no compile): a
    killed build left the baton (and the OS lock's file, no longer locked)."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = Path(
        cpp_extension._get_build_directory(kernels._build_name("native"), verbose=False)
    )
    (build_dir / "lock").touch()
    build_dir.with_name(build_dir.name + ".lock").write_text("999999\n")

    class Built:
        @staticmethod
        def compiled_isa():
            return []

    def load(
        name, **_
    ):  # what torch.utils.cpp_extension._jit_compile does around its build
        baton = FileBaton(
            os.path.join(
                cpp_extension._get_build_directory(name, verbose=False), "lock"
            )
        )
        if baton.try_acquire():
            baton.release()
        else:
            baton.wait()
        return Built

    monkeypatch.setattr(cpp_extension, "load", load)
    built = []
    thread = in_thread(lambda: built.append(kernels._build("native")))
    thread.join(10)
    assert built == [Built], "the build waited on the lock file a killed build left"
