"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral (full or sliding-window attention), Qwen2
(qkv bias), Qwen3 (per-head q/k norm): the plain pre-norm decoder of `decoder.py`.

Qwen2 and Qwen3 configs do not spell out what differs from Llama's: their traits (`QWEN2`,
`QWEN3`, also the base of Qwen2-MoE's and Qwen3-MoE's) say it.

Weights load from HF names; q/k/v and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from typing import Any

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec, GGUFArch


class LlamaForCausalLM(DecoderForCausalLM):
    pass


def qwen_layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    """An older Qwen config.json (no `layer_types`) slides from layer `max_window_layers` on."""
    first = text.get("max_window_layers", num_layers)
    return [
        "sliding_attention" if i >= first else "full_attention"
        for i in range(num_layers)
    ]


QWEN2 = ConfigTraits(qkv_bias_only=True, layer_types=qwen_layer_types)
QWEN3 = ConfigTraits(qk_norm="head", layer_types=qwen_layer_types)

SPEC = FamilySpec(
    name="llama",
    architectures={
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
    },
    model_types={
        "llama": ConfigTraits(),
        "mistral": ConfigTraits(),
        "qwen2": QWEN2,
        "qwen3": QWEN3,
    },
    gguf=(
        # llama.cpp labels Mistral-style GGUFs `llama` too; it permutes their q/k rows, and stores
        # qwen2/qwen3 (ggml's NEOX rope) unpermuted
        GGUFArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True),
        GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2"),
        GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ),
)
