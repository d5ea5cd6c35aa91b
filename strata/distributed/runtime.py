"""Rank 0's side of a tensor/expert-parallel replica: starts the worker ranks, joins the groups,
broadcasts each step, rebalances experts, notices a dead rank, and stops the workers.

The engine process is rank 0: it loads its own shard, owns the scheduler, the allocator and the
radix cache (page ids mean the same slots in every rank's KV shard), samples, and streams outputs.
Workers (`strata.distributed.worker`) are child processes of it, one thread each by default (the
machine's cores split over the ranks), killed by the kernel if rank 0 dies.

    Engine ──► ParallelRuntime.start_kv(plan, ...)  once: workers allocate their KV shards
    ModelRunner.forward ──► send_step(fb)           every step, before rank 0's own forward
    DraftModelDrafter ──► start_draft_kv, draft_link  a split MoE draft's KV shards and steps
    Engine.step ──► before_step()                   EPLB every --eplb-interval steps (draft too)
    HiCache / PD ──► page_pool(local).read_pages    whole pages of every KV head (strata.distributed.kv)
    Engine.close ──► shutdown()                     Stop, wait, kill what is left, leave the groups
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from strata.config import EngineConfig
from strata.distributed import messages as msg
from strata.distributed.comm import STARTUP_TIMEOUT_S, Comm, check_free
from strata.distributed.eplb import (
    imbalance,
    initial_placement,
    load_placements,
    plan_placement,
    rank_loads,
)
from strata.distributed.errors import RankFailure
from strata.distributed.layers import ShardedLoad, expert_layers
from strata.distributed.sharding import ShardPlan, check_supported
from strata.layers.expert_load import expert_load_delta
from strata.model_config import ModelConfig

if TYPE_CHECKING:
    from strata.cache.kv_plan import KVPlan

logger = logging.getLogger(__name__)
STOP_WAIT_S = 10.0
EXIT_WAIT_S = 1.0  # after a failed collective, how long to wait for the rank that caused it to exit


def check_engine_options(cfg: EngineConfig) -> None:
    """What a split replica does not do yet, refused with what to change."""
    if cfg.speculative_algorithm in ("mtp", "dspark"):
        raise ValueError(
            f"--speculative-algorithm {cfg.speculative_algorithm} runs on one rank only "
            "(it reads the target's hidden states)"
        )
    if cfg.eplb_interval and cfg.ep_size == 1:
        raise ValueError(
            "--eplb-interval places experts over ranks; it needs --ep-size > 1"
        )


@dataclass
class Split:
    """One model split over the ranks: the target, or a mixture-of-experts draft model."""

    plan: ShardPlan
    shard: ShardedLoad
    model_dir: Path
    kind: int  # msg.TARGET or msg.DRAFT: what its messages say
    model: torch.nn.Module | None = None  # rank 0's shard, once loaded (attach)
    load_mark: dict[int, list[int]] = field(default_factory=dict)


def split_draft(cfg: EngineConfig) -> tuple[Path, ModelConfig] | None:
    """The draft model to split over the ranks with the target, or None (it runs on rank 0 alone).

    A mixture-of-experts draft of an expert-parallel target is split like it (its experts over the
    ranks, with --speculative-draft-ep-num-redundant-experts spare slots): its expert forwards are
    what splitting spreads. Other drafts are small enough to run whole on rank 0."""
    from strata.models import config_from_dir
    from strata.weights.default_model import resolve_model_path

    redundant = cfg.speculative_draft_ep_num_redundant_experts
    if cfg.speculative_algorithm != "draft" or cfg.ep_size == 1:
        return None
    model_dir = resolve_model_path(cfg.speculative_draft_model)
    draft = config_from_dir(model_dir)
    if draft.moe is None:
        if redundant:
            raise ValueError(
                f"--speculative-draft-ep-num-redundant-experts: the draft model {model_dir.name} "
                "has no mixture-of-experts layers (its experts are what the slots replicate)"
            )
        return None
    check_supported(draft, cfg.tp_size, cfg.ep_size)
    return model_dir, draft


class ParallelRuntime:
    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: Path,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        context_len: int,
        renames: tuple[tuple[str, str], ...],
    ):
        check_engine_options(cfg)
        check_supported(model_config, cfg.tp_size, cfg.ep_size)
        self.cfg, self.dtype = cfg, dtype
        self.world_size = world = max(cfg.tp_size, cfg.ep_size)
        placement = ()
        if cfg.ep_size > 1:
            placement = initial_placement(
                model_config.moe.num_experts, cfg.ep_num_redundant_experts, world
            )
        draft = split_draft(cfg)
        draft_placement = ()
        if draft is not None:
            draft_placement = initial_placement(
                draft[1].moe.num_experts,
                cfg.speculative_draft_ep_num_redundant_experts,
                world,
                flag="--speculative-draft-ep-num-redundant-experts",
            )
        threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // world)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        check_free()  # one replica per process: refuse before starting any worker
        store = Comm.make_store("127.0.0.1", 0, world, True, cfg.dist_timeout)
        self.procs: list[subprocess.Popen] = []
        joined: list[Comm] = []  # this rank's groups, once joined
        # if the engine never gets to shutdown() (its load failed, or it was dropped unclosed), the
        # workers and this process's groups go with this object, so the process can start another
        self._release = weakref.finalize(self, _release, self.procs, joined)
        for rank in range(1, world):
            init = msg.WorkerInit(
                model_dir=str(model_dir),
                rank=rank,
                tp_size=cfg.tp_size,
                ep_size=cfg.ep_size,
                placement=list(placement),
                host="127.0.0.1",
                port=store.port,
                device=f"cuda:{rank}" if device.type == "cuda" else str(device),
                dtype=str(dtype).removeprefix("torch."),
                quantization=cfg.quantization,
                context_len=context_len,
                num_threads=threads,
                timeout_s=cfg.dist_timeout,
                parent_pid=os.getpid(),
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                draft=None
                if draft is None
                else msg.DraftInit(str(draft[0]), list(draft_placement)),
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "strata.distributed.worker"],
                stdin=subprocess.PIPE,
            )
            self.procs.append(proc)
            # a worker whose interpreter dies at once closes the pipe first: _wait_started reports it
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(msgspec.json.encode(init))
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        try:
            self._wait_started(store)
            self.comm = Comm(0, world, store, device, cfg.dist_timeout)
        except BaseException:
            self._release()
            raise
        joined.append(self.comm)
        plan = ShardPlan(model_config, 0, cfg.tp_size, cfg.ep_size, renames, placement)
        self.target = Split(plan, ShardedLoad(plan, self.comm), model_dir, msg.TARGET)
        self.draft: Split | None = None  # a split draft model (`split_draft`)
        if draft is not None:
            from strata.models import get_model_class

            draft_renames = get_model_class(draft[1].architecture).RENAMES
            plan = ShardPlan(
                draft[1], 0, cfg.tp_size, cfg.ep_size, draft_renames, draft_placement
            )
            self.draft = Split(plan, ShardedLoad(plan, self.comm), draft[0], msg.DRAFT)
        self.failed: str | None = None
        self.steps = 0
        self.rebalances = 0
        logger.info(
            "parallel: %d ranks (tp %d, ep %d), worker pids %s, %d threads each",
            world,
            cfg.tp_size,
            cfg.ep_size,
            [p.pid for p in self.procs],
            threads,
        )

    @property
    def plan(self) -> ShardPlan:
        return self.target.plan

    @property
    def shard(self) -> ShardedLoad:
        return self.target.shard

    @property
    def model(self):
        """Rank 0's shard of the target, once loaded."""
        return self.target.model

    def splits(self) -> list[Split]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def describe(self) -> dict:
        """For /get_server_info: the split, the workers, and per MoE layer the rows each rank computed
        since the last placement (expert parallel)."""
        rank_load = (
            self.rank_load() if self.model is not None and self.cfg.ep_size > 1 else {}
        )
        draft_load = (
            self.rank_load(self.draft)
            if self.draft is not None and self.draft.model is not None
            else {}
        )
        return {
            "tp_size": self.cfg.tp_size,
            "ep_size": self.cfg.ep_size,
            "worker_pids": [p.pid for p in self.procs],
            "healthy": self.healthy,
            "rebalances": self.rebalances,
            "rank_load": _load_summary(rank_load),
            "draft_rank_load": _load_summary(draft_load),
        }

    def local_config(self) -> ModelConfig:
        return self.plan.local_config()

    def page_pool(self, local):
        """The pool as HiCache and PD see it: whole pages of every KV head, gathered from and
        scattered to the ranks (`strata.distributed.kv.ShardedKVPool`); with the attention
        replicated, rank 0's pages, written on every rank (`ReplicatedKVPool`)."""
        from strata.distributed.kv import ReplicatedKVPool, ShardedKVPool

        if self.cfg.tp_size == 1:
            return ReplicatedKVPool(local, self)
        cfg, plan = self.plan.cfg, self.plan
        splits = [
            ShardPlan(cfg, r, plan.tp_size, plan.ep_size).heads
            for r in range(self.world_size)
        ]
        return ShardedKVPool(local, self, splits, cfg.num_kv_heads)

    def start_kv(
        self, plan: KVPlan, page_size: int, kv_dtype: torch.dtype, model
    ) -> None:
        """Workers allocate their KV shards of the pool `plan` sized; returns once every rank is
        ready to step."""
        self.target.model = model
        self._wait_loaded()
        self.send(
            msg.KVLayout(
                getattr(
                    plan, "layer_windows", []
                ),  # DeepSeek-V4's plan has window groups only
                plan.num_pages,
                page_size,
                dict(plan.group_pages),
                str(kv_dtype).removeprefix("torch."),
            )
        )
        self.comm.barrier()
        self.target.load_mark = model.expert_load()

    def start_draft_kv(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_dtype: torch.dtype,
        model,
    ) -> None:
        """The split draft model's KV: each worker allocates its shard of the draft's own pool (the
        same page ids as rank 0's draft allocator). After `start_kv`."""
        assert self.draft is not None
        self.draft.model = model
        self.send(
            msg.KVLayout(
                [None] * num_layers,
                num_pages,
                page_size,
                {},
                str(kv_dtype).removeprefix("torch."),
                model=msg.DRAFT,
            )
        )
        self.comm.barrier()
        self.draft.load_mark = model.expert_load()

    def draft_link(self) -> DraftLink:
        """What the draft's ModelRunner broadcasts its steps through."""
        return DraftLink(self)

    def _wait_started(self, store) -> None:
        """Until every worker has reached the store (one that dies first, e.g. at import, fails the
        start at once instead of leaving the group's rendezvous to time out)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [f"started/{r}" for r in range(1, self.world_size)]
        while not store.check(keys):
            failed = self._exited_rank()
            if failed is not None:
                raise RankFailure(
                    f"a worker rank failed to start: {failed} (see its log above)"
                )
            if time.monotonic() > deadline:
                raise RankFailure(
                    f"the worker ranks did not start within {STARTUP_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.05)

    def _wait_loaded(self) -> None:
        """Until every worker has its shard in memory (a dead worker ends the wait at once)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        ranks = list(range(1, self.world_size))
        while not self.comm.marked("loaded", ranks):
            self.check()
            if time.monotonic() > deadline:
                raise RankFailure(
                    f"the worker ranks did not load the model within {STARTUP_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ every step

    def check(self) -> None:
        """RankFailure if a worker has exited (or an earlier collective failed)."""
        if self.failed is None:
            self.failed = self._exited_rank()
        if self.failed is None and self.comm.failed is not None:
            # a rank that exited explains a failed collective best: give a dying one a moment
            deadline = time.monotonic() + EXIT_WAIT_S
            while self.failed is None and time.monotonic() < deadline:
                time.sleep(0.05)
                self.failed = self._exited_rank()
            self.failed = self.failed or self.comm.failed
        if self.failed is not None:
            raise RankFailure(
                f"a tensor/expert-parallel rank is gone: {self.failed}; restart the server"
            )

    def _exited_rank(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    @property
    def healthy(self) -> bool:
        try:
            self.check()
        except RankFailure:
            return False
        return True

    def send_step(self, fb, model: int = msg.TARGET) -> None:
        """Broadcast one `ForwardBatch` of the target or the split draft (before rank 0 runs it)."""
        attn = fb.attn
        step = msg.Step(
            input_ids=msg.to_bytes(fb.input_ids),
            q_lens=attn.q_len.tolist(),
            kv_lens=attn.kv_len.tolist(),
            page_table=msg.to_bytes(attn.page_table),
            num_decode=attn.num_decode,
            out_slots=msg.to_bytes(attn.out_slots),
            groups=[
                msg.GroupMeta(
                    msg.to_bytes(g.page_table),
                    None if g.key_floor is None else msg.to_bytes(g.key_floor),
                )
                for g in attn.groups
            ],
            sample_rows=None if fb.sampling is None else msg.to_bytes(fb.sample_rows),
            ngram_ids=None
            if fb.ngrams is None or fb.ngrams.ids is None
            else msg.to_bytes(fb.ngrams.ids),
            model=model,
        )
        self.send(step)

    def send(self, message: msg.ToWorker) -> None:
        """Broadcast one message to the workers (RankFailure if one is gone)."""
        self.check()
        self.comm.send_bytes(msg.encode(message))

    def before_step(self) -> None:
        """At a step boundary: RankFailure if a rank is gone; every --eplb-interval steps, rebalance
        the experts."""
        self.check()
        self.steps += 1
        interval = self.cfg.eplb_interval
        if interval and self.steps % interval == 0:
            self.rebalance()

    # ------------------------------------------------------------------ EPLB

    def rank_load(self, split: Split | None = None) -> dict[int, list[int]]:
        """Rows each rank computed per MoE layer since the last reset ({layer: [rows per rank]}), of
        the target or the split draft."""
        model = (split or self.target).model
        return {i: e.rank_load.tolist() for i, e in expert_layers(model).items()}

    def reset_rank_load(self) -> None:
        for split in self.splits():
            if split.model is not None:
                for e in expert_layers(split.model).values():
                    e.rank_load.zero_()

    def rebalance(self) -> dict[int, tuple[int, ...]]:
        """Place each MoE layer's experts for the load measured since the last rebalance, on every
        rank, between two steps (running requests keep their KV and continue); a split draft's
        experts too, from its own load. Returns the target's placements."""
        if self.cfg.ep_size == 1:
            raise ValueError(
                "rebalancing places experts over ranks; it needs --ep-size > 1"
            )
        placed = [
            self._rebalance(split) for split in self.splits() if split.model is not None
        ]
        if any(placed):
            self.rebalances += 1
            self.reset_rank_load()  # the rows per rank under the new placement
        return placed[0] if placed else {}

    def draft_placements(self) -> dict[int, tuple[int, ...]]:
        """The split draft's placement per MoE layer ({} without one)."""
        if self.draft is None or self.draft.model is None:
            return {}
        return {i: e.placement for i, e in expert_layers(self.draft.model).items()}

    def _rebalance(self, split: Split) -> dict[int, tuple[int, ...]]:
        now = split.model.expert_load()
        load = expert_load_delta(now, split.load_mark) if split.load_mark else now
        layers = expert_layers(split.model)
        placements, before, after = {}, [], []
        for i, counts in load.items():
            if sum(counts) == 0:
                continue
            old = layers[i].placement
            placements[i] = plan_placement(counts, len(old), self.world_size)
            before.append(imbalance(rank_loads(counts, old, self.world_size)))
            after.append(imbalance(rank_loads(counts, placements[i], self.world_size)))
        if not placements:
            return {}
        self.send(
            msg.Placement({i: list(p) for i, p in placements.items()}, model=split.kind)
        )
        load_placements(split.model, split.model_dir, placements, self.dtype)
        self.comm.barrier()
        split.load_mark = now
        logger.info(
            "EPLB (%s): %d MoE layers placed anew; per-rank max/mean of the measured load %.2f -> %.2f (worst layer)",
            "draft" if split.kind == msg.DRAFT else "target",
            len(placements),
            max(before),
            max(after),
        )
        return placements

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop every worker: a Stop message when the group still works, then wait, then kill; then
        leave the process groups. Idempotent."""
        if not self._release.alive:
            return
        if (
            self.failed is None
            and self.comm.failed is None
            and all(p.poll() is None for p in self.procs)
        ):
            try:
                self.comm.send_bytes(msg.encode(msg.Stop()))
                for proc in self.procs:
                    proc.wait(STOP_WAIT_S)
            except (RankFailure, subprocess.TimeoutExpired):
                pass
        self._release()  # kills what did not stop (a broken group: all of it)


def _load_summary(rank_load: dict[int, list[int]]) -> dict | None:
    """Per MoE layer, the rows each rank computed and their max / mean (None: no MoE layer)."""
    return {
        i: {"rows_per_rank": rows, "max_over_mean": imbalance(rows)}
        for i, rows in rank_load.items()
    } or None


class DraftLink:
    """The split draft's ModelRunner sends its steps through this (`ModelRunner.parallel`)."""

    def __init__(self, runtime: ParallelRuntime):
        self.runtime = runtime

    def send_step(self, fb) -> None:
        self.runtime.send_step(fb, msg.DRAFT)


def _release(procs: list[subprocess.Popen], joined: list[Comm]) -> None:
    _kill_all(procs)
    for comm in joined:
        comm.close()


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
