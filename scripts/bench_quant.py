"""Decode step time of the default model (SmolLM2-135M) with bf16, int8 and int4 weights.

    python scripts/bench_quant.py                      # 3 rounds, every variant, 2 shapes
    python scripts/bench_quant.py --rounds 5 --variants bf16 int8 int4

Every variant is loaded once (an Engine, then `quantize_model` on its model); each round runs every
variant in turn, so all of them share the same stretch of machine noise. Shapes (strata.bench.one_batch,
greedy, ignore_eos, fresh random prompts):
  one stream   one 256-token prompt, 64 new tokens: decode step = ms per token
  batch 16     16 prompts of 64 tokens, 32 new tokens each: the step in which all 16 decode
Reports, per variant and shape, the median over rounds of the median decode step, its ratio to bf16
(median of the per-round ratios), and the prefill time of the same batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from strata import Engine
from strata.bench.one_batch import run_strata_one_batch
from strata.layers.quant import quantize_model

# name -> quantize_model kwargs (None: the bf16 model as loaded)
VARIANTS: dict[str, dict | None] = {
    "bf16": None,
    "int8": {"method": "int8"},
    "int4": {"method": "int4"},
    "int8-float-logits": {
        "method": "int8",
        "tied_lm_head": False,
    },  # tied embedding stays bf16 for logits
    "int4-float-logits": {"method": "int4", "tied_lm_head": False},
    "int4-g128": {
        "method": "int4",
        "group_size": 128,
    },  # 64 where 128 does not divide (576)
}
SHAPES = {
    "one stream": (1, 256, 64),
    "batch 16": (16, 64, 32),
}  # batch_size, input_len, output_len


def load(name: str, threads: int | None) -> Engine:
    engine = Engine(None, dtype="bfloat16", kv_cache_tokens=8192, num_threads=threads)
    if VARIANTS[name] is not None:
        quantize_model(engine.model, **VARIANTS[name])
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS)
    )
    parser.add_argument(
        "--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES)
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    args = parser.parse_args()
    names = ["bf16"] + [v for v in args.variants if v != "bf16"]
    engines = {name: load(name, args.threads) for name in names}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds",
        flush=True,
    )

    step_ms = {(n, s): [] for n in names for s in args.shapes}
    prefill_s = {(n, s): [] for n in names for s in args.shapes}
    for r in range(args.rounds):
        for shape in args.shapes:
            batch_size, input_len, output_len = SHAPES[shape]
            for name in names:
                t0 = time.perf_counter()
                res = run_strata_one_batch(
                    engines[name], batch_size, input_len, output_len, seed=r
                )
                step_ms[name, shape].append(res.decode_step_ms)
                prefill_s[name, shape].append(res.prefill_s)
                print(
                    f"round {r} {shape:10s} {name:18s} decode step {res.decode_step_ms:7.2f} ms "
                    f"prefill {res.prefill_s:6.2f} s  ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )

    print(
        "\nmedian over rounds (ratio to bf16 = median of per-round ratios; <1 is faster)"
    )
    print(
        f"{'variant':18s} "
        + " ".join(
            f"{s + ' step ms':>18s} {'ratio':>6s} {'prefill s':>9s}"
            for s in args.shapes
        )
    )
    for name in names:
        cells = []
        for shape in args.shapes:
            ratios = [
                a / b for a, b in zip(step_ms[name, shape], step_ms["bf16", shape])
            ]
            cells.append(
                f"{statistics.median(step_ms[name, shape]):18.2f} {statistics.median(ratios):6.2f} "
                f"{statistics.median(prefill_s[name, shape]):9.2f}"
            )
        print(f"{name:18s} " + " ".join(cells))


if __name__ == "__main__":
    main()
