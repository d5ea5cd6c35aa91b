"""Secrets stay private: never in server info, metrics, logs or any process's command line; the
frontend <-> engine sockets are files only the server's user can open."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from strata.ports import free_port

pytestmark = pytest.mark.e2e

API_KEY = "k3y-for-clients-only"
PD_SECRET = "pd-s3cret-value-42"
REDIS_PASSWORD = "hunter2-redis-pw"


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _ipc_dirs(pid: int) -> set[Path]:
    """Directories of the unix sockets process `pid` holds open (from /proc/net/unix by inode)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    dirs = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes:
            assert not parts[7].startswith("@strata"), (
                f"abstract socket {parts[7]} has no permissions"
            )
            if parts[7].startswith("/"):
                dirs.add(Path(parts[7]).parent)
    return dirs


@pytest.fixture(scope="module")
def server():
    dead_port = free_port()  # a port nobody listens on: the L3 tier just misses
    env = {
        "STRATA_API_KEY": API_KEY,
        "STRATA_DISAGG_SECRET": PD_SECRET,
        "STRATA_HICACHE_STORAGE_PATH": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{dead_port}/0",
    }
    srv = LiveServer(
        "--hicache-storage-backend", "redis", "--log-level", "debug", env=env
    )
    srv.api_key = (
        API_KEY  # the client side sends it; the server read it from STRATA_API_KEY
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def test_secrets_never_leave(server):
    with server.client() as c:
        assert (
            httpx.get(server.url + "/get_server_info").status_code == 401
        )  # the key came from the env
        r = c.post(
            "/generate",
            json={"text": "Hello there", "sampling_params": {"max_new_tokens": 4}},
        )
        assert r.status_code == 200, r.text
        info_text = c.get("/get_server_info").text
        metrics_text = c.get("/metrics").text
    info = server.info()
    engine_pid = info["engine"]["pid"]
    assert info["engine_config"]["disaggregation_secret"] == "<redacted>"
    assert info["engine_config"]["hicache_storage_path"].startswith(
        "redis://<redacted>@127.0.0.1:"
    )
    assert info["server_config"]["api_key"] == "<redacted>"
    exposed = {
        "server info": info_text,
        "metrics": metrics_text,
        "log": server.output(),
        "frontend command line": _cmdline(server.proc.pid),
        "engine command line": _cmdline(engine_pid),
    }
    for where, text in exposed.items():
        for secret in (API_KEY, PD_SECRET, REDIS_PASSWORD):
            assert secret not in text, f"{secret!r} leaked into the {where}"


def test_ipc_sockets_live_in_a_private_directory(server):
    engine_pid = server.info()["engine"]["pid"]
    dirs = _ipc_dirs(server.proc.pid) | _ipc_dirs(engine_pid)
    assert dirs, "no filesystem sockets between frontend and engine"
    for d in dirs:
        mode = d.stat()
        assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid(), d


def test_ipc_directory_is_removed_at_exit():
    srv = LiveServer()
    try:
        srv.wait_ready()
        dirs = _ipc_dirs(srv.proc.pid)
        assert dirs
        assert srv.stop() == 0
        assert not any(d.exists() for d in dirs)
    finally:
        srv.close()
