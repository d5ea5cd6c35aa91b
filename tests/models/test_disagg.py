"""Prefill/decode disaggregation between two engines over TCP (loopback): identical greedy answers,
clear failures and no leaked slots when the prefill worker dies, and no KV from strangers."""

from __future__ import annotations

import time

import pytest

from strata import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 33, 91, 120, 7, 64, 200, 13], list(range(30, 71)), [300, 301, 302, 99, 98]]


def engine(model_dir, mode, secret="s3cret", **kw):
    return Engine(str(model_dir), dtype="float32", kv_cache_tokens=512, page_size=4,
                  disaggregation_mode=mode, disaggregation_secret=secret, **kw)


def run_pair(prefill: Engine | None, decode: Engine, rids: list[str], deadline_s: float = 60) -> dict:
    outs: dict[str, list] = {r: [] for r in rids}
    done: set[str] = set()
    start = time.monotonic()
    while len(done) < len(rids) and time.monotonic() - start < deadline_s:
        if prefill is not None:
            prefill.step()
        for o in decode.step():
            if o.rid in outs:
                outs[o.rid].append(o)
                if o.finished:
                    done.add(o.rid)
    return outs


@pytest.fixture(scope="module")
def expected(llama_dir):
    single = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=512)
    return [r.token_ids for r in single.generate(PROMPTS, GREEDY)]


def test_prefill_then_decode_equals_a_single_server(llama_dir, expected):
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    rids = []
    for i, prompt in enumerate(PROMPTS):
        room = 1000 + i
        # the decode side may hear of the request first: its Hello waits on the prefill side
        d.add_request(prompt, GREEDY, rid=f"r{i}", bootstrap_room=room, bootstrap_addr=p.disagg_endpoint)
        p.add_request(prompt, GREEDY, rid=f"r{i}", bootstrap_room=room)
        rids.append(f"r{i}")
    outs = run_pair(p, d, rids)
    got = [[t for o in outs[r] for t in o.new_token_ids] for r in rids]
    assert got == expected
    assert all(outs[r][-1].finish_reason == "length" for r in rids)
    assert p.disagg.stats["sent"] == 3 and d.disagg.stats["received"] == 3
    d.scheduler.check_no_leaks()
    p.scheduler.check_no_leaks()
    p.close()
    d.close()


def test_dead_prefill_worker_fails_clearly_and_frees_slots(llama_dir):
    p = engine(llama_dir, "prefill")
    d = engine(llama_dir, "decode", disaggregation_timeout=1.0)
    free_before = d.scheduler.allocator.num_free_pages
    d.add_request(PROMPTS[1], GREEDY, rid="x", bootstrap_room=7, bootstrap_addr=p.disagg_endpoint)
    p.add_request(PROMPTS[1], GREEDY, rid="x", bootstrap_room=7)
    assert d.scheduler.allocator.num_free_pages < free_before  # slots reserved for the transfer
    p.close()  # the prefill worker dies before computing anything
    outs = run_pair(None, d, ["x"], deadline_s=10)
    last = outs["x"][-1]
    assert last.finished and last.finish_reason == "error" and "did not deliver" in last.error
    assert not d.scheduler.prealloc
    d.scheduler.check_no_leaks()
    d.close()


def test_wrong_secret_or_unannounced_room_gets_nothing(llama_dir):
    p = engine(llama_dir, "prefill")
    intruder = engine(llama_dir, "decode", secret="wrong", disaggregation_timeout=1.0)
    stranger = engine(llama_dir, "decode", disaggregation_timeout=1.0)
    p.add_request(PROMPTS[0], GREEDY, rid="a", bootstrap_room=1)
    intruder.add_request(PROMPTS[0], GREEDY, rid="a", bootstrap_room=1, bootstrap_addr=p.disagg_endpoint)
    stranger.add_request(PROMPTS[0], GREEDY, rid="b", bootstrap_room=99, bootstrap_addr=p.disagg_endpoint)
    deadline = time.monotonic() + 10
    results = {}
    while len(results) < 2 and time.monotonic() < deadline:
        p.step()
        for name, eng in (("intruder", intruder), ("stranger", stranger)):
            for o in eng.step():
                if o.finished:
                    results[name] = o
    assert results["intruder"].finish_reason == "error"
    assert results["stranger"].finish_reason == "error"
    assert p.disagg.stats["rejected"] >= 1 and p.disagg.stats["sent"] == 0
    for e in (p, intruder, stranger):
        e.scheduler.check_no_leaks()
        e.close()


def test_disaggregated_workers_refuse_plain_requests(llama_dir):
    d = engine(llama_dir, "decode")
    with pytest.raises(ValueError, match="bootstrap_room"):
        d.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="shared secret"):
        Engine(str(llama_dir), dtype="float32", kv_cache_tokens=64, disaggregation_mode="prefill")
    d.close()
