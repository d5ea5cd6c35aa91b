"""Metric arithmetic on synthetic timings: TTFT, ITL, TPOT, percentiles, throughput, the window."""

from __future__ import annotations

import pytest

from strata.bench.metrics import LatencyStats, RequestRecord, percentile, summarize
from strata.bench.server_info import (
    TokenCounters,
    hit_rate_between,
    parse_token_counters,
)
from strata.bench.window import (
    StepSample,
    completion_window,
    engine_window,
    serving_window,
)


def rec(
    start, chunks, end, out_len, prompt_len=10, error=None, cached=None
) -> RequestRecord:
    return RequestRecord(
        start=start,
        end=end,
        chunk_times=list(chunks),
        prompt_len=prompt_len,
        output_len=out_len,
        error=error,
        cached_tokens=cached,
    )


def test_ttft_itl_tpot_of_one_request():
    r = rec(1.0, [1.5, 1.6, 1.8, 2.0], 2.0, 4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.2])
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.5) / 3)


def test_tpot_undefined_for_one_token_and_no_chunks():
    assert rec(0, [0.3], 0.3, 1).tpot is None
    assert rec(0, [], 0.3, 0).ttft is None


def test_percentiles_interpolate_linearly():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    stats = LatencyStats.of_seconds([v / 1000 for v in values])
    assert (stats.count, stats.mean_ms, stats.median_ms, stats.p99_ms) == (
        100,
        pytest.approx(50.5),
        pytest.approx(50.5),
        pytest.approx(99.01),
    )
    assert LatencyStats.of_seconds([]).median_ms is None


def test_summary_counts_failures_and_excludes_them_from_latency():
    records = [
        rec(0.0, [0.1, 0.2, 0.3], 0.3, 3, prompt_len=10, cached=5),
        rec(0.0, [0.2, 0.4], 0.4, 2, prompt_len=30, cached=0),
        rec(0.1, [], 0.15, 0, error="HTTP 500: boom"),
        rec(0.1, [], 0.15, 0, error="HTTP 500: boom"),
    ]
    s = summarize(records)
    assert (s.completed, s.failed) == (2, 2)
    assert s.errors == {"HTTP 500: boom": 2}
    assert s.duration_s == pytest.approx(0.4)
    assert s.request_throughput == pytest.approx(2 / 0.4)
    assert s.output_throughput == pytest.approx(5 / 0.4)
    assert s.input_throughput == pytest.approx(40 / 0.4)
    assert s.total_throughput == pytest.approx(45 / 0.4)
    assert s.ttft.mean_ms == pytest.approx(150.0)
    assert s.itl.count == 3 and s.itl.mean_ms == pytest.approx(
        1000 * (0.1 + 0.1 + 0.2) / 3
    )
    assert s.usage_cache_hit_rate == pytest.approx(5 / 40)
    assert s.e2e.median_ms == pytest.approx(350.0)
    assert s.short_outputs == 0


def test_short_answers_are_counted():
    records = [rec(0.0, [0.1], 0.2, 1), rec(0.0, [0.1, 0.2], 0.2, 2)]
    for r in records:
        r.asked_output_len = 2
    assert summarize(records).short_outputs == 1


def test_completion_window_edges():
    assert completion_window([float(t) for t in range(1, 11)]) == (2.0, 9.0)
    assert completion_window([5.0]) is None
    assert completion_window([3.0, 3.0, 3.0]) is None
    with pytest.raises(ValueError):
        completion_window([1.0, 2.0], 0.9, 0.2)


def test_serving_window_counts_only_inside():
    # 10 requests, request i sends a chunk every 0.1 s from t=i to its end at t=i+1 (10 chunks, 10 tokens)
    records = [
        rec(float(i) - 0.5, [i + 0.1 * k for k in range(1, 11)], i + 1.0, 10)
        for i in range(10)
    ]
    w = serving_window(records)
    assert w is not None
    # finish times 1..10 -> window (2, 9]
    assert (w.start, w.end) == (2.0, 9.0)
    assert w.completed == 7  # requests finishing at 3..9
    chunks_inside = sum(1 for r in records for t in r.chunk_times if 2.0 < t <= 9.0)
    assert w.output_throughput == pytest.approx(chunks_inside / 7.0)
    assert w.mean_step_ms == pytest.approx(100.0)
    assert "estimate" in w.step_source


def test_no_window_when_requests_finish_together():
    # 10 requests over 10 s, all but one finishing within 50 ms: no steady state to measure
    records = [rec(0.0, [9.0], 10.0 + 0.005 * i, 1) for i in range(10)]
    assert serving_window(records) is None
    assert (
        completion_window([10.0 + 0.005 * i for i in range(10)]) is not None
    )  # without the run span


def test_serving_window_ignores_failed_requests():
    good = [rec(0, [0.5 + i], 1.0 + i, 1) for i in range(5)]
    bad = [rec(0, [], 100.0, 0, error="x")]
    w = serving_window(good + bad)
    assert (w.start, w.end) == (
        1.0,
        5.0,
    )  # the failed request ending at t=100 does not stretch it


def test_engine_window_means_decode_steps_inside():
    steps = [
        StepSample(
            end=float(t),
            duration_s=0.5 if t % 2 else 1.0,
            num_sampled=4,
            decode_only=t != 4,
        )
        for t in range(1, 11)
    ]
    w = engine_window(steps, finish_times=[float(t) for t in range(1, 11)])
    # window (2, 9]: steps ending at 3..9; step 4 is not decode-only
    assert w.mean_step_ms == pytest.approx(
        1000 * (0.5 + 0.5 + 1.0 + 0.5 + 1.0 + 0.5) / 6
    )
    assert w.output_throughput == pytest.approx(7 * 4 / 7.0)
    assert w.step_source == "engine decode steps"


def test_prometheus_counters_and_hit_rate_delta():
    page = '# HELP x\nstrata:prompt_tokens_total{model_name="m"} 100.0\nstrata:cached_tokens_total{model_name="m"} 25\nother 3\n'
    assert parse_token_counters(page) == TokenCounters(100.0, 25.0)
    assert parse_token_counters("nothing here 1") is None
    assert hit_rate_between(
        TokenCounters(100, 25), TokenCounters(300, 125)
    ) == pytest.approx(0.5)
    assert hit_rate_between(None, TokenCounters(1, 1)) is None
