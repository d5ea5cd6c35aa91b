"""Routing functions of a mixture-of-experts layer: router logits -> each token's experts and weights.

Every function has the signature of `RoutingFn` and is picked by name from `ROUTING` (the name is
`MoEConfig.routing`, set from the HF model_type by `strata.moe_config`). Each docstring names the
families that route that way; tests/unit/test_moe_routing.py checks each against transformers'
own router module on random inputs.

The contract: `logits` is [T, E] (any float dtype; the functions compute in float32), the result is
(weights [T, top_k] float32, experts [T, top_k] int64). The order of a token's k choices carries no
meaning (the expert outputs are summed).

A token's result must not depend on the other tokens of the step (a speculative verification's rows
must route as lone decodes do), and torch's CPU kernels do not promise that for every op: an
elementwise sigmoid runs a vectorized body and a scalar tail that round differently, and which
elements fall in the tail depends on the element count; a reduction over a short last dim may
associate its terms by the tensor's shape. So sums over a token's choices go left to right
(`row_sum`) and sigmoids are taken in float64 (`sigmoid32`: the two paths then agree after rounding
to float32 but for values within a float64 ulp of a float32 rounding boundary).
"""

from __future__ import annotations

from typing import Protocol

import torch

from strata.moe_config import MoEConfig


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] summed over the last dim left to right, keepdim: the same bits for a row in any tensor."""
    total = x[..., :1]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j : j + 1]
    return total


def sigmoid32(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) in float32, computed in float64 (see the module docstring)."""
    return torch.sigmoid(x.double()).float()


class RoutingFn(Protocol):
    def __call__(
        self,
        logits: torch.Tensor,
        cfg: MoEConfig,
        correction_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def softmax_topk(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
):
    """softmax over all experts -> top-k -> renormalised to sum to 1 if `norm_topk_prob`.
    Mixtral (always renormalises), Qwen2-MoE and Qwen3-MoE (per the config)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / row_sum(weights)
    return weights, experts


def topk_softmax(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
):
    """top-k on the raw logits (the router's linear has a bias) -> softmax over the k chosen. GPT-OSS."""
    top, experts = torch.topk(logits.float(), cfg.top_k, dim=-1)
    return torch.softmax(top, dim=-1), experts


def _group_mask(scores: torch.Tensor, cfg: MoEConfig, group_score: str) -> torch.Tensor:
    """[T, E] bool: the experts in each token's best `topk_groups` of `num_groups` equal groups, a
    group scored by its best expert ("max") or the sum of its best two ("top2_sum")."""
    grouped = scores.view(scores.shape[0], cfg.num_groups, -1)  # [T, G, E / G]
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, cfg.topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand_as(grouped).reshape_as(scores)


def sigmoid_group_topk(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
):
    """DeepSeek-V3 (noaux_tc): sigmoid scores; the choice is made on scores + the per-expert
    correction bias, limited to the best `topk_groups` groups (a group scored by the sum of its best
    two); the weights are the chosen experts' scores without the bias, renormalised if
    `norm_topk_prob`, times `routed_scaling_factor`."""
    scores = sigmoid32(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        choice = choice.masked_fill(
            ~_group_mask(choice, cfg, "top2_sum"), float("-inf")
        )
    experts = torch.topk(choice, cfg.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (row_sum(weights) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def softmax_greedy(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
):
    """DeepSeek-V2 `topk_method="greedy"`: softmax -> top-k, times `routed_scaling_factor` (never
    renormalised, as transformers runs it)."""
    weights, experts = torch.topk(
        torch.softmax(logits.float(), dim=-1), cfg.top_k, dim=-1
    )
    return weights * cfg.routed_scaling_factor, experts


def softmax_group_limited_greedy(
    logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
):
    """DeepSeek-V2 `topk_method="group_limited_greedy"`: softmax; only the best `topk_groups` groups
    (a group scored by its best expert) stay candidates; top-k, times `routed_scaling_factor`."""
    probs = torch.softmax(logits.float(), dim=-1)
    probs = probs.masked_fill(~_group_mask(probs, cfg, "max"), 0.0)
    weights, experts = torch.topk(probs, cfg.top_k, dim=-1)
    return weights * cfg.routed_scaling_factor, experts


ROUTING: dict[str, RoutingFn] = {
    "softmax_topk": softmax_topk,
    "topk_softmax": topk_softmax,
    "sigmoid_group_topk": sigmoid_group_topk,
    "softmax_greedy": softmax_greedy,
    "softmax_group_limited_greedy": softmax_group_limited_greedy,
}


def get_routing(name: str) -> RoutingFn:
    if name not in ROUTING:
        raise ValueError(
            f"MoE routing {name!r} is not supported; supported: {', '.join(sorted(ROUTING))}"
        )
    return ROUTING[name]
