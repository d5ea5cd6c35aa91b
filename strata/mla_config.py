"""The multi-head latent attention part of a model's config (DeepSeek-V2/V3): `MLAConfig`, read from
HF's config.json by `mla_from_hf`, and the softmax scale transformers gives it (`mla_scale`).
`strata.model_config.ModelConfig` holds one; its layers then attend through `strata.layers.mla` and keep
their KV in `strata.cache.kv_pool.LatentKVPool`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.rope_config import RopeConfig

# HF model types whose attention is MLA
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


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


def mla_from_hf(text: dict[str, Any], model_type: str) -> MLAConfig | None:
    """The MLA part of a config.json, None for a model without latent attention."""
    if text.get("kv_lora_rank") is None:
        return None
    if model_type not in _MLA_MODEL_TYPES:
        raise ValueError(
            f"multi-head latent attention of model_type {model_type!r} is not supported; supported: "
            f"{', '.join(_MLA_MODEL_TYPES)}"
        )
    return MLAConfig(
        kv_lora_rank=text["kv_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"],
        qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"],
        q_lora_rank=text.get("q_lora_rank"),
        # DeepSeek-V2 always rotates interleaved pairs (a complex product); V3 per `rope_interleave`
        rope_interleave=model_type == "deepseek_v2"
        or bool(text.get("rope_interleave", True)),
    )


def mla_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """The softmax scale: qk_head_dim ** -0.5 and, under a scaled RoPE with `mscale_all_dim`, times
    YaRN's mscale(factor, mscale_all_dim) squared (transformers' `yarn_apply_mscale`)."""
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= rope.yarn_mscale(rope.mscale_all_dim) ** 2
    return scale
