"""The gated MLP's activation: act(gate) * up over a fused [.., 2 * intermediate] projection
(gate first, as Llama's gate/up and Phi-3's gate_up_proj checkpoints order them), and GPT-OSS's
experts' clamped SwiGLU and DeepSeek-V4's clamped SiLU over the same layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels import usable

ACTIVATIONS = (
    "silu",
    "gelu_pytorch_tanh",
)  # HF `hidden_act` / `hidden_activation` names
ALIASES = {"swish": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def check_activation(name: str, architecture: str) -> str:
    """The canonical name of a supported activation, else a ValueError naming the supported ones."""
    name = ALIASES.get(name, name)
    if name not in ACTIVATIONS:
        supported = ", ".join(ACTIVATIONS)
        raise ValueError(
            f"hidden_act {name!r} is not supported for {architecture}; supported: {supported}"
        )
    return name


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up: [T, 2 * I] -> act(gate) * up: [T, I]. SiLU runs as one native kernel on the CPU."""
    if act == "silu":
        ops = usable(gate_up)
        if ops and gate_up.is_contiguous():
            return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's experts: gate_up [T, 2 * I] (gate first) -> (up + 1) * gate * sigmoid(alpha * gate),
    with gate clamped to at most `limit` and up to [-limit, limit]: [T, I]. (GPT-OSS's checkpoint
    interleaves gate and up columns; its loader de-interleaves them into this layout.)"""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_silu_mul(
    gate: torch.Tensor, up: torch.Tensor, limit: float
) -> torch.Tensor:
    """DeepSeek-V4's experts and shared expert: SiLU(gate clamped to at most `limit`) * up clamped to
    [-limit, limit]."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


# the experts' activations over the fused layout beside the plain ones (`MoEConfig.expert_act`)
EXPERT_ACTIVATIONS = ("clamped_swiglu", "clamped_silu")


def check_expert_activation(name: str) -> str:
    """An experts' activation: GPT-OSS's or DeepSeek-V4's clamped one, or a plain one."""
    return name if name in EXPERT_ACTIVATIONS else check_activation(name, "MoE")


def expert_act_and_mul(
    gate_up: torch.Tensor, act: str, limit: float, alpha: float
) -> torch.Tensor:
    """gate_up [R, 2 * I] (gate first) -> [R, I] under an experts' activation
    (`check_expert_activation`'s name)."""
    if act == "clamped_swiglu":
        return clamped_swiglu(gate_up, limit, alpha)
    if act == "clamped_silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return clamped_silu_mul(gate, up, limit)
    return act_and_mul(gate_up.contiguous(), act)
