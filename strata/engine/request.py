"""A request inside the engine, and the outputs it streams back.

KV layout of a running request (page_size 4 here):

    seq = prompt_ids + output_ids
    |<-- cached_len -->|<------ own pages ------>|
    [ tree pages (locked) | pages this request allocated ]  ...  seq[kv_len:] not computed yet
    0                  cached_len              kv_len        len(seq)

`pages[i]` backs tokens [i * page_size, (i + 1) * page_size). The first cached_len // page_size
pages belong to the prefix cache (locked through `prefix_node`); the rest are the request's own.
Decode is the case len(seq) - kv_len == 1: the last sampled token is fed back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.engine.outputs import RequestOutput, TokenLogprob, TopLogprob
from strata.grammar.state import GrammarState
from strata.sampling_params import SamplingParams
from strata.tokenizer import IncrementalDetokenizer

KEY_SHIFT = 32  # prefix-cache keys of an adapter's tokens: -(adapter << 32) - token - 1


def adapter_cache_key(tokens: list[int], adapter: int) -> list[int]:
    """The prefix cache's key for tokens run under LoRA adapter `adapter` (its load id; 0: the
    base model, whose keys are the tokens): negative ints, a space of their own per adapter, so
    KV computed under one adapter is never matched by another's request."""
    if not adapter:
        return tokens
    base = adapter << KEY_SHIFT
    return [-(base + t) - 1 for t in tokens]


__all__ = ["Req", "ReqStatus", "RequestOutput", "TokenLogprob", "TopLogprob"]


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    arrival: int = 0  # admission order, for fcfs
    depends_on: Req | None = (
        None  # n > 1: wait until this sibling has cached the prompt
    )
    # the sampler's per-request numbers, built at admission (strata.layers.sampler.sampling_row)
    sampling_row: torch.Tensor | None = None  # [len(ROW_FIELDS)] float32
    top_k: int = 0  # effective top-k: the vocabulary size when disabled
    grammar: GrammarState | None = (
        None  # structured output: the grammar's state (params.structured)
    )
    # params.logit_bias as the sampler's (token ids [N] int64, biases [N] float32), built on first use
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    # KV state (see module docstring)
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    cached_len: int = 0
    prefix_node: Any = None
    window_dropped: list[int] = field(
        default_factory=list
    )  # per window group: pages before this gave their KV back
    # --swa-replay: the window groups' KV of [replay_from, cached_len) is being recomputed into these
    # pages of each group (the tree's pages there lack it); None when not replaying
    replay_from: int | None = None
    replay_end: int = 0  # the cached_len the replay started from
    replay_pages: list[list[int]] = field(default_factory=list)
    # speculative decoding: tokens drafted to follow the sequence, fed after it this step (verified by
    # the forward; see strata.engine.speculative), the n-gram length that found them, and the
    # request's decayed (accepted, tried) drafted tokens
    draft_ids: list[int] = field(default_factory=list)
    draft_match: int = 0
    spec_history: tuple[float, float] = (0.0, 0.0)
    # a block drafter's (DSpark) blocks alone: their decayed (accepted, tried) drafted tokens
    block_history: tuple[float, float] = (0.0, 0.0)
    # what the block drafter's forwards bought it: decayed (forwards, tokens accepted, rows drafted)
    # of its blocks as verified, a forward whose block was cut to nothing counting as one of 0, 0
    block_yield: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # reporting
    num_cached_tokens: int = (
        0  # prompt tokens served from the prefix cache at first admission
    )
    cached_tokens_by_tier: dict[str, int] = field(
        default_factory=dict
    )  # device / host / storage
    admitted_once: bool = False
    num_retractions: int = 0
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_status: int | None = None  # RequestOutput.error_status
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_tokens: int = 0  # output tokens already reported
    spec_verify_steps: int = 0  # steps that fed drafts
    spec_drafted: int = 0
    spec_accepted: int = 0
    aborted: bool = False
    adapter: int = (
        0  # the LoRA adapter's load id (strata.engine.lora); 0: the base model
    )

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def seq_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def cache_key(self, end: int) -> list[int]:
        """Tokens [0, end) as the prefix cache keys them: an adapter's in a space of its own."""
        return adapter_cache_key(self.seq_slice(0, end), self.adapter)

    def pages_short(self, end: int, page_size: int) -> int:
        """Pages `pages` lacks to cover positions [0, end)."""
        return max(0, -(-end // page_size) - len(self.pages))

    @property
    def fed_len(self) -> int:
        """Positions this step's forward computes up to: the sequence plus any drafted tokens."""
        return self.seq_len + len(self.draft_ids)

    @property
    def extend_len(self) -> int:
        """Tokens still to be fed before the next sample (1 while decoding)."""
        return self.seq_len - self.kv_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def remaining_new(self) -> int:
        """Output tokens it may still produce (max_new_tokens less those it has)."""
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def make_output(self) -> RequestOutput:
        """Everything new since the last call (tokens, text, logprobs), then marks it as sent."""
        new_ids = self.output_ids[self.sent_tokens :]
        self.sent_tokens = len(self.output_ids)
        text = (
            self.detokenizer.take_delta(self.finished)
            if self.detokenizer is not None
            else ""
        )
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        return RequestOutput(
            rid=self.rid,
            new_token_ids=new_ids,
            text_delta=text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            matched_stop=self.matched_stop,
            error=self.error,
            error_status=self.error_status,
            logprobs=logprobs,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.num_cached_tokens,
            cached_tokens_details=dict(self.cached_tokens_by_tier),
            spec_verify_steps=self.spec_verify_steps,
            spec_drafted_tokens=self.spec_drafted,
            spec_accepted_tokens=self.spec_accepted,
        )
