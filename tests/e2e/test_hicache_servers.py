"""Two server processes sharing one L3 backend (a directory with default flags, then Redis with
explicit ones): a long prefix computed on the first is a storage hit on the second, and the tiers
show in meta info, server info and metrics."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from live_server import LiveServer, free_port

pytestmark = pytest.mark.e2e

DOC = [
    (i * 7 + 3) % 370 + 5 for i in range(400)
]  # above the default 256-token prefetch threshold


def hicache_args(backend: str, path: str) -> list[str]:
    return [
        "--page-size",
        "4",
        "--kv-cache-tokens",
        "1024",
        "--hicache-storage-backend",
        backend,
        "--hicache-storage-path",
        path,
        "--hicache-prefetch-policy",
        "wait_complete",
        "--hicache-prefetch-threshold",
        "16",
    ]


def generate(server: LiveServer, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    with server.client() as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def shared_prefix_hits(args: list[str]) -> None:
    a, b = LiveServer(*args), LiveServer(*args)
    try:
        a.wait_ready()
        b.wait_ready()
        first = generate(a, DOC + [1, 2, 3])
        time.sleep(1.0)  # write-through to L3 runs in the background
        second = generate(b, DOC + [9, 9, 9])
        meta = second["meta_info"]
        assert meta["cached_tokens"] >= len(DOC) - 4, meta
        assert meta["cached_tokens_details"]["storage"] >= len(DOC) - 4, meta
        again = generate(b, DOC + [1, 2, 3])
        assert again["output_ids"] == first["output_ids"]
        info = b.info()["hicache"]
        assert (
            info["hit_tokens"]["storage"] >= len(DOC) - 4
            and info["bytes_from_storage"] > 0
        )
        with b.client() as c:
            metrics = c.get("/metrics").text
        assert (
            "strata:hicache_hit_tokens{model_name=" in metrics
            and 'tier="storage"' in metrics
        )
    finally:
        a.close()
        b.close()


def test_two_servers_share_a_file_backend_with_default_flags(tmp_path):
    # the default prefetch policy (auto) waits for L3 while fetching beats recomputing
    shared_prefix_hits(
        [
            "--hicache-storage-backend",
            "file",
            "--hicache-storage-path",
            str(tmp_path / "l3"),
        ]
    )


def test_two_servers_share_a_redis_backend(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(
            "redis-server is not installed (CI installs it: apt-get install redis-server)"
        )
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        import redis

        while time.monotonic() < deadline:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        shared_prefix_hits(hicache_args("redis", f"redis://127.0.0.1:{port}/0"))
    finally:
        proc.kill()
        proc.wait()
