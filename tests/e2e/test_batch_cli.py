"""`strata batch INPUT -o OUTPUT`: the answers of a batch input file, offline, in input order, with
a server of its own or a running one; --resume keeps what an interrupted run wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from live_server import LiveServer, tiny_model_dir
from test_batches import as_file, chat_line

pytestmark = pytest.mark.e2e


def strata_batch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata.cli", "batch", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_batch_runs_on_a_server_of_its_own(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat_line(i) for i in range(5)] + [chat_line(5, temperature=-1)]
    lines.append(
        {
            "custom_id": "plain",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "one two", "max_tokens": 4, "temperature": 0},
        }
    )
    source.write_bytes(as_file(lines))
    done = strata_batch(
        str(source),
        "-o",
        str(out),
        "--model",
        str(tiny_model_dir()),
        "--dtype",
        "float32",
    )
    assert done.returncode == 0, done.stderr
    assert "7 lines answered (6 succeeded, 1 failed" in done.stderr
    answers = read(out)
    assert [a["custom_id"] for a in answers] == [line["custom_id"] for line in lines]
    assert answers[5]["response"]["status_code"] == 400
    assert answers[6]["response"]["body"]["object"] == "text_completion"
    with LiveServer() as srv:  # the same answers as a server gives the same requests
        for line, answer in zip(lines[:5], answers[:5]):
            direct = httpx.post(srv.url + line["url"], json=line["body"], timeout=60)
            assert (
                answer["response"]["body"]["choices"][0]["message"]["content"]
                == direct.json()["choices"][0]["message"]["content"]
            )


def test_resume_keeps_earlier_answers_and_bad_input_names_its_line(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat_line(i) for i in range(6)]
    source.write_bytes(as_file(lines))
    with LiveServer() as srv:
        first = strata_batch(str(source), "-o", str(out), "--base-url", srv.url)
        assert first.returncode == 0, first.stderr
        answers = read(out)
        # as if the run had stopped after two answers, halfway through writing the third
        out.write_text(
            "".join(json.dumps(a) + "\n" for a in answers[:2]) + '{"id": "batch_req_'
        )
        again = strata_batch(str(str(source)), "-o", str(out), "--base-url", srv.url)
        assert again.returncode == 2 and "--resume" in again.stderr
        again = strata_batch(
            str(source), "-o", str(out), "--base-url", srv.url, "--resume"
        )
        assert again.returncode == 0, again.stderr
        assert "2 kept from before" in again.stderr
        resumed = read(out)
        assert [a["custom_id"] for a in resumed] == [f"req-{i}" for i in range(6)]
        assert [a["id"] for a in resumed[:2]] == [a["id"] for a in answers[:2]]
        for a, b in zip(resumed, answers):
            assert a["response"]["body"]["choices"] == b["response"]["body"]["choices"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(as_file([chat_line(1)]) + b"{oops\n")
    done = strata_batch(
        str(bad), "-o", str(tmp_path / "x.jsonl"), "--base-url", "http://127.0.0.1:9"
    )
    assert done.returncode == 2
    assert "line 2" in done.stderr and "not JSON" in done.stderr
