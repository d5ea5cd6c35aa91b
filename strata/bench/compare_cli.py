"""`strata bench compare MODE`: build the targets, define what one run of each mode measures (a
dict of named figures), rotate the targets round by round (compare.py), then report.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from strata.bench.args import (
    dataset_config_from_args,
    load_bench_tokenizer,
    serving_config_from_args,
    sweep_label,
    sweep_points,
)
from strata.config import EngineConfig, engine_config_from_args


def _context(args: argparse.Namespace):
    from strata.bench.targets import BenchContext

    cfg = engine_config_from_args(args)
    defaults = EngineConfig()
    options = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "extra")
        and getattr(cfg, f.name) != getattr(defaults, f.name)
    }
    model_dir, tokenizer = load_bench_tokenizer(args.model)
    return BenchContext(
        model=args.model,
        model_dir=model_dir,
        engine_options=options,
        tokenizer=tokenizer,
    )


def _one_batch_run(args: argparse.Namespace, details: dict[str, list]):
    def run(target, round_index: int) -> dict[str, float | None]:
        figures: dict[str, float | None] = {}
        results = []
        for input_len in args.input_len:
            for bs in args.batch_size:
                key = f"bs={bs} in={input_len}"
                try:
                    r = target.one_batch(
                        bs, input_len, args.output_len, args.seed + round_index
                    )
                except ValueError as exc:
                    print(
                        f"  {target.label} {key}: not measured ({exc})", file=sys.stderr
                    )
                    figures[f"{key}: prefill (tok/s)"] = figures[
                        f"{key}: decode step (ms)"
                    ] = None
                    continue
                figures[f"{key}: prefill (tok/s)"] = r.prefill_tok_s
                figures[f"{key}: decode step (ms)"] = r.decode_step_ms
                if r.kv_peak_bytes_per_request is not None:
                    figures[f"{key}: KV per request, peak (MiB)"] = (
                        r.kv_peak_bytes_per_request / 2**20
                    )
                results.append(r)
        details[target.label] = results
        return figures

    return run


def _offline_run(args: argparse.Namespace, ctx, details: dict[str, list]):
    from strata.bench.datasets import make_dataset

    datasets: dict[int, Any] = {}

    def run(target, round_index: int) -> dict[str, float | None]:
        if round_index not in datasets:
            datasets[round_index] = make_dataset(
                dataset_config_from_args(args, seed_offset=round_index), ctx.tokenizer
            )
        r = target.offline(datasets[round_index])
        details[target.label] = [r]
        return {
            "total (tok/s)": r.total_tok_s,
            "output (tok/s)": r.output_tok_s,
            "requests (req/s)": r.request_throughput,
            "steady output (tok/s)": r.window.output_throughput if r.window else None,
            "steady decode step (ms)": r.window.mean_step_ms if r.window else None,
            "cache hit rate": r.cache_hit_rate,
        }

    return run


def _serving_run(args: argparse.Namespace, ctx, details: dict[str, list]):
    from strata.bench import server_info
    from strata.bench.datasets import make_dataset
    from strata.bench.serving import run_serving

    datasets: dict[tuple[int, int], Any] = {}
    sweep = sweep_points(args)

    def run(target, round_index: int) -> dict[str, float | None]:
        url = target.serving_url()
        figures: dict[str, float | None] = {}
        results = []
        for i, (rate, conc) in enumerate(sweep):
            key = (round_index, i)
            if (
                key not in datasets
            ):  # same prompts for every target within a round, fresh ones per round
                datasets[key] = make_dataset(
                    dataset_config_from_args(args, seed_offset=1000 * round_index + i),
                    ctx.tokenizer,
                )
            server_info.flush_cache(
                url
            )  # best effort: peers without /flush_cache keep theirs
            config = serving_config_from_args(
                args, url, rate, conc, target.served_model(), target.length_control
            )
            r = run_serving(config, datasets[key], ctx.tokenizer)
            results.append(r)
            figures["KV tokens per GiB"] = kv_tokens_per_gib(
                server_info.server_info(url)
            )
            s, w, label = r.summary, r.window, sweep_label(rate, conc)
            hit = (
                s.usage_cache_hit_rate
                if s.usage_cache_hit_rate is not None
                else r.server_cache_hit_rate
            )
            figures.update(
                {
                    f"{label}: output (tok/s)": s.output_throughput,
                    f"{label}: requests (req/s)": s.request_throughput,
                    f"{label}: TTFT median (ms)": s.ttft.median_ms,
                    f"{label}: ITL median (ms)": s.itl.median_ms,
                    f"{label}: TPOT median (ms)": s.tpot.median_ms,
                    f"{label}: E2E median (ms)": s.e2e.median_ms,
                    f"{label}: steady output (tok/s)": w.output_throughput
                    if w
                    else None,
                    f"{label}: steady decode step, mean ITL (ms)": w.mean_step_ms
                    if w
                    else None,
                    f"{label}: cache hit rate": hit,
                    f"{label}: failed requests": float(s.failed),
                    f"{label}: short outputs (fewer tokens than asked)": float(
                        s.short_outputs
                    ),
                    f"{label}: frontend CPU per output token (ms)": r.server_cpu_ms_per_output_token.get(
                        "frontend"
                    ),
                    f"{label}: engine CPU per output token (ms)": r.server_cpu_ms_per_output_token.get(
                        "engine"
                    ),
                }
            )
        details[target.label] = results
        return figures

    return run


def kv_tokens_per_gib(info: dict[str, Any] | None) -> float | None:
    """Tokens of context the server's KV pool holds per GiB of it (Strata's /get_server_info)."""
    engine = (info or {}).get("engine") or {}
    tokens, size = engine.get("num_kv_tokens"), engine.get("kv_bytes")
    return tokens / size * 2**30 if tokens and size else None


def _without_requests(serving: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in serving.items() if k != "requests"}


def run_compare_command(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.compare import run_compare
    from strata.bench.targets import make_target, parse_target

    specs = [parse_target(t) for t in args.targets]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"targets must differ, got {labels}")
    ctx = _context(args)
    targets = [make_target(s, ctx) for s in specs]
    details: dict[str, list] = {}
    mode = args.compare_mode
    if mode == "one-batch":
        run = _one_batch_run(args, details)
    elif mode == "offline":
        run = _offline_run(args, ctx, details)
    else:
        run = _serving_run(args, ctx, details)
    try:
        result = run_compare(mode, targets, args.rounds, run)
    finally:
        for t in targets:
            t.close()
    print(report.compare_text(result))
    if args.output_json:
        payload = {
            "mode": result.mode,
            "rounds": result.rounds,
            "targets": result.targets,
            "medians": {
                t: {f: result.median(t, f) for f in result.figures}
                for t in result.values
            },
            "ratios_vs_first": {
                t: {f: result.ratio(t, f) for f in result.figures}
                for t in result.values
            },
            "values_per_round": result.values,
            "skipped": result.skipped,
            "load_averages": result.load_averages,
            "last_round": {
                t: [
                    _without_requests(report.serving_json(r))
                    if mode == "serving"
                    else r
                    for r in rs
                ]
                for t, rs in details.items()
            },
        }
        report.write_json(args.output_json, f"compare-{mode}", payload)
    if args.plot:
        from strata.bench.plots import plot_one_batch, plot_serving

        if mode == "serving":
            paths = plot_serving(details, args.plot)
        elif mode == "one-batch":
            paths = plot_one_batch(
                [r for rs in details.values() for r in rs], args.plot
            )
        else:
            paths = []
        for path in paths:
            print(f"wrote {path}", file=sys.stderr)
    return 0 if result.values else 1
