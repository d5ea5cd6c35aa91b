"""Start a server subprocess on a free local port, wait until it answers, stop it.

The server's output goes to a log file (its path is in every error), so a benchmark's terminal
shows the benchmark; the log is removed when a server that started fine is stopped. Readiness: GET /health answers 200 (Strata, SGLang, vLLM), or else
GET /v1/models does (llama.cpp's Python server has no /health).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from strata.ports import free_port

STOP_TIMEOUT_S = 20.0


def serve_argv(port: int, *flags: str) -> list[str]:
    """`strata serve` on 127.0.0.1:`port`, quiet but for warnings, with `flags`."""
    return [
        sys.executable,
        "-m",
        "strata.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]


class ServerProcess:
    """`with ServerProcess(cmd_for_port, name) as srv: srv.base_url ...` (cmd_for_port(port) -> argv)."""

    def __init__(
        self,
        argv_for_port,
        name: str,
        *,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ):
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = list(argv_for_port(self.port))
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        fd, path = tempfile.mkstemp(prefix=f"strata-bench-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen | None = None
        self._keep_log = False  # a failed start keeps its log for the user to read

    def start(self) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self._keep_log = True
                raise RuntimeError(
                    f"{self.name} server exited with code {code} during start-up:\n{self.log_tail()}"
                )
            if self._ready():
                return self
            time.sleep(0.5)
        self._keep_log = True
        self.stop()
        raise RuntimeError(
            f"{self.name} server did not become ready within {self.startup_timeout_s:.0f}s "
            f"(log: {self.log_path}):\n{self.log_tail()}"
        )

    def _ready(self) -> bool:
        for path in ("/health", "/v1/models"):
            try:
                resp = httpx.get(self.base_url + path, timeout=5)
            except httpx.HTTPError:
                return False
            if resp.status_code == 200:
                return True
            if resp.status_code != 404:
                return False  # e.g. 503 while loading
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if not self._keep_log:
            self.log_path.unlink(missing_ok=True)

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
