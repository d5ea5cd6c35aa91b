"""`strata router --launch N`: start N local `strata serve` replicas on free ports, and stop them.

Each replica is `python -m strata.server --host 127.0.0.1 --port P <engine flags> <--replica-args>`
in its own process group (its engine dies with it), and gets SIGTERM if the router dies (Linux
PDEATHSIG). The router waits until every replica answers GET /health with 200, then serves; on exit
it stops them (SIGTERM, then SIGKILL). A replica that dies while the router runs is ejected by the
health checks like any worker; it is not restarted.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from strata.config import EngineConfig
from strata.ports import free_port
from strata.redact import env_name
from strata.server.config import ServerConfig

logger = logging.getLogger("strata.router")

STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1


def _prctl():
    try:
        return ctypes.CDLL(
            None, use_errno=True
        ).prctl  # looked up in the parent: no dlopen after fork
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM when the router dies, even by SIGKILL,
    so no replica outlives the router that launched it. Only a foreign call: no locks taken."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def engine_flags(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The EngineConfig flags given on the router's command line that differ from their defaults,
    as `strata serve` flags (`--model m --dtype float32 ...`), and the secret ones as environment
    variables (STRATA_DISAGG_SECRET=...): a command line is readable by every local user."""
    flags: list[str] = []
    env: dict[str, str] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "extra" or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if f.metadata.get("secret"):
            if value is not None:
                env[env_name(EngineConfig, f.name)] = str(value)
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if value is None or value == default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags, env


class LocalReplica:
    """One `strata serve` subprocess on a fixed port; start() again after stop() reuses the port."""

    def __init__(
        self,
        serve_flags: list[str],
        port: int | None = None,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        log_level: str = "warning",
        secret_env: dict[str, str] | None = None,
    ):
        self.host = host
        self.secret_env = dict(
            secret_env or {}
        )  # secrets reach the replica as STRATA_* variables
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.serve_flags = list(serve_flags)
        self.api_key = api_key
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "strata.server",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--log-level",
            self.log_level,
            *self.serve_flags,
        ]

    def environment(self) -> dict[str, str]:
        """The replica's environment: ours, with its secrets (the API key included) and no other."""
        key_var = env_name(ServerConfig, "api_key")
        env = {k: v for k, v in os.environ.items() if k != key_var}
        env.update(self.secret_env, PYTHONUNBUFFERED="1")
        if self.api_key:
            env[key_var] = self.api_key
        return env

    def start(self, stdout=None) -> None:
        self.proc = subprocess.Popen(
            self.command(),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            env=self.environment(),
            start_new_session=True,
            preexec_fn=_die_with_parent if _PRCTL is not None else None,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Until GET /health answers 200; RuntimeError if the process exits, TimeoutError if slow."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(
                    f"replica {self.url} exited with status {code} before it was ready"
                )
            try:
                if (
                    httpx.get(
                        self.url + "/health", timeout=2, trust_env=False
                    ).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"replica {self.url} was not ready after {timeout:.0f}s")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning(
                "replica %s did not exit in %.0fs; killing it", self.url, timeout
            )
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (frontend and engine)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def launch_replicas(
    n: int,
    serve_flags: list[str],
    *,
    api_key: str | None,
    timeout: float,
    log_level: str = "warning",
    secret_env: dict[str, str] | None = None,
) -> list[LocalReplica]:
    """Start n replicas at once and wait for all; on any failure stop them all and raise."""
    replicas = [
        LocalReplica(
            serve_flags, api_key=api_key, log_level=log_level, secret_env=secret_env
        )
        for _ in range(n)
    ]
    try:
        for r in replicas:
            r.start()
            assert r.proc is not None
            logger.info("started replica %s (pid %d)", r.url, r.proc.pid)
        deadline = time.monotonic() + timeout
        for r in replicas:
            r.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def stop_replicas(replicas: list[LocalReplica]) -> None:
    for r in replicas:
        if r.alive() and r.proc is not None:
            r.proc.send_signal(signal.SIGTERM)
    for r in replicas:
        r.stop()
