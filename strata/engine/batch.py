"""What one step computes: the scheduler's plan (`ScheduleBatch`) and its tensor form (`ForwardBatch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.engine.request import Req
from strata.layers.attention import AttentionMetadata
from strata.layers.sampler import SamplingBatch


@dataclass
class ScheduleBatch:
    """Requests in this step, decodes (one token each) first, then extends (prefill chunks)."""

    reqs: list[Req]
    extend_lens: list[int]  # tokens fed for each request this step
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def sampled_reqs(self) -> list[Req]:
        """Requests whose whole sequence is computed after this step, so they sample a token."""
        return [r for r, n in zip(self.reqs, self.extend_lens) if r.kv_len + n == r.seq_len]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows of the flattened tokens whose logits are sampled
    sampling: SamplingBatch | None
