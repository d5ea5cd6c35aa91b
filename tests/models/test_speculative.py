"""Speculative decoding through the engine: greedy output identical with it on and off (n-gram drafts
and an oracle drafter whose runs are accepted for a while and then break), no KV leaks, only accepted
tokens in the prefix cache, the sampled distribution unchanged, and the adaptive policy's choices."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
import torch
from oracle_drafter import OracleDrafter

from strata import Engine, SamplingParams, kernels
from strata.engine.draft_policy import (
    EXPLORE_EVERY,
    DraftGuard,
    DraftPolicy,
    StepCost,
    batch_bucket,
)
from strata.engine.ngram import NgramDrafter, NgramIndex, SharedNgramIndex
from strata.layers.packed import blas_matmuls

REPETITIVE = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Paged attention keeps the KV cache in fixed-size pages. Paged attention keeps the KV",
    "Hello world! Hello world! Hello world! Hello",
    "Radix trees share prefixes between requests; schedulers batch them.",
]


def greedy(max_new: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True, **kw)


def engine(model_dir, spec: bool, **kw) -> Engine:
    options = dict(dtype="float32", kv_cache_tokens=2048, page_size=1)
    options.update(kw)
    if options.get("quantization"):
        options.setdefault(
            "device", "cpu"
        )  # block quantization runs on the CPU kernels
    if spec:
        options.update(speculative_algorithm="ngram", speculative_fixed_length=True)
    return Engine(str(model_dir), **options)


def run_all(eng: Engine, prompts, params):
    results = eng.generate(prompts, params)
    eng.scheduler.check_no_leaks()
    return results


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_output_is_identical_with_ngram_drafts(tiny_models, family, page_size):
    kw = dict(page_size=page_size, chunked_prefill_size=16)
    off = run_all(engine(tiny_models[family], False, **kw), REPETITIVE, greedy(40))
    on_engine = engine(tiny_models[family], True, **kw)
    on = run_all(on_engine, REPETITIVE, greedy(40))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = on_engine.scheduler.spec.stats
    assert stats.verify_steps > 0 and stats.accepted_tokens > 0, stats
    # again: radix hits on the prompts, and the shared index now knows the previous outputs
    again = run_all(on_engine, REPETITIVE, greedy(40))
    assert [r.token_ids for r in again] == [r.token_ids for r in off]
    assert all(r.cached_tokens > 0 for r in again)


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", {}),
        ("llama", {"page_size": 4, "chunked_prefill_size": 8}),
        ("gemma3", {"page_size": 4}),
        ("llama", {"quantization": "int8"}),
    ],
)
def test_greedy_identical_with_accepted_runs_and_rejections(tiny_models, family, kw):
    prompts = [
        "The quick brown fox",
        "Hello world!",
        "Numbers 0123",
        "Radix trees share prefixes",
    ]
    reference_engine = engine(tiny_models[family], False, **kw)
    off = run_all(reference_engine, prompts, greedy(48))
    on_engine = engine(tiny_models[family], True, **kw)
    refs = {tuple(on_engine.encode(p)): r.token_ids for p, r in zip(prompts, off)}
    on_engine.scheduler.spec.drafter = OracleDrafter(refs)
    on = run_all(on_engine, prompts, greedy(48))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = on_engine.scheduler.spec.stats
    assert stats.accepted_tokens > stats.verify_steps, (
        stats
    )  # runs longer than one token were accepted
    assert stats.accepted_tokens < stats.drafted_tokens, (
        stats
    )  # and some drafts were rejected


@pytest.fixture(scope="module")
def other_families(tmp_path_factory):
    """Tiny models of the families whose layers differ from Llama's: MoE, latent attention, sinks,
    softcaps, sliding windows in every layer, partial rotary, DeepSeek-V4 (tokenizers included)."""
    from tiny_dsv4 import make_dsv4
    from tiny_models import build_tokenizer, make_model

    root = tmp_path_factory.mktemp("spec_families")
    dirs = {}
    for family in (
        "mixtral",
        "qwen3_moe",
        "gpt_oss",
        "deepseek_v2_lora",
        "deepseek_v3",
        "gemma2",
        "mistral_sw",
        "phi3",
    ):
        dirs[family] = make_model(root / family, family)
    dirs["dsv4"] = make_dsv4(root / "dsv4")
    build_tokenizer(dirs["dsv4"])
    return dirs


@pytest.mark.parametrize(
    "family,kw",
    [
        ("mixtral", {}),
        ("qwen3_moe", {"dtype": "bfloat16", "page_size": 4, "chunked_prefill_size": 8}),
        ("gpt_oss", {}),
        ("deepseek_v2_lora", {"dtype": "bfloat16"}),
        ("deepseek_v3", {"quantization": "int4", "dtype": "bfloat16"}),
        ("gemma2", {"page_size": 4}),
        ("mistral_sw", {"page_size": 4, "chunked_prefill_size": 8}),
        ("phi3", {"dtype": "bfloat16"}),
        ("dsv4", {}),
        ("dsv4", {"dtype": "bfloat16", "page_size": 4}),
    ],
)
def test_greedy_identical_with_drafts_in_every_family(other_families, family, kw):
    """Verification rows attend, route and project as lone decodes do, whatever the layers are: the
    oracle drafter's long accepted runs and rejections, and the n-gram drafter, leave greedy output
    as it is without drafts."""
    prompts = ["The quick brown fox", "Hello world!", "Numbers 0123", *REPETITIVE]
    model_dir = other_families[family]
    off_engine = engine(model_dir, False, **kw)
    if kernels.cpu_ops() is not None and next(off_engine.model.parameters()).is_cpu:
        # every float matmul on the native kernels (routers, experts, MLA's absorbed products), but
        # DeepSeek-V4's own (its MoE, hyper-connections and compressed attention)
        assert (blas_matmuls(off_engine.model) == []) == (family != "dsv4"), (
            blas_matmuls(off_engine.model)
        )
    off = [r.token_ids for r in run_all(off_engine, prompts, greedy(40))]
    oracle = engine(model_dir, True, **kw)
    refs = {tuple(oracle.encode(p)): out for p, out in zip(prompts, off)}
    oracle.scheduler.spec.drafter = OracleDrafter(refs)
    assert [r.token_ids for r in run_all(oracle, prompts, greedy(40))] == off
    stats = oracle.scheduler.spec.stats
    assert (
        stats.accepted_tokens > stats.verify_steps
        and stats.accepted_tokens < stats.drafted_tokens
    ), stats
    assert [
        r.token_ids for r in run_all(engine(model_dir, True, **kw), prompts, greedy(40))
    ] == off


def test_logprobs_stop_strings_max_tokens_and_n_agree(llama_dir):
    prompt = "The quick brown fox"
    off_engine = engine(llama_dir, False)
    base = off_engine.generate(prompt, greedy(40))[0]
    text = base.text
    stop = text[
        len(text) // 2 : len(text) // 2 + 3
    ]  # ends inside what an accepted run covers
    cases = [
        greedy(40, logprobs=2),
        greedy(40, stop=[stop]),
        greedy(13),  # max_new_tokens reached mid-run
        greedy(30, n=3),
        SamplingParams(temperature=0, max_new_tokens=40),  # eos allowed
    ]
    on_engine = engine(llama_dir, True)
    on_engine.generate(
        prompt, greedy(40)
    )  # the same prefix-cache state as the other engine
    on_engine.scheduler.spec.drafter = OracleDrafter(
        {tuple(on_engine.encode(prompt)): base.token_ids}, corrupt=0.2
    )
    for params in cases:
        off = off_engine.generate(prompt, params)[0]
        on = on_engine.generate(prompt, params)[0]
        for a, b in zip(off.choices, on.choices, strict=True):
            assert (b.token_ids, b.text, b.finish_reason, b.matched_stop) == (
                a.token_ids,
                a.text,
                a.finish_reason,
                a.matched_stop,
            ), params
            # the same up to float rounding: a float matmul's summation order depends on its rows
            # (1 decoding, or k + 1 verifying), as it does on the batch without speculation
            assert [lp.token_id for lp in b.logprobs] == [
                lp.token_id for lp in a.logprobs
            ]
            for x, y in zip(a.logprobs, b.logprobs):
                assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
                assert [t.token_id for t in y.top] == [t.token_id for t in x.top]
        on_engine.scheduler.check_no_leaks()
    assert on_engine.scheduler.spec.stats.accepted_tokens > 0


def test_only_accepted_tokens_enter_the_prefix_cache(llama_dir):
    eng = engine(llama_dir, True, page_size=1)
    prompt = eng.encode("The quick brown fox")
    off = engine(llama_dir, False).generate(prompt, greedy(30))[0].token_ids
    eng.scheduler.spec.drafter = OracleDrafter(
        {tuple(prompt): off}, corrupt=1.0
    )  # every proposal has a bad token
    out = eng.generate(prompt, greedy(30))[0].token_ids
    assert out == off
    # the whole sequence but its last token is cached, and nothing longer matches
    seq = prompt + out
    match = eng.scheduler.cache.match_prefix(seq)
    assert match.cached_len == len(seq) - 1
    for bad in range(3, 8):
        assert (
            eng.scheduler.cache.match_prefix(seq[:-1] + [bad] + [bad]).cached_len
            <= len(seq) - 1
        )


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_page_leaks_with_drafts_and_aborts(llama_dir, page_size):
    rng = random.Random(page_size)
    eng = engine(
        llama_dir,
        True,
        kv_cache_tokens=256,
        page_size=page_size,
        chunked_prefill_size=16,
    )
    system = [rng.randrange(3, 380) for _ in range(24)]
    live: list[str] = []
    for _ in range(250):
        if rng.random() < 0.3 and len(live) < 10:
            motif = [rng.randrange(3, 380) for _ in range(rng.randint(2, 6))]
            prompt = (system if rng.random() < 0.6 else []) + motif * rng.randint(1, 6)
            params = SamplingParams(
                temperature=rng.choice([0.0, 1.0]),
                max_new_tokens=rng.randint(1, 40),
                ignore_eos=True,
                n=rng.choice([1, 1, 2]),
            )
            live += eng.add_request(prompt, params)
        if rng.random() < 0.05 and live:
            eng.abort(rng.choice(live))
        for out in eng.step():
            if out.finished and out.rid in live:
                live.remove(out.rid)
        eng.scheduler.check_no_leaks()
    while eng.scheduler.has_work():
        eng.step()
    eng.scheduler.check_no_leaks()
    sched = eng.scheduler
    assert (
        sched.allocator.num_free_pages + sched.cache.total_pages
        == sched.allocator.num_pages
    )
    assert sched.spec.stats.verify_steps > 0
    assert not sched.spec.drafter.own  # every request's index is gone with it


def test_greedy_identical_with_drafts_over_the_kv_tiers_and_under_memory_pressure(
    llama_dir,
):
    """Prefixes that come back from the host tier (a device pool too small to keep them), and
    requests retracted for want of pages and resumed, verify drafts as everywhere else: the same
    greedy output as without speculation, and no page leaked."""
    long_prompts = [p * 6 for p in REPETITIVE]
    tiered = {"enable_hierarchical_cache": True, "kv_cache_tokens": 512, "page_size": 4}
    off_engine, on_engine = (
        engine(llama_dir, False, **tiered),
        engine(llama_dir, True, **tiered),
    )
    for _ in range(
        3
    ):  # later rounds hit the prefixes the device pool gave up to the host
        off = [r.token_ids for r in run_all(off_engine, long_prompts, greedy(40))]
        assert [
            r.token_ids for r in run_all(on_engine, long_prompts, greedy(40))
        ] == off
    assert (
        on_engine.hicache.stats.promoted_pages > 0
        and on_engine.scheduler.spec.stats.accepted_tokens > 0
    )

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta"]
    prompts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(10, 60)))
        for _ in range(16)
    ]
    tight = {"kv_cache_tokens": 400, "page_size": 4, "chunked_prefill_size": 32}
    off = [
        r.token_ids
        for r in run_all(engine(llama_dir, False, **tight), prompts, greedy(64))
    ]
    on_engine = engine(llama_dir, True, **tight)
    assert [r.token_ids for r in run_all(on_engine, prompts, greedy(64))] == off
    assert (
        on_engine.scheduler.num_retractions > 0
        and on_engine.scheduler.spec.stats.accepted_tokens > 0
    )


def test_a_decode_worker_verifies_drafts_over_kv_from_its_prefill_worker(llama_dir):
    """Prefill/decode disaggregation with speculation on the decode worker (and configured, unused, on
    the prefill one): drafts verified over the KV that came over the wire give a single server's
    answers."""
    kw = {"kv_cache_tokens": 512, "page_size": 4, "disaggregation_secret": "s3cret"}
    single = engine(
        llama_dir,
        False,
        **{k: v for k, v in kw.items() if k != "disaggregation_secret"},
    )
    prompts = [single.encode(p) for p in REPETITIVE]
    expected = [r.token_ids for r in single.generate(prompts, greedy(40))]
    prefill = engine(llama_dir, True, disaggregation_mode="prefill", **kw)
    decode = engine(llama_dir, True, disaggregation_mode="decode", **kw)
    decode.scheduler.spec.drafter = OracleDrafter(
        {tuple(p): e for p, e in zip(prompts, expected)}, corrupt=0.5
    )
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        decode.add_request(
            prompt,
            greedy(40),
            rid=f"r{i}",
            bootstrap_room=700 + i,
            bootstrap_addr=prefill.disagg_endpoint,
        )
        prefill.add_request(prompt, greedy(40), rid=f"r{i}", bootstrap_room=700 + i)
        got[f"r{i}"] = []
    finished: set[str] = set()
    deadline = time.monotonic() + 60
    while len(finished) < len(prompts) and time.monotonic() < deadline:
        prefill.step()
        for out in decode.step():
            got[out.rid] += out.new_token_ids
            if out.finished:
                finished.add(out.rid)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    stats = decode.scheduler.spec.stats
    assert stats.accepted_tokens > stats.verify_steps > 0, stats
    for e in (prefill, decode):
        e.scheduler.check_no_leaks()
        e.close()


def test_sampled_tokens_keep_the_target_distribution(llama_dir):
    """Temperature, top-k, top-p and penalties: the first four output tokens of 1,500 seeded requests
    with drafts (each position's most frequent token: accepted often, rejected often) are distributed
    as without them (a chi-square test of homogeneity per position)."""
    prompt = "Hello world!"
    params = dict(
        temperature=1.0,
        top_k=8,
        top_p=0.95,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        max_new_tokens=4,
        ignore_eos=True,
    )
    n = 1500
    off_engine = engine(
        llama_dir, False, max_running_requests=512, kv_cache_tokens=16384
    )
    on_engine = engine(llama_dir, True, max_running_requests=512, kv_cache_tokens=16384)
    ids = on_engine.encode(prompt)

    def histograms(eng, seed0):
        outs = eng.generate(
            [ids] * n, [SamplingParams(seed=seed0 + i, **params) for i in range(n)]
        )
        return [Counter(o.token_ids[j] for o in outs) for j in range(4)]

    off = histograms(off_engine, 0)
    modes = [h.most_common(1)[0][0] for h in off]

    class ModeDrafter:
        def propose(self, rid, prompt, output, k):
            return modes[len(output) : len(output) + k], 2

        def finish(self, rid):
            pass

    on_engine.scheduler.spec.drafter = ModeDrafter()
    on = histograms(on_engine, 10**6)
    stats = on_engine.scheduler.spec.stats
    assert (
        stats.accepted_tokens > 100
        and stats.drafted_tokens - stats.accepted_tokens > 300
    ), stats
    for j in range(4):
        stat, critical = chi_square_homogeneity(off[j], on[j])
        assert stat < critical, (
            j,
            stat,
            critical,
            off[j].most_common(5),
            on[j].most_common(5),
        )


def chi_square_homogeneity(
    a: Counter, b: Counter, z: float = 3.29
) -> tuple[float, float]:
    """Pearson's statistic for "a and b (equal totals) are samples of one distribution", tokens with
    fewer than 10 observations in all pooled into one category, and its critical value at
    p = 0.0005 (z = 3.29; the chi-square quantile by Wilson-Hilferty)."""
    pooled_a, pooled_b = Counter(), Counter()
    for t in set(a) | set(b):
        key = t if a[t] + b[t] >= 10 else "rare"
        pooled_a[key] += a[t]
        pooled_b[key] += b[t]
    stat = sum(
        (pooled_a[k] - pooled_b[k]) ** 2 / (pooled_a[k] + pooled_b[k]) for k in pooled_a
    )
    df = max(1, len(pooled_a) - 1)
    return stat, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_structured_output_with_drafts(llama_dir):
    """A regex-constrained request: drafts the grammar forbids are cut before they are fed, and the
    output is the same as without speculation."""
    from strata.grammar.spec import GrammarSpec

    prompt = "Numbers 0123"
    params = greedy(
        20, structured=GrammarSpec(kind="regex", source=r"[0-9]{3}-[a-z ]{4,12}\.")
    )
    off = engine(llama_dir, False).generate(prompt, params)[0]
    on_engine = engine(llama_dir, True)
    ids = on_engine.encode(prompt)
    on_engine.scheduler.spec.drafter = OracleDrafter(
        {tuple(ids): off.token_ids}, corrupt=0.5
    )
    on = on_engine.generate(prompt, params)[0]
    assert (on.token_ids, on.text, on.finish_reason) == (
        off.token_ids,
        off.text,
        off.finish_reason,
    )
    on_engine.scheduler.check_no_leaks()


# ---------------------------------------------------------------------------- the parts


def test_ngram_index_finds_the_longest_earlier_match():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    assert index.lookup([1, 2, 3], 2) == (
        [9, 2],
        3,
    )  # 1 2 3 -> 9 (the suffix itself is not indexed)
    assert index.lookup([5, 2, 3], 3) == (
        [7, 1, 2],
        2,
    )  # "2 3" most recently followed by 7
    assert index.lookup([8], 2) == ([], 0)


def test_shared_index_holds_recent_texts_within_capacity():
    shared = SharedNgramIndex(2, 3, capacity=10)
    shared.add([1, 2, 3, 4, 5, 6])
    assert shared.lookup([1, 2], 2) == ([3, 4], 2)
    shared.add([7, 8, 9, 10, 11, 12])  # 12 tokens > 10: the first text goes
    assert shared.lookup([1, 2], 2) == ([], 0)
    assert shared.lookup([8, 9], 2) == ([10, 11], 2)
    assert shared.size == 6


def test_drafter_prefers_the_requests_own_text_then_recent_requests():
    drafter = NgramDrafter(2, 4, shared_tokens=1000)
    drafter.propose("a", [5, 6, 7, 8, 9], [], 3)
    drafter.finish("a")
    assert drafter.propose("b", [1, 5, 6], [], 3) == (
        [7, 8, 9],
        -2,
    )  # from request a: the length negated
    assert drafter.propose("c", [5, 6, 1, 2, 5, 6], [], 3) == (
        [1, 2, 5],
        2,
    )  # its own text wins a tie
    assert drafter.propose("d", [7, 5, 6, 5, 6], [], 3) == (
        [5, 6],
        2,
    )  # even when its draft is shorter
    assert drafter.propose("e", [6, 7, 1, 5, 6, 7], [], 3) == (
        [8, 9],
        -3,
    )  # a longer match elsewhere wins


def test_drafts_from_other_requests_learn_their_acceptance_apart():
    """Drafts found in other requests' texts are accepted far less often than a request's own: the
    policy keeps their rate apart, and a request's record with its own text does not lift them."""
    policy = DraftPolicy(max_draft=8)
    for _ in range(50):
        policy.record(2, drafted=4, accepted=4)  # own text, length 2: always right
        policy.record(
            -2, drafted=4, accepted=0
        )  # others' texts, length 2: always wrong
    good_history = (20.0, 20.0)
    assert policy.accept_rate(good_history, 2) > 0.95
    assert policy.accept_rate(good_history, -2) < 0.05
    assert policy.accept_rate((0.0, 0.0), -2) == policy.accept_rate(good_history, -2)


def test_step_cost_fit_and_policy_decisions():
    cost = StepCost()
    for rows, prefill in [
        (1, 0),
        (2, 64),
        (4, 0),
        (8, 128),
        (16, 0),
        (32, 256),
        (64, 0),
        (1, 32),
        (9, 0),
    ]:
        cost.observe(1, rows, prefill, 0.030 + 0.001 * rows + 0.0002 * prefill)
    a, b, c = cost.coefficients(
        1
    )  # the bucket of one decode has too few steps: the overall fit
    assert (a, b, c) == pytest.approx((0.030, 0.001, 0.0002), rel=1e-2)
    # per batch size: steps of 60-64 decodes whose rows cost 4 ms each get their own line
    for rows in [60, 64, 62, 61, 63, 64, 60, 62, 63, 61, 64, 60]:
        cost.observe(rows, rows, 0, 0.050 + 0.004 * rows)
    assert cost.coefficients(64)[:2] == pytest.approx((0.050, 0.004), rel=0.05)
    assert cost.coefficients(1) == pytest.approx((a, b, c), rel=0.2)
    policy = DraftPolicy(max_draft=8)
    policy.cost = cost
    from strata.engine.draft_policy import Candidate

    sure = Candidate("x", [1] * 8, 4, accept_rate=0.9)
    # one request: tokens are cheap next to the step (b / a = 1/30), so a likely draft is fed whole
    assert policy.choose([sure], base_tokens=1, num_decodes=1, budget=100) == [8]
    # a hopeless one is not
    assert policy.choose([Candidate("y", [1] * 8, 2, 0.02)], 1, 1, 100) == [0]
    # 64 decoding requests: a token costs 64x more output than it did; only near-certain ones pass
    many = [Candidate(i, [1] * 8, 4, 0.6) for i in range(64)]
    assert sum(policy.choose(many, base_tokens=64, num_decodes=64, budget=1000)) == 0
    # the budget caps the total
    assert sum(policy.choose([sure, sure], 1, 2, budget=5)) == 5


def test_a_step_where_no_draft_could_pay_looks_nothing_up():
    """could_draft bounds choose: where it says no, no candidate these requests could propose (any
    match length, own text or others') would be fed, so the speculator skips the lookups."""
    from strata.engine.draft_policy import Candidate
    from strata.engine.speculative import Speculator

    rng = random.Random(3)
    skipped = 0
    for trial in range(300):
        policy = DraftPolicy(max_draft=8)
        a, b = rng.uniform(0.002, 0.05), rng.uniform(0.0002, 0.004)
        for rows in (1, 2, 4, 9, 16, 33, 64, 5, 12):
            policy.cost.observe(1, rows, 0, a + b * rows)
        for n in rng.sample([-5, -3, -2, 2, 3, 4, 5], rng.randrange(0, 5)):
            tried = rng.uniform(0, 40)
            policy.by_match[n] = [rng.uniform(0, tried), tried]
        decodes = rng.choice([1, 2, 8, 32, 64, 128])
        histories = [
            (acc, acc + rng.uniform(0, 5))
            for acc in (rng.uniform(0, 10) for _ in range(decodes))
        ]
        candidates = [
            Candidate(i, [1] * 8, m, policy.accept_rate(h, m))
            for i, h in enumerate(histories)
            for m in [rng.choice([-4, -2, 2, 3, 5, 7])]
        ]
        if not policy.could_draft(histories, decodes, decodes):
            skipped += 1
            assert (
                sum(policy.choose(candidates, decodes, decodes, budget=10_000)) == 0
            ), trial
    assert 30 < skipped < 270  # both answers were tested

    class Counting:
        lookups = 0

        def propose(self, *args):
            Counting.lookups += 1
            return [7, 8, 9], 3

    class Config:
        speculative_ngram_min, speculative_ngram_max, speculative_shared_tokens = (
            2,
            5,
            1024,
        )
        speculative_num_draft_tokens, speculative_fixed_length = 8, False

    class R:
        rid, prompt_ids, output_ids, spec_history, grammar = (
            "r",
            [1, 2, 3],
            [4],
            (0.0, 0.0),
            None,
        )

    spec = Speculator(Config())
    spec.drafter = Counting()
    for rows in (
        1,
        2,
        4,
        9,
        16,
        33,
        64,
        5,
        12,
    ):  # a row costs as much as the rest of a step
        spec.policy.cost.observe(1, rows, 0, 0.005 + 0.005 * rows)
    spec.policy.guard.allows = lambda n: True
    assert (
        spec.plan([(R(), 8)] * 64, 64, 64, budget=1000) == [] and Counting.lookups == 0
    )
    assert spec.stats.declined == 64
    assert spec.plan([(R(), 8)], 1, 1, budget=1000) and Counting.lookups == 1


def run_guard(
    guard: DraftGuard, decodes: int, steps: int, plain_rate: float, draft_rate: float
) -> list[bool]:
    """Steps of one batch size where the policy always wants to draft: what the guard allows, with
    each arm's measured output rate (tokens per second) as given."""
    allowed = []
    for _ in range(steps):
        ok = guard.allows(decodes)
        allowed.append(ok)
        rate = draft_rate if ok else plain_rate
        guard.observe(decodes, ok, tokens=decodes * 2, seconds=decodes * 2 / rate)
    return allowed


def explorations(allowed: list[bool], arm: bool) -> bool:
    """Whether `arm` was taken on exactly the exploring steps: one in EXPLORE_EVERY."""
    return abs(allowed.count(arm) - len(allowed) / EXPLORE_EVERY) <= 1


def test_guard_vetoes_drafting_that_measures_slower_and_keeps_measuring():
    guard = DraftGuard()
    # drafts slower at 64 decodes: after both arms are measured, only exploring steps draft
    late = run_guard(guard, 64, 200, plain_rate=100.0, draft_rate=80.0)[100:]
    assert explorations(late, True)
    # faster at one decode: drafting stays on, with one plain step in EXPLORE_EVERY to measure
    late = run_guard(guard, 1, 200, plain_rate=30.0, draft_rate=45.0)[100:]
    assert explorations(late, False)
    # the 64-decode veto lifts once drafting pays there (the exploring steps see it)
    late = run_guard(guard, 64, 600, plain_rate=100.0, draft_rate=130.0)[400:]
    assert explorations(late, False)
    # batch sizes are told apart by powers of two
    assert batch_bucket(33) == batch_bucket(64) != batch_bucket(65)


def test_guard_explores_only_an_arm_not_seen_lately():
    """Steps that found nothing to draft measure the plain arm on their own: while they come often
    enough the guard takes no plain step of its own; once they stop, it does, one in EXPLORE_EVERY."""
    guard = DraftGuard()
    run_guard(guard, 1, 100, plain_rate=30.0, draft_rate=45.0)
    forced = 0
    for step in range(200):
        allowed = guard.allows(1)
        forced += not allowed
        nothing_found = (
            step % (EXPLORE_EVERY // 2) == 0
        )  # a plain step the drafter's miss made
        drafted = allowed and not nothing_found
        guard.observe(
            1,
            drafted,
            tokens=2 if drafted else 1,
            seconds=(2 / 45.0) if drafted else 1 / 30.0,
        )
    assert forced == 0
    # no more misses: forced plain steps come back at the old rate
    assert explorations(
        run_guard(guard, 1, 160, plain_rate=30.0, draft_rate=45.0), False
    )


def test_policy_stands_down_where_the_guard_says_drafts_are_slower():
    from strata.engine.draft_policy import Candidate

    policy = DraftPolicy(max_draft=4)
    for rows in [8, 16, 24, 32, 8, 20, 12, 28, 9]:
        policy.cost.observe(
            8, rows, 0, 0.030 + 0.0001 * rows
        )  # cheap rows: the model would draft
    run_guard(policy.guard, 8, 100, plain_rate=100.0, draft_rate=70.0)
    wants = [Candidate(i, [1] * 4, 4, 0.9) for i in range(8)]
    steps = range(EXPLORE_EVERY * 2)
    chosen = [
        sum(policy.choose(wants, 8, 8, budget=100)) if policy.allows(8) else 0
        for _ in steps
    ]
    assert sum(1 for c in chosen if c) == 2 and max(chosen) == 32


# ---------------------------------------------------------------------------- draft model


@pytest.fixture(scope="module")
def small_draft(llama_dir, tmp_path_factory):
    """The target with noise in its weights and the same tokenizer: a drafter right only some of the time."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "noisy"
    shutil.copytree(llama_dir, out)
    gen = torch.Generator().manual_seed(0)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        noisy = {
            k: v + 0.15 * v.std() * torch.randn(v.shape, generator=gen)
            if v.dim() == 2
            else v
            for k, v in tensors.items()
        }
        save_file(noisy, path, metadata={"format": "pt"})
    return out


def draft_engine(target, draft, **kw) -> Engine:
    options = dict(
        dtype="float32",
        kv_cache_tokens=2048,
        page_size=1,
        speculative_algorithm="draft",
        speculative_draft_model=str(draft),
        speculative_fixed_length=True,
    )
    options.update(kw)
    return Engine(str(target), **options)


def test_the_target_as_its_own_draft_model_is_always_right(llama_dir):
    off = engine(llama_dir, False).generate(REPETITIVE, greedy(40))
    eng = draft_engine(llama_dir, llama_dir, speculative_num_draft_tokens=5)
    on = eng.generate(REPETITIVE, greedy(40))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = eng.scheduler.spec.stats
    assert stats.verify_steps > 0 and stats.accepted_tokens == stats.drafted_tokens, (
        stats
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_smaller_draft_model_keeps_greedy_output_and_catches_up_after_prefix_hits(
    llama_dir, small_draft, page_size
):
    kw = dict(page_size=page_size, chunked_prefill_size=16)
    prompts = REPETITIVE[:2] + ["Numbers 0123456789 and punctuation"]
    off = engine(llama_dir, False, **kw).generate(prompts, greedy(24, n=2))
    eng = draft_engine(llama_dir, small_draft, **kw)
    for _ in range(
        2
    ):  # the second round hits the target's prefix cache; the draft replays
        on = eng.generate(prompts, greedy(24, n=2))
        assert [[c.token_ids for c in r.choices] for r in on] == [
            [c.token_ids for c in r.choices] for r in off
        ]
        eng.scheduler.check_no_leaks()
    stats = eng.scheduler.spec.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, stats
    drafter = eng.scheduler.spec.draft_model
    assert (
        not drafter.seqs
        and drafter.allocator.num_free_pages == drafter.allocator.num_pages
    )


def test_a_draft_model_with_another_tokenizer_is_refused(llama_dir, tmp_path):
    from tiny_models import make_model

    other = make_model(tmp_path / "other", "llama", vocab_size=384)
    import json

    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {
        t: (i + 7) % len(vocab["model"]["vocab"])
        for t, i in vocab["model"]["vocab"].items()
    }
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="tokenizer differs"):
        draft_engine(llama_dir, other)
    with pytest.raises(ValueError, match="goes with"):
        Engine(str(llama_dir), speculative_algorithm="draft")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_identical_over_float_weights(tmp_path, dtype):
    """Float weights run the native dense kernel, whose rows do not depend on the call's size, so a
    verification's rows are one-at-a-time decoding's bits. At this width oneDNN's packed bf16 linears
    (the fallback without the kernels) round some verification rows apart: with 6 such prompts and
    these drafts, 3 answers turned."""
    from tiny_models import make_model

    from strata.layers.packed import DenseLinear

    if kernels.cpu_ops() is None:
        pytest.skip("the CPU kernels could not be built here")
    model_dir = make_model(
        tmp_path / "wide",
        "llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.08,
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 300) for _ in range(rng.randrange(20, 120))] for _ in range(6)
    ]
    kw = dict(dtype=dtype, page_size=16, device="cpu")  # the CPU's kernels
    off_engine = engine(model_dir, False, **kw)
    linears = [
        m
        for m in off_engine.model.modules()
        if isinstance(m, (torch.nn.Linear, DenseLinear))
    ]
    assert linears and all(isinstance(m, DenseLinear) for m in linears)
    off = [r.token_ids for r in run_all(off_engine, prompts, greedy(48))]
    on_engine = engine(model_dir, True, **kw)
    on_engine.scheduler.spec.drafter = OracleDrafter(
        {tuple(p): r for p, r in zip(prompts, off)}
    )
    assert [r.token_ids for r in run_all(on_engine, prompts, greedy(48))] == off
    stats = on_engine.scheduler.spec.stats
    assert (
        stats.accepted_tokens > 3 * stats.verify_steps
        and stats.accepted_tokens < stats.drafted_tokens
    ), stats


def test_speculation_over_blas_matmuls_warns_that_rows_can_round_apart(
    llama_dir, caplog
):
    """Without the native kernels float weights go through BLAS (oneDNN/MKL, cuBLAS), which may sum a row
    in another order when the call has more rows, so a verification's rows are not promised the bits of
    one-at-a-time decoding; the engine says so at start. The native kernels (block-quantized weights, and
    the dense kernel for float ones) compute a row the same in any call: no warning."""
    with caplog.at_level("WARNING", logger="strata.engine.engine"):
        native = engine(llama_dir, True, device="cpu")
        quantized = engine(llama_dir, True, quantization="int8")
    if kernels.cpu_ops() is not None:
        assert blas_matmuls(native.model) == [] and blas_matmuls(quantized.model) == []
        assert "speculative decoding over float weights" not in caplog.text
    with kernels.disabled(), caplog.at_level("WARNING", logger="strata.engine.engine"):
        blas = engine(llama_dir, True, device="cpu")
        plain = engine(llama_dir, False, device="cpu")
    assert blas_matmuls(blas.model) == ["Linear"] and blas_matmuls(plain.model) == [
        "Linear"
    ]
    assert caplog.text.count("speculative decoding over float weights") == 1


@pytest.mark.parametrize("forward_ms,depth", [(0.5, 4), (3.0, 1), (30.0, 0)])
def test_a_draft_models_forwards_are_priced_into_the_draft_length(forward_ms, depth):
    """A draft model pays one forward per drafted depth: the depth is cut where the step's
    expected tokens per second, those forwards' measured time included, is highest (0: no draft,
    the model not run). Steps of 5 ms + 0.2 ms per row; drafts accepted at 0.8."""
    from strata.config import EngineConfig
    from strata.engine.request import Req
    from strata.engine.speculative import Speculator

    asked: list[int] = []

    class DraftModel:
        def draft(self, wants):
            asked.extend(k for _, _, k in wants)
            return [[7] * k for _, _, k in wants]

        def finish(self, rid):
            pass

    config = EngineConfig(
        speculative_algorithm="draft",
        speculative_draft_model="unused",
        speculative_num_draft_tokens=4,
    )
    spec = Speculator(config, DraftModel())
    for _ in range(40):
        for rows in (1, 3, 5):
            spec.policy.cost.observe(1, rows, 0, 0.005 + 0.0002 * rows)
        spec.draft_cost.observe(1, forward_ms / 1e3)
    spec.policy.guard.allows = lambda n: True
    req = Req(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams())
    req.spec_history = (80.0, 100.0)
    got = spec.plan([(req, 8)], 1, 1, 64)
    assert [len(d) for _, d, _ in got] == ([depth] if depth else [])
    assert asked == ([depth] if depth else [])
