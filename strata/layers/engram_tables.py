"""Where Engram's tables live (`--engram-placement`, `strata.layers.engram`):

    memory  parameters of the model, on its device; each Engram layer indexes them in the forward
    host    a host pool outside the model (pinned where the model runs on a GPU), filled at load
    mmap    the checkpoint file itself, memory-mapped: only the rows read become resident

host and mmap gather a step's rows ahead: the rows depend on token ids only, so `start` is called
when the batch is prepared and a worker thread gathers each Engram layer's rows, in layer order,
while the forward runs the layers before it; the layer waits for its rows. All three give the same
rows (a table cast to the model's dtype at load, or each gathered row cast the same way).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open


def table_rows(
    table: torch.Tensor, indices: torch.Tensor, start: int | None = None
) -> torch.Tensor:
    """table [num_tables, rows, dim]: the rows at `indices` [T, num_tables] -> [T, num_tables, dim].
    `start`: the table holds only rows [start, start + rows) of each (split over ranks); rows another
    rank holds come back as zeros. None: it holds every row."""
    tables = torch.arange(indices.shape[1], device=indices.device)
    if start is None:
        return table[tables, indices]
    local = indices - start
    inside = (local >= 0) & (local < table.shape[1])
    rows = table[tables, local.clamp(0, table.shape[1] - 1)]
    return rows * inside.unsqueeze(-1).to(rows.dtype)


class OffloadedTables:
    """Engram tables outside the model: {layer: [num_tables, rows, dim]} in any dtype, rows handed
    over in `dtype`; `rows`: the [start, end) of each table they hold where the tables are split over
    ranks (rows elsewhere come back as zeros), None: every row.

    Contract: `start` is called by the thread that runs the steps, once per step and in step order;
    it does not block. The futures it returns hold [T, num_tables, dim] rows on the host, and raise
    what the gather raised (an unreadable mapped file fails that step). The tables are never written."""

    def __init__(
        self,
        tables: dict[int, torch.Tensor],
        dtype: torch.dtype,
        pin: bool,
        rows: tuple[int, int] | None = None,
    ):
        self.tables = tables
        self.dtype = dtype
        self.pin = pin
        self.rows = rows
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="engram-gather")

    def start(self, indices: dict[int, torch.Tensor]) -> dict[int, Future]:
        """Gather every layer's rows ([T, num_tables] indices on the CPU) on the worker thread."""
        return {
            layer: self._worker.submit(self._gather, layer, idx)
            for layer, idx in sorted(indices.items())
        }

    def _gather(self, layer: int, indices: torch.Tensor) -> torch.Tensor:
        start = None if self.rows is None else self.rows[0]
        rows = table_rows(self.tables[layer], indices, start).to(self.dtype)
        return rows.pin_memory() if self.pin else rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables.values())

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def host_tables(
    files: list[Path],
    names: dict[str, int],
    dtype: torch.dtype,
    pin: bool,
    rows: tuple[int, int] | None = None,
) -> OffloadedTables:
    """The named checkpoint tensors ({name: layer}) read into host memory in `dtype` (only rows
    [start, end) of each table where `rows` says)."""
    tables: dict[int, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a mapping
                if name in names:
                    # a copy: safetensors may hand back a view of its file mapping
                    t = (
                        f.get_tensor(name)
                        if rows is None
                        else f.get_slice(name)[:, rows[0] : rows[1]]
                    ).to(dtype, copy=True)
                    tables[names[name]] = t.pin_memory() if pin else t
    _check_complete(tables, names)
    return OffloadedTables(tables, dtype, pin, rows)


# safetensors dtype -> (numpy dtype of the stored bytes, torch dtype they are viewed as)
_STORED = {
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
    "F64": (np.float64, torch.float64),
}


def mmap_tables(
    files: list[Path],
    names: dict[str, int],
    dtype: torch.dtype,
    pin: bool,
    rows: tuple[int, int] | None = None,
) -> OffloadedTables:
    """The named checkpoint tensors mapped from their files (copy-on-write, never written): the
    safetensors header gives each tensor's byte range, which becomes a numpy memmap viewed by torch."""
    tables: dict[int, torch.Tensor] = {}
    for path in files:
        for name, (stored, shape, offset) in _safetensors_layout(path).items():
            if name not in names:
                continue
            if stored not in _STORED:
                raise ValueError(
                    f"--engram-placement mmap cannot map {name} ({stored} in {path.name}); "
                    f"mappable dtypes: {sorted(_STORED)}; use --engram-placement host"
                )
            np_dtype, torch_dtype = _STORED[stored]
            array = np.memmap(
                path, dtype=np_dtype, mode="c", offset=offset, shape=tuple(shape)
            )
            # rows are read at random: no read-ahead, or each row read faults in its neighbours
            array._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]
            table = torch.from_numpy(array).view(torch_dtype)
            # split over ranks: a view of this rank's rows; the others' are never touched
            tables[names[name]] = table if rows is None else table[:, rows[0] : rows[1]]
    _check_complete(tables, names)
    return OffloadedTables(tables, dtype, pin, rows)


def _safetensors_layout(path: Path) -> dict[str, tuple[str, list[int], int]]:
    """{tensor name: (dtype, shape, byte offset in the file)} from a safetensors header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {
        name: (info["dtype"], info["shape"], base + info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    }


def _check_complete(tables: dict[int, torch.Tensor], names: dict[str, int]) -> None:
    if len(tables) != len(set(names.values())):
        missing = sorted(n for n, layer in names.items() if layer not in tables)
        raise ValueError(f"checkpoint is missing Engram tables: {missing[:8]}")


# --engram-placement -> how tables kept outside the model are built (memory: none are)
TABLE_PLACEMENTS: dict[str, Callable[..., OffloadedTables] | None] = {
    "memory": None,
    "host": host_tables,
    "mmap": mmap_tables,
}
