"""Decode step time of an Engram model per table placement (--engram-placement), in one process.

Builds the tiny V4.1-style model of tests/tiny_dsv4.py with ~1 GiB of fp32 Engram tables (once,
in --model-dir), loads one engine per placement, and times `run_strata_one_batch` at each batch
size, the placements in a rotating order per round so that drift on a shared machine falls on
all of them alike. Prints the median decode step per placement and its ratio to `memory`.

    python scripts/bench_engram_placements.py --model-dir /tmp/engram1g --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PLACEMENTS = ["memory", "host", "mmap"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--table-rows", type=int, default=1_048_573)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()

    from tiny_dsv4 import add_engram, make_dsv4

    from strata import Engine
    from strata.bench.one_batch import run_strata_one_batch

    if not (args.model_dir / "engram.safetensors").exists():
        add_engram(
            make_dsv4(args.model_dir), engram_table_size=args.table_rows, engram_dim=32
        )
    engines = {
        p: Engine(
            str(args.model_dir),
            dtype="float32",
            kv_cache_tokens=8192,
            page_size=16,
            engram_placement=p,
            # fresh prompts: the cache cannot help, and its window tails would hold back the
            # next batch's admissions (see BENCHMARKS, "Engram table placements")
            disable_radix_cache=True,
        )
        for p in PLACEMENTS
    }
    steps: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = PLACEMENTS[r % 3 :] + PLACEMENTS[: r % 3]
        for bs in args.batch_sizes:
            for p in order:
                res = run_strata_one_batch(
                    engines[p], bs, args.input_len, args.output_len, seed=r
                )
                if res.decode_step_ms is None:  # no step in which every request decoded
                    print(f"round {r} batch {bs} {p}: no all-decode step")
                    continue
                steps.setdefault((p, bs), []).append(res.decode_step_ms)
                print(f"round {r} batch {bs} {p}: {res.decode_step_ms:.2f} ms")
    rows = []
    for bs in args.batch_sizes:
        base = statistics.median(steps[("memory", bs)])
        for p in PLACEMENTS:
            med = statistics.median(steps[(p, bs)])
            rows.append(
                {
                    "batch": bs,
                    "placement": p,
                    "decode_step_ms": med,
                    "x_memory": med / base,
                }
            )
            print(
                f"batch {bs:3d} {p:7s} median {med:7.2f} ms  x memory {med / base:.3f}  "
                f"rounds {' '.join(f'{t:.2f}' for t in steps[(p, bs)])}"
            )
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
