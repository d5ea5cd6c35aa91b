"""`strata bench timing`: one deployment timed by fixed batches and by the completion window."""

from __future__ import annotations

import json

import pytest
from test_bench_cli import parse

from strata import Engine
from strata.bench.timing import run_timing_methods, spread_lengths


def test_output_lengths_spread_over_the_range():
    assert spread_lengths(5, 100, 0.2) == [20, 40, 60, 80, 100]
    assert spread_lengths(1, 100, 0.2) == [100]
    assert min(spread_lengths(64, 128, 0.25)) == 32


def test_both_methods_on_one_engine(llama_dir):
    engine = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=4096)
    c = run_timing_methods(
        engine, batch_size=16, input_len=24, output_len=40, prefill_batches=3
    )
    assert len(c.fixed.prefill_tok_s) == 3 and min(c.fixed.prefill_tok_s) > 0
    # every step after the batch's first tokens decodes all 16: 39 of them
    assert len(c.fixed.decode_step_ms) == 39
    assert c.window.output_lens == spread_lengths(16, 40, 0.25)
    assert c.window.window is not None  # requests finish one after another
    assert 0 < c.window.window.completed <= 16
    s = c.summary()
    assert s["fixed_output_tok_s"] == pytest.approx(
        16_000 / c.fixed.decode_step_ms_median
    )
    assert s["fixed_over_window_output"] == pytest.approx(
        s["fixed_output_tok_s"] / s["window_output_tok_s"]
    )
    engine.scheduler.check_no_leaks()


def test_the_timing_command_reports_both_side_by_side(llama_dir, tmp_path, capsys):
    out = tmp_path / "timing.json"
    args = parse(
        [
            "timing",
            "--model",
            str(llama_dir),
            "--dtype",
            "float32",
            "--batch-size",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "24",
            "--prefill-batches",
            "2",
            "--output-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "fixed batches" in text and "20%-90% window" in text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "timing"
    assert len(data["results"]["fixed"]["prefill_tok_s"]) == 2
    assert data["results"]["summary"]["fixed_prefill_tok_s"] > 0
