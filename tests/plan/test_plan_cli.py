"""`strata plan` end to end through the CLI with calibration JSON (no model is run)."""

from __future__ import annotations

import json

import pytest

from strata.cli import main
from strata.plan.cost_model import CostModel, load_cost_model


def _calibration(tmp_path, cost: CostModel):
    path = tmp_path / "cal.json"
    cost.save(path)
    return str(path)


def test_simulate_prints_writes_json_and_plots(tmp_path, cost, capsys):
    cal = _calibration(tmp_path, cost)
    out = tmp_path / "sim.json"
    rc = main(
        [
            "plan",
            "simulate",
            "--calibration",
            cal,
            "--dataset",
            "shared-prefix",
            "--num-groups",
            "2",
            "--prompts-per-group",
            "4",
            "--system-len",
            "256",
            "--question-len",
            "16",
            "--output-len",
            "8",
            "--replicas",
            "2",
            "--request-rate",
            "4",
            "--output-json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT ms" in text and "cache hit rate" in text
    result = json.loads(out.read_text())["result"]
    assert result["summary"]["completed"] == 8
    assert (
        result["hit_rate"]["device"] > 0.5
    )  # cache-aware routing keeps each group on one replica
    assert (tmp_path / "plots" / "simulation.png").stat().st_size > 0


def test_simulate_compares_with_a_serving_json(tmp_path, cost, capsys):
    cal = _calibration(tmp_path, cost)
    measured = tmp_path / "serving.json"
    measured.write_text(
        json.dumps(
            {
                "benchmark": "serving",
                "results": [
                    {
                        "summary": {
                            "request_throughput": 1.0,
                            "output_throughput": 16.0,
                            "ttft": {"median_ms": 150.0, "p99_ms": 300.0},
                            "itl": {"median_ms": 12.0},
                            "e2e": {"median_ms": 400.0},
                            "usage_cache_hit_rate": 0.0,
                        }
                    }
                ],
            }
        )
    )
    rc = main(
        [
            "plan",
            "simulate",
            "--calibration",
            cal,
            "--num-prompts",
            "4",
            "--input-len",
            "128",
            "--output-len",
            "16",
            "--request-rate",
            "1",
            "--compare-json",
            str(measured),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted" in text and "measured" in text and "%" in text


def test_size_answers_with_the_cheapest_deployment(tmp_path, cost, capsys):
    cal = _calibration(tmp_path, cost)
    rc = main(
        [
            "plan",
            "size",
            "--calibration",
            cal,
            "--rate",
            "10",
            "--slo-ttft-p99",
            "1000",
            "--slo-itl-p99",
            "200",
            "--num-prompts",
            "60",
            "--input-len",
            "128",
            "--output-len",
            "16",
            "--max-workers",
            "8",
            "--no-pd",
        ]
    )
    assert rc == 0
    assert "cheapest meeting the SLO" in capsys.readouterr().out


def test_calibrate_from_figures_and_one_batch_json(tmp_path, capsys):
    figures = tmp_path / "h100.json"
    samples = []
    for b in (1, 8, 32, 128):
        samples.append(
            {
                "kind": "decode",
                "batch_size": b,
                "context_tokens": 1024,
                "seconds": 0.008 + 0.00005 * b,
            }
        )
    for n in (256, 1024, 4096):
        samples.append(
            {"kind": "prefill", "new_tokens": n, "seconds": 0.01 + 0.00004 * n}
        )
    figures.write_text(
        json.dumps(
            {
                "samples": samples,
                "kv_bytes_per_token": 131072,
                "pd_bytes_per_s": 25e9,
                "spec": {"accept_length": 2.0, "draft_length": 4},
            }
        )
    )
    out = tmp_path / "cal.json"
    assert (
        main(["plan", "calibrate", "--from-json", str(figures), "--output", str(out)])
        == 0
    )
    model = load_cost_model(out)
    assert model.kv_bytes_per_token == 131072 and model.pd_bytes_per_s == 25e9
    assert 0.4 < model.spec_accept_rate < 0.6
    assert abs(model.decode_step_s(32, 1024) - (0.008 + 0.00005 * 32)) < 0.001
    assert abs(model.prefill_s(1024) - (0.01 + 0.00004 * 1024)) < 0.003

    one_batch = tmp_path / "one_batch.json"
    one_batch.write_text(
        json.dumps(
            {
                "benchmark": "one-batch",
                "results": [
                    {
                        "batch_size": b,
                        "input_len": 256,
                        "output_len": 32,
                        "prefill_s": 0.7 * b,
                        "decode_step_ms": 25 + 6 * b,
                    }
                    for b in (1, 4, 16)
                ],
            }
        )
    )
    out2 = tmp_path / "cal2.json"
    assert (
        main(
            [
                "plan",
                "calibrate",
                "--from-json",
                str(one_batch),
                "--row-threshold",
                "32",
                "--output",
                str(out2),
            ]
        )
        == 0
    )
    assert abs(load_cost_model(out2).decode_step_s(4, 272) - 0.049) < 0.005


def test_errors_say_what_to_do(tmp_path, cost, capsys):
    cal = _calibration(tmp_path, cost)
    assert main(["plan", "size", "--calibration", cal, "--rate", "1"]) == 2
    assert "--slo-ttft-p99" in capsys.readouterr().err
    assert main(["plan", "simulate", "--calibration", str(tmp_path / "nope.json")]) == 2
    assert "strata plan calibrate" in capsys.readouterr().err
    assert main(["plan", "simulate", "--calibration", cal, "--speculative"]) == 2
    assert "accept rate" in capsys.readouterr().err


def test_a_spec_json_with_a_drafter_charges_its_forward(tmp_path, cost, capsys):
    """`strata bench spec --output-json` of a draft model or block drafter: the drafter's ms per
    call, times its calls per verifying step, is what each drafting step pays beside its rows."""
    cal = _calibration(tmp_path, cost)
    bench = tmp_path / "spec.json"
    result = {"scenario": "chat-batch1", "accept_length": 2.0, "draft_length": 4.0}
    bench.write_text(
        json.dumps(
            {
                "config": {"scenarios": ["chat-batch1"]},
                "results": [
                    {
                        **result,
                        "drafter_ms_per_call": 6.0,
                        "drafter_calls_per_verify_step": 0.5,
                    }
                ],
            }
        )
    )
    common = ["plan", "simulate", "--calibration", cal, "--speculative"]
    common += ["--dataset", "random", "--num-prompts", "2", "--output-len", "8"]
    from strata.cli import build_parser
    from strata.plan.cli import cost_model_from_args

    args = build_parser().parse_args(common + ["--spec-json", str(bench)])
    assert cost_model_from_args(args).spec_draft_s == pytest.approx(0.003)
    args = build_parser().parse_args(
        common + ["--spec-json", str(bench), "--spec-draft-ms", "1"]
    )
    assert cost_model_from_args(args).spec_draft_s == pytest.approx(0.001)
    assert main(common + ["--spec-json", str(bench)]) == 0
    capsys.readouterr()
    assert main(common + ["--spec-json", str(bench), "--spec-draft-ms", "-1"]) == 2
    assert "spec_draft_s" in capsys.readouterr().err
