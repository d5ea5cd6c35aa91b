"""One simulated `strata serve` replica: the scheduler's step loop, with step times from the cost model.

Each step follows `Scheduler._schedule_once` (strata/engine/scheduler.py), deciding with the
scheduler's own policy code (strata/engine/policy.py: the new-token ratio, the KV reservation,
admission's stop rules, the retraction victims; strata/engine/chunking.py: the prefill pieces):

    1. (PD decode) requests whose prompt KV arrived join the running batch as decodes
    2. every decode needs one more KV slot; out of room even after evicting the prefix cache,
       running requests are retracted (`retraction_victim`) and re-queued
    3. requests part-way through a chunked prefill continue (pieces of chunked_prefill_size; one
       that does not fit the step's budget, max_batch_tokens - decodes, waits, unless it is the
       step's first piece, which is cut to fit)
    4. waiting requests are admitted in arrival order while the running limit, the token budget,
       max_prefill_tokens and the KV budget allow; the KV budget keeps back the new-token ratio x
       the remaining outputs of running requests (`NewTokenRatio`), counted in tokens (the
       engine's pages at page_size 1). An admitted request matches its longest cached prefix
       (L1, then consecutive L2 blocks copied up, paid at the host copy rate in this step), skips
       a step when it shares an uncached prefix with a request admitted in the same step (the
       next block's name compared, where the engine compares tokens), and gets KV for its first
       chunk
    5. with speculative decoding, decodes get drafts best first while the expected tokens per
       second of the step grow (DraftPolicy's rule, with one acceptance rate p for every request)
    6. the step needs cost_model.step_s(its segments) (+ L2 copies) of its host's compute (a
       `Host`: alone it takes that long; co-located replicas share the host, see cluster.py)

At the end of a step prefill chunks advance (their full blocks enter the prefix tree, locked),
finished prefills sample their first token, decodes get 1 + accepted drafts, and finished
requests give their blocks to the tree (unlocked, evictable) and their private KV back.

KV accounting (tokens):  free = kv_cache_tokens - tree blocks x block_size - sum of private KV,
where a request's private KV = positions it allocated beyond its locked prefix blocks.

L3 (storage, shared by the deployment's replicas): on arrival, if it holds >= the prefetch
threshold of tokens past L1/L2, the `auto` policy waits for the fetch (this replica's I/O queue,
at the storage read rate) when that is quicker than recomputing them, and the blocks land in L2.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strata.cache.prefetch import auto_wait_s, fetches_l3_hit
from strata.config import EngineConfig
from strata.engine.chunking import prefill_piece
from strata.engine.policy import (
    NewTokenRatio,
    SchedulePolicy,
    admission_open,
    draft_pays,
    kv_admits,
    kv_pages,
    retraction_victim,
    stuck_victim,
)
from strata.plan.cost_model import CostModel, Segment
from strata.plan.kv_tiers import DeviceCache, LRUBlocks, block_hashes
from strata.plan.workload import SimTurn


@dataclass(frozen=True)
class ReplicaConfig:
    """The engine flags the simulation honours (EngineConfig's names and defaults)."""

    kv_cache_tokens: int = 16455  # the default `strata serve` pool of the default model here (fp32 KV, 24 GiB)
    max_running_requests: int = EngineConfig.max_running_requests
    max_batch_tokens: int = EngineConfig.max_batch_tokens
    chunked_prefill_size: int = EngineConfig.chunked_prefill_size
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens
    disable_radix_cache: bool = EngineConfig.disable_radix_cache
    host_cache_tokens: int = (
        0  # L2 (enable_hierarchical_cache: hicache_ratio x kv_cache_tokens); 0 = none
    )
    # L3 hits smaller than this are not fetched
    prefetch_threshold_tokens: int = EngineConfig.hicache_prefetch_threshold
    speculative: bool = False  # draft with the cost model's spec_accept_rate
    block_size: int = 16  # prefix-matching granularity of the simulation (tokens)

    def __post_init__(self) -> None:
        for name in (
            "kv_cache_tokens",
            "max_running_requests",
            "max_batch_tokens",
            "max_prefill_tokens",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_cache_tokens < 0:
            raise ValueError(
                f"host_cache_tokens must be >= 0, got {self.host_cache_tokens}"
            )


@dataclass(eq=False)
class SimRequest:
    """A request's state in the simulation (the engine's `Req`, reduced to lengths and block names)."""

    turn: SimTurn
    sent_t: float
    max_new: int  # output tokens this replica produces (1 on a PD prefill worker)
    hashes: list[int]
    seq_no: int = 0  # arrival order on its replica
    outputs: int = 0
    kv_len: int = 0  # positions whose KV is computed
    alloc: int = 0  # positions with KV allocated
    locked: list[int] = field(
        default_factory=list
    )  # prefix blocks locked in the tree (hashes[:len])
    admitted_once: bool = False
    ready_t: float = 0.0  # an L3 prefetch it waits for ends then
    l3_blocks: tuple[int, int] = (0, 0)  # block index range fetched from L3 for it
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    chunk_times: list[float] = field(default_factory=list)
    finish_t: float | None = None
    retractions: int = 0
    worker: Any = None  # the cluster's handle on where it runs (plan.cluster's _Worker)
    decode_req: SimRequest | None = (
        None  # PD prefill side: the decode-side request it feeds
    )

    @property
    def prompt_len(self) -> int:
        return self.turn.prompt_len

    @property
    def seq_len(self) -> int:
        return self.turn.prompt_len + self.outputs

    @property
    def extend_len(self) -> int:
        return self.seq_len - self.kv_len

    # what strata.engine.policy reads (its PolicyReq)
    @property
    def remaining_new(self) -> int:
        return self.max_new - self.outputs

    @property
    def num_outputs(self) -> int:
        return self.outputs

    @property
    def arrival(self) -> int:
        return self.seq_no

    @property
    def priority(self) -> int:
        return 0  # the planner's traffic is all of one priority


@dataclass
class Step:
    items: list[
        tuple[SimRequest, int, int]
    ]  # (request, tokens fed, drafted tokens among them)
    seconds: float  # of the host's compute (wall time when alone)
    prefill: bool = False  # it feeds prefill chunks (co-located replicas slow it by contention_prefill)
    started: float = 0.0


class Replica:
    """A replica's scheduler, driven by the cluster's event loop (`loop.at(t, fn, *args)`, `loop.now`)."""

    def __init__(
        self,
        name: str,
        cfg: ReplicaConfig,
        cost: CostModel,
        loop,
        storage: LRUBlocks | None = None,
        on_finish: Callable[[SimRequest, float], None] | None = None,
        host=None,
        rng: random.Random | None = None,
        policy: SchedulePolicy | None = None,
    ):
        self.name, self.cfg, self.cost, self.loop = name, cfg, cost, loop
        self.compute = host  # runs steps: `run(replica, seconds, done)`; None: alone on its machine
        self.block = cfg.block_size
        self.host = (
            LRUBlocks(cfg.host_cache_tokens // self.block)
            if cfg.host_cache_tokens
            else None
        )
        self.storage = (
            storage if self.host is not None else None
        )  # L3 sits behind L2, as in HiCache
        self.device = DeviceCache(
            not cfg.disable_radix_cache,
            self.host.put if self.host is not None else None,
        )
        self.on_finish = on_finish
        self.rng = rng or random.Random(0)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.reserving: list[
            SimRequest
        ] = []  # PD decode: waiting for room for their prompt KV
        self.prefilled: list[
            SimRequest
        ] = []  # PD decode: KV arrived, joins at the next step
        self.private_tokens = 0
        self.busy = False
        # the scheduler's own policy (strata.engine.policy)
        self.policy = policy or SchedulePolicy()
        self.ratio = NewTokenRatio(self.policy)
        self.io_busy_until = 0.0
        self.arrivals = 0
        self.wake_at: float | None = None
        # counters
        self.busy_s = 0.0
        self.num_steps = 0
        self.tokens_fed = 0
        self.batch_size_sum = 0
        self.kv_peak_tokens = 0
        self.num_retractions = 0
        self.spec_drafted = 0
        self.spec_accepted = 0

    # ----------------------------------------------------------------- accounting

    @property
    def free_tokens(self) -> int:
        return (
            self.cfg.kv_cache_tokens
            - self.device.num_blocks * self.block
            - self.private_tokens
        )

    @property
    def load(self) -> int:
        return (
            len(self.waiting)
            + len(self.running)
            + len(self.reserving)
            + len(self.prefilled)
        )

    def make_room(self, tokens: int) -> bool:
        short = tokens - self.free_tokens
        if short > 0:
            self.device.evict(math.ceil(short / self.block))
        return self.free_tokens >= tokens

    def _alloc_to(self, r: SimRequest, end: int) -> bool:
        need = end - r.alloc
        if need <= 0:
            return True
        if not self.make_room(need):
            return False
        r.alloc = end
        self.private_tokens += need
        return True

    def _cache_computed(self, r: SimRequest) -> None:
        """Full computed blocks past the locked prefix enter the tree, locked by r (a block already
        there makes r's copy a duplicate, freed)."""
        if not self.device.enabled:
            return
        full = min(r.kv_len // self.block, len(r.hashes))
        for i in range(len(r.locked), full):
            h = r.hashes[i]
            if self.device.insert_locked(h) and self.storage is not None:
                self.storage.put(h)  # write_through
            r.locked.append(h)
            self.private_tokens -= self.block

    def _release(self, r: SimRequest) -> None:
        self._cache_computed(r)
        self.device.unlock(r.locked)
        self.private_tokens -= r.alloc - len(r.locked) * self.block
        r.locked, r.alloc = [], 0

    # ----------------------------------------------------------------- requests in

    def check_fits(self, turn: SimTurn, max_new: int) -> None:
        need = turn.prompt_len + max(max_new - 1, 0)
        if need > self.cfg.kv_cache_tokens:
            raise ValueError(
                f"a request needs {need} KV tokens but a replica holds {self.cfg.kv_cache_tokens}; "
                "raise --kv-cache-tokens or shorten the workload"
            )

    def new_request(self, turn: SimTurn, sent_t: float, max_new: int) -> SimRequest:
        self.check_fits(turn, max_new)
        hashes = block_hashes(turn.prompt + turn.answer, self.block)
        return SimRequest(turn, sent_t, max_new, hashes)

    def submit(self, r: SimRequest) -> None:
        """A request arrives (HTTP done): maybe start an L3 prefetch, queue it, run a step if idle."""
        r.seq_no = self.arrivals
        self.arrivals += 1
        self._maybe_prefetch(r)
        self.waiting.append(r)
        self.kick()

    def reserve(self, r: SimRequest) -> bool:
        """PD decode side: hold KV for the whole prompt (retried each step while there is no room)."""
        r.seq_no = self.arrivals
        self.arrivals += 1
        if self._alloc_to(r, r.prompt_len):
            return True
        self.reserving.append(r)
        return False

    def kv_arrived(self, r: SimRequest) -> None:
        """PD decode side: the prompt's KV and first token are here; the request decodes from the next step."""
        self.prefilled.append(r)
        self.kick()

    def _maybe_prefetch(self, r: SimRequest) -> None:
        if self.storage is None or self.host is None:
            return
        limit = (r.seq_len - 1) // self.block
        start = self.device.match(r.hashes, limit)
        while start < limit and r.hashes[start] in self.host:
            start += 1
        s = 0
        while start + s < limit and r.hashes[start + s] in self.storage:
            s += 1
        tokens = s * self.block
        # the engine asks L3 for every page past L1/L2 (it cannot know which it holds); the
        # simulation knows, and asks for the run of blocks it holds
        if s == 0 or not fetches_l3_hit(tokens, self.cfg.prefetch_threshold_tokens):
            return
        now = self.loop.now
        queued = max(0.0, self.io_busy_until - now)
        fetch_s = queued + self.cost.kv_bytes(tokens) / self.cost.storage_bytes_per_s
        recompute_s = self.cost.prefill_s(
            tokens,
            start * self.block,
            self.cfg.chunked_prefill_size,
            self.cfg.max_batch_tokens,
        )
        # the engine waits up to auto_wait_s for the fetch, which here ends after fetch_s;
        # 0: recomputing is quicker, do not wait
        if auto_wait_s(fetch_s, recompute_s) == 0:
            return
        r.ready_t = self.io_busy_until = now + fetch_s
        r.l3_blocks = (start, start + s)
        self.loop.at(r.ready_t, self._prefetch_done, r.hashes[start : start + s])

    def _prefetch_done(self, hashes: list[int]) -> None:
        assert self.host is not None  # prefetches fill the host tier
        for h in hashes:
            self.host.put(h)
        self.kick()

    # ----------------------------------------------------------------- the step loop

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    def kick(self) -> None:
        if not self.busy and self.has_work():
            self._start_step()

    def _start_step(self) -> None:
        step = self._schedule()
        if step is None:
            pending = [r.ready_t for r in self.waiting if r.ready_t > self.loop.now]
            if pending and (self.wake_at is None or self.wake_at <= self.loop.now):
                self.wake_at = min(pending)
                self.loop.at(self.wake_at, self.kick)
            return
        self.busy = True
        step.started = self.loop.now
        self.num_steps += 1
        self.tokens_fed += sum(n for _, n, _ in step.items)
        self.batch_size_sum += len(step.items)
        self.kv_peak_tokens = max(
            self.kv_peak_tokens, self.cfg.kv_cache_tokens - self.free_tokens
        )
        if self.compute is None:
            self.loop.at(self.loop.now + step.seconds, self._end_step, step)
        else:
            self.compute.run(
                self, step.seconds, lambda: self._end_step(step), step.prefill
            )

    def _schedule(self) -> Step | None:
        step = self._schedule_once()
        while (
            step is None and len(self.running) > 1
        ):  # all stuck mid-prefill without KV: retract one
            self._retract(stuck_victim(self.running))
            step = self._schedule_once()
        return step

    def _schedule_once(self) -> Step | None:
        cfg, now = self.cfg, self.loop.now
        for r in list(self.reserving):
            if self._alloc_to(r, r.prompt_len):
                self.reserving.remove(r)
        for r in self.prefilled:  # add_prefilled: a decode with its first token
            r.kv_len, r.outputs = r.prompt_len, 1
            r.admitted_once = True
            if r.outputs >= r.max_new:
                r.chunk_times.append(now)
                self._finish(r, now)
            else:
                self.running.append(r)
        self.prefilled = []
        decodes = [r for r in self.running if r.extend_len == 1]
        while decodes and not self.make_room(
            sum(1 for r in decodes if r.alloc < r.kv_len + 1)
        ):
            victim = retraction_victim(self.running)
            if victim is None:
                break
            self._retract(victim)
            decodes = [r for r in decodes if r is not victim]
        decodes = [r for r in decodes if self._alloc_to(r, r.kv_len + 1)]
        budget = cfg.max_batch_tokens - len(decodes)
        extends: list[tuple[SimRequest, int]] = []
        for r in [r for r in self.running if r.extend_len > 1]:
            n = prefill_piece(
                r.extend_len,
                cfg.chunked_prefill_size,
                budget,
                not decodes and not extends,
                first_piece=not extends,
            )
            if n <= 0 or not self._alloc_to(r, r.kv_len + n):
                continue
            extends.append((r, n))
            budget -= n
        copy_s = self._admit(extends, budget, batch_empty=not decodes and not extends)
        if not decodes and not extends:
            return None
        drafts = (
            self._plan_drafts(decodes, len(decodes) + sum(n for _, n in extends))
            if cfg.speculative
            else {}
        )
        self.ratio.after_step()
        items = [(r, 1 + drafts.get(id(r), 0), drafts.get(id(r), 0)) for r in decodes]
        items += [(r, n, 0) for r, n in extends]
        segments = [
            Segment(n, r.kv_len, decode=(r.extend_len == 1)) for r, n, _ in items
        ]
        draft_s = self.cost.spec_draft_s if drafts else 0.0  # the drafter's forward
        return Step(
            items, self.cost.step_s(segments) + copy_s + draft_s, prefill=bool(extends)
        )

    def _admit(
        self, extends: list[tuple[SimRequest, int]], budget: int, batch_empty: bool
    ) -> float:
        """Admit waiting requests (step 4); returns the seconds of L2 -> L1 copies they caused."""
        cfg, now = self.cfg, self.loop.now
        prefill_budget = cfg.max_prefill_tokens
        # KV is counted in tokens: the engine's pages at its default page_size of 1
        reserved = self.policy.reserved_tokens(self.running, self.ratio.value)
        available = (
            self.free_tokens
            + len(self.device.evictable) * self.block
            - kv_pages(reserved, 1)
        )
        copy_s = 0.0
        admitted_now: list[SimRequest] = []
        for r in sorted(self.waiting, key=lambda r: r.seq_no):
            if not admission_open(
                len(self.running), cfg.max_running_requests, budget, prefill_budget
            ):
                break
            if r.ready_t > now:
                continue
            limit = (
                r.seq_len - 1
            ) // self.block  # at most seq_len - 1 tokens are reused
            m = self.device.match(r.hashes, limit)
            r.locked = list(r.hashes[:m])
            self.device.lock(
                r.locked
            )  # before promotion makes room: the match must not be evicted
            promoted = 0
            if self.host is not None and self.device.enabled:
                promoted = self.host.run_from(r.hashes, m, limit)
                while promoted and not self.make_room(promoted * self.block):
                    promoted -= 1
                for h in r.hashes[
                    m : m + promoted
                ]:  # copied up into the tree, locked by r
                    self.device.insert_locked(h)
                    r.locked.append(h)
                copy_s += (
                    self.cost.kv_bytes(promoted * self.block)
                    / self.cost.host_bytes_per_s
                )
            cached = len(r.locked) * self.block
            r.kv_len = r.alloc = cached
            if self._shares_uncached_prefix(r, len(r.locked), admitted_now):
                self._unadmit(r)
                continue  # next step it reuses what the other request is computing now
            need = kv_pages(
                self.policy.reserve_tokens(
                    r.seq_len - cached, r.remaining_new, self.ratio.value
                ),
                1,
            )
            if not kv_admits(need, available, batch_empty, len(self.running)):
                self._unadmit(r)
                break
            n = prefill_piece(
                r.extend_len,
                self.cfg.chunked_prefill_size,
                min(budget, prefill_budget),
                batch_empty,
                first_piece=not extends,
            )
            if n <= 0 or not self._alloc_to(r, r.kv_len + n):
                self._unadmit(r)
                break
            if not r.admitted_once:
                lo, hi = r.l3_blocks
                from_l3 = max(0, min(m + promoted, hi) - max(m, lo)) * self.block
                r.cached_by_tier = {
                    "device": m * self.block,
                    "host": promoted * self.block - from_l3,
                    "storage": from_l3,
                }
                r.admitted_once = True
            self.waiting.remove(r)
            self.running.append(r)
            extends.append((r, n))
            admitted_now.append(r)
            available -= need
            budget -= n
            prefill_budget -= n
            batch_empty = False
        return copy_s

    def _unadmit(self, r: SimRequest) -> None:
        self._release(r)
        r.kv_len = 0

    def _shares_uncached_prefix(
        self, r: SimRequest, matched: int, admitted_now: list[SimRequest]
    ) -> bool:
        # at most seq_len - 1 tokens are reusable, as in the scheduler
        if not self.device.enabled or not self.policy.checks_shared_prefix(
            r.seq_len - 1, matched * self.block
        ):
            return False
        if matched >= len(r.hashes):
            return False
        # the engine compares the next in_batch_prefix_tokens tokens; the simulation knows blocks,
        # so it compares the next block's name (it covers every token before it)
        h = r.hashes[matched]
        return any(
            len(o.hashes) > matched and o.hashes[matched] == h for o in admitted_now
        )

    def _plan_drafts(self, decodes: list[SimRequest], base_rows: int) -> dict[int, int]:
        """Drafts per decode (id -> k), added best first while tokens/second of the step grows
        (the engine's rule, `draft_pays`). Where the engine's DraftPolicy learns each request's
        acceptance and measures its step cost, this has one rate p for every request (so best
        first is depth by depth, in request order) and the cost model's step times."""
        p = self.cost.spec_accept_rate
        if p is None or p <= 0 or not decodes:
            return {}
        coef, thr = self.cost.coef, self.cost.row_threshold
        large = thr is not None and base_rows >= thr
        cap = self.cfg.max_batch_tokens - base_rows
        if thr is not None and not large:
            cap = min(
                cap, thr - 1 - base_rows
            )  # drafts never push a step across the kernel switch
        per_row = coef.get("per_row_large" if large else "per_row", 0.0)
        step_s = plain_s = self.cost.step_s(
            [Segment(1, r.kv_len, True) for r in decodes]
        )
        expected = float(len(decodes))
        drafts: dict[int, int] = {}
        limits = {
            id(r): min(self.cost.spec_max_draft, r.max_new - r.outputs - 1)
            for r in decodes
        }
        for depth in range(1, self.cost.spec_max_draft + 1):
            gain = p**depth
            for r in decodes:
                if (
                    cap <= 0
                    or limits[id(r)] < depth
                    or not self._alloc_to(r, r.kv_len + 1 + depth)
                ):
                    continue
                extra = per_row + coef.get("per_decode_ctx", 0.0) * (r.kv_len + depth)
                if not draft_pays(gain, expected, step_s, extra):
                    return self._worth_the_drafter(
                        drafts, len(decodes), expected, step_s, plain_s
                    )
                drafts[id(r)] = depth
                expected += gain
                step_s += extra
                cap -= 1
        return self._worth_the_drafter(drafts, len(decodes), expected, step_s, plain_s)

    def _worth_the_drafter(
        self,
        drafts: dict[int, int],
        num_decodes: int,
        expected: float,
        step_s: float,
        plain_s: float,
    ) -> dict[int, int]:
        """The drafts, if the step's expected tokens per second with them and the drafter's
        forward (`spec_draft_s`) beat the plain step's (`plain_s` for `num_decodes`); else none."""
        if not drafts or self.cost.spec_draft_s <= 0:
            return drafts
        with_s = step_s + self.cost.spec_draft_s
        return drafts if expected / with_s > num_decodes / plain_s else {}

    def _retract(self, r: SimRequest) -> None:
        self._release(r)
        r.kv_len = 0
        r.retractions += 1
        self.num_retractions += 1
        self.running.remove(r)
        self.waiting.append(r)
        self.ratio.after_retraction()

    def _end_step(self, step: Step) -> None:
        now = self.loop.now
        self.busy_s += now - step.started
        p = self.cost.spec_accept_rate or 0.0
        for r, n, k in step.items:
            if r.kv_len + n < r.seq_len:  # a prefill chunk with more to come
                r.kv_len += n
                self._cache_computed(r)
                continue
            prefill = r.extend_len > 1
            accepted = 0
            while accepted < k and self.rng.random() < p:
                accepted += 1
            self.spec_drafted += k
            self.spec_accepted += accepted
            old_seq = r.seq_len
            r.outputs = min(r.max_new, r.outputs + 1 + accepted)
            # valid KV: the fed tokens (the prompt, or the last token and the accepted drafts)
            r.kv_len = min(old_seq + accepted, r.seq_len - 1)
            if r.alloc > r.kv_len:  # rejected drafts' KV goes back
                self.private_tokens -= r.alloc - r.kv_len
                r.alloc = r.kv_len
            r.chunk_times.append(now)
            if prefill:
                self._cache_computed(r)
            if r.outputs >= r.max_new:
                self.running.remove(r)
                self._finish(r, now)
        self.busy = False
        self.kick()

    def _finish(self, r: SimRequest, now: float) -> None:
        self._release(r)
        r.finish_t = now
        if self.reserving:
            for q in list(self.reserving):
                if self._alloc_to(q, q.prompt_len):
                    self.reserving.remove(q)
        if self.on_finish is not None:
            self.on_finish(r, now)
