"""How a model splits over ranks, on numbers alone: heads, slices, vocabulary shards, what is refused,
and EPLB's replication and balanced packing."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from strata.distributed.eplb import (
    imbalance,
    initial_placement,
    plan_placement,
    rank_loads,
    replicate,
)
from strata.distributed.sharding import ShardPlan, check_supported, head_split
from strata.model_config import ModelConfig
from strata.models import config_from_hf


@pytest.mark.parametrize(
    "heads,kv,size",
    [
        (4, 2, 2),
        (4, 1, 2),
        (9, 3, 2),
        (8, 2, 4),
        (8, 8, 3),
        (16, 2, 8),
        (6, 3, 2),
        (12, 4, 3),
    ],
)
def test_every_query_head_lands_once_beside_its_kv_head(heads, kv, size):
    group = heads // kv
    seen = []
    for rank in range(size):
        h = head_split(heads, kv, rank, size)
        q = range(h.q_start, h.q_start + h.num_q)
        assert h.num_q > 0 and h.num_kv > 0
        # every query head reads a KV head this rank holds, and the rank's KV heads are all read
        assert {qh // group for qh in q} == set(
            range(h.kv_start, h.kv_start + h.num_kv)
        )
        seen.extend(q)
    assert sorted(seen) == list(range(heads))


def test_heads_that_cannot_split_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        head_split(
            6, 2, 0, 4
        )  # 4 ranks over 2 KV heads: 6 query heads do not divide by 4


def small_config(**changes) -> ModelConfig:
    cfg = config_from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 101,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    return dataclasses.replace(cfg, **changes)


def test_shards_of_a_checkpoint_tensor_add_back_up_to_it():
    cfg = small_config()
    plans = [ShardPlan(cfg, r, 2, 1) for r in range(2)]
    hd = cfg.head_dim
    q = torch.randn(cfg.num_heads * hd, cfg.hidden_size)
    o = torch.randn(cfg.hidden_size, cfg.num_heads * hd)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    qs = [p.shard_tensor("model.layers.1.self_attn.q_proj.weight", q) for p in plans]
    os_ = [p.shard_tensor("model.layers.1.self_attn.o_proj.weight", o) for p in plans]
    downs = [
        p.shard_tensor("model.layers.0.mlp.down_proj.weight", torch.ones(64, 96))
        for p in plans
    ]
    embeds = [p.shard_tensor("model.embed_tokens.weight", embed) for p in plans]
    assert torch.equal(torch.cat(qs), q)  # column parallel: output rows
    assert torch.equal(torch.cat(os_, dim=1), o)  # row parallel: input columns
    assert [d.shape[1] for d in downs] == [48, 48]
    # vocabulary 101 over 2 ranks: 51 rows each, the last padded with one zero row
    assert [e.shape[0] for e in embeds] == [51, 51]
    assert torch.equal(torch.cat(embeds)[:101], embed) and not embeds[1][-1].any()
    bias = torch.randn(64)
    assert torch.equal(
        plans[0].shard_tensor("model.layers.0.self_attn.o_proj.bias", bias), bias
    )
    assert (
        not plans[1].shard_tensor("model.layers.0.self_attn.o_proj.bias", bias).any()
    )  # added once
    norm = torch.randn(64)
    assert plans[1].shard_tensor("model.layers.0.input_layernorm.weight", norm) is norm
    local = plans[1].local_config()
    assert (
        local.num_heads,
        local.num_kv_heads,
        local.intermediate_size,
        local.vocab_size,
    ) == (2, 1, 48, 51)


def test_models_a_split_cannot_run_are_refused():
    with pytest.raises(ValueError, match="has none"):
        check_supported(small_config(), 1, 2)  # expert parallel without experts
    with pytest.raises(ValueError, match="all heads at once"):
        check_supported(small_config(qk_norm="full"), 2, 1)
    with pytest.raises(ValueError, match="must be 1 or the other"):
        check_supported(small_config(), 2, 4)
    check_supported(small_config(), 2, 1)


def test_replicas_go_to_the_heaviest_experts():
    assert replicate([100, 10, 10, 80], 6) == [2, 1, 1, 2]
    assert replicate([100, 1, 1, 1], 7) == [4, 1, 1, 1]


@pytest.mark.parametrize("seed", range(5))
def test_balanced_packing_holds_every_expert_and_evens_the_ranks(seed):
    gen = torch.Generator().manual_seed(seed)
    E, world, redundant = 16, 4, 4
    load = (torch.rand(E, generator=gen) ** 4 * 1000).round().tolist()  # skewed
    placement = plan_placement(load, E + redundant, world)
    assert len(placement) == E + redundant and set(placement) == set(range(E))
    per_rank = (E + redundant) // world
    for r in range(world):  # no rank holds two copies of one expert
        slots = placement[r * per_rank : (r + 1) * per_rank]
        assert len(set(slots)) == len(slots)
    before = imbalance(rank_loads(load, initial_placement(E, redundant, world), world))
    after = imbalance(rank_loads(load, placement, world))
    assert after < before and after < 1.25
    # the greedy packing is within the heaviest item of the best possible max
    copies = [placement.count(e) for e in range(E)]
    heaviest = max(load[e] / copies[e] for e in range(E))
    assert max(rank_loads(load, placement, world)) <= sum(load) / world + heaviest


def test_packing_matches_the_best_split_on_a_small_case():
    load, world = [9, 7, 6, 5, 4, 3], 2
    placement = plan_placement(load, 6, world)
    best = min(
        max(sum(load[e] for e in side), sum(load) - sum(load[e] for e in side))
        for side in itertools.combinations(range(6), 3)
    )
    assert max(rank_loads(load, placement, world)) == best


def test_fewer_copies_of_hot_experts_when_they_pack_better():
    """Two hot experts, 4 spare slots, 4 ranks: 3 copies each would put two copies on two ranks;
    2 copies each (spares left to cold experts) give every rank one."""
    load = [5, 5, 1220, 1210] + [5] * 12
    placement = plan_placement(load, 20, 4)
    assert placement.count(2) == 2 and placement.count(3) == 2
    assert imbalance(rank_loads(load, placement, 4)) < 1.05


def test_engram_tables_split_by_rows_and_deepseek_names_slice_the_shared_expert():
    """DeepSeek-V4.1 over two ranks (attention replicated): each rank's config holds its rows of
    every Engram table and half the shared expert; the checkpoint's tables and shared-expert
    weights (DeepSeek's own names too) are cut to match; routed experts pass whole to the slots."""
    import transformers
    from tiny_dsv4 import ENGRAM, TINY

    from strata.models.deepseek_v4 import DeepseekV4ForCausalLM

    raw = transformers.DeepseekV4Config(**TINY).to_dict()
    raw.update(ENGRAM, architectures=["DeepseekV4ForCausalLM"])
    cfg = config_from_hf(raw)
    plans = [
        ShardPlan(cfg, r, 1, 2, DeepseekV4ForCausalLM.RENAMES, tuple(range(8)))
        for r in range(2)
    ]
    size, shared = ENGRAM["engram_table_size"], cfg.moe.shared_intermediate_size
    assert [p.local_config().dsv4.engram.shard_rows for p in plans] == [
        (0, size // 2),
        (size // 2, size),
    ]
    assert sum(p.local_config().moe.shared_intermediate_size for p in plans) == shared
    table = torch.randn(4, size, 8)
    parts = [p.shard_tensor("model.layers.2.engram.embedding", table) for p in plans]
    assert torch.equal(torch.cat(parts, dim=1), table)
    w1 = torch.randn(shared, TINY["hidden_size"])
    for name in (
        "layers.1.ffn.shared_experts.w1.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
    ):
        cut = [p.shard_tensor(name, w1) for p in plans]
        assert torch.equal(torch.cat(cut), w1)
    expert = torch.randn(TINY["moe_intermediate_size"], TINY["hidden_size"])
    assert plans[1].shard_tensor("layers.1.ffn.experts.5.w1.weight", expert) is expert
    # one rank: nothing is cut
    assert ShardPlan(cfg, 0, 1, 1).local_config().dsv4.engram.shard_rows is None
