"""Multi-head latent attention (DeepSeek-V2/V3) exact against transformers (fp32): logits of batched
prefills and decodes in both of MLA's forms (absorbed, decompressed) at page sizes 1 and 16,
greedy tokens under chunked prefill and through radix hits; the latent pool holds one
kv_lora_rank + qk_rope_head_dim row per token and layer (the very latent transformers caches), and
its pages move through HiCache's tiers and PD transfers unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from test_disagg import pd_tokens
from test_hicache import GREEDY as TIER_GREEDY  # what run_one generates
from test_hicache import LONG, through_the_tiers
from test_parity import PROMPTS, forward_logits, hf_greedy, hf_model
from tiny_models import MLA_FAMILIES, constant_tensors, make_model

from strata import Engine, SamplingParams
from strata.cache.kv_plan import plan_kv_pool
from strata.cache.kv_pool import LatentKVPool, MHAKVPool
from strata.config import EngineConfig
from strata.engine.request import Req
from strata.layers.mla import deinterleave
from strata.mla_config import MLAConfig
from strata.models import config_from_dir, config_from_hf

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SHARED = PROMPTS[2][:32] + [7, 8, 9]  # shares a 32-token prefix with PROMPTS[2]
LATENT_DIM = 32 + 8  # tiny_models' kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_models")
    return {
        family: make_model(root / family, family, tokenizer=False)
        for family in MLA_FAMILIES
    }


def test_tiny_checkpoints_hold_no_constant_tensor(mla_models):
    """DeepSeek-V3's e_score_correction_bias (zeros in transformers), biases and norms are drawn at
    random, so a correction bias or norm that is loaded wrongly or not at all shows in the logits."""
    assert {family: constant_tensors(d) for family, d in mla_models.items()} == {
        family: [] for family in mla_models
    }


@pytest.fixture(scope="module")
def expected(mla_models):
    """transformers' greedy tokens for PROMPTS and for a prompt sharing PROMPTS[2]'s first 32 tokens."""
    out = {}
    for family, model_dir in mla_models.items():
        ref = hf_model(model_dir)
        out[family] = [
            hf_greedy(ref, p, GREEDY.max_new_tokens) for p in [*PROMPTS, SHARED]
        ]
    return out


def mla_engine(model_dir, prefill_form: str = "auto", **options) -> Engine:
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024, **options)
    for layer in engine.model.layers:
        layer.self_attn.prefill_form = prefill_form
    return engine


def prefill_then_decode_logits(
    engine: Engine, ref=None, steps: int = 3
) -> torch.Tensor:
    """Logits of a batched prefill of PROMPTS, then `steps` batched decodes of fixed tokens; each
    step checked against transformers (`ref`) within 1e-4 when given."""
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    seqs = [list(p) for p in PROMPTS]
    out = [forward_logits(engine, reqs, [len(p) for p in PROMPTS], num_decode=0)]
    if ref is not None:
        with torch.no_grad():
            want = torch.cat([ref(torch.tensor([s])).logits[0] for s in seqs])
        torch.testing.assert_close(out[-1], want, atol=1e-4, rtol=0)
    for step in range(steps):
        for i, (req, s) in enumerate(zip(reqs, seqs)):
            req.output_ids.append(11 + 7 * i + step)
            s.append(11 + 7 * i + step)
        out.append(forward_logits(engine, reqs, [1] * len(reqs), num_decode=len(reqs)))
        if ref is not None:
            with torch.no_grad():
                want = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])
            torch.testing.assert_close(out[-1], want, atol=1e-4, rtol=0)
    return torch.cat(out).float()


def test_config_reads_the_latent_attention(mla_models):
    v2 = config_from_dir(mla_models["deepseek_v2"])
    assert v2.mla == MLAConfig(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    )
    assert v2.head_dim == 8  # the rotary part of a head, as transformers sets it
    mscale_all_dim = 0.1 * 0.8 * math.log(4.0) + 1  # YaRN factor 4, mscale_all_dim 0.8
    assert v2.layers[0].scale == pytest.approx(24**-0.5 * mscale_all_dim**2)
    assert ([s.moe for s in v2.layers], v2.moe.routing) == (
        [False, True],
        "softmax_greedy",
    )
    lora = config_from_dir(mla_models["deepseek_v2_lora"])
    assert (lora.mla.q_lora_rank, lora.moe.routing) == (
        24,
        "softmax_group_limited_greedy",
    )
    assert [s.moe for s in lora.layers] == [False, True, True]
    assert lora.layers[0].scale == pytest.approx(24**-0.5)  # default RoPE: no mscale
    v3 = config_from_dir(mla_models["deepseek_v3"])
    assert (
        v3.moe.routing,
        v3.moe.correction_bias,
        v3.moe.num_groups,
        v3.moe.topk_groups,
    ) == ("sigmoid_group_topk", True, 4, 2)
    assert (
        v3.mla.rope_interleave
        and not config_from_dir(mla_models["deepseek_v3_halves"]).mla.rope_interleave
    )


# DeepSeek-V3 as published (config.json fields that matter here): no head_dim, old-style rope_scaling
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}


def test_published_deepseek_v3_config_and_its_kv_bytes_per_token():
    """The hub's config.json: RoPE over the 64 rope dims, the YaRN softmax scale, and a KV cache of
    61 x 576 values per token (70,272 bytes in bf16; MHA K/V of the same heads would be ~71x that),
    which is what sizing the pool from memory divides by."""
    mc = config_from_hf(DEEPSEEK_V3)
    assert (mc.head_dim, mc.layers[0].rope.rope_type, mc.mla.latent_dim) == (
        64,
        "yarn",
        576,
    )
    assert mc.layers[0].scale == pytest.approx(
        192**-0.5 * (0.1 * math.log(40) + 1) ** 2
    )
    assert [s.moe for s in mc.layers[:4]] == [False, False, False, True]
    latent = LatentKVPool.bytes_per_token(61, 576, torch.bfloat16)
    mha = 61 * 128 * (192 + 128) * 2  # per-head K (nope + rope) and V, bf16
    assert (latent, mha, mha // latent) == (70_272, 4_997_120, 71)
    plan = plan_kv_pool(
        EngineConfig(mem_fraction_static=0.5, page_size=16),
        mc,
        torch.bfloat16,
        torch.device("cpu"),
        context_len=1 << 20,
    )
    from strata.cache.kv_plan import total_memory_bytes

    assert (
        plan.num_pages
        == int(total_memory_bytes(torch.device("cpu")) * 0.5 / latent) // 16
    )


@pytest.mark.parametrize("family", list(MLA_FAMILIES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_and_decode_logits_match(mla_models, family, page_size):
    prefill_then_decode_logits(
        mla_engine(mla_models[family], page_size=page_size),
        hf_model(mla_models[family]),
    )


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_both_prefill_forms_match(mla_models, family, form):
    """Extends attend over the cached latents (absorbed) or over per-head K/V expanded from them
    (decompressed); `auto` picks per step, so each is forced here."""
    engine = mla_engine(mla_models[family], form, page_size=4)
    prefill_then_decode_logits(engine, hf_model(mla_models[family]))


def test_pytorch_path_matches_the_kernels(mla_models):
    """Decode attention over the latent rows without the native kernels (GPUs, no compiler)."""
    from strata import kernels

    model_dir = mla_models["deepseek_v3"]
    with kernels.disabled():
        plain = prefill_then_decode_logits(
            mla_engine(model_dir, "absorbed", page_size=4)
        )
    fast = prefill_then_decode_logits(mla_engine(model_dir, "absorbed", page_size=4))
    torch.testing.assert_close(plain, fast, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(MLA_FAMILIES))
def test_greedy_tokens_under_chunked_prefill(mla_models, expected, family):
    engine = mla_engine(mla_models[family], chunked_prefill_size=5)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected[family][
        : len(PROMPTS)
    ]
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_hit_is_exact(mla_models, expected, family, page_size):
    """A request sharing a 32-token prefix reads its latents from the cache and computes only its tail."""
    engine = mla_engine(mla_models[family], page_size=page_size)
    first = engine.generate([PROMPTS[2]], GREEDY)[0]
    second = engine.generate([SHARED], GREEDY)[0]
    assert second.cached_tokens == 32
    assert [first.token_ids, second.token_ids] == [
        expected[family][2],
        expected[family][-1],
    ]
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_pool_holds_one_row_per_token_and_layer(mla_models, family):
    """Per layer the pool is [slots, 1, kv_lora_rank + qk_rope_head_dim], and after a prefill a
    token's row is exactly what transformers caches for it: the normalised latent and the roped key
    (V2's rotation keeps its pairs interleaved; ours are in halves, a permutation both sides share)."""
    model_dir = mla_models[family]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=64, page_size=4)
    pool = engine.scheduler.runner.kv
    layers = engine.state.model_config.num_layers
    assert isinstance(pool, LatentKVPool)
    assert [tuple(t.shape) for t in pool.latent] == [(64, 1, LATENT_DIM)] * layers
    assert pool.page_shape == (layers, 1, 4, 1, LATENT_DIM)
    assert engine.state.kv_bytes == 64 * layers * LATENT_DIM * 4
    prompt = PROMPTS[0]
    req = Req(rid="0", prompt_ids=list(prompt), params=SamplingParams())
    forward_logits(engine, [req], [len(prompt)], num_decode=0)
    slots = pool.slots_of_pages(req.pages)[: len(prompt)]
    with torch.no_grad():
        cache = hf_model(model_dir)(
            torch.tensor([prompt]), use_cache=True
        ).past_key_values
    for layer in range(layers):
        latent, k_pe = (
            cache.layers[layer].keys[0, 0],
            cache.layers[layer].values[0, 0],
        )  # [S, 32], [S, 8]
        if family == "deepseek_v2":
            k_pe = deinterleave(k_pe)
        ours = pool.latent[layer][slots, 0].cpu()  # the oracle runs on the CPU
        torch.testing.assert_close(
            ours, torch.cat([latent, k_pe], -1), atol=1e-5, rtol=0
        )


def test_latent_pages_round_trip():
    pool = LatentKVPool(
        3,
        LATENT_DIM,
        num_pages=6,
        page_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for t in pool.latent:
        t.copy_(torch.randn_like(t))
    data, present = pool.read_pages([4, 1])
    assert data.shape == (2, *pool.page_shape) and present.shape == (2, 0)
    assert torch.equal(data[0, 2, 0, :, 0], pool.latent[2][16:20, 0])
    other = LatentKVPool(
        3,
        LATENT_DIM,
        num_pages=6,
        page_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    other.write_pages([0, 5], data)
    assert torch.equal(other.read_pages([0, 5])[0], data)
    assert pool.page_bytes == 3 * 4 * LATENT_DIM * 4 == pool.bytes_by_group()[0]
    assert pool.page_bytes * 6 == pool.nbytes
    mha = MHAKVPool(
        3,
        2,
        8,
        num_pages=6,
        page_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert mha.page_bytes == 3 * 2 * 4 * 2 * 8 * 4 and mha.layout != pool.layout


def test_latent_pages_through_every_tier(mla_models, tmp_path):
    """Latent pages demoted to L2, promoted back, and restored from L3 by a restarted engine give the
    answers of a plain engine."""
    model = mla_models["deepseek_v3"]
    prompt = LONG + [1, 2, 3]
    plain = Engine(
        str(model),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=4,
        disable_radix_cache=True,
    )
    want = plain.generate([prompt], TIER_GREEDY)[0].token_ids
    through_the_tiers(model, prompt, want, str(tmp_path / "l3"))


def test_prefill_then_decode_sends_the_latent(mla_models, expected):
    """PD: the prefill worker sends each prompt's latent rows; the decode worker continues exactly."""
    model = mla_models["deepseek_v2"]
    workers = [
        Engine(
            str(model),
            dtype="float32",
            kv_cache_tokens=512,
            page_size=4,
            disaggregation_mode=mode,
            disaggregation_secret="s3cret",
        )
        for mode in ("prefill", "decode")
    ]
    p, d = workers
    assert (
        pd_tokens(p, d, PROMPTS, GREEDY, 3000)
        == expected["deepseek_v2"][: len(PROMPTS)]
    )
    assert (
        d.disagg.stats["bytes_received"]
        == sum(len(q) for q in PROMPTS) * 2 * LATENT_DIM * 4
    )  # 2 layers, fp32
    for w in workers:
        w.scheduler.check_no_leaks()
        w.close()


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(mla_models):
    """bf16 through the absorbed and decompressed forms strays from fp32 no more than transformers'
    bf16 model strays from its fp32 one."""
    from transformers import AutoModelForCausalLM

    model_dir = mla_models["deepseek_v3"]
    ours, theirs = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(str(model_dir), dtype=dtype, kv_cache_tokens=1024)
        ours[dtype] = prefill_then_decode_logits(engine, steps=0)
        ref = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).eval()
        with torch.no_grad():
            theirs[dtype] = torch.cat(
                [ref(torch.tensor([p])).logits[0].float() for p in PROMPTS]
            )
    our_err = (ours["bfloat16"] - ours["float32"]).abs()
    their_err = (theirs["bfloat16"] - theirs["float32"]).abs()
    assert our_err.max() <= 1.5 * their_err.max() + 0.02, (
        our_err.max(),
        their_err.max(),
    )
    assert our_err.mean() <= 1.2 * their_err.mean() + 1e-3, (
        our_err.mean(),
        their_err.mean(),
    )


def test_int8_weights_keep_the_latent_up_projection_float(mla_models):
    """--quantization int8 quantizes the MLA projections that are plain linears; kv_b_proj, whose
    per-head blocks the absorbed form multiplies by, stays a float parameter, and the model still
    picks the float model's token at most positions (92% here; int8 activations on a tiny random model)."""
    model_dir = str(mla_models["deepseek_v3_halves"])
    # block quantization runs on the CPU kernels
    exact = Engine(model_dir, dtype="float32", kv_cache_tokens=256, device="cpu")
    exact = prefill_then_decode_logits(exact, steps=0)
    engine = Engine(
        model_dir,
        dtype="float32",
        kv_cache_tokens=256,
        quantization="int8",
        device="cpu",
    )
    attn = engine.model.layers[0].self_attn
    assert (
        type(attn.o_proj).__name__ == "Q8Linear"
        and attn.kv_b_proj.weight.dtype == torch.float32
    )
    int8 = prefill_then_decode_logits(engine, steps=0)
    assert (int8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8


def test_multi_token_prediction_layers_are_skipped_and_fp8_refused(mla_models):
    """DeepSeek-V3's checkpoints hold a layer past the last (multi-token prediction): it loads without
    it; FP8 weights fail with a message instead of an unknown-weight error."""
    from strata.models.deepseek_v2 import DeepseekV2ForCausalLM
    from strata.weights.loader import iter_safetensors

    model_dir = mla_models["deepseek_v3"]
    cfg = config_from_dir(model_dir)
    weights = list(iter_safetensors(model_dir))
    mtp = [
        (name.replace("layers.1.", f"layers.{cfg.num_layers}."), t)
        for name, t in weights
        if ".layers.1." in name
    ]
    DeepseekV2ForCausalLM(cfg, max_positions=64).load_weights(weights + mtp)
    with pytest.raises(ValueError, match="FP8 weights"):
        DeepseekV2ForCausalLM(cfg, max_positions=64).load_weights(
            [
                *weights,
                ("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(1)),
            ]
        )
