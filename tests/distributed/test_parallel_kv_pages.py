"""KV pages leave and enter a tensor-parallel replica with every KV head (gathered from and scattered
to the ranks), or an expert-parallel one whose ranks each hold them whole: the hierarchical cache
promotes them back exactly, L3 pages written by the split replica serve a one-rank engine, and a tp
2 prefill worker feeds a tp 1 decode worker (PD)."""

from __future__ import annotations

import random
import time

import pytest
from tiny_models import make_model

from strata import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
LONG = [(i * 7 + 3) % 370 + 5 for i in range(120)]
PROMPT = LONG + [1, 2, 3]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # 4 query heads over 2 KV heads: each rank holds one KV head
    return make_model(
        tmp_path_factory.mktemp("kv_pages") / "llama", "llama", tokenizer=False
    )


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp("kv_pages") / "qwen3_moe", "qwen3_moe", tokenizer=False
    )


def plain_tokens(model_dir) -> list[int]:
    plain = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=4,
        disable_radix_cache=True,
    )
    try:
        return plain.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        plain.close()


@pytest.fixture(scope="module")
def expected(llama):
    return plain_tokens(llama)


def run_one(engine: Engine, prompt: list[int]):
    (rid,) = engine.add_request(prompt, GREEDY)
    outs = []
    while not any(o.finished for o in outs):
        outs += [o for o in engine.step() if o.rid == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1].cached_tokens_details


@pytest.mark.parametrize("split", ["tp2", "ep2"])
def test_hierarchical_cache_round_trip_and_l3_shared_with_one_rank(
    llama, qwen3_moe, expected, tmp_path, split
):
    """tp2: every KV head gathered from and scattered to the ranks; ep2 (attention replicated): rank
    0's pages read as they are, each write stored by both ranks."""
    model, split_options = (
        (llama, {"tp_size": 2}) if split == "tp2" else (qwen3_moe, {"ep_size": 2})
    )
    if split == "ep2":
        expected = plain_tokens(qwen3_moe)
    storage = str(tmp_path / "l3")
    opts = dict(
        dtype="float32",
        kv_cache_tokens=256,
        page_size=4,
        hicache_prefetch_threshold=16,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
    )
    engine = Engine(str(model), **opts, **split_options)
    try:
        assert (
            engine.generate([PROMPT], GREEDY)[0].token_ids == expected
        )  # cold; written through to L3
        rng = random.Random(0)
        for _ in range(3):  # push the prefix out of L1 (into L2)
            engine.generate([[rng.randrange(5, 380) for _ in range(100)]], GREEDY)
        assert engine.scheduler.cache.match_prefix(PROMPT).cached_len < 116
        tokens, details = run_one(engine, PROMPT)
        assert (
            tokens == expected and details["host"] > 0
        )  # promoted from L2 into both ranks' shards
        engine.scheduler.check_no_leaks()
        engine.hicache.flush()
    finally:
        engine.close()
    single = Engine(str(model), **opts, hicache_prefetch_policy="wait_complete")
    try:
        tokens, details = run_one(single, PROMPT)
    finally:
        single.close()
    assert (
        tokens == expected and details["storage"] >= 100
    )  # the split replica's pages, read by one rank


def test_tp2_prefill_worker_feeds_a_tp1_decode_worker(llama):
    prompts = [[5, 17, 33, 91, 120, 7, 64, 200, 13], list(range(30, 71))]
    single = Engine(str(llama), dtype="float32", kv_cache_tokens=512)
    want = [r.token_ids for r in single.generate(prompts, GREEDY)]
    common = dict(
        dtype="float32",
        kv_cache_tokens=512,
        page_size=4,
        disaggregation_secret="s3cret",
    )
    p = Engine(str(llama), **common, disaggregation_mode="prefill", tp_size=2)
    d = Engine(str(llama), **common, disaggregation_mode="decode")
    try:
        rids = [f"r{i}" for i in range(len(prompts))]
        for i, prompt in enumerate(prompts):
            d.add_request(
                prompt,
                GREEDY,
                rid=rids[i],
                bootstrap_room=500 + i,
                bootstrap_addr=p.disagg_endpoint,
            )
            p.add_request(prompt, GREEDY, rid=rids[i], bootstrap_room=500 + i)
        outs = {r: [] for r in rids}
        deadline = time.monotonic() + 60
        while (
            not all(outs[r] and outs[r][-1].finished for r in rids)
            and time.monotonic() < deadline
        ):
            p.step()
            for o in d.step():
                outs[o.rid].append(o)
        assert [[t for o in outs[r] for t in o.new_token_ids] for r in rids] == want
        assert p.disagg.stats["sent"] == 2
    finally:
        p.close()
        d.close()
