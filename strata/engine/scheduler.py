"""The scheduler: continuous batching over the paged KV pool and the prefix cache.

Each `step()`:
  1. decode requests (one token each) get a page when their last page is full; if the pool is out
     of pages even after evicting the prefix cache, running requests are retracted (KV released
     into the cache, request re-queued) until the rest fit;
  2. requests part-way through a chunked prefill continue with their next chunk;
  3. waiting requests are admitted (fcfs or lpm order) while the token budget, the running limit and
     the KV budget allow: their longest cached prefix is matched and locked, pages are allocated
     for their first chunk;
  4. one forward runs over all of them (decodes first, then prefill chunks) and samples a token for
     every request whose sequence is now fully computed;
  5. tokens are appended, finished requests give their KV to the prefix cache and their private
     pages back to the allocator.

Invariant after every step: allocator free pages + prefix-cache pages + pages owned privately by
running requests == pool pages.
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import torch

from strata.cache.allocator import PageAllocator
from strata.cache.radix import CacheTiers, DeviceOnly, PrefixCache, WindowCache
from strata.config import EngineConfig
from strata.engine.accounting import KVAccounting
from strata.engine.batch import ScheduleBatch
from strata.engine.chunking import prefill_piece
from strata.engine.draft_steps import DraftSteps
from strata.engine.hooks import KVTransferPeer, StepObserver
from strata.engine.limits import SizeLimits
from strata.engine.model_runner import ModelRunner
from strata.engine.policy import (
    NewTokenRatio,
    SchedulePolicy,
    admission_open,
    kv_admits,
    kv_pages,
    preemption_victim,
    retraction_victim,
    stuck_victim,
)
from strata.engine.request import (
    Req,
    ReqStatus,
    RequestOutput,
    TokenLogprob,
    TopLogprob,
)
from strata.engine.speculative import Speculator
from strata.engine.stopping import stop_reason
from strata.engine.window_kv import WindowKV
from strata.grammar.compiler import GrammarCompiler
from strata.layers.sampler import SamplerOutput, sampling_row
from strata.sampling_params import SamplingParams
from strata.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class Scheduler(KVAccounting):
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        allocator: PageAllocator,
        prefix_cache: PrefixCache,
        tokenizer,
        eos_token_ids: frozenset[int],
        context_len: int,
        draft_model=None,
        policy: SchedulePolicy | None = None,
        *,
        tiers: CacheTiers | None = None,
        windows: WindowCache | None = None,
    ):
        """`prefix_cache` is the device's; `tiers` the slower ones behind it (`HiCache`; default:
        none) and `windows` what it is told about window KV (default: the prefix cache itself,
        which must then be a `WindowCache`)."""
        self.config = config
        self.runner = runner
        self.allocator = allocator
        self.cache = prefix_cache
        self.tiers = tiers if tiers is not None else DeviceOnly(prefix_cache)
        if windows is None:
            if not isinstance(prefix_cache, WindowCache):
                raise TypeError(
                    f"{type(prefix_cache).__name__} is no WindowCache: pass windows="
                )
            windows = prefix_cache
        self.windows = windows
        self.cache_enabled = not config.disable_radix_cache
        self.page_size = allocator.page_size
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.vocab_size = runner.vocab_size
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.pending_outputs: list[RequestOutput] = []
        self.arrivals = 0
        # the numbers and orders it decides by (strata.engine.policy, shared with the planner)
        self.policy = policy or SchedulePolicy()
        self.ratio = NewTokenRatio(self.policy)
        self.num_retractions = 0
        self.num_preemptions = 0  # retractions that made way for a higher priority
        self._top = 0  # the best priority live in this step (`_prefill_chunks`)
        self.step_count = 0
        # PD disaggregation: requests whose prompt KV is being received (decode side), and the
        # peer that moves KV in or out (`attach_peer`)
        self.prealloc: dict[str, Req] = {}
        self.peer: KVTransferPeer | None = None
        self.observers: list[StepObserver] = []  # `add_observer`
        # speculative decoding; draft_model: a DraftModelDrafter (--speculative-algorithm draft), an
        # MTPDrafter (mtp) or a DSparkDrafter (dspark): the last two read the target's hidden states
        # after every step
        self.spec = (
            Speculator(config, draft_model)
            if config.speculative_algorithm != "none"
            else None
        )
        self._read_hidden_for(draft_model)
        # the parts for window groups (sliding-window layers) and for speculative decoding
        self.window_kv = WindowKV(allocator, prefix_cache, windows, self._alloc_for)
        self.drafts = DraftSteps(allocator, context_len)

    # ----------------------------------------------------------------- extension points

    def attach_peer(self, peer: KVTransferPeer) -> None:
        """Attach the subsystem that moves requests' KV in or out (see `KVTransferPeer`): it is
        polled at every step, keeps `has_work` true while busy, and sees each finished request
        before its KV is released. One per scheduler."""
        if self.peer is not None and self.peer is not peer:
            raise RuntimeError("this scheduler already has a KV transfer peer attached")
        self.peer = peer

    def add_observer(self, observer: StepObserver) -> None:
        """Tell `observer` what every later step does (see `StepObserver`)."""
        self.observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop telling `observer`; a no-op if it was not added."""
        if observer in self.observers:
            self.observers.remove(observer)

    def set_speculator(self, spec: Speculator | None) -> Speculator | None:
        """Use `spec` for speculative decoding from the next step on (None: none); returns the
        one used so far. Only between requests: a request's drafts belong to its speculator."""
        previous, self.spec = self.spec, spec
        self._read_hidden_for(None if spec is None else spec.draft_model)
        return previous

    def _read_hidden_for(self, draft_model) -> None:
        """Keep the target's hidden states after each step where `draft_model` reads them (MTP: the
        final ones; DSpark: the streams after the layers it names), and nothing where it does not."""
        self.runner.keep_hidden = getattr(draft_model, "needs_hidden", False)
        capture = getattr(self.runner.model, "capture_layers", None)
        if capture is not None:
            capture(getattr(draft_model, "capture_after", ()))

    # ----------------------------------------------------------------- requests in and out

    @property
    def new_token_ratio(self) -> float:
        """The share of running requests' remaining outputs admission keeps KV back for."""
        return self.ratio.value

    @property
    def pool_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise ValueError (a LimitError) if a request could never run on this engine."""
        SizeLimits(self.context_len, self.pool_tokens).check(
            prompt_len, params.max_new_tokens
        )

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: int = 0,
    ) -> list[str]:
        """Queue a request (n > 1 becomes n sibling requests). Returns the engine rids created.
        `adapter`: the LoRA adapter's load id it runs under (0: the base model).

        Raises ValueError (nothing queued) if the request is invalid or can never fit.
        """
        rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        self.validate_request(rids, prompt_ids, params)
        first: Req | None = None
        for i, r in enumerate(rids):
            seed = None if params.seed is None else params.seed + i
            # siblings wait for the first to cache the prompt, then share its KV
            req = self._new_req(
                r,
                prompt_ids,
                params,
                seed,
                depends_on=first if self.cache_enabled else None,
            )
            req.adapter = adapter
            first = first or req
            if params.max_new_tokens == 0:
                self._finish(req, "length")
                continue
            self.waiting.append(req)
        if first is not None and not first.finished:
            self.tiers.on_arrival(first.rid, first.cache_key(first.seq_len - 1))
        return rids

    def validate_request(
        self, rids: list[str], prompt_ids: list[int], params: SamplingParams
    ) -> None:
        """Raise ValueError (with what to change) if requests `rids` with this prompt and these
        parameters could never run here, or an id is in use. Changes nothing."""
        params.validate(self.vocab_size)
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        self.check_fits(len(prompt_ids), params)
        for r in rids:
            if r in self.reqs:
                raise ValueError(f"request id {r!r} is already in use")

    def _new_req(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int | None,
        depends_on: Req | None,
    ) -> Req:
        req = Req(
            rid=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            detokenizer=(
                IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
                )
                if self.tokenizer is not None
                else None
            ),
            generator=None if seed is None else torch.Generator().manual_seed(seed),
            arrival=self.arrivals,
            depends_on=depends_on,
        )
        req.sampling_row, req.top_k = sampling_row(params, self.vocab_size)
        if (
            params.structured is not None
        ):  # compiled once per distinct grammar; GrammarError is a ValueError
            req.grammar = self.grammars.new_state(params.structured)
        self.arrivals += 1
        self.reqs[rid] = req
        return req

    # ----------------------------------------------------------------- PD disaggregation, decode side

    def reserve_prefilled(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> Req | None:
        """Validate a request whose prompt KV will arrive from a prefill worker, and allocate its pages.

        Returns None (nothing held) when the pool has no room now; raises ValueError if it never will.
        The request is held outside the queues until `add_prefilled` or `abort`.
        """
        if params.n != 1:
            raise ValueError(
                "n > 1 is not supported with prefill/decode disaggregation"
            )
        self.validate_request([rid], prompt_ids, params)
        need = math.ceil(len(prompt_ids) / self.page_size)
        parts = self.allocator.tail_parts(
            need, len(prompt_ids)
        )  # window KV only for the prompt's last window
        if not self.cache.make_room(need, parts):
            return None
        req = self._new_req(rid, prompt_ids, params, params.seed, depends_on=None)
        req.pages = self.allocator.alloc(need, parts)
        req.admitted_once = True
        self.prealloc[rid] = req
        return req

    def add_prefilled(
        self,
        rid: str,
        first_token: int,
        logprob: TokenLogprob | None = None,
        cached_tokens: int = 0,
        cached_by_tier: dict[str, int] | None = None,
    ) -> None:
        """The prompt's KV is now in the request's pages and the prefill worker sampled `first_token`
        (having taken `cached_tokens` of the prompt from its prefix cache): the request joins the
        running batch as a decode."""
        req = self.prealloc.pop(rid)
        req.kv_len = len(req.prompt_ids)
        req.num_cached_tokens, req.cached_tokens_by_tier = (
            cached_tokens,
            dict(cached_by_tier or {}),
        )
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        req.output_ids.append(first_token)
        if req.grammar is not None:
            req.grammar.accept(first_token)
        if logprob is not None and req.params.logprobs is not None:
            req.pending_logprobs.append(logprob)
        if reason := stop_reason(req, first_token, self.context_len):
            self._finish(req, reason)
        else:
            self.pending_outputs.append(req.make_output())

    def reserved(self, rid: str) -> Req | None:
        """The request `reserve_prefilled` holds for `rid` (its pages take the prompt's KV), if
        it still waits for it."""
        return self.prealloc.get(rid)

    def fail_prefilled(self, rid: str, error: str, status: int | None = None) -> None:
        """A reserved request's KV will not come: free its pages and finish it with `error`
        (as HTTP `status`, None: 500). A no-op if `rid` holds no reservation."""
        req = self.prealloc.pop(rid, None)
        if req is None:
            return
        self.allocator.free(req.pages)
        req.pages = []
        req.error, req.error_status = error, status
        self._finish(req, "error")

    def fail_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        error: str,
        status: int | None = None,
    ) -> None:
        """Report request `rid`, which never reached the scheduler's queues, as failed with
        `error` (as HTTP `status`, None: 500): its output (finish_reason "error") comes out of
        the next step."""
        req = self._new_req(rid, prompt_ids, params, None, None)
        req.error, req.error_status = error, status
        self._finish(req, "error")

    def abort(self, rid: str) -> bool:
        """Abort a request now: its KV is released immediately. Returns False if unknown/finished."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        if rid in self.prealloc:
            self.fail_prefilled(rid, "aborted")
            req.finish_reason = "abort"
            return True
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.aborted = True
        self._finish(req, "abort")
        return True

    def has_requests(self) -> bool:
        """Whether a request is queued or running, or has outputs that no step returned yet."""
        return bool(self.waiting or self.running or self.pending_outputs)

    def has_work(self) -> bool:
        """Whether a step can make progress: `has_requests`, or background work (reserved PD
        requests, a busy KV transfer peer)."""
        return bool(self.has_requests() or self.prealloc) or (
            self.peer is not None and self.peer.busy()
        )

    def discard_pending_outputs(self) -> None:
        """Drop the outputs the next step would return (a caller that reported them already)."""
        self.pending_outputs.clear()

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        self.step_count += 1
        observers = list(self.observers)
        for o in observers:
            o.on_step_start()
        try:
            return self._step(observers)
        finally:
            for o in observers:
                o.on_step_end()

    def _step(self, observers: list[StepObserver]) -> list[RequestOutput]:
        self.tiers.poll()
        if self.peer is not None:
            self.peer.poll()
        start = (
            time.perf_counter()
        )  # speculation's cost includes looking drafts up (in schedule)
        for o in observers:
            o.on_schedule_start()
        batch = self.schedule()
        for o in observers:
            o.on_scheduled(batch)
        if batch is None and self.tiers.fetching():
            time.sleep(0.001)  # requests wait for an L3 prefetch; don't spin
        if batch is not None:
            watch = self.spec.watch(batch) if self.spec is not None else None
            try:
                sampled = self._forward(batch, observers)
            except (
                Exception
            ) as exc:  # a failed forward fails its requests, not the engine
                logger.exception("forward failed")
                for req in batch.reqs:
                    if not req.finished:
                        req.error = f"internal error during forward: {exc}"
                        self._finish(req, "error")
            else:
                for o in observers:
                    o.on_results_start(batch)
                self.process_results(batch, sampled)
                for o in observers:
                    o.on_results_end(batch)
                if watch is not None:
                    self.spec.observe(
                        watch, time.perf_counter() - start, self.runner.hidden
                    )
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _forward(
        self, batch: ScheduleBatch, observers: list[StepObserver]
    ) -> SamplerOutput | None:
        for o in observers:
            o.on_forward_start(batch)
        try:
            return self.runner.forward(batch)
        finally:
            for o in observers:
                o.on_forward_end(batch)

    def schedule(self) -> ScheduleBatch | None:
        batch = self._schedule_once()
        # running requests that are all stuck mid-prefill without pages: retract until one can move
        while batch is None and len(self.running) > 1:
            self.retract(stuck_victim(self.running))
            batch = self._schedule_once()
        return batch

    def _schedule_once(self) -> ScheduleBatch | None:
        self._preempt_for_priority()
        if self.config.schedule_mix == "prefill-first" and (
            self.waiting or any(r.extend_len > 1 for r in self.running)
        ):
            batch = self._prefills_only()
            if batch is not None:
                return batch
        decodes = [r for r in self.running if r.extend_len == 1]
        self._reserve_decode_pages(decodes)
        decodes = [
            r for r in self.running if r.extend_len == 1
        ]  # retraction may have removed some
        extends = self._prefill_chunks(
            self.config.max_batch_tokens - len(decodes), bool(decodes)
        )
        decodes, extends = _yield_to_priority(decodes, extends)
        if not decodes and not extends:
            return None
        verifying: list[Req] = []
        if self.spec is not None and decodes:
            base = len(decodes) + sum(n for _, n in extends)
            budget = self.config.max_batch_tokens - base
            verifying = self.drafts.plan(self.spec, decodes, len(decodes), budget)
            decodes = [r for r in decodes if not r.draft_ids]
        self.ratio.after_step()
        return ScheduleBatch(
            reqs=decodes + verifying + [r for r, _ in extends],
            extend_lens=[1] * len(decodes)
            + [1 + len(r.draft_ids) for r in verifying]
            + [n for _, n in extends],
            num_decode=len(decodes),
        )

    def _prefills_only(self) -> ScheduleBatch | None:
        """--schedule-mix prefill-first: a step of prefill chunks alone (running requests'
        next chunks, then admissions), or None when none can run (then decodes step as usual)."""
        _, extends = _yield_to_priority(
            [], self._prefill_chunks(self.config.max_batch_tokens, False)
        )
        if not extends:
            return None
        self.ratio.after_step()
        return ScheduleBatch(
            reqs=[r for r, _ in extends],
            extend_lens=[n for _, n in extends],
            num_decode=0,
        )

    def _prefill_chunks(self, budget: int, decoding: bool) -> list[tuple[Req, int]]:
        """The step's prefill chunks within `budget` tokens: running requests' next chunks, then
        admissions. `decoding`: the step has decode rows too (a chunk is then never alone)."""
        extends: list[tuple[Req, int]] = []
        prefilling = [r for r in self.running if r.extend_len > 1]
        if not prefilling and not self.waiting:
            return extends  # a decode-only step: nothing to feed or admit
        # a waiting request of a higher priority goes before running chunks of a lower one
        urgent = min(
            (r.priority for r in self.waiting if self.tiers.ready(r.rid)), default=None
        )
        self._top = min(
            (r.priority for r in itertools.chain(self.running, self.waiting)),
            default=0,
        )
        for req in sorted(prefilling, key=lambda r: r.priority):
            if urgent is not None and req.priority > urgent:
                break
            alone = not decoding and not extends
            n = prefill_piece(
                req.extend_len,
                self.policy.chunk_for(
                    self.config.chunked_prefill_size, req.priority, self._top
                ),
                budget,
                alone,
                first_piece=not extends,
            )
            n = self.window_kv.alloc_chunk(req, n, alone)
            if n <= 0:
                continue
            extends.append((req, n))
            budget -= n
        self._admit(extends, budget, batch_empty=not decoding and not extends)
        return extends

    def _reserve_decode_pages(self, decodes: list[Req]) -> None:
        """Give every decode whose last page is full a new page, retracting others if needed."""
        needy = [r for r in decodes if r.kv_len + 1 > len(r.pages) * self.page_size]
        while needy and not self.cache.make_room(len(needy)):
            victim = retraction_victim(self.running)
            if victim is None:
                break
            self.retract(victim)
            needy = [r for r in needy if r is not victim]
        for req in needy:
            pages = self.allocator.alloc(1) if self.cache.make_room(1) else None
            if (
                pages is None
            ):  # only when pages are held outside the running set (PD reservations)
                req.error = "the KV cache is exhausted; retry the request"
                self._finish(req, "error")
                continue
            req.pages.extend(pages)

    def _alloc_for(self, req: Req, end: int) -> bool:
        """Make req.pages cover positions [0, end). All or nothing."""
        need = req.pages_short(end, self.page_size)
        if need <= 0:
            return True
        if not self.cache.make_room(need):
            return False
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _preempt_for_priority(self) -> None:
        """The first waiting request (by priority, then arrival) retracts running requests of a
        lower priority until the running limit and the KV budget let it in, as vLLM's priority
        scheduling does; requests of one priority never preempt each other."""
        if not self.waiting or not self.running:
            return
        head = min(self.waiting, key=lambda r: (r.priority, r.arrival))
        if all(r.priority <= head.priority for r in self.running):
            return  # nothing to preempt (the usual case: every request of one priority)
        if not self.tiers.ready(head.rid) or (
            head.depends_on is not None and not head.depends_on.finished
        ):
            return
        while not self._room_for(head):
            victim = preemption_victim(self.running, head.priority)
            if victim is None:
                return
            self.retract(victim, preempted=True)

    def _room_for(self, req: Req) -> bool:
        """Whether admission would take `req` now (its prefix match counted, as `_admit` does)."""
        if len(self.running) >= self.config.max_running_requests:
            return False
        cached = (
            self.cache.match_prefix(req.cache_key(req.seq_len - 1)).cached_len
            if self.cache_enabled
            else 0
        )
        need = self.policy.reserve_tokens(
            req.seq_len - cached, req.remaining_new, self.ratio.value
        )
        return kv_admits(
            self.allocator.held_pages(kv_pages(need, self.page_size)),
            self._available_pages(),
            False,
            len(self.running),
        )

    def _available_pages(self) -> int:
        """Pool pages admission may give out: free and evictable ones, less the running requests'
        reservations (in pool pages: more than primary pages with a shared window pool)."""
        return (
            self.allocator.num_free_pages
            + self.cache.evictable_pages
            - self.allocator.held_pages(self._reserved_pages(), len(self.running))
        )

    def _waiting_order(self) -> list[Req]:
        if (
            self.config.schedule_policy == "lpm"
            and len(self.waiting) <= self.policy.lpm_max_waiting
            and self.cache_enabled
        ):
            lens = {
                id(r): self.cache.match_prefix(r.cache_key(r.seq_len - 1)).cached_len
                for r in self.waiting
            }
            return sorted(
                self.waiting, key=lambda r: (r.priority, -lens[id(r)], r.arrival)
            )
        return sorted(self.waiting, key=lambda r: (r.priority, r.arrival))

    def _shares_uncached_prefix(
        self, tokens: list[int], cached_len: int, admitted_now: list[Req]
    ) -> bool:
        """True if a request admitted in this step starts with the same in_batch_prefix_tokens
        tokens after `cached_len`: admitting both now would compute that shared prefix twice
        (`SchedulePolicy.checks_shared_prefix`). Costs O(in_batch_prefix_tokens) per admitted
        request."""
        if not self.cache_enabled or not self.policy.checks_shared_prefix(
            len(tokens), cached_len
        ):
            return False
        end = cached_len + self.policy.in_batch_prefix_tokens
        window = tokens[cached_len:end]
        return any(
            r.seq_len > end
            and r.cache_key(end)[cached_len:] == window
            and r.cache_key(cached_len) == tokens[:cached_len]
            for r in admitted_now
        )

    def _reserved_pages(self) -> int:
        """Pages kept back for the future tokens of running requests."""
        tokens = self.policy.reserved_tokens(self.running, self.ratio.value)
        return kv_pages(tokens, self.page_size)

    def _admit(
        self, extends: list[tuple[Req, int]], budget: int, batch_empty: bool
    ) -> None:
        prefill_budget = self.config.max_prefill_tokens
        held = (
            self.allocator.held_pages
        )  # pool pages per primary pages (more with a shared window pool)
        available = self._available_pages()
        admitted_now: list[Req] = []
        # the best priority fed this step: a request below it would wait anyway
        # (`_yield_to_priority`)
        best = min((r.priority for r, _ in extends), default=None)
        for req in self._waiting_order():
            if best is not None and req.priority > best:
                break
            if not admission_open(
                len(self.running),
                self.config.max_running_requests,
                budget,
                prefill_budget,
            ):
                break
            dep = req.depends_on
            if dep is not None and not (
                dep.finished or dep.kv_len >= len(dep.prompt_ids)
            ):
                continue
            if not self.tiers.ready(req.rid):
                continue
            # match at most seq_len - 1 tokens: the last one must be fed to get logits
            reusable = req.cache_key(req.seq_len - 1)
            match = self.tiers.load_prefix(reusable)
            if self._shares_uncached_prefix(reusable, match.cached_len, admitted_now):
                continue  # next step it reuses what the other request is computing now
            need = self.policy.reserve_tokens(
                req.seq_len - match.cached_len, req.remaining_new, self.ratio.value
            )
            need_pages = held(kv_pages(need, self.page_size))
            if not kv_admits(need_pages, available, batch_empty, len(self.running)):
                break
            self.cache.inc_lock(match.node)
            req.prefix_node, req.pages = match.node, list(match.pages)
            req.cached_len = req.kv_len = match.cached_len
            if (
                self.config.swa_replay
                and self.allocator.groups
                and not self.window_kv.start_replay(req, batch_empty)
            ):
                self._release_kv(req, cache_it=False)
                break
            n = prefill_piece(
                req.extend_len,
                self.policy.chunk_for(
                    self.config.chunked_prefill_size, req.priority, self._top
                ),
                min(budget, prefill_budget),
                batch_empty,
                first_piece=not extends,
            )
            n = self.window_kv.alloc_chunk(req, n, batch_empty)
            if n <= 0:
                self._release_kv(req, cache_it=False)
                break
            if not req.admitted_once:
                hits = {
                    "device": match.cached_len - sum(match.loaded.values()),
                    **match.loaded,
                }
                replayed = (
                    match.cached_len - req.kv_len
                )  # --swa-replay recomputes these in every layer
                hits["device"] -= min(replayed, hits["device"])
                req.num_cached_tokens = req.kv_len
                req.cached_tokens_by_tier = {"host": 0, "storage": 0, **hits}
                req.admitted_once = True
                self.tiers.on_admitted(len(reusable), hits)
            self.waiting.remove(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            extends.append((req, n))
            best = req.priority if best is None else min(best, req.priority)
            admitted_now.append(req)
            available -= need_pages
            budget -= n
            prefill_budget -= n
            batch_empty = False

    # ----------------------------------------------------------------- results

    def process_results(
        self, batch: ScheduleBatch, sampled: SamplerOutput | None
    ) -> None:
        row = 0  # the sampler's first row of the next request that samples
        verified: set[int] = set()
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.kv_len + n < req.fed_len:  # a prefill chunk with more to come
                req.kv_len += n
                continue
            drafted = len(req.draft_ids)
            if drafted:
                verified.add(id(req))
            tokens, kv_end = self.drafts.take_tokens(self.spec, req, n, sampled, row)
            for j, token in enumerate(tokens):
                req.output_ids.append(token)
                req.kv_len = min(
                    kv_end, req.seq_len
                )  # KV of tokens after a stop is not kept
                if req.grammar is not None:
                    req.grammar.accept(token)
                if req.params.logprobs is not None:
                    req.pending_logprobs.append(
                        _token_logprob(sampled, row + j, token, req.params.logprobs)
                    )
                if reason := stop_reason(req, token, self.context_len):
                    self._finish(req, reason)
                    break
            row += 1 + drafted
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.finished:
                continue
            if n > 1 and self.cache_enabled and id(req) not in verified:
                self._cache_unfinished(req)
            if (
                self.allocator.groups
            ):  # after caching: the prompt's window KV is the tree's to keep or drop
                self.window_kv.drop_behind_window(req)
            if req.output_ids[req.sent_tokens :]:
                self.pending_outputs.append(req.make_output())

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's tokenizer (built on first use: ~10 ms-1 s)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._grammars

    _grammars: GrammarCompiler | None = None

    def _finish(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        if req.status is ReqStatus.RUNNING:
            if self.peer is not None:
                self.peer.before_release(req)
            self.running.remove(req)
            self._release_kv(req, cache_it=reason != "error")
        req.status = ReqStatus.FINISHED
        self.tiers.on_finished(req.rid)
        if self.spec is not None:
            self.spec.finish(req.rid)
        if req.detokenizer is not None and reason != "abort":
            req.detokenizer.flush()
        self.pending_outputs.append(req.make_output())
        del self.reqs[req.rid]

    def retract(self, req: Req, *, preempted: bool = False) -> None:
        """Free a running request's KV (its computed prefix goes to the cache) and re-queue it.
        `preempted`: it makes way for a request of a higher priority (the KV reservation was not
        too optimistic, so the new-token ratio stays)."""
        self.running.remove(req)
        self._release_kv(req, cache_it=True)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.waiting.append(req)
        if preempted:
            self.num_preemptions += 1
            logger.debug("preempted %s (priority %d)", req.rid, req.priority)
            return
        self.num_retractions += 1
        self.ratio.after_retraction()
        logger.info("retracted %s (%d tokens) to free KV", req.rid, req.seq_len)

    # ----------------------------------------------------------------- KV ownership

    def _release_kv(self, req: Req, cache_it: bool) -> None:
        """Hand the request's pages to the prefix cache (whole computed pages) or the allocator.

        pages[:cached_len/ps] are the cache's own (unlocked here); of the rest, those the cache
        already holds a copy of, and the partial last page, go back to the allocator.
        """
        ps = self.page_size
        own_from = req.cached_len // ps
        if req.replay_from is not None:
            self.window_kv.end_replay(req)
        if cache_it and self.cache_enabled:
            full = max(
                req.kv_len // ps * ps, req.cached_len
            )  # a replaying request is fed from before cached_len
            self._insert_computed(req, full)
            self.allocator.free(req.pages[full // ps :])
        else:
            self.allocator.free(req.pages[own_from:])
        if req.prefix_node is not None:
            self.cache.dec_lock(req.prefix_node)
        req.pages, req.prefix_node, req.window_dropped = [], None, []
        req.kv_len = req.cached_len = 0

    def _insert_computed(self, req: Req, full: int) -> list[int]:
        """Insert the request's first `full` (page-aligned) tokens with their pages into the cache,
        and free its own pages that duplicate ones the cache already held. Returns those tokens."""
        ps = self.page_size
        own_from = req.cached_len // ps
        tokens = req.cache_key(full)
        present = self.cache.insert(tokens, req.pages[: full // ps])
        self.allocator.free(req.pages[own_from : max(own_from, present // ps)])
        return tokens

    def _cache_unfinished(self, req: Req) -> None:
        """Insert a running request's computed pages into the cache and lock them in its place,
        so other requests (n > 1 siblings, a shared system prompt) can reuse them at once."""
        ps = self.page_size
        full = (req.kv_len // ps) * ps
        if full <= req.cached_len:
            return
        tokens = self._insert_computed(req, full)
        match = self.cache.match_prefix(tokens)
        assert match.cached_len == full, "just inserted"
        if req.kv_len >= len(
            req.prompt_ids
        ):  # the prompt is in: its next turn or a retry resumes here
            self.windows.keep_resumable(match.node)
        self.cache.inc_lock(match.node)
        self.cache.dec_lock(req.prefix_node)
        req.prefix_node = match.node
        req.pages[: full // ps] = match.pages
        req.cached_len = full


def _yield_to_priority(
    decodes: list[Req], extends: list[tuple[Req, int]]
) -> tuple[list[Req], list[tuple[Req, int]]]:
    """A step that feeds a prompt chunk of a higher priority carries nothing of a lower one:
    its decodes and chunks wait a step (they keep their KV), so a batch job's rows never slow
    the prefill an interactive request waits on for its first token. Requests of one priority:
    unchanged."""
    if not extends:
        return decodes, extends
    best = min(r.priority for r, _ in extends)
    if all(r.priority <= best for r in decodes) and all(
        r.priority <= best for r, _ in extends
    ):
        return decodes, extends
    return (
        [r for r in decodes if r.priority <= best],
        [(r, n) for r, n in extends if r.priority <= best],
    )


def _token_logprob(
    sampled: SamplerOutput, row: int, token: int, k: int
) -> TokenLogprob:
    top = []
    if k and sampled.top_ids is not None:
        ids = sampled.top_ids[row, :k].tolist()
        lps = sampled.top_logprobs[row, :k].tolist()
        top = [TopLogprob(t, lp) for t, lp in zip(ids, lps)]
    return TokenLogprob(token_id=token, logprob=float(sampled.logprobs[row]), top=top)
