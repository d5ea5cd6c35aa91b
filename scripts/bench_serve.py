"""A small closed-loop load generator for `strata serve` (a stand-in until `strata bench` exists).

Each of C concurrent clients sends streaming /v1/completions requests back to back (distinct
prompts, fixed output length with ignore_eos) until R requests have finished; reports requests/s,
output tokens/s, mean/p50/p99 TTFT and TPOT, over the whole run.

    python scripts/bench_serve.py --url http://127.0.0.1:30000 --concurrency 1 16 64 --requests 64 --output-len 64
    python scripts/bench_serve.py --launch "--model DIR --dtype float32" ...   # also starts the server, times start-up
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time

import httpx

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "paged",
    "attention",
    "keeps",
    "every",
    "cache",
    "warm",
]


def prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(
        WORDS[(i * 7 + k) % len(WORDS)] for k in range(words)
    )


async def one_request(
    client: httpx.AsyncClient, i: int, args
) -> tuple[float, float, int]:
    body = {
        "prompt": prompt(i, args.prompt_words),
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft or 0.0, time.perf_counter() - start, tokens


async def run_level(url: str, concurrency: int, args) -> dict:
    results: list[tuple[float, float, int]] = []
    counter = iter(range(args.requests))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            for i in counter:
                results.append(
                    await one_request(client, i + concurrency * 10_000, args)
                )

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    tpots = sorted((lat - t) / (n - 1) for t, lat, n in results if n > 1)
    out_tokens = sum(r[2] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "req_per_s": len(results) / wall,
        "out_tok_per_s": out_tokens / wall,
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        "tpot_mean_ms": 1000 * statistics.fmean(tpots) if tpots else 0.0,
        "tpot_p50_ms": 1000 * pct(tpots, 0.5),
    }


def launch(flags: str, port: int) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable,
        "-m",
        "strata.server",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *shlex.split(flags),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if (
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
                == 200
            ):
                return proc, time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument(
        "--launch",
        help="start `python -m strata.server` with these flags first (on --port)",
    )
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument(
        "--requests", type=int, default=64, help="requests per concurrency level"
    )
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=32)
    args = p.parse_args()
    proc = None
    url = args.url
    if args.launch is not None:
        proc, ready_s = launch(args.launch, args.port)
        url = f"http://127.0.0.1:{args.port}"
        print(f"time to ready: {ready_s:.1f}s")
    try:
        asyncio.run(
            run_level(url, 1, argparse.Namespace(**{**vars(args), "requests": 2}))
        )  # warm-up
        print(
            "conc  reqs  wall_s  req/s  out_tok/s  ttft_mean_ms  ttft_p99_ms  tpot_mean_ms"
        )
        for c in args.concurrency:
            r = asyncio.run(run_level(url, c, args))
            print(
                f"{c:4d}  {r['requests']:4d}  {r['wall_s']:6.1f}  {r['req_per_s']:5.2f}  {r['out_tok_per_s']:9.1f}"
                f"  {r['ttft_mean_ms']:12.0f}  {r['ttft_p99_ms']:11.0f}  {r['tpot_mean_ms']:12.1f}",
                flush=True,
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
