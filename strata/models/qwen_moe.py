"""Qwen2-MoE and Qwen3-MoE: the Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm) decoders with a
mixture-of-experts MLP (softmax, top-k, renormalised when `norm_topk_prob`), except in the layers
the config keeps dense (`mlp_only_layers`, `decoder_sparse_step`; see `strata.config`).

Qwen2-MoE adds an always-on shared expert scaled by sigmoid(x @ shared_expert_gate). Checkpoint
names are ours: `mlp.gate` (router), `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_expert.*`.
"""

from __future__ import annotations

import dataclasses

from strata.models.decoder import DecoderForCausalLM
from strata.models.llama import QWEN2, QWEN3
from strata.models.spec import FamilySpec
from strata.moe_config import MoETraits


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    pass


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    pass


SPEC = FamilySpec(
    name="qwen_moe",
    architectures={
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    },
    model_types={
        "qwen2_moe": dataclasses.replace(
            QWEN2, moe=MoETraits(gated_shared_expert=True)
        ),
        "qwen3_moe": dataclasses.replace(QWEN3, moe=MoETraits()),
    },
)
