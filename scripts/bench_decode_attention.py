"""Decode attention over the paged pool, the default model's shape: one call per layer, every layer's
own K/V pool, so that the keys come from memory as in a decode step of many requests.

    python scripts/bench_decode_attention.py                      # 64 requests of 320 keys, 30 layers
    python scripts/bench_decode_attention.py --batch 1 --keys 2048
    python scripts/bench_decode_attention.py --scatter            # every key in a slot of its own

Each request's first 256 keys sit in consecutive slots (a prefill's) and the rest interleave with
the other requests' (decode steps taken together), or with --scatter, every slot is drawn at
random; --shared gives every request the same slots (the keys stay in cache: the kernel's own
work). Prints the median over rounds of the time of one pass over the layers, and the K/V bytes
read per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from strata import kernels

HEADS, KV_HEADS, HEAD_DIM, PROMPT = 9, 3, 64, 256


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--keys", type=int, default=320, help="keys per request")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--scatter", action="store_true")
    layout.add_argument("--shared", action="store_true")
    args = parser.parse_args()
    ops = kernels.cpu_ops()
    if ops is None:
        sys.exit("needs the native kernels")
    batch, keys = args.batch, args.keys
    slots = batch * keys
    gen = torch.Generator().manual_seed(0)

    def pool() -> torch.Tensor:
        return torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)

    k_pools = [pool() for _ in range(args.layers)]
    v_pools = [pool() for _ in range(args.layers)]
    table = torch.empty(batch, keys, dtype=torch.int64)
    prompt = min(PROMPT, keys)
    for b in range(batch):
        table[b, :prompt] = torch.arange(b * prompt, (b + 1) * prompt)
    decoded = torch.arange(batch * prompt, slots).view(keys - prompt, batch).t()
    table[:, prompt:] = decoded
    if args.scatter:
        table = torch.randperm(slots, generator=gen).view(batch, keys)
    elif args.shared:
        table[:] = table[0].clone()
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    owner = torch.arange(batch)
    positions = torch.full((batch,), keys - 1, dtype=torch.int64)

    def one_pass() -> float:
        start = time.perf_counter()
        for k_pool, v_pool in zip(k_pools, v_pools):
            ops.paged_attention(
                out, q, k_pool, v_pool, table, owner, positions, 1, HEAD_DIM**-0.5
            )
        return (time.perf_counter() - start) * 1e3

    one_pass()
    ms = statistics.median(one_pass() for _ in range(args.rounds))
    read = batch * keys * KV_HEADS * HEAD_DIM * 2 * 2 * args.layers
    print(
        f"{batch} requests x {keys} keys, {args.layers} layers: {ms:.2f} ms a pass, "
        f"{read / 1e6:.0f} MB of K/V, {read / ms / 1e6:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
