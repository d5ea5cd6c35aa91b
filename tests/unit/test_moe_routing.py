"""Each routing function, and the whole MoE block, against transformers' own router and MoE modules
on random inputs: Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, DeepSeek-V3 and DeepSeek-V2 (both of its
top-k methods). Plus the grouped expert compute against a per-token loop."""

from __future__ import annotations

import pytest
import torch
import transformers

from strata.bench.moe import load_hf_moe_block
from strata.layers.moe import MoE, grouped_linear, grouped_mm_works
from strata.layers.moe_routing import ROUTING
from strata.layers.packed import dense_target, pack_linears
from strata.models import config_from_hf

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.5,
)
T = 40  # tokens

# name -> (config class, its MoE fields, module of the HF classes, router class, MoE block class)
CASES = {
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=6, num_experts_per_tok=2),
        "mixtral",
        "MixtralTopKRouter",
        "MixtralSparseMoeBlock",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        ),
        "qwen2_moe",
        "Qwen2MoeTopKRouter",
        "Qwen2MoeSparseMoeBlock",
    ),
    "qwen2_moe_norm": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=True,
        ),
        "qwen2_moe",
        "Qwen2MoeTopKRouter",
        "Qwen2MoeSparseMoeBlock",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        ),
        "qwen3_moe",
        "Qwen3MoeTopKRouter",
        "Qwen3MoeSparseMoeBlock",
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(num_local_experts=6, num_experts_per_tok=2, head_dim=8, swiglu_limit=2.0),
        "gpt_oss",
        "GptOssTopKRouter",
        "GptOssMLP",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=2,
        ),
        "deepseek_v3",
        "DeepseekV3TopkRouter",
        "DeepseekV3MoE",
    ),
    "deepseek_v2_greedy": (
        "DeepseekV2Config",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            topk_method="greedy",
            routed_scaling_factor=1.5,
            n_shared_experts=1,
        ),
        "deepseek_v2",
        "DeepseekV2TopkRouter",
        "DeepseekV2Moe",
    ),
    "deepseek_v2_group": (
        "DeepseekV2Config",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            n_shared_experts=1,
        ),
        "deepseek_v2",
        "DeepseekV2TopkRouter",
        "DeepseekV2Moe",
    ),
}
ROUTING_OF = {
    "mixtral": "softmax_topk",
    "qwen2_moe": "softmax_topk",
    "qwen2_moe_norm": "softmax_topk",
    "qwen3_moe": "softmax_topk",
    "gpt_oss": "topk_softmax",
    "deepseek_v3": "sigmoid_group_topk",
    "deepseek_v2_greedy": "softmax_greedy",
    "deepseek_v2_group": "softmax_group_limited_greedy",
}


def hf_case(name: str):
    cls, fields, module, router_cls, block_cls = CASES[name]
    hf_cfg = getattr(transformers, cls)(**BASE, **fields)
    hf_cfg._experts_implementation = "eager"
    mod = getattr(transformers.models, module)
    modeling = getattr(mod, f"modeling_{module}")
    moe_cfg = config_from_hf(hf_cfg.to_dict()).moe
    return hf_cfg, moe_cfg, getattr(modeling, router_cls), getattr(modeling, block_cls)


def randomize(module: torch.nn.Module) -> None:
    """Every parameter and buffer drawn at random: routers, biases and DeepSeek's correction bias
    included (transformers leaves some at zero)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.5)


def by_expert(weights: torch.Tensor, experts: torch.Tensor):
    """A token's k choices in expert order (the order carries no meaning; DeepSeek's is unsorted)."""
    experts, order = experts.sort(dim=-1)
    return weights.float().gather(1, order), experts


def test_every_routing_function_is_tested():
    assert set(ROUTING_OF.values()) == set(ROUTING)


@pytest.mark.parametrize("name", list(CASES))
def test_routing_function_equals_transformers_router(name):
    hf_cfg, moe_cfg, router_cls, _ = hf_case(name)
    assert moe_cfg.routing == ROUTING_OF[name]
    router = router_cls(hf_cfg).eval()
    randomize(router)
    x = torch.randn(T, BASE["hidden_size"])
    with torch.no_grad():
        logits, hf_weights, hf_experts = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    weights, experts = ROUTING[moe_cfg.routing](logits, moe_cfg, bias)
    assert weights.shape == experts.shape == (T, moe_cfg.top_k)
    want_w, want_e = by_expert(hf_weights, hf_experts)
    got_w, got_e = by_expert(weights, experts)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    if name == "deepseek_v3":  # the correction bias changed the choice for some tokens
        assert not torch.equal(
            experts.sort(-1).values,
            torch.topk(logits, moe_cfg.top_k).indices.sort(-1).values,
        )


@pytest.mark.parametrize("backend", ["grouped_mm", "loop", "native"])
@pytest.mark.parametrize("name", list(CASES))
def test_moe_block_equals_transformers(name, backend):
    """Routing, grouped experts, GPT-OSS's biased clamped SwiGLU, shared experts (Qwen2-MoE's
    sigmoid-gated one, DeepSeek's ungated ones): our block's output is transformers' block's. With
    the router and the expert stacks packed for the native dense kernel ("native", as the loader
    leaves a CPU model), each token's output is also the same bits alone as among the others."""
    if backend == "grouped_mm" and not grouped_mm_works("cpu", torch.float32):
        pytest.skip("this torch has no CPU grouped GEMM")
    if backend == "native" and dense_target() is None:
        pytest.skip("the CPU kernels could not be built here")
    hf_cfg, moe_cfg, _, block_cls = hf_case(name)
    hf_block = block_cls(hf_cfg).eval()
    randomize(hf_block)
    ours = MoE(BASE["hidden_size"], moe_cfg)
    load_hf_moe_block(ours, hf_block, gpt_oss=name == "gpt_oss")
    if backend == "native":
        assert (
            pack_linears(ours) >= 2
            and ours.gate.native_kernel
            and ours.experts.native_kernel
        )
        assert (
            ours.experts.gate_up_proj is None
        )  # packed in place of the float stack, not beside it
    else:
        ours.experts.backend = backend
    x = torch.randn(T, BASE["hidden_size"])
    with torch.no_grad():
        expected = hf_block(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        ours.expert_load.zero_()
        got = ours(x)
        assert int(ours.expert_load.sum()) == T * moe_cfg.top_k
        if backend == "native":
            for t in range(T):
                assert torch.equal(ours(x[t : t + 1]), got[t : t + 1]), t
    tol = (
        1e-4 if backend == "native" else 1e-5
    )  # the kernel sums in its own order, not BLAS's
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_packed_experts_unpack_to_their_stacks():
    _, moe_cfg, _, _ = hf_case("gpt_oss")
    if dense_target() is None:
        pytest.skip("the CPU kernels could not be built here")
    ours = MoE(BASE["hidden_size"], moe_cfg)
    randomize(ours)
    stacks = {
        name: getattr(ours.experts, name).detach().clone()
        for name in ("gate_up_proj", "down_proj")
    }
    pack_linears(ours)
    for name, stack in stacks.items():
        assert torch.equal(ours.experts.unpacked(name), stack)


def test_grouped_linear_backends_equal_a_per_token_loop():
    """Rows grouped by expert, some experts empty: both backends give each row its expert's matmul."""
    torch.manual_seed(0)
    E, R = 5, 23
    experts = torch.randint(0, E - 2, (R,)).sort().values  # experts 3 and 4 get no rows
    ends = torch.bincount(experts, minlength=E).cumsum(0).to(torch.int32)
    x, w = torch.randn(R, 16), torch.randn(E, 24, 16)
    expected = torch.stack([w[e] @ x[r] for r, e in enumerate(experts.tolist())])
    torch.testing.assert_close(grouped_linear(x, w, ends, "loop"), expected)
    if grouped_mm_works("cpu", torch.float32):
        torch.testing.assert_close(grouped_linear(x, w, ends, "grouped_mm"), expected)


def test_expert_load_summary_names_the_busiest_expert_and_the_imbalance():
    from strata.layers.expert_load import expert_load_delta, expert_load_summary

    before, after = (
        {1: [0, 2, 0, 0], 3: [0, 0, 0, 0]},
        {1: [0, 8, 2, 0], 3: [0, 0, 0, 0]},
    )
    assert expert_load_delta(after, before) == {1: [0, 6, 2, 0], 3: [0, 0, 0, 0]}
    summary = expert_load_summary(expert_load_delta(after, before))
    assert summary[1] == {
        "tokens": 8,
        "busiest_expert": 1,
        "max_tokens": 6,
        "mean_tokens": 2.0,
        "max_over_mean": 3.0,
        "idle_experts": 2,
    }
    assert (
        summary[3]["max_over_mean"] is None and summary[3]["idle_experts"] == 4
    )  # no token yet
