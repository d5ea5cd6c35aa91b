"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward.

A decoding request normally feeds its last token and samples one. With speculation it feeds its
last token plus k drafted tokens and samples at all k + 1 positions (the scheduler treats this as a
short extend): draft j is kept while the target's choice at its position agrees (greedy) or passes
the rejection test (sampling, `strata.layers.sampler.sample`), and the first disagreement is
replaced by the target's own token. Every step yields between 1 and k + 1 tokens, and the output has
exactly the target model's distribution.

Here:
  * `NgramDrafter` — prompt lookup: the longest recent n-gram of the request's own text that occurred
    before in it (or, failing that, in recent requests' texts, `SharedNgramIndex`) proposes what
    followed it.
  * `StepCost` — an online fit of step time against tokens in the step, t(T) = a + b T.
  * `DraftPolicy` — how many drafts each request feeds this step: a token is added while its
    expected acceptance (learned per request and per n-gram match length) buys more output per
    second than it costs (b, weighed against the step's a + b T). As the batch grows, the cost of a
    token grows relative to what it gains, and drafting stops on its own.
  * `SpecStats` — counters for /metrics and the response.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_PRIOR_ACCEPT = 0.5  # assumed per-token acceptance before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-trials the learned per-match-length rate counts for, against a request's own
REQUEST_DECAY = 0.9  # a request's acceptance history forgets at this rate per verify step
MAX_SLOPE_GUESS = 32.0  # before the cost of a token is measured: a step of 33 tokens costs two of one


# ---------------------------------------------------------------------------- n-gram drafting


class NgramIndex:
    """n-grams (min_n <= n <= max_n) of a growing token list -> where the most recent one ended.

    Lookups read tokens after that end: only n-grams with a following token are indexed, so the
    suffix being matched never finds itself."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        old = len(self.tokens)
        self.tokens.extend(tokens)
        # an n-gram ending at e (exclusive) becomes indexable once tokens[e] exists: e in [old, new)
        for end in range(max(old, self.min_n), len(self.tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(self.tokens[end - n : end])] = end

    def lookup(self, suffix: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the longest indexed n-gram ending `suffix`, its n)."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            end = self.ends.get(tuple(suffix[len(suffix) - n :]))
            if end is not None:
                return self.tokens[end : end + k], n
        return [], 0


class SharedNgramIndex:
    """The texts of recently finished requests, searchable by n-gram (agents re-send and edit the same
    text across requests). Holds at most `capacity` tokens; the oldest texts go first."""

    def __init__(self, min_n: int, max_n: int, capacity: int):
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.texts: OrderedDict[int, list[int]] = OrderedDict()
        self.ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (text id, end)
        self.size = 0
        self.next_id = 0

    def add(self, tokens: list[int]) -> None:
        if self.capacity <= 0 or len(tokens) <= self.min_n:
            return
        tokens = tokens[-self.capacity :]
        tid, self.next_id = self.next_id, self.next_id + 1
        self.texts[tid] = tokens
        self.size += len(tokens)
        for end in range(self.min_n, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = (tid, end)
        while self.size > self.capacity:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        tid, tokens = self.texts.popitem(last=False)
        self.size -= len(tokens)
        for end in range(self.min_n, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                if self.ends.get(key, (None,))[0] == tid:
                    del self.ends[key]

    def lookup(self, suffix: Sequence[int], k: int) -> tuple[list[int], int]:
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            hit = self.ends.get(tuple(suffix[len(suffix) - n :]))
            if hit is not None:
                tid, end = hit
                return self.texts[tid][end : end + k], n
        return [], 0


class NgramDrafter:
    """Prompt lookup over each request's prompt and output, then over recent requests."""

    def __init__(self, min_n: int, max_n: int, shared_tokens: int):
        self.min_n, self.max_n = min_n, max_n
        self.own: dict[str, NgramIndex] = {}
        self.shared = SharedNgramIndex(min_n, max_n, shared_tokens)

    def propose(self, rid: str, prompt: list[int], output: list[int], k: int) -> tuple[list[int], int]:
        """Up to k draft tokens to follow prompt + output, and the n-gram length that found them."""
        index = self.own.get(rid)
        if index is None:
            index = self.own[rid] = NgramIndex(self.min_n, self.max_n)
        known = len(index.tokens)
        if known < len(prompt):
            index.extend(prompt[known:])
            known = len(prompt)
        index.extend(output[known - len(prompt) :])
        suffix = index.tokens[-self.max_n :]
        draft, n = index.lookup(suffix, k)
        shared, shared_n = self.shared.lookup(suffix, k)
        if shared_n > n or (shared_n == n and len(shared) > len(draft)):
            return shared, shared_n
        return draft, n

    def finish(self, rid: str) -> None:
        index = self.own.pop(rid, None)
        if index is not None:
            self.shared.add(index.tokens)


# ---------------------------------------------------------------------------- the policy


class StepCost:
    """Step time against tokens in the step, t(T) = a + b T, fitted by least squares with forgetting
    over every step the engine runs (prefill chunks and verifications included)."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.w = self.st = self.stt = self.sd = self.std = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.st = self.st * d + tokens
        self.stt = self.stt * d + tokens * tokens
        self.sd = self.sd * d + seconds
        self.std = self.std * d + tokens * seconds

    @property
    def measured(self) -> bool:
        return self.w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per token. Until the steps seen vary in size enough to tell
        b, it is guessed as a / MAX_SLOPE_GUESS."""
        if not self.w:
            return 0.0, 0.0
        mean_t, mean_d = self.st / self.w, self.sd / self.w
        var = self.stt / self.w - mean_t * mean_t
        if var > 1.0:
            b = max(0.0, (self.std / self.w - mean_t * mean_d) / var)
            a = mean_d - b * mean_t
            if a > 0:
                return a, b
        a = mean_d / (1.0 + mean_t / MAX_SLOPE_GUESS)
        return a, a / MAX_SLOPE_GUESS


@dataclass
class Candidate:
    """One decoding request's proposal for this step."""

    key: object  # whatever the caller identifies the request by
    draft: list[int]
    match_len: int  # n-gram length that found it (0 when the drafter has no notion of it)
    accept_rate: float  # estimated probability that each drafted token is accepted


class DraftPolicy:
    """Chooses each request's draft length for one step (see the module docstring)."""

    def __init__(self, max_draft: int, adaptive: bool = True):
        self.max_draft = max_draft
        self.adaptive = adaptive
        self.cost = StepCost()
        # accepted / tried drafted tokens per n-gram match length, decayed
        self.by_match: dict[int, list[float]] = {}

    def accept_rate(self, history: tuple[float, float], match_len: int) -> float:
        """Per-token acceptance of a request's next draft: its own history (accepted, tried), pulled
        towards what drafts found by n-grams of this length achieved across requests."""
        acc, tried = self.by_match.get(match_len, (0.0, 0.0))
        prior = (acc + DEFAULT_PRIOR_ACCEPT) / (tried + 1.0)
        own_acc, own_tried = history
        return min(0.99, (own_acc + PRIOR_WEIGHT * prior) / (own_tried + PRIOR_WEIGHT))

    def choose(self, candidates: list[Candidate], base_tokens: int, num_decodes: int, budget: int) -> list[int]:
        """Draft lengths (<= len(draft), summing to <= budget), in the order of `candidates`.

        base_tokens: tokens of the step without drafts; num_decodes: requests that yield a token
        (the step's output without drafts). A drafted token at depth j of a request with acceptance
        p is expected to add p^j tokens of output; tokens are taken best first while
        (E + gain) / t(T + 1) > E / t(T)."""
        lengths = [0] * len(candidates)
        if not self.adaptive:
            for i, c in enumerate(candidates):
                lengths[i] = min(len(c.draft), self.max_draft, max(0, budget))
                budget -= lengths[i]
            return lengths
        a, b = self.cost.coefficients()
        heap = [(-c.accept_rate, i, 1) for i, c in enumerate(candidates) if c.draft]
        heapq.heapify(heap)
        expected, tokens = float(max(num_decodes, 1)), base_tokens
        while heap and budget > 0:
            neg_gain, i, depth = heapq.heappop(heap)
            gain = -neg_gain
            # worth it iff (E + g) / (a + b (T + 1)) > E / (a + b T)  <=>  g (a + b T) > E b
            if gain * (a + b * tokens) <= expected * b:
                break  # gains only shrink from here
            lengths[i] = depth
            expected += gain
            tokens += 1
            budget -= 1
            c = candidates[i]
            if depth < min(len(c.draft), self.max_draft):
                heapq.heappush(heap, (-(gain * c.accept_rate), i, depth + 1))
        return lengths

    def record(self, match_len: int, drafted: int, accepted: int) -> None:
        """Learn from one verification: `accepted` of `drafted` tokens kept; a rejection was seen
        unless all were kept."""
        stats = self.by_match.setdefault(match_len, [0.0, 0.0])
        stats[0] = stats[0] * 0.99 + accepted
        stats[1] = stats[1] * 0.99 + accepted + (accepted < drafted)


@dataclass
class SpecStats:
    """Counters since start (for /metrics), and how the policy's choices were distributed."""

    verify_steps: int = 0  # request-steps that fed drafts
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    declined: int = 0  # request-steps with a proposal the policy chose not to feed
    draft_lengths: dict[int, int] = field(default_factory=dict)  # chosen length -> request-steps

    @property
    def mean_accept_len(self) -> float:
        """Tokens yielded per verifying request-step (accepted drafts + the target's own token)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "declined": self.declined,
            "mean_accept_len": self.mean_accept_len,
            "draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())},
        }


class Speculator:
    """What the scheduler asks of speculative decoding: this step's drafts, and the outcome.

    n-gram drafts cost nothing to look up, so each request proposes what it finds and the policy
    picks lengths from those. A draft model costs a forward per drafted position, so the policy picks
    lengths first (from acceptance learned so far) and only that much is drafted."""

    def __init__(self, config, draft_model=None):
        self.drafter = NgramDrafter(
            config.speculative_ngram_min, config.speculative_ngram_max, config.speculative_shared_tokens
        )
        self.draft_model = draft_model  # a DraftModelDrafter for --speculative-algorithm draft
        self.policy = DraftPolicy(config.speculative_num_draft_tokens, adaptive=not config.speculative_fixed_length)
        self.max_draft = config.speculative_num_draft_tokens
        self.stats = SpecStats()

    def plan(self, decodes: list[tuple], base_tokens: int, num_decodes: int, budget: int) -> list[tuple]:
        """decodes: (request, most tokens it may draft); base_tokens: the step's tokens without drafts;
        num_decodes: requests the step yields a token for. Returns (request, drafts, match length) for
        the requests that draft this step."""
        candidates = []
        for req, limit in decodes:
            limit = min(limit, self.max_draft)
            if self.draft_model is not None:
                candidates.append(Candidate(req, [0] * limit, 0, self.policy.accept_rate(req.spec_history, 0)))
                continue
            draft, match_len = self.drafter.propose(req.rid, req.prompt_ids, req.output_ids, limit)
            draft = _grammar_prefix(req, draft)
            if draft:
                candidates.append(Candidate(req, draft, match_len, self.policy.accept_rate(req.spec_history, match_len)))
        lengths = self.policy.choose(candidates, base_tokens, num_decodes, budget)
        self.stats.declined += sum(1 for k in lengths if k == 0)
        chosen = [(c, k) for c, k in zip(candidates, lengths) if k > 0]
        if self.draft_model is not None:
            drafts = self.draft_model.draft([(c.key.rid, c.key.prompt_ids + c.key.output_ids, k) for c, k in chosen])
            return [(c.key, d, 0) for (c, _), draft in zip(chosen, drafts) if (d := _grammar_prefix(c.key, draft))]
        return [(c.key, c.draft[:k], c.match_len) for c, k in chosen]

    def verified(self, req, drafted: int, accepted: int) -> None:
        self.policy.record(req.draft_match, drafted, accepted)
        acc, tried = req.spec_history
        req.spec_history = (acc * REQUEST_DECAY + accepted, tried * REQUEST_DECAY + accepted + (accepted < drafted))
        req.spec_verify_steps += 1
        req.spec_drafted += drafted
        req.spec_accepted += accepted
        s = self.stats
        s.verify_steps += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.draft_lengths[drafted] = s.draft_lengths.get(drafted, 0) + 1

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.policy.cost.observe(tokens, seconds)

    def after_step(self, batch, fed_from: list[int], hidden) -> None:
        """An MTP drafter takes each unfinished request's newly committed positions (from `fed_from`,
        its KV length before the step, to its KV length now) with the target's hidden states there."""
        if hidden is None or not getattr(self.draft_model, "needs_hidden", False):
            return
        items, row = [], 0
        for req, n, p0 in zip(batch.reqs, batch.extend_lens, fed_from):
            m = req.kv_len - p0
            if not req.finished and m > 0:
                items.append((req.rid, p0, hidden[row : row + m], req.seq_slice(p0 + 1, p0 + 1 + m)))
            row += n
        self.draft_model.extend(items)

    def finish(self, rid: str) -> None:
        self.drafter.finish(rid)
        if self.draft_model is not None:
            self.draft_model.finish(rid)


def _grammar_prefix(req, draft: list[int]) -> list[int]:
    """The part of a draft a structured-output request's grammar allows (the rest would be rejected)."""
    if draft and req.grammar is not None:
        return draft[: req.grammar.valid_prefix(draft)]
    return draft
