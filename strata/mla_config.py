"""The multi-head latent attention part of a model's config (DeepSeek-V2/V3): `MLAConfig`, read from
HF's config.json by `mla_from_hf` (told what the file does not say by the family's `MLATraits`), and
the softmax scale transformers gives it (`mla_scale`). `strata.model_config.ModelConfig` holds one;
its layers then attend through `strata.layers.mla` and keep their KV in
`strata.cache.kv_pool.LatentKVPool`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.rope_config import RopeConfig


@dataclass(frozen=True)
class MLAConfig:
    """Each head's query and key are [nope | rope] parts; keys and values come from one per-token latent.

    q: hidden -> (q_proj, or q_a_proj -> norm -> q_b_proj) -> per head [qk_nope_head_dim | qk_rope_head_dim]
    latent: hidden -> kv_a_proj_with_mqa -> [kv_lora_rank (normalised) | qk_rope_head_dim (roped, one
    for all heads)]; kv_b_proj: kv_lora_rank -> per head [key nope part | value (v_head_dim)]."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = (
        None  # queries through a low-rank bottleneck of this size; None: one q_proj
    )
    rope_interleave: bool = (
        True  # RoPE pairs (x0, x1), (x2, x3), ... (DeepSeek's layout); False: halves
    )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values a token keeps per layer in the KV cache (every head reads the same row)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLATraits:
    """How a family with latent attention spells it where config.json does not say: declared in the
    family's file (`strata.models`), read by `mla_from_hf`."""

    # RoPE pairs are interleaved whatever config.json's `rope_interleave` says (DeepSeek-V2's
    # complex product); False: as `rope_interleave` says, interleaved when absent (DeepSeek-V3)
    always_interleaved: bool = False


def mla_from_hf(text: dict[str, Any], traits: MLATraits | None) -> MLAConfig | None:
    """The MLA part of a config.json, None for a model without latent attention; `traits` are the
    family's (None: it has no latent attention)."""
    if text.get("kv_lora_rank") is None:
        return None
    if traits is None:
        raise ValueError(
            "config.json sets kv_lora_rank (multi-head latent attention), but its model family "
            "has no latent attention in Strata; check the config's model_type"
        )
    return MLAConfig(
        kv_lora_rank=text["kv_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"],
        qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"],
        q_lora_rank=text.get("q_lora_rank"),
        rope_interleave=traits.always_interleaved
        or bool(text.get("rope_interleave", True)),
    )


def mla_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """The softmax scale: qk_head_dim ** -0.5 and, under a scaled RoPE with `mscale_all_dim`, times
    YaRN's mscale(factor, mscale_all_dim) squared (transformers' `yarn_apply_mscale`)."""
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= rope.yarn_mscale(rope.mscale_all_dim) ** 2
    return scale
