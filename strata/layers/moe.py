"""The mixture-of-experts MLP: router -> routing function -> grouped expert compute -> weighted sum,
plus an optional always-on shared expert (Qwen2-MoE scales it by a sigmoid gate).

    x [T, H] -> gate: logits [T, E] -> ROUTING[cfg.routing]: weights, experts [T, k]
      -> the T * k (token, expert) rows sorted by expert: rows of one expert are contiguous
      -> gate_up_proj[e] -> act -> down_proj[e] on each expert's rows (one grouped GEMM)
      -> each row times its weight, scattered back and summed over k -> [T, H] (+ shared expert)

Expert weights are stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], the
layout of transformers' in-memory experts for Mixtral/Qwen/DeepSeek; the loader fills them from
per-expert checkpoint tensors or from a family's stacked ones (`Experts.load`).

Every forward adds the number of rows routed to each expert to `expert_load` (int64 [E], on the
model's device; the bincount the grouping needs anyway): the input to expert placement.
`strata.layers.expert_load` says how uneven such counts are (what `/get_server_info` and
`strata bench offline` report).
"""

from __future__ import annotations

import functools
import re
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata import kernels
from strata.layers.activation import (
    check_activation,
    check_expert_activation,
    expert_act_and_mul,
)
from strata.layers.mlp import MLP
from strata.layers.moe_routing import get_routing, row_sum, sigmoid32
from strata.layers.packed import DenseLinear, NativePackable, pack_groups, unpack_dense
from strata.moe_config import MoEConfig

EXPERT_BACKENDS = ("grouped_mm", "loop")


def _loop_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """x [R, K] with rows grouped by expert (counts[e] rows of expert e, in order), weight
    [E, N, K] -> [R, N]: one matmul per expert that has rows."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = F.linear(x[start : start + n], weight[e])
            start += n
    return out


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str
) -> torch.Tensor:
    """x [R, K] grouped by expert, weight [E, N, K], group_ends [E] int32 (the cumulative row
    counts: expert e owns rows group_ends[e-1]:group_ends[e]) -> [R, N]; row r is
    x[r] @ weight[expert of r].T. `grouped_mm` is torch's grouped GEMM (one call for every
    expert); `loop` runs one matmul per expert with rows (the reference)."""
    if backend == "grouped_mm":
        return F.grouped_mm(x, weight.transpose(1, 2), offs=group_ends)
    ends = group_ends.tolist()
    return _loop_linear(
        x, weight, [end - start for start, end in zip([0, *ends], ends)]
    )


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """True if torch's grouped GEMM runs on this device and dtype and matches the per-expert loop
    (it needs a recent torch; CUDA's accepts bf16 only)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(7, 32, generator=gen).to(device_type, dtype)
        w = torch.randn(3, 48, 32, generator=gen).to(device_type, dtype)
        ends = torch.tensor([4, 4, 7], dtype=torch.int32, device=device_type)
        got = grouped_linear(x, w, ends, "grouped_mm").float()
        return torch.allclose(
            got, grouped_linear(x, w, ends, "loop").float(), atol=1e-2, rtol=1e-2
        )
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Router(NativePackable, nn.Module):
    """The router's linear (weight [E, H], optional bias) and DeepSeek-V3's score correction bias.
    `pack` gives it a packed copy for the native dense kernel (strata.layers.packed), so a token's
    logits, and so its experts, never depend on the other rows of the step."""

    def __init__(self, hidden_size: int, cfg: MoEConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        self.bias = (
            nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(cfg.num_experts)) if cfg.correction_bias else None
        )
        self.dense: nn.Module | None = None

    def pack_sources(self) -> list[torch.Tensor]:
        return [self.weight]

    def pack(self, target: str) -> None:
        self.dense = DenseLinear(self.weight, self.bias, target)
        self.packed_target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> logits [T, E]
        if self.dense is not None and x.is_cpu:  # packed
            return self.dense(x)
        return F.linear(x, self.weight, self.bias)


# a per-expert checkpoint tensor, relative to the experts module: "3.gate_proj.weight"
_PER_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")


class ExpertLoader(Protocol):
    """What loading a checkpoint asks of an experts module (`Experts`, or EP's `EPExperts`)."""

    def load(self, name: str, tensor: torch.Tensor) -> tuple[str, int]: ...
    def num_pieces(self, name: str) -> int: ...


class Experts(NativePackable, nn.Module):
    """The routed experts' stacked weights and their grouped compute."""

    def __init__(self, hidden_size: int, cfg: MoEConfig):
        super().__init__()
        E, I = cfg.num_experts, cfg.intermediate_size  # noqa: E741
        self.num_experts, self.intermediate_size = E, I
        self.act = check_expert_activation(cfg.expert_act)
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, I))
        self.gate_up_proj_bias = (
            nn.Parameter(torch.empty(E, 2 * I)) if cfg.expert_bias else None
        )
        self.down_proj_bias = (
            nn.Parameter(torch.empty(E, hidden_size)) if cfg.expert_bias else None
        )
        self.backend: str | None = None  # None: grouped_mm where it works, else loop
        self.out_features = {"gate_up_proj": 2 * I, "down_proj": hidden_size}

    def pack_sources(self) -> list[torch.Tensor]:
        return [self.gate_up_proj, self.down_proj]

    def pack(self, target: str) -> None:
        """Hold each stack packed for the native dense kernel instead (`{name}_packed` [E, ...], each
        expert as strata.layers.packed.pack_dense lays it out; biases as float32), so that a row's
        output never depends on the other rows of the call, as with BLAS it may. The float stacks are
        dropped, not kept twice; `unpacked(name)` rebuilds one."""
        for name in ("gate_up_proj", "down_proj"):
            weight = self._parameters[name]
            assert weight is not None  # packed once
            packed = pack_groups(weight.detach())
            self._parameters[name] = None
            self.register_buffer(f"{name}_packed", packed, persistent=False)
            bias = getattr(self, f"{name}_bias")
            if bias is not None:
                setattr(
                    self,
                    f"{name}_bias",
                    nn.Parameter(
                        bias.detach().float().contiguous(), requires_grad=False
                    ),
                )
        self.packed_target = target

    def unpacked(self, name: str) -> torch.Tensor:
        """The [E, N, K] stack `name` (gate_up_proj or down_proj), packed or not."""
        if self.packed_target is None:
            return getattr(self, name)
        return torch.stack(
            [
                unpack_dense(w, self.out_features[name])
                for w in getattr(self, f"{name}_packed")
            ]
        )

    def _project(
        self,
        x: torch.Tensor,
        name: str,
        group_ends: torch.Tensor,
        backend: str | None,
        row_expert: torch.Tensor,
    ) -> torch.Tensor:
        """Rows x grouped by expert @ each one's `name` stack^T, + its bias; backend None: the packed
        stacks on the native kernel (group_ends int64), else grouped_linear's (group_ends int32)."""
        bias = getattr(self, f"{name}_bias")
        if backend is None:
            assert self.packed_target is not None  # backend None: packed
            return kernels.loaded(self.packed_target).dense_grouped_linear(
                x.contiguous(),
                getattr(self, f"{name}_packed"),
                group_ends,
                bias,
                self.out_features[name],
            )
        y = grouped_linear(x, getattr(self, name), group_ends, backend)
        return y if bias is None else y + bias[row_expert]

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] float32
        experts: torch.Tensor,  # [T, k] int64
        counts: torch.Tensor,  # [E] rows routed to each expert (bincount of experts)
    ) -> torch.Tensor:
        T, k = experts.shape
        if self.packed_target is not None and x.is_cpu:
            backend = None
        else:
            backend = self.backend or (
                "grouped_mm" if grouped_mm_works(x.device.type, x.dtype) else "loop"
            )
        # rows r = t * k + j of the flattened choices, sorted by expert: order[i] is the i-th row
        # in expert order; rows of expert e are order[group_ends[e-1] : group_ends[e]]
        order = experts.reshape(-1).argsort(stable=True)  # [T * k]
        group_ends = counts.cumsum(0)  # [E]
        if backend is not None:
            group_ends = group_ends.to(torch.int32)  # grouped_mm's offsets
        rows = x[order // k]  # [T * k, H]
        row_expert = experts.reshape(-1)[order]  # [T * k], ascending (the biases' rows)
        h = self._project(
            rows, "gate_up_proj", group_ends, backend, row_expert
        )  # [T * k, 2I]
        h = expert_act_and_mul(h, self.act, self.limit, self.alpha)
        y = self._project(h, "down_proj", group_ends, backend, row_expert)  # [T * k, H]
        out = torch.empty_like(y, dtype=torch.float32)
        out[order] = (
            y.float() * weights.reshape(-1)[order, None]
        )  # back to row order t * k + j
        return (
            row_sum(out.view(T, k, -1).transpose(1, 2)).squeeze(-1).to(x.dtype)
        )  # each row's k in order

    def load(self, name: str, tensor: torch.Tensor) -> tuple[str, int]:
        """Copy one checkpoint tensor in: a stacked one under our own name (`gate_up_proj`, ...,
        already in our layout) or one expert's `{e}.{gate,up,down}_proj.{weight,bias}`. Returns the
        parameter it filled and how many of its `num_pieces` that was."""
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            param = getattr(self, name, None)
            if not isinstance(param, nn.Parameter):
                raise ValueError(f"unexpected expert weight {name!r}")
            _copy(param, tensor, name)
            return name, self.num_pieces(name)
        e, proj, kind = int(match[1]), match[2], match[3]
        stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        target = stacked if kind == "weight" else f"{stacked}_bias"
        param = getattr(self, target)
        if param is None or e >= self.num_experts:
            raise ValueError(f"unexpected expert weight {name!r}")
        dst = param.data[e]
        if proj != "down_proj":  # gate rows first, then up rows
            dst = (
                dst[: self.intermediate_size]
                if proj == "gate_proj"
                else dst[self.intermediate_size :]
            )
        _copy(dst, tensor, name)
        return target, 1

    def num_pieces(self, name: str) -> int:
        """Per-expert checkpoint tensors that make up our stacked parameter `name`."""
        return self.num_experts * (2 if name.startswith("gate_up_proj") else 1)


def _copy(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(
            f"expert weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


class MoE(nn.Module):
    """A mixture-of-experts MLP in place of a decoder layer's dense one: [T, H] -> [T, H]."""

    expert_load: torch.Tensor  # a buffer

    def __init__(self, hidden_size: int, cfg: MoEConfig, mlp_bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.route = get_routing(cfg.routing)
        self.gate = Router(hidden_size, cfg)
        self.experts = Experts(hidden_size, cfg)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_intermediate_size:
            act = check_activation(cfg.expert_act, "MoE shared expert")
            self.shared_expert = MLP(
                hidden_size, cfg.shared_intermediate_size, act, mlp_bias
            )
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        # tokens routed to each expert since the last reset; a buffer so that it follows .to(device)
        self.register_buffer(
            "expert_load",
            torch.zeros(cfg.num_experts, dtype=torch.int64),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        logits = self.gate(x)  # [T, E]
        weights, experts = self.route(
            logits, self.cfg, self.gate.e_score_correction_bias
        )
        counts = torch.bincount(
            experts.reshape(-1), minlength=self.cfg.num_experts
        )  # [E]
        self.expert_load += counts
        out = self.experts(x, weights, experts, counts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = sigmoid32(self.shared_expert_gate(x)).to(shared.dtype) * shared
            out = out + shared
        return out
