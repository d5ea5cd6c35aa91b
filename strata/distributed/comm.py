"""The process groups of one tensor/expert-parallel replica and the collectives its layers use.

Two groups over the same ranks, both made by `torch.distributed` from one TCPStore that rank 0
hosts on a local port:

- the compute group (gloo on the CPU, NCCL on GPUs): the layers' all-reduces and the logits'
  all-gather, each bounded by `timeout_s` (--dist-timeout), so a rank that dies or stalls turns into
  a `RankFailure` instead of a hang;
- the control group (gloo, CPU tensors): rank 0's per-step broadcast of the batch (msgspec bytes,
  `strata.distributed.messages`). Workers wait on it while the server idles, so their timeout on it
  is long; rank 0's is `timeout_s` (each process's timeout is its own).

Start-up goes through the store, not a collective: a worker sets `started/<rank>` before the
groups' rendezvous and `loaded/<rank>` once its shard is in memory; rank 0 waits for those keys
(while its workers live) before joining and before its first broadcast, so a worker that dies while
starting fails at once and a slow load is never mistaken for a stalled rank.

The groups are `torch.distributed`'s default group and its subgroups, of which a process has one
set: a process is rank 0 of at most one replica at a time. `close` leaves them, so the process can
start another replica afterwards; `check_free` refuses a second while one is open.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from strata.distributed.errors import RankFailure

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(
    days=30
)  # a worker may wait this long for rank 0's next step
STARTUP_TIMEOUT_S = 300.0  # for every rank to join


def check_free() -> None:
    """Raises if this process is already in a process group (another split Engine not closed yet)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already runs a tensor/expert-parallel replica (torch.distributed is initialized, "
            "and a process holds one set of groups): close() that Engine before starting another with "
            "--tp-size/--ep-size > 1, or start the second in its own process"
        )


class Comm:
    """This process's rank in its replica and the collectives over it."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.TCPStore,
        device: torch.device,
        timeout_s: float,
    ):
        """Joins the groups; returns once every rank has (rank 0 starts the workers before this)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s
        self.store = store
        self.failed: str | None = (
            None  # set by the first collective that failed; the group is then unusable
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        # joining waits for every rank to start (imports, CUDA): longer than a collective may take
        dist.init_process_group(
            backend,
            store=self.store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
        )
        self.closed = False
        try:
            self.group = dist.new_group(
                backend=backend, timeout=datetime.timedelta(seconds=timeout_s)
            )
            # a worker waits on the control group for as long as the server idles; rank 0's sends on it
            # are bounded like any collective (gloo's send waits for the receiver to take it)
            control_timeout = (
                datetime.timedelta(seconds=timeout_s) if rank == 0 else CONTROL_TIMEOUT
            )
            self.control = dist.new_group(backend="gloo", timeout=control_timeout)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def make_store(
        host: str, port: int, world_size: int, is_master: bool, timeout_s: float
    ) -> dist.TCPStore:
        """Rank 0 hosts the store (port 0: any free port, then `store.port`); workers connect to it."""
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
            wait_for_workers=False,
        )

    def run(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), a collective: its failure becomes a RankFailure (and marks the group failed)."""
        try:
            return fn(*args, **kwargs)
        except RankFailure:
            raise
        except Exception as exc:  # gloo/NCCL: a closed connection, a timeout
            self.failed = (
                f"rank {self.rank}: {what} failed (a rank died or stalled): {exc}"
            )
            raise RankFailure(self.failed) from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns the tensor."""
        self.run("all-reduce", dist.all_reduce, tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n], rank r's part at columns [r * n, (r + 1) * n)."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.run("all-gather", dist.all_gather, parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)

    def send_bytes(self, payload: bytes) -> None:
        """Rank 0: broadcast one message on the control group."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self.run("step broadcast", dist.broadcast, size, 0, group=self.control)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.run("step broadcast", dist.broadcast, data, 0, group=self.control)

    def recv_bytes(self) -> bytes:
        """A worker: the next message rank 0 broadcasts (waits as long as the control group allows)."""
        size = torch.empty(1, dtype=torch.int64)
        self.run("waiting for rank 0", dist.broadcast, size, 0, group=self.control)
        data = torch.empty(int(size), dtype=torch.uint8)
        self.run("waiting for rank 0", dist.broadcast, data, 0, group=self.control)
        return data.numpy().tobytes()

    def mark(self, key: str) -> None:
        self.store.set(f"{key}/{self.rank}", "1")  # only its presence is read

    def marked(self, key: str, ranks: list[int]) -> bool:
        """Rank 0: whether each of `ranks` has set `key` (does not wait)."""
        return self.run(
            f"reading {key}", self.store.check, [f"{key}/{r}" for r in ranks]
        )

    def barrier(self) -> None:
        self.run("barrier", dist.barrier, group=self.control)

    def close(self) -> None:
        """Leaves the groups (once), so this process may join another replica's."""
        if self.closed:
            return
        self.closed = True
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 -- a broken group cannot always be torn down cleanly
            logger.warning(
                "leaving the process groups failed (%s); this process may not start another "
                "tensor/expert-parallel replica",
                exc,
            )
