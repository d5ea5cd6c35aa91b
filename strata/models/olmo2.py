"""OLMo 2: norms after attention and after the MLP, none before (`norm_layout="post"`), and q/k
RMSNorm over all heads at once (`qk_norm="full"`, weights of num_heads * head_dim), applied before
the split into heads and RoPE. Checkpoint names are Llama's.
"""

from __future__ import annotations

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec


class Olmo2ForCausalLM(DecoderForCausalLM):
    pass


SPEC = FamilySpec(
    name="olmo2",
    architectures={"Olmo2ForCausalLM": Olmo2ForCausalLM},
    model_types={"olmo2": ConfigTraits(qk_norm="full", norm_layout="post")},
)
