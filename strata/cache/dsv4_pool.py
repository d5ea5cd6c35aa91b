"""DeepSeek-V4's paged state (`DSV4KVPool`) and how big to make it (`plan_dsv4_pool`).

A V4 layer keeps three kinds of state, each paged so that the allocator, the prefix cache, HiCache
and PD handle it as they handle any KV (page ids from `GroupedPageAllocator`):

    primary pages (P tokens)      compressed entries: the entry whose window closes at position e
                                  lives in page(e) at row (e % P) // m (ceil(P / m) rows per page):
                                  CSA entries [head_dim] + their index keys [index_head_dim],
                                  HCA entries [head_dim]. Kept as long as the tokens are.
    window group W                every layer's sliding K (= V) [head_dim], given back behind W
    window group 2m (CSA)         each token's compressor inputs: kv | gate+bias for both series
                                  [4 head_dim] and the indexer's [4 index_head_dim]: an entry
                                  closing at e pools tokens e - 2m + 1 .. e
    window group m' (HCA)         kv | gate+bias [2 head_dim]: an entry closing at e pools e - m' + 1 .. e
    window group of Engram's      per Engram layer, each position's normalised gated memory value
    convolution (V4.1 configs     [hc_mult x hidden]: the output at t reads t - (kernel - 1) x dilation .. t
    with engram_conv_kernel)

The compressors' partial windows are thus the last 2m (m') tokens of a window group, not a
per-request buffer: a request resumes at any page boundary whose groups still hold their windows
(what `WindowRadixCache.match` checks), so a prefix hit needs neither a snapshot nor a replay, and
chunked prefill may split a window anywhere. Groups with equal windows are one group.

Pages leave the pool as [n, 1, 1, P, 1, E] (`read_pages`): row j of a page is its token j's share,
[entry row j of each compressed buffer (zeros past ceil(P / m)) | each group's row j], so a prefix cut
at any token (PD sends the prompt's first tokens) keeps every entry those tokens closed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strata.cache.kv_pool import KVPool
from strata.dsv4_config import DSV4Config


def entry_rows(page_size: int, rate: int) -> int:
    """Rows of compressed entries per primary page (one per window that can close inside it)."""
    return -(-page_size // rate)


def entry_slots(
    page_table: torch.Tensor, ends: torch.Tensor, page_size: int, rate: int
) -> torch.Tensor:
    """Rows of the entries whose windows close at positions `ends` ([B, N], of page_table's rows)."""
    pages = page_table.gather(1, ends // page_size)
    return pages * entry_rows(page_size, rate) + (ends % page_size) // rate


class DSV4KVPool(KVPool):
    """Buffers by layer: `swa[l]` [group slots, head_dim]; `state[l]` (CSA/HCA layers) [group slots,
    width]; `entries[l]`, `index_keys[l]` (CSA only) [primary pages * rows, dim]; None where a layer
    has none; `conv[l]` (Engram layers with a convolution) [group slots, hc_mult x hidden].
    `group_of[kind]` is the window group (1-based) of "swa", "csa", "hca", "conv"."""

    def __init__(
        self,
        v4: DSV4Config,
        head_dim: int,
        num_pages: int,
        page_size: int,
        group_pages: dict[int, int],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.v4 = v4
        self.num_pages, self.page_size = num_pages, page_size
        self.num_slots = num_pages * page_size
        self.dtype, self.device = dtype, torch.device(device)
        self.windows = sorted(group_pages)
        self.group_pages = [group_pages[w] for w in self.windows]
        windows = {"swa": v4.sliding_window, **v4.state_windows}
        self.group_of = {kind: self.windows.index(w) + 1 for kind, w in windows.items()}
        widths = {"csa": 4 * head_dim + 4 * v4.index_head_dim, "hca": 2 * head_dim}
        P = page_size

        def zeros(rows: int, width: int) -> torch.Tensor:
            # zeros, not empty: padded gathers read (and mask) rows nobody wrote
            return torch.zeros((rows, width), dtype=dtype, device=device)

        def group_rows(kind: str) -> int:
            return self.group_pages[self.group_of[kind] - 1] * P

        self.swa = [zeros(group_rows("swa"), head_dim) for _ in v4.layer_kinds]
        self.state = [
            None if k == "sliding" else zeros(group_rows(k), widths[k])
            for k in v4.layer_kinds
        ]
        self.entries = [
            None
            if k == "sliding"
            else zeros(num_pages * entry_rows(P, v4.rate(k)), head_dim)
            for k in v4.layer_kinds
        ]
        self.index_keys = [
            zeros(num_pages * entry_rows(P, v4.csa_rate), v4.index_head_dim)
            if k == "csa"
            else None
            for k in v4.layer_kinds
        ]
        engram = v4.engram
        self.conv = [
            zeros(group_rows("conv"), engram.state_width)
            if engram is not None and engram.conv_kernel and layer in engram.layers
            else None
            for layer in range(len(v4.layer_kinds))
        ]
        self.page_maps: list[np.ndarray] = []

    def attach_page_maps(self, maps: Sequence[np.ndarray]) -> None:
        """The allocator's page map of each window group (`WindowGroup.to_group`), in group order."""
        if len(maps) != len(self.windows):
            raise ValueError(
                f"{len(maps)} page maps for {len(self.windows)} window groups"
            )
        self.page_maps = list(maps)

    # ------------------------------------------------------------------ whole pages

    def _buffers(self) -> list[tuple[torch.Tensor, int, int]]:
        """(buffer, group (0: primary), rows per page) of every buffer, in page-row order."""
        P = self.page_size
        out: list[tuple[torch.Tensor | None, int, int]] = []
        for layer, kind in enumerate(self.v4.layer_kinds):
            if kind != "sliding":
                out.append((self.entries[layer], 0, entry_rows(P, self.v4.rate(kind))))
            if kind == "csa":
                out.append((self.index_keys[layer], 0, entry_rows(P, self.v4.csa_rate)))
        for layer, kind in enumerate(self.v4.layer_kinds):
            out.append((self.swa[layer], self.group_of["swa"], P))
            if kind != "sliding":
                out.append((self.state[layer], self.group_of[kind], P))
            if self.conv[layer] is not None:
                out.append((self.conv[layer], self.group_of["conv"], P))
        # a sliding layer has no entries, index keys or state, and none was listed
        return [(buf, g, rows) for buf, g, rows in out if buf is not None]

    def _page_ids(self, pages: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group (primary first): each page's page there (0 where absent) and whether it is held."""
        out = [(pages, np.ones(len(pages), dtype=bool))]
        for page_map in self.page_maps:
            own = page_map[pages]
            out.append((np.where(own >= 0, own, 0), own >= 0))
        return out

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        idx = np.asarray(pages, dtype=np.int64)
        n, P = len(idx), self.page_size
        out = torch.zeros((n, P, self.row_width), dtype=self.dtype)
        groups = self._page_ids(idx)
        col = 0
        for buf, g, rows in self._buffers():
            ids, held = groups[g]
            slots = (
                (torch.from_numpy(ids).view(-1, 1) * rows + torch.arange(rows))
                .view(-1)
                .to(buf.device)
            )
            part = buf[slots].view(n, rows, -1).cpu()
            part[torch.from_numpy(~held)] = 0
            out[:, :rows, col : col + buf.shape[1]] = part
            col += buf.shape[1]
        present = (
            np.stack([held for _, held in groups[1:]], axis=1)
            if self.windows
            else np.ones((n, 0), bool)
        )
        return out.view(n, *self.page_shape), present

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        n = len(idx)
        rows_in = data.reshape(n, self.page_size, self.row_width)
        groups = self._page_ids(idx)
        col = 0
        for buf, g, rows in self._buffers():
            ids, held = groups[g]
            keep = torch.from_numpy(held)
            slots = (
                (torch.from_numpy(ids[held]).view(-1, 1) * rows + torch.arange(rows))
                .view(-1)
                .to(buf.device)
            )
            part = rows_in[keep][:, :rows, col : col + buf.shape[1]]
            buf[slots] = part.reshape(-1, buf.shape[1]).to(buf.device, buf.dtype)
            col += buf.shape[1]

    @property
    def row_width(self) -> int:
        return sum(buf.shape[1] for buf, _, _ in self._buffers())

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (1, 1, self.page_size, 1, self.row_width)

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf, _, _ in self._buffers())

    @property
    def layout(self) -> str:
        v4, engram = self.v4, self.v4.engram
        conv = (
            f";engram_conv={engram.layers},{engram.conv_span},{engram.state_width}"
            if engram is not None and engram.conv_kernel
            else ""
        )
        return (
            f"deepseek_v4;kinds={','.join(v4.layer_kinds)};head_dim={self.swa[0].shape[1]};"
            f"index_dim={v4.index_head_dim};rates={v4.csa_rate},{v4.hca_rate};window={v4.sliding_window};"
            f"dtype={self.dtype};page={self.page_size}{conv}"
        )

    def bytes_by_group(self) -> list[int]:
        per_page = [0] * (len(self.windows) + 1)
        for buf, g, rows in self._buffers():
            per_page[g] += rows * buf.shape[1] * buf.element_size()
        return per_page


@dataclass
class DSV4Plan:
    """How big the pool is: primary pages (compressed entries; every token of context) and the
    window groups' pages."""

    num_pages: int
    group_pages: dict[int, int]  # window -> pages
    reason: str
    v4: DSV4Config

    @property
    def context_pages(self) -> int:
        """Pages of context one request can hold (KVPlan's counterpart): every primary page."""
        return self.num_pages

    def describe(self) -> str:
        kinds = self.v4.layer_kinds
        parts = [
            f"{sum(k != 'sliding' for k in kinds)} compressed layers' entries ({self.num_pages} pages)"
        ]
        parts += [f"window-{w} group: {n} pages" for w, n in self.group_pages.items()]
        return "; ".join(parts)


def bytes_per_token(
    v4: DSV4Config, head_dim: int, page_size: int, itemsize: int
) -> tuple[float, dict[str, int]]:
    """(primary bytes per token of context, bytes per token of each window kind's rows)."""
    primary = 0.0
    for kind in v4.layer_kinds:
        if kind != "sliding":
            dim = head_dim + (v4.index_head_dim if kind == "csa" else 0)
            primary += entry_rows(page_size, v4.rate(kind)) * dim * itemsize / page_size
    window = {"swa": len(v4.layer_kinds) * head_dim * itemsize}
    for kind, width in (
        ("csa", 4 * head_dim + 4 * v4.index_head_dim),
        ("hca", 2 * head_dim),
    ):
        if kind in v4.layer_kinds:
            window[kind] = v4.layer_kinds.count(kind) * width * itemsize
    if "conv" in v4.state_windows:
        assert v4.engram is not None  # a convolution is Engram's
        window["conv"] = len(v4.engram.layers) * v4.engram.state_width * itemsize
    return primary, window


def context_bytes(
    v4: DSV4Config, head_dim: int, context_len: int, page_size: int, itemsize: int
) -> int:
    """State one request of context_len tokens holds: every compressed entry, plus each window's
    last tokens (rounded up to whole pages, as a running request holds them)."""
    primary, window = bytes_per_token(v4, head_dim, page_size, itemsize)
    spans = {"swa": v4.sliding_window, **v4.state_windows}
    held = 0
    for kind, per_token in window.items():
        tokens = min(context_len, (-(-spans[kind] // page_size) + 1) * page_size)
        held += tokens * per_token
    return int(primary * context_len + held)


def plan_dsv4_pool(
    v4: DSV4Config,
    head_dim: int,
    kv_dtype: torch.dtype,
    page_size: int,
    kv_cache_tokens: int | None,
    mem_fraction: float,
    total_bytes: int,
    context_len: int,
    chunk: int,
    ratio: float,
    contexts_cap: int,
) -> DSV4Plan:
    """Primary pages from --kv-cache-tokens, else from --mem-fraction-static of memory with each
    window group at `ratio` (--swa-full-tokens-ratio) pages per primary page; a group never gets
    fewer pages than one request needs at once (its window plus a prefill chunk, and a few pages)."""
    primary, window = bytes_per_token(v4, head_dim, page_size, kv_dtype.itemsize)
    if kv_cache_tokens is not None:
        num_tokens, reason = kv_cache_tokens, "--kv-cache-tokens"
    else:
        num_tokens = int(
            total_bytes * mem_fraction / (primary + ratio * sum(window.values()))
        )
        reason = (
            f"--mem-fraction-static {mem_fraction} of {total_bytes / 2**30:.1f} GiB"
        )
        if num_tokens > contexts_cap * context_len:
            num_tokens, reason = (
                contexts_cap * context_len,
                f"{contexts_cap} x the {context_len}-token context",
            )
    num_pages = max(1, num_tokens // page_size)
    spans = sorted({v4.sliding_window, *v4.state_windows.values()})
    group_pages = {}
    for w in spans:
        least = -(-(w + min(chunk, context_len)) // page_size) + 3
        group_pages[w] = min(num_pages, max(least, math.ceil(ratio * num_pages)))
    return DSV4Plan(num_pages, group_pages, reason, v4)
