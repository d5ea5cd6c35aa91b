"""The processes that never compute, started as users start them (`strata serve`, `strata router`
through the CLI, which builds every subcommand's parser), never map libtorch; the engine does."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from live_server import LiveServer, free_port

pytestmark = pytest.mark.e2e


def maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_the_strata_serve_frontend_and_the_router_do_not_load_torch():
    with LiveServer(entry=("-m", "strata.cli", "serve")) as srv:
        assert maps_libtorch(
            srv.info()["engine"]["pid"]
        )  # the check sees torch where it is loaded
        assert not maps_libtorch(srv.proc.pid), (
            "the `strata serve` frontend loaded torch"
        )

        port = free_port()
        with tempfile.TemporaryFile() as log:
            router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "strata.cli",
                    "router",
                    "--worker-urls",
                    srv.url,
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                deadline = time.monotonic() + 60
                while True:
                    assert router.poll() is None and time.monotonic() < deadline, _read(
                        log
                    )
                    try:
                        if (
                            httpx.get(
                                f"http://127.0.0.1:{port}/health", timeout=2
                            ).status_code
                            == 200
                        ):
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.1)
                assert not maps_libtorch(router.pid), (
                    "the `strata router` process loaded torch"
                )
            finally:
                router.terminate()
                router.wait(30)


def _read(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-3000:]
