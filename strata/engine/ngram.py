"""Prompt lookup, the n-gram drafter of speculative decoding (`strata.engine.speculative`): the
longest recent n-gram of a request's own text that occurred before in it (`NgramIndex`), or,
failing that, in recently finished requests' texts (`SharedNgramIndex`), proposes what followed
it (`NgramDrafter`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


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
        self.ends: dict[
            tuple[int, ...], tuple[int, int]
        ] = {}  # n-gram -> (text id, end)
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

    def propose(
        self, rid: str, prompt: list[int], output: list[int], k: int
    ) -> tuple[list[int], int]:
        """Up to k draft tokens to follow prompt + output, and the n-gram length that found them,
        negated when it was found in other requests' texts: those drafts are accepted far less often
        than the request's own at the same length (on the bench's answers 2-23% of drafted tokens
        against 19-85%), so the policy learns their acceptance apart."""
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
        if shared_n > n:
            return shared, -shared_n
        return draft, n

    def finish(self, rid: str) -> None:
        index = self.own.pop(rid, None)
        if index is not None:
            self.shared.add(index.tokens)
