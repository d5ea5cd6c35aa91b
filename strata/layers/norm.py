"""RMSNorm, computed in float32 like the reference implementations, optionally fused with the
residual add that precedes it (the native kernel does both in one pass)."""

from __future__ import annotations

import torch

from strata.kernels import usable


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, returns (norm(x + residual), x + residual)."""
        ops = usable(x) if x.is_contiguous() and x.dtype == self.weight.dtype else None
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
        return self.weight * x.to(dtype)
