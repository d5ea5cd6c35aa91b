"""The DeepSeek-V4 part of a model's config: `DSV4Config`, read from HF's config.json (model type
`deepseek_v4`) by `dsv4_from_hf`. `strata.model_config.ModelConfig` holds one; its layers are then
`strata.models.deepseek_v4`'s and keep their state in `strata.cache.dsv4_pool.DSV4KVPool`.

Per layer (`layer_kinds`):
  sliding  attends to its last `sliding_window` tokens only
  csa      also to compressed entries, one per `csa_rate` tokens pooled over two overlapping windows,
           of which the lightning indexer keeps `index_topk` per query
  hca      also to every compressed entry, one per `hca_rate` tokens

V4.1-style configs may add Engram layers (`engram`, `strata.engram_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.engram_config import EngramConfig, engram_from_hf
from strata.rope_config import RopeConfig

LAYER_KINDS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class DSV4Config:
    layer_kinds: tuple[str, ...]  # per layer: sliding | csa | hca
    hash_layers: tuple[
        bool, ...
    ]  # per layer: experts chosen by token id (`tid2eid`), not by score
    sliding_window: int
    csa_rate: int  # m: tokens per CSA entry (each entry pools 2m tokens: two overlapping series)
    hca_rate: int  # m': tokens per HCA entry
    rope_head_dim: int  # the last rope_head_dim values of each head are rotated (interleaved pairs)
    compress_rope: RopeConfig  # of CSA/HCA layers, their compressors and the indexer
    q_lora_rank: int
    o_groups: int  # grouped output projection: heads in o_groups groups ...
    o_lora_rank: (
        int  # ... each projected to o_lora_rank values before o_b_proj mixes them
    )
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int  # mHC: residual streams per token
    hc_sinkhorn_iters: int
    hc_eps: float
    scoring_func: str  # router scores: sqrtsoftplus | sigmoid | softmax
    swiglu_limit: float  # experts' (and the shared expert's) gate clamped above, up to [-limit, limit]
    # V4.1's conditional memory (`engram_*` keys); None: no Engram layers
    engram: EngramConfig | None = None

    def rate(self, kind: str) -> int:
        return self.csa_rate if kind == "csa" else self.hca_rate

    @property
    def state_windows(self) -> dict[str, int]:
        """Tokens back each compressor reads when it closes an entry: CSA 2m (its two series), HCA m';
        and Engram's convolution (`conv`), the positions one of its outputs reads."""
        kinds = set(self.layer_kinds)
        out = {}
        if "csa" in kinds:
            out["csa"] = 2 * self.csa_rate
        if "hca" in kinds:
            out["hca"] = self.hca_rate
        if self.engram is not None and self.engram.conv_kernel:
            out["conv"] = self.engram.conv_span
        return out


def dsv4_from_hf(text: dict[str, Any], compress_rope: RopeConfig) -> DSV4Config:
    """The V4 fields of a `deepseek_v4` config.json (as transformers' DeepseekV4Config writes it)."""
    n = text["num_hidden_layers"]
    kinds = text.get("layer_types")
    if kinds is None:  # transformers' default: 2 HCA layers, then CSA / HCA alternating
        kinds = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))
        ]
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown or len(kinds) != n:
        raise ValueError(
            f"DeepSeek-V4 layer_types must be {n} of {sorted(LAYER_KINDS)}; got {kinds}"
        )
    mlp = text.get("mlp_layer_types") or ["hash_moe"] * min(n, 3) + ["moe"] * max(
        0, n - 3
    )
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update(text.get("compress_rates") or {})
    head_dim = text["head_dim"]
    partial = text.get("partial_rotary_factor") or 64 / 512
    scoring = text.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ValueError(
            f"DeepSeek-V4 scoring_func {scoring!r} is not supported; supported: {SCORING_FUNCS}"
        )
    if text.get("num_key_value_heads", 1) != 1:
        raise ValueError(
            "DeepSeek-V4 attention has one KV head (K = V); num_key_value_heads must be 1"
        )
    return DSV4Config(
        layer_kinds=tuple(LAYER_KINDS[k] for k in kinds),
        hash_layers=tuple(k == "hash_moe" for k in mlp[:n]),
        sliding_window=text["sliding_window"],
        csa_rate=rates["compressed_sparse_attention"],
        hca_rate=rates["heavily_compressed_attention"],
        rope_head_dim=int(head_dim * partial),
        compress_rope=compress_rope,
        q_lora_rank=text["q_lora_rank"],
        o_groups=text["o_groups"],
        o_lora_rank=text["o_lora_rank"],
        index_n_heads=text["index_n_heads"],
        index_head_dim=text["index_head_dim"],
        index_topk=text["index_topk"],
        hc_mult=text["hc_mult"],
        hc_sinkhorn_iters=text["hc_sinkhorn_iters"],
        hc_eps=float(text["hc_eps"]),
        scoring_func=scoring,
        swiglu_limit=float(text["swiglu_limit"]),
        engram=engram_from_hf(text, n),
    )
