"""Mooncake under the engine: two engines share a Mooncake store as L3 (the second's prompt is an L3
hit with the same greedy tokens) and keep serving when its master dies; a prefill/decode pair whose
KV moves through Mooncake's transfer engine answers as one engine does."""

from __future__ import annotations

import time

from test_disagg import GREEDY as PD_GREEDY
from test_disagg import PROMPTS, run_pair
from test_hicache import GREEDY, LONG, check_hierarchy_leaks, make_engine

from strata import Engine


def mooncake_l3(master, **kw) -> Engine:
    path = f"{master.url}?global_segment_size={64 << 20}&local_buffer_size={16 << 20}"
    return make_engine(
        master.llama_dir,
        hicache_storage_backend="mooncake",
        hicache_storage_path=path,
        **kw,
    )


def test_engines_share_a_mooncake_store_and_survive_its_master(
    llama_dir, mooncake_master
):
    mooncake_master.llama_dir = llama_dir
    plain = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=4,
        disable_radix_cache=True,
    )
    expected = plain.generate([LONG + [1, 2, 3]], GREEDY)[0].token_ids
    a = mooncake_l3(mooncake_master)
    b = mooncake_l3(mooncake_master, hicache_prefetch_policy="wait_complete")
    assert a.generate([LONG + [1, 2, 3]], GREEDY)[0].token_ids == expected
    a.hicache.flush()
    assert (
        a.hicache.stats.storage_written_pages >= 29
        and a.hicache.stats.storage_errors == 0
    )
    r = b.generate([LONG + [1, 2, 3]], GREEDY)[
        0
    ]  # b never saw this prompt: its prefix comes from L3
    assert r.token_ids == expected
    assert r.cached_tokens >= 116 and b.hicache.stats.hit_tokens["storage"] >= 116
    mooncake_master.kill()
    other = [(i * 11 + 5) % 370 + 5 for i in range(120)]
    start = time.monotonic()
    got = b.generate(
        [other, LONG + [1, 2, 3]], GREEDY
    )  # L1 still serves; L3 errors are misses
    a.generate([other], GREEDY)
    a.hicache.flush()
    assert time.monotonic() - start < 60
    assert got[1].token_ids == expected
    c = mooncake_l3(
        mooncake_master, hicache_prefetch_policy="timeout", hicache_prefetch_timeout=5.0
    )
    assert (
        c.generate([LONG + [1, 2, 3]], GREEDY)[0].token_ids == expected
    )  # starts and serves without it
    c.hicache.flush()
    assert a.hicache.stats.storage_errors + b.hicache.stats.storage_errors >= 1
    assert c.hicache.stats.storage_errors >= 1
    for e in (a, b, c):
        check_hierarchy_leaks(e)
        e.close()


def test_prefill_then_decode_through_mooncake_equals_a_single_engine(
    llama_dir, mooncake_master
):
    # the transfer engine needs no master; the fixture skips where Mooncake cannot run
    single = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=512)
    expected = [r.token_ids for r in single.generate(PROMPTS, PD_GREEDY)]
    opts = {
        "dtype": "float32",
        "kv_cache_tokens": 512,
        "page_size": 4,
        "disaggregation_secret": "s3cret",
        "disaggregation_transfer_backend": "mooncake",
    }
    p = Engine(str(llama_dir), disaggregation_mode="prefill", **opts)
    d = Engine(str(llama_dir), disaggregation_mode="decode", **opts)
    rids = []
    for i, prompt in enumerate(PROMPTS):
        d.add_request(
            prompt,
            PD_GREEDY,
            rid=f"m{i}",
            bootstrap_room=3000 + i,
            bootstrap_addr=p.disagg_endpoint,
        )
        p.add_request(prompt, PD_GREEDY, rid=f"m{i}", bootstrap_room=3000 + i)
        rids.append(f"m{i}")
    outs = run_pair(p, d, rids)
    assert [[t for o in outs[r] for t in o.new_token_ids] for r in rids] == expected
    assert (
        p.disagg.stats["sent"] == 3
        and d.disagg.stats["received"] == 3
        and d.disagg.stats["rejected"] == 0
    )
    pulled = d.disagg.transport.stats["pulled_bytes"]
    assert (
        pulled == d.disagg.stats["bytes_received"] == p.disagg.stats["bytes_sent"] > 0
    )
    deadline = time.monotonic() + 5
    while (
        p.disagg.transport.staged and time.monotonic() < deadline
    ):  # acks free the prefill's payloads
        p.step()
        time.sleep(0.01)
    assert not p.disagg.transport.staged
    for e in (p, d):
        e.scheduler.check_no_leaks()
        e.close()
