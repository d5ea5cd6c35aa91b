"""What one step computes: the scheduler's plan (`ScheduleBatch`) and its tensor form (`ForwardBatch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.engine.request import Req
from strata.layers.attention import AttentionMetadata
from strata.layers.engram import EngramInputs
from strata.layers.sampler import SamplingBatch


@dataclass
class ScheduleBatch:
    """Requests in this step, decodes (one token each) first, then extends (prefill chunks, and
    decodes that feed drafted tokens: `Req.draft_ids`)."""

    reqs: list[Req]
    extend_lens: list[int]  # tokens fed for each request this step
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def sampled_reqs(self) -> list[Req]:
        """Requests whose whole sequence is computed after this step, so they sample a token."""
        return [
            r for r, n in zip(self.reqs, self.extend_lens) if r.kv_len + n == r.fed_len
        ]


@dataclass
class ForwardBatch:
    rows: list[SampleRow]  # what each sampled row is, in sample_rows order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: (
        torch.Tensor
    )  # [S] rows of the flattened tokens whose logits are sampled
    sampling: SamplingBatch | None
    # models with Engram layers: each token's n-gram rows, hashed (and gathered ahead) at prepare
    ngrams: EngramInputs | None = None


@dataclass
class SampleRow:
    """One sampled position: the request's last, or one of its drafted ones. `before` are the drafts
    fed ahead of it, `draft` the drafted token its choice is checked against (-1: none)."""

    req: Req
    before: list[int]
    draft: int


def sample_rows_of(reqs: list[Req]) -> list[SampleRow]:
    """The sampled rows of these requests, in the order the forward's sample rows are laid out."""
    rows: list[SampleRow] = []
    for req in reqs:
        drafts = req.draft_ids
        rows.extend(SampleRow(req, drafts[:j], drafts[j]) for j in range(len(drafts)))
        rows.append(SampleRow(req, drafts, -1))
    return rows
