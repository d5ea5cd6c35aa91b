"""/v1/files and /v1/batches of a live `strata serve`, through the official OpenAI client and raw
HTTP: a batch's answers equal the same requests sent directly (greedy), failing lines go to the
error file, bad files and fields are 4xx naming what to fix, cancel, keys see only their own, and
a server killed mid-batch resumes it on restart without losing or redoing a line."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer

pytestmark = pytest.mark.e2e

KEYS = "alice alice-key-0001\nbob bob-key-00000002\n"


def chat_line(i: int, max_tokens: int = 6, **extra) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": f"count to {i}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        },
    }


def as_file(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout}s")


def start_batch(client: openai.OpenAI, lines: list[dict]):
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(as_file(lines))), purpose="batch"
    )
    return uploaded, client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def wait_answered(client: openai.OpenAI, batch_id: str, n: int, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while client.batches.retrieve(batch_id).request_counts.completed < n:
        assert time.monotonic() < deadline, f"fewer than {n} lines answered"
        time.sleep(0.05)


def jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    with LiveServer("--api-key-file", str(keys)) as srv:
        yield srv


def alice_http(srv: LiveServer) -> httpx.Client:
    return httpx.Client(
        base_url=srv.url, headers={"Authorization": "Bearer alice-key-0001"}, timeout=60
    )


def openai_client(srv: LiveServer, key: str = "alice-key-0001") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def test_a_batch_answers_as_the_same_requests_sent_directly(server):
    client = openai_client(server)
    lines = [chat_line(i) for i in range(6)]
    lines.append(chat_line(6, temperature=-1))  # the endpoint's 400
    lines.append(
        {
            "custom_id": "text",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        }
    )
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(as_file(lines))), purpose="batch"
    )
    assert uploaded.purpose == "batch" and uploaded.bytes == len(as_file(lines))
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_done(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 8
    assert done.request_counts.completed == 7 and done.request_counts.failed == 1
    out = jsonl(client.files.content(done.output_file_id).content)
    errors = jsonl(client.files.content(done.error_file_id).content)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(6)] + ["text"]
    assert [e["custom_id"] for e in errors] == ["req-6"]
    assert errors[0]["response"]["status_code"] == 400
    assert "temperature" in errors[0]["response"]["body"]["error"]["message"]
    with alice_http(server) as http:
        for line, answer in zip(lines[:6], out[:6]):
            assert answer["response"]["status_code"] == 200
            direct = http.post("/v1/chat/completions", json=line["body"]).json()
            got = answer["response"]["body"]["choices"][0]["message"]["content"]
            assert got == direct["choices"][0]["message"]["content"]
            usage = answer["response"]["body"]["usage"]
            for field in ("prompt_tokens", "completion_tokens"):
                assert usage[field] == direct["usage"][field]
    listed = client.batches.list(limit=5)
    assert done.id in [b.id for b in listed.data]


def test_batch_lines_are_counted_under_the_key_that_made_the_batch(server):
    before = httpx.get(server.url + "/metrics", headers=server.headers).text
    client = openai_client(server, "bob-key-00000002")
    uploaded, batch = start_batch(client, [chat_line(1), chat_line(2)])
    done = wait_done(client, batch.id)
    assert done.status == "completed"
    metrics = httpx.get(
        server.url + "/metrics", headers={"Authorization": "Bearer bob-key-00000002"}
    ).text

    def count(text: str) -> float:
        for line in text.splitlines():
            if line.startswith('strata:api_key_requests_total{key="bob"'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert (
        count(metrics) - count(before) >= 2 + 2
    )  # two lines, and this test's own calls
    # alice sees none of bob's files or batches
    alice = openai_client(server)
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve(done.id)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(uploaded.id)
    assert uploaded.id not in [f.id for f in alice.files.list().data]


def test_bad_files_and_fields_are_4xx_naming_what_to_fix(server):
    http = alice_http(server)

    def upload(data: bytes, purpose: str = "batch") -> httpx.Response:
        return http.post(
            "/v1/files", files={"file": ("x.jsonl", data)}, data={"purpose": purpose}
        )

    bad = [
        (b"not json\n", "line 1"),
        (as_file([chat_line(1), chat_line(1)]), "custom_id"),
        (as_file([{**chat_line(1), "method": "GET"}]), "method"),
        (as_file([{**chat_line(1), "url": "/v1/nope"}]), "url"),
        (as_file([{**chat_line(1), "body": {"stream": True}}]), "stream"),
        (b"\n\n", "no request"),
        (b"\xff\xfe", "UTF-8"),
    ]
    for data, words in bad:
        r = upload(data)
        assert r.status_code == 400, (data, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    r = upload(as_file([chat_line(1)]), purpose="fine-tune")
    assert r.status_code == 400 and "purpose" in r.json()["error"]["message"]
    r = http.post("/v1/files", json={"purpose": "batch"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    good = upload(as_file([chat_line(1)])).json()
    for body, param in [
        ({"input_file_id": good["id"], "endpoint": "/v1/x", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": good["id"], "endpoint": "/v1/chat/completions", "completion_window": "1h"}, "completion_window"),
        ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": 3, "endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
    ]:  # fmt: skip
        r = http.post("/v1/batches", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post(
        "/v1/batches",
        json={
            "input_file_id": "file-none",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert r.status_code == 404
    # a file whose lines name another endpoint than the batch's: the batch fails, naming the line
    r = http.post(
        "/v1/batches",
        json={
            "input_file_id": good["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    )
    failed = wait_done(openai_client(server), r.json()["id"])
    assert failed.status == "failed"
    assert failed.errors.data[0].line == 1
    assert "endpoint" in failed.errors.data[0].message
    assert http.get("/v1/batches/batch_none").status_code == 404
    assert http.get("/v1/files?limit=0").status_code == 400
    assert http.delete(f"/v1/files/{good['id']}").json()["deleted"] is True
    assert http.get(f"/v1/files/{good['id']}").status_code == 404
    r = http.post(f"/v1/batches/{failed.id}/cancel")
    assert r.status_code == 409
    http.close()


def test_cancel_stops_a_batch_and_keeps_what_finished(server):
    client = openai_client(server)
    lines = [chat_line(i, max_tokens=64, ignore_eos=True) for i in range(40)]
    _, batch = start_batch(client, lines)
    wait_answered(client, batch.id, 1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(client, batch.id, 60)
    assert done.status == "cancelled"
    assert 1 <= done.request_counts.completed < 40
    out = jsonl(client.files.content(done.output_file_id).content)
    assert len(out) == done.request_counts.completed
    # the server is idle again: nothing of the batch is still running
    deadline = time.monotonic() + 30
    with alice_http(server) as http:
        while http.get("/get_server_info").json()["num_running_reqs"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_killed_server_resumes_its_batch_without_losing_or_redoing_a_line(tmp_path):
    batch_dir = tmp_path / "batches"
    lines = [chat_line(i, max_tokens=48, ignore_eos=True) for i in range(24)]
    srv = LiveServer("--batch-dir", str(batch_dir), "--batch-concurrency", "4")
    with srv:
        client = openai_client(srv, "unused")
        _, batch = start_batch(client, lines)
        wait_answered(client, batch.id, 4)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
    before = _stored(batch_dir, batch.id)
    assert 4 <= len(before) < 24, "the kill came too late to test a resume"
    with LiveServer("--batch-dir", str(batch_dir)) as again:
        client = openai_client(again, "unused")
        done = wait_done(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts.completed == 24
        out = jsonl(client.files.content(done.output_file_id).content)
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]
    by_custom = {o["custom_id"]: o["id"] for o in out}
    for (
        custom_id,
        record_id,
    ) in before.items():  # answered before the kill: kept, not redone
        assert by_custom[custom_id] == record_id


def _stored(batch_dir: Path, batch_id: str) -> dict[str, str]:
    db = sqlite3.connect(batch_dir / "batches.sqlite3")
    try:
        rows = db.execute(
            "SELECT record FROM results WHERE batch_id = ?", (batch_id,)
        ).fetchall()
    finally:
        db.close()
    return {json.loads(r)["custom_id"]: json.loads(r)["id"] for (r,) in rows}
