"""Mixtral: the pre-norm Llama decoder with a mixture-of-experts MLP in every layer (softmax over
the experts, top-k, renormalised; `strata.layers.moe_routing.softmax_topk`).

Its checkpoint names the MLP `block_sparse_moe` and each expert's projections w1 (gate), w3 (up),
w2 (down); they load into the stacked experts of `strata.layers.moe` under our names.
"""

from __future__ import annotations

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec
from strata.moe_config import MoETraits


class MixtralForCausalLM(DecoderForCausalLM):
    RENAMES = (
        ("block_sparse_moe.", "mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )


SPEC = FamilySpec(
    name="mixtral",
    architectures={"MixtralForCausalLM": MixtralForCausalLM},
    # transformers' Mixtral always renormalises the top-k weights
    model_types={"mixtral": ConfigTraits(moe=MoETraits(norm_topk_prob=True))},
)
