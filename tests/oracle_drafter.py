"""A drafter for speculative-decoding tests that knows the answers: it proposes what the target will
say (from a run without speculation), corrupting one token of a proposal now and then, so that a
run has long accepted runs and rejections at every depth.

Import it as `from oracle_drafter import OracleDrafter` (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import random


class OracleDrafter:
    """Proposes the next tokens of the reference answer to a prompt, one of them replaced by a token
    in 3..299 with probability `corrupt`; nothing once the output has left the reference."""

    def __init__(
        self,
        references: dict[tuple[int, ...], list[int]],
        seed: int = 0,
        corrupt: float = 0.3,
    ):
        self.references = references
        self.rng = random.Random(seed)
        self.corrupt = corrupt

    def propose(self, rid, prompt, output, k):
        ref = self.references.get(tuple(prompt), [])
        if ref[: len(output)] != output:
            return [], 0
        draft = list(ref[len(output) : len(output) + k])
        if draft and self.rng.random() < self.corrupt:
            draft[self.rng.randrange(len(draft))] = self.rng.randrange(3, 300)
        return draft, 3

    def finish(self, rid):
        pass
