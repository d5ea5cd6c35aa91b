"""The preallocated KV pool, indexed by slot: `MHAKVPool` (one K and one V buffer per layer) and
`LatentKVPool` (multi-head latent attention: one latent row per token and layer), behind `KVPool`.

Slots are grouped into pages of `page_size` (slot = page * page_size + offset); the allocator and
the prefix cache deal in pages, attention deals in slots.

Layers are grouped by how far back they attend. The full-attention layers form the primary group:
their buffers are indexed by the page ids the scheduler and the prefix cache hand around. Each
sliding-window size forms a group of its own with a smaller buffer, indexed by its own pages
(`GroupedPageAllocator` maps a primary page to the group's page); a window layer holds at most
about W tokens per request, as pages that fall out of the window go back while the request runs.
When every layer is windowed (Mistral's sliding configs) the primary group stores nothing: its page
ids only name positions.

Shared (`--swa-pool shared`, one window size, at least one full layer): every group draws its pages
from one pool, so the memory goes wherever the workload needs it (long cached conversations: full
layers; many running windows: window layers) instead of a fixed split. Pages are then of one size:
F full layers give F buffers per K and V, each holding a page of one layer; the window layers are
cut into ceil(S / F) groups of up to F layers, layer i of a group in buffer i. A primary page and
each group's page behind it are different pages of the same buffers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch


class KVPool(ABC):
    """A KV layout: what the engine, the accounting, HiCache's L2/L3 page copies and PD transfers
    need of it. Nothing outside the model's attention reads its buffers directly.

    Whole pages leave and enter the pool only through `read_pages` / `write_pages`, as
    [n, *page_shape] on the CPU, page_shape = (layers, parts, page_size, heads, dim): parts 2 (K, V)
    and heads the KV heads for MHA; 1 and 1 for MLA's latent row. Pages are addressed as the
    allocator hands them out; `write_pages` writes into pages the caller has allocated and mutates
    nothing else. A pool is used by the scheduler's thread only (no locking)."""

    page_size: int
    num_pages: int
    dtype: torch.dtype
    device: torch.device
    windows: list[
        int
    ]  # the window size of each window group (empty: one group, every layer)
    scratch_page: int | None = (
        None  # a never-allocated page for `--swa-replay` (window groups only)
    )
    shared: bool = (
        False  # the window groups' pages come from the primary pool (MHAKVPool)
    )

    @property
    def grouped(self) -> bool:
        return bool(self.windows)

    @property
    @abstractmethod
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One page as `read_pages` returns it: (layers, parts, page_size, heads, dim)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer (what L2 holds, L3 stores and PD sends per page)."""
        return math.prod(self.page_shape) * self.dtype.itemsize

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every buffer of the pool."""

    @property
    @abstractmethod
    def layout(self) -> str:
        """The layout, for the namespace of pages shared through L3 storage or PD (must differ
        between layouts whose pages differ in meaning)."""

    @abstractmethod
    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        """The KV of whole pages on the CPU: [n, *page_shape], and [n, window groups] bool: whether
        each group still held its part (absent parts read as zeros)."""

    @abstractmethod
    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Write `read_pages` data into allocated pages."""

    @abstractmethod
    def bytes_by_group(self) -> list[int]:
        """Bytes per page of each group (primary first): what one page costs there."""

    def slots_of_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """Slot ids of whole pages, in order: [len(pages) * page_size] int64."""
        base = torch.tensor(pages, dtype=torch.int64).view(-1, 1) * self.page_size
        return (base + torch.arange(self.page_size)).view(-1)


class MHAKVPool(KVPool):
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
        shared: bool = False,
    ):
        """layer_windows: each layer's window (None: full), or a layer count (all full).
        group_pages: pages of each window size's own group; None: every layer in the primary group
        (windowed layers then keep every token's KV, as a full layer does). shared: the window
        groups' pages come from the primary pool (`shares_pool` says where that applies)."""
        if isinstance(layer_windows, int):
            layer_windows = [None] * layer_windows
        group_pages = group_pages or {}
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.device = torch.device(device)
        if shared and not self.shares_pool(layer_windows, group_pages):
            raise ValueError(
                "a shared pool needs one window size and at least one full-attention layer"
            )
        self.shared = shared
        # zeros, not empty: padded attention gathers slots it masks out (the unwritten tail of a
        # request's last page, padding rows), and a masked 0 * NaN from uninitialised memory is NaN
        # with window groups the full layers get one page more, never allocated: where a replayed
        # window's tokens write their full-layer KV (`--swa-replay` keeps the cached one)
        self.scratch_page = num_pages if group_pages else None

        def buffer(pages: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (pages * page_size, num_kv_heads, head_dim)
            return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(
                shape, dtype=dtype, device=device
            )

        if shared:
            full = sum(w is None for w in layer_windows)
            windowed = [i for i, w in enumerate(layer_windows) if w is not None]
            num_groups = -(-len(windowed) // full)
            window = layer_windows[windowed[0]]
            assert window is not None
            self.windows = [window] * num_groups
            self.group_pages = [num_pages] * num_groups
            self.group_of = [0] * len(layer_windows)
            buffers = [buffer(num_pages + 1) for _ in range(full)]
            # layer -> its buffer: full layers in order, then each group's layers in order
            lane: dict[int, int] = {}
            for i in (i for i, w in enumerate(layer_windows) if w is None):
                lane[i] = len(lane)
            for j, i in enumerate(windowed):
                self.group_of[i], lane[i] = 1 + j // full, j % full
            self.k = [buffers[lane[i]][0] for i in range(len(layer_windows))]
            self.v = [buffers[lane[i]][1] for i in range(len(layer_windows))]
        else:
            self.windows = sorted(
                group_pages
            )  # window group g (1-based in group_of) has windows[g - 1]
            self.group_pages = [group_pages[w] for w in self.windows]
            self.group_of = [
                self.windows.index(w) + 1 if w is not None and w in group_pages else 0
                for w in layer_windows
            ]
            self.k, self.v = [], []
            for g in self.group_of:
                k, v = buffer(
                    num_pages + (self.scratch_page is not None)
                    if g == 0
                    else self.group_pages[g - 1]
                )
                self.k.append(k)
                self.v.append(v)

        self.page_maps: list[
            np.ndarray
        ] = []  # per window group: primary page -> its page (-1: none)

    @staticmethod
    def shares_pool(
        layer_windows: Sequence[int | None], group_pages: dict[int, int]
    ) -> bool:
        """Whether these layers can draw every group's pages from one pool: one window size, and a
        full-attention layer to size the pages by."""
        return len(group_pages) == 1 and any(w is None for w in layer_windows)

    def attach_page_maps(self, maps: Sequence[np.ndarray]) -> None:
        """The allocator's page map of each window group (`WindowGroup.to_group`), in group order."""
        if len(maps) != len(self.windows):
            raise ValueError(
                f"{len(maps)} page maps for {len(self.windows)} window groups"
            )
        self.page_maps = list(maps)

    # ----------------------------------------------------------------- whole pages, every group
    # (what moves between tiers and workers: L2/L3 pages, PD transfers)

    def _group_slots(
        self, pages: np.ndarray
    ) -> list[tuple[torch.Tensor, np.ndarray | None]]:
        """Per group (primary first): the pages' slots in that group's buffers, and which pages the
        group holds (None: all, the primary group). Missing pages point at slot 0 (masked by the caller)."""
        out: list[tuple[torch.Tensor, np.ndarray | None]] = [
            (self.slots_of_pages(pages.tolist()), None)
        ]
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
        out = torch.zeros(
            (n, len(self.k), 2, ps, k0.shape[1], k0.shape[2]), dtype=self.dtype
        )
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

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        k = self.k[0]
        return (len(self.k), 2, self.page_size, k.shape[1], k.shape[2])

    @property
    def nbytes(self) -> int:
        unique = {
            id(t): t for t in self.k + self.v
        }.values()  # shared: layers share buffers
        return sum(t.numel() * t.element_size() for t in unique)

    @property
    def layout(self) -> str:
        k = self.k[0]
        return (
            f"layers={len(self.k)};kv_heads={k.shape[1]};head_dim={k.shape[2]};dtype={k.dtype};"
            f"page={self.page_size}"
            + (f";window_groups={self.windows}" if self.windows else "")
            + (";shared" if self.shared else "")
        )

    def layer_bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * k.shape[1] * k.shape[2] * k.element_size()

    def bytes_by_group(self) -> list[int]:
        per_layer = self.layer_bytes_per_token() * self.page_size
        if self.shared:  # every page of the pool spans one page of each buffer
            return [per_layer * self.group_of.count(0)] * (len(self.windows) + 1)
        return [
            per_layer * self.group_of.count(g) for g in range(len(self.windows) + 1)
        ]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class LatentKVPool(KVPool):
    """Multi-head latent attention (DeepSeek-V2/V3, `strata.layers.mla`): per layer ONE row per token,
    shared by every head: [slots, 1, kv_lora_rank + qk_rope_head_dim] = the normalised compressed KV
    (the latent), then the roped key part. No per-head K or V is stored: attention up-projects the
    latent (or absorbs the up-projection into the query and the output).

        row of token t:  [ c_kv(t): kv_lora_rank | k_pe(t): qk_rope_head_dim ]
                           values of the absorbed form   (keys: the whole row)

    One group: MLA layers have no sliding windows."""

    def __init__(
        self,
        num_layers: int,
        latent_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """latent_dim: kv_lora_rank + qk_rope_head_dim."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.windows = []
        # zeros, not empty: padded attention gathers (and masks) slots nobody wrote (see MHAKVPool)
        shape = (self.num_slots, 1, latent_dim)
        self.latent = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (len(self.latent), 1, self.page_size, 1, self.latent[0].shape[2])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent)

    @property
    def layout(self) -> str:
        layers, _, page_size, _, latent_dim = self.page_shape
        return f"mla;layers={layers};latent_dim={latent_dim};dtype={self.dtype};page={page_size}"

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        n = len(pages)
        slots = self.slots_of_pages(list(pages)).to(self.device)
        rows = torch.stack(
            [t[slots] for t in self.latent]
        )  # [layers, n * ps, 1, latent_dim]
        out = (
            rows.view(len(self.latent), n, 1, self.page_size, 1, -1)
            .transpose(0, 1)
            .cpu()
        )
        return out.contiguous(), np.ones((n, 0), dtype=bool)

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        slots = self.slots_of_pages(list(pages)).to(self.device)
        for layer, t in enumerate(
            self.latent
        ):  # data[:, layer]: [n, 1, ps, 1, latent_dim]
            t[slots] = data[:, layer].reshape(-1, *t.shape[1:]).to(t.device, t.dtype)

    def bytes_by_group(self) -> list[int]:
        return [self.page_bytes]

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * latent_dim * dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (a page's payload for L3 storage or a PD transfer)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()
