"""Model families: a registry from HF architecture names to our model classes (imported lazily).

Every family is the decoder of `decoder.py` (plain PyTorch over `strata.layers`), configured by
`ModelConfig` and its per-layer `LayerSpec`s (a layer's MLP is dense or a mixture of experts,
`strata.layers.moe`; its attention is paged attention, or DeepSeek's latent attention,
`strata.layers.mla`); each family's small file says what is particular to it. A model's forward
takes a `ForwardBatch` and the KV pool and returns hidden states; `compute_logits` runs the LM head
only on the rows that are sampled.
"""

from __future__ import annotations

import importlib

# HF architecture name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "Gemma2ForCausalLM": "strata.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "strata.models.gemma:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "strata.models.phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "strata.models.olmo2:Olmo2ForCausalLM",
    "MixtralForCausalLM": "strata.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "strata.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "strata.models.qwen_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "strata.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": "strata.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "strata.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV4ForCausalLM": "strata.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    target = _REGISTRY.get(architecture)
    if target is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
