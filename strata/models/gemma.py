"""Gemma 2 and Gemma 3 (text): the decoder of `decoder.py` in its Gemma settings, all read from the
config by `ModelConfig.from_hf_dict`:

- sandwich norms (before and after attention, before and after the MLP), RMSNorm scaling by
  (1 + weight) in float32, embeddings times sqrt(hidden_size);
- sliding-window and full-attention layers per `layer_types` (Gemma 2 alternates; Gemma 3 has one
  full layer in six), scores scaled by query_pre_attn_scalar**-0.5, GeGLU (tanh GELU) MLP;
- Gemma 2: attention logits and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: per-head q/k norm, and its own RoPE per layer kind (rope_local_base_freq on sliding
  layers, the global theta with its scaling on full ones).

The LM head is tied to the embeddings. Checkpoint names are Llama's.
"""

from __future__ import annotations

from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec


class Gemma2ForCausalLM(DecoderForCausalLM):
    pass


class Gemma3ForCausalLM(DecoderForCausalLM):
    pass


SPEC = FamilySpec(
    name="gemma",
    architectures={
        "Gemma2ForCausalLM": Gemma2ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
    },
    model_types=("gemma2", "gemma3_text"),
)
