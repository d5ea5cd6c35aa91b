"""Ministral (Ministral 8B): the pre-norm Llama decoder with no q/k/v bias, whose config lists per
layer whether it slides (`layer_types`: sliding-window or full attention over `sliding_window`).
`ModelConfig` reads all of it as it reads Llama's and Mistral's; checkpoint names are Llama's.
"""

from __future__ import annotations

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec


class MinistralForCausalLM(DecoderForCausalLM):
    pass


SPEC = FamilySpec(
    name="ministral",
    architectures={"MinistralForCausalLM": MinistralForCausalLM},
    model_types={"ministral": ConfigTraits()},
)
