"""The serving benchmark: drive any OpenAI-compatible server with a dataset and measure it.

Arrivals: conversation i arrives at the i-th point of a Poisson process of `request_rate`
conversations per second (all at t=0 when the rate is inf); `max_concurrency` caps the requests
in flight (a request that arrives while the cap is reached waits, and its TTFT counts from when it
is actually sent). A multi-turn conversation sends its next turn as soon as the previous answer
ended, with that answer in the history. If a turn fails, the remaining turns of its conversation
are recorded as failed (they cannot be sent without the answer), so nothing is silently dropped.

Before timing, `num_warmup` short requests with fresh random text are sent (one at a time): they
warm the server up without seeding its prefix cache with the benchmark's prompts, and a server
that cannot answer them stops the run with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.bench import server_info
from strata.bench.datasets import (
    TURN_SEPARATOR,
    Conversation,
    Turn,
    num_requests,
    token_text,
    vocab_pool,
)
from strata.bench.http_client import ENDPOINTS, OpenAIClient
from strata.bench.metrics import RequestRecord, ServingSummary, summarize
from strata.bench.progress import Progress
from strata.bench.window import SteadyWindow, serving_window
from strata.redact import SECRET

WARMUP_INPUT_LEN = 32
WARMUP_OUTPUT_LEN = 8

# How a request asks for exactly max_tokens tokens (servers differ; an unknown field may be rejected):
#   ignore_eos         `"ignore_eos": true` (Strata, SGLang, vLLM)
#   logit_bias         `"logit_bias": {eos: -100}` for the tokenizer's special tokens (plain OpenAI; llama.cpp)
#   generation_config  transformers serve: `"generation_config": "{min_new_tokens: n, max_new_tokens: n}"`
#   none               nothing: answers may stop early at EOS (then output lengths differ between servers)
LENGTH_CONTROLS = ("ignore_eos", "logit_bias", "generation_config", "none")


@dataclass(frozen=True)
class ServingConfig:
    base_url: str
    endpoint: str = "completions"  # completions | chat
    model: str | None = (
        None  # the `model` field of requests; None: the first of GET /v1/models
    )
    request_rate: float = (
        math.inf
    )  # conversations per second (Poisson); inf: all at once
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    num_warmup: int = 1
    temperature: float = 0.0
    length_control: str = (
        "ignore_eos"  # how to ask for exactly output_len tokens; see LENGTH_CONTROLS
    )
    send_token_ids: bool = (
        False  # completions: send the prompt as token ids (exact lengths)
    )
    extra_body: dict[str, Any] = field(
        default_factory=dict
    )  # merged into every request body
    api_key: str | None = field(default=None, metadata=SECRET)
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"endpoint must be one of {tuple(ENDPOINTS)}, got {self.endpoint!r}"
            )
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf for all at once), got {self.request_rate}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(
                f"max_concurrency must be >= 1, got {self.max_concurrency}"
            )
        if self.length_control not in LENGTH_CONTROLS:
            raise ValueError(
                f"length_control must be one of {LENGTH_CONTROLS}, got {self.length_control!r}"
            )
        if self.send_token_ids and self.endpoint != "completions":
            raise ValueError(
                "send_token_ids works with the completions endpoint only; drop it or use --endpoint completions"
            )


@dataclass
class ServingResult:
    config: ServingConfig
    model: str
    records: list[RequestRecord]
    summary: ServingSummary  # whole run
    window: SteadyWindow | None  # 20%..90% of requests completed
    server_cache_hit_rate: (
        float | None
    )  # from the server: this run's /metrics delta, else /get_server_info
    server_cache_hit_rate_source: str | None
    # a Strata server on this machine: CPU milliseconds its frontend / engine process spent per output
    # token of the run (HTTP, detokenizing, streaming vs the model); {} for other servers
    server_cpu_ms_per_output_token: dict[str, float] = field(default_factory=dict)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start): 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


class RequestBuilder:
    """Request bodies for one conversation turn, for the completions or chat endpoint."""

    def __init__(self, config: ServingConfig, model: str, tokenizer):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer

    def body(
        self, conv: Conversation, turn: int, history: list[str]
    ) -> tuple[dict[str, Any], int]:
        """(body, prompt length estimate); `history` holds the answers of turns 0..turn-1."""
        cfg = self.config
        out_len = conv.turns[turn].output_len
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": out_len,
            "temperature": cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cfg.length_control == "ignore_eos":
            body["ignore_eos"] = True
        elif cfg.length_control == "logit_bias":
            body["logit_bias"] = {str(t): -100 for t in self._stop_ids()}
        elif cfg.length_control == "generation_config":
            body["generation_config"] = json.dumps(
                {
                    "min_new_tokens": out_len,
                    "max_new_tokens": out_len,
                    "do_sample": cfg.temperature > 0,
                }
            )
        if cfg.endpoint == "chat":
            messages = (
                [{"role": "system", "content": conv.system.text}] if conv.system else []
            )
            for k in range(turn):
                messages.append({"role": "user", "content": conv.turns[k].text})
                messages.append({"role": "assistant", "content": history[k]})
            messages.append({"role": "user", "content": conv.turns[turn].text})
            body["messages"] = messages
            estimate = self._estimate_chat(messages)
        else:
            parts = [conv.system.text] if conv.system else []
            for k in range(turn):
                parts += [conv.turns[k].text, history[k], TURN_SEPARATOR]
            parts.append(conv.turns[turn].text)
            text = "".join(parts)
            if cfg.send_token_ids:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                body["prompt"], estimate = ids, len(ids)
            else:
                body["prompt"] = text
                estimate = (
                    conv.first_prompt_len
                    if turn == 0
                    else len(self.tokenizer.encode(text, add_special_tokens=False))
                )
        body.update(cfg.extra_body)
        return body, estimate

    def _stop_ids(self) -> list[int]:
        ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def _estimate_chat(self, messages: list[dict[str, str]]) -> int:
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return len(ids)
        return sum(
            len(self.tokenizer.encode(m["content"], add_special_tokens=False))
            for m in messages
        )


def run_serving(
    config: ServingConfig, conversations: list[Conversation], tokenizer
) -> ServingResult:
    """Run the benchmark (blocking). Raises RuntimeError if the server cannot be used at all."""
    base = config.base_url.rstrip("/")
    model = config.model or server_info.first_model(base, config.api_key)
    if model is None:
        raise RuntimeError(
            f"{base}/v1/models lists no model and none was given; is the server up? Pass --model NAME"
        )
    pids = server_info.server_pids(server_info.server_info(base, config.api_key))
    records, start, before, cpu_before = asyncio.run(
        _drive(config, model, conversations, tokenizer, pids)
    )
    cpu_after = server_info.cpu_seconds(pids)
    after = server_info.token_counters(base, config.api_key)
    rate, source = (
        server_info.hit_rate_between(before, after),
        "/metrics counters (this run)",
    )
    if rate is None:
        info = server_info.server_info(base, config.api_key)
        rate = info.get("cache_hit_rate") if info else None
        source = "/get_server_info (since server start)"
    summary = summarize(records, start=start)
    tokens = summary.total_output_tokens
    cpu_ms = {
        name: 1e3 * (cpu_after[name] - cpu_before[name]) / tokens
        for name in cpu_before
        if name in cpu_after and tokens
    }
    return ServingResult(
        config=config,
        model=model,
        records=records,
        summary=summary,
        window=serving_window(records),
        server_cache_hit_rate=rate,
        server_cache_hit_rate_source=source if rate is not None else None,
        server_cpu_ms_per_output_token=cpu_ms,
    )


async def _drive(
    config: ServingConfig,
    model: str,
    conversations: list[Conversation],
    tokenizer,
    pids: dict[str, int],
) -> tuple[
    list[RequestRecord], float, server_info.TokenCounters | None, dict[str, float]
]:
    """Warm up, read the server's token counters (and its processes' CPU time), then run every
    conversation; (records, start, counters, CPU seconds)."""
    client = OpenAIClient(
        config.base_url,
        api_key=config.api_key,
        timeout_s=config.timeout_s,
        tokenizer=tokenizer,
    )
    builder = RequestBuilder(config, model, tokenizer)
    try:
        await _warmup(client, builder, config, tokenizer)
        before = await asyncio.to_thread(
            server_info.token_counters, config.base_url.rstrip("/"), config.api_key
        )
        cpu_before = server_info.cpu_seconds(pids)
        records: list[RequestRecord] = []
        limit = (
            asyncio.Semaphore(config.max_concurrency)
            if config.max_concurrency
            else None
        )
        arrivals = poisson_arrivals(
            len(conversations), config.request_rate, config.seed
        )
        with Progress(num_requests(conversations), "requests", config.progress) as bar:
            start = time.perf_counter()

            async def one(conv: Conversation, offset: float) -> None:
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                history: list[str] = []
                for turn in range(len(conv.turns)):
                    body, estimate = builder.body(conv, turn, history)
                    async with limit if limit is not None else contextlib.nullcontext():
                        rec = await client.send(config.endpoint, body, estimate)
                    rec.asked_output_len = conv.turns[turn].output_len
                    records.append(rec)
                    bar.update()
                    if not rec.ok:
                        now = time.perf_counter()
                        for _ in range(turn + 1, len(conv.turns)):
                            records.append(
                                RequestRecord(
                                    start=now,
                                    end=now,
                                    error=f"not sent: turn {turn} of its conversation failed",
                                )
                            )
                            bar.update()
                        return
                    history.append(rec.text)

            await asyncio.gather(*(one(c, t) for c, t in zip(conversations, arrivals)))
        return records, start, before, cpu_before
    finally:
        await client.close()


async def _warmup(
    client: OpenAIClient, builder: RequestBuilder, config: ServingConfig, tokenizer
) -> None:
    rng = random.Random(config.seed ^ 0x5EED)
    pool = vocab_pool(tokenizer)
    for _ in range(config.num_warmup):
        turn = token_text(tokenizer, rng, WARMUP_INPUT_LEN, pool)
        conv = Conversation((Turn(turn.text, turn.ids, WARMUP_OUTPUT_LEN),))
        body, estimate = builder.body(conv, 0, [])
        rec = await client.send(config.endpoint, body, estimate)
        if not rec.ok:
            raise RuntimeError(
                f"the warm-up request to {config.base_url} failed ({rec.error}); is the server up and the model name right?"
            )
