"""Workloads from a trace and in bursts; and engine calibration end to end on a tiny random model."""

from __future__ import annotations

import json

import pytest

from strata.bench.datasets import DatasetConfig
from strata.plan.workload import dataset_workload, poisson_arrivals, trace_workload


def test_a_trace_shares_prefixes_and_chains_conversation_turns(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "t": 0.0,
            "input_len": 300,
            "output_len": 8,
            "prefix_id": "sys",
            "prefix_len": 256,
        },
        {
            "t": 0.5,
            "input_len": 280,
            "output_len": 4,
            "prefix_id": "sys",
            "prefix_len": 256,
        },
        {"t": 1.0, "input_len": 50, "output_len": 10, "conversation": "c1"},
        {"t": 9.0, "input_len": 20, "output_len": 5, "conversation": "c1"},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    wl = trace_workload(trace)
    assert wl.arrivals == [0.0, 0.5, 1.0]
    a, b, conv = wl.conversations
    assert (
        a[0].prompt[:256] == b[0].prompt[:256]
        and a[0].prompt[256:] != b[0].prompt[256:]
    )
    assert (a[0].prompt_len, a[0].output_len, b[0].prompt_len) == (300, 8, 280)
    first, second = conv
    assert (
        second.prompt == first.prompt + first.answer + second.prompt[60:]
    )  # the history, then 20 new tokens
    assert second.prompt_len == 50 + 10 + 20
    trace.write_text('{"t": 0, "input_len": 5}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        trace_workload(trace)


def test_bursts_arrive_together_at_the_same_mean_rate():
    times = poisson_arrivals(800, rate=4.0, seed=0, burst_size=8)
    assert times[:8] == [0.0] * 8 and times[8] > 0 and len(set(times)) == 100
    assert 800 / times[-1] == pytest.approx(4.0, rel=0.2)
    wl = dataset_workload(
        DatasetConfig(num_prompts=16, input_len=32, output_len=4),
        rate=2.0,
        arrival="burst",
        burst_size=4,
    )
    assert len(set(wl.arrivals)) == 4


@pytest.mark.e2e
def test_engine_calibration_fits_a_tiny_model(tmp_path):
    """The engine source end to end (it wraps the scheduler's `schedule`: fails loudly if that changes)."""
    from tiny_models import make_model

    from strata.engine.engine import Engine
    from strata.plan.calibrate import EnginePlan, calibrate_engine

    engine = Engine(
        str(make_model(tmp_path / "llama", "llama")),
        kv_cache_tokens=4096,
        num_threads=1,
    )
    plan = EnginePlan(
        prefill_lens=(16, 64),
        cached_prefills=((64, 16),),
        decode_batches=(1, 4),
        decode_contexts=(16, 96),
        decode_steps=3,
        mixed=True,
    )
    model, samples = calibrate_engine(engine, plan)
    engine.close()
    kinds = {s.what.split(":")[0] for s in samples}
    assert kinds == {"prefill step", "decode step", "mixed step"}
    assert (
        model.kv_bytes_per_token > 0
        and model.host_bytes_per_s > 0
        and model.pd_bytes_per_s > 0
    )
    assert model.prefill_s(64) > 0 and model.decode_step_s(4, 96) > 0
