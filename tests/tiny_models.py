"""Tiny random-weight models made from transformers configs in a temp dir (no downloads).

Import it as `from tiny_models import make_model` (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests.",
    "Paged attention keeps the KV cache in fixed-size pages.",
    "Radix trees share prefixes between requests; schedulers batch them.",
    "Numbers 0123456789 and punctuation: ,.;:!?()[]{}",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Hermes/Qwen-style tool calling: the tools in a system turn, calls as <tool_call>{json}</tool_call>,
# results in <tool_response> blocks
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}"
    '</tools>\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{%- elif m['tool_calls'] %}<|im_start|>assistant\n{%- for c in m['tool_calls'] %}\n<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(
    out_dir: Path, vocab_size: int = 320, chat_template: str = CHAT_TEMPLATE
) -> None:
    """A byte-level BPE trained on a few sentences, saved in HF format with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)


FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama_tied_llama3": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_linear": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "linear",
                "rope_theta": 10000.0,
                "factor": 2.0,
            }
        },
    ),
    "llama_yarn": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", {}),
    # partial rotary (8 of 16 dims) with longrope; the parity prompts and their generations stay below
    # original_max_position_embeddings (tests/models/test_hybrid.py crosses it)
    "phi3": (
        "Phi3Config",
        {
            "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.3, 1.9, 2.5],
                "long_factor": [1.1, 2.0, 4.5, 7.0],
                "original_max_position_embeddings": 64,
            },
            "original_max_position_embeddings": 64,
        },
    ),
    # hybrid attention with tiny windows, so that the parity prompts (up to 41 tokens) and their
    # generations run past them
    "mistral_sw": ("MistralConfig", {"sliding_window": 8}),
    # a sliding layer, then a full one, as its config's layer_types say
    "ministral": (
        "MinistralConfig",
        {
            "head_dim": 16,  # transformers' MinistralConfig leaves it None
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen2_sw": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 20.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 16,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1_000_000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "tie_word_embeddings": True,
        },
    ),
}
# mixture-of-experts families (tests/models/test_moe.py), apart from FAMILIES so that the dense
# parity suite does not build them: experts small enough that every prompt routes unevenly
MOE_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # layer 1 dense (mlp_only_layers), the others 8 experts top-2 unrenormalised + a gated shared expert
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
    ),
    # layers 1 and 3 sparse (decoder_sparse_step 2), top-3 renormalised
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
        },
    ),
    # sinks, q/k/v/o biases, window 8 then full, YaRN; experts with biases and a clamped SwiGLU whose
    # limit the tiny activations reach
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "swiglu_limit": 3.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,  # max_position_embeddings / original_max_position_embeddings
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
        },
    ),
}
# multi-head latent attention families (tests/models/test_mla.py): DeepSeek-V2/V3 with 8 experts
# top-2 and one shared expert after `first_k_dense_replace` dense layers; latent 32 + rope 8, heads
# of 16 + 8 (q/k) and 16 (v). num_key_value_heads must equal the heads: transformers' eager MLA
# repeats the expanded keys by heads // num_key_value_heads
_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}
MLA_FAMILIES = {
    # q_proj (no q_lora_rank), softmax greedy routing; YaRN whose mscale / mscale_all_dim differ, so
    # both the rotary attention factor and the softmax scale's mscale_all_dim ** 2 show
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            **_MLA,
            "q_lora_rank": None,
            "rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
        },
    ),
    # q through q_lora_rank, group-limited greedy (best 2 of 4 groups), biased projections, 3 layers
    "deepseek_v2_lora": (
        "DeepseekV2Config",
        {
            **_MLA,
            "num_hidden_layers": 3,
            "q_lora_rank": 24,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "attention_bias": True,
            "mlp_bias": True,
            "routed_scaling_factor": 1.5,
        },
    ),
    # sigmoid + correction bias, group-limited top-k, renormalised, x2.5; YaRN as DeepSeek-V3 ships it
    # (mscale = mscale_all_dim = 1: only the softmax scale changes); interleaved RoPE
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_MLA,
            "q_lora_rank": 24,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        },
    ),
    # RoPE in halves (rope_interleave False), q_proj, one group, every layer sparse
    "deepseek_v3_halves": (
        "DeepseekV3Config",
        {
            **_MLA,
            "q_lora_rank": None,
            "rope_interleave": False,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
        },
    ),
}
# families whose RMSNorm weights are initialised to a constant (zeros for Gemma's 1 + w, ones
# elsewhere): make_model draws them at random so that a misplaced norm shows in the logits
RANDOM_NORMS = {"olmo2", "phi3", "gemma2", "gemma3"}


def randomize_constants(model, scale: float = 0.3) -> None:
    """Add noise to every parameter and persistent buffer that transformers initialises to one
    constant (zero biases, unit norms, DeepSeek's correction bias), so that a weight loaded into
    the wrong place, or not at all, shows in the logits."""
    persistent = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for t in persistent.values():
            if (
                t.is_floating_point()
                and t.numel() > 1
                and bool((t == t.reshape(-1)[0]).all())
            ):
                t.add_(torch.randn_like(t) * scale)


def constant_tensors(model_dir: Path) -> list[str]:
    """The floating-point tensors of a saved checkpoint whose values are all one number (what
    `randomize_constants` leaves none of)."""
    from safetensors.torch import load_file

    found = []
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, t in load_file(path).items():
            if t.is_floating_point() and bool((t == t.reshape(-1)[0]).all()):
                found.append(name)
    return found


def tiny_config(family: str = "llama", **overrides):
    """The transformers config of the tiny `family` model (what `make_model` saves)."""
    import transformers

    config_cls, extra = {**FAMILIES, **MOE_FAMILIES, **MLA_FAMILIES}[family]
    kwargs = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,  # peaky logits: greedy choices are not near-ties
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    return getattr(transformers, config_cls)(**kwargs)


def make_model(
    out_dir: Path,
    family: str = "llama",
    *,
    tokenizer: bool = True,
    chat_template: str = CHAT_TEMPLATE,
    **overrides,
) -> Path:
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in RANDOM_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.3)
    if family in MOE_FAMILIES or family in MLA_FAMILIES:
        randomize_constants(model)
    model.save_pretrained(out_dir)
    if tokenizer:
        build_tokenizer(out_dir, chat_template=chat_template)
    return out_dir
