"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral (full or sliding-window attention), Qwen2
(qkv bias), Qwen3 (per-head q/k norm): the plain pre-norm decoder of `decoder.py`.

Weights load from HF names; q/k/v and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec, GGUFArch


class LlamaForCausalLM(DecoderForCausalLM):
    pass


SPEC = FamilySpec(
    name="llama",
    architectures={
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
    },
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    gguf=(
        # llama.cpp labels Mistral-style GGUFs `llama` too; it permutes their q/k rows, and stores
        # qwen2/qwen3 (ggml's NEOX rope) unpermuted
        GGUFArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True),
        GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2"),
        GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ),
)
