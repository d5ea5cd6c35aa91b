"""RMSNorm, computed in float32 like the reference implementations, optionally fused with the
residual add that precedes it (the native kernel does both in one pass).

Gemma's variant (`unit_offset=True`) scales by (1 + weight) and multiplies in float32 before
rounding to the activations' dtype; it runs on the PyTorch path only.
"""

from __future__ import annotations

import torch

from strata.kernels import usable


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, returns (norm(x + residual), x + residual)."""
        fast = (
            x.is_contiguous() and x.dtype == self.weight.dtype and not self.unit_offset
        )
        ops = usable(x) if fast else None
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps) if ops else self.reference(x)
        if ops and residual.is_contiguous() and residual.dtype == x.dtype:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)
