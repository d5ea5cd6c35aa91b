"""`strata bench serving | one-batch | offline | compare` — flags, and the glue to run and report.

Wired into the main CLI with one line in strata/cli.py's build_parser:
    from strata.bench.cli import add_bench_args; add_bench_args(sub)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from strata.config import EngineConfig, add_engine_args, engine_config_from_args

# ----------------------------------------------------------------- flags


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    from strata.bench.datasets import DATASETS, DatasetConfig

    d = DatasetConfig()
    g = p.add_argument_group("dataset (made locally; nothing is downloaded)")
    g.add_argument("--dataset", choices=DATASETS, default=d.name)
    g.add_argument(
        "--num-prompts", type=int, default=d.num_prompts, help="requests; conversations for multi-turn"
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--input-len", type=int, default=d.input_len, help="prompt tokens (multi-turn: user tokens per turn)"
    )
    g.add_argument("--output-len", type=int, default=d.output_len)
    g.add_argument(
        "--range-ratio", type=float, default=d.range_ratio, help="lengths uniform in [len*ratio, len]"
    )
    g.add_argument(
        "--num-groups", type=int, default=d.num_groups, help="shared-prefix: groups (one system prompt each)"
    )
    g.add_argument("--prompts-per-group", type=int, default=d.prompts_per_group)
    g.add_argument("--system-len", type=int, default=d.system_len, help="shared-prefix: system prompt tokens")
    g.add_argument("--question-len", type=int, default=d.question_len, help="shared-prefix: question tokens")
    g.add_argument("--num-turns", type=int, default=d.num_turns, help="multi-turn: turns per conversation")
    g.add_argument(
        "--dataset-path", default=None, help="file: a JSONL (prompt/output_len, ShareGPT or messages)"
    )
    g.add_argument("--file-output-len", type=int, default=None, help="file: override every answer length")
    g.add_argument(
        "--file-multi-turn", action="store_true", help="file: keep every user turn of a conversation"
    )


def _dataset_config(args: argparse.Namespace, seed_offset: int = 0):
    from strata.bench.datasets import DatasetConfig

    return DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed + seed_offset,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        system_len=args.system_len,
        question_len=args.question_len,
        num_turns=args.num_turns,
        path=args.dataset_path,
        file_output_len=args.file_output_len,
        file_multi_turn=args.file_multi_turn,
    )


def _add_serving_args(p: argparse.ArgumentParser, with_target: bool) -> None:
    from strata.bench.serving import LENGTH_CONTROLS

    g = p.add_argument_group("serving")
    if with_target:
        g.add_argument(
            "--base-url", default="http://127.0.0.1:30000", help="the server (default: strata serve's)"
        )
        g.add_argument(
            "--model", default=None, help="the model name sent in requests (default: first of /v1/models)"
        )
        g.add_argument(
            "--tokenizer",
            default=None,
            help="model dir or .gguf whose tokenizer makes the dataset (default: the default model)",
        )
        g.add_argument("--api-key", default=None)
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests/s, Poisson (default inf: all at once); several values sweep",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="requests in flight at most; several values sweep",
    )
    g.add_argument("--num-warmup", type=int, default=1, help="short warm-up requests before timing")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--length-control", choices=LENGTH_CONTROLS, default="ignore_eos",
                   help="how requests ask for exactly --output-len tokens: ignore_eos (Strata/SGLang/vLLM), logit_bias "
                   "(plain OpenAI, llama.cpp), generation_config (transformers serve), none; compare's peers pick their own")  # fmt: skip
    g.add_argument("--send-token-ids", action="store_true", help="completions: send prompts as token ids")
    g.add_argument(
        "--extra-body", type=json.loads, default=None, help="JSON object merged into every request"
    )
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--disable-progress", action="store_true")


def _add_one_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("one batch")
    g.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    g.add_argument("--input-len", type=int, nargs="+", default=[512])
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--seed", type=int, default=0)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots (needs matplotlib)")


def add_bench_args(subparsers) -> None:
    """Add `bench` and its subcommands to the main CLI's subparsers."""
    from strata.bench.targets import MODES

    bench = subparsers.add_parser("bench", help="benchmarks: serving, one-batch, offline, compare")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serving = sub.add_parser(
        "serving", help="drive an OpenAI-compatible server (Strata, SGLang, vLLM, llama.cpp)"
    )
    _add_serving_args(serving, with_target=True)
    _add_dataset_args(serving)
    _add_output_args(serving)
    serving.set_defaults(func=cmd_serving)

    one = sub.add_parser("one-batch", help="fixed batch x input x output on the offline engine")
    add_engine_args(one)
    _add_one_batch_args(one)
    _add_output_args(one)
    one.set_defaults(func=cmd_one_batch)

    off = sub.add_parser("offline", help="offline engine throughput on a dataset")
    add_engine_args(off)
    _add_dataset_args(off)
    _add_output_args(off)
    off.set_defaults(func=cmd_offline)

    cmp = sub.add_parser(
        "compare", help="one workload on several targets, alternating rounds; medians and ratios"
    )
    cmp_sub = cmp.add_subparsers(dest="compare_mode", required=True)
    for mode in MODES:
        p = cmp_sub.add_parser(mode, help=f"compare {mode}")
        p.add_argument("--targets", nargs="+", default=["strata", "transformers"],
                       help="strata[:opt=v], transformers[:batch_size=N], transformers-serve, llamacpp, url=http://...")  # fmt: skip
        p.add_argument("--rounds", type=int, default=3)
        add_engine_args(p)
        if mode == "serving":
            _add_serving_args(p, with_target=False)
            _add_dataset_args(p)
        elif mode == "one-batch":
            _add_one_batch_args(p)
        else:
            _add_dataset_args(p)
        _add_output_args(p)
        p.set_defaults(func=cmd_compare)


# ----------------------------------------------------------------- commands


def _tokenizer_for(model: str | None):
    from strata.tokenizer import load_tokenizer
    from strata.weights.default_model import resolve_model_path

    model_dir = resolve_model_path(model)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(
            f"{model_dir} has no tokenizer; benchmarks make text prompts, pass a model directory with one"
        )
    return model_dir, tokenizer


def _serving_config(
    args: argparse.Namespace,
    base_url: str,
    rate: float,
    conc: int | None,
    model: str | None,
    length_control: str | None = None,
):
    from strata.bench.serving import ServingConfig

    return ServingConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        model=model,
        request_rate=rate,
        max_concurrency=conc,
        num_warmup=args.num_warmup,
        temperature=args.temperature,
        length_control=length_control or args.length_control,
        send_token_ids=args.send_token_ids,
        extra_body=args.extra_body or {},
        api_key=getattr(args, "api_key", None),
        timeout_s=args.timeout,
        seed=args.seed,
        progress=not args.disable_progress,
    )


def _sweep(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    return [(rate, conc) for rate in args.request_rate for conc in (args.max_concurrency or [None])]


def _sweep_label(rate: float, conc: int | None) -> str:
    parts = [f"c={conc}"] if conc else []
    if not math.isinf(rate) or not parts:
        parts.append(f"rate={rate:g}")
    return " ".join(parts)


def cmd_serving(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.datasets import make_dataset
    from strata.bench.serving import run_serving

    _, tokenizer = _tokenizer_for(args.tokenizer)
    results = []
    for i, (rate, conc) in enumerate(_sweep(args)):
        # each sweep point gets its own prompts (seed + i), so none is served from the previous one's cache
        conversations = make_dataset(_dataset_config(args, seed_offset=i), tokenizer)
        try:
            r = run_serving(
                _serving_config(args, args.base_url, rate, conc, args.model), conversations, tokenizer
            )
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(report.serving_text(r), flush=True)
        print(flush=True)
        results.append(r)
    if len(results) > 1:
        rows = [
            [_sweep_label(r.config.request_rate, r.config.max_concurrency), report.fmt(r.summary.request_throughput, 3),
             report.fmt(r.summary.output_throughput), report.fmt(r.summary.ttft.median_ms), report.fmt(r.summary.itl.median_ms),
             report.fmt(r.window.output_throughput if r.window else None), str(r.summary.failed)]
            for r in results
        ]  # fmt: skip
        print(
            report.table(
                rows,
                [
                    "sweep point",
                    "req/s",
                    "out tok/s",
                    "TTFT p50 ms",
                    "ITL p50 ms",
                    "steady out tok/s",
                    "failed",
                ],
            )
        )
    if args.output_json:
        report.write_json(args.output_json, "serving", [report.serving_json(r) for r in results])
    if args.plot:
        from strata.bench.plots import plot_serving

        for path in plot_serving({args.base_url: results}, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.summary.completed for r in results) else 1


def _make_engine(args: argparse.Namespace):
    from strata.engine.engine import Engine

    return Engine(**dataclasses.asdict(engine_config_from_args(args)))


def _check_one_batch_fits(engine, batch_sizes: list[int], input_lens: list[int], output_len: int) -> None:
    need = max(batch_sizes) * (max(input_lens) + output_len)
    if engine.state.num_kv_tokens < need:
        raise ValueError(
            f"the largest batch needs {need} KV cache tokens but the pool holds {engine.state.num_kv_tokens}; "
            f"raise --kv-cache-tokens to at least {need} or use smaller --batch-size / --input-len"
        )
    if engine.config.max_running_requests < max(batch_sizes):
        raise ValueError(
            f"--max-running-requests {engine.config.max_running_requests} is below --batch-size {max(batch_sizes)}"
        )


def cmd_one_batch(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.one_batch import run_strata_one_batch

    engine = _make_engine(args)
    _check_one_batch_fits(engine, args.batch_size, args.input_len, args.output_len)
    results = []
    for input_len in args.input_len:
        for bs in args.batch_size:
            print(
                f"one-batch: batch {bs}, input {input_len}, output {args.output_len} ...",
                file=sys.stderr,
                flush=True,
            )
            results.append(run_strata_one_batch(engine, bs, input_len, args.output_len, args.seed))
    print(report.one_batch_text(results))
    if args.output_json:
        report.write_json(args.output_json, "one-batch", results)
    if args.plot:
        from strata.bench.plots import plot_one_batch

        for path in plot_one_batch(results, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_offline(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.datasets import make_dataset
    from strata.bench.offline import run_strata_offline

    engine = _make_engine(args)
    conversations = make_dataset(_dataset_config(args), engine.tokenizer)
    result = run_strata_offline(engine, conversations)
    print(report.offline_text(result))
    if args.output_json:
        report.write_json(args.output_json, "offline", result)
    return 0


# ----------------------------------------------------------------- compare


def _context(args: argparse.Namespace):
    from strata.bench.targets import BenchContext

    cfg = engine_config_from_args(args)
    defaults = EngineConfig()
    options = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "extra") and getattr(cfg, f.name) != getattr(defaults, f.name)
    }
    model_dir, tokenizer = _tokenizer_for(args.model)
    return BenchContext(model=args.model, model_dir=model_dir, engine_options=options, tokenizer=tokenizer)


def _one_batch_run(args: argparse.Namespace, details: dict[str, list]):
    def run(target, round_index: int) -> dict[str, float | None]:
        figures: dict[str, float | None] = {}
        results = []
        for input_len in args.input_len:
            for bs in args.batch_size:
                key = f"bs={bs} in={input_len}"
                try:
                    r = target.one_batch(bs, input_len, args.output_len, args.seed + round_index)
                except ValueError as exc:
                    print(f"  {target.label} {key}: not measured ({exc})", file=sys.stderr)
                    figures[f"{key}: prefill (tok/s)"] = figures[f"{key}: decode step (ms)"] = None
                    continue
                figures[f"{key}: prefill (tok/s)"] = r.prefill_tok_s
                figures[f"{key}: decode step (ms)"] = r.decode_step_ms
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
                _dataset_config(args, seed_offset=round_index), ctx.tokenizer
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
    sweep = _sweep(args)

    def run(target, round_index: int) -> dict[str, float | None]:
        url = target.serving_url()
        figures: dict[str, float | None] = {}
        results = []
        for i, (rate, conc) in enumerate(sweep):
            key = (round_index, i)
            if key not in datasets:  # same prompts for every target within a round, fresh ones per round
                datasets[key] = make_dataset(
                    _dataset_config(args, seed_offset=1000 * round_index + i), ctx.tokenizer
                )
            server_info.flush_cache(url)  # best effort: peers without /flush_cache keep theirs
            config = _serving_config(args, url, rate, conc, target.served_model(), target.length_control)
            r = run_serving(config, datasets[key], ctx.tokenizer)
            results.append(r)
            s, w, label = r.summary, r.window, _sweep_label(rate, conc)
            hit = s.usage_cache_hit_rate if s.usage_cache_hit_rate is not None else r.server_cache_hit_rate
            figures.update({
                f"{label}: output (tok/s)": s.output_throughput,
                f"{label}: requests (req/s)": s.request_throughput,
                f"{label}: TTFT median (ms)": s.ttft.median_ms,
                f"{label}: ITL median (ms)": s.itl.median_ms,
                f"{label}: TPOT median (ms)": s.tpot.median_ms,
                f"{label}: E2E median (ms)": s.e2e.median_ms,
                f"{label}: steady output (tok/s)": w.output_throughput if w else None,
                f"{label}: steady decode step, mean ITL (ms)": w.mean_step_ms if w else None,
                f"{label}: cache hit rate": hit,
                f"{label}: failed requests": float(s.failed),
            })  # fmt: skip
        details[target.label] = results
        return figures

    return run


def cmd_compare(args: argparse.Namespace) -> int:
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
            "medians": {t: {f: result.median(t, f) for f in result.figures} for t in result.values},
            "ratios_vs_first": {t: {f: result.ratio(t, f) for f in result.figures} for t in result.values},
            "values_per_round": result.values,
            "skipped": result.skipped,
            "last_round": {
                t: [report.serving_json(r)["summary"] if mode == "serving" else r for r in rs]
                for t, rs in details.items()
            },
        }
        report.write_json(args.output_json, f"compare-{mode}", payload)
    if args.plot:
        from strata.bench.plots import plot_one_batch, plot_serving

        if mode == "serving":
            paths = plot_serving(details, args.plot)
        elif mode == "one-batch":
            paths = plot_one_batch([r for rs in details.values() for r in rs], args.plot)
        else:
            paths = []
        for path in paths:
            print(f"wrote {path}", file=sys.stderr)
    return 0 if result.values else 1
