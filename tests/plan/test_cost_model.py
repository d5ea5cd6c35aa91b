"""The cost model: features of a step, the fit recovering known coefficients, JSON, accept rates."""

from __future__ import annotations

import random

import numpy as np
import pytest

from strata.plan.cost_model import (
    FEATURES,
    CostModel,
    Sample,
    Segment,
    accept_rate_from_length,
    chunked_prefill_steps,
    fit,
    load_cost_model,
)

TRUE = {
    "overhead": 0.020,
    "overhead_large": 0.045,
    "per_row": 0.0055,
    "per_row_large": 0.0026,
    "per_decode_ctx": 3e-6,
    "per_prefill_attn": 5e-4,  # ~20% of a 2k-token prefill, as on this CPU
    "per_prefill_ctx": 0.08,  # 20 ms to gather 256 cached tokens under a short chunk
}


def _synthetic_samples(
    noise: float, seed: int = 0, request_overhead: float = 0.0
) -> list[Sample]:
    rng = random.Random(seed)
    truth = CostModel(coef=TRUE, row_threshold=32)
    out = []
    for i in range(150):
        kind = rng.choice(["decode", "prefill", "mixed"])
        segs = []
        if kind in ("decode", "mixed"):
            segs += [
                Segment(1, rng.randint(16, 3000), True)
                for _ in range(rng.randint(1, 64))
            ]
        if kind in ("prefill", "mixed"):
            segs += [
                Segment(
                    rng.choice([rng.randint(8, 64), rng.randint(8, 2048)]),
                    rng.choice([0, 0, 256, 512, 1500]),
                    False,
                )
            ]
        t = truth.step_s(segs) * (1 + rng.gauss(0, noise))
        reqs = (
            1.0
            if kind == "prefill" and request_overhead and rng.random() < 0.5
            else 0.0
        )
        s = Sample.of_steps(
            [segs], t + reqs * request_overhead, 32, f"{kind} {i}"
        )  # each its own configuration
        out.append(Sample(s.features, s.seconds, s.what, 1, reqs))
    return out


def test_the_fit_recovers_known_coefficients_exactly_without_noise():
    model = fit(_synthetic_samples(noise=0.0), row_threshold=32)
    for name in FEATURES:
        assert model.coef[name] == pytest.approx(TRUE[name], rel=1e-6), name
    assert model.fit["max_rel_err"] < 1e-9


def test_the_fit_recovers_known_coefficients_within_noise_and_the_request_overhead():
    model = fit(
        _synthetic_samples(noise=0.03, seed=1, request_overhead=0.015), row_threshold=32
    )
    for name in (
        "overhead",
        "overhead_large",
        "per_row",
        "per_row_large",
        "per_decode_ctx",
    ):
        assert model.coef[name] == pytest.approx(TRUE[name], rel=0.1), name
    assert model.coef["per_prefill_attn"] == pytest.approx(
        TRUE["per_prefill_attn"], rel=0.25
    )
    assert model.request_overhead_s == pytest.approx(0.015, rel=0.2)
    assert model.fit["median_rel_err"] < 0.04


def test_the_fit_never_returns_negative_costs():
    # times that fall with batch size would need a negative per-row cost: it is clipped to 0
    samples = [
        Sample.of_steps([[Segment(1, 100, True)] * b], 0.05 - 0.0001 * b, None)
        for b in range(1, 20)
    ]
    model = fit(samples, row_threshold=None)
    assert all(v >= 0 for v in model.coef.values())
    assert model.decode_step_s(1, 100) > 0


def test_features_of_a_step():
    # one decode at context 100 and a 50-token chunk on 200 cached tokens, below the kernel switch
    f = Sample.of_steps(
        [[Segment(1, 100, True), Segment(50, 200, False)]], 1.0, row_threshold=64
    ).features
    assert dict(zip(FEATURES, f)) == {
        "overhead": 1.0,
        "overhead_large": 0.0,
        "per_row": 51.0,
        "per_row_large": 0.0,
        "per_decode_ctx": 100.0,
        "per_prefill_attn": 50 * (200 + 25) / 1e3,
        "per_prefill_ctx": 200 / 1e3,
    }


def test_chunked_prefill_steps_follow_the_budgets():
    steps = chunked_prefill_steps(
        batch_size=3, new_len=3000, context_len=0, chunk=2048, max_batch_tokens=4096
    )
    fed = [sum(s.new_len for s in step) for step in steps]
    assert sum(fed) == 9000 and max(fed) <= 4096
    assert all(s.new_len <= 2048 for step in steps for s in step)
    # a request's second chunk sees its first chunk as context
    assert any(s.context_len == 2048 for step in steps for s in step)


def test_json_round_trip_and_errors(tmp_path):
    model = CostModel(
        coef=TRUE, row_threshold=32, kv_bytes_per_token=46080, spec_accept_rate=0.5
    )
    path = tmp_path / "cal.json"
    model.save(path)
    assert load_cost_model(path) == model
    with pytest.raises(FileNotFoundError, match="strata plan calibrate"):
        load_cost_model(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown cost-model coefficients"):
        CostModel(coef={"per_token": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(coef={"overhead": -1.0})


def test_accept_rate_inverts_the_accept_length():
    for p in (0.2, 0.5, 0.8):
        k = 4
        length = sum(p**j for j in range(k + 1))
        assert accept_rate_from_length(length, k) == pytest.approx(p, abs=1e-6)
    assert accept_rate_from_length(1.0, 4) == 0.0
    assert np.isclose(accept_rate_from_length(10.0, 4), 0.999)


def test_the_pd_handoff_fit_recovers_latency_and_bandwidth():
    from strata.plan.remote import fit_handoff

    base = CostModel(
        coef={"overhead": 0.01, "per_row_large": 0.002},
        kv_bytes_per_token=46080,
        request_overhead_s=0.05,
    )
    measured = []
    for n in (128, 512, 1024):
        local = 0.05 + base.prefill_s(n) + base.decode_step_s(1, n)
        measured.append((n, local + 0.3 + n * 46080 / 2e8))  # 300 ms + 200 MB/s
    model, rows = fit_handoff(base, measured)
    assert model.pd_latency_s == pytest.approx(0.3, rel=1e-6)
    assert model.pd_bytes_per_s == pytest.approx(2e8, rel=1e-6)
    assert len(rows) == 3 and model.coef == base.coef


def test_contention_of_co_located_workers_from_their_timings(monkeypatch):
    """Two workers on one host: a decode batch and a prompt measured on the first alone, then on
    both at once. Decode steps 1.5x slower while both are busy, prefills 1.8x: contention 0.5 and 0.8."""
    import asyncio

    from strata.bench import http_client
    from strata.bench.metrics import RequestRecord
    from strata.plan import remote

    busy: set[str] = set()

    class FakeClient:
        def __init__(self, url, api_key=None):
            self.url = url

        async def send(self, endpoint, body, prompt_len):
            busy.add(self.url)
            await asyncio.sleep(0.01)  # the other worker's load arrives in the meantime
            step = 0.02 * (1.5 if len(busy) > 1 else 1.0)
            tokens = body["max_tokens"]
            ttft = (
                0.1 * (1.8 if len(busy) > 1 else 1.0)
                if len(body["prompt"]) > 100
                else step
            )
            rec = RequestRecord(
                start=0.0, chunk_times=[ttft + i * step for i in range(tokens)]
            )
            await asyncio.sleep(0.01)
            busy.discard(self.url)
            return rec

        async def close(self):
            pass

    monkeypatch.setattr(http_client, "OpenAIClient", FakeClient)
    urls = remote._colocated_workers(
        ["http://127.0.0.1:1", "http://10.0.0.2:2", "http://127.0.0.1:3"]
    )
    assert urls == ["http://127.0.0.1:1", "http://127.0.0.1:3"]
    got = asyncio.run(
        remote._contention(
            urls, "m", None, list(range(10, 90)), remote.ServerPlan(), lambda s: None
        )
    )
    assert got == pytest.approx((0.5, 0.8), abs=1e-6)  # (decode, prefill)
    assert remote._colocated_workers([]) == []


def test_the_simulator_takes_the_calibrated_contention_unless_told(tmp_path):
    from strata.cli import build_parser
    from strata.plan.cli import deployment_from_args

    parser = build_parser()
    args = parser.parse_args(
        ["plan", "simulate", "--calibration", "x.json", "--replicas-per-host", "2"]
    )
    measured = CostModel(
        coef={"overhead": 0.01}, contention=0.4, contention_prefill=0.9
    )
    dep = deployment_from_args(args, measured)
    assert (dep.contention, dep.contention_prefill) == (0.4, 0.9)
    assert (
        deployment_from_args(args, CostModel(coef={"overhead": 0.01})).contention == 1.0
    )
    args = parser.parse_args(
        ["plan", "simulate", "--calibration", "x.json", "--contention", "0.7"]
    )
    dep = deployment_from_args(args, measured)
    assert (dep.contention, dep.contention_prefill) == (0.7, 0.7)
    with pytest.raises(ValueError, match="contention"):
        CostModel(coef={}, contention=-0.1)
