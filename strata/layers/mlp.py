"""The gated MLP: down_proj(act(gate) * up) over one fused gate_up_proj matmul (gate rows first).

The dense MLP of every decoder layer, and the shared expert of a mixture-of-experts layer."""

from __future__ import annotations

import torch
from torch import nn

from strata.layers.activation import act_and_mul


class MLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False
    ):
        super().__init__()
        self.act = act  # a canonical name of `strata.layers.activation.ACTIVATIONS`
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))
