"""What the drafters with weights share: how they are built (`DraftOptions`: a draft model's, the
MTP layer's, a DSpark drafter's), and the rows of their own paged KV per request for a run of the
target's positions (`Rows`, `RowsByRequest`: the MTP layer and a DSpark drafter keep one row per
position the target computed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from strata.cache.allocator import PageAllocator

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftOptions:
    """The target's compute dtype, device, weight quantization and context length, which a drafter
    loads its weights with, and the size of the drafter's own KV pool."""

    dtype: torch.dtype
    device: torch.device
    num_tokens: int  # KV tokens of the drafter's pool (as many as the target's)
    page_size: int
    quantization: str
    context_len: int

    @property
    def num_pages(self) -> int:
        return max(1, self.num_tokens // self.page_size)


@dataclass
class Rows:
    """One request's rows: positions [first, first + length), their pages (page i holds rows
    [i * page_size, (i + 1) * page_size) counted from `first`)."""

    first: int
    length: int = 0
    pages: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.first + self.length


R = TypeVar("R", bound=Rows)


class RowsByRequest(Generic[R]):
    """Each request's `Rows` (of type `row_type`) in pages of `allocator`."""

    def __init__(self, row_type: type[R], allocator: PageAllocator):
        self.row_type = row_type
        self.allocator = allocator
        self.seqs: dict[str, R] = {}

    def seq_at(self, rid: str, p0: int) -> R:
        """The request's rows, cut back to end at p0 (or started afresh at p0 if it has none there)."""
        seq = self.seqs.get(rid)
        if seq is not None and seq.first <= p0 <= seq.end:
            seq.length = p0 - seq.first
            return seq
        return self.restart(rid, p0)

    def restart(self, rid: str, p0: int) -> R:
        """The request's rows given up; new ones start at p0."""
        self.drop(rid)
        seq = self.seqs[rid] = self.row_type(first=p0)
        return seq

    def drop(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.allocator.free(seq.pages)
