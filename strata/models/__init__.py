"""Model families: a registry from HF architecture names to our model classes (imported lazily).

Each family is one small file of plain PyTorch over `strata.layers`; a model's forward takes a
`ForwardBatch` and the KV pool and returns hidden states; `compute_logits` runs the LM head only on
the rows that are sampled.
"""

from __future__ import annotations

import importlib

# HF architecture name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "strata.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "strata.models.llama:LlamaForCausalLM",
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
