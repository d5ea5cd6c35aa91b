"""The preallocated KV pool: one K and one V buffer per layer, indexed by slot.

Slots are grouped into pages of `page_size` (slot = page * page_size + offset); the allocator and
the prefix cache deal in pages, attention deals in slots.
"""

from __future__ import annotations

import torch


class MHAKVPool:
    """K/V for multi-head (and grouped-query) attention: [num_slots, num_kv_heads, head_dim] per layer."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        shape = (self.num_slots, num_kv_heads, head_dim)
        # zeros, not empty: padded attention gathers slots it masks out (the unwritten tail of a
        # request's last page, padding rows), and a masked 0 * NaN from uninitialised memory is NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        """Slot ids of whole pages, in order: [len(pages) * page_size] int64."""
        base = torch.tensor(pages, dtype=torch.int64).view(-1, 1) * self.page_size
        return (base + torch.arange(self.page_size)).view(-1)
