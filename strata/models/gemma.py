"""Gemma 2 and Gemma 3 (text): the decoder of `decoder.py` in its Gemma settings, read from the
config as their traits say (`GEMMA2`, `GEMMA3`, for what the config does not spell out):

- sandwich norms (before and after attention, before and after the MLP), RMSNorm scaling by
  (1 + weight) in float32, embeddings times sqrt(hidden_size);
- sliding-window and full-attention layers per `layer_types` (Gemma 2 alternates; Gemma 3 has one
  full layer in six), scores scaled by query_pre_attn_scalar**-0.5, GeGLU (tanh GELU) MLP;
- Gemma 2: attention logits and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: per-head q/k norm, and its own RoPE per layer kind (rope_local_base_freq on sliding
  layers, the global theta with its scaling on full ones).

The LM head is tied to the embeddings. Checkpoint names are Llama's. llama.cpp's `gemma3` GGUFs
convert back as `SPEC.gguf` says (norms stored plus 1, its norm names, the settings the file leaves
to llama.cpp's runtime: `gguf_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec, GGUFArch


class Gemma2ForCausalLM(DecoderForCausalLM):
    pass


class Gemma3ForCausalLM(DecoderForCausalLM):
    pass


def gemma2_layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    """An older Gemma 2 config.json (no `layer_types`): sliding and full layers alternate, sliding
    first."""
    return [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(num_layers)
    ]


def gemma3_layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    """An older Gemma 3 config.json: a full layer every `sliding_window_pattern` (6), else sliding."""
    pattern = text.get("sliding_window_pattern", 6)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


# sandwich norms scaling by (1 + weight), embeddings times sqrt(hidden_size), tied LM head unless
# the config says otherwise, the MLP's activation in `hidden_activation`
_GEMMA = ConfigTraits(
    norm_layout="sandwich",
    norm_unit_offset=True,
    scale_embeddings=True,
    tied_embeddings=True,
    hidden_activation=True,
)
GEMMA2 = dataclasses.replace(_GEMMA, layer_types=gemma2_layer_types)
GEMMA3 = dataclasses.replace(
    _GEMMA, qk_norm="head", local_rope=True, layer_types=gemma3_layer_types
)


def _f32(value: float) -> float:
    """A float stored as float32 in GGUF, as its shortest decimal."""
    return float(str(np.float32(value)))


def gguf_config(config: dict[str, Any], meta: Callable[..., Any]) -> None:
    """Gemma 3's settings in a GGUF's config.json. The file states the window and the global RoPE
    base; the rest llama.cpp's runtime fixes for the architecture (llama-model.cpp, LLM_ARCH_GEMMA3),
    and so do we: a full-attention layer every 6th (`set_swa_pattern(6)`), RoPE base 10000 without
    scaling on sliding layers, scores scaled by head_dim**-0.5 except on the 62-layer 27B model
    (hidden / heads, as gemma_pytorch), no softcaps, GELU (tanh)."""
    num_layers = config["num_hidden_layers"]
    pattern = meta(
        "attention.sliding_window_pattern", 6
    )  # a period, or per layer True = sliding
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or (i + 1) % pattern != 0 for i in range(num_layers)]
    window = meta("attention.sliding_window")
    if window is None:
        raise ValueError(
            "gemma3.attention.sliding_window is missing (llama.cpp requires it)"
        )
    local_theta = _f32(meta("rope.freq_base_swa", 10000.0))
    per_head = config["hidden_size"] // config["num_attention_heads"]
    config.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",  # what transformers' Gemma 3 reads
        sliding_window=int(window),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        query_pre_attn_scalar=per_head if num_layers == 62 else config["head_dim"],
        attn_logit_softcapping=meta("attn_logit_softcapping"),
        final_logit_softcapping=meta("final_logit_softcapping"),
        # transformers 5 reads a RoPE per layer kind; older readers rope_theta + rope_local_base_freq
        rope_local_base_freq=local_theta,
        rope_parameters={
            "full_attention": config[
                "rope_parameters"
            ],  # the global base, with its scaling if any
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
    )


SPEC = FamilySpec(
    name="gemma",
    architectures={
        "Gemma2ForCausalLM": Gemma2ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
    },
    model_types={"gemma2": GEMMA2, "gemma3_text": GEMMA3},
    gguf=(
        GGUFArch(
            "gemma3",
            "Gemma3ForCausalLM",
            "gemma3_text",
            # llama.cpp stores every norm weight plus 1 (`norm_shift` in convert_hf_to_gguf.py)
            norm_offset=True,
            # four norms per layer: llama.cpp's `ffn_norm` is the norm before the MLP, which HF
            # Gemma names pre_feedforward_layernorm; HF's post_attention_layernorm is the norm
            # after attention (Llama uses that name for the pre-MLP norm)
            layer_tensor_names={
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            # by name: otherwise transformers parses the whole file a second time to pick the
            # class (~30 s for Gemma's 262k vocabulary)
            named_tokenizer=True,
            # Gemma's chat turns end with <end_of_turn>; its HF generation_config.json lists it too
            end_of_turn_tokens=("<end_of_turn>",),
            config=gguf_config,
        ),
    ),
)
