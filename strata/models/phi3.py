"""Phi-3 / Phi-3.5 / Phi-4-mini: a pre-norm Llama-like decoder whose checkpoint stores q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj` (gate rows first), our fused layout as it is: nothing is
fused at load. Its RoPE may be partial (`partial_rotary_factor`) and longrope-scaled ("su": short
factors below the original context, long ones past it; see `strata.layers.rope`), and a
`sliding_window` in its config applies to every layer.
"""

from __future__ import annotations

from typing import ClassVar

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec


class Phi3ForCausalLM(DecoderForCausalLM):
    # the checkpoint's qkv_proj / gate_up_proj are ours
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {}


SPEC = FamilySpec(
    name="phi3",
    architectures={"Phi3ForCausalLM": Phi3ForCausalLM},
    # older Phi-3 configs name longrope "su" or "yarn"
    model_types={
        "phi3": ConfigTraits(rope_aliases={"su": "longrope", "yarn": "longrope"})
    },
)
