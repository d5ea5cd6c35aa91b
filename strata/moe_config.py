"""The mixture-of-experts part of a model's config: `MoEConfig`, read from each family's HF spelling
(`moe_from_hf`, told what the file does not say by the family's `MoETraits`), and which layers are
sparse (`moe_layers`). `strata.model_config.ModelConfig` holds one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (`strata.layers.moe`), normalised from each family's HF spelling.

    routing names a function of `strata.layers.moe_routing.ROUTING` (the HF families using each are
    listed there); expert_act is the experts' gated activation (`strata.layers.activation`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    num_groups: int = (
        1  # group-limited routing (DeepSeek): experts in `num_groups` equal groups ...
    )
    topk_groups: int = 1  # ... of which a token may use the best `topk_groups`
    routed_scaling_factor: float = (
        1.0  # the routed experts' weights are scaled by it (DeepSeek)
    )
    router_bias: bool = False  # the router's linear has a bias (GPT-OSS)
    correction_bias: bool = (
        False  # a per-expert bias added to the scores for choosing only (DeepSeek-V3)
    )
    expert_bias: bool = False  # the experts' projections have biases (GPT-OSS)
    expert_act: str = "silu"  # silu | gelu_pytorch_tanh | clamped_swiglu (GPT-OSS)
    swiglu_limit: float = (
        7.0  # clamped_swiglu: gate clamped above, up to [-limit, limit]
    )
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate)
    shared_intermediate_size: int = (
        0  # an always-on shared expert of this size; 0: none
    )
    shared_expert_gate: bool = (
        False  # the shared expert's output is scaled by sigmoid(x @ w) (Qwen2-MoE)
    )


@dataclass(frozen=True)
class MoETraits:
    """How a family's config.json spells its experts where the file does not say it: declared in the
    family's file (`strata.models`), read by `moe_from_hf`. The defaults are Mixtral's and Qwen's."""

    # the function of `strata.layers.moe_routing.ROUTING` that picks the experts; None: config.json's
    # `topk_method` picks it (DeepSeek-V2, `_TOPK_METHODS`)
    routing: str | None = "softmax_topk"
    # renormalise the top-k weights: True or False whatever config.json says (Mixtral always,
    # DeepSeek-V2 never, as transformers runs them); None: config.json's `norm_topk_prob`
    norm_topk_prob: bool | None = None
    routed_scaling: bool = (
        False  # config.json's `routed_scaling_factor` applies (DeepSeek)
    )
    correction_bias: bool = False  # a per-expert score-correction bias (DeepSeek-V3)
    biases: bool = (
        False  # the router and the experts' projections have biases (GPT-OSS)
    )
    expert_act: str | None = (
        None  # the experts' activation; None: config.json's hidden_act
    )
    # an always-on shared expert of `shared_expert_intermediate_size`, gated (Qwen2-MoE) ...
    gated_shared_expert: bool = False
    # ... or `n_shared_experts` of `moe_intermediate_size`, as one MLP (DeepSeek)
    shared_experts: bool = False


# DeepSeek-V2's `topk_method` -> the routing function of `strata.layers.moe_routing.ROUTING`
_TOPK_METHODS = {
    "greedy": "softmax_greedy",
    "group_limited_greedy": "softmax_group_limited_greedy",
}


def moe_from_hf(text: dict[str, Any], traits: MoETraits | None) -> MoEConfig | None:
    """The experts of a mixture-of-experts config.json, None for a dense model; `traits` are the
    family's (None: it has no experts). HF spells the expert count num_local_experts (Mixtral,
    GPT-OSS), num_experts (Qwen) or n_routed_experts (DeepSeek)."""
    num_experts = (
        text.get("num_local_experts")
        or text.get("num_experts")
        or text.get("n_routed_experts")
        or 0
    )
    if num_experts <= 0:
        return None
    if traits is None:
        raise ValueError(
            f"config.json has {num_experts} experts, but its model family has no mixture of "
            "experts in Strata; check the config's model_type"
        )
    routing = traits.routing
    if routing is None:
        method = text.get("topk_method", "greedy")
        if method not in _TOPK_METHODS:
            raise ValueError(
                f"DeepSeek-V2 topk_method {method!r} is not supported; supported: {sorted(_TOPK_METHODS)}"
            )
        routing = _TOPK_METHODS[method]
    if traits.gated_shared_expert:
        shared = text.get("shared_expert_intermediate_size") or 0
    elif traits.shared_experts:
        shared = (text.get("n_shared_experts") or 0) * text["moe_intermediate_size"]
    else:
        shared = 0
    norm_topk_prob = traits.norm_topk_prob
    return MoEConfig(
        num_experts=num_experts,
        top_k=text.get("num_experts_per_tok")
        or text["experts_per_token"],  # the latter: GPT-OSS's own name
        intermediate_size=text.get("moe_intermediate_size")
        or text["intermediate_size"],
        routing=routing,
        norm_topk_prob=bool(text.get("norm_topk_prob"))
        if norm_topk_prob is None
        else norm_topk_prob,
        num_groups=text.get("n_group") or 1,
        topk_groups=text.get("topk_group") or 1,
        routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0)
        if traits.routed_scaling
        else 1.0,
        router_bias=traits.biases,
        correction_bias=traits.correction_bias,
        expert_bias=traits.biases,
        expert_act=traits.expert_act or text.get("hidden_act", "silu"),
        swiglu_limit=float(text.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(text.get("swiglu_alpha", 1.702)),
        shared_intermediate_size=shared,
        shared_expert_gate=traits.gated_shared_expert and shared > 0,
    )


def moe_layers(text: dict[str, Any], num_layers: int) -> list[bool]:
    """Which layers' MLP is the mixture of experts; the others are dense (intermediate_size). Every
    layer, except those HF's configs keep dense: the first `first_k_dense_replace` (DeepSeek), those
    in `mlp_only_layers` and those off the `decoder_sparse_step` (Qwen: layer i is sparse when
    (i + 1) % step == 0)."""
    first_sparse = text.get("first_k_dense_replace") or 0
    dense = set(text.get("mlp_only_layers") or ())
    step = text.get("decoder_sparse_step") or 1
    return [
        i >= first_sparse and i not in dense and (i + 1) % step == 0
        for i in range(num_layers)
    ]
