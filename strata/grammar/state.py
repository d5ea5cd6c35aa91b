"""`GrammarState`: one request's position in its grammar, and the batched bitmask fill.

Contract with the engine, per sampling step of a request that has a state:
  1. while `needs_mask`, the runner fills the request's row of a [rows, words] int32 bitmask
     (`fill_bitmasks`; bit t of the row = token t allowed) and the sampler masks the logits;
  2. the scheduler passes the sampled token to `accept` (False: the grammar rejected it; only
     possible when the mask was not applied or the matcher hit an internal limit, see `error`);
  3. `is_complete` (the grammar admits nothing more) finishes the request.
Tokens before the `start_after` trigger are recorded but not matched (a reasoning model's
thinking); the mask applies from the token after the trigger. `rollback(n)` undoes the last n
accepted tokens (speculative decoding rejects draft tokens this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_executor: Any = None  # llguidance.LLExecutor, made on first batched fill


class GrammarState:
    def __init__(self, matcher: Any, start_after: Sequence[int], vocab_size: int):
        self.matcher = matcher  # llguidance.LLMatcher, this request's own copy
        self.trigger = tuple(start_after)
        self.vocab_size = vocab_size  # the matcher's vocabulary: bitmask rows are ceil(vocab_size / 32) words
        self.history: list[
            int
        ] = []  # every token accepted (armed or not), for the trigger and rollback
        self.armed_at: int | None = (
            0 if not self.trigger else None
        )  # len(history) when the grammar was armed

    @property
    def armed(self) -> bool:
        return self.armed_at is not None

    @property
    def needs_mask(self) -> bool:
        """True when the next token is constrained (armed, not finished, not broken)."""
        return self.armed and not self.matcher.is_stopped()

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and admits no further token (the output is done)."""
        return self.armed and self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher broke (a rejected token or an internal limit), else None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error().split("\n<state>", 1)[0].strip()

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the state is then broken)."""
        self.history.append(token)
        if not self.armed:
            if tuple(self.history[-len(self.trigger) :]) == self.trigger:
                self.armed_at = len(self.history)
            return True
        return self.matcher.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (including ones before the trigger)."""
        num_tokens = min(num_tokens, len(self.history))
        if num_tokens <= 0:
            return
        if self.armed_at is not None:
            matched = len(self.history) - self.armed_at
            if num_tokens > matched:  # back past the trigger: disarm
                self.matcher.reset()
                self.armed_at = None if self.trigger else 0
            else:
                self.matcher.rollback(num_tokens)
        del self.history[len(self.history) - num_tokens :]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would accept in a row from here (nothing is consumed).
        Before the trigger every token passes, up to the one that completes it (what follows it would
        be matched against a grammar not yet started: drafts stop there)."""
        if self.armed:
            return (
                0
                if self.matcher.is_stopped()
                else self.matcher.validate_tokens(list(tokens))
            )
        tail = list(self.history[-len(self.trigger) :])
        for i, token in enumerate(tokens):
            tail = (tail + [token])[-len(self.trigger) :]
            if tuple(tail) == self.trigger:
                return i + 1
        return len(tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write this state's allowed tokens into bitmask[row] ([rows, words] int32, C-contiguous)."""
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(states: Sequence[GrammarState]) -> np.ndarray:
    """The next-token bitmask of each state, one row each: [len(states), words] int32.

    Several states are filled in parallel by llguidance's thread pool (it releases the GIL)."""
    global _executor
    words = bitmask_words(max(s.vocab_size for s in states))
    bitmask = np.empty((len(states), words), dtype=np.int32)
    if len(states) == 1:
        states[0].fill_bitmask(bitmask, 0)
        return bitmask
    if _executor is None:
        from llguidance import LLExecutor

        _executor = LLExecutor()
    _executor.unsafe_compute_mask_ptr(
        [(s.matcher, i) for i, s in enumerate(states)],
        bitmask.ctypes.data,
        words * 4,
        len(states),
    )
    return bitmask
