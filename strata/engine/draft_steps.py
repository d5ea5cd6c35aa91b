"""What the scheduler does for speculative decoding (strata.engine.speculative): which decoding
requests feed drafted tokens this step, with pages for them, and which tokens a request keeps once
the forward has verified them (the KV of rejected drafts given back).
"""

from __future__ import annotations

import math

from strata.cache.allocator import PageAllocator
from strata.engine.request import Req
from strata.engine.speculative import Speculator
from strata.layers.sampler import SamplerOutput


class DraftSteps:
    """Owned by the `Scheduler`: works on its allocator, within its context length. The
    speculator is passed to each call (the scheduler's current one: `Scheduler.set_speculator`
    may swap it between requests)."""

    def __init__(self, allocator: PageAllocator, context_len: int):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.context_len = context_len

    def plan(
        self, spec: Speculator, decodes: list[Req], base_tokens: int, budget: int
    ) -> list[Req]:
        """Speculative decoding: the decodes that feed drafted tokens this step, with `draft_ids` set
        and pages for them allocated (from free pages only: drafts never evict cached KV)."""
        eligible = []
        for req in decodes:
            # every accepted draft is one more output token, plus the target's own at the end
            limit = (
                min(
                    req.params.max_new_tokens - len(req.output_ids),
                    self.context_len - req.seq_len,
                )
                - 1
            )
            if limit > 0 and req.replay_from is None:
                eligible.append((req, limit))
        verifying = []
        for req, draft, match_len in spec.plan(
            eligible, base_tokens, len(decodes), budget
        ):
            k = len(draft)
            while k > 0 and not self.allocator.can_alloc(
                req.pages_short(req.kv_len + 1 + k, self.page_size)
            ):
                k -= 1
            if k > 0:
                req.pages.extend(
                    self.allocator.alloc(
                        req.pages_short(req.kv_len + 1 + k, self.page_size)
                    )
                    or []
                )
                req.draft_ids, req.draft_match = draft[:k], match_len
                verifying.append(req)
        return verifying

    def take_tokens(
        self,
        spec: Speculator | None,
        req: Req,
        n: int,
        sampled: SamplerOutput,
        row: int,
    ) -> tuple[list[int], int]:
        """The tokens a request that sampled at `row` (and after) appends, and the KV length they
        leave it with. Drafted tokens: the accepted run, then the target's own token (its correction
        at the first rejection, or one more after the last draft); the KV of rejected drafts is
        dropped and their pages freed."""
        drafts, req.draft_ids = req.draft_ids, []
        accepted = 0
        if drafts:
            flags = sampled.accepted[row : row + len(drafts)].tolist()
            while accepted < len(drafts) and flags[accepted]:
                accepted += 1
        tokens = drafts[:accepted] + [int(sampled.token_ids[row + accepted])]
        kv_end = req.kv_len + n - len(drafts) + accepted
        if drafts:
            assert spec is not None  # only a speculator drafts
            keep = math.ceil(kv_end / self.page_size)
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
            spec.verified(req, len(drafts), accepted)
        return tokens, kv_end
