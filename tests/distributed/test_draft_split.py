"""A mixture-of-experts draft model split over the ranks of an expert-parallel target
(`--speculative-algorithm draft --ep-size 2`), with redundant expert slots of its own
(`--speculative-draft-ep-num-redundant-experts`): drafts as the whole draft model would, answers
unchanged, its load measured per rank and evened by EPLB, and the flag's misuses refused."""

from __future__ import annotations

import pytest
from tiny_models import make_model

from strata import Engine, SamplingParams
from strata.bench.parallel import (
    DraftEPLBConfig,
    EPLBBenchConfig,
    make_skewed_moe,
    run_draft_eplb,
)
from strata.config import EngineConfig

EPLB = EPLBBenchConfig(num_prompts=4, prompt_len=24, output_len=8)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return make_skewed_moe(tmp_path_factory.mktemp("draft-split") / "skewed", EPLB)


def test_a_split_draft_of_the_targets_own_weights_is_always_accepted(skewed):
    """The draft is the target's checkpoint, so a draft computed right is the target's own greedy
    token: every one is accepted. A shard that missed its experts' all-reduce would draft noise."""
    result = run_draft_eplb(
        DraftEPLBConfig(
            eplb=EPLBBenchConfig(
                model=str(skewed), num_prompts=4, prompt_len=24, output_len=8
            ),
            draft_model=str(skewed),
            redundant=(2,),
            draft_tokens=3,
            rounds=1,
        )
    )
    (row,) = result["rows"]
    assert row["same_tokens"]
    assert row["drafted"] > 0 and row["accepted"] >= 0.95 * row["drafted"]
    for layer in row["before"]["layers"].values():  # both ranks computed draft rows
        assert min(layer["rows_per_rank"]) > 0
    # experts 2 and 3, the router's favourites, both start on rank 0; one rebalance spreads them
    assert row["before"]["worst_max_over_mean"] > 1.5
    assert row["after"]["worst_max_over_mean"] < 1.2
    for placement in row[
        "placements"
    ].values():  # 8 experts + 2 spare slots: 5 per rank
        assert len(placement) == 10
        assert all({2, 3} & set(placement[r * 5 : (r + 1) * 5]) for r in range(2))


def test_another_moe_draft_keeps_the_answers_and_frees_its_pages(skewed, tmp_path):
    draft = make_skewed_moe(
        tmp_path / "draft", EPLBBenchConfig(seed=7, hot_experts=(5, 6))
    )
    prompts = [[5 + i, 9, 11 + i, 30, 31, 32, 7] for i in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_tokens=1024, page_size=4)
    one = Engine(str(skewed), **options)
    want = [r.token_ids for r in one.generate(prompts, params)]
    one.close()
    engine = Engine(
        str(skewed),
        **options,
        ep_size=2,
        speculative_algorithm="draft",
        speculative_draft_model=str(draft),
        speculative_num_draft_tokens=3,
        speculative_fixed_length=True,
        eplb_interval=2,  # rebalances target and draft while requests run
    )
    try:
        runtime = engine.parallel
        assert runtime.draft is not None
        got = engine.generate(prompts, params)
        drafter = engine.scheduler.spec.draft_model
        drafted = engine.scheduler.spec.stats.drafted_tokens
        engine.scheduler.check_no_leaks()
        assert not drafter.seqs  # every finished request's draft pages went back
        assert drafter.allocator.num_free_pages == drafter.allocator.num_pages
        info = engine.stats(full=True)["parallel"]
        assert info["draft_rank_load"] is not None
    finally:
        engine.close()
    assert [r.token_ids for r in got] == want
    assert drafted > 0
    assert runtime.rebalances > 0


def test_the_flag_is_refused_where_it_means_nothing(skewed, tmp_path):
    with pytest.raises(ValueError, match="needs --speculative-algorithm draft"):
        EngineConfig(speculative_draft_ep_num_redundant_experts=2)
    with pytest.raises(ValueError, match="--ep-size > 1"):
        EngineConfig(
            speculative_algorithm="draft",
            speculative_draft_model=str(skewed),
            speculative_draft_ep_num_redundant_experts=2,
        )
    dense = make_model(tmp_path / "dense", "llama", tokenizer=False)
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        _split_draft_engine(skewed, dense, redundant=2)
    with pytest.raises(ValueError, match="speculative-draft-ep-num-redundant-experts"):
        # 8 experts + 1 slot do not split over 2 ranks: the draft's flag is named
        _split_draft_engine(skewed, skewed, redundant=1)


def _split_draft_engine(target, draft, redundant: int) -> Engine:
    return Engine(
        str(target),
        dtype="float32",
        kv_cache_tokens=256,
        ep_size=2,
        speculative_algorithm="draft",
        speculative_draft_model=str(draft),
        speculative_draft_ep_num_redundant_experts=redundant,
    )


def test_the_bench_command_reports_each_count(tmp_path, capsys):
    import json

    from strata.cli import main

    out = tmp_path / "draft.json"
    argv = [
        "bench",
        "parallel",
        "draft-eplb",
        "--num-prompts",
        "2",
        "--prompt-len",
        "8",
    ]
    argv += ["--output-len", "4", "--rounds", "1", "--hot-experts", "5"]
    argv += ["--speculative-draft-ep-num-redundant-experts", "0", "2"]
    assert main(argv + ["--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["redundant"] for r in rows] == [0, 2]
    assert all(r["same_tokens"] and r["draft_forward_s_after"] > 0 for r in rows)
    assert "draft forward ms" in capsys.readouterr().out
