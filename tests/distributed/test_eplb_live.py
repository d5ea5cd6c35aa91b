"""EPLB on a live expert-parallel replica (two ranks): on a tiny model whose router favours experts 2
and 3 (both on rank 0 at first), a rebalance spreads them and evens the rows each rank computes,
and rebalancing every few steps while requests run changes no token and drops no request."""

from __future__ import annotations

import pytest

from strata import Engine, SamplingParams
from strata.bench.parallel import EPLBBenchConfig, _workload, make_skewed_moe, run_eplb

CFG = EPLBBenchConfig(num_prompts=6, prompt_len=24, output_len=12)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return make_skewed_moe(tmp_path_factory.mktemp("eplb") / "skewed", CFG)


def test_rebalance_evens_the_ranks_load_and_keeps_the_answers(skewed):
    result = run_eplb(
        EPLBBenchConfig(model=str(skewed), num_prompts=4, prompt_len=32, output_len=4)
    )
    assert (
        result["before"]["worst_max_over_mean"] > 1.5
    )  # experts 2 and 3 both start on rank 0
    assert result["after"]["worst_max_over_mean"] < 1.2
    for placement in result[
        "placements"
    ].values():  # 5 slots per rank: each rank computes a hot expert
        assert all({2, 3} & set(placement[r * 5 : (r + 1) * 5]) for r in range(2))
    assert result["same_tokens"]


def test_rebalancing_every_few_steps_changes_no_token_and_drops_no_request(skewed):
    prompts = _workload(CFG, 512)
    params = SamplingParams(
        temperature=0, max_new_tokens=CFG.output_len, ignore_eos=True
    )
    options = dict(
        dtype="float32", kv_cache_tokens=2048, page_size=4, chunked_prefill_size=32
    )
    one = Engine(str(skewed), **options)
    want = [r.token_ids for r in one.generate(prompts, params)]
    engine = Engine(
        str(skewed), **options, ep_size=2, ep_num_redundant_experts=2, eplb_interval=3
    )
    try:
        initial = engine.parallel.model.layers[0].mlp.experts.placement
        results = engine.generate(prompts, params)
        placement = engine.parallel.model.layers[0].mlp.experts.placement
        engine.scheduler.check_no_leaks()
    finally:
        engine.close()
    assert engine.parallel.steps >= 6  # two rebalances at least, while requests ran
    assert placement != initial
    assert [r.finish_reason for r in results] == ["length"] * len(prompts)
    assert [r.token_ids for r in results] == want
