"""How big the KV pool is and how its layers are grouped (`plan_kv_pool` -> `KVPlan`), from the
engine's flags, the model's layers and the device's memory. DeepSeek-V4's pools plan themselves
(strata.cache.dsv4_pool)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from strata.cache.kv_pool import LatentKVPool, MHAKVPool
from strata.config import EngineConfig
from strata.model_config import ModelConfig

KV_CONTEXTS_CAP = 64  # default pool never exceeds this many full contexts


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class KVPlan:
    """How big the KV pool is and how its layers are grouped."""

    layer_windows: list[int | None]  # per layer: its window, None for full attention
    num_pages: int  # primary pages (the full layers'; names only, when every layer is windowed)
    group_pages: dict[
        int, int
    ]  # window -> pages of that window group ({}: one pool for all layers)
    reason: str  # where the size came from
    shared: bool = False  # every group draws from the num_pages of the primary pool (--swa-pool shared)
    window_reserve: int = (
        0  # shared: pages the window groups take beside one request's longest context
    )

    @property
    def context_pages(self) -> int:
        """Pages of context one request can hold in the full layers (all of them unless shared)."""
        return max(1, self.num_pages - self.window_reserve)

    def describe(self) -> str:
        full = sum(w is None or w not in self.group_pages for w in self.layer_windows)
        if self.shared:
            windowed = len(self.layer_windows) - full
            return (
                f"{full} layers keep every token, {windowed} window-{next(iter(self.group_pages))} layers "
                f"give back what falls out of it; one shared pool of {self.num_pages} pages"
            )
        parts = [f"{full} layers keep every token ({self.num_pages} pages)"]
        for w, n in self.group_pages.items():
            parts.append(f"{self.layer_windows.count(w)} window-{w} layers: {n} pages")
        return "; ".join(parts)


def kv_layer_bytes_per_token(mc: ModelConfig, kv_dtype: torch.dtype) -> int:
    """KV bytes one token takes in one layer of this model's pool: one latent row (MLA), else K and V
    of every KV head."""
    if mc.mla is not None:
        return LatentKVPool.bytes_per_token(1, mc.mla.latent_dim, kv_dtype)
    return MHAKVPool.bytes_per_token(1, mc.num_kv_heads, mc.head_dim, kv_dtype)


def plan_kv_pool(
    cfg: EngineConfig,
    mc: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    shareable: bool = False,
) -> KVPlan:
    """Size the pool. --kv-cache-tokens sets the primary pages (the tokens of context the full
    layers hold); otherwise --mem-fraction-static of memory is split so each window group gets
    --swa-full-tokens-ratio pages per primary page. A window group never gets fewer pages than one
    request can need at once (its window plus a prefill chunk, a few pages of slack) nor more than
    the primary pages. With --swa-pool shared (where `shareable` and the layers allow it) the same
    memory becomes one pool of pages of the full layers' size that every group draws from."""
    windows = [spec.window for spec in mc.layers]
    ps = cfg.page_size
    grouped = cfg.sliding_kv == "window" and any(w is not None for w in windows)
    layer_bytes = kv_layer_bytes_per_token(mc, kv_dtype)
    ratio = cfg.swa_full_tokens_ratio if grouped else 1.0
    windowed = sum(w is not None for w in windows) if grouped else 0
    per_token = layer_bytes * ((len(windows) - windowed) + ratio * windowed)
    if cfg.kv_cache_tokens is not None:
        num_tokens, reason = cfg.kv_cache_tokens, "--kv-cache-tokens"
    else:
        total = total_memory_bytes(device)
        num_tokens = int(total * cfg.mem_fraction_static / per_token)
        reason = f"--mem-fraction-static {cfg.mem_fraction_static} of {total / 2**30:.1f} GiB"
        cap = KV_CONTEXTS_CAP * context_len
        if (
            num_tokens > cap
        ):  # small models: more KV than 64 full contexts is memory with no use
            num_tokens, reason = (
                cap,
                f"{KV_CONTEXTS_CAP} x the {context_len}-token context (below {reason})",
            )
    num_pages = max(1, num_tokens // ps)
    group_pages = {}
    if grouped:
        chunk = (
            cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else context_len
        )
        for w in sorted({w for w in windows if w is not None}):
            least = -(-(w + min(chunk, context_len)) // ps) + 3
            group_pages[w] = min(num_pages, max(least, math.ceil(ratio * num_pages)))
    if (
        grouped
        and shareable
        and cfg.swa_pool == "shared"
        and MHAKVPool.shares_pool(windows, group_pages)
    ):
        full = len(windows) - windowed
        pages = num_pages + math.ceil(
            next(iter(group_pages.values())) * windowed / full
        )  # the same bytes
        (w,) = group_pages
        reserve = -(-windowed // full) * (
            -(-(w + min(chunk, context_len)) // ps) + 1
        )  # a window + chunk per group
        return KVPlan(
            windows,
            pages,
            {w: pages},
            reason,
            shared=True,
            window_reserve=min(reserve, pages - 1),
        )
    return KVPlan(windows, num_pages, group_pages, reason)
