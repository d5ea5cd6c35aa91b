"""OpenAI's batch input and output lines, and running one line, shared by the server's
`/v1/batches` (strata.server.batch_api) and the offline `strata batch` (strata.offline_batch).

An input file is JSONL, one request a line:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`parse_input` checks every line before anything runs and names each bad one (its 1-based line,
a code, the field). `run_line` posts one line's body to its endpoint through any httpx client
(the server's own app in-process, or a `strata serve` over HTTP), so a line is answered exactly
as the same request sent by a client would be; it comes back as an output line:

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

Lines of the endpoints that take `priority` (chat and completions) run at least at the batch's
priority (`--batch-priority`), so a batch never outranks interactive traffic.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
PRIORITY_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 100  # reported per file; the rest are counted in the last message


@dataclass(frozen=True)
class InputLine:
    index: int  # 0-based position among the file's lines (blank lines count)
    custom_id: str
    url: str
    body: dict[str, Any]


class BatchInputError(ValueError):
    """The input file's problems, OpenAI's `errors.data` entries."""

    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = errors
        super().__init__("; ".join(error_text(e) for e in errors[:5]))


def error_text(error: dict[str, Any]) -> str:
    where = f"line {error['line']}: " if error.get("line") else ""
    return f"{where}{error['message']}"


def _error(code: str, message: str, line: int | None, param: str | None = None):
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(data: bytes, endpoint: str | None = None) -> list[InputLine]:
    """Every line of a batch input file, checked; BatchInputError lists what is wrong.
    `endpoint`: the batch's (each line's url must be it); None: any of ENDPOINTS."""
    errors: list[dict[str, Any]] = []
    lines: list[InputLine] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchInputError(
            [_error("invalid_encoding", f"the file is not UTF-8 ({exc})", None)]
        ) from None
    raw_lines = text.splitlines()
    if sum(1 for raw in raw_lines if raw.strip()) > MAX_LINES:
        raise BatchInputError(
            [
                _error(
                    "too_many_lines",
                    f"a batch holds at most {MAX_LINES} requests",
                    None,
                )
            ]
        )
    for index, raw in enumerate(raw_lines):
        number = index + 1
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as exc:
            errors.append(_error("invalid_json", f"not JSON ({exc})", number))
            continue
        if not isinstance(item, dict):
            errors.append(
                _error("invalid_request", "a line must be a JSON object", number)
            )
            continue
        problem = _line_problem(item, endpoint, seen)
        if problem is not None:
            errors.append(_error(*problem[:2], number, problem[2]))
            continue
        seen.add(item["custom_id"])
        lines.append(InputLine(index, item["custom_id"], item["url"], item["body"]))
    if not lines and not errors:
        errors.append(_error("empty_file", "the file holds no request", None))
    if errors:
        if len(errors) > MAX_ERRORS:
            rest = len(errors) - MAX_ERRORS
            errors = errors[:MAX_ERRORS]
            errors[-1] = {
                **errors[-1],
                "message": f"{errors[-1]['message']} (and {rest} more lines with errors)",
            }
        raise BatchInputError(errors)
    return lines


def _line_problem(
    item: dict[str, Any], endpoint: str | None, seen: set[str]
) -> tuple[str, str, str] | None:
    """(code, message, param) of a line's first problem, or None."""
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "invalid_request", "custom_id must be a non-empty string", "custom_id"
    if custom_id in seen:
        return (
            "duplicate_custom_id",
            f"custom_id {custom_id!r} is used by an earlier line; each must be unique",
            "custom_id",
        )
    if item.get("method") != "POST":
        return "invalid_request", 'method must be "POST"', "method"
    url = item.get("url")
    if endpoint is not None and url != endpoint:
        return (
            "mismatched_endpoint",
            f"url is {url!r} but the batch's endpoint is {endpoint!r}",
            "url",
        )
    if url not in ENDPOINTS:
        return (
            "invalid_url",
            f"url must be one of {list(ENDPOINTS)}, got {url!r}",
            "url",
        )
    body = item.get("body")
    if not isinstance(body, dict):
        return "invalid_request", "body must be a JSON object (the request)", "body"
    if body.get("stream"):
        return (
            "invalid_request",
            "a batch request cannot stream; drop body.stream",
            "body.stream",
        )
    extra = set(item) - {"custom_id", "method", "url", "body"}
    if extra:
        return (
            "invalid_request",
            f"unknown fields {sorted(extra)}; a line has custom_id, method, url and body",
            sorted(extra)[0],
        )
    return None


def request_body(line: InputLine, priority: int) -> dict[str, Any]:
    """The body sent for a line: at `priority` or lower (a larger value) where the endpoint has
    one; a wrongly typed `priority` is sent as it is, for the endpoint to answer 400."""
    body = line.body
    if line.url in PRIORITY_ENDPOINTS:
        own = body.get("priority", 0)
        if isinstance(own, int) and not isinstance(own, bool):
            body = {**body, "priority": max(own, priority)}
    return body


def output_line(
    custom_id: str,
    status: int | None,
    body: Any,
    request_id: str | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    response = (
        None
        if status is None
        else {
            "status_code": status,
            "request_id": request_id or uuid.uuid4().hex,
            "body": body,
        }
    )
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def succeeded(record: dict[str, Any]) -> bool:
    response = record.get("response")
    return response is not None and 200 <= response["status_code"] < 300


async def run_line(
    client: httpx.AsyncClient,
    line: InputLine,
    priority: int,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Send one line to its endpoint; its output line. httpx.HTTPError when the server is gone."""
    response = await client.post(
        line.url, json=request_body(line, priority), headers=headers, timeout=None
    )
    try:
        body = response.json()
    except ValueError:
        body = {
            "error": {
                "message": response.text[:2000] or f"HTTP {response.status_code}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    return output_line(
        line.custom_id,
        response.status_code,
        body,
        request_id=(body.get("id") if isinstance(body, dict) else None),
    )


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(
        json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        for r in records
    )
