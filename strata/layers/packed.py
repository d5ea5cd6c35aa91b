"""bf16 linear layers with weights prepacked for oneDNN (CPU).

`torch.nn.functional.linear` on bf16 CPU tensors reorders the weight into oneDNN's blocked layout
on every call; packing it once at load time makes every projection faster, most of all the
one-row matmuls of a decode step (weights streamed from memory: ~1.3x). `pack_linears` swaps each
bf16 `nn.Linear` of a loaded model (and the tied output head) for a `PackedLinear`, after checking
on a random input that the packed op gives the same result; on any failure the model is left as it
was. Off with the other CPU fast paths under STRATA_CPU_KERNELS=0.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import enabled_by_env

logger = logging.getLogger(__name__)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = _pack(weight)  # an opaque oneDNN tensor: a plain attribute, not a parameter
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = _linear(x.reshape(-1, self.in_features).contiguous(), self.packed, self.bias)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn_packed"


def packing_works() -> bool:
    """True if oneDNN's packed bf16 linear runs here and matches F.linear."""
    if not enabled_by_env() or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
        b = torch.randn(48, generator=gen).to(torch.bfloat16)
        x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
        return torch.allclose(
            _linear(x, _pack(w), b).float(), F.linear(x, w, b).float(), atol=0.05, rtol=0.02
        )
    except Exception as exc:  # an op missing from this torch build, an unsupported CPU, ...
        logger.info("oneDNN weight packing unavailable (%s)", exc)
        return False


def pack_linears(model: nn.Module) -> int:
    """Replace the model's bf16 CPU nn.Linear modules (and a tied output head) by PackedLinear.
    Returns how many were packed."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
    ]
    if not targets or not packing_works():
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    count = len(targets)
    embed = getattr(model, "embed_tokens", None)
    if (
        getattr(model, "lm_head", "absent") is None
        and embed is not None
        and embed.weight.dtype == torch.bfloat16
    ):
        model.lm_head = PackedLinear(embed.weight, None)  # tied: a packed copy of the embedding matrix
        count += 1
    return count
