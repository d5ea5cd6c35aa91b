"""The planner's simulated replica decides what the engine's scheduler decides: one trace of arrivals
replayed through a tiny random-weight engine and through `Replica`, step by step.

Both call strata.engine.policy (and chunking.prefill_piece); this test is what keeps the rest of
the two step loops (the order requests are looked at, when KV is allocated, what a finished or
retracted request gives back) from drifting apart. Per step it compares which requests run, how
many tokens each feeds (chunk sizes, decodes), which were retracted, and the new-token ratio.

What is compared under which conditions, and why:
  - KV is the engine's pages at page_size 1 (the simulation counts tokens).
  - Without the prefix cache every decision must agree exactly.
  - With the prefix cache, the simulation matches blocks of `block_size` tokens and compares one
    block where the engine compares in_batch_prefix_tokens tokens: with block_size 1 and prompts
    that share either a long prefix or none, both hit and defer alike. The pool is large enough
    that nothing is evicted: the engine's radix tree evicts its least recently used leaves, the
    simulation its blocks in the order they were released, which can pick different prefixes.
  - Speculative decoding is not compared: the engine drafts with n-gram lookups and a measured
    step cost, the simulation with the cost model and one acceptance rate.
"""

from __future__ import annotations

import random

import pytest

from strata.engine.batch import ScheduleBatch
from strata.engine.engine import Engine
from strata.engine.hooks import StepObserver
from strata.engine.policy import SchedulePolicy
from strata.plan.cost_model import CostModel
from strata.plan.replica import Replica, ReplicaConfig, SimRequest, Step
from strata.plan.workload import SimTurn
from strata.sampling_params import SamplingParams

# one step's decisions: ((request, tokens fed) in batch order, requests retracted, new-token ratio)
Decision = tuple[tuple[tuple[str, int], ...], frozenset[str], float]

FLAGS = dict(
    max_running_requests=6,
    max_batch_tokens=32,
    chunked_prefill_size=16,
    max_prefill_tokens=64,
)


def trace(seed: int, shared_prefix: bool) -> list[tuple[int, list[int], int]]:
    """Arrivals in order: (how many batches ran before it arrives, prompt ids, max_new_tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(40)]
    out = []
    for i in range(14):
        body = [rng.randrange(3, 300) for _ in range(rng.randint(3, 50))]
        prompt = (system + body) if shared_prefix and i % 2 else body
        out.append((rng.choice([0, 0, 0, 3, 8, 15]), prompt, rng.randint(2, 60)))
    return sorted(out, key=lambda a: a[0])


def due(pending: list, batches: int, idle: bool) -> list[tuple[int, list[int], int]]:
    """Pop the arrivals due before batch number `batches` (when `idle`, at least the next one)."""
    n = sum(1 for a in pending if a[1][0] <= batches)
    return [pending.pop(0) for _ in range(max(n, 1 if idle and pending else 0))]


class Recorder(StepObserver):
    """Reads each scheduled batch of the engine, with what its scheduling retracted."""

    def __init__(self, engine: Engine):
        self.sched = engine.scheduler
        self.reqs: dict = {}  # rid -> Req, kept after they finish
        self.retractions: dict[str, int] = {}
        self.steps: list[Decision] = []

    def on_scheduled(self, batch: ScheduleBatch | None) -> None:
        if batch is None:
            return
        retracted = frozenset(
            rid
            for rid, req in self.reqs.items()
            if req.num_retractions > self.retractions.get(rid, 0)
        )
        self.retractions = {rid: req.num_retractions for rid, req in self.reqs.items()}
        items = tuple((r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens))
        self.steps.append((items, retracted, self.sched.new_token_ratio))


def run_engine(model_dir, arrivals, cache: bool) -> tuple[list[Decision], int]:
    eng = Engine(
        str(model_dir),
        dtype="float32",
        page_size=1,
        kv_cache_tokens=2048 if cache else 128,
        disable_radix_cache=not cache,
        **FLAGS,
    )
    rec = Recorder(eng)
    eng.scheduler.add_observer(rec)
    pool_tokens = eng.scheduler.allocator.num_free_pages
    pending = list(enumerate(arrivals))
    while pending or eng.scheduler.has_requests():
        idle = not eng.scheduler.has_requests()
        for i, (_, prompt, max_new) in due(pending, len(rec.steps), idle):
            params = SamplingParams(
                max_new_tokens=max_new, temperature=0.0, ignore_eos=True
            )
            (rid,) = eng.add_request(prompt, params, rid=f"r{i}")
            rec.reqs[rid] = eng.scheduler.reqs[rid]
        eng.step()
    return rec.steps, pool_tokens


class ManualLoop:
    """The cluster's event loop, run one event at a time so arrivals can be put between steps;
    `on_step` sees each step as the replica schedules it (its end is the event it asks for)."""

    def __init__(self, on_step):
        self.now = 0.0
        self.events: list[tuple[float, object, tuple]] = []
        self.on_step = on_step

    def at(self, t, fn, *args) -> None:
        if args and isinstance(args[0], Step):
            self.on_step(args[0])
        self.events.append((t, fn, args))
        self.events.sort(key=lambda e: e[0])


def run_sim(
    arrivals, pool_tokens: int, cache: bool, policy: SchedulePolicy | None = None
) -> list[Decision]:
    loop = ManualLoop(lambda step: record(step))
    cfg = ReplicaConfig(
        kv_cache_tokens=pool_tokens,
        disable_radix_cache=not cache,
        block_size=1,
        **FLAGS,
    )
    rep = Replica("sim", cfg, CostModel(coef={"overhead": 0.01}), loop, policy=policy)
    reqs: dict[int, SimRequest] = {}
    seen: dict[int, int] = {}
    names: dict[int, str] = {}
    steps: list[Decision] = []

    def record(step: Step) -> None:
        retracted = frozenset(
            names[k] for k, r in reqs.items() if r.retractions > seen.get(k, 0)
        )
        seen.update({k: r.retractions for k, r in reqs.items()})
        items = tuple((names[id(r)], n) for r, n, _ in step.items)
        steps.append((items, retracted, rep.ratio.value))

    pending = list(enumerate(arrivals))
    while pending or loop.events:
        # the end of a step schedules the next one, so what arrives before batch k arrives here
        # before the end of batch k - 1; arrivals to an idle replica are queued together (as
        # between two engine steps) before it starts a step
        idle = not loop.events
        rep.busy = True
        for i, (_, prompt, max_new) in due(pending, len(steps), idle):
            turn = SimTurn(i, 0, tuple(prompt), tuple(range(max_new)))
            r = rep.new_request(turn, loop.now, max_new)
            reqs[id(r)], names[id(r)] = r, f"r{i}"
            rep.submit(r)
        rep.busy = not idle
        if idle:
            rep.kick()
            continue
        t, fn, args = loop.events.pop(0)
        loop.now = t
        fn(*args)
    return steps


def first_difference(real: list[Decision], sim: list[Decision]) -> str | None:
    for i, (a, b) in enumerate(zip(real, sim)):
        if a != b:
            return f"step {i}: engine {a} / simulation {b}"
    if len(real) != len(sim):
        return f"engine ran {len(real)} steps, the simulation {len(sim)}"
    return None


@pytest.mark.parametrize(
    "seed,cache", [(0, False), (4, False), (6, False), (3, True), (4, True)]
)
def test_the_simulated_replica_decides_as_the_scheduler(llama_dir, seed, cache):
    arrivals = trace(seed, shared_prefix=cache)
    real, pool_tokens = run_engine(llama_dir, arrivals, cache)
    assert first_difference(real, run_sim(arrivals, pool_tokens, cache)) is None
    # the trace exercises what is compared: chunked prompts, steps at the token budget, and
    # (the small pool) admission held back by the KV budget and retractions
    fed = [n for items, _, _ in real for _, n in items]
    assert max(fed) == FLAGS["chunked_prefill_size"]
    assert any(
        sum(n for _, n in items) == FLAGS["max_batch_tokens"] for items, _, _ in real
    )
    if not cache:
        assert any(retracted for _, retracted, _ in real)
    else:  # shared prefixes were reused (nothing is retracted in the large pool)
        assert sum(fed) < sum(len(p) + m - 1 for _, p, m in arrivals)


def test_the_parity_check_catches_a_policy_that_drifted(llama_dir):
    """One constant changed on the simulation's side changes its decisions, and the check says so."""
    arrivals = trace(0, shared_prefix=False)
    real, pool_tokens = run_engine(llama_dir, arrivals, cache=False)
    for drifted in (
        SchedulePolicy(reserve_clip_tokens=4),
        SchedulePolicy(retract_ratio_step=0.3),
    ):
        sim = run_sim(arrivals, pool_tokens, cache=False, policy=drifted)
        assert first_difference(real, sim) is not None
        assert [s[0] for s in sim] != [
            s[0] for s in real
        ]  # not only the ratio: decisions
