"""Whole KV pages of a split replica, for what moves pages between the pool and elsewhere (HiCache's
L2/L3 copies, PD transfers): a `KVPool` on rank 0 that the page movers use.

`ReplicatedKVPool` (attention replicated: --ep-size without --tp-size): every rank holds the same
pages whole, so a read is rank 0's own and a write is broadcast for every rank to store (any pool:
window groups and DeepSeek-V4's state too).

`ShardedKVPool` (tensor parallel), every KV head:

Each rank's pool holds its KV heads of the same pages. Reading pages gathers every rank's heads to
rank 0 (a `ReadPages` broadcast, then a gather on the control group, shards padded to the widest);
writing broadcasts the full pages after a `WritePages` and each rank keeps its heads. So a page
leaves the replica in the layout of one rank holding every head: the KV namespace, L3 pages and PD
transfers are those of a single-rank replica of the same model (a tp=2 prefill worker can feed a
tp=1 decode worker). The model keeps using each rank's own pool; only page movers see this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from strata.cache.kv_pool import KVPool, MHAKVPool
from strata.distributed.sharding import HeadSplit


def pad_heads(pages: torch.Tensor, width: int) -> torch.Tensor:
    """[n, layers, 2, ps, heads, dim] -> the same with `width` heads (zeros after the rank's own)."""
    if pages.shape[4] == width:
        return pages.contiguous()
    out = pages.new_zeros(*pages.shape[:4], width, pages.shape[5])
    out[:, :, :, :, : pages.shape[4]] = pages
    return out


class ReplicatedKVPool(KVPool):
    """Rank 0's pool, whose writes every worker repeats (see the module docstring)."""

    def __init__(self, local: KVPool, runtime):
        self.local, self.runtime = local, runtime
        self.page_size, self.num_pages = local.page_size, local.num_pages
        self.dtype, self.device = local.dtype, local.device
        self.windows = list(getattr(local, "windows", []))

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return self.local.page_shape

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    @property
    def layout(self) -> str:
        return self.local.layout

    def bytes_by_group(self) -> list[int]:
        return self.local.bytes_by_group()

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        return self.local.read_pages(pages)

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        from strata.distributed.messages import WritePages

        idx = np.asarray(pages, dtype=np.int64)
        maps = getattr(self.local, "page_maps", [])
        self.runtime.send(
            WritePages(list(pages), [m[idx].tolist() for m in maps] or None)
        )
        full = data.reshape(len(pages), *self.page_shape).to(self.dtype).contiguous()
        self.runtime.comm.run(
            "page broadcast", dist.broadcast, full, 0, group=self.runtime.comm.control
        )
        self.local.write_pages(pages, full)


class ShardedKVPool(KVPool):
    def __init__(
        self, local: MHAKVPool, runtime, splits: list[HeadSplit], num_kv_heads: int
    ):
        if local.grouped:
            raise ValueError(
                "moving KV pages of window groups between tensor-parallel ranks is not built yet"
            )
        self.local, self.runtime, self.splits = local, runtime, splits
        self.num_kv_heads = num_kv_heads
        self.page_size, self.num_pages = local.page_size, local.num_pages
        self.dtype, self.device, self.windows = local.dtype, local.device, []
        self.width = max(
            s.num_kv for s in splits
        )  # the widest shard: what the gather moves per rank

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        layers, parts, ps, _, dim = self.local.page_shape
        return (layers, parts, ps, self.num_kv_heads, dim)

    @property
    def nbytes(self) -> int:
        return self.local.nbytes  # this rank's buffers

    @property
    def layout(self) -> str:
        return self.local.layout.replace(
            f"kv_heads={self.local.page_shape[3]}", f"kv_heads={self.num_kv_heads}"
        )

    def bytes_by_group(self) -> list[int]:
        return self.local.bytes_by_group()

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        from strata.distributed.messages import ReadPages

        self.runtime.send(ReadPages(list(pages)))
        mine, present = self.local.read_pages(pages)
        parts = [torch.empty_like(pad_heads(mine, self.width)) for _ in self.splits]
        self.runtime.comm.run(
            "page gather",
            dist.gather,
            pad_heads(mine, self.width),
            parts,
            0,
            group=self.runtime.comm.control,
        )
        out = torch.empty(len(pages), *self.page_shape, dtype=mine.dtype)
        for split, part in zip(self.splits, parts):
            out[:, :, :, :, split.kv_start : split.kv_start + split.num_kv] = part[
                :, :, :, :, : split.num_kv
            ]
        return out, present

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        from strata.distributed.messages import WritePages

        self.runtime.send(WritePages(list(pages)))
        full = data.to(self.dtype).contiguous()
        self.runtime.comm.run(
            "page broadcast", dist.broadcast, full, 0, group=self.runtime.comm.control
        )
        self.local.write_pages(pages, own_heads(full, self.splits[0]))


def own_heads(pages: torch.Tensor, split: HeadSplit) -> torch.Tensor:
    return pages[:, :, :, :, split.kv_start : split.kv_start + split.num_kv]
