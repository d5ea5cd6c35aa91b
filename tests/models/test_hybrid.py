"""Per-layer attention (sliding windows, Gemma's local/global RoPE, softcaps) and the families built
on it, exact against transformers past their windows: under chunked prefill whose chunks straddle
the window edge, page sizes 1 and 16, and prefix sharing through the radix cache."""

from __future__ import annotations

import pytest
import torch
from test_parity import hf_greedy, hf_model
from tiny_models import make_model

from strata import Engine, SamplingParams
from strata.config import ModelConfig

WINDOWED = ["mistral_sw", "qwen2_sw", "gemma2", "gemma3"]  # tiny_models.FAMILIES, window 8
WINDOW = 8
# 30 and 23 tokens: several windows long; the second shares the first's 20-token prefix
LONG_PROMPTS = [
    [(7 * i + 3) % 380 + 2 for i in range(30)],
    [(7 * i + 3) % 380 + 2 for i in range(20)] + [11, 12, 13],
]
PARAMS = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_models):
    return {
        family: [hf_greedy(hf_model(tiny_models[family]), p, PARAMS.max_new_tokens) for p in LONG_PROMPTS]
        for family in WINDOWED
    }


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize(
    "options",
    [
        # chunks of 5 and 3: chunk boundaries fall inside the window, so a chunk's early queries see
        # keys of the previous chunk and its later ones do not
        {"chunked_prefill_size": 5, "page_size": 1},
        {"chunked_prefill_size": 3, "page_size": 16},
    ],
    ids=str,
)
def test_greedy_past_the_window_equals_transformers(tiny_models, expected, family, options):
    engine = Engine(str(tiny_models[family]), dtype="float32", kv_cache_tokens=1024, **options)
    got = [r.token_ids for r in engine.generate(LONG_PROMPTS, PARAMS)]
    assert got == expected[family]
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("family", ["mistral_sw", "gemma3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_hit_past_the_window_is_exact(tiny_models, expected, family, page_size):
    """The second prompt runs after the first finished: it reuses the cached 20-token prefix (longer
    than the window) and computes only its tail."""
    engine = Engine(str(tiny_models[family]), dtype="float32", kv_cache_tokens=1024, page_size=page_size)
    first = engine.generate([LONG_PROMPTS[0]], PARAMS)[0]
    second = engine.generate([LONG_PROMPTS[1]], PARAMS)[0]
    assert second.cached_tokens == (20 // page_size) * page_size  # 20 or 16 tokens: past the window
    assert [first.token_ids, second.token_ids] == expected[family]
    engine.scheduler.check_no_leaks()


def test_windowed_model_accepts_contexts_longer_than_its_window(tiny_models):
    """The old engine capped the context at the sliding window; now it is the model's full length."""
    model_dir = tiny_models["mistral_sw"]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024)
    assert engine.scheduler.context_len == ModelConfig.from_dir(model_dir).max_position_embeddings == 512
    prompt = [(5 * i + 1) % 380 + 2 for i in range(120)]
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    got = engine.generate([prompt], params)[0].token_ids
    assert got == hf_greedy(hf_model(model_dir), prompt, params.max_new_tokens)


def test_phi3_longrope_past_the_original_length(tmp_path):
    """Prompts within original_max_position_embeddings (16) use the short factors; decode steps past
    it the long ones, exactly like transformers' forward with its KV cache. (transformers' generate
    recomputes the whole sequence with the long factors at the crossing; strata keeps the cached
    keys, see strata.layers.rope.)"""
    model_dir = make_model(
        tmp_path / "phi3",
        "phi3",
        tokenizer=False,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.3, 1.9, 2.5],
            "long_factor": [1.1, 2.0, 4.5, 7.0],
            "original_max_position_embeddings": 16,
        },
        original_max_position_embeddings=16,
    )
    ref = hf_model(model_dir)
    prompt = [(7 * i + 3) % 380 + 2 for i in range(12)]
    with torch.no_grad():  # transformers' forward, one token at a time on its KV cache
        out = ref(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(15):
            pos = torch.tensor([[len(prompt) + len(tokens) - 1]])
            out = ref(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, position_ids=pos)
            tokens.append(int(out.logits[0, -1].argmax()))
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=256)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == tokens


# ---------------------------------------------------------------------------- the spec from config.json


def _spec(**text) -> ModelConfig:
    base = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6}
    base["num_attention_heads"] = 4
    return ModelConfig.from_hf_dict({**base, **text})


def test_gemma3_hub_config_layers_and_ropes():
    """An older Gemma 3 config.json (no layer_types, no rope_parameters): one full layer in
    `sliding_window_pattern`, local theta on sliding layers, global theta + scaling on full ones."""
    cfg = _spec(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, sliding_window=512,
        sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert [s.window for s in cfg.layers] == [512, 512, None, 512, 512, None]
    local, full = cfg.layers[0].rope, cfg.layers[2].rope
    assert (local.theta, local.rope_type) == (10_000.0, "default")
    assert (full.theta, full.rope_type, full.factor) == (1_000_000.0, "linear", 8.0)
    assert cfg.layers[0].scale == 256**-0.5
    assert (cfg.norm_layout, cfg.qk_norm) == ("sandwich", "head")
    assert cfg.norm_unit_offset and cfg.scale_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings


def test_window_sources():
    mistral = _spec(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
    assert {s.window for s in mistral.layers} == {4096}
    qwen_off = _spec(model_type="qwen2", sliding_window=4096, use_sliding_window=False, max_window_layers=2)
    assert {s.window for s in qwen_off.layers} == {None}
    qwen_on = _spec(model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert [s.window for s in qwen_on.layers] == [None, None, 64, 64, 64, 64]
    gemma2 = _spec(
        model_type="gemma2", sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
    )
    assert [s.window for s in gemma2.layers] == [4096, None] * 3
    assert {s.softcap for s in gemma2.layers} == {50.0} and gemma2.final_logit_softcap == 30.0
    olmo2 = _spec(model_type="olmo2")
    assert (olmo2.norm_layout, olmo2.qk_norm) == ("post", "full")
    with pytest.raises(ValueError, match="not supported"):
        _spec(model_type="llama", sliding_window=8, layer_types=["chunked_attention"] * 6)
