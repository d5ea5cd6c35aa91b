"""The preallocated KV pool: one K and one V buffer per layer, indexed by slot.

Slots are grouped into pages of `page_size` (slot = page * page_size + offset); the allocator and
the prefix cache deal in pages, attention deals in slots.

Layers are grouped by how far back they attend. The full-attention layers form the primary group:
their buffers are indexed by the page ids the scheduler and the prefix cache hand around. Each
sliding-window size forms a group of its own with a smaller buffer, indexed by its own pages
(`GroupedPageAllocator` maps a primary page to the group's page); a window layer holds at most
about W tokens per request, as pages that fall out of the window go back while the request runs.
When every layer is windowed (Mistral's sliding configs) the primary group stores nothing: its page
ids only name positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MHAKVPool:
    """K/V for multi-head (and grouped-query) attention: [slots, num_kv_heads, head_dim] per layer."""

    def __init__(
        self,
        layer_windows: Sequence[int | None] | int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        group_pages: dict[int, int] | None = None,
    ):
        """layer_windows: each layer's window (None: full), or a layer count (all full).
        group_pages: pages of each window size's own group; None: every layer in the primary group
        (windowed layers then keep every token's KV, as a full layer does)."""
        if isinstance(layer_windows, int):
            layer_windows = [None] * layer_windows
        group_pages = group_pages or {}
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.windows = sorted(group_pages)  # window group g (1-based in group_of) has windows[g - 1]
        self.group_pages = [group_pages[w] for w in self.windows]
        self.group_of = [
            self.windows.index(w) + 1 if w is not None and w in group_pages else 0 for w in layer_windows
        ]
        # zeros, not empty: padded attention gathers slots it masks out (the unwritten tail of a
        # request's last page, padding rows), and a masked 0 * NaN from uninitialised memory is NaN
        # with window groups the full layers get one page more, never allocated: where a replayed
        # window's tokens write their full-layer KV (`--swa-replay` keeps the cached one)
        self.scratch_page = num_pages if self.windows else None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for g in self.group_of:
            pages = num_pages + (self.scratch_page is not None) if g == 0 else self.group_pages[g - 1]
            shape = (pages * page_size, num_kv_heads, head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

        self.page_maps: list[np.ndarray] = []  # per window group: primary page -> its page (-1: none)

    @property
    def grouped(self) -> bool:
        return bool(self.windows)

    def attach_page_maps(self, maps: Sequence[np.ndarray]) -> None:
        """The allocator's page map of each window group (`WindowGroup.to_group`), in group order."""
        if len(maps) != len(self.windows):
            raise ValueError(f"{len(maps)} page maps for {len(self.windows)} window groups")
        self.page_maps = list(maps)

    # ----------------------------------------------------------------- whole pages, every group
    # (what moves between tiers and workers: L2/L3 pages, PD transfers)

    def _group_slots(self, pages: np.ndarray) -> list[tuple[torch.Tensor, np.ndarray | None]]:
        """Per group (primary first): the pages' slots in that group's buffers, and which pages the
        group holds (None: all, the primary group). Missing pages point at slot 0 (masked by the caller)."""
        out: list[tuple[torch.Tensor, np.ndarray | None]] = [(self.slots_of_pages(pages.tolist()), None)]
        for page_map in self.page_maps:
            own = page_map[pages]
            held = own >= 0
            out.append((self.slots_of_pages(np.where(held, own, 0).tolist()), held))
        return out

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        """The KV of whole pages, on the CPU: [n, layers, 2 (k/v), page_size, Hkv, D], and
        [n, window groups] bool: whether each group still held its part (absent parts read as zeros)."""
        idx = np.asarray(pages, dtype=np.int64)
        n, ps = len(idx), self.page_size
        k0 = self.k[0]
        out = torch.zeros((n, len(self.k), 2, ps, k0.shape[1], k0.shape[2]), dtype=self.dtype)
        groups = self._group_slots(idx)
        present = np.ones((n, len(self.windows)), dtype=bool)
        for g, (_, held) in enumerate(groups[1:]):
            present[:, g] = held
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            slots, held = groups[self.group_of[layer]]
            slots = slots.to(k.device)
            out[:, layer, 0] = k[slots].view(n, ps, *k.shape[1:]).cpu()
            out[:, layer, 1] = v[slots].view(n, ps, *v.shape[1:]).cpu()
            if held is not None and not held.all():
                out[torch.from_numpy(~held), layer] = 0
        return out, present

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Write `read_pages` data into allocated pages, each group's part where the group holds the
        page (the caller drops a group's page where its part was absent)."""
        idx = np.asarray(pages, dtype=np.int64)
        groups = self._group_slots(idx)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            slots, held = groups[self.group_of[layer]]
            rows = data[:, layer]  # [n, 2, ps, Hkv, D]
            if held is not None:
                keep = torch.from_numpy(held)
                slots = slots.view(len(idx), -1)[keep].view(-1)
                rows = rows[keep]
            slots = slots.to(k.device)
            k[slots] = rows[:, 0].reshape(-1, *k.shape[1:]).to(k.device, k.dtype)
            v[slots] = rows[:, 1].reshape(-1, *v.shape[1:]).to(v.device, v.dtype)

    def layer_bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * k.shape[1] * k.shape[2] * k.element_size()

    def bytes_by_group(self) -> list[int]:
        """Bytes per page of each group (primary first): what one page costs there."""
        per_layer = self.layer_bytes_per_token() * self.page_size
        return [per_layer * self.group_of.count(g) for g in range(len(self.windows) + 1)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def slots_of_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """Slot ids of whole pages, in order: [len(pages) * page_size] int64."""
        base = torch.tensor(pages, dtype=torch.int64).view(-1, 1) * self.page_size
        return (base + torch.arange(self.page_size)).view(-1)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (a page's payload for L3 storage or a PD transfer)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()
