"""Tensor and expert parallel over two ranks (gloo, one thread each) give the greedy tokens of one
rank and of transformers: dense families (GQA, one KV head replicated, an uneven head split with a
padded vocabulary shard, tied embeddings, q/k/v biases with window groups, Gemma 2's sandwich norms
and softcaps) and mixture-of-experts ones (experts sliced by TP, sharded by EP with and without
redundant slots, a shared expert, GPT-OSS's stacked biased experts), through chunked prefill and a
radix cache hit; and int8 blocks quantized per shard give the tokens of int8 on one rank."""

from __future__ import annotations

import pytest
import torch
from oracle_drafter import OracleDrafter
from tiny_models import make_model
from transformers import AutoModelForCausalLM, GenerationConfig

from strata import Engine, SamplingParams

PROMPTS = [
    [5, 17, 33, 91, 120, 7, 64, 200, 13],
    [44, 3, 250],
    list(range(30, 30 + 41)),  # three chunks of 16
]
SHARED = PROMPTS[2][:32] + [7, 8, 9]  # hits the 32 cached tokens of PROMPTS[2]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
ENGINE = dict(
    dtype="float32", kv_cache_tokens=1024, page_size=4, chunked_prefill_size=16
)

# name -> (family, config overrides, parallel options)
CASES = {
    "llama_gqa_tp2": ("llama", {}, {"tp_size": 2}),
    "llama_one_kv_head_tp2": ("llama", {"num_key_value_heads": 1}, {"tp_size": 2}),
    # 6 heads over 3 KV heads: 1 + 2 KV heads per rank; vocabulary 383: the second shard padded
    "llama_uneven_tp2": (
        "llama",
        {
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "hidden_size": 96,
            "vocab_size": 383,
        },
        {"tp_size": 2},
    ),
    "llama_tied_tp2": ("llama_tied_llama3", {}, {"tp_size": 2}),
    "qwen2_window_tp2": ("qwen2_sw", {}, {"tp_size": 2}),
    "gemma2_tp2": ("gemma2", {}, {"tp_size": 2}),
    "mixtral_tp2": ("mixtral", {}, {"tp_size": 2}),
    "qwen2_moe_tp2_ep2": ("qwen2_moe", {}, {"tp_size": 2, "ep_size": 2}),
    "qwen3_moe_ep2_redundant": (
        "qwen3_moe",
        {},
        {"ep_size": 2, "ep_num_redundant_experts": 2},
    ),
    # stacked checkpoint experts with biases, sinks, a window layer; attention replicated
    "gpt_oss_ep2": ("gpt_oss", {}, {"ep_size": 2}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_models")
    return {
        name: make_model(root / name, family, tokenizer=False, **overrides)
        for name, (family, overrides, _) in CASES.items()
    }


@torch.no_grad()
def hf_greedy(
    model_dir, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(
            model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=cfg
            )[0, len(p) :].tolist()
        )
    return out


def run(model_dir, **options) -> tuple[list[list[int]], int]:
    """Greedy tokens of PROMPTS then SHARED (after PROMPTS finished), and SHARED's cached tokens."""
    engine = Engine(str(model_dir), **ENGINE, **options)
    try:
        tokens = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        shared = engine.generate([SHARED], GREEDY)[0]
        engine.scheduler.check_no_leaks()
        return [*tokens, shared.token_ids], shared.cached_tokens
    finally:
        engine.close()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_one_rank_and_transformers(models, case):
    model_dir = models[case]
    want = hf_greedy(model_dir, [*PROMPTS, SHARED], GREEDY.max_new_tokens)
    one_rank, _ = run(model_dir)
    parallel, cached = run(model_dir, **CASES[case][2])
    assert cached == 32  # the radix hit happened on the split replica too
    assert parallel == one_rank == want


def test_int8_shards_give_the_tokens_of_int8_on_one_rank(models):
    """Row-parallel inputs split at multiples of the 32-wide blocks, so each rank quantizes exactly
    the blocks one rank would; only the order of the final sums differs."""
    model_dir = models["llama_gqa_tp2"]
    one_rank, _ = run(model_dir, quantization="int8")
    parallel, _ = run(model_dir, quantization="int8", tp_size=2)
    assert parallel == one_rank


def test_drafts_verified_on_a_split_replica_keep_its_tokens(models):
    """Speculative verification rows run through the split layers as lone decodes do: a TP=2 replica
    with drafts (accepted runs and rejections at every depth) gives its tokens without them."""
    model_dir = models["llama_gqa_tp2"]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    plain = Engine(str(model_dir), **ENGINE, tp_size=2)
    try:
        want = [r.token_ids for r in plain.generate(PROMPTS, params)]
    finally:
        plain.close()
    engine = Engine(
        str(model_dir),
        **ENGINE,
        tp_size=2,
        speculative_algorithm="ngram",
        speculative_fixed_length=True,
    )
    try:
        engine.scheduler.spec.drafter = OracleDrafter(
            {tuple(p): w for p, w in zip(PROMPTS, want)}
        )
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == want
        stats = engine.scheduler.spec.stats
        assert stats.verify_steps < stats.accepted_tokens < stats.drafted_tokens, stats
        engine.scheduler.check_no_leaks()
    finally:
        engine.close()
