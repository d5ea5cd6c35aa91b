"""The processes a soak runs and breaks: two replicas sharing an L3 tier behind a router, a PD pair
behind a second router, optionally a Redis, each on a free loopback port with its own log.

    dp router ──▶ replica-a ─┐                       pd router ──▶ prefill ──KV──▶ decode
              └─▶ replica-b ─┴─ L3: a directory (on a tmpfs of our own when mounting works) or Redis

Everything listens on 127.0.0.1 only. `Proc` starts one process, kills or restarts it on the same
port (same argv, so the router knows it again), and reads its resident memory from /proc. A
server's engine process is its child; its pid comes from the server's /get_server_info
(`engine.pid`), else from /proc.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from strata.bench.soak_config import ClusterConfig
from strata.ports import free_port

LOOPBACK = "127.0.0.1"
STOP_TIMEOUT_S = 20.0


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a live process (VmRSS), None when it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


@dataclass
class Proc:
    """One process of the soak, restartable on its port. `url` is None for Redis."""

    name: str
    argv: list[str]
    log_path: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    is_server: bool = True  # `strata serve`: has an engine child and /get_server_info
    popen: subprocess.Popen | None = None
    engine_pid: int | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(
                f"\n==== soak: start #{self.starts + 1}: {' '.join(self.argv)}\n".encode()
            )
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # a ^C of the soak reaches the soak; it stops these itself
            )
        self.engine_pid = None
        self.starts += 1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            os.kill(self.popen.pid, sig)

    def find_engine_pid(self) -> int | None:
        """The engine's pid from /get_server_info (cached until the next start), else the child."""
        if not self.is_server or not self.alive():
            return None
        if self.engine_pid is None or not pid_alive(self.engine_pid):
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                info = httpx.get(self.url + "/get_server_info", timeout=10).json()
                self.engine_pid = int(info["engine"]["pid"])
            if self.engine_pid is None:
                assert self.popen is not None  # alive
                children = child_pids(self.popen.pid)
                self.engine_pid = children[0] if children else None
        return self.engine_pid

    def stop(self) -> None:
        """SIGTERM (a server drains for its grace period), then SIGKILL; an engine left alone goes too."""
        engine = self.engine_pid
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(
                    self.popen.pid, signal.SIGCONT
                )  # a stopped process cannot handle SIGTERM
                self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if engine is not None and pid_alive(engine):
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGCONT)
                os.kill(engine, signal.SIGKILL)

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(
                self.log_path.read_text(errors="replace").splitlines()[-num_lines:]
            )
        except OSError:
            return "(no log)"


@dataclass
class Cluster:
    """Built by `Cluster.create`; `start()` brings everything up, `close()` takes it all down."""

    config: ClusterConfig
    replicas: list[Proc]
    router: Proc
    prefill: Proc
    decode: Proc
    pd_router: Proc
    redis: Proc | None
    l3_dir: Path
    tmpfs: (
        Path | None
    )  # mount point of the L3 tmpfs, None when mounting failed (see tmpfs_note)
    tmpfs_note: str

    @classmethod
    def create(cls, config: ClusterConfig) -> Cluster:
        run = config.run_dir
        run.mkdir(parents=True, exist_ok=True)
        tmpfs, note = (
            mount_tmpfs(run / "l3-mount", config.l3_tmpfs_mib)
            if config.l3 == "file"
            else (None, "")
        )
        l3_dir = (tmpfs or run) / "l3"
        secret = secrets.token_hex(16)
        redis = None
        if config.l3 == "redis":
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError(
                    "--l3 redis needs redis-server on PATH (apt-get install redis-server)"
                )
            port = free_port()
            argv = [
                exe,
                "--port",
                str(port),
                "--bind",
                LOOPBACK,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(run),
            ]
            redis = Proc("redis", argv, run / "redis.log", port, is_server=False)
            l3 = [
                "--hicache-storage-backend",
                "redis",
                "--hicache-storage-path",
                f"redis://{LOOPBACK}:{port}/0",
            ]
        else:
            l3 = [
                "--hicache-storage-backend",
                "file",
                "--hicache-storage-path",
                str(l3_dir),
                "--hicache-storage-max-gib",
                str(config.l3_max_gib),
            ]
        model = ["--model", config.model] if config.model else []

        def server(name: str, *extra: str, env: dict[str, str] | None = None) -> Proc:
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "strata.server",
                *model,
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--log-level",
                "warning",
                *config.server_args,
                *extra,
            ]
            return Proc(name, argv, run / f"{name}.log", port, env or {})

        replicas = [
            server(f"replica-{c}", "--enable-hierarchical-cache", *l3) for c in "ab"
        ]
        pd_env = {"STRATA_DISAGG_SECRET": secret}  # never on a command line
        prefill = server("prefill", "--disaggregation-mode", "prefill", env=pd_env)
        decode = server("decode", "--disaggregation-mode", "decode", env=pd_env)

        def router(name: str, *workers: str, env: dict[str, str] | None = None) -> Proc:
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "strata.router",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--log-level",
                "warning",
                *workers,
                *config.router_args,
            ]
            return Proc(
                name, argv, run / f"{name}.log", port, env or {}, is_server=False
            )

        dp = router("router", "--worker-urls", *(r.url for r in replicas))
        pd = router(
            "pd-router", "--prefill", prefill.url, "--decode", decode.url, env=pd_env
        )
        return cls(
            config, replicas, dp, prefill, decode, pd, redis, l3_dir, tmpfs, note
        )

    @property
    def servers(self) -> list[Proc]:
        return [*self.replicas, self.prefill, self.decode]

    @property
    def routers(self) -> list[Proc]:
        return [self.router, self.pd_router]

    def all(self) -> list[Proc]:
        return [p for p in (self.redis, *self.servers, *self.routers) if p is not None]

    def start(self, timeout_s: float) -> None:
        if self.redis is not None:
            self.redis.start()
            wait_port(self.redis, 10.0)
        for p in self.servers:
            p.start()
        for p in self.servers:
            wait_healthy(p, timeout_s)
        for p in self.routers:
            p.start()
        for p in self.routers:
            wait_healthy(p, 60.0)
        wait_pd_ready(self.pd_router, 60.0)
        for p in self.servers:
            p.find_engine_pid()

    def close(self) -> None:
        for p in [*self.routers, *self.servers, *([self.redis] if self.redis else [])]:
            with contextlib.suppress(Exception):
                p.stop()
        if self.tmpfs is not None:
            subprocess.run(
                ["umount", "-l", str(self.tmpfs)], capture_output=True, check=False
            )


def mount_tmpfs(path: Path, size_mib: int) -> tuple[Path | None, str]:
    """A tmpfs of `size_mib` at `path` for the file tier, so filling it gives ENOSPC; or why not."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={size_mib}m,mode=0700",
                "tmpfs",
                str(path),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"mount failed ({exc}); the ENOSPC fault is skipped"
    if done.returncode != 0:
        return (
            None,
            f"mount failed ({done.stderr.strip() or done.returncode}); the ENOSPC fault is skipped",
        )
    return path, f"a {size_mib} MiB tmpfs mounted for the L3 directory"


def wait_port(p: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((LOOPBACK, p.port), timeout=1),
        ):
            return
        if not p.alive():
            raise RuntimeError(f"{p.name} exited during start-up:\n{p.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(
        f"{p.name} did not listen on port {p.port} within {timeout_s:.0f}s"
    )


def wait_healthy(p: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not p.alive():
            raise RuntimeError(
                f"{p.name} exited during start-up (log {p.log_path}):\n{p.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(
        f"{p.name} not healthy within {timeout_s:.0f}s (log {p.log_path}):\n{p.log_tail()}"
    )


def wait_pd_ready(router: Proc, timeout_s: float) -> None:
    """The PD router learns the prefill worker's KV address from its info; wait until it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (
                "bootstrap_addr"
                in httpx.get(router.url + "/get_server_info", timeout=5).text
            ):
                return
        time.sleep(0.25)
    raise RuntimeError(
        f"the PD router did not learn the prefill worker's KV address in {timeout_s:.0f}s"
    )
