"""bf16 prefill attention: the extend kernel's AMX bf16 tiles vs its AVX-512 BF16 dot products.

    python scripts/bench_attention_tiles.py                      # 512 and 2048 tokens, 3 rounds
    python scripts/bench_attention_tiles.py --tokens 2048 --heads 9 3 --head-dim 64 --rounds 5

One fresh prompt (a request with no cached prefix) of each length, bf16 queries and cache, through
`extend_attention` on both paths alternating within a round; reports the median over rounds of each
path's median call (ms per layer, all threads), their ratio, and beside them torch's CPU flash
attention (`F.scaled_dot_product_attention`, bf16, causal, grouped-query) on the same tensors. Needs
a CPU with AMX bf16 (exits otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F

from strata import kernels
from strata.layers.quant import median_call_ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument(
        "--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV")
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ops = kernels.cpu_ops()
    if ops is None or not ops.attention_tiles_available():
        sys.exit(
            "no AMX bf16 tiles here (the CPU lacks amx_bf16, or the OS refused them)"
        )
    saved = ops.attention_tiles()
    heads, kv_heads = args.heads
    dim = args.head_dim
    print(
        f"{'tokens':>7} {'dot (ms)':>9} {'tiles (ms)':>10} {'dot/tiles':>9} {'SDPA (ms)':>9}"
    )
    try:
        for n in args.tokens:
            gen = torch.Generator().manual_seed(n)
            q = torch.randn(n, heads, dim, generator=gen).bfloat16()
            k = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
            v = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
            out = torch.empty_like(q)
            call = partial(
                ops.extend_attention,
                out,
                q,
                k,
                v,
                torch.arange(n).view(1, -1),
                torch.tensor([0]),
                torch.tensor([n]),
                torch.tensor([n]),
                1,
                dim**-0.5,
            )
            sdpa = partial(
                F.scaled_dot_product_attention,
                q.transpose(0, 1).unsqueeze(0).contiguous(),
                k.transpose(0, 1).unsqueeze(0).contiguous(),
                v.transpose(0, 1).unsqueeze(0).contiguous(),
                is_causal=True,
                enable_gqa=True,
            )
            times: dict[str, list[float]] = {"dot": [], "tiles": [], "sdpa": []}
            for _ in range(args.rounds):
                for path in ("dot", "tiles"):
                    ops.set_attention_tiles(path == "tiles")
                    times[path].append(median_call_ms(call, args.repeats))
                times["sdpa"].append(median_call_ms(sdpa, args.repeats))
            dot, tiles, ref = (
                statistics.median(times[p]) for p in ("dot", "tiles", "sdpa")
            )
            print(f"{n:>7} {dot:>9.2f} {tiles:>10.2f} {dot / tiles:>8.2f}x {ref:>9.2f}")
    finally:
        ops.set_attention_tiles(saved)


if __name__ == "__main__":
    main()
