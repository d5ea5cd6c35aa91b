"""Block-quantized linears of the default model (SmolLM2-135M): the int8 dot products vs AMX int8 tiles.

    python scripts/bench_int8_tiles.py                     # rows 16 64 128 512 2048, 3 rounds
    python scripts/bench_int8_tiles.py --rows 64 --rounds 5

Each distinct weight shape of the model (its q4 linears and the q8 head) is timed at each row count
on both paths, the paths alternating within a round; reports the median over rounds of each path's
median call (ms, all threads) and their ratio, and beside them oneDNN's bf16 matmul of the same
shape (torch's, which takes AMX bf16 tiles on such CPUs). Needs a CPU with AMX (exits otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F

from strata import Engine, kernels
from strata.layers.quant import QuantLinear, median_call_ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine()
    ops = kernels.cpu_ops()
    if ops is None or not ops.int8_tiles_available():
        sys.exit(
            "no AMX int8 tiles here (the CPU lacks amx_int8, or the OS refused them)"
        )
    saved = ops.int8_tile_rows()
    shapes: dict[tuple[str, int, int], QuantLinear] = {}
    for module in engine.model.modules():
        if isinstance(module, QuantLinear):
            shapes.setdefault(
                (module.format, module.out_features, module.in_features), module
            )
    print(
        "format  N x K          rows  dot products ms  tiles ms  dot / tiles  oneDNN bf16 ms"
    )
    gen = torch.Generator().manual_seed(0)
    for (fmt, n, k), layer in sorted(shapes.items()):
        weight = torch.randn(n, k, generator=gen).bfloat16()
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            repeats = 20 if rows <= 128 else 5
            times: dict[str, list[float]] = {"dot": [], "tiles": [], "onednn": []}
            for _ in range(args.rounds):
                for path, tile_rows in (("dot", 0), ("tiles", 1)):
                    ops.set_int8_tile_rows(tile_rows, tile_rows)
                    times[path].append(
                        median_call_ms(partial(layer.kernel_mm, ops, x), repeats)
                    )
                times["onednn"].append(
                    median_call_ms(partial(F.linear, x, weight), repeats)
                )
            dot, tiles, onednn = (
                statistics.median(times[p]) for p in ("dot", "tiles", "onednn")
            )
            print(
                f"{fmt:6}  {n:5} x {k:<5}  {rows:5}  {dot:15.3f}  {tiles:8.3f}  {dot / tiles:10.2f}x"
                f"  {onednn:14.3f}"
            )
    ops.set_int8_tile_rows(*saved)
    engine.close()


if __name__ == "__main__":
    main()
