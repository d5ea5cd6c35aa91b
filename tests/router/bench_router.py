"""Measure routing policies on a shared-prefix workload over 2 local replicas, in one run.

    python tests/router/bench_router.py --model default --rounds 2 --output-json router_bench.json

Starts two `strata serve` replicas once, then for each round and each policy: starts
`python -m strata.router --policy P` over them, flushes both caches, drives the same workload
through the router with `strata.bench.serving` (shared-prefix dataset, capped concurrency), and
reads the workers' own /metrics counters for the hit rate they saw. Policies alternate within a
round, so slow drift of a shared machine hits both alike. Prints a Markdown table (medians over
rounds) for docs/ROUTER.md. Not a test (pytest does not collect it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from strata.bench import server_info
from strata.bench.datasets import DatasetConfig, make_dataset
from strata.bench.serving import ServingConfig, run_serving
from strata.ports import free_port
from strata.router.launcher import LocalReplica
from strata.tokenizer import load_tokenizer


def model_dir(name: str) -> tuple[Path, list[str]]:
    if name == "tiny":
        sys.path.insert(
            0, str(Path(__file__).resolve().parents[1])
        )  # tests/conftest.py: make_model
        from tiny_models import make_model

        return make_model(
            Path(tempfile.mkdtemp(prefix="router-bench-")) / "tiny-llama", "llama"
        ), [
            "--dtype",
            "float32",
        ]
    from strata.weights.default_model import resolve_model_path

    return resolve_model_path(None if name == "default" else name), []


def start_router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "strata.router",
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warning",
        "--worker-urls",
        *urls,
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("router did not come up")


def worker_counters(urls: list[str]) -> tuple[float, float]:
    prompt = cached = 0.0
    for u in urls:
        c = server_info.token_counters(u)
        assert c is not None, f"{u}/metrics has no token counters"
        prompt, cached = prompt + c.prompt_tokens, cached + c.cached_tokens
    return prompt, cached


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="default", help="default | tiny | a model directory"
    )
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument(
        "--num-threads", type=int, default=1, help="torch threads per replica"
    )
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    path, extra = model_dir(args.model)
    tokenizer = load_tokenizer(path)
    flags = ["--model", str(path), "--num-threads", str(args.num_threads), *extra]
    replicas = [LocalReplica(flags) for _ in range(2)]
    for r in replicas:
        r.start()
    results: dict[str, list[dict]] = {p: [] for p in args.policies}
    try:
        for r in replicas:
            r.wait_ready(600)
        urls = [r.url for r in replicas]
        dataset = DatasetConfig(
            name="shared-prefix",
            num_groups=args.num_groups,
            prompts_per_group=args.prompts_per_group,
            system_len=args.system_len,
            question_len=args.question_len,
            output_len=args.output_len,
            seed=0,
        )
        conversations = make_dataset(dataset, tokenizer)
        for rnd in range(args.rounds):
            for policy in args.policies:
                proc, url = start_router(urls, policy)
                try:
                    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
                    before = worker_counters(urls)
                    config = ServingConfig(
                        base_url=url,
                        max_concurrency=args.max_concurrency,
                        num_warmup=1,
                        progress=False,
                        seed=rnd,
                    )
                    res = run_serving(config, conversations, tokenizer)
                    after = worker_counters(urls)
                    per_worker = {
                        w["url"]: w["num_requests"]
                        for w in httpx.get(url + "/workers").json()["workers"]
                    }
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
                s = res.summary
                row = {
                    "round": rnd,
                    "completed": s.completed,
                    "failed": s.failed,
                    "request_throughput": s.request_throughput,
                    "input_throughput": s.input_throughput,
                    "output_throughput": s.output_throughput,
                    "ttft_mean_ms": s.ttft.mean_ms,
                    "ttft_median_ms": s.ttft.median_ms,
                    "ttft_p99_ms": s.ttft.p99_ms,
                    "e2e_median_ms": s.e2e.median_ms,
                    "usage_hit_rate": s.usage_cache_hit_rate,
                    "worker_hit_rate": (after[1] - before[1])
                    / max(after[0] - before[0], 1),
                    "requests_per_worker": sorted(per_worker.values()),
                }
                results[policy].append(row)
                print(json.dumps({"policy": policy, **row}), flush=True)
    finally:
        for r in replicas:
            r.stop()

    def med(policy: str, key: str) -> float:
        return statistics.median(row[key] for row in results[policy])

    def span(policy: str, key: str, fmt: str) -> str:
        values = [row[key] for row in results[policy]]
        return f"{format(med(policy, key), fmt)} ({format(min(values), fmt)}\N{EN DASH}{format(max(values), fmt)})"

    print(
        f"\nmodel {path.name}; 2 replicas x {args.num_threads} thread(s); shared-prefix {args.num_groups} groups x "
        f"{args.prompts_per_group} prompts, system {args.system_len} + question {args.question_len} tokens, "
        f"output {args.output_len}; max concurrency {args.max_concurrency}; median (min\N{EN DASH}max) of {args.rounds} rounds\n"
    )
    print(
        "| policy | req/s | input tok/s | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | hit rate (usage) | hit rate (workers) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in args.policies:
        print(
            f"| {p} | {span(p, 'request_throughput', '.2f')} | {med(p, 'input_throughput'):.0f} | "
            f"{span(p, 'ttft_mean_ms', '.0f')} | {med(p, 'ttft_median_ms'):.0f} | {med(p, 'ttft_p99_ms'):.0f} | "
            f"{med(p, 'usage_hit_rate'):.3f} | {med(p, 'worker_hit_rate'):.3f} |"
        )
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=1)
        )
    return (
        0 if all(row["failed"] == 0 for rows in results.values() for row in rows) else 1
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
