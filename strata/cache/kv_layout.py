"""`KVLayout`: the ways a model's KV cache can be laid out. A family's spec declares one
(`strata.models.spec.FamilySpec.kv_layout`, re-exported there) and `strata.cache.kv_layouts` builds
the pool of each. Torch-free, as the spec is.
"""

from __future__ import annotations

import enum


class KVLayout(enum.Enum):
    """How a family's KV cache is laid out; `strata.cache.kv_layouts` builds the pool of each."""

    # K and V of every KV head per layer and slot (`MHAKVPool`); the layers with a sliding window
    # get window groups of their own (`GroupedPageAllocator`, `WindowRadixCache`) when they slide
    PAGED = "paged"
    # multi-head latent attention: one latent row per token and layer (`LatentKVPool`)
    LATENT = "latent"
    # DeepSeek-V4: compressed entries by primary page, sliding K and compressor windows in window
    # groups (`DSV4KVPool`)
    DSV4 = "dsv4"
