"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward.

A decoding request normally feeds its last token and samples one. With speculation it feeds its
last token plus k drafted tokens and samples at all k + 1 positions (the scheduler treats this as a
short extend): draft j is kept while the target's choice at its position agrees (greedy) or passes
the rejection test (sampling, `strata.layers.sampler.sample`), and the first disagreement is
replaced by the target's own token. Every step yields between 1 and k + 1 tokens, and the output has
exactly the target model's distribution.

Here:
  * `NgramDrafter` (`strata.engine.ngram`) — prompt lookup: the longest recent n-gram of the
    request's own text that occurred before in it (or, failing that, in recent requests' texts)
    proposes what followed it.
  * `DraftPolicy` and the costs and guard it decides by (`strata.engine.draft_policy`) — how many
    drafts each request feeds this step, where they buy more output per second than they cost.
  * `Speculator` — what the scheduler asks: each step's drafts (looked up, or drafted by a draft
    model, an MTP layer or a DSpark block drafter, as the policy prices them), and what the step
    yielded, fed back to the policy.
  * `SpecStats` — counters for /metrics and the response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from strata.engine.draft_policy import (
    PRIOR_WEIGHT,
    Candidate,
    DrafterCost,
    DraftPolicy,
    expected_tokens,
)
from strata.engine.ngram import NgramDrafter

REQUEST_DECAY = (
    0.9  # a request's acceptance history forgets at this rate per verify step
)
EXPLORE_DECLINED = (
    16  # steps a block forward may go declined before it is run once anyway
)
BLOCK_YIELD_DECAY = (
    0.99  # every request's block forwards (the prior) forget at this rate per forward
)


@dataclass
class SpecStats:
    """Counters since start (for /metrics), and how the policy's choices were distributed."""

    verify_steps: int = 0  # request-steps that fed drafts
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    declined: int = 0  # request-steps the policy fed no draft: a proposal not worth its row, or none could be
    vetoed: int = 0  # request-steps the guard stood down, before any lookup (drafting measured slower there)
    draft_calls: int = (
        0  # calls of a draft model or block drafter (a forward each, or k of them)
    )
    draft_requests: int = 0  # requests drafted for over those calls
    draft_seconds: float = 0.0  # time in them
    draft_lengths: dict[int, int] = field(
        default_factory=dict
    )  # chosen length -> request-steps

    @property
    def mean_accept_len(self) -> float:
        """Tokens yielded per verifying request-step (accepted drafts + the target's own token)."""
        return (
            (self.accepted_tokens + self.verify_steps) / self.verify_steps
            if self.verify_steps
            else 0.0
        )

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "declined": self.declined,
            "vetoed": self.vetoed,
            "draft_calls": self.draft_calls,
            "draft_requests": self.draft_requests,
            "draft_seconds": self.draft_seconds,
            "mean_accept_len": self.mean_accept_len,
            "draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())},
        }


@dataclass
class StepWatch:
    batch: object  # the step's ScheduleBatch
    fed_from: list[int]  # each request's KV length before the step
    decoding: list  # its requests that decode or verify (not prefill)
    outputs: int  # their output tokens before it
    drafted: int  # drafted tokens it feeds
    verifying: int  # requests feeding drafts
    draft_s: float = 0.0  # seconds its drafter calls took (in the scheduling before it)


class Speculator:
    """What the scheduler asks of speculative decoding: this step's drafts, and the outcome.

    n-gram drafts cost nothing to look up, so each request proposes what it finds and the policy
    picks lengths from those. A draft model costs a forward per drafted position, so the policy picks
    lengths first (from acceptance learned so far) and only that much is drafted. A block drafter
    (DSpark) drafts a whole block in one forward, so it proposes first, with its confidence in each
    draft, and the policy picks lengths from those."""

    def __init__(self, config, draft_model=None):
        self.drafter = NgramDrafter(
            config.speculative_ngram_min,
            config.speculative_ngram_max,
            config.speculative_shared_tokens,
        )
        self.draft_model = (
            draft_model  # a DraftModelDrafter for --speculative-algorithm draft
        )
        self.policy = DraftPolicy(
            config.speculative_num_draft_tokens,
            adaptive=not config.speculative_fixed_length,
        )
        self.max_draft = config.speculative_num_draft_tokens
        # a block drafter's requests also look their n-grams up, and draft whichever is expected
        # to yield more (--speculative-dspark-only: the block drafter alone)
        self.ngram_beside = not getattr(config, "speculative_dspark_only", False)
        self.stats = SpecStats()
        # one forward of the drafter (a draft model's, per drafted depth; a block drafter's), as
        # measured
        self.draft_cost = DrafterCost()
        self._declined_forwards = (
            0  # steps in a row whose drafter's forward did not pay
        )
        self._draft_s = 0.0  # drafter seconds of the step being scheduled
        # every request's block forwards, as `Req.block_yield`: the prior of a request's own
        self.block_yield = (0.0, 0.0, 0.0)

    def plan(
        self, decodes: list[tuple], base_tokens: int, num_decodes: int, budget: int
    ) -> list[tuple]:
        """decodes: (request, most tokens it may draft); base_tokens: the step's tokens without drafts;
        num_decodes: requests the step yields a token for. Returns (request, drafts, match length) for
        the requests that draft this step."""
        if decodes and not self.policy.allows(num_decodes):
            self.stats.vetoed += len(decodes)
            return []
        histories = [r.spec_history for r, _ in decodes]
        if decodes and not self.policy.could_draft(histories, base_tokens, num_decodes):
            self.stats.declined += len(
                decodes
            )  # no proposal could pay for its row: none looked up
            return []
        if getattr(self.draft_model, "block", False):
            return self._plan_block(decodes, base_tokens, num_decodes, budget)
        candidates = []
        for req, limit in decodes:
            limit = min(limit, self.max_draft)
            if self.draft_model is not None:
                candidates.append(
                    Candidate(
                        req,
                        [0] * limit,
                        0,
                        self.policy.accept_rate(req.spec_history, 0),
                    )
                )
                continue
            draft, match_len = self.drafter.propose(
                req.rid, req.prompt_ids, req.output_ids, limit
            )
            draft = _grammar_prefix(req, draft)
            if draft:
                candidates.append(
                    Candidate(
                        req,
                        draft,
                        match_len,
                        self.policy.accept_rate(req.spec_history, match_len),
                    )
                )
        lengths = self.policy.choose(candidates, base_tokens, num_decodes, budget)
        if self.draft_model is not None and self.policy.adaptive:
            lengths = self._priced_depth(candidates, lengths, base_tokens, num_decodes)
        self.stats.declined += sum(1 for k in lengths if k == 0)
        chosen = [(c, k) for c, k in zip(candidates, lengths) if k > 0]
        if self.draft_model is not None and chosen:
            start = time.perf_counter()
            drafts = self.draft_model.draft(
                [(c.key.rid, c.key.prompt_ids + c.key.output_ids, k) for c, k in chosen]
            )
            seconds = time.perf_counter() - start
            depth = max(k for _, k in chosen)  # forwards it ran, the last ones narrower
            mean_rows = sum(k for _, k in chosen) / depth
            self.draft_cost.observe(round(mean_rows), seconds / depth)
            self._drafted(len(chosen), seconds)
            return [
                (c.key, d, 0)
                for (c, _), draft in zip(chosen, drafts)
                if (d := _grammar_prefix(c.key, draft))
            ]
        return [(c.key, c.draft[:k], c.match_len) for c, k in chosen]

    def _plan_block(
        self, decodes: list[tuple], base_tokens: int, num_decodes: int, budget: int
    ) -> list[tuple]:
        """A block drafter (DSpark): one forward drafts a whole block per request, so the blocks
        are drafted first and the policy then picks lengths from the drafter's confidences. Each
        request's own n-grams are looked up first (free); blocks are proposed only for requests
        the policy would give a draft at their blocks' measured acceptance (a block costs its rows
        whether or not they are verified: a large batch does not pay for blocks it would not
        verify), and not where the request's n-gram match is expected to yield as much."""
        # a block's acceptance: what this request's blocks achieved (its n-gram drafts' history
        # tells how its text repeats, not how well the drafter predicts it), pulled towards every
        # request's blocks
        rates = [self.policy.accept_rate(req.block_history, 0) for req, _ in decodes]
        # the lengths the policy would verify of each request's block at that acceptance
        picked = self._lengths(decodes, rates, base_tokens, num_decodes, budget)
        block_lengths = {req.rid: k for (req, _), k in zip(decodes, picked)}
        found: dict[str, Candidate] = {}
        blocks = []
        # when no block has been wanted for EXPLORE_DECLINED steps, the request whose blocks are
        # best accepted is drafted for anyway: a drafter whose blocks fell out of favour (another
        # kind of traffic) is measured again, as a declined forward is (`_declines`)
        explore = self.policy.adaptive and (
            self._declined_forwards + 1 >= EXPLORE_DECLINED
        )
        spare = None
        for (req, limit), rate, wanted in zip(decodes, rates, picked):
            k = min(limit, self.max_draft)
            c = None
            if self.ngram_beside:
                draft, n = self.drafter.propose(
                    req.rid, req.prompt_ids, req.output_ids, k
                )
                draft = _grammar_prefix(req, draft)
                if draft:
                    c = found[req.rid] = Candidate(
                        req, draft, n, self.policy.accept_rate(req.spec_history, n)
                    )
            if (
                c is not None
                and expected_tokens(c) >= self._forward_yield(req, k, rate)[0]
            ):
                continue
            if wanted:
                blocks.append(((req, k), rate))
            elif explore and (spare is None or rate > spare[1]):
                spare = ((req, k), rate)
        if not blocks and spare is not None:
            blocks = [spare]
        if not blocks:
            self._declined_forwards += 1
        if self.policy.adaptive and blocks:
            blocks = self._blocks_worth_a_forward(
                blocks, found, block_lengths, base_tokens, num_decodes
            )
        proposals = []
        if blocks:
            start = time.perf_counter()
            proposals = self.draft_model.propose(
                [
                    (req.rid, req.prompt_ids + req.output_ids, k)
                    for (req, k), _ in blocks
                ]
            )
            seconds = time.perf_counter() - start
            self.draft_cost.observe(len(blocks), seconds)
            self._drafted(len(blocks), seconds)
        proposed = {}
        unmade = set()  # no block drafted for these: not a forward that bought nothing
        for ((req, _), rate), p in zip(blocks, proposals):
            if not p.drafted:
                unmade.add(req.rid)
            draft = _grammar_prefix(req, p.tokens)
            if draft:
                conf = None if p.confidence is None else p.confidence[: len(draft)]
                proposed[req.rid] = Candidate(req, draft, 0, rate, conf)
        candidates = []
        for req, _ in decodes:
            options = [c for c in (found.get(req.rid), proposed.get(req.rid)) if c]
            if options:
                candidates.append(max(options, key=expected_tokens))
        lengths = self.policy.choose(candidates, base_tokens, num_decodes, budget)
        drafting = {c.key.rid for c, k in zip(candidates, lengths) if k > 0}
        self.stats.declined += len(decodes) - len(drafting)
        for (req, _), _ in blocks:
            if req.rid not in drafting and req.rid not in unmade:
                # the forward bought it nothing (a verified block's is counted in `verified`)
                self._yielded(req, 0, 0)
        return [
            (c.key, c.draft[:k], c.match_len)
            for c, k in zip(candidates, lengths)
            if k > 0
        ]

    def _forward_yield(self, req, k: int, rate: float) -> tuple[float, float]:
        """What a block forward is expected to add for this request: (tokens accepted, rows
        drafted), as its earlier forwards bought them (their blocks cut by the drafter's
        confidence, or to nothing), pulled towards every request's by PRIOR_WEIGHT forwards.
        Before any forward was measured: a block of k at the request's block acceptance."""
        n, acc, rows = self.block_yield
        if n <= 0:
            return expected_tokens(Candidate(req, [0] * k, 0, rate)), float(k)
        own_n, own_acc, own_rows = req.block_yield
        w = own_n + PRIOR_WEIGHT
        return (
            (own_acc + PRIOR_WEIGHT * acc / n) / w,
            (own_rows + PRIOR_WEIGHT * rows / n) / w,
        )

    def _yielded(self, req, accepted: int, drafted: int) -> None:
        """One block forward's outcome for a request (see `Req.block_yield`)."""
        req.block_yield = _forwarded(req.block_yield, REQUEST_DECAY, accepted, drafted)
        self.block_yield = _forwarded(
            self.block_yield, BLOCK_YIELD_DECAY, accepted, drafted
        )

    def _lengths(
        self,
        decodes: list[tuple],
        rates: list[float],
        base_tokens: int,
        num_decodes: int,
        budget: int,
    ) -> list[int]:
        """The draft length the policy would give each request at these acceptance rates."""
        return self.policy.choose(
            [
                Candidate(req, [0] * min(limit, self.max_draft), 0, rate)
                for (req, limit), rate in zip(decodes, rates)
            ],
            base_tokens,
            num_decodes,
            budget,
        )

    def _priced_depth(
        self,
        candidates: list[Candidate],
        lengths: list[int],
        base_tokens: int,
        num_decodes: int,
    ) -> list[int]:
        """A draft model's lengths cut at the depth K whose step yields the most tokens per second,
        counting its K forwards (depth d: one forward over the requests drafting that deep, at the
        measured `draft_cost`) beside the verified rows; 0: no draft, the model not run. An
        unmeasured model runs, and one declined EXPLORE_DECLINED steps in a row runs again."""
        deepest = max(lengths, default=0)
        if deepest == 0 or self.draft_cost.seconds(1) is None:
            return lengths
        tokens, rows, forwards = float(max(num_decodes, 1)), float(base_tokens), 0.0
        plain = (tokens, rows)
        cuts = []  # (tokens, rows, drafter seconds) of the step drafting 1, 2, ... deep
        gains = [1.0] * len(candidates)
        for depth in range(1, deepest + 1):
            deep = [i for i, k in enumerate(lengths) if k >= depth]
            for i in deep:
                gains[i] *= candidates[i].rate(depth - 1)
                tokens += gains[i]
            rows += len(deep)
            forwards += self.draft_cost.seconds(len(deep)) or 0.0
            cuts.append((tokens, rows, forwards))
        best = self._best_cut(num_decodes, plain, cuts)
        if self._declines(best):
            return [0] * len(lengths)
        return [min(k, best or deepest) for k in lengths]

    def _blocks_worth_a_forward(
        self,
        blocks: list,
        found: dict,
        picked: dict[str, int],
        base_tokens: int,
        num_decodes: int,
    ) -> list:
        """The blocks worth the block drafter's forward: of the requests' blocks, best gain first,
        the prefix whose step is expected to yield the most tokens per second, the forward's
        measured time included (none: the step drafts n-grams alone). A block's gain is what the
        request's earlier forwards bought (`_forward_yield`: their blocks as the drafter's
        confidence cut them), over its n-gram match. An unmeasured forward runs, and a declined
        one runs again after EXPLORE_DECLINED steps, so that its cost and acceptance stay
        measured."""
        if self.draft_cost.seconds(len(blocks)) is None:
            return blocks
        rows0, tokens0 = base_tokens, float(max(num_decodes, 1))
        options = []
        for block in blocks:
            (req, _), rate = block
            alt = found.get(req.rid)
            alt_len = len(alt.draft) if alt is not None else 0
            alt_tokens = expected_tokens(alt) if alt is not None else 0.0
            rows0 += alt_len
            tokens0 += alt_tokens
            tokens, drafted = self._forward_yield(req, picked.get(req.rid, 0), rate)
            options.append((tokens - alt_tokens, drafted - alt_len, block))
        options.sort(key=lambda o: -o[0])
        tokens, rows = tokens0, float(rows0)
        cuts = []  # (tokens, rows, drafter seconds) of the step with the best n blocks
        for n, (gain, extra_rows, _) in enumerate(options, start=1):
            tokens += gain
            rows += extra_rows
            cuts.append((tokens, rows, self.draft_cost.seconds(n) or 0.0))
        best = self._best_cut(num_decodes, (tokens0, float(rows0)), cuts)
        if self._declines(best):
            return []
        return [o[2] for o in options[: best or len(options)]]

    def _best_cut(
        self,
        num_decodes: int,
        plain: tuple[float, float],
        cuts: list[tuple[float, float, float]],
    ) -> int:
        """Which of the drafting options `cuts` (expected tokens, rows, drafter seconds; option n
        is cuts[n - 1]) gives the step the most tokens per second at the fitted step cost; 0: none
        beats the step without the drafter (`plain`: its tokens and rows)."""
        a, b, _ = self.policy.cost.coefficients(num_decodes)
        best, best_rate = 0, plain[0] / (a + b * plain[1])
        for n, (tokens, rows, seconds) in enumerate(cuts, start=1):
            rate = tokens / (a + b * rows + seconds)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def _declines(self, best: int) -> bool:
        """Whether the drafter's forward is skipped this step: its best cut is none (`best` 0),
        bar one run every EXPLORE_DECLINED steps in a row, which keeps its cost measured."""
        if best == 0:
            self._declined_forwards += 1
            if self._declined_forwards < EXPLORE_DECLINED:
                return True
        self._declined_forwards = 0
        return False

    def _drafted(self, requests: int, seconds: float) -> None:
        self._draft_s += seconds
        self.stats.draft_calls += 1
        self.stats.draft_requests += requests
        self.stats.draft_seconds += seconds

    def verified(self, req, drafted: int, accepted: int) -> None:
        self.policy.record(req.draft_match, drafted, accepted)
        if (
            req.draft_match >= 0
        ):  # the history is of the request's own text (see accept_rate)
            req.spec_history = _decayed(req.spec_history, drafted, accepted)
        if req.draft_match == 0 and getattr(self.draft_model, "block", False):
            req.block_history = _decayed(req.block_history, drafted, accepted)
            self._yielded(req, accepted, drafted)
        req.spec_verify_steps += 1
        req.spec_drafted += drafted
        req.spec_accepted += accepted
        s = self.stats
        s.verify_steps += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.draft_lengths[drafted] = s.draft_lengths.get(drafted, 0) + 1

    def watch(self, batch) -> StepWatch:
        """What `observe` needs to know of a step from before it runs."""
        decoding = [
            r for i, r in enumerate(batch.reqs) if i < batch.num_decode or r.draft_ids
        ]
        return StepWatch(
            batch=batch,
            fed_from=[r.kv_len for r in batch.reqs],
            decoding=decoding,
            outputs=sum(len(r.output_ids) for r in decoding),
            drafted=sum(len(r.draft_ids) for r in batch.reqs),
            verifying=len(decoding) - batch.num_decode,
            draft_s=self._take_draft_s(),
        )

    def _take_draft_s(self) -> float:
        seconds, self._draft_s = self._draft_s, 0.0
        return seconds

    def observe(self, w: StepWatch, seconds: float, hidden) -> None:
        """After a step: its cost and what its decoding requests yielded (for the cost fit and the
        guard), and, for an MTP drafter, each unfinished request's newly committed positions (from
        its KV length before the step to its KV length now) with the target's hidden states there."""
        batch = w.batch
        rows = batch.num_decode + w.verifying + w.drafted
        decodes, prefill = batch.num_decode + w.verifying, batch.num_tokens - rows
        if decodes:
            cost = self.policy.cost
            # the step's rows alone: its drafter calls are measured apart (`draft_cost`); the
            # guard below weighs the whole step, drafting included
            cost.observe(
                decodes, rows, prefill, max(seconds - w.draft_s, 0.1 * seconds)
            )
            # the guard compares decoding time: the step's, less what its prefill chunks cost
            decoding = max(
                seconds - cost.coefficients(decodes)[2] * prefill, 0.1 * seconds
            )
            yielded = sum(len(r.output_ids) for r in w.decoding) - w.outputs
            self.policy.guard.observe(decodes, w.drafted > 0, yielded, decoding)
        if hidden is None or not getattr(self.draft_model, "needs_hidden", False):
            return
        items, row = [], 0
        keeps = getattr(self.draft_model, "keeps", None)
        for req, n, p0 in zip(batch.reqs, batch.extend_lens, w.fed_from):
            m = req.kv_len - p0
            if not req.finished and m > 0 and (keeps is None or keeps(req.rid)):
                items.append(
                    (
                        req.rid,
                        p0,
                        hidden[row : row + m],
                        req.seq_slice(p0 + 1, p0 + 1 + m),
                    )
                )
            row += n
        self.draft_model.extend(items)

    def finish(self, rid: str) -> None:
        self.drafter.finish(rid)
        if self.draft_model is not None:
            self.draft_model.finish(rid)


def _decayed(
    history: tuple[float, float], drafted: int, accepted: int
) -> tuple[float, float]:
    """An (accepted, tried) history after one verification (a rejection was tried too)."""
    acc, tried = history
    return (
        acc * REQUEST_DECAY + accepted,
        tried * REQUEST_DECAY + accepted + (accepted < drafted),
    )


def _forwarded(
    history: tuple[float, float, float], decay: float, accepted: int, drafted: int
) -> tuple[float, float, float]:
    """A (forwards, tokens accepted, rows drafted) history after one more forward."""
    n, acc, rows = history
    return (n * decay + 1, acc * decay + accepted, rows * decay + drafted)


def _grammar_prefix(req, draft: list[int]) -> list[int]:
    """The part of a draft a structured-output request's grammar allows (the rest would be rejected)."""
    if draft and req.grammar is not None:
        return draft[: req.grammar.valid_prefix(draft)]
    return draft
