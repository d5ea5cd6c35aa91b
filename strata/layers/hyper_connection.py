"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream of each token is
`hc_mult` parallel streams instead of one.

Around each sublayer (attention, MLP), from the streams h [T, n, D]:

    flat = rmsnorm(h.flatten())  @ fn.T  ->  pre [n], post [n], comb [n, n]   (per token)
    pre  = sigmoid(.) + eps          the sublayer's input is  sum_i pre_i * h_i
    post = 2 * sigmoid(.)            its output y goes back as  post_i * y  into stream i
    comb = Sinkhorn(softmax(.) + eps), doubly stochastic: the streams mix as  comb.T @ h

so the new streams are post * y + comb.T @ h. `HyperHead` collapses the streams into one at the end.
All of it runs in float32 (the checkpoint keeps these weights in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, no weight (the rms in float32, the product in x's dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The mixing weights around one sublayer (`fn`, `base`, `scale`: transformers' names)."""

    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        sinkhorn_iters: int,
        eps: float,
        norm_eps: float,
    ):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = (
            hc_mult,
            sinkhorn_iters,
            eps,
            norm_eps,
        )
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(
            torch.empty(width, hc_mult * hidden_size, dtype=torch.float32)
        )
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(
        self, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (the sublayer's input [T, D], post [T, n], comb [T, n, n]) (float32)."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())  # [T, (2 + n) * n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(
            comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1
        ).add_(self.eps)
        # Sinkhorn-Knopp: columns, then (rows, columns) iters - 1 times (in place: ~100 tiny ops per call)
        eps = self.eps
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
        for _ in range(self.iters - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def merge(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a sublayer: post * out + comb.T @ streams. [T, n, D]."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state (`hc_fn`, `hc_base`, `hc_scale`)."""

    def __init__(self, hidden_size: int, hc_mult: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(
            torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32)
        )
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:  # [T, n, D] -> [T, D]
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = (
            torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float())
            + self.eps
        )
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
