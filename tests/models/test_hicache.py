"""KV cache hierarchy: answers are identical whichever tier a prefix comes from; tiers survive
restarts and are shared between engines; corrupt entries and dead backends degrade to recompute."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from strata import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
LONG = [(i * 7 + 3) % 370 + 5 for i in range(120)]  # a 120-token "document"


def make_engine(model_dir, **kw) -> Engine:
    opts = dict(
        dtype="float32", kv_cache_tokens=256, page_size=4, hicache_prefetch_threshold=16
    )
    opts.update(kw)
    return Engine(str(model_dir), **opts)


def fill_l1(engine: Engine, seed: int) -> None:
    """Push everything else out of L1 with unrelated prompts."""
    rng = random.Random(seed)
    for _ in range(3):
        engine.generate([[rng.randrange(5, 380) for _ in range(100)]], GREEDY)


@pytest.fixture(scope="module")
def expected(llama_dir):
    plain = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=4,
        disable_radix_cache=True,
    )
    return plain.generate([LONG + [1, 2, 3]], GREEDY)[0].token_ids


def check_hierarchy_leaks(engine: Engine) -> None:
    engine.scheduler.check_no_leaks()
    hc = engine.hicache
    assert hc.host_allocator.num_free_pages + len(hc.l2) == hc.config.host_pages


def test_l1_l2_l3_hits_give_identical_answers(llama_dir, expected, tmp_path):
    storage = str(tmp_path / "l3")
    eng = make_engine(
        llama_dir, hicache_storage_backend="file", hicache_storage_path=storage
    )
    prompt = LONG + [1, 2, 3]
    assert eng.generate([prompt], GREEDY)[0].token_ids == expected  # cold
    r = eng.generate([prompt], GREEDY)[0]  # in L1
    assert r.token_ids == expected and r.cached_tokens >= 116
    fill_l1(eng, 0)
    assert (
        eng.scheduler.cache.match_prefix(prompt).cached_len < 116
    )  # evicted from L1 ...
    outs = []
    (rid,) = eng.add_request(prompt, GREEDY)
    while not any(o.finished for o in outs):
        outs += [o for o in eng.step() if o.rid == rid]
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].cached_tokens_details["host"] > 0  # ... and promoted back from L2
    check_hierarchy_leaks(eng)
    eng.close()
    # a restarted engine finds the prefix only in L3
    eng2 = make_engine(
        llama_dir,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        hicache_prefetch_policy="wait_complete",
    )
    (rid,) = eng2.add_request(prompt, GREEDY)
    outs = []
    while not any(o.finished for o in outs):
        outs += [o for o in eng2.step() if o.rid == rid]
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].cached_tokens_details["storage"] >= 100
    assert eng2.hicache.stats.storage_read_pages > 0
    check_hierarchy_leaks(eng2)
    eng2.close()


@pytest.mark.parametrize(
    "policy", ["write_through", "write_through_selective", "write_back"]
)
def test_write_policies_reach_storage(llama_dir, expected, tmp_path, policy):
    storage = str(tmp_path / "l3")
    eng = make_engine(
        llama_dir,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        hicache_write_policy=policy,
        hicache_ratio=0.5,
    )
    prompt = LONG + [1, 2, 3]
    for _ in range(
        3
    ):  # hit it twice (write_through_selective writes on the second hit)
        assert eng.generate([prompt], GREEDY)[0].token_ids == expected
    fill_l1(eng, 0)
    fill_l1(
        eng, 1
    )  # with a small L2 this pushes its pages out of L2 too (write_back writes then)
    eng.hicache.flush()
    assert eng.hicache.stats.storage_written_pages > 0
    assert any(Path(storage).rglob("strata-kv-*"))
    check_hierarchy_leaks(eng)
    eng.close()


def test_corrupted_storage_entries_are_ignored_and_recomputed(
    llama_dir, expected, tmp_path
):
    storage = tmp_path / "l3"
    eng = make_engine(
        llama_dir, hicache_storage_backend="file", hicache_storage_path=str(storage)
    )
    eng.generate([LONG + [1, 2, 3]], GREEDY)
    eng.close()
    files = sorted(storage.rglob("strata-kv-*"))
    assert files
    for i, f in enumerate(
        files
    ):  # damage every entry: flip a byte, truncate, or swap contents
        data = f.read_bytes()
        if i % 3 == 0:
            f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        elif i % 3 == 1:
            f.write_bytes(data[: len(data) // 2])
        else:
            f.write_bytes(files[(i + 1) % len(files)].read_bytes())
    eng2 = make_engine(
        llama_dir,
        hicache_storage_backend="file",
        hicache_storage_path=str(storage),
        hicache_prefetch_policy="wait_complete",
    )
    r = eng2.generate([LONG + [1, 2, 3]], GREEDY)[0]
    assert r.token_ids == expected
    assert eng2.hicache.stats.corrupt_pages >= 1
    eng2.close()


def test_engines_share_a_file_backend_with_the_default_prefetch_policy(
    llama_dir, expected, tmp_path
):
    storage = str(tmp_path / "shared")
    a = make_engine(
        llama_dir, hicache_storage_backend="file", hicache_storage_path=storage
    )
    b = make_engine(
        llama_dir, hicache_storage_backend="file", hicache_storage_path=storage
    )
    assert b.hicache.config.prefetch_policy == "auto"
    a.generate([LONG + [1, 2, 3]], GREEDY)
    a.hicache.flush()
    # a's prefill was measured (admission to cached prompt); b has only its priors, which say wait
    ((tokens, seconds),) = a.hicache.prefill_rate.samples
    assert tokens == len(LONG) + 2 and seconds > 0
    assert not b.hicache.prefill_rate.samples and not b.hicache.read_rate.samples
    r = b.generate([LONG + [9, 9, 9]], GREEDY)[0]
    assert r.cached_tokens >= 100 and b.hicache.stats.hit_tokens["storage"] >= 100
    assert len(b.hicache.read_rate.samples) == 1  # the fetch was measured too
    assert b.generate([LONG + [1, 2, 3]], GREEDY)[0].token_ids == expected
    a.close()
    b.close()


@pytest.mark.parametrize(
    "other", [{"quantization": "int8"}, {"kv_cache_dtype": "bfloat16"}]
)
def test_engines_whose_kv_differs_never_exchange_pages(llama_dir, tmp_path, other):
    """Quantized weights or another KV dtype make other KV bytes: the namespace keeps them apart."""
    storage = str(tmp_path / "shared")
    device = (
        {"device": "cpu"} if "quantization" in other else {}
    )  # block quantization: the CPU kernels
    a = make_engine(
        llama_dir,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        **device,
    )
    b = make_engine(
        llama_dir,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        hicache_prefetch_policy="wait_complete",
        **other,
        **device,
    )
    assert a.hicache.namespace != b.hicache.namespace
    a.generate([LONG + [1, 2, 3]], GREEDY)
    a.hicache.flush()
    assert a.hicache.stats.storage_written_pages > 0
    r = b.generate([LONG + [9, 9, 9]], GREEDY)[0]
    assert r.cached_tokens == 0 and b.hicache.stats.hit_tokens["storage"] == 0
    a.close()
    b.close()


def test_file_storage_stays_within_its_size_bound(llama_dir, tmp_path):
    storage = tmp_path / "l3"
    page_bytes = (
        4 * 512 + 80
    )  # 4 tokens x (2 layers x K,V x 2 heads x 16 dims x 4 bytes) + header
    bound = 40 * page_bytes
    eng = make_engine(
        llama_dir,
        hicache_storage_backend="file",
        hicache_storage_path=str(storage),
        hicache_storage_max_gib=bound / 2**30,
        hicache_storage_ttl=3600,
    )
    assert (
        abs(eng.hicache.storage.max_bytes - bound) <= 1
        and eng.hicache.storage.ttl_s == 3600
    )
    rng = random.Random(5)
    for _ in range(4):  # ~100 pages written through
        eng.generate([[rng.randrange(5, 380) for _ in range(100)]], GREEDY)
    eng.hicache.flush()
    assert eng.hicache.stats.storage_written_pages > 80
    files = list(storage.rglob("strata-kv-*"))
    assert files and sum(f.stat().st_size for f in files) <= bound
    assert {f.stat().st_size for f in files} == {page_bytes}
    eng.close()


def test_engines_share_a_redis_backend_and_survive_its_death(
    llama_dir, expected, redis_server
):
    proc, url = redis_server
    a = make_engine(
        llama_dir, hicache_storage_backend="redis", hicache_storage_path=url
    )
    b = make_engine(
        llama_dir,
        hicache_storage_backend="redis",
        hicache_storage_path=url,
        hicache_prefetch_policy="wait_complete",
    )
    a.generate([LONG + [1, 2, 3]], GREEDY)
    a.hicache.flush()
    import redis

    pages = redis.Redis.from_url(url).keys("strata-kv-*")
    assert (
        pages and 0 < redis.Redis.from_url(url).pttl(pages[0]) <= 86400 * 1000
    )  # the default TTL
    r = b.generate([LONG + [9, 9, 9]], GREEDY)[0]
    assert r.cached_tokens >= 100
    proc.kill()
    proc.wait()
    other = [(i * 11 + 5) % 370 + 5 for i in range(120)]
    c = make_engine(
        llama_dir,
        hicache_storage_backend="redis",
        hicache_storage_path=url,
        hicache_prefetch_policy="timeout",
        hicache_prefetch_timeout=5.0,
    )
    start = time.monotonic()
    got = c.generate([LONG + [1, 2, 3], other], GREEDY)
    assert time.monotonic() - start < 30
    assert got[0].token_ids == expected
    assert c.hicache.stats.storage_errors >= 1
    for e in (a, b, c):
        e.close()


def run_one(engine: Engine, prompt: list[int]):
    """Greedy tokens of one request and its last output (which carries the per-tier hits)."""
    (rid,) = engine.add_request(prompt, GREEDY)
    outs = []
    while not any(o.finished for o in outs):
        outs += [o for o in engine.step() if o.rid == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def through_the_tiers(
    model_dir, prompt: list[int], want: list[int], storage: str, check=None, **options
) -> None:
    """`prompt` answered with `want` cold, then with its prefix promoted from L2 after L1 forgot
    it, then by a restarted engine that finds it only in the L3 file store under `storage`
    (`options`: more engine flags for both; `check`: called with the first engine once built)."""
    eng = make_engine(
        model_dir,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        **options,
    )
    if check is not None:
        check(eng)
    assert eng.generate([prompt], GREEDY)[0].token_ids == want
    fill_l1(eng, 0)
    assert eng.scheduler.cache.match_prefix(prompt).cached_len < 100
    tokens, last = run_one(eng, prompt)
    assert tokens == want and last.cached_tokens_details["host"] >= 100
    check_hierarchy_leaks(eng)
    eng.close()
    eng2 = make_engine(
        model_dir,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        hicache_prefetch_policy="wait_complete",
        **options,
    )
    tokens, last = run_one(eng2, prompt)
    assert tokens == want and last.cached_tokens_details["storage"] >= 100
    check_hierarchy_leaks(eng2)
    eng2.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_windowed_model_through_every_tier(tiny_models, tmp_path, page_size):
    """Gemma 3 (window 8, a KV pool per layer group): pages demoted, promoted and restored from L3
    carry their window groups' parts or say they lack them; answers stay those of a plain engine.
    (A split pool, so that L1's pressure falls on whole pages: the same prompt sent again matches
    inside its cached leaf, a point whose window KV a shared pool gives back first; the shared pool
    through the tiers is the next test's.)"""
    model = tiny_models["gemma3"]
    prompt = LONG + [1, 2, 3]
    plain = Engine(
        str(model),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=page_size,
        disable_radix_cache=True,
    )
    expected = plain.generate([prompt], GREEDY)[0].token_ids

    def windowed(
        eng: Engine,
    ) -> None:  # the windowed layout, not every layer in one pool
        assert eng.scheduler.allocator.groups

    through_the_tiers(
        model,
        prompt,
        expected,
        str(tmp_path / "l3"),
        check=windowed,
        page_size=page_size,
        swa_pool="split",
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_shared_window_pool_through_the_tiers(tiny_models, tmp_path, page_size):
    """Gemma 3 with full and window layers drawing from one L1 pool: a conversation pushed out of L1
    comes back from L2, and after a restart from L3, with only the window KV its next turn reads
    (promoted pages take pool pages for the parts they carry); its tokens stay a plain engine's."""
    model = tiny_models["gemma3"]
    storage = str(tmp_path / "l3")
    eng = make_engine(
        model,
        page_size=page_size,
        kv_cache_tokens=160,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
    )
    assert eng.scheduler.allocator.shared
    prompt = LONG + [1, 2, 3]
    first = eng.generate([prompt], GREEDY)[0]
    turn2 = prompt + first.token_ids + [4, 5]
    plain = Engine(
        str(model),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=page_size,
        disable_radix_cache=True,
    )
    expected = plain.generate([turn2], GREEDY)[0].token_ids
    fill_l1(eng, 1)
    tokens, last = run_one(eng, turn2)
    assert tokens == expected and last.cached_tokens_details["host"] >= 100
    check_hierarchy_leaks(eng)
    eng.close()
    eng2 = make_engine(
        model,
        page_size=page_size,
        kv_cache_tokens=160,
        hicache_storage_backend="file",
        hicache_storage_path=storage,
        hicache_prefetch_policy="wait_complete",
    )
    tokens, last = run_one(eng2, turn2)
    assert tokens == expected and last.cached_tokens_details["storage"] >= 100
    check_hierarchy_leaks(eng2)
    eng2.close()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_no_leaks_across_demote_promote_cycles(
    tiny_models, tmp_path, page_size, family
):
    rng = random.Random(page_size)
    eng = make_engine(
        tiny_models[family],
        page_size=page_size,
        kv_cache_tokens=160,
        hicache_ratio=1.5,
        hicache_storage_backend="file",
        hicache_storage_path=str(tmp_path / "l3"),
        chunked_prefill_size=24,
    )
    docs = [
        [rng.randrange(5, 380) for _ in range(rng.randint(20, 60))] for _ in range(5)
    ]
    live: list[str] = []
    for _ in range(250):
        if rng.random() < 0.3 and len(live) < 6:
            prompt = rng.choice(docs) + [
                rng.randrange(5, 380) for _ in range(rng.randint(1, 10))
            ]
            live += eng.add_request(
                prompt,
                SamplingParams(
                    temperature=0, max_new_tokens=rng.randint(1, 12), ignore_eos=True
                ),
            )
        if rng.random() < 0.03 and live:
            eng.abort(rng.choice(live))
        for out in eng.step():
            if out.finished and out.rid in live:
                live.remove(out.rid)
        check_hierarchy_leaks(eng)
    while eng.scheduler.has_work():
        eng.step()
    check_hierarchy_leaks(eng)
    stats = eng.hicache.stats
    assert stats.demoted_pages > 0 and stats.promoted_pages > 0
    # the host pages written so far (what L2 adds to resident memory) never pass its size, and
    # cover at least the pages L2 holds now
    page_bytes = eng.hicache.host.page_bytes
    held = len(eng.hicache.l2) * page_bytes
    assert 0 < held <= stats.host_touched_bytes <= stats.host_bytes
    eng.close()
