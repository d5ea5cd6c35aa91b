"""The serving client and driver against a fake OpenAI-compatible server (tests/bench/conftest.py)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from strata.bench.datasets import DatasetConfig, make_dataset
from strata.bench.serving import ServingConfig, poisson_arrivals, run_serving


def cfg(server, **kw) -> ServingConfig:
    return ServingConfig(base_url=server.base_url, progress=False, **kw)


def dataset(tok, **kw):
    base = {"name": "random", "num_prompts": 8, "input_len": 12, "output_len": 5}
    return make_dataset(DatasetConfig(**{**base, **kw}), tok)


def test_completes_every_request_with_usage_counts(fake_server, tiny_tokenizer):
    fake_server.reset()
    r = run_serving(cfg(fake_server), dataset(tiny_tokenizer), tiny_tokenizer)
    s = r.summary
    assert (s.completed, s.failed) == (8, 0)
    assert r.model == "fake-model"
    assert all(x.output_len == 5 and len(x.chunk_times) == 5 for x in r.records)
    assert s.total_output_tokens == 40
    assert s.ttft.count == 8 and s.ttft.median_ms > 0
    assert s.itl.count == 8 * 4
    body = fake_server.state.bodies[-1]
    assert (
        body["max_tokens"] == 5
        and body["ignore_eos"] is True
        and body["stream"] is True
    )
    assert body["stream_options"] == {"include_usage": True}
    assert fake_server.state.count == 9  # one warm-up request + 8


def test_failed_requests_are_counted_not_dropped(fake_server, tiny_tokenizer):
    fake_server.reset(fail_every=3, error_every=5)
    r = run_serving(
        cfg(fake_server, num_warmup=0, max_concurrency=2),
        dataset(tiny_tokenizer, num_prompts=15),
        tiny_tokenizer,
    )
    s = r.summary
    assert len(r.records) == 15
    assert s.completed + s.failed == 15
    # numbers 3,6,9,12,15 -> HTTP 500; 5 and 10 -> stream error (15 is already a 500)
    assert s.failed == 7
    assert (
        sum(
            n
            for msg, n in s.errors.items()
            if "HTTP 500" in msg and "injected failure" in msg
        )
        == 5
    )
    assert sum(n for msg, n in s.errors.items() if "stream error" in msg) == 2
    assert s.ttft.count == s.completed


def test_warmup_failure_stops_with_a_clear_error(fake_server, tiny_tokenizer):
    fake_server.reset(fail_every=1)
    with pytest.raises(RuntimeError, match="warm-up"):
        run_serving(cfg(fake_server), dataset(tiny_tokenizer), tiny_tokenizer)


def test_unreachable_server_fails_requests_not_the_run(tiny_tokenizer):
    c = ServingConfig(
        base_url="http://127.0.0.1:9",
        model="m",
        num_warmup=0,
        progress=False,
        timeout_s=5,
    )
    r = run_serving(c, dataset(tiny_tokenizer, num_prompts=3), tiny_tokenizer)
    assert (r.summary.completed, r.summary.failed) == (0, 3)


def test_without_usage_output_is_counted_from_text(fake_server, tiny_tokenizer):
    fake_server.reset(include_usage=False)
    r = run_serving(
        cfg(fake_server), dataset(tiny_tokenizer, num_prompts=3), tiny_tokenizer
    )
    retokenized = len(
        tiny_tokenizer.encode("tok0 tok1 tok2 tok3 tok4 ", add_special_tokens=False)
    )
    assert [x.output_len for x in r.records] == [
        max(retokenized, 5)
    ] * 3  # 5 chunks of one token each
    assert all(x.cached_tokens is None for x in r.records)


def test_max_concurrency_caps_requests_in_flight(fake_server, tiny_tokenizer):
    fake_server.reset(token_delay_s=0.01)
    run_serving(
        cfg(fake_server, max_concurrency=3, num_warmup=0),
        dataset(tiny_tokenizer, num_prompts=10),
        tiny_tokenizer,
    )
    assert fake_server.state.max_in_flight == 3


def test_multi_turn_chat_sends_history_and_waits_for_answers(
    fake_server, tiny_tokenizer
):
    fake_server.reset()
    convs = dataset(
        tiny_tokenizer, name="multi-turn", num_prompts=2, num_turns=3, output_len=3
    )
    r = run_serving(
        cfg(fake_server, endpoint="chat", num_warmup=0), convs, tiny_tokenizer
    )
    assert r.summary.completed == 6
    bodies = fake_server.state.bodies
    third = [b for b in bodies if len(b["messages"]) == 5]
    assert len(third) == 2
    for b in third:
        assert [m["role"] for m in b["messages"]] == [
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
        ]
        assert b["messages"][1]["content"] == "tok0 tok1 tok2 "
    # each turn starts only after the previous turn of its conversation ended
    events = fake_server.state.events
    for conv in convs:
        numbers = [
            i + 1
            for i, b in enumerate(bodies)
            if b["messages"][0]["content"] == conv.turns[0].text
        ]
        for prev, nxt in itertools.pairwise(numbers):
            end_prev = next(t for kind, n, t in events if kind == "end" and n == prev)
            start_next = next(
                t for kind, n, t in events if kind == "start" and n == nxt
            )
            assert start_next > end_prev


def test_failed_turn_fails_the_rest_of_its_conversation(fake_server, tiny_tokenizer):
    fake_server.reset(fail_every=2)
    convs = dataset(tiny_tokenizer, name="multi-turn", num_prompts=1, num_turns=4)
    r = run_serving(cfg(fake_server, num_warmup=0), convs, tiny_tokenizer)
    assert (r.summary.completed, r.summary.failed) == (1, 3)
    assert fake_server.state.count == 2


def test_shared_prefix_cache_hit_rate_from_server_and_usage(
    fake_server, tiny_tokenizer
):
    fake_server.reset()
    convs = dataset(
        tiny_tokenizer,
        name="shared-prefix",
        num_groups=2,
        prompts_per_group=4,
        system_len=30,
        question_len=5,
    )
    r = run_serving(cfg(fake_server, max_concurrency=1), convs, tiny_tokenizer)
    assert r.server_cache_hit_rate_source == "/metrics counters (this run)"
    assert r.server_cache_hit_rate > 0.3
    assert r.summary.usage_cache_hit_rate == pytest.approx(r.server_cache_hit_rate)


def test_token_id_prompts(fake_server, tiny_tokenizer):
    fake_server.reset()
    convs = dataset(tiny_tokenizer, num_prompts=2)
    run_serving(
        cfg(fake_server, send_token_ids=True, num_warmup=0), convs, tiny_tokenizer
    )
    assert fake_server.state.bodies[0]["prompt"] in [
        list(c.turns[0].ids) for c in convs
    ]


def test_poisson_arrivals_deterministic_with_the_right_rate():
    a = poisson_arrivals(2000, 4.0, seed=1)
    assert a == poisson_arrivals(2000, 4.0, seed=1)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert a[-1] / 1999 == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_request_rate_spreads_the_run(fake_server, tiny_tokenizer):
    fake_server.reset()
    r = run_serving(
        cfg(fake_server, request_rate=20.0, num_warmup=0),
        dataset(tiny_tokenizer, num_prompts=6),
        tiny_tokenizer,
    )
    starts = sorted(x.start for x in r.records)
    expected = poisson_arrivals(6, 20.0, seed=0)[-1]
    assert starts[-1] - starts[0] == pytest.approx(expected, abs=0.05)


def test_cli_serving_writes_json_and_plots(
    fake_server, tiny_tokenizer, llama_dir, tmp_path, capsys
):
    pytest.importorskip("matplotlib")
    from strata.bench.cli import cmd_serving

    fake_server.reset()
    args = _parse(
        [
            "serving",
            "--base-url",
            fake_server.base_url,
            "--tokenizer",
            str(llama_dir),
            "--num-prompts",
            "6",
            "--input-len",
            "10",
            "--output-len",
            "4",
            "--max-concurrency",
            "1",
            "4",
            "--disable-progress",
            "--output-json",
            str(tmp_path / "out.json"),
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert cmd_serving(args) == 0
    out = capsys.readouterr().out
    assert (
        "TTFT median (ms)" in out
        and "steady output throughput (tok/s)" in out
        and "failed requests" in out
    )
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["benchmark"] == "serving" and len(data["results"]) == 2
    assert data["results"][0]["summary"]["completed"] == 6
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {
        "throughput_vs_concurrency.png",
        "ttft_distribution.png",
    }


def _parse(argv: list[str]):
    import argparse

    from strata.bench.cli import add_bench_args

    parser = argparse.ArgumentParser()
    add_bench_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_length_controls_for_servers_without_ignore_eos(fake_server, tiny_tokenizer):
    fake_server.reset()
    convs = dataset(tiny_tokenizer, num_prompts=1)
    run_serving(
        cfg(fake_server, length_control="logit_bias", num_warmup=0),
        convs,
        tiny_tokenizer,
    )
    body = fake_server.state.bodies[-1]
    assert (
        "ignore_eos" not in body
        and body["logit_bias"][str(tiny_tokenizer.eos_token_id)] == -100
    )
    run_serving(
        cfg(fake_server, length_control="generation_config", num_warmup=0),
        convs,
        tiny_tokenizer,
    )
    body = fake_server.state.bodies[-1]
    assert json.loads(body["generation_config"]) == {
        "min_new_tokens": 5,
        "max_new_tokens": 5,
        "do_sample": False,
    }
    with pytest.raises(ValueError, match="length_control"):
        cfg(fake_server, length_control="please")


def test_server_cpu_per_output_token_of_a_local_server(fake_server, tiny_tokenizer):
    """A server on this machine that names its processes in /get_server_info gets their CPU time per
    output token measured over the run (the fake one: the test's own process, so it cannot be 0)."""
    fake_server.reset()
    r = run_serving(cfg(fake_server), dataset(tiny_tokenizer), tiny_tokenizer)
    assert set(r.server_cpu_ms_per_output_token) == {
        "frontend"
    }  # it names no engine process
    assert r.server_cpu_ms_per_output_token["frontend"] > 0


def test_server_processes_gone_or_unnamed_are_left_out():
    import os

    from strata.bench.server_info import cpu_seconds, server_pids

    assert server_pids(None) == {} and server_pids({"frontend_pid": "x"}) == {}
    assert server_pids({"frontend_pid": os.getpid(), "engine": {"pid": 2**22 + 1}}) == {
        "frontend": os.getpid()
    }
    before = cpu_seconds({"me": os.getpid()})["me"]
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds({"me": os.getpid()})["me"] > before
    assert cpu_seconds({"gone": 2**22 + 1}) == {}
