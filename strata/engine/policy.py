"""The scheduling policy: the numbers and orders `Scheduler` decides each step, in plain ints and
floats (no torch), so the planner's simulated replica (strata.plan.replica) decides them with the
same code instead of a copy.

    SchedulePolicy    the constants, in one place (frozen), and the rules that read them:
                      reserve_tokens (the KV a request is expected to need: what it still feeds +
                      its clipped remaining outputs x the ratio), reserved_tokens (for all the
                      running ones), checks_shared_prefix (when the in-batch prefix check applies)
    NewTokenRatio     the share of running requests' remaining outputs the KV budget keeps back:
                      starts at init_ratio, decays each scheduled step to min_ratio, rises after a
                      retraction
    kv_pages          a reservation in pages
    admission_open    the admission loop's stop rules (running limit, token budget, prefill budget)
    kv_admits         the KV budget rule, with the empty-batch exception
    retraction_victim, stuck_victim   which running request is retracted
    preemption_victim  which running request makes way for a waiting one that outranks it
    draft_pays        whether one more drafted row raises a step's expected output rate

How much of a prompt a request feeds in one step is `strata.engine.chunking.prefill_piece`.
What does not live here: pages, the allocator and the prefix cache (the scheduler's), blocks,
times and the cost model (the planner's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class SchedulePolicy:
    """The policy's constants (the engine's flags, e.g. max_batch_tokens, stay in EngineConfig)."""

    init_ratio: float = 0.7  # new-token ratio at start and after a quiet spell
    min_ratio: float = 0.1  # it never decays below this
    ratio_decay: float = 0.001  # per scheduled step
    retract_ratio_step: float = (
        0.1  # added after each retraction (capped at 1.0), as in SGLang
    )
    reserve_clip_tokens: int = (
        4096  # a request's remaining outputs counted at most this many
    )
    in_batch_prefix_tokens: int = (
        32  # shared uncached tokens that defer a second request a step
    )
    lpm_max_waiting: int = (
        128  # past this many waiting requests, lpm falls back to fcfs
    )
    # a prompt piece of a request below the best priority live (a batch job's beside interactive
    # traffic): short, so that a step an interactive request arrives during ends soon
    background_chunk_tokens: int = 64

    def chunk_for(self, chunk: int, priority: int, top: int) -> int:
        """The prompt piece size of a request of `priority` when the best priority live is `top`
        (`chunk`: --chunked-prefill-size; <= 0 means no chunking)."""
        if priority <= top:
            return chunk
        return (
            min(chunk, self.background_chunk_tokens)
            if chunk > 0
            else self.background_chunk_tokens
        )

    def reserve_tokens(
        self, extend_len: int, remaining_new: int, ratio: float
    ) -> float:
        """KV tokens a request is expected to need from now on: the `extend_len` tokens it still
        feeds, and `ratio` of its remaining outputs (at most reserve_clip_tokens of them)."""
        return extend_len + min(remaining_new, self.reserve_clip_tokens) * ratio

    def reserved_tokens(self, running: Sequence[PolicyReq], ratio: float) -> float:
        """KV tokens kept back for the running requests' future tokens when admitting others."""
        return sum(
            self.reserve_tokens(r.extend_len, r.remaining_new, ratio) for r in running
        )

    def checks_shared_prefix(self, reusable_len: int, cached_len: int) -> bool:
        """Whether a request with `reusable_len` matchable tokens of which `cached_len` are cached
        has enough uncached ones for the in-batch check: if a request admitted in the same step
        starts with the same next in_batch_prefix_tokens tokens after the same cached prefix, the
        second one waits a step and then reuses what the first computed (SGLang's in-batch
        prefix check). The caller compares the tokens (the engine) or block names (the planner)."""
        return reusable_len - cached_len >= self.in_batch_prefix_tokens


class NewTokenRatio:
    """The fraction of each running request's remaining outputs that admission keeps KV back for
    (`SchedulePolicy.reserve_tokens`): it decays while steps go well, rises after a retraction."""

    def __init__(self, policy: SchedulePolicy):
        self.policy = policy
        self.value = policy.init_ratio

    def after_step(self) -> None:
        """A step was scheduled: reserve a little less from now on."""
        p = self.policy
        self.value = max(p.min_ratio, self.value - p.ratio_decay)

    def after_retraction(self) -> None:
        """A request was retracted: the reservation was too optimistic."""
        self.value = min(1.0, self.value + self.policy.retract_ratio_step)


class PolicyReq(Protocol):
    """A request as the policy sees it."""

    @property
    def extend_len(
        self,
    ) -> int: ...  # tokens to feed before its next sample (1 while decoding)

    @property
    def remaining_new(self) -> int: ...  # output tokens it may still produce

    @property
    def num_outputs(self) -> int: ...  # output tokens produced so far

    @property
    def prompt_len(self) -> int: ...

    @property
    def arrival(self) -> int: ...  # arrival order on this scheduler

    @property
    def priority(self) -> int: ...  # lower is served first (0 for interactive requests)


R = TypeVar("R", bound=PolicyReq)


def kv_pages(tokens: float, page_size: int) -> int:
    """Pages that hold `tokens` (possibly fractional, from a reservation) KV tokens."""
    return math.ceil(tokens / page_size)


def admission_open(
    num_running: int, max_running: int, budget: int, prefill_budget: int
) -> bool:
    """Whether admission may look at another waiting request: below the running limit, with
    tokens left in the step (`budget`) and in its new-prompt allowance (`prefill_budget`)."""
    return num_running < max_running and budget > 0 and prefill_budget > 0


def kv_admits(need: int, available: int, batch_empty: bool, num_running: int) -> bool:
    """Whether a request needing `need` KV units fits the `available` ones left after the running
    requests' reservations; a request that would run alone (nothing in the step, nothing running)
    is admitted anyway (it fits the pool: requests are checked against its size on arrival)."""
    return need <= available or (batch_empty and num_running == 0)


def retraction_victim(running: Sequence[R]) -> R | None:
    """The request to retract when decodes need KV there is not: of the lowest priority (the
    largest value), the one with the fewest outputs (least work lost), then the longest prompt
    (most KV freed), then the newest. None when one or no request runs (the last one is never
    retracted)."""
    if len(running) <= 1:
        return None
    return min(
        running, key=lambda r: (-r.priority, r.num_outputs, -r.prompt_len, -r.arrival)
    )


def stuck_victim(running: Sequence[R]) -> R:
    """The request to retract when nothing can be scheduled (all running requests stuck
    mid-prefill without KV): the newest of the lowest priority."""
    return max(running, key=lambda r: (r.priority, r.arrival))


def preemption_victim(running: Sequence[R], priority: int) -> R | None:
    """The running request to retract so that a waiting request of `priority` can start: one of
    a strictly lower priority (a larger value), chosen as `retraction_victim` chooses; None when
    every running request ranks with it or above (equals never preempt each other)."""
    lower = [r for r in running if r.priority > priority]
    if not lower:
        return None
    return min(
        lower, key=lambda r: (-r.priority, r.num_outputs, -r.prompt_len, -r.arrival)
    )


def draft_pays(gain: float, expected: float, step_s: float, row_s: float) -> bool:
    """Whether one more drafted row worth `gain` expected tokens raises a step's output rate, the
    step yielding `expected` tokens in `step_s` and the row adding `row_s`:
    (E + g) / (t + r) > E / t  <=>  g t > E r."""
    return gain * step_s > expected * row_s
