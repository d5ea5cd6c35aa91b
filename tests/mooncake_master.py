"""A private `mooncake_master` on loopback free ports, for the Mooncake L3 tests; `skip_reason()`
says why Mooncake cannot run here (the package or a native library it loads is missing)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from strata.ports import free_port


def skip_reason() -> str | None:
    try:
        import mooncake.engine
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (
            f"Mooncake is not usable here ({exc}); CI installs it: pip install -e '.[mooncake]' "
            "and apt-get install libibverbs1"
        )
    return None


class MooncakeMaster:
    def __init__(self, log_dir: Path, port: int | None = None):
        import mooncake

        self.exe = Path(mooncake.__file__).parent / "mooncake_master"
        self.port = port or free_port()
        self.log = log_dir / f"mooncake-master-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        argv = [
            str(self.exe),
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={free_port()}",
            "--metrics_host=127.0.0.1",
            "--rpc_thread_num=2",
            "--enable_metric_reporting=false",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"mooncake_master did not listen on {self.address} within {timeout_s}s"
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
