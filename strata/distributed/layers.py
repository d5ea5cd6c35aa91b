"""The parallel pieces a sharded model needs beyond its own modules: the vocabulary-parallel
embedding and LM head, the all-reduce closing each split sublayer, and the expert-parallel experts.

`install(model, plan, comm)` puts them into a model built from `ShardPlan.local_config` and loaded
with `ShardPlan.shard_tensor` (strata.weights.loader does both when given a plan).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed.comm import Comm
from strata.distributed.sharding import ShardPlan
from strata.layers.activation import check_expert_activation, expert_act_and_mul
from strata.layers.moe import MoE, grouped_linear, grouped_mm_works
from strata.moe_config import MoEConfig


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding table; ids outside them look up zeros, and the
    all-reduce sums the one rank's row that holds each id."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [shard, hidden]
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The rank's vocabulary rows of the output projection; logits gathered over the ranks
    ([S, hidden] -> [S, tp * shard], the padding columns of the last rank at the end)."""

    def __init__(
        self, head: nn.Module | None, embedding: VocabParallelEmbedding, comm: Comm
    ):
        super().__init__()
        self.head = head  # a (possibly packed or quantized) linear; None: tied to the embedding rows
        self.embedding = [embedding]  # a plain list: not a second owner of the table
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = (
            self.head(hidden)
            if self.head is not None
            else F.linear(hidden, self.embedding[0].weight)
        )
        return self.comm.all_gather_last(local)


def _all_reduce_hook(comm: Comm):
    def hook(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(out)

    return hook


def install(model: nn.Module, plan: ShardPlan, comm: Comm) -> None:
    """After loading: one all-reduce closing each split sublayer, and the vocabulary-parallel ends."""
    cfg = plan.cfg
    for layer, spec in zip(model.layers, cfg.layers):
        if plan.tp_size > 1:
            layer.self_attn.register_forward_hook(_all_reduce_hook(comm))
        if (spec.moe and plan.world_size > 1) or (not spec.moe and plan.tp_size > 1):
            layer.mlp.register_forward_hook(_all_reduce_hook(comm))
        engram = getattr(layer, "engram", None)
        if engram is not None and plan.world_size > 1:
            engram.all_reduce = (
                comm.all_reduce
            )  # each rank looked up its rows of the tables
    if plan.tp_size > 1:
        embed = VocabParallelEmbedding(
            model.embed_tokens.weight.data, plan.rank * plan.vocab_shard, comm
        )
        model.embed_tokens = embed
        model.lm_head = ParallelLMHead(model.lm_head, embed, comm)


# ---------------------------------------------------------------------------- expert parallel

_PER_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")


class EPExperts(nn.Module):
    """This rank's physical expert slots, in place of `strata.layers.moe.Experts`.

    A placement maps each of P physical slots to a logical expert (P = E + redundant replicas); rank
    r holds slots [r * S, (r + 1) * S), S = P / world_size. Every rank sees every token (attention is
    tensor-parallel or replicated, so the hidden states are the same everywhere) and routes all of
    them identically; a (token t, expert e) row goes to replica t mod replicas(e) of e, so the rows of
    a replicated expert spread over its copies. Each rank computes the rows that landed in its slots
    and scatters them into a [T, hidden] partial sum; the layer's all-reduce adds the ranks' parts.

    Why an all-reduce and not an all-to-all: here every rank already holds every token, so there is
    nothing to dispatch; combining is one all-reduce of [T, hidden], the same collective (and bytes)
    tensor parallel spends per sublayer. An all-to-all pays off when each rank owns different tokens
    (data-parallel attention), which this engine does not do.

    `rank_load` counts the rows each rank computed since the last reset (every rank counts them
    all; rank 0's copy is what EPLB and the benchmark read).
    """

    def __init__(
        self,
        hidden_size: int,
        cfg: MoEConfig,
        placement: tuple[int, ...],
        rank: int,
        world_size: int,
    ):
        super().__init__()
        if len(placement) % world_size:
            raise ValueError(
                f"{len(placement)} expert slots do not split over {world_size} ranks"
            )
        E, I = cfg.num_experts, cfg.intermediate_size  # noqa: E741
        S = len(placement) // world_size
        self.num_experts, self.intermediate_size, self.num_slots = E, I, S
        self.rank, self.world_size = rank, world_size
        self.act = check_expert_activation(cfg.expert_act)
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.gate_up_proj = nn.Parameter(torch.empty(S, 2 * I, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(S, hidden_size, I))
        self.gate_up_proj_bias = (
            nn.Parameter(torch.empty(S, 2 * I)) if cfg.expert_bias else None
        )
        self.down_proj_bias = (
            nn.Parameter(torch.empty(S, hidden_size)) if cfg.expert_bias else None
        )
        self.register_buffer(
            "rank_load", torch.zeros(world_size, dtype=torch.int64), persistent=False
        )
        self.set_placement(placement)

    def set_placement(self, placement: tuple[int, ...]) -> None:
        """The routing tables of a placement (the slots' weights are loaded separately)."""
        E, S = self.num_experts, self.num_slots
        if sorted(set(placement)) != list(range(E)):
            raise ValueError(
                f"a placement must hold every one of the {E} experts at least once"
            )
        replicas: list[list[int]] = [[] for _ in range(E)]
        for slot, e in enumerate(placement):
            replicas[e].append(slot)
        width = max(len(r) for r in replicas)
        table = torch.tensor(
            [r + [r[0]] * (width - len(r)) for r in replicas],
            dtype=torch.int64,
            device="cpu",
        )
        self.placement = tuple(placement)
        self.replica_table = (
            table  # [E, max replicas] physical slots of each expert (padded)
        )
        self.replica_count = torch.tensor(
            [len(r) for r in replicas], dtype=torch.int64, device="cpu"
        )  # [E]
        self.slot_experts = list(
            placement[self.rank * S : (self.rank + 1) * S]
        )  # this rank's slots

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] float32
        experts: torch.Tensor,  # [T, k] int64
        counts: torch.Tensor,  # [E] (unused: this rank's own counts are per slot)
    ) -> torch.Tensor:
        T, k = experts.shape
        dev = x.device
        flat = experts.reshape(-1)  # [T * k], row r = t * k + j
        token = torch.arange(T, device=dev).repeat_interleave(k)  # [T * k]
        table, count = self.replica_table.to(dev), self.replica_count.to(dev)
        slot = table[flat, token % count[flat]]  # [T * k] physical slot of each row
        owner = slot // self.num_slots
        self.rank_load += torch.bincount(owner, minlength=self.world_size)
        mine = (owner == self.rank).nonzero().squeeze(1)  # rows computed here
        local = slot[mine] - self.rank * self.num_slots
        order = local.argsort(stable=True)
        rows, local = mine[order], local[order]  # grouped by local slot
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=dev)
        if len(rows) == 0:
            return out.to(x.dtype)
        backend = "grouped_mm" if grouped_mm_works(dev.type, x.dtype) else "loop"
        group_ends = (
            torch.bincount(local, minlength=self.num_slots).cumsum(0).to(torch.int32)
        )
        h = grouped_linear(
            x[token[rows]], self.gate_up_proj, group_ends, backend
        )  # [R, 2I]
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[local]
        h = expert_act_and_mul(h, self.act, self.limit, self.alpha)
        y = grouped_linear(h, self.down_proj, group_ends, backend)  # [R, H]
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[local]
        out.index_add_(0, token[rows], y.float() * weights.reshape(-1)[rows, None])
        return out.to(x.dtype)

    # ------------------------------------------------------------------ loading (the Experts interface)

    def load(self, name: str, tensor: torch.Tensor) -> tuple[str, int]:
        """One checkpoint tensor of the experts: copied into every local slot holding its expert."""
        match = _PER_EXPERT.fullmatch(name)
        if (
            match is None
        ):  # a stacked tensor [E, ...] in our layout (`expert_tensor` converted it)
            param = getattr(self, name, None)
            if not isinstance(param, nn.Parameter):
                raise ValueError(f"unexpected expert weight {name!r}")
            for s, e in enumerate(self.slot_experts):
                param.data[s].copy_(tensor[e])
            return name, self.num_pieces(name)
        e, proj, kind = int(match[1]), match[2], match[3]
        stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        target = stacked if kind == "weight" else f"{stacked}_bias"
        param = getattr(self, target)
        if param is None or e >= self.num_experts:
            raise ValueError(f"unexpected expert weight {name!r}")
        I = self.intermediate_size  # noqa: E741
        for s, slot_expert in enumerate(self.slot_experts):
            if slot_expert == e:
                dst = param.data[s]
                if proj != "down_proj":
                    dst = dst[:I] if proj == "gate_proj" else dst[I:]
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"expert weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
        return target, 1

    def num_pieces(self, name: str) -> int:
        return self.num_experts * (2 if name.startswith("gate_up_proj") else 1)


def use_expert_parallel(model: nn.Module, plan: ShardPlan) -> None:
    """On the meta-device model, before loading: every MoE layer's experts (`strata.layers.moe`'s,
    or a family's own with their interface, as DeepSeek-V4's) become this rank's slots."""
    for layer in model.layers:
        if isinstance(layer.mlp, MoE) or hasattr(
            getattr(layer.mlp, "experts", None), "num_pieces"
        ):
            layer.mlp.experts = EPExperts(
                plan.cfg.hidden_size,
                plan.cfg.moe,
                plan.placement,
                plan.rank,
                plan.world_size,
            )


def expert_layers(model: nn.Module) -> dict[int, EPExperts]:
    return {
        i: layer.mlp.experts
        for i, layer in enumerate(model.layers)
        if isinstance(getattr(layer.mlp, "experts", None), EPExperts)
    }


class ShardedLoad:
    """What `strata.weights.loader.load_model` asks of a parallel rank: the config to build from,
    changes to the module tree before loading, this rank's part of each checkpoint tensor, and the
    parallel pieces after loading."""

    def __init__(self, plan: ShardPlan, comm: Comm):
        self.plan, self.comm = plan, comm

    def local_config(self):
        return self.plan.local_config()

    def prepare(self, model: nn.Module) -> None:  # on the meta device
        if self.plan.ep_size > 1:
            use_expert_parallel(model, self.plan)

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.plan.shard_tensor(name, tensor)

    def install(self, model: nn.Module) -> None:
        for experts in expert_layers(model).values():
            experts.rank_load.zero_()
        install(model, self.plan, self.comm)
