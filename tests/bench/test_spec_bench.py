"""`strata bench spec` end to end on a tiny model: both engines give the same tokens, and the engine
with speculation runs the algorithm the options name (ngram when none is named)."""

from __future__ import annotations

import pytest

from strata.bench.spec import SpecBenchConfig, format_text, run


@pytest.mark.parametrize("algorithm", [None, "draft"])
def test_spec_bench_runs_the_named_drafter(llama_dir, algorithm):
    options = dict(model=str(llama_dir), dtype="float32", kv_cache_tokens=4096)
    if algorithm == "draft":  # the target as its own draft model: every draft is kept
        # a fixed draft length: the adaptive policy, timing drafts that cost a full target step each,
        # may rightly decline them all on a busy machine, and this test is about the bench's plumbing
        options.update(
            speculative_algorithm="draft",
            speculative_draft_model=str(llama_dir),
            speculative_fixed_length=True,
        )
    cfg = SpecBenchConfig(
        scenarios=("chat-batch1", "chat-concurrent"),
        batch1_prompts=2,
        concurrency=3,
        output_len=12,
        rounds=1,
    )
    results = run(cfg, options, progress=lambda _: None)
    assert [r.scenario for r in results] == ["chat-batch1", "chat-concurrent"]
    for r in results:
        s = r.summary()
        assert s["identical_outputs"] and s["off_tok_s"] > 0 and s["on_tok_s"] > 0
    if algorithm == "draft":
        assert all(
            r.accept_length[0] > 1 for r in results
        )  # drafts were fed and accepted
    costs = results[0].summary()[
        "step_costs"
    ]  # batch 1: step cost by rows; none for concurrent rounds
    assert costs["off_decode_ms"] > 0 and results[1].summary()["step_costs"] is None
    rows = costs["on_by_rows"]
    assert all(c["ms"] > 0 and c["steps"] > 0 for c in rows.values())
    drafted_rows = sum(c["steps"] for n, c in rows.items() if n > 1)
    assert (drafted_rows > 0) == (
        results[0].draft_length[0] > 0
    )  # verifications show as steps of 1 + k rows
    # every token-producing step without prefill is counted once: decodes and verifications
    assert sum(c["steps"] for c in rows.values()) <= results[0].output_tokens[0]
    # batch 1 also times the decode phase (after each first token); concurrent rounds do not
    b1, conc = results[0].summary(), results[1].summary()
    assert b1["off_decode_tok_s"] > 0 and b1["on_decode_tok_s"] > 0
    assert b1["decode_ratio"] == pytest.approx(
        b1["on_decode_tok_s"] / b1["off_decode_tok_s"]
    )
    assert conc["decode_ratio"] is None
    for r in results:  # pooled: all output tokens over all time, per side (one round: that round's figures)
        pooled = r.summary()["pooled"]
        assert pooled["off_tok_s"] == pytest.approx(r.off_tok_s[0])
        assert pooled["on_tok_s"] == pytest.approx(r.on_tok_s[0])
        assert pooled["ratio"] == pytest.approx(r.ratios[0])
    text = format_text(results)
    assert "on tok/s" in text and "chat-batch1: decode step off" in text
    assert "chat-batch1: decode phase (after each first token)" in text


def test_batch1_rounds_interleave_the_sides_prompt_by_prompt(monkeypatch):
    """At batch 1 the two sides take each prompt in turn, the first alternating, and each side's
    timing sums its own requests'."""
    from strata.bench import spec

    calls = []

    def fake_run(arm, prompts, batch1, output_len, steps=None):
        assert batch1 and len(prompts) == 1 and steps is not None
        calls.append((arm, prompts[0][0]))
        steps.append(arm)
        return spec.RunTiming(
            [[prompts[0][0]] * 3],
            seconds=1.0 if arm == "A" else 0.5,
            decode_tokens=2,
            decode_seconds=0.25,
        )

    monkeypatch.setattr(spec, "_run_arm", fake_run)
    steps = {"off": [], "on": []}
    timings = spec._run_interleaved(
        {"off": "A", "on": "B"}, [[10], [11], [12]], 8, steps, first=1
    )
    assert calls == [("B", 10), ("A", 10), ("A", 11), ("B", 11), ("B", 12), ("A", 12)]
    assert steps == {"off": ["A"] * 3, "on": ["B"] * 3}
    off, on = timings["off"], timings["on"]
    assert off.outputs == on.outputs == [[10] * 3, [11] * 3, [12] * 3]
    assert (off.seconds, on.seconds) == (3.0, 1.5) and on.tok_s == pytest.approx(
        2 * off.tok_s
    )
    assert (off.decode_tokens, off.decode_seconds) == (6, 0.75)


def test_both_sides_are_one_engine_each_cold_and_as_it_was_after(llama_dir):
    """The side without speculation runs the engine with its speculator detached, and each run starts
    from an empty prefix cache; the speculator is back afterwards, even when a run fails."""
    from strata import Engine, SamplingParams
    from strata.bench import spec

    engine = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=1024,
        speculative_algorithm="ngram",
    )
    speculator = engine.scheduler.spec
    prompt = engine.encode("Hello world! Hello world! Hello world!")
    off, on = spec.Arm(engine, None), spec.Arm(engine, speculator)
    seen = []
    for arm in (on, off, on):
        with arm.active() as e:
            seen.append(e.scheduler.spec)
            out = e.generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))[
                0
            ]
            assert out.cached_tokens == 0  # the other side's run left nothing to hit
        assert engine.scheduler.spec is speculator
    assert seen == [speculator, None, speculator]
    with pytest.raises(RuntimeError), off.active():
        raise RuntimeError("a run that fails")
    assert engine.scheduler.spec is speculator


def test_pooled_figures_weigh_rounds_by_their_time():
    """The pooled ratio is all output tokens over all time, per side; not the median of round ratios."""
    from strata.bench.spec import ScenarioResult

    r = ScenarioResult(
        "grounded-batch1",
        output_tokens=[100, 300],
        off_output_tokens=[100, 300],
        off_seconds=[1.0, 3.0],
        on_seconds=[0.5, 1.0],
        off_tok_s=[100.0, 100.0],
        on_tok_s=[200.0, 300.0],
        ratios=[2.0, 3.0],
        accept_length=[3.0, 4.0],
        draft_length=[4.0, 5.0],
    )
    pooled = r.summary()["pooled"]
    assert pooled["off_tok_s"] == pytest.approx(100.0) and pooled[
        "on_tok_s"
    ] == pytest.approx(400 / 1.5)
    assert pooled["ratio"] == pytest.approx(8 / 3) and r.summary()[
        "ratio"
    ] == pytest.approx(2.5)
    assert "grounded-batch1: pooled over its 2 rounds" in format_text([r])
    assert ScenarioResult("chat-concurrent").pooled() is None
