"""A tiny random-weight DeepSeek-V4 made from transformers' config in a temp dir (no downloads).

Four layers: sliding, CSA, HCA, CSA (window 16, CSA m = 4 with 8 index heads and top-4, HCA m' = 16);
hash-routed experts in layer 0; two mHC streams. What transformers leaves constant (sinks, the
score-correction bias, norms, position biases) is randomised, and `tid2eid` drawn at random, so the
sink, bias and hash-routing paths are exercised."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import randomize_constants

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    hc_mult=2,
    sliding_window=16,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 16,
    },
    max_position_embeddings=1024,
    initializer_range=0.25,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)


def make_dsv4(out_dir: Path, **overrides) -> Path:
    import transformers

    config = transformers.DeepseekV4Config(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_constants(model)
    with torch.no_grad():
        model.model.hc_head.hc_scale.add_(
            0.3
        )  # one value: randomize_constants leaves it at 1
        for name, buf in model.named_buffers():
            if name.endswith(
                "tid2eid"
            ):  # zeros in transformers: every token to expert 0
                buf.copy_(torch.randint(0, config.n_routed_experts, buf.shape))
    model.save_pretrained(out_dir)
    return out_dir


def prompt(n: int, seed: int) -> list[int]:
    """n random token ids (none of the first three, the special ones)."""
    return torch.randint(
        3, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


# a V4.1-style Engram: layers 0 and 2, 2- and 3-grams, two hash heads each, 97-row tables of 8
# (`CONV` adds the demo's short convolution: 3 taps, 2 positions apart: each output reads 5 positions)
ENGRAM = dict(
    engram_layers=[0, 2],
    engram_orders=[2, 3],
    engram_heads=2,
    engram_table_size=97,
    engram_dim=8,
    engram_hash_seed=7,
    engram_vocab_map=200,
)
CONV = dict(engram_conv_kernel=3, engram_conv_dilation=2)


def add_engram(model_dir: Path, seed: int = 1, **overrides) -> Path:
    """Turn a tiny V4 checkpoint into a V4.1-style one: the `engram_*` config keys and, in
    `engram.safetensors`, random tables, projections, norms and a token-id -> compressed-id map.
    transformers' V4 model ignores all of it (tests add Engram to it with forward hooks)."""
    import json

    from safetensors.torch import save_file

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    engram = {k: v for k, v in {**ENGRAM, **overrides}.items() if v is not None}
    config.update(engram)
    config_path.write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    H, dim = config["hidden_size"], engram["engram_dim"]
    tables = len(engram["engram_orders"]) * engram["engram_heads"]
    width = tables * dim
    tensors = {}
    if "engram_vocab_map" in engram:
        tensors["model.engram_vocab_map"] = torch.randint(
            0, engram["engram_vocab_map"], (config["vocab_size"],), generator=g
        )
    for layer in engram["engram_layers"]:
        p = f"model.layers.{layer}.engram."
        tensors[p + "embedding"] = torch.randn(
            tables, engram["engram_table_size"], dim, generator=g
        )
        tensors[p + "key_proj.weight"] = torch.randn(H, width, generator=g) / width**0.5
        tensors[p + "value_proj.weight"] = (
            torch.randn(H, width, generator=g) * 0.5 / width**0.5
        )
        for norm in ("hidden_norm", "key_norm"):
            tensors[p + f"{norm}.weight"] = 1 + 0.3 * torch.randn(H, generator=g)
        kernel = engram.get("engram_conv_kernel")
        if kernel:  # the short convolution: a norm per mHC stream, depthwise taps
            streams = config["hc_mult"]
            for s in range(streams):
                tensors[p + f"short_conv.norms.{s}.weight"] = 1 + 0.3 * torch.randn(
                    H, generator=g
                )
            tensors[p + "short_conv.conv.weight"] = 0.5 * torch.randn(
                streams * H, 1, kernel, generator=g
            )
    save_file(tensors, model_dir / "engram.safetensors")
    return model_dir
