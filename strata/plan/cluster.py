"""A simulated deployment: replicas (or P prefill + D decode workers) behind the router, one event loop.

    EventLoop   a heap of (time, sequence, callback): the discrete-event core (no dependency)
    Deployment  how many replicas of which ReplicaConfig, the router's policies, PD, L3, co-location
    simulate()  serve a Workload on a Deployment with a CostModel -> SimResult

Routing reuses the router's own policy classes (strata/router/policy.py, cache_aware.py) over
stand-in workers whose `load` is what the real router computes when its polls are fresh: the
requests it has in flight there. Cache-aware keys are `prefix_tree.token_key` of the prompt ids,
so the same prefix tree decides.

PD: each request goes to a prefill worker (`prefill_policy`) and a decode worker (`policy`) at
once. The decode worker reserves KV for the prompt (retried each step while full); the prefill
worker runs the prompt with max_new_tokens 1; once both are done the KV travels
(pd_latency_s + bytes / pd_bytes_per_s) and the decode worker takes the request in at its next
step, whose end is the first token the client sees.

Co-location: `replicas_per_host` > 1 puts that many replicas on one machine's compute (the CPU
case, `strata router --launch 2` on one box). `Host` shares it: while k of its replicas are in a
step, each step progresses at 1 / (1 + contention x (k - 1)) of its solo speed (processor
sharing: contention 1 = they split the machine evenly, 0 = no interference; one figure for decode
steps, one for steps with prefill chunks), and every step in
flight is re-timed whenever one starts or ends.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from strata.plan.cost_model import CostModel
from strata.plan.kv_tiers import LRUBlocks
from strata.plan.replica import Replica, ReplicaConfig, SimRequest
from strata.plan.results import SimResult, collect
from strata.plan.workload import SimTurn, Workload
from strata.router.config import RouterConfig
from strata.router.policy import RoutingKey
from strata.router.prefix_tree import token_key
from strata.router.registry import POLICIES, make_policy

if TYPE_CHECKING:
    from strata.router.worker import Worker


class EventLoop:
    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


@dataclass(frozen=True)
class Deployment:
    num_replicas: int = 1  # data-parallel replicas; with PD: the decode workers
    num_prefill: int = 0  # PD: prefill workers (0: no disaggregation)
    policy: str = "cache_aware"
    prefill_policy: str = "least_load"
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    storage_tokens: int | None = (
        0  # shared L3 capacity (tokens); None: unbounded; 0: no L3
    )
    replicas_per_host: int = 1
    contention: float = (
        1.0  # slowdown per other busy co-located replica, of a decode step
    )
    contention_prefill: float | None = (
        None  # of a step with prefill chunks (None: `contention`)
    )
    cache_threshold: float = (
        0.3  # the cache_aware policy's knobs (RouterConfig's defaults)
    )
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_prefill < 0:
            raise ValueError(
                "a deployment needs >= 1 (decode) replica and >= 0 prefill workers"
            )
        for name in ("policy", "prefill_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(
                    f"{name} must be one of {tuple(POLICIES)}, got {getattr(self, name)!r}"
                )
        if (
            self.replicas_per_host < 1
            or self.contention < 0
            or (self.contention_prefill or 0) < 0
        ):
            raise ValueError("replicas_per_host must be >= 1 and contention >= 0")

    @property
    def num_workers(self) -> int:
        return self.num_replicas + self.num_prefill

    @property
    def label(self) -> str:
        return (
            f"PD {self.num_prefill}P+{self.num_replicas}D"
            if self.num_prefill
            else f"{self.num_replicas} replica(s)"
        )


class Host:
    """Processor sharing of one machine among the steps of its co-located replicas: with k steps in
    flight each advances at 1 / (1 + c (k - 1)) of its solo speed, c by the step's kind (a decode
    step, memory-bound, suffers less from a neighbour than a prefill chunk does)."""

    def __init__(
        self,
        loop: EventLoop,
        contention: float,
        contention_prefill: float | None = None,
    ):
        self.loop, self.contention = loop, contention
        self.contention_prefill = (
            contention if contention_prefill is None else contention_prefill
        )
        # id(replica) -> [work left (solo seconds), done callback, version, contention]
        self.active: dict[int, list] = {}
        self.updated = 0.0
        self.version = itertools.count()

    def _rate(self, contention: float) -> float:
        return 1.0 / (1.0 + contention * max(0, len(self.active) - 1))

    def _advance(self) -> None:
        elapsed = self.loop.now - self.updated
        for entry in self.active.values():
            entry[0] = max(0.0, entry[0] - elapsed * self._rate(entry[3]))
        self.updated = self.loop.now

    def _reschedule(self) -> None:
        for key, entry in self.active.items():
            entry[2] = next(self.version)
            self.loop.at(
                self.loop.now + entry[0] / self._rate(entry[3]),
                self._finish,
                key,
                entry[2],
            )

    def run(
        self, replica, seconds: float, done: Callable[[], None], prefill: bool = False
    ) -> None:
        self._advance()
        self.active[id(replica)] = [
            seconds,
            done,
            0,
            self.contention_prefill if prefill else self.contention,
        ]
        self._reschedule()

    def _finish(self, key: int, version: int) -> None:
        entry = self.active.get(key)
        if entry is None or entry[2] != version:
            return  # re-timed since
        self._advance()
        del self.active[key]
        self._reschedule()
        entry[1]()


class _Worker:
    """What a router policy sees: a URL and a load (requests in flight there)."""

    def __init__(self, url: str, replica: Replica):
        self.url = url
        self.replica = replica
        self.in_flight = 0

    @property
    def load(self) -> int:
        return self.in_flight


class _Router:
    def __init__(
        self, workers: list[_Worker], policy: str, dep: Deployment, rng: random.Random
    ):
        cfg = RouterConfig(
            policy=policy,
            cache_threshold=dep.cache_threshold,
            balance_abs_threshold=dep.balance_abs_threshold,
            balance_rel_threshold=dep.balance_rel_threshold,
        )
        self.workers = workers
        self.policy = make_policy(cfg, rng)

    def choose(self, prompt: tuple[int, ...]) -> _Worker:
        # a _Worker stands in for the router's Worker: the policies read only its url and load
        workers = cast("list[Worker]", self.workers)
        choice = self.policy.choose(workers, RoutingKey(token_key(list(prompt))))
        return cast(_Worker, choice.worker)


class Simulation:
    def __init__(
        self, workload: Workload, dep: Deployment, cost: CostModel, seed: int = 0
    ):
        self.workload, self.dep, self.cost = workload, dep, cost
        self.loop = EventLoop()
        rng = random.Random(seed)
        self.think_rng = random.Random(seed + 1)
        cap = dep.storage_tokens
        self.storage = (
            LRUBlocks(None if cap is None else cap // dep.replica.block_size)
            if cap != 0
            else None
        )
        hosts: dict[int, Host] = {}

        def make(name: str, index: int, on_finish) -> Replica:
            host = None
            if dep.replicas_per_host > 1:
                host = hosts.setdefault(
                    index // dep.replicas_per_host,
                    Host(self.loop, dep.contention, dep.contention_prefill),
                )
            return Replica(
                name,
                dep.replica,
                cost,
                self.loop,
                self.storage,
                on_finish,
                host,
                random.Random(rng.random()),
            )

        self.decode = [
            _Worker(f"r{i}", make(f"r{i}", i, self._on_finish))
            for i in range(dep.num_replicas)
        ]
        n = dep.num_replicas
        self.prefill = [
            _Worker(f"p{i}", make(f"p{i}", n + i, self._on_prefilled))
            for i in range(dep.num_prefill)
        ]
        self.router = _Router(self.decode, dep.policy, dep, rng)
        self.prefill_router = (
            _Router(self.prefill, dep.prefill_policy, dep, rng)
            if self.prefill
            else None
        )
        self.done: list[SimRequest] = []
        self.in_flight = 0
        self.pending: deque[tuple[int, int]] = deque()
        self.pd: dict[
            int, dict
        ] = {}  # id(decode-side request) -> {prefill done, reserved, ...}

    # ----------------------------------------------------------------- requests

    def run(self) -> SimResult:
        for ci, t in enumerate(self.workload.arrivals):
            self.loop.at(t, self._arrive, ci, 0)
        self.loop.run()
        stuck = self.workload.num_requests - len(self.done)
        if stuck:
            raise RuntimeError(
                f"{stuck} requests never finished in the simulation (a KV budget that can never fit?)"
            )
        return collect(
            self.done,
            [w.replica for w in self.decode],
            [w.replica for w in self.prefill],
            self,
        )

    def _arrive(self, ci: int, turn: int) -> None:
        cap = self.workload.max_concurrency
        if cap is not None and self.in_flight >= cap:
            self.pending.append((ci, turn))
            return
        self.in_flight += 1
        self._send(self.workload.conversations[ci][turn])

    def _send(self, turn: SimTurn) -> None:
        now = self.loop.now
        worker = self.router.choose(turn.prompt)
        worker.in_flight += 1
        req = worker.replica.new_request(turn, now, turn.output_len)
        req.worker = worker
        if self.prefill_router is None:
            worker.replica.submit(req)
            return
        pworker = self.prefill_router.choose(turn.prompt)
        pworker.in_flight += 1
        preq = pworker.replica.new_request(turn, now, 1)
        preq.worker, preq.decode_req = pworker, req
        self.pd[id(req)] = {
            "prefilled_t": None,
            "reserved": worker.replica.reserve(req),
        }
        pworker.replica.submit(preq)

    def _on_prefilled(self, preq: SimRequest, now: float) -> None:
        preq.worker.in_flight -= 1
        req = preq.decode_req
        assert req is not None  # a PD prefill feeds a decode-side request
        req.cached_by_tier = preq.cached_by_tier
        state = self.pd[id(req)]
        state["prefilled_t"] = now
        self._maybe_transfer(req)

    def _maybe_transfer(self, req: SimRequest) -> None:
        state = self.pd[id(req)]
        if state["prefilled_t"] is None:
            return
        if not state["reserved"]:
            state["reserved"] = req.alloc >= req.prompt_len
            if not state["reserved"]:
                self.loop.at(
                    self.loop.now + 0.005, self._maybe_transfer, req
                )  # the decode side retries each step
                return
        seconds = (
            self.cost.pd_latency_s
            + self.cost.kv_bytes(req.prompt_len) / self.cost.pd_bytes_per_s
        )
        self.loop.at(self.loop.now + seconds, req.worker.replica.kv_arrived, req)

    def _on_finish(self, req: SimRequest, now: float) -> None:
        req.worker.in_flight -= 1
        self.pd.pop(id(req), None)
        self.done.append(req)
        self.in_flight -= 1
        conv = self.workload.conversations[req.turn.conversation]
        if req.turn.turn + 1 < len(
            conv
        ):  # the next turn, after the user's pause (if any)
            think = self.workload.think_time_s
            pause = self.think_rng.expovariate(1.0 / think) if think > 0 else 0.0
            self.loop.at(
                now + pause, self._arrive, req.turn.conversation, req.turn.turn + 1
            )
        if self.pending:
            self.loop.at(now, self._arrive, *self.pending.popleft())


def simulate(
    workload: Workload, dep: Deployment, cost: CostModel, seed: int = 0
) -> SimResult:
    """Serve `workload` on `dep` with step times from `cost`; deterministic for a seed."""
    return Simulation(workload, dep, cost, seed).run()


def with_replicas(
    dep: Deployment, num_replicas: int, num_prefill: int = 0
) -> Deployment:
    return replace(dep, num_replicas=num_replicas, num_prefill=num_prefill)


def host_cache_tokens(kv_cache_tokens: int, ratio: float) -> int:
    """L2 size as `--hicache-ratio` sets it (L2 tokens per L1 token)."""
    return math.floor(kv_cache_tokens * ratio)
