"""OpenAI's Files and Batch APIs: upload a JSONL of requests, run it as a batch behind
interactive traffic, download the answers.

    POST   /v1/files                  multipart `file` + `purpose` ("batch")
    GET    /v1/files                  ?purpose=&limit=&after=&order=
    GET    /v1/files/{id}             the File object
    GET    /v1/files/{id}/content     the bytes
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata}
    GET    /v1/batches                ?limit=&after=
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

`BatchRunner` runs in the frontend process, one batch at a time, oldest first: it checks the
input file (a bad file fails the batch, naming its lines), then sends up to `--batch-concurrency`
lines at once through this very app in-process (so each is answered as the same request from a
client would be, with the same validation and limits), at `--batch-priority`: the scheduler admits
interactive requests first and preempts batch rows to make room for them. Each finished line is
written to the store at once (strata.server.batch_store); a restart resumes a batch with the
lines that have no answer yet, so none is lost or answered twice. At the end the answers that
succeeded go to the output file and the others to the error file, in input order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import deque
from typing import Any

import httpx
from fastapi import APIRouter, Request, Response
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from strata.server.api_keys import current_key
from strata.server.batch_jobs import (
    ENDPOINTS,
    BatchInputError,
    InputLine,
    jsonl,
    output_line,
    parse_input,
    run_line,
    succeeded,
)
from strata.server.batch_store import BatchStore
from strata.server.protocol import APIError, CreateBatchRequest, decode_body
from strata.server.serving import get_state, json_response, read_body

logger = logging.getLogger(__name__)

router = APIRouter()

FILE_PURPOSES = ("batch",)
COMPLETION_WINDOWS = {"24h": 24 * 3600}
INTERNAL_HEADER = "x-strata-batch"  # the runner's own requests: this process's token
KEY_NAME_HEADER = "x-strata-batch-key"  # whose batch it is (counted under that key)
MAX_LIST = 100  # batches per page
MAX_FILES = 10_000  # files per page (OpenAI's default and maximum)


def _owner() -> str:
    return current_key.get() or ""


def _limit(request: Request, default: int = 20, maximum: int = MAX_LIST) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= maximum:
        raise APIError(
            400,
            f"limit must be an integer in [1, {maximum}], got {raw!r}",
            param="limit",
        )
    return int(raw)


def _runner(request: Request) -> BatchRunner:
    return get_state(request).batches


# ------------------------------------------------------------------ files


@router.post("/v1/files")
async def upload_file(request: Request) -> Response:
    runner = _runner(request)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(
            400,
            "send the file as multipart/form-data with the fields `file` and `purpose`",
        )
    try:
        form = await request.form(max_files=1, max_fields=4)
    except (MultiPartException, HTTPException, ValueError) as exc:
        detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or exc
        raise APIError(400, f"the multipart body could not be read: {detail}") from None
    try:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose not in FILE_PURPOSES:
            raise APIError(
                400,
                f"purpose must be one of {list(FILE_PURPOSES)}, got {purpose!r}",
                param="purpose",
            )
        if upload is None or isinstance(upload, str):
            raise APIError(400, "the form has no `file` part", param="file")
        data = await upload.read()
        filename = upload.filename or "upload.jsonl"
    finally:
        await form.close()
    limit = get_state(request).config.max_request_bytes
    if len(data) > limit:
        raise APIError(
            413,
            f"the file is {len(data)} bytes; this server accepts at most {limit} (see --max-request-bytes)",
        )
    try:
        parse_input(data)
    except BatchInputError as exc:
        raise APIError(
            400, f"not a valid batch input file: {exc}", param="file"
        ) from None
    doc = await asyncio.to_thread(
        runner.store.add_file, _owner(), filename, purpose, data
    )
    return json_response(doc)


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    runner = _runner(request)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(
            400, f"order must be 'asc' or 'desc', got {order!r}", param="order"
        )
    limit = _limit(request, MAX_FILES, MAX_FILES)
    files = runner.store.list_files(
        _owner(),
        request.query_params.get("purpose"),
        limit,
        request.query_params.get("after"),
        order,
    )
    return json_response(_page(files, len(files) == limit))


def _file(request: Request, file_id: str) -> dict:
    doc = _runner(request).store.get_file(_owner(), file_id)
    if doc is None:
        raise APIError(404, f"no file with id {file_id!r}", param="file_id")
    return doc


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    return json_response(_file(request, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    _file(request, file_id)
    data = await asyncio.to_thread(_runner(request).store.file_content, file_id)
    return Response(data, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    if not _runner(request).store.delete_file(_owner(), file_id):
        raise APIError(404, f"no file with id {file_id!r}", param="file_id")
    return json_response({"id": file_id, "object": "file", "deleted": True})


# ------------------------------------------------------------------ batches


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, state.config.max_request_bytes)
    req = decode_body(body, CreateBatchRequest)
    if req.endpoint not in ENDPOINTS:
        raise APIError(
            400,
            f"endpoint must be one of {list(ENDPOINTS)}, got {req.endpoint!r}",
            param="endpoint",
        )
    if req.completion_window not in COMPLETION_WINDOWS:
        raise APIError(
            400,
            f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {req.completion_window!r}",
            param="completion_window",
        )
    if req.metadata is not None and (
        len(req.metadata) > 16
        or any(len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())
    ):
        raise APIError(
            400,
            "metadata holds at most 16 pairs, keys of at most 64 and values of at most 512 characters",
            param="metadata",
        )
    runner = state.batches
    owner = _owner()
    source = runner.store.get_file(owner, req.input_file_id)
    if source is None:
        raise APIError(
            404, f"no file with id {req.input_file_id!r}", param="input_file_id"
        )
    if source["purpose"] != "batch":
        raise APIError(
            400,
            f"file {req.input_file_id!r} has purpose {source['purpose']!r}; upload it with purpose 'batch'",
            param="input_file_id",
        )
    now = int(time.time())
    doc = {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": req.endpoint,
        "errors": None,
        "input_file_id": req.input_file_id,
        "completion_window": req.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + COMPLETION_WINDOWS[req.completion_window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": req.metadata,
    }
    runner.store.add_batch(owner, doc)
    runner.wake()
    return json_response(runner.view(doc))


@router.get("/v1/batches")
async def list_batches(request: Request) -> Response:
    runner = _runner(request)
    limit = _limit(request)
    docs = runner.store.list_batches(_owner(), limit, request.query_params.get("after"))
    return json_response(_page([runner.view(d) for d in docs], len(docs) == limit))


def _batch(request: Request, batch_id: str) -> dict:
    doc = _runner(request).store.get_batch(batch_id, _owner())
    if doc is None:
        raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id")
    return doc


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    return json_response(_runner(request).view(_batch(request, batch_id)))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    runner = _runner(request)
    doc = _batch(request, batch_id)
    if doc["status"] in ("validating", "in_progress"):
        doc = runner.cancel(doc)
    elif doc["status"] not in ("cancelling", "cancelled"):
        raise APIError(
            409,
            f"batch {batch_id!r} is {doc['status']} and cannot be cancelled",
            code="batch_not_cancellable",
        )
    return json_response(runner.view(doc))


def _page(data: list[dict], maybe_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": maybe_more,
    }


# ------------------------------------------------------------------ the runner


class BatchRunner:
    """Runs the stored batches through `app` (see the module's docstring)."""

    def __init__(self, store: BatchStore, concurrency: int, priority: int):
        self.store = store
        self.concurrency = concurrency
        self.priority = priority
        self.token = secrets.token_hex(
            16
        )  # lets the runner's own requests past the API key
        self._wake = asyncio.Event()
        self._cancelled: set[str] = set()
        self._current: str | None = None
        self._tasks: list[asyncio.Task] = []

    def wake(self) -> None:
        self._wake.set()

    def view(self, doc: dict) -> dict:
        """The Batch object a client sees: with the line counts as they are now."""
        if doc["status"] in ("in_progress", "finalizing", "cancelling"):
            completed, failed = self.store.counts(doc["id"])
            doc = {
                **doc,
                "request_counts": {
                    **doc["request_counts"],
                    "completed": completed,
                    "failed": failed,
                },
            }
        return doc

    def summary(self) -> dict[str, int]:
        """For /get_server_info and the dashboard: unfinished batches and their lines."""
        pending = self.store.unfinished()
        total = done = 0
        for doc in pending:
            total += doc["request_counts"]["total"]
            done += sum(self.store.counts(doc["id"]))
        return {"unfinished": len(pending), "lines": total, "lines_done": done}

    def cancel(self, doc: dict) -> dict:
        doc = {**doc, "status": "cancelling", "cancelling_at": int(time.time())}
        self.store.save_batch(doc)
        self._cancelled.add(doc["id"])
        if self._current == doc["id"]:
            for task in self._tasks:
                task.cancel()
        self.wake()
        return doc

    async def run(self, app: Any) -> None:
        """Forever: the oldest unfinished batch, else wait for one."""
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://batch.internal"
        ) as client:
            while True:
                self._wake.clear()
                pending = await asyncio.to_thread(self.store.unfinished)
                if not pending:
                    await self._wake.wait()
                    continue
                try:
                    await self._run_batch(client, pending[0])
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a bug here must not stop later batches
                    logger.exception("batch %s failed", pending[0]["id"])
                    self._fail(
                        pending[0], "internal_error", f"{type(exc).__name__}: {exc}"
                    )

    def _fail(
        self, doc: dict, code: str, message: str, line: int | None = None
    ) -> None:
        self._finish(
            {
                **doc,
                "status": "failed",
                "failed_at": int(time.time()),
                "errors": {
                    "object": "list",
                    "data": [
                        {"code": code, "message": message, "param": None, "line": line}
                    ],
                },
            }
        )

    def _finish(self, doc: dict) -> None:
        self.store.save_batch(doc)
        self._cancelled.discard(doc["id"])

    async def _run_batch(self, client: httpx.AsyncClient, doc: dict) -> None:
        batch_id = doc["id"]
        self._current = batch_id
        try:
            data = await asyncio.to_thread(
                self.store.file_content, doc["input_file_id"]
            )
        except FileNotFoundError:
            return self._fail(
                doc,
                "file_not_found",
                f"the input file {doc['input_file_id']} was deleted",
            )
        try:
            lines = parse_input(data, doc["endpoint"])
        except BatchInputError as exc:
            doc = {**doc, "status": "failed", "failed_at": int(time.time())}
            doc["errors"] = {"object": "list", "data": exc.errors}
            return self._finish(doc)
        if doc["status"] == "validating":
            doc = {
                **doc,
                "status": "in_progress",
                "in_progress_at": int(time.time()),
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
            }
            self.store.save_batch(doc)
        if doc["status"] == "in_progress" and batch_id not in self._cancelled:
            expired = await self._run_lines(client, doc, lines)
            if expired:
                doc = {**doc, "status": "expired", "expired_at": int(time.time())}
                return await self._write_outputs(doc, lines)
        latest = self.store.get_batch(batch_id) or doc
        if latest["status"] == "cancelling" or batch_id in self._cancelled:
            doc = {**latest, "status": "cancelled", "cancelled_at": int(time.time())}
        else:
            doc = {**latest, "status": "completed", "completed_at": int(time.time())}
            doc["finalizing_at"] = int(time.time())
        await self._write_outputs(doc, lines)

    async def _run_lines(
        self, client: httpx.AsyncClient, doc: dict, lines: list[InputLine]
    ) -> bool:
        """Run the lines without an answer; True if the completion window ran out first."""
        batch_id = doc["id"]
        done = await asyncio.to_thread(self.store.done_lines, batch_id)
        queue = deque(line for line in lines if line.index not in done)
        owner = self.store.batch_owner(batch_id) or ""
        headers = {INTERNAL_HEADER: self.token, KEY_NAME_HEADER: owner}
        deadline = doc["expires_at"]
        expired = False

        async def worker() -> None:
            nonlocal expired
            while queue and not expired:
                if time.time() >= deadline:
                    expired = True
                    return
                line = queue.popleft()
                try:
                    record = await run_line(client, line, self.priority, headers)
                except httpx.HTTPError as exc:  # in-process: only a bug gets here
                    record = output_line(
                        line.custom_id,
                        500,
                        {"error": {"message": str(exc), "type": "server_error"}},
                    )
                await asyncio.to_thread(
                    self.store.add_result,
                    batch_id,
                    line.index,
                    succeeded(record),
                    record,
                )

        self._tasks = [
            asyncio.ensure_future(worker())
            for _ in range(min(self.concurrency, len(queue)))
        ]
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*self._tasks, return_exceptions=False)
        finally:
            for task in self._tasks:
                task.cancel()
            self._tasks = []
        me = asyncio.current_task()
        cancelling = getattr(me, "cancelling", None)  # Task.cancelling: Python 3.11
        if cancelling is not None and cancelling():  # the server is stopping
            raise asyncio.CancelledError
        return expired

    async def _write_outputs(self, doc: dict, lines: list[InputLine]) -> None:
        """The output and error files of what ran (expired lines as errors), and the end state."""
        batch_id = doc["id"]
        owner = self.store.batch_owner(batch_id) or ""
        ok = list(self.store.results(batch_id, True))
        failed = list(self.store.results(batch_id, False))
        if doc["status"] == "expired":
            done = self.store.done_lines(batch_id)
            failed += [
                output_line(
                    line.custom_id,
                    None,
                    None,
                    error={
                        "code": "batch_expired",
                        "message": "This request could not be executed before the completion window expired.",
                    },
                )
                for line in lines
                if line.index not in done
            ]
        for records, key in ((ok, "output_file_id"), (failed, "error_file_id")):
            if records:
                name = f"{batch_id}_{'output' if key == 'output_file_id' else 'error'}.jsonl"
                out = await asyncio.to_thread(
                    self.store.add_file, owner, name, "batch_output", jsonl(records)
                )
                doc[key] = out["id"]
        doc["request_counts"] = {
            "total": len(lines),
            "completed": len(ok),
            "failed": len(failed),
        }
        self._finish(doc)
        self._current = None
