"""A worker rank (1 .. N - 1) of a tensor/expert-parallel replica: `python -m strata.distributed.worker`.

Started by rank 0 (`strata.distributed.runtime.ParallelRuntime`) with a `WorkerInit` as JSON on
stdin. It joins the groups, loads its shard of the model, allocates its shard of the KV pool that
rank 0 sized, then runs what rank 0 broadcasts, step by step, until a `Stop`:

    Step       rebuild the step's attention metadata, run the forward (its collectives pair with
               rank 0's), compute the logits rows when rank 0 samples (the gather needs every rank)
    Placement  load the experts of a new expert placement into this rank's slots

A split draft model (`WorkerInit.draft`) is a second `Part`: loaded after the target, its own KV
pool, and the `Step`, `KVLayout` and `Placement` messages that name it (`model == DRAFT`).

It schedules nothing and samples nothing. It dies with rank 0 (PR_SET_PDEATHSIG), and exits when a
collective fails, so no worker outlives its replica.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from strata.distributed import messages as msg
from strata.distributed.comm import Comm
from strata.distributed.errors import RankFailure
from strata.distributed.sharding import ShardPlan
from strata.process import die_with_parent, settle_heap

logger = logging.getLogger("strata.worker")


def build_step(step: msg.Step, page_size: int, device: torch.device):
    """(input_ids, positions, attention metadata, sample rows or None) of a broadcast step."""
    from strata.layers.attention import AttentionMetadata

    batch = len(step.q_lens)
    attn = AttentionMetadata.build(
        step.q_lens,
        step.kv_lens,
        msg.from_bytes(step.page_table, batch),
        page_size,
        step.num_decode,
        device,
    )
    attn.out_slots = msg.from_bytes(step.out_slots).to(device)
    for g in step.groups:
        meta = attn.with_page_table(msg.from_bytes(g.page_table, batch))
        meta.key_floor = None if g.key_floor is None else msg.from_bytes(g.key_floor)
        attn.groups.append(meta)
    sample_rows = (
        None
        if step.sample_rows is None
        else msg.from_bytes(step.sample_rows).to(device)
    )
    return msg.from_bytes(step.input_ids).to(device), attn.positions, attn, sample_rows


@dataclass
class Part:
    """One model this rank holds a shard of (the target, or a split draft model) and its KV."""

    plan: ShardPlan
    model: torch.nn.Module
    model_dir: str
    kv: Any = None
    page_size: int = 0


class Worker:
    def __init__(self, init: msg.WorkerInit):
        self.device = torch.device(init.device)
        world = max(init.tp_size, init.ep_size)
        store = Comm.make_store(init.host, init.port, world, False, init.timeout_s)
        store.set(
            f"started/{init.rank}", b"1"
        )  # rank 0 waits for this before the group's rendezvous
        self.comm = Comm(init.rank, world, store, self.device, init.timeout_s)
        self.dtype = getattr(torch, init.dtype)
        self.parts = [self._load(init, init.model_dir, init.placement)]
        if init.draft is not None:  # loaded in the order rank 0 loads them
            self.parts.append(
                self._load(init, init.draft.model_dir, init.draft.placement)
            )
        self.comm.mark("loaded")

    @property
    def plan(self) -> ShardPlan:
        return self.parts[msg.TARGET].plan

    @property
    def kv(self):
        return self.parts[msg.TARGET].kv

    def _load(self, init: msg.WorkerInit, model_dir: str, placement: list[int]) -> Part:
        from strata.distributed.layers import ShardedLoad
        from strata.models import config_from_dir, get_model_class
        from strata.weights.loader import load_model

        cfg = config_from_dir(model_dir)
        plan = ShardPlan(
            cfg,
            init.rank,
            init.tp_size,
            init.ep_size,
            get_model_class(cfg.architecture).RENAMES,
            tuple(placement),
        )
        model = load_model(
            Path(model_dir),
            cfg,
            self.dtype,
            self.device,
            max_positions=init.context_len,
            quantization=init.quantization,
            shard=ShardedLoad(plan, self.comm),
        )
        return Part(plan, model, model_dir)

    def make_kv(self, layout: msg.KVLayout) -> None:
        from strata.cache.dsv4_pool import DSV4KVPool
        from strata.cache.kv_pool import MHAKVPool

        part = self.parts[layout.model]
        local = part.plan.local_config()
        part.page_size = layout.page_size
        if (
            local.dsv4 is not None
        ):  # attention replicated: every rank holds the whole state
            part.kv = DSV4KVPool(
                local.dsv4,
                local.head_dim,
                layout.num_pages,
                layout.page_size,
                layout.group_pages,
                getattr(torch, layout.kv_dtype),
                self.device,
            )
            return
        part.kv = MHAKVPool(
            layout.layer_windows,
            local.num_kv_heads,
            local.head_dim,
            layout.num_pages,
            layout.page_size,
            getattr(torch, layout.kv_dtype),
            self.device,
            group_pages=layout.group_pages,
        )

    @torch.inference_mode()
    def run_step(self, step: msg.Step) -> None:
        part = self.parts[step.model]
        ids, positions, attn, sample_rows = build_step(
            step, part.page_size, self.device
        )
        if step.ngram_ids is None:
            hidden = part.model(ids, positions, attn, part.kv)
        else:  # an Engram model: hash (and gather) this rank's rows as rank 0 did
            ngrams = part.model.prepare_ngrams(msg.from_bytes(step.ngram_ids, len(ids)))
            hidden = part.model(ids, positions, attn, part.kv, ngrams)
        if sample_rows is not None:
            part.model.compute_logits(hidden[sample_rows])

    def read_pages(self, pages: list[int]) -> None:
        from strata.distributed.kv import pad_heads

        mine, _ = self.kv.read_pages(pages)
        width = max(
            ShardPlan(
                self.plan.cfg, r, self.plan.tp_size, self.plan.ep_size
            ).heads.num_kv
            for r in range(self.comm.world_size)
        )
        self.comm.run(
            "page gather",
            dist.gather,
            pad_heads(mine, width),
            None,
            0,
            group=self.comm.control,
        )

    def write_pages(
        self, pages: list[int], group_pages: list[list[int]] | None = None
    ) -> None:
        from strata.distributed.kv import own_heads

        if (
            self.plan.tp_size == 1
        ):  # attention replicated: the pages whole, as rank 0 stores them
            full = torch.empty(len(pages), *self.kv.page_shape, dtype=self.kv.dtype)
            self.comm.run(
                "page broadcast", dist.broadcast, full, 0, group=self.comm.control
            )
            if group_pages is not None:  # where each window group keeps these pages
                maps = [
                    np.full(self.kv.num_pages, -1, dtype=np.int64) for _ in group_pages
                ]
                for m, ids in zip(maps, group_pages):
                    m[pages] = ids
                self.kv.attach_page_maps(maps)
            self.kv.write_pages(pages, full)
            return
        layers, parts, ps, _, dim = self.kv.page_shape
        full = torch.empty(
            len(pages),
            layers,
            parts,
            ps,
            self.plan.cfg.num_kv_heads,
            dim,
            dtype=self.kv.dtype,
        )
        self.comm.run(
            "page broadcast", dist.broadcast, full, 0, group=self.comm.control
        )
        self.kv.write_pages(pages, own_heads(full, self.plan.heads))

    def apply_placement(self, message: msg.Placement) -> None:
        from strata.distributed.eplb import load_placements

        part = self.parts[message.model]
        load_placements(part.model, part.model_dir, message.placements, self.dtype)

    def loop(self) -> None:
        while True:
            message = msg.decode(self.comm.recv_bytes())
            if isinstance(message, msg.Step):
                self.run_step(message)
            elif isinstance(message, msg.KVLayout):
                self.make_kv(message)
                self.comm.barrier()  # ready
            elif isinstance(message, msg.Placement):
                self.apply_placement(message)
                self.comm.barrier()
            elif isinstance(message, msg.ReadPages):
                self.read_pages(message.pages)
            elif isinstance(message, msg.WritePages):
                self.write_pages(message.pages, message.group_pages)
            elif isinstance(message, msg.Stop):
                return


def main() -> int:
    init = msgspec.json.decode(sys.stdin.buffer.read(), type=msg.WorkerInit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when a worker stops
    die_with_parent(init.parent_pid)
    logging.basicConfig(
        level=init.log_level,
        format=f"%(asctime)s rank {init.rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(init.num_threads)
    if init.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(init.device))
    worker = None
    try:
        worker = Worker(init)
        settle_heap()
        worker.loop()
    except RankFailure as exc:
        logger.error("%s; exiting", exc)
        return 1
    finally:
        if worker is not None:
            worker.comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
