"""The simulator on cases that can be checked by hand, with the round-number cost model of conftest.py
(a step: 10 ms + 1 ms per token fed + 2 us per decode context token)."""

from __future__ import annotations

import pytest

from strata.bench.datasets import DatasetConfig
from strata.plan.cluster import Deployment, Simulation, simulate
from strata.plan.cost_model import CostModel
from strata.plan.replica import ReplicaConfig
from strata.plan.workload import SimTurn, Workload, answer_ids, dataset_workload


def one(prompt: tuple[int, ...], output_len: int, conv: int = 0) -> list[SimTurn]:
    return [SimTurn(conv, 0, prompt, answer_ids(conv, 0, output_len))]


def run_checked(workload: Workload, dep: Deployment, cost: CostModel, seed: int = 0):
    """Simulate, then check the KV accounting of every worker came back to zero (no leaked KV)."""
    sim = Simulation(workload, dep, cost, seed)
    result = sim.run()
    for w in sim.decode + sim.prefill:
        rep = w.replica
        assert rep.private_tokens == 0, rep.name
        assert all(c == 0 for c in rep.device.locks.values()), rep.name
        assert not rep.running and not rep.waiting
    return result


@pytest.mark.parametrize("prompt_len,chunk", [(100, 2048), (5000, 2048)])
def test_one_request_alone_ttft_is_its_prefill_time(cost, prompt_len, chunk):
    prompt = tuple(range(prompt_len))
    wl = Workload([one(prompt, 5)], [0.0])
    r = run_checked(
        wl, Deployment(1, replica=ReplicaConfig(chunked_prefill_size=chunk)), cost
    )
    chunks = [min(chunk, prompt_len - i) for i in range(0, prompt_len, chunk)]
    prefill = sum(0.010 + 0.001 * n for n in chunks)
    decodes = [0.010 + 0.001 + 2e-6 * (prompt_len + i) for i in range(4)]
    rec = r.records[0]
    assert rec.ttft == pytest.approx(prefill)
    assert rec.itls == pytest.approx(decodes)
    assert rec.e2e == pytest.approx(prefill + sum(decodes))
    assert r.workers[0].steps == len(chunks) + 4


def test_request_overhead_shifts_what_the_client_sees(cost):
    wl = Workload([one(tuple(range(100)), 3)], [0.0])
    base = simulate(wl, Deployment(1), cost).records[0]
    shifted = simulate(wl, Deployment(1), cost.with_(request_overhead_s=0.05)).records[
        0
    ]
    assert shifted.ttft == pytest.approx(base.ttft + 0.05)
    assert shifted.itls == pytest.approx(base.itls)


@pytest.mark.parametrize("policy,hits", [("cache_aware", True), ("round_robin", False)])
def test_a_shared_prefix_hits_on_the_second_request_with_cache_aware_routing(
    cost, policy, hits
):
    prefix = tuple(range(1000, 1256))  # 256 tokens = 16 whole blocks
    a = [SimTurn(0, 0, prefix + tuple(range(16)), answer_ids(0, 0, 4))]
    b = [SimTurn(1, 0, prefix + tuple(range(50, 66)), answer_ids(1, 0, 4))]
    wl = Workload(
        [a, b], [0.0, 5.0]
    )  # the second arrives long after the first finished
    r = run_checked(wl, Deployment(2, policy=policy), cost)
    second = max(r.records, key=lambda x: x.start)
    assert second.cached_tokens == (256 if hits else 0)
    busy = sorted(w.steps for w in r.workers)
    assert (
        busy[0] == 0
    ) == hits  # cache_aware kept both on one replica, round_robin used both
    # the hit shortens the second prefill: 16 new tokens instead of 272
    assert second.ttft == pytest.approx(0.010 + 0.001 * (16 if hits else 272))


def test_pd_split_first_token_waits_for_prefill_transfer_and_a_decode_step(cost):
    wl = Workload([one(tuple(range(100)), 5)], [0.0])
    r = run_checked(wl, Deployment(1, num_prefill=1), cost)
    prefill = 0.010 + 0.001 * 100
    transfer = 0.001 + 100 * 1000 / 1e9
    first_decode = (
        0.010 + 0.001 + 2e-6 * 100
    )  # the decode worker's step that takes the request in
    rec = r.records[0]
    assert rec.ttft == pytest.approx(prefill + transfer + first_decode)
    assert rec.output_len == 5
    roles = {w.role: w.steps for w in r.workers}
    assert roles == {
        "prefill": 1,
        "decode": 4,
    }  # the first decode step yields tokens 1 and 2


def test_closed_loop_obeys_littles_law(cost):
    cfg = DatasetConfig(
        name="random", num_prompts=200, input_len=64, output_len=16, range_ratio=0.5
    )
    wl = dataset_workload(cfg, max_concurrency=8)
    r = run_checked(wl, Deployment(1), cost)
    s = r.summary
    # N = X * W: 8 requests in flight throughout (but the last few), X requests/s, W mean E2E
    assert s.request_throughput * s.e2e.mean_ms / 1000 == pytest.approx(8, rel=0.05)


def test_saturated_throughput_is_bounded_by_the_step_rate():
    flat = CostModel(coef={"overhead": 0.010})  # every step 10 ms, whatever it holds
    cfg = DatasetConfig(name="random", num_prompts=80, input_len=32, output_len=32)
    r = run_checked(
        dataset_workload(cfg),
        Deployment(1, replica=ReplicaConfig(max_running_requests=4)),
        flat,
    )
    bound = 4 / 0.010  # at most 4 requests sample a token per step
    assert 0.9 * bound <= r.summary.output_throughput <= bound


def test_a_tight_kv_pool_retracts_and_still_finishes_everything(cost):
    cfg = DatasetConfig(name="random", num_prompts=24, input_len=100, output_len=60)
    dep = Deployment(1, replica=ReplicaConfig(kv_cache_tokens=800))
    r = run_checked(dataset_workload(cfg), dep, cost)
    assert r.summary.completed == 24
    assert r.workers[0].kv_peak_tokens <= 800
    assert r.workers[0].retractions > 0


def test_the_host_tier_turns_evicted_turns_into_hits(cost):
    cfg = DatasetConfig(
        name="multi-turn", num_prompts=8, num_turns=3, input_len=96, output_len=16
    )
    wl = lambda: dataset_workload(cfg, max_concurrency=8)  # noqa: E731  (8 histories > 1024 tokens of L1)
    small = ReplicaConfig(kv_cache_tokens=1024)
    without = run_checked(wl(), Deployment(1, replica=small), cost)
    with_l2 = run_checked(
        wl(),
        Deployment(
            1, replica=ReplicaConfig(kv_cache_tokens=1024, host_cache_tokens=4096)
        ),
        cost,
    )
    assert without.hit_rate["host"] == 0
    assert with_l2.hit_rate["host"] > 0
    assert sum(with_l2.hit_rate.values()) > sum(without.hit_rate.values()) + 0.1


def test_shared_storage_serves_a_prefix_computed_on_another_replica(cost):
    cfg = DatasetConfig(
        name="shared-prefix",
        num_groups=2,
        prompts_per_group=4,
        system_len=256,
        question_len=16,
        output_len=4,
    )
    replica = ReplicaConfig(host_cache_tokens=4096, prefetch_threshold_tokens=64)
    wl = lambda: dataset_workload(cfg, max_concurrency=1)  # noqa: E731
    shared = run_checked(
        wl(),
        Deployment(2, policy="round_robin", replica=replica, storage_tokens=None),
        cost,
    )
    alone = run_checked(
        wl(),
        Deployment(2, policy="round_robin", replica=replica, storage_tokens=0),
        cost,
    )
    assert shared.hit_rate["storage"] > 0.2
    assert alone.hit_rate["storage"] == 0
    assert shared.summary.ttft.median_ms < alone.summary.ttft.median_ms


def test_speculative_decoding_pays_at_low_load_and_stops_itself_at_high_load(cost):
    spec = cost.with_(spec_accept_rate=0.7, spec_max_draft=4)
    on, off = ReplicaConfig(speculative=True), ReplicaConfig()
    single = Workload([one(tuple(range(64)), 64)], [0.0])
    fast = run_checked(single, Deployment(1, replica=on), spec)
    slow = run_checked(single, Deployment(1, replica=off), spec)
    assert fast.summary.e2e.mean_ms < 0.75 * slow.summary.e2e.mean_ms
    # 64 decodes: a step costs 10 + 64 ms for 64 tokens, a draft 1 ms for 0.7: not worth it
    cfg = DatasetConfig(name="random", num_prompts=64, input_len=32, output_len=32)
    busy = run_checked(dataset_workload(cfg), Deployment(1, replica=on), spec)
    plain = run_checked(dataset_workload(cfg), Deployment(1, replica=off), spec)
    assert busy.summary.output_throughput == pytest.approx(
        plain.summary.output_throughput, rel=0.1
    )


def test_co_located_replicas_share_the_machine(cost):
    # two 100-token prompts (110 ms of compute each) on two replicas of one host, the second 55 ms later:
    # the first runs alone for 55 ms, then both at half speed until it ends at 165 ms; the second has
    # done 55 ms of work by then and finishes its last 55 ms alone, at 220 ms
    a = one(tuple(range(100)), 1, conv=0)
    b = [SimTurn(1, 0, tuple(range(500, 600)), answer_ids(1, 0, 1))]
    wl = Workload([a, b], [0.0, 0.055])
    r = run_checked(wl, Deployment(2, policy="least_load", replicas_per_host=2), cost)
    first, second = sorted(r.records, key=lambda x: x.start)
    assert first.ttft == pytest.approx(0.165)
    assert second.ttft == pytest.approx(0.220 - 0.055)
    apart = run_checked(wl, Deployment(2, policy="least_load"), cost)
    assert [x.ttft for x in apart.records] == pytest.approx([0.110, 0.110])


def test_co_located_steps_slow_each_other_by_their_own_kind():
    """Processor sharing with a contention per step kind: a decode step beside a prefill chunk,
    decodes unaffected (0), prefills sharing evenly (1): the decode ends on time, the chunk gets
    half speed while both run."""
    from strata.plan.cluster import EventLoop, Host

    loop = EventLoop()
    host = Host(loop, contention=0.0, contention_prefill=1.0)
    ends = {}
    host.run(
        "decode-replica",
        1.0,
        lambda: ends.setdefault("decode", loop.now),
        prefill=False,
    )
    host.run(
        "prefill-replica",
        1.0,
        lambda: ends.setdefault("prefill", loop.now),
        prefill=True,
    )
    loop.run()
    assert ends["decode"] == pytest.approx(1.0) and ends["prefill"] == pytest.approx(
        1.5
    )


def test_the_drafters_forward_is_charged_and_declines_drafting_where_it_costs_more():
    """A draft model or block drafter costs a forward on every step that drafts (`spec_draft_s`),
    beside its verified rows: one request, steps of 10 ms + 1 ms per row, accept rate 0.7."""
    from strata.plan.cost_model import CostModel

    base = CostModel(coef={"overhead": 0.010, "per_row": 0.001})
    single = Workload([one(tuple(range(64)), 64)], [0.0])
    on = Deployment(1, replica=ReplicaConfig(speculative=True))
    spec = base.with_(spec_accept_rate=0.7, spec_max_draft=4)
    free = run_checked(single, on, spec)
    cheap = run_checked(single, on, spec.with_(spec_draft_s=0.004))
    dear = run_checked(single, on, spec.with_(spec_draft_s=0.050))
    plain = run_checked(single, Deployment(1), spec)
    # 4 drafts: 1 + 0.7 + 0.49 + 0.34 + 0.24 = 2.77 tokens for 15 ms (+4: 19 ms) vs 1 for 11 ms
    assert (
        free.summary.e2e.mean_ms < cheap.summary.e2e.mean_ms < plain.summary.e2e.mean_ms
    )
    steps = cheap.workers[0].steps
    assert cheap.summary.e2e.mean_ms == pytest.approx(
        free.summary.e2e.mean_ms + 4 * (steps - 1), rel=0.02
    )
    # a 50 ms forward for 1.77 more tokens: drafting declined, the plain steps' times
    assert dear.summary.e2e.mean_ms == pytest.approx(plain.summary.e2e.mean_ms)
