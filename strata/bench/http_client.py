"""One streamed request to an OpenAI-compatible server (Strata, SGLang, vLLM, llama.cpp), timed.

The client asks for `stream: true` with `stream_options.include_usage`, and records the arrival
time of every chunk that carries content (the first one is the TTFT). Token counts come from the
final usage chunk when the server sends one; otherwise the generated text is re-tokenized with the
benchmark's tokenizer (or the number of content chunks if larger; the prompt length then is
the client's own estimate).

A request fails (and is recorded as failed, never dropped) on: a connection error or timeout, an
HTTP status other than 200, an `{"error": ...}` event in the stream, or a stream that ends with
neither `[DONE]` nor a finish_reason.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from strata.bench.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class OpenAIClient:
    """An httpx connection pool to one server; `send` runs one streamed request."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        tokenizer=None,
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.tokenizer = tokenizer

    async def close(self) -> None:
        await self.http.aclose()

    async def send(
        self, endpoint: str, body: dict[str, Any], prompt_len_estimate: int
    ) -> RequestRecord:
        """POST `body` (streamed) to `endpoint` ('completions' | 'chat'); never raises for a failed request."""
        rec = RequestRecord(start=time.perf_counter(), prompt_len=prompt_len_estimate)
        pieces: list[str] = []
        usage: dict[str, Any] | None = None
        done = finished = False
        try:
            async with self.http.stream("POST", ENDPOINTS[endpoint], json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {_error_message(detail)}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        now = time.perf_counter()
                        chunk = json.loads(data)
                        if "error" in chunk:
                            rec.error = (
                                f"stream error: {_error_message(json.dumps(chunk))}"
                            )
                            break
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices") or []:
                            piece = _content(choice, endpoint)
                            if piece:
                                rec.chunk_times.append(now)
                                pieces.append(piece)
                            finished = finished or bool(choice.get("finish_reason"))
        except httpx.HTTPError as exc:
            rec.error = (
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            )
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            rec.error = f"malformed stream: {exc}"
        rec.end = time.perf_counter()
        rec.text = "".join(pieces)
        if rec.error is None and not (done or finished):
            rec.error = "the stream ended before [DONE] or a finish_reason"
        self._count_tokens(rec, usage)
        return rec

    def _count_tokens(self, rec: RequestRecord, usage: dict[str, Any] | None) -> None:
        if usage and usage.get("prompt_tokens"):
            rec.prompt_len = int(usage["prompt_tokens"])
        details = (usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
        if usage and usage.get("completion_tokens") is not None:
            rec.output_len = int(usage["completion_tokens"])
        elif self.tokenizer is not None:
            # re-tokenizing generated text merges some tokens, while servers without usage (llama.cpp)
            # send one chunk per token: take the larger count
            retokenized = len(self.tokenizer.encode(rec.text, add_special_tokens=False))
            rec.output_len = max(retokenized, len(rec.chunk_times))
        else:
            rec.output_len = len(rec.chunk_times)


def _content(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


def _error_message(detail: str) -> str:
    try:
        obj = json.loads(detail)
    except json.JSONDecodeError:
        return detail.strip()[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]
