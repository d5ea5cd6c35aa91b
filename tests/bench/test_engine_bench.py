"""one-batch, offline, the transformers baseline and compare, on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.bench.compare import round_order, run_compare
from strata.bench.datasets import DatasetConfig, make_dataset
from strata.bench.offline import run_strata_offline
from strata.bench.one_batch import run_strata_one_batch
from strata.bench.step_timer import StepTimer
from strata.bench.targets import BenchContext, make_target, parse_target


@pytest.fixture(scope="module")
def engine(llama_dir):
    from strata import Engine

    return Engine(
        model=str(llama_dir),
        dtype="float32",
        kv_cache_tokens=4096,
        chunked_prefill_size=64,
    )


def test_one_batch_measures_prefill_and_every_decode_step(engine):
    r = run_strata_one_batch(engine, batch_size=3, input_len=40, output_len=6, seed=1)
    assert (r.batch_size, r.input_len, r.output_len) == (3, 40, 6)
    assert r.prefill_s > 0 and r.prefill_tok_s == pytest.approx(3 * 40 / r.prefill_s)
    assert (
        r.num_decode_steps == 5
    )  # one token from prefill, then 5 steps where all 3 decode
    assert r.decode_step_ms > 0 and r.decode_tok_s == pytest.approx(
        3 / (r.decode_step_ms / 1000)
    )
    pieces = r.decode_pieces_ms
    assert set(pieces) == {
        "schedule",
        "prepare",
        "model",
        "logits",
        "sample",
        "process",
        "total",
    }
    assert pieces["model"] > 0
    assert sum(v for k, v in pieces.items() if k != "total") <= pieces["total"] * 1.01
    engine.scheduler.check_no_leaks()


def test_step_timer_leaves_the_engine_as_it_was(engine):
    from strata import SamplingParams

    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    before = engine.generate([[5, 6, 7, 8]], params)[0].token_ids
    with StepTimer(engine) as timer:
        assert engine.generate([[5, 6, 7, 8]], params)[0].token_ids == before
    assert len(timer.steps) >= 4
    assert "step" not in vars(engine.scheduler) and "forward" not in vars(
        engine.scheduler.runner
    )
    assert type(engine.scheduler.runner.model).__name__ != "_TimedModel"


def test_offline_counts_tokens_and_reports_the_window(
    engine, tiny_tokenizer, monkeypatch
):
    from strata.bench import offline
    from strata.bench.window import completion_window

    convs = make_dataset(
        DatasetConfig(
            name="random", num_prompts=10, input_len=20, output_len=8, range_ratio=0.25
        ),
        tiny_tokenizer,
    )
    seen = {}
    real_window = offline.engine_window

    def spy(steps, finish_times, *args, **kwargs):
        seen.update(steps=steps, finish_times=finish_times)
        return real_window(steps, finish_times, *args, **kwargs)

    monkeypatch.setattr(offline, "engine_window", spy)
    r = run_strata_offline(engine, convs)
    in_len = sum(len(c.turns[0].ids) for c in convs)
    out_len = sum(c.turns[0].output_len for c in convs)
    assert (
        r.num_requests == 10 and r.output_tokens == out_len and r.input_tokens == in_len
    )
    assert r.total_tok_s == pytest.approx((in_len + out_len) / r.duration_s)
    # the window is made of the engine's own steps: every request's finish and every sampled token
    assert (
        len(seen["finish_times"]) == 10
        and sum(s.num_sampled for s in seen["steps"]) == out_len
    )
    steps = seen["steps"]
    span = steps[-1].end - steps[0].end + steps[0].duration_s
    if completion_window(seen["finish_times"], run_span=span) is None:
        # the 20%-90% completions fell within a tenth of the run: a busy machine stalled other steps
        assert r.window is None
    else:
        assert r.window is not None and r.window.step_source == "engine decode steps"
    assert r.expert_load is None and r.expert_load_summary is None  # a dense model


def test_offline_shared_prefix_hits_the_radix_cache_only_when_enabled(
    llama_dir, tiny_tokenizer
):
    from strata import Engine

    cfg = DatasetConfig(
        name="shared-prefix",
        num_groups=2,
        prompts_per_group=4,
        system_len=48,
        question_len=6,
        output_len=3,
    )
    convs = make_dataset(cfg, tiny_tokenizer)
    # one prompt admitted per step, so later requests find the earlier ones' prefix in the cache
    opts = {"dtype": "float32", "kv_cache_tokens": 4096, "max_prefill_tokens": 64}
    on = run_strata_offline(Engine(model=str(llama_dir), **opts), convs)
    off = run_strata_offline(
        Engine(model=str(llama_dir), disable_radix_cache=True, **opts), convs
    )
    assert on.cache_hit_rate > 0.4
    assert off.cache_hit_rate == 0


def test_multi_turn_offline_feeds_answers_back(engine, tiny_tokenizer):
    convs = make_dataset(
        DatasetConfig(
            name="multi-turn", num_prompts=3, num_turns=2, input_len=8, output_len=4
        ),
        tiny_tokenizer,
    )
    r = run_strata_offline(engine, convs)
    assert r.num_requests == 6
    # turn 2 carries turn 1's prompt and answer: 3 * (8) + 3 * (8 + 4 + sep + 8)
    sep = len(tiny_tokenizer.encode("\n", add_special_tokens=False))
    assert r.input_tokens == 3 * 8 + 3 * (8 + 4 + sep + 8)
    assert r.cache_hit_rate > 0  # the second turn reuses the first's KV


def _ctx(llama_dir, tok, **engine_options) -> BenchContext:
    return BenchContext(
        model=str(llama_dir),
        model_dir=llama_dir,
        engine_options={"dtype": "float32", **engine_options},
        tokenizer=tok,
    )


def test_transformers_baseline_one_batch_and_offline(llama_dir, tiny_tokenizer):
    t = make_target(
        parse_target("transformers:batch_size=4"), _ctx(llama_dir, tiny_tokenizer)
    )
    r = t.one_batch(2, 16, 4, seed=0)
    assert (
        r.target == "transformers:batch_size=4"
        and r.num_decode_steps == 3
        and r.prefill_tok_s > 0
    )
    convs = make_dataset(
        DatasetConfig(
            name="random", num_prompts=6, input_len=10, output_len=3, range_ratio=0.5
        ),
        tiny_tokenizer,
    )
    off = t.offline(convs)
    assert off.num_requests == 6 and off.output_tokens == sum(
        c.turns[0].output_len for c in convs
    )
    assert off.cached_tokens is None


def test_round_order_alternates():
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_run_compare_skips_unavailable_and_failing_targets(llama_dir, tiny_tokenizer):
    ctx = _ctx(llama_dir, tiny_tokenizer)
    targets = [
        make_target(parse_target(s), ctx)
        for s in ("transformers", "url=http://127.0.0.1:9", "llamacpp")
    ]
    calls = []

    def run(target, r):
        calls.append((target.label, r))
        return {"x (tok/s)": 10.0 + r}

    res = run_compare("one-batch", targets, 3, run, log=lambda m: None)
    assert calls == [("transformers", 0), ("transformers", 1), ("transformers", 2)]
    assert "does not support one-batch" in res.skipped["http://127.0.0.1:9"]
    assert (
        ".gguf" in res.skipped["llamacpp"] or "not installed" in res.skipped["llamacpp"]
    )
    assert res.median("transformers", "x (tok/s)") == 11.0
    assert res.ratio("transformers", "x (tok/s)") == 1.0


def test_parse_target_forms():
    assert parse_target("strata").kind == "strata"
    spec = parse_target("strata:disable_radix_cache=true,page-size=16")
    assert spec.options == {"disable_radix_cache": "true", "page_size": "16"}
    assert parse_target("url=http://h:1/").url == "http://h:1"
    with pytest.raises(ValueError, match="unknown target"):
        parse_target("sglang")
    assert parse_target("vllm:python=/v/bin/python").options == {
        "python": "/v/bin/python"
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_target("strata:oops")


def test_vllm_target_says_why_it_cannot_run(llama_dir, tiny_tokenizer):
    target = make_target(
        parse_target("vllm:python=/nonexistent/python"), _ctx(llama_dir, tiny_tokenizer)
    )
    assert "offline" in target.unavailable("offline")
    assert "cannot be imported by /nonexistent/python" in target.unavailable("serving")


def test_strata_target_rejects_unknown_engine_options(llama_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match="not an EngineConfig field"):
        make_target(
            parse_target("strata:warp_speed=9"), _ctx(llama_dir, tiny_tokenizer)
        )


def test_llama_server_target_says_why_it_cannot_run_and_batches(
    llama_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    from strata.bench import llamacpp

    monkeypatch.delenv(llamacpp.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on PATH
    target = make_target(
        parse_target("llama-server:binary=/nonexistent"),
        _ctx(llama_dir, tiny_tokenizer),
    )
    assert "does not support one-batch" in target.unavailable("one-batch")
    assert "llama-server not found" in target.unavailable("serving")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert llamacpp.llama_server_binary(None) == str(binary)
    argv = llamacpp.llama_server_argv(
        str(binary), Path("m.gguf"), 8080, threads=2, slots=64, ctx_per_slot=1024
    )
    assert argv[argv.index("--parallel") + 1] == "64" and argv[
        argv.index("--ctx-size") + 1
    ] == str(64 * 1024)
    assert argv[argv.index("--threads") + 1] == "2"
