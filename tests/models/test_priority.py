"""Request priority: a waiting request of a higher priority (a lower value) is admitted first and
preempts running requests of a lower one when the running limit or the KV budget keeps it out;
requests of one priority never preempt each other; preempted requests still finish exactly."""

from __future__ import annotations

from test_parity import PROMPTS, hf_greedy, hf_model

from strata import Engine, SamplingParams
from strata.engine.hooks import StepObserver
from strata.engine.policy import preemption_victim

BATCH = 10  # the low priority used here (a batch job's)


def params(priority: int, max_new_tokens: int = 24) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True, priority=priority
    )


def run(engine: Engine, pending: set[str], order: list[str]) -> None:
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.rid)
                order.append(out.rid)


def test_a_higher_priority_request_preempts_at_the_running_limit(llama_dir):
    ref = hf_model(llama_dir)
    engine = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=1024, max_running_requests=2
    )
    low = [engine.add_request(p, params(BATCH, 40))[0] for p in PROMPTS[:2]]
    for _ in range(5):
        engine.step()
    assert {r.rid for r in engine.scheduler.running} == set(low)
    urgent = engine.add_request(PROMPTS[2], params(0))[0]
    engine.step()
    running = {r.rid for r in engine.scheduler.running}
    assert urgent in running and len(running) == 2
    assert engine.scheduler.num_preemptions == 1
    assert (
        engine.scheduler.num_retractions == 0
    )  # not a KV shortage: the ratio is untouched
    order: list[str] = []
    run(engine, {urgent, *low}, order)
    assert order[0] == urgent
    got = {rid: engine._collect([rid]).token_ids for rid in (urgent, *low)}
    assert got[urgent] == hf_greedy(ref, PROMPTS[2], 24)
    for rid, prompt in zip(low, PROMPTS[:2]):
        assert got[rid] == hf_greedy(ref, prompt, 40)
    engine.scheduler.check_no_leaks()


def test_a_higher_priority_request_preempts_when_kv_runs_short(llama_dir):
    ref = hf_model(llama_dir)
    engine = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=128, page_size=4)
    low = [engine.add_request(p + [11], params(BATCH, 40))[0] for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    urgent = engine.add_request(PROMPTS[2], params(-1, 20))[0]
    engine.step()
    assert urgent in {r.rid for r in engine.scheduler.running}
    assert engine.scheduler.num_preemptions >= 1
    order: list[str] = []
    run(engine, {urgent, *low}, order)
    assert order[0] == urgent
    assert engine._collect([urgent]).token_ids == hf_greedy(ref, PROMPTS[2], 20)
    for rid, prompt in zip(low, PROMPTS[:2]):
        assert engine._collect([rid]).token_ids == hf_greedy(ref, prompt + [11], 40)
    engine.scheduler.check_no_leaks()


def test_equal_priorities_wait_their_turn(llama_dir):
    engine = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=1024, max_running_requests=2
    )
    first = [engine.add_request(p, params(0, 30))[0] for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    late = engine.add_request(PROMPTS[2], params(0, 5))[0]
    order: list[str] = []
    run(engine, {late, *first}, order)
    assert engine.scheduler.num_preemptions == 0
    assert order[-1] == late
    engine.scheduler.check_no_leaks()


def test_waiting_requests_are_admitted_by_priority_then_arrival(llama_dir):
    engine = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=1024, max_running_requests=1
    )
    rids = [
        engine.add_request(PROMPTS[0], params(5, 4))[0],
        engine.add_request(PROMPTS[1], params(1, 4))[0],
        engine.add_request(PROMPTS[3], params(5, 4))[0],
        engine.add_request(PROMPTS[2], params(-3, 4))[0],
    ]
    order: list[str] = []
    run(engine, set(rids), order)
    assert order == [rids[3], rids[1], rids[0], rids[2]]


class _R:
    def __init__(self, priority, outputs, prompt, arrival):
        self.priority, self.num_outputs = priority, outputs
        self.prompt_len, self.arrival = prompt, arrival


def test_preemption_victim_is_the_lowest_priority_with_least_work():
    a, b, c, d = _R(0, 1, 5, 0), _R(10, 9, 5, 1), _R(10, 2, 5, 2), _R(5, 0, 5, 3)
    assert preemption_victim([a, b, c, d], 0) is c
    assert preemption_victim([a, b, c, d], 10) is None
    assert preemption_victim([a, d], 3) is d
    assert preemption_victim([a], 0) is None


class Batches(StepObserver):
    def __init__(self):
        self.batches: list[list[str]] = []

    def on_scheduled(self, batch) -> None:
        if batch is not None:
            self.batches.append([r.rid for r in batch.reqs])


def test_a_step_feeding_an_urgent_prompt_carries_no_lower_priority_rows(llama_dir):
    """Decodes and prompt chunks of a lower priority wait while a higher one's prompt is fed, so
    its first token is not slowed by them; everything still finishes exactly."""
    ref = hf_model(llama_dir)
    engine = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=2048, chunked_prefill_size=8
    )
    seen = Batches()
    engine.scheduler.add_observer(seen)
    low = [
        engine.add_request(PROMPTS[2], params(BATCH, 30))[0],  # 41 tokens: 6 chunks
        engine.add_request(PROMPTS[0], params(BATCH, 30))[0],
    ]
    for _ in range(3):
        engine.step()  # one low request decodes, the other is mid-prompt
    urgent = engine.add_request(PROMPTS[3], params(0, 10))[0]  # 18 tokens: 3 chunks
    order: list[str] = []
    run(engine, {urgent, *low}, order)
    with_urgent = [b for b in seen.batches if urgent in b]
    feeding = with_urgent[:3]  # its three prompt chunks
    assert all(b == [urgent] for b in feeding), feeding
    assert any(set(low) & set(b) for b in with_urgent[3:])  # then they run beside it
    assert engine._collect([urgent]).token_ids == hf_greedy(ref, PROMPTS[3], 10)
    for rid, prompt in zip(low, [PROMPTS[2], PROMPTS[0]]):
        assert engine._collect([rid]).token_ids == hf_greedy(ref, prompt, 30)
    engine.scheduler.check_no_leaks()
