"""Per-request timings -> latency statistics and run throughput.

Definitions (those of SGLang's bench_serving, so figures compare across engines):

    TTFT  time from sending a request to its first content chunk
    ITL   the gaps between consecutive content chunks of one request (a chunk usually carries one
          token; a server that batches tokens per chunk shows fewer, longer gaps)
    TPOT  (E2E - TTFT) / (output_len - 1), per request with output_len > 1
    E2E   time from sending a request to the end of its stream

Statistics are over successful requests only; failed requests are counted in `failed`, never
dropped. Throughputs divide by the whole run's duration (first request sent -> last one ended).
Times are `time.perf_counter()` seconds; reported latencies are milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    start: float  # perf_counter when the request was sent
    end: float = 0.0  # when its stream ended (or it failed)
    chunk_times: list[float] = field(
        default_factory=list
    )  # arrival of each content chunk (absolute)
    prompt_len: int = (
        0  # from the server's usage when reported, else the client's estimate
    )
    output_len: int = (
        0  # from usage when reported, else re-tokenized text, else chunk count
    )
    cached_tokens: int | None = (
        None  # usage.prompt_tokens_details.cached_tokens, if the server says
    )
    error: str | None = None
    text: str = ""  # the generated text (multi-turn feeds it into the next turn)
    asked_output_len: int | None = (
        None  # max_tokens requested (a shorter answer is counted as short)
    )

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90, p99 (and count) of a set of latencies, in milliseconds."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    p90_ms: float | None
    p99_ms: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if len(values) == 0:
            return cls(0, None, None, None, None)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        return cls(
            count=len(ms),
            mean_ms=float(ms.mean()),
            median_ms=percentile(ms, 50),
            p90_ms=percentile(ms, 90),
            p99_ms=percentile(ms, 99),
        )


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if len(values) == 0:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class ServingSummary:
    """Whole-run figures of a serving benchmark (the steady-state window is `window.SteadyWindow`)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # generated tokens / s
    total_throughput: float  # (input + output) / s
    mean_concurrency: float  # sum of E2E / duration: requests in flight on average
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    usage_cache_hit_rate: (
        float | None
    )  # sum cached_tokens / sum prompt_tokens, if usage reported them
    short_outputs: int = 0  # successful requests that got fewer tokens than asked (EOS honoured, or truncated)
    errors: dict[str, int] = field(
        default_factory=dict
    )  # error message (first 120 chars) -> count


def summarize(
    records: Sequence[RequestRecord],
    start: float | None = None,
    end: float | None = None,
) -> ServingSummary:
    """Figures over `records`; the run spans [start, end] (default: first send .. last end)."""
    if start is None:
        start = min((r.start for r in records), default=0.0)
    if end is None:
        end = max((r.end for r in records), default=start)
    duration = max(end - start, 1e-9)
    good = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    total_in = sum(r.prompt_len for r in good)
    total_out = sum(r.output_len for r in good)
    with_cache = [r for r in good if r.cached_tokens is not None]
    hit_rate = None
    if with_cache and sum(r.prompt_len for r in with_cache) > 0:
        hit_rate = sum(r.cached_tokens or 0 for r in with_cache) / sum(
            r.prompt_len for r in with_cache
        )
    errors: dict[str, int] = {}
    for r in bad:
        key = (r.error or "unknown error")[:120]
        errors[key] = errors.get(key, 0) + 1
    return ServingSummary(
        completed=len(good),
        failed=len(bad),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(good) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_throughput=(total_in + total_out) / duration,
        mean_concurrency=sum(r.e2e for r in good) / duration,
        ttft=LatencyStats.of_seconds([r.ttft for r in good if r.ttft is not None]),
        tpot=LatencyStats.of_seconds([r.tpot for r in good if r.tpot is not None]),
        itl=LatencyStats.of_seconds([x for r in good for x in r.itls]),
        e2e=LatencyStats.of_seconds([r.e2e for r in good]),
        usage_cache_hit_rate=hit_rate,
        short_outputs=sum(
            1
            for r in good
            if r.asked_output_len is not None and r.output_len < r.asked_output_len
        ),
        errors=errors,
    )


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None/NaN (None if there are none)."""
    kept = [
        v
        for v in values
        if v is not None and not (isinstance(v, float) and math.isnan(v))
    ]
    return float(np.median(kept)) if kept else None
