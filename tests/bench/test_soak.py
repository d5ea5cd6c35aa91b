"""`strata bench soak`'s judgement, without servers: how each answer is classified, when the soak
fails, and where a 5xx is counted. (The soak itself runs in tests/e2e/test_soak_cluster.py.)"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess

import httpx
import pytest

from strata.bench.soak import SoakResult
from strata.bench.soak_config import LoadConfig
from strata.bench.soak_faults import FaultResult, fill
from strata.bench.soak_load import Load, Record


def judge(kind: str, handler) -> tuple[str, int | None, str]:
    """What the soak's client makes of `handler`'s answer to one request of `kind`."""
    load = Load(
        LoadConfig(request_timeout_s=5),
        "http://dp",
        "http://pd",
        "m",
        context_len=64,
        t0=0.0,
    )

    async def one():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await load._one(http, kind, "http://dp", random.Random(0))

    return asyncio.run(one())


def sse(*events: object) -> httpx.Response:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return httpx.Response(
        200,
        content="".join(lines).encode(),
        headers={"content-type": "text/event-stream"},
    )


def chat(content: str, finish: str = "stop", **message) -> httpx.Response:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content, **message},
        "finish_reason": finish,
    }
    return httpx.Response(200, json={"choices": [choice]})


ERROR = {
    "error": {"message": "no healthy workers", "type": "x", "param": None, "code": None}
}


@pytest.mark.parametrize(
    ("kind", "response", "outcome"),
    [
        ("chat", chat("hi"), "answered"),
        ("structured", chat('{"color":"red","ok":true}'), "answered"),
        ("structured", chat('{"color":"red",'), "lost"),  # invalid JSON for a schema
        ("structured", chat('{"color":"pink","ok":true}'), "lost"),  # breaks the schema
        (
            "structured",
            chat('{"color":"re', finish="length"),
            "answered",
        ),  # cut off by its max_tokens
        ("tool_call", chat(None, tool_calls=[]), "lost"),
        (
            "tool_call",
            chat(
                None,
                tool_calls=[
                    {
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city":"Lima"}',
                        }
                    }
                ],
            ),
            "answered",
        ),
        ("chat", httpx.Response(503, json=ERROR), "failed"),
        (
            "chat",
            httpx.Response(502, text="Bad Gateway"),
            "lost",
        ),  # a 5xx without a message
        ("bad_type", httpx.Response(400, json=ERROR), "answered"),
        ("bad_type", chat("hi"), "lost"),  # a bad request must get its 400
        ("too_long", httpx.Response(422, json=ERROR), "lost"),
        (
            "chat_stream",
            sse(
                {"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]},
                "[DONE]",
            ),
            "answered",
        ),
        (
            "chat_stream",
            sse(
                {"choices": [{"delta": {"content": "a"}}]},
                {"error": {"message": "worker died"}},
            ),
            "failed",
        ),
        (
            "chat_stream",
            sse({"choices": [{"delta": {"content": "a"}}]}),
            "lost",
        ),  # no [DONE], no error
        (
            "disconnect",
            sse(*[{"choices": [{"delta": {"content": "a"}}]}] * 3),
            "cancelled",
        ),
    ],
)
def test_each_answer_is_judged(kind, response, outcome):
    assert judge(kind, lambda request: response)[0] == outcome


def test_a_request_with_no_answer_is_lost_and_one_past_the_timeout_hung():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    assert judge("chat", refuse)[0] == "lost"

    def slow(request):
        raise httpx.ReadTimeout("slow", request=request)

    assert judge("chat", slow)[0] == "hung"


def result(records: list[Record], leaked: dict[str, int | None]) -> SoakResult:
    kv = {
        name: None if n is None else {"leaked_pages": n} for name, n in leaked.items()
    }
    fault = FaultResult("kill_replica", "replica-a", injected_at=10.0, ended_at=20.0)
    return SoakResult({}, 60.0, records, [fault], [], kv, [])


def test_the_soak_fails_on_anything_lost_hung_or_leaked_and_splits_5xx_by_fault_window():
    ok = [
        Record("chat", "dp", 1.0, 2.0, "answered", 200),
        Record("chat", "dp", 12.0, 13.0, "failed", 503, "x"),
    ]
    assert result(ok, {"replica-a": 0}).problems() == []
    assert result(
        [*ok, Record("chat", "pd", 3.0, 4.0, "lost", None)], {"replica-a": 0}
    ).problems() == ["1 requests lost"]
    assert result(ok, {"replica-a": 2}).problems() == ["replica-a: 2 KV pages leaked"]
    assert "could not be read" in result(ok, {"decode": None}).problems()[0]
    late = Record(
        "chat", "dp", 40.0, 41.0, "failed", 500, "boom"
    )  # after the window (20 s + grace)
    assert result([*ok, late], {}).server_errors() == {"fault_windows": 1, "quiet": 1}


def test_fill_writes_until_the_file_system_is_full(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        written = fill(mnt / "filler")
        assert 1.9 * 2**20 <= written <= 2 * 2**20
        with pytest.raises(OSError, match="No space"):
            (mnt / "page").write_bytes(bytes(8192))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_quiet_time_5xx_are_grouped_by_message():
    records = [
        Record(
            "chat", "pd", 40.0, 41.0, "failed", 502, "prefill worker :8001 timed out"
        ),
        Record(
            "chat", "pd", 42.0, 43.0, "failed", 502, "prefill worker :8002 timed out"
        ),
        Record("chat", "dp", 44.0, 45.0, "failed", 500, "boom"),
        Record("chat", "dp", 12.0, 13.0, "failed", 503, "in the fault window"),
        Record("chat", "dp", 46.0, 47.0, "failed", 400, "a client error"),
    ]
    assert result(records, {}).quiet_server_errors() == [
        {
            "target": "pd",
            "status": 502,
            "message": "prefill worker :N timed out",
            "count": 2,
        },
        {"target": "dp", "status": 500, "message": "boom", "count": 1},
    ]
