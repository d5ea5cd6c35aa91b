"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral (full or sliding-window attention), Qwen2
(qkv bias), Qwen3 (per-head q/k norm): the plain pre-norm decoder of `decoder.py`.

Weights load from HF names; q/k/v and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from strata.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
