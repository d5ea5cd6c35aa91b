"""Which part of each weight a rank holds (`ShardPlan`), decided from the config alone.

Tensor parallel (tp_size N), per decoder layer:

    attention  q/k/v rows: the rank's heads (column parallel)    o_proj columns: the same heads (row parallel)
    dense MLP  gate/up rows: a slice of the intermediate        down_proj columns: that slice
    embedding  rows of a vocabulary slice (vocabulary parallel); LM head the same rows, logits gathered

Heads: with at least as many KV heads as ranks, rank r holds KV heads [r * KV // N, (r + 1) * KV // N)
and the query heads that read them (uneven splits allowed: 9 heads over 2 ranks = 3 KV heads as 1 + 2,
query heads 3 + 6); with fewer KV heads than ranks, each rank holds one KV head (replicated, N / KV
ranks share it) and num_heads / N query heads of its group.

Engram tables (DeepSeek-V4.1) are split by rows over every rank: rank r holds rows [r * R // N,
(r + 1) * R // N) of each table, looks up the rows of the step's n-grams that fall there (zeros
elsewhere), and one all-reduce of [T, tables, dim] gives every rank every row.

Mixture-of-experts layers are split over every rank (`world_size` = max(tp, ep)) even when the
attention is replicated: with ep_size 1 each expert's intermediate is sliced like a dense MLP's;
with ep_size N each rank holds whole experts (`strata.distributed.layers.EPExperts`). The shared
expert is sliced either way. Each split sublayer ends in ONE all-reduce of its [T, hidden] output
(a forward hook on the attention / MLP module, installed by `install`). A row-parallel bias is kept
by rank 0 only (the others hold zeros), so the sum adds it once.

The checkpoint tensors are sliced as they stream from the files (`shard_tensor`: one whole tensor
at a time, then only the rank's part is kept); the model is built from `local_config` (its heads,
intermediate sizes and vocabulary slice), so the module code is the one every single-process model
runs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from strata.model_config import ModelConfig
from strata.models import family_spec

_LAYER = re.compile(r"layers\.(\d+)\.")


def split_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous part of n items split as evenly as possible."""
    return rank * n // size, (rank + 1) * n // size


@dataclass(frozen=True)
class HeadSplit:
    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_split(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadSplit:
    """The query and KV heads rank holds (see the module docstring)."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads do not divide into {num_kv_heads} KV heads"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_end = split_range(num_kv_heads, rank, size)
        return HeadSplit(
            kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start
        )
    if size % num_kv_heads or num_heads % size:
        raise ValueError(
            f"--tp-size {size} cannot split {num_heads} query heads over {num_kv_heads} KV heads: with fewer KV "
            f"heads than ranks the ranks must be a multiple of the KV heads and divide the query heads"
        )
    per_rank = num_heads // size
    return HeadSplit(rank * per_rank, per_rank, rank // (size // num_kv_heads), 1)


def check_supported(cfg: ModelConfig, tp_size: int, ep_size: int) -> None:
    """ValueError, naming what is missing, for a model this split cannot run."""
    world = max(tp_size, ep_size)
    if world == 1:
        return
    if min(tp_size, ep_size) not in (1, world):
        raise ValueError(
            f"--tp-size {tp_size} and --ep-size {ep_size}: each must be 1 or the other's value"
        )
    spec = family_spec(cfg.architecture)
    experts_only = spec.expert_parallel and not spec.tensor_parallel
    if experts_only and tp_size > 1:
        raise ValueError(
            f"--tp-size: {cfg.architecture}'s attention does not split over ranks yet; "
            "--ep-size N runs it over N ranks with the attention replicated and the experts "
            "(and any Engram tables) split"
        )
    if not (spec.tensor_parallel or experts_only):
        raise ValueError(
            f"tensor/expert parallel does not cover {cfg.architecture} ({spec.name}) yet; run it with one rank"
        )
    if cfg.qk_norm == "full":
        raise ValueError(
            f"{cfg.architecture} normalises q/k over all heads at once; tensor parallel does not split it"
        )
    if ep_size > 1 and cfg.moe is None:
        raise ValueError(
            "--ep-size shards a mixture-of-experts model's experts; this model has none"
        )
    if tp_size > 1:
        head_split(
            cfg.num_heads, cfg.num_kv_heads, 0, tp_size
        )  # raises when the heads cannot split


@dataclass(frozen=True)
class ShardPlan:
    """One rank's part of the model. `placement` (expert parallel): the logical expert in each
    physical expert slot, `num_slots` = len(placement) = world_size * slots per rank."""

    cfg: ModelConfig  # the whole model's
    rank: int
    tp_size: int
    ep_size: int
    renames: tuple[
        tuple[str, str], ...
    ] = ()  # the family's checkpoint renames (before matching names)
    placement: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def heads(self) -> HeadSplit:
        cfg = self.cfg
        if self.tp_size == 1:
            return HeadSplit(0, cfg.num_heads, 0, cfg.num_kv_heads)
        return head_split(cfg.num_heads, cfg.num_kv_heads, self.rank, self.tp_size)

    @property
    def vocab_shard(self) -> int:
        """Rows of the vocabulary each rank holds (the last rank's tail padded with zero rows)."""
        return -(-self.cfg.vocab_size // self.tp_size)

    def local_config(self) -> ModelConfig:
        """The config the rank's modules are built from: its heads, slices and vocabulary rows."""
        cfg, h = self.cfg, self.heads
        changes: dict = {"num_heads": h.num_q, "num_kv_heads": h.num_kv}
        if self.tp_size > 1:
            lo, hi = split_range(cfg.intermediate_size, self.rank, self.tp_size)
            changes.update(intermediate_size=hi - lo, vocab_size=self.vocab_shard)
        if cfg.moe is not None and self.world_size > 1:
            moe = cfg.moe
            lo, hi = split_range(
                moe.shared_intermediate_size, self.rank, self.world_size
            )
            moe_changes: dict[str, Any] = {"shared_intermediate_size": hi - lo}
            if self.ep_size == 1:
                lo, hi = split_range(moe.intermediate_size, self.rank, self.world_size)
                moe_changes["intermediate_size"] = hi - lo
            changes["moe"] = dataclasses.replace(moe, **moe_changes)
        v4 = cfg.dsv4
        if v4 is not None and v4.engram is not None and self.world_size > 1:
            engram = dataclasses.replace(v4.engram, shard_rows=self.engram_rows)
            changes["dsv4"] = dataclasses.replace(v4, engram=engram)
        return dataclasses.replace(cfg, **changes)

    @property
    def engram_rows(self) -> tuple[int, int]:
        """Rows [start, end) of every Engram table this rank holds (they split over all ranks)."""
        assert self.cfg.dsv4 is not None and self.cfg.dsv4.engram is not None
        return split_range(self.cfg.dsv4.engram.table_size, self.rank, self.world_size)

    # ------------------------------------------------------------------ checkpoint tensors

    def shard_tensor(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of one checkpoint tensor (the tensor itself where it is replicated)."""
        name = hf_name
        for old, new in self.renames:
            name = name.replace(old, new)
        parts = name.split(".")
        leaf, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else (name, "")
        tp, world = self.tp_size, self.world_size
        if (
            name.endswith(("embed_tokens.weight", "lm_head.weight"))
            and ".layers." not in name
        ):
            return self._vocab_rows(tensor) if tp > 1 else tensor
        match = _LAYER.search(name)
        if match is None:
            return tensor
        if name.endswith(".engram.embedding") and world > 1:
            lo, hi = (
                self.engram_rows
            )  # [num_tables, table_size, dim]: rows split over the ranks
            return tensor[:, lo:hi]
        moe_layer = self.cfg.layers[int(match[1])].moe
        if tp > 1 and leaf in ("qkv_proj", "gate_up_proj") and ".experts." not in name:
            raise ValueError(
                f"{hf_name!r}: this checkpoint stores fused projections; tensor parallel slices q/k/v "
                "and gate/up separately (run it with --tp-size 1)"
            )
        if ".self_attn." in name:
            if tp == 1:
                return tensor
            h, hd = self.heads, self.cfg.head_dim
            if leaf == "q_proj":
                return tensor[h.q_start * hd : (h.q_start + h.num_q) * hd]
            if leaf in ("k_proj", "v_proj"):
                return tensor[h.kv_start * hd : (h.kv_start + h.num_kv) * hd]
            if leaf == "o_proj":
                return self._row_parallel(
                    tensor, kind, h.q_start * hd, (h.q_start + h.num_q) * hd
                )
            if leaf == "sinks":
                return tensor[h.q_start : h.q_start + h.num_q]
            return tensor  # per-head q/k norms: the same for every head
        if ".experts." in name:
            if self.ep_size > 1:
                return tensor  # whole experts: EPExperts.load keeps the ones in this rank's slots
            assert self.cfg.moe is not None  # experts belong to an MoE model
            return self._sliced(
                tensor, leaf, kind, self.cfg.moe.intermediate_size, world, stacked=True
            )
        if ".shared_expert." in name or ".shared_experts." in name:
            assert self.cfg.moe is not None
            return self._sliced(
                tensor, leaf, kind, self.cfg.moe.shared_intermediate_size, world
            )
        if (
            ".mlp." in name
            and not moe_layer
            and leaf in ("gate_proj", "up_proj", "down_proj")
            and tp > 1
        ):
            return self._sliced(tensor, leaf, kind, self.cfg.intermediate_size, tp)
        return tensor  # norms, the router, a shared expert's gate: replicated

    def _sliced(
        self,
        tensor: torch.Tensor,
        leaf: str,
        kind: str,
        size: int,
        ranks: int,
        stacked: bool = False,
    ):
        """A gated MLP's projection sliced along its intermediate dimension of `size`."""
        lo, hi = split_range(size, self.rank, ranks)
        if leaf in ("gate_proj", "up_proj"):
            return tensor[lo:hi]
        if leaf == "down_proj":
            return self._row_parallel(tensor, kind, lo, hi)
        if stacked:
            raise ValueError(
                f"expert weight {leaf}.{kind} is stored stacked; tensor parallel slices per-expert ones"
            )
        return tensor

    def _row_parallel(
        self, tensor: torch.Tensor, kind: str, lo: int, hi: int
    ) -> torch.Tensor:
        """Input columns [lo, hi) of a row-parallel weight; its bias on rank 0 only."""
        if kind == "bias":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor[:, lo:hi]

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        shard = self.vocab_shard
        rows = tensor[self.rank * shard : (self.rank + 1) * shard]
        if rows.shape[0] < shard:
            pad = tensor.new_zeros(shard - rows.shape[0], *tensor.shape[1:])
            rows = torch.cat([rows, pad])
        return rows
