"""DeepSeek-V4 exact against transformers (fp32) through Strata's scheduler and paged state: logits of
batched prefills, of prefills chunked inside compression windows and of batched decodes of requests
of different lengths, at page sizes 1 and 16; greedy tokens equal `generate()`'s for prompts spanning
many CSA and HCA windows, with chunked prefill, through radix hits (which resume from the cached
compressor windows, no replay), retraction under a small pool, HiCache's L2/L3 tiers and a
prefill/decode pair; attention in blocks of queries and YaRN on the compressed layers; pages
round-trip through `read_pages` / `write_pages`; no page leaks in any group; `kv-layout`'s bytes.

The tiny checkpoint (tests/tiny_dsv4.py) randomises what transformers leaves constant and draws
`tid2eid` at random, so sinks, the correction bias and hash routing are exercised. The indexer has
8 heads: its scores are sums of 8 ReLU terms, so exact ties (which torch.topk may break differently
from transformers' batch-1 call, see docs/ARCHITECTURE.md) do not occur in these prompts.
"""

from __future__ import annotations

import pytest
import torch
from test_disagg import pd_tokens
from test_hicache import GREEDY as TIER_GREEDY  # what run_one generates
from test_hicache import LONG, through_the_tiers
from test_parity import forward_logits, hf_greedy, hf_model
from tiny_dsv4 import make_dsv4, prompt
from tiny_models import constant_tensors

from strata import Engine, SamplingParams
from strata.cache.dsv4_pool import DSV4KVPool
from strata.engine.request import Req
from strata.models import config_from_dir

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
# 150 tokens: 37 CSA entries (top-4 kept per query), 9 HCA entries, the window 16
PROMPTS = [prompt(150, 1), prompt(61, 2), prompt(97, 3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_dsv4(tmp_path_factory.mktemp("dsv4"))


@pytest.fixture(scope="module")
def ref(model_dir):
    return hf_model(model_dir)


@pytest.fixture(scope="module")
def expected(ref):
    return [hf_greedy(ref, p, GREEDY.max_new_tokens) for p in PROMPTS]


def engine(model_dir, **options) -> Engine:
    return Engine(
        str(model_dir), **{"dtype": "float32", "kv_cache_tokens": 1024, **options}
    )


@torch.no_grad()
def ref_logits(ref, seq: list[int]) -> torch.Tensor:
    return ref(torch.tensor([seq])).logits[0]


def test_tiny_checkpoint_holds_no_constant_tensor(model_dir):
    assert constant_tensors(model_dir) == [
        "model.hc_head.hc_scale"
    ]  # a single value, moved off 1 by make_dsv4
    cfg = config_from_dir(model_dir)
    assert cfg.dsv4.layer_kinds == ("sliding", "csa", "hca", "csa")
    assert cfg.dsv4.hash_layers == (True, False, False, False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_prefill_and_decode_logits_match(model_dir, ref, page_size):
    """A batched prefill of three prompts, then decode steps for all three at once, every request at
    another position in its windows."""
    eng = engine(model_dir, page_size=page_size)
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    logits = forward_logits(eng, reqs, [len(p) for p in PROMPTS], num_decode=0)
    start = 0
    for p in PROMPTS:
        torch.testing.assert_close(
            logits[start : start + len(p)], ref_logits(ref, p), atol=1e-4, rtol=0
        )
        start += len(p)
    seqs = [list(p) for p in PROMPTS]
    last = torch.stack(
        [
            logits[i - 1]
            for i in torch.tensor([len(p) for p in PROMPTS]).cumsum(0).tolist()
        ]
    )
    for _ in range(4):
        for req, s, t in zip(reqs, seqs, last.argmax(-1).tolist()):
            req.output_ids.append(t)
            s.append(t)
        last = forward_logits(eng, reqs, [1] * len(reqs), num_decode=len(reqs))
        expected = torch.stack([ref_logits(ref, s)[-1] for s in seqs])
        torch.testing.assert_close(last, expected, atol=1e-4, rtol=0)


def test_query_blocks_give_the_same_logits(model_dir, ref, monkeypatch):
    """Long extends attend in blocks of queries (scores bounded by SCORES_MAX): blocks of a few
    queries, each reading only its columns of the window, give transformers' logits."""
    from strata.layers import dsv4_attention

    monkeypatch.setattr(
        dsv4_attention, "SCORES_MAX", 16384
    )  # blocks of ~5 queries here
    eng = engine(model_dir, page_size=16)
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    logits = forward_logits(eng, reqs, [len(p) for p in PROMPTS], num_decode=0)
    start = 0
    for p in PROMPTS:
        torch.testing.assert_close(
            logits[start : start + len(p)], ref_logits(ref, p), atol=1e-4, rtol=0
        )
        start += len(p)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_chunked_inside_windows_matches(model_dir, ref, page_size):
    """Chunks ending mid-window (CSA m = 4, HCA m' = 16), one of them beside a decoding request."""
    eng = engine(model_dir, page_size=page_size)
    long, other = PROMPTS[0], PROMPTS[1]
    a = Req(rid="a", prompt_ids=list(long), params=SamplingParams())
    b = Req(rid="b", prompt_ids=list(other), params=SamplingParams())
    forward_logits(eng, [b], [len(other)], num_decode=0)
    full = ref_logits(ref, long)
    done = 0
    for n in (7, 30, 1, 45, 67):
        b.output_ids.append(5 + n)
        logits = forward_logits(eng, [b, a], [1, n], num_decode=1)
        torch.testing.assert_close(logits[1:], full[done : done + n], atol=1e-4, rtol=0)
        torch.testing.assert_close(
            logits[0], ref_logits(ref, other + b.output_ids)[-1], atol=1e-4, rtol=0
        )
        done += n
    assert done == len(long)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_generate(model_dir, expected, page_size):
    eng = engine(model_dir, page_size=page_size, chunked_prefill_size=23)
    got = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    assert got == expected
    eng.scheduler.check_no_leaks()


def test_radix_hit_resumes_from_cached_windows(model_dir, ref, expected):
    """A prompt sharing the first 112 tokens (7 HCA windows) of another hits the cache at a page
    boundary and resumes from the cached compressor windows: same tokens as a cold run."""
    eng = engine(model_dir, page_size=16)
    first = eng.generate([PROMPTS[0]], GREEDY)[0]
    assert first.token_ids == expected[0]
    shared = PROMPTS[0][:117] + prompt(20, 9)
    again = eng.generate([shared], GREEDY)[0]
    assert again.cached_tokens == 112
    assert again.token_ids == hf_greedy(ref, shared, GREEDY.max_new_tokens)
    eng.scheduler.check_no_leaks()


def test_pages_round_trip(model_dir):
    """read_pages -> write_pages into other pages reproduces every buffer's rows (what HiCache and PD
    move), and a group's part that was given back reads as absent."""
    eng = engine(model_dir, page_size=4)
    eng.generate([PROMPTS[1]], GREEDY)
    pool: DSV4KVPool = eng.scheduler.runner.kv
    alloc = eng.scheduler.allocator
    cached = [p for p in range(alloc.num_pages) if not alloc.is_free(p)]
    alloc.groups[0].drop(cached[:2])  # as the cache's window eviction would
    data, present = pool.read_pages(cached)
    assert data.shape == (len(cached), *pool.page_shape)
    assert not present[:2, 0].any() and present[2:].all()
    fresh = alloc.alloc(len(cached), present)  # tombstones where a part was absent
    pool.write_pages(fresh, data)
    again, present_again = pool.read_pages(fresh)
    assert (present_again == present).all()
    torch.testing.assert_close(again, data, atol=0, rtol=0)
    assert data.abs().sum() > 0


def test_state_pages_through_every_tier(model_dir, tmp_path):
    """Entries and window rows demoted to L2, promoted back, and restored from L3 by a restarted
    engine give the answers of a plain engine."""
    prompt = LONG + [1, 2, 3]
    plain = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=4,
        disable_radix_cache=True,
    )
    want = plain.generate([prompt], TIER_GREEDY)[0].token_ids
    through_the_tiers(model_dir, prompt, want, str(tmp_path / "l3"))


def test_prefill_decode_pair_equals_a_single_engine(model_dir, expected):
    kw = dict(
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=4,
        disaggregation_secret="s3cret",
    )
    p = Engine(str(model_dir), disaggregation_mode="prefill", **kw)
    d = Engine(str(model_dir), disaggregation_mode="decode", **kw)
    assert pd_tokens(p, d, PROMPTS, GREEDY, 2000) == expected
    d.scheduler.check_no_leaks()
    p.scheduler.check_no_leaks()
    p.close()
    d.close()


def test_kv_layout_counts_entries_and_windows(model_dir):
    """Per token of a request's context (bf16, page 16): the entries (2 CSA layers x (32 + 16) values
    per 4 tokens, 1 HCA layer x 32 values in one row per 16-token page) plus the windows each request
    holds, two pages each: sliding K (4 layers x 32), CSA inputs (2 x 192), HCA inputs (1 x 64)."""
    from strata.bench.kv_layout import kv_layout

    row = kv_layout(model_dir, torch.bfloat16, (8192, 65536), page_size=16)
    entries = (2 * 48 / 4 + 32 / 16) * 2
    windows = 32 * (4 * 32 + 2 * 192 + 64) * 2
    assert row.bytes_per_token == entries == 52
    assert row.at_context == {
        8192: entries + windows / 8192,
        65536: entries + windows / 65536,
    }


def test_yarn_on_the_compressed_layers_matches(tmp_path):
    """Published V4 configs stretch the compressed layers' RoPE with YaRN (attention factor 1) and
    keep the sliding layers' plain: logits of a prompt past the original length still match."""
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    model_dir = make_dsv4(tmp_path / "yarn", rope_parameters=yarn)
    cfg = config_from_dir(model_dir)
    assert [spec.rope.rope_type for spec in cfg.layers] == [
        "default",
        "yarn",
        "yarn",
        "yarn",
    ]
    eng = engine(model_dir, page_size=16)
    req = Req(rid="y", prompt_ids=list(PROMPTS[0]), params=SamplingParams())
    logits = forward_logits(eng, [req], [len(PROMPTS[0])], num_decode=0)
    torch.testing.assert_close(
        logits, ref_logits(hf_model(model_dir), PROMPTS[0]), atol=1e-4, rtol=0
    )


def test_small_pool_under_pressure_stays_exact(model_dir, ref):
    """A pool too small for every request at once (and window groups smaller still): decodes are
    retracted and resumed, chunks of 7 split windows, the cache gives window pages back; every token
    is still transformers' and no page of any group leaks."""
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    prompts = [prompt(n, seed) for seed, n in zip(range(10, 14), (11, 43, 7, 22))]
    eng = engine(model_dir, kv_cache_tokens=96, page_size=4, chunked_prefill_size=7)
    got = [r.token_ids for r in eng.generate(prompts * 2, params)]
    assert eng.scheduler.num_retractions > 0
    assert got == [hf_greedy(ref, p, params.max_new_tokens) for p in prompts] * 2
    eng.scheduler.check_no_leaks()
