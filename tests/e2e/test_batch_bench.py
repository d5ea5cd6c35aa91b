"""`strata bench batch` against a live server: alone and with-batch runs alternate, the batch runs
meanwhile and is stopped after each, and the report has the medians and the p99 TTFT ratio."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from live_server import LiveServer, tiny_model_dir

pytestmark = pytest.mark.e2e


def test_bench_batch_measures_interactive_latency_beside_a_batch(tmp_path):
    out = tmp_path / "batch.json"
    with LiveServer() as srv:
        done = subprocess.run(
            [
                sys.executable, "-m", "strata.cli", "bench", "batch",
                "--base-url", srv.url, "--tokenizer", str(tiny_model_dir()),
                "--endpoint", "chat", "--rounds", "2", "--num-prompts", "6",
                "--input-len", "24", "--output-len", "8", "--request-rate", "20",
                "--batch-lines", "60", "--batch-input-words", "8",
                "--batch-output-len", "24", "--disable-progress",
                "--output-json", str(out),
            ],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        batches = httpx.get(srv.url + "/v1/batches", timeout=30).json()["data"]
        assert len(batches) == 2
        assert all(b["status"] in ("cancelled", "completed") for b in batches)
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        assert info["batches"]["unfinished"] == 0
    result = json.loads(out.read_text())["results"]
    runs = result["runs"]
    assert [r["with_batch"] for r in runs] == [False, True, True, False]
    assert all(r["failed"] == 0 and r["ttft_p99_ms"] > 0 for r in runs)
    assert all(r["batch_lines_per_s"] > 0 for r in runs if r["with_batch"])
    assert result["summary"]["ttft_p99_ratio"] > 0
    assert "interactive TTFT with the batch / alone" in done.stdout
