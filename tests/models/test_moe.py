"""Mixture-of-experts models exact against transformers (fp32): Mixtral, Qwen2-MoE (a dense layer
and a gated shared expert), Qwen3-MoE (decoder_sparse_step), GPT-OSS (sinks, windows, biased
experts with a clamped SwiGLU). Logits of a batched prefill and decode, greedy tokens under chunked
prefill and through a radix cache hit, and the per-expert load counters."""

from __future__ import annotations

import pytest
import torch
from test_parity import PROMPTS, forward_logits, hf_greedy, hf_model
from tiny_models import MOE_FAMILIES, constant_tensors, make_model

from strata import Engine, SamplingParams
from strata.engine.request import Req
from strata.models import config_from_dir, config_from_hf

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SHARED = PROMPTS[2][:32] + [7, 8, 9]  # shares a 32-token prefix with PROMPTS[2]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {
        family: make_model(root / family, family, tokenizer=False)
        for family in MOE_FAMILIES
    }


@pytest.fixture(scope="module")
def expected(moe_models):
    """transformers' greedy tokens for PROMPTS and for a prompt sharing PROMPTS[2]'s first 32 tokens."""
    out = {}
    for family, model_dir in moe_models.items():
        ref = hf_model(model_dir)
        out[family] = [
            hf_greedy(ref, p, GREEDY.max_new_tokens) for p in [*PROMPTS, SHARED]
        ]
    return out


def test_tiny_checkpoints_hold_no_constant_tensor(moe_models):
    """Router and expert biases, GPT-OSS's sinks, norms: nothing a parity test reads is left at the
    one value transformers initialises it to, so a weight loaded wrongly or not at all shows."""
    assert {family: constant_tensors(d) for family, d in moe_models.items()} == {
        family: [] for family in moe_models
    }


def test_dense_and_sparse_layers_follow_the_config(moe_models):
    layers = {
        f: [s.moe for s in config_from_dir(d).layers] for f, d in moe_models.items()
    }
    assert layers == {
        "mixtral": [True, True],
        "qwen2_moe": [True, False, True],  # mlp_only_layers=[1]
        "qwen3_moe": [False, True, False, True],  # decoder_sparse_step=2
        "gpt_oss": [True, True],
    }
    deepseek = config_from_hf(
        {
            "model_type": "deepseek_v3",
            "vocab_size": 32,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 2,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        }
    )
    assert [s.moe for s in deepseek.layers] == [False, True, True, True]
    moe = deepseek.moe
    assert (moe.routing, moe.shared_intermediate_size, moe.correction_bias) == (
        "sigmoid_group_topk",
        32,
        True,
    )


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_prefill_and_decode_logits_match(moe_models, family):
    model_dir = moe_models[family]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024, page_size=4)
    ref = hf_model(model_dir)
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    logits = forward_logits(engine, reqs, [len(p) for p in PROMPTS], num_decode=0)
    start = 0
    for p in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(
            logits[start : start + len(p)], want, atol=1e-4, rtol=0
        )
        start += len(p)
    seqs = [list(p) for p in PROMPTS]
    for step in range(3):  # batched decode steps, fixed tokens
        for i, (req, s) in enumerate(zip(reqs, seqs)):
            req.output_ids.append(11 + 7 * i + step)
            s.append(11 + 7 * i + step)
        with torch.no_grad():
            want = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])
        torch.testing.assert_close(
            forward_logits(engine, reqs, [1] * len(reqs), len(reqs)),
            want,
            atol=1e-4,
            rtol=0,
        )


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_greedy_tokens_under_chunked_prefill(moe_models, expected, family):
    engine = Engine(
        str(moe_models[family]),
        dtype="float32",
        kv_cache_tokens=1024,
        chunked_prefill_size=5,
    )
    got = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert got == expected[family][: len(PROMPTS)]
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_radix_hit_is_exact(moe_models, expected, family):
    """A second request sharing a 32-token prefix reuses its KV and computes only the tail (the
    experts see only the new tokens) with transformers' tokens."""
    engine = Engine(
        str(moe_models[family]), dtype="float32", kv_cache_tokens=1024, page_size=4
    )
    first = engine.generate([PROMPTS[2]], GREEDY)[0]
    second = engine.generate([SHARED], GREEDY)[0]
    assert second.cached_tokens == 32
    assert [first.token_ids, second.token_ids] == [
        expected[family][2],
        expected[family][-1],
    ]
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_expert_load_counts_transformers_routing(moe_models, family):
    """After one prefill, each MoE layer's counters are the bincount of the experts transformers'
    routers chose for those tokens (dense layers have none); a reset zeroes them."""
    model_dir = moe_models[family]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024)
    engine.model.reset_expert_load()
    prompt = PROMPTS[2]
    forward_logits(
        engine,
        [Req(rid="0", prompt_ids=list(prompt), params=SamplingParams())],
        [len(prompt)],
        0,
    )
    cfg = config_from_dir(model_dir)
    with torch.no_grad():
        out = hf_model(model_dir)(torch.tensor([prompt]), output_router_logits=True)
    sparse = [i for i, spec in enumerate(cfg.layers) if spec.moe]
    want = {}
    for layer, logits in zip(sparse, out.router_logits):
        experts = torch.topk(
            logits.float().softmax(-1) if family != "gpt_oss" else logits, cfg.moe.top_k
        ).indices
        want[layer] = torch.bincount(
            experts.reshape(-1), minlength=cfg.moe.num_experts
        ).tolist()
    load = engine.model.expert_load()
    assert load == want
    assert all(sum(c) == len(prompt) * cfg.moe.top_k for c in load.values())
    engine.model.reset_expert_load()
    assert all(sum(c) == 0 for c in engine.model.expert_load().values())


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_bf16_is_as_close_to_fp32_as_transformers_bf16(moe_models, family):
    """bf16 through our grouped experts (bf16 grouped GEMM, packed shared-expert linears) strays from
    fp32 no more than transformers' bf16 model strays from its fp32 one."""
    from transformers import AutoModelForCausalLM

    model_dir = moe_models[family]
    ours, theirs = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(str(model_dir), dtype=dtype, kv_cache_tokens=1024)
        reqs = [
            Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
            for i, p in enumerate(PROMPTS)
        ]
        ours[dtype] = forward_logits(engine, reqs, [len(p) for p in PROMPTS], 0).float()
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


def test_a_missing_expert_is_reported(moe_models):
    """A checkpoint without one expert's gate projection fails to load, naming the stacked weight."""
    from strata.models.mixtral import MixtralForCausalLM
    from strata.weights.loader import iter_safetensors

    model_dir = moe_models["mixtral"]
    cfg = config_from_dir(model_dir)
    model = MixtralForCausalLM(cfg, max_positions=64)
    weights = [
        (n, t)
        for n, t in iter_safetensors(model_dir)
        if n != "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    ]
    with pytest.raises(
        ValueError, match=r"missing weights: \['layers.1.mlp.experts.gate_up_proj'\]"
    ):
        model.load_weights(weights)
