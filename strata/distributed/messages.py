"""Typed messages from rank 0 to its worker ranks (msgspec; never pickle).

`WorkerInit` travels on the worker's stdin as JSON when rank 0 starts it; the others are broadcast
on the control group (`Comm.send_bytes`) as msgpack. A `Step` is one forward: what
`ModelRunner.prepare` built on rank 0, as flat arrays, from which a worker rebuilds the same
`AttentionMetadata` (primary pages, window groups, replay floors and redirected slots included).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

TARGET, DRAFT = 0, 1  # the model a KVLayout, Step or Placement is for


class DraftInit(msgspec.Struct):
    """A mixture-of-experts draft model split over the same ranks as the target."""

    model_dir: str
    placement: list[
        int
    ]  # logical expert of each physical slot (its redundant slots included)


class WorkerInit(msgspec.Struct):
    model_dir: str
    rank: int
    tp_size: int
    ep_size: int
    placement: list[int]  # expert parallel: logical expert of each physical slot
    host: str
    port: int  # rank 0's TCPStore
    device: str
    dtype: str  # the compute dtype rank 0 chose ("float32", ...)
    quantization: str
    context_len: int
    num_threads: int
    timeout_s: float
    parent_pid: int
    log_level: str = "INFO"  # rank 0's
    draft: DraftInit | None = None


class KVLayout(msgspec.Struct, tag="kv"):
    """The KV pool rank 0 sized; each rank allocates its shard (its KV heads) of the same pages."""

    layer_windows: list[int | None]
    num_pages: int
    page_size: int
    group_pages: dict[int, int]
    kv_dtype: str
    model: int = TARGET


class GroupMeta(msgspec.Struct):
    page_table: bytes  # int64 [B, max_pages] in this window group's pages
    key_floor: bytes | None  # int64 [B], or None


class Step(msgspec.Struct, tag="step"):
    input_ids: bytes  # int64 [T]
    q_lens: list[int]
    kv_lens: list[int]
    page_table: bytes  # int64 [B, max_pages]
    num_decode: int
    out_slots: (
        bytes  # int64 [T] (rank 0 may redirect replayed positions to a scratch page)
    )
    groups: list[GroupMeta]
    sample_rows: (
        bytes | None
    )  # int64 [S]: rows whose logits are computed (the gather joins); None: none
    # Engram models: int64 [T, K + 1], each token's ids at t - K .. t (`prepare_ngrams`' input)
    ngram_ids: bytes | None = None
    model: int = TARGET


class Placement(msgspec.Struct, tag="placement"):
    """Expert parallel: new placements (MoE layer -> logical expert of each physical slot), applied
    by every rank between two steps."""

    placements: dict[int, list[int]]
    model: int = TARGET


class ReadPages(msgspec.Struct, tag="read_pages"):
    """Every rank reads its heads of these pages; rank 0 gathers them (`strata.distributed.kv`)."""

    pages: list[int]


class WritePages(msgspec.Struct, tag="write_pages"):
    """Rank 0 broadcasts every head of these pages next; each rank writes its own."""

    pages: list[int]
    # a pool with window groups, attention replicated: each group's page of each of `pages` (-1:
    # the group holds none), which rank 0's allocator knows and the workers do not
    group_pages: list[list[int]] | None = None


class Stop(msgspec.Struct, tag="stop"):
    pass


ToWorker = KVLayout | Step | Placement | ReadPages | WritePages | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ToWorker)


def encode(message: ToWorker) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> ToWorker:
    return _decoder.decode(data)


def to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()


def from_bytes(data: bytes, rows: int = -1) -> torch.Tensor:
    """int64 bytes -> a CPU tensor (reshaped to [rows, -1] when rows >= 0)."""
    t = torch.from_numpy(np.frombuffer(data, dtype=np.int64).copy())
    return t if rows < 0 else t.reshape(rows, -1)
