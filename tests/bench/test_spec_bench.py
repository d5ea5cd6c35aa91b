"""`strata bench spec` end to end on a tiny model: both engines give the same tokens, and the engine
with speculation runs the algorithm the options name (ngram when none is named)."""

from __future__ import annotations

import pytest

from strata.bench.spec import SpecBenchConfig, format_text, run


@pytest.mark.parametrize("algorithm", [None, "draft"])
def test_spec_bench_runs_the_named_drafter(llama_dir, algorithm):
    options = dict(model=str(llama_dir), dtype="float32", kv_cache_tokens=4096)
    if algorithm == "draft":  # the target as its own draft model: every draft is kept
        options.update(speculative_algorithm="draft", speculative_draft_model=str(llama_dir))
    cfg = SpecBenchConfig(scenarios=("chat-batch1", "chat-concurrent"), batch1_prompts=2, concurrency=3,
                          output_len=12, rounds=1)
    results = run(cfg, options, progress=lambda _: None)
    assert [r.scenario for r in results] == ["chat-batch1", "chat-concurrent"]
    for r in results:
        s = r.summary()
        assert s["identical_outputs"] and s["off_tok_s"] > 0 and s["on_tok_s"] > 0
    if algorithm == "draft":
        assert all(r.accept_length[0] > 1 for r in results)  # drafts were fed and accepted
    assert "on tok/s" in format_text(results)
