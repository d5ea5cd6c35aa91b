"""The KV pool of each `KVLayout` a model family declares (`strata.models.spec`), a registry by
layout: `KV_LAYOUTS[spec.kv_layout].build(...)` returns the pool and the plan that sized it, so
the engine builds any family's pool without knowing which family it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from strata.cache.dsv4_pool import DSV4KVPool, plan_dsv4_pool
from strata.cache.kv_layout import KVLayout
from strata.cache.kv_plan import KV_CONTEXTS_CAP, KVPlan, total_memory_bytes
from strata.cache.kv_pool import KVPool, LatentKVPool, MHAKVPool
from strata.config import EngineConfig
from strata.model_config import ModelConfig


@dataclass(frozen=True)
class PoolRequest:
    """What a layout needs to build a pool: the flags, the model, `plan` (from `plan_kv_pool`),
    and `pool_config`, this rank's part of the model (its KV heads) under tensor parallel."""

    cfg: EngineConfig
    model_config: ModelConfig
    pool_config: ModelConfig
    plan: KVPlan
    kv_dtype: torch.dtype
    device: torch.device
    context_len: int


@dataclass(frozen=True)
class KVLayoutBuilder:
    """`build` returns (the plan the pool was sized by, the pool); `shareable`: its window groups
    may become one shared pool (--swa-pool shared), so `plan_kv_pool` may plan one;
    `flat(model_config, num_layers, num_pages, page_size, dtype, device)`: a pool of this layout
    for `num_layers` layers that each keep every token, no window groups (a multi-token-prediction
    layer's, an embedding forward's scratch pool); None where the layout has none."""

    build: Callable[[PoolRequest], tuple[Any, KVPool]]
    flat: (
        Callable[[ModelConfig, int, int, int, torch.dtype, torch.device], KVPool] | None
    )
    shareable: bool = False


def _paged(r: PoolRequest) -> tuple[KVPlan, KVPool]:
    pool = MHAKVPool(
        r.plan.layer_windows,
        r.pool_config.num_kv_heads,
        r.model_config.head_dim,
        r.plan.num_pages,
        r.cfg.page_size,
        r.kv_dtype,
        r.device,
        group_pages=r.plan.group_pages,
        shared=r.plan.shared,
    )
    return r.plan, pool


def _paged_flat(
    mc: ModelConfig,
    num_layers: int,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    return MHAKVPool(
        num_layers, mc.num_kv_heads, mc.head_dim, num_pages, page_size, dtype, device
    )


def _latent(r: PoolRequest) -> tuple[KVPlan, KVPool]:
    """One latent row per token and layer (DeepSeek-V2/V3)."""
    mla = r.model_config.mla
    assert mla is not None, "a latent-attention family's config has its MLAConfig"
    pool = LatentKVPool(
        r.model_config.num_layers,
        mla.latent_dim,
        r.plan.num_pages,
        r.cfg.page_size,
        r.kv_dtype,
        r.device,
    )
    return r.plan, pool


def _latent_flat(
    mc: ModelConfig,
    num_layers: int,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    mla = mc.mla
    assert mla is not None, "a latent-attention family's config has its MLAConfig"
    return LatentKVPool(num_layers, mla.latent_dim, num_pages, page_size, dtype, device)


def _dsv4(r: PoolRequest) -> tuple[Any, KVPool]:
    """DeepSeek-V4: sliding K, compressor windows, compressed entries; the pool plans itself."""
    cfg, mc, v4 = r.cfg, r.model_config, r.model_config.dsv4
    assert v4 is not None, "a DeepSeek-V4 family's config has its DSV4Config"
    if cfg.swa_replay or cfg.sliding_kv != "window":
        raise ValueError(
            "--swa-replay and --sliding-kv full do not apply to DeepSeek-V4: its windows "
            "are window groups, and prefix hits resume exactly from them (strata.cache.dsv4_pool)"
        )
    chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else r.context_len
    plan = plan_dsv4_pool(
        v4,
        mc.head_dim,
        r.kv_dtype,
        cfg.page_size,
        cfg.kv_cache_tokens,
        cfg.mem_fraction_static,
        total_memory_bytes(r.device),
        r.context_len,
        chunk,
        cfg.swa_full_tokens_ratio,
        KV_CONTEXTS_CAP,
    )
    pool = DSV4KVPool(
        v4,
        mc.head_dim,
        plan.num_pages,
        cfg.page_size,
        plan.group_pages,
        r.kv_dtype,
        r.device,
    )
    return plan, pool


KV_LAYOUTS: dict[KVLayout, KVLayoutBuilder] = {
    KVLayout.PAGED: KVLayoutBuilder(_paged, _paged_flat, shareable=True),
    KVLayout.LATENT: KVLayoutBuilder(_latent, _latent_flat),
    # V4's state is its window groups: no flat pool (its MTP layers and embeddings are refused)
    KVLayout.DSV4: KVLayoutBuilder(_dsv4, None),
}
