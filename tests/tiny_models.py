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


def build_tokenizer(out_dir: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE trained on a few sentences, saved in HF format with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
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
    "llama_linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
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
    "qwen2_sw": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
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
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "tie_word_embeddings": True,
        },
    ),
}
# families whose RMSNorm weights are initialised to a constant (zeros for Gemma's 1 + w, ones
# elsewhere): make_model draws them at random so that a misplaced norm shows in the logits
RANDOM_NORMS = {"olmo2", "phi3", "gemma2", "gemma3"}


def make_model(out_dir: Path, family: str = "llama", *, tokenizer: bool = True, **overrides) -> Path:
    import transformers

    config_cls, extra = FAMILIES[family]
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
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in RANDOM_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir)
    if tokenizer:
        build_tokenizer(out_dir)
    return out_dir
