"""`strata bench serving | batch | lora | one-batch | timing | offline | compare | moe | kv-layout | grammar | spec | soak` — flags, and the glue to run and report
(`compare` itself is in compare_cli.py).

Wired into the main CLI with one line in strata/cli.py's build_parser:
    from strata.bench.cli import add_bench_args; add_bench_args(sub)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys

from strata.bench.args import (
    dataset_config_from_args,
    load_bench_tokenizer,
    serving_config_from_args,
    sweep_label,
    sweep_points,
)
from strata.config import add_engine_args, engine_config_from_args

# ----------------------------------------------------------------- flags


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    from strata.bench.datasets import DATASETS, DatasetConfig

    d = DatasetConfig()
    g = p.add_argument_group("dataset (made locally; nothing is downloaded)")
    g.add_argument("--dataset", choices=DATASETS, default=d.name)
    g.add_argument(
        "--num-prompts",
        type=int,
        default=d.num_prompts,
        help="requests; conversations for multi-turn",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--input-len",
        type=int,
        default=d.input_len,
        help="prompt tokens (multi-turn: user tokens per turn)",
    )
    g.add_argument("--output-len", type=int, default=d.output_len)
    g.add_argument(
        "--range-ratio",
        type=float,
        default=d.range_ratio,
        help="lengths uniform in [len*ratio, len]",
    )
    g.add_argument(
        "--num-groups",
        type=int,
        default=d.num_groups,
        help="shared-prefix: groups (one system prompt each)",
    )
    g.add_argument("--prompts-per-group", type=int, default=d.prompts_per_group)
    g.add_argument(
        "--system-len",
        type=int,
        default=d.system_len,
        help="shared-prefix: system prompt tokens",
    )
    g.add_argument(
        "--question-len",
        type=int,
        default=d.question_len,
        help="shared-prefix: question tokens",
    )
    g.add_argument(
        "--num-turns",
        type=int,
        default=d.num_turns,
        help="multi-turn: turns per conversation",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help="file: a JSONL (prompt/output_len, ShareGPT or messages)",
    )
    g.add_argument(
        "--file-output-len",
        type=int,
        default=None,
        help="file: override every answer length",
    )
    g.add_argument(
        "--file-multi-turn",
        action="store_true",
        help="file: keep every user turn of a conversation",
    )


def _add_serving_args(p: argparse.ArgumentParser, with_target: bool) -> None:
    from strata.bench.serving import LENGTH_CONTROLS

    g = p.add_argument_group("serving")
    if with_target:
        g.add_argument(
            "--base-url",
            default="http://127.0.0.1:30000",
            help="the server (default: strata serve's)",
        )
        g.add_argument(
            "--model",
            default=None,
            help="the model name sent in requests (default: first of /v1/models)",
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
    g.add_argument(
        "--num-warmup", type=int, default=1, help="short warm-up requests before timing"
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--length-control",
        choices=LENGTH_CONTROLS,
        default="ignore_eos",
        help="how requests ask for exactly --output-len tokens: ignore_eos (Strata/SGLang/vLLM), logit_bias "
        "(plain OpenAI, llama.cpp), generation_config (transformers serve), none; compare's peers pick their own",
    )
    g.add_argument(
        "--send-token-ids",
        action="store_true",
        help="completions: send prompts as token ids",
    )
    g.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON object merged into every request",
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
    g.add_argument(
        "--output-json", default=None, metavar="FILE", help="write the results as JSON"
    )
    g.add_argument(
        "--plot", default=None, metavar="DIR", help="write PNG plots (needs matplotlib)"
    )


def add_bench_args(subparsers) -> None:
    """Add `bench` and its subcommands to the main CLI's subparsers."""
    from strata.bench.targets import MODES

    bench = subparsers.add_parser(
        "bench", help="benchmarks: serving, one-batch, offline, compare"
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serving = sub.add_parser(
        "serving",
        help="drive an OpenAI-compatible server (Strata, SGLang, vLLM, llama.cpp)",
    )
    _add_serving_args(serving, with_target=True)
    _add_dataset_args(serving)
    _add_output_args(serving)
    serving.set_defaults(func=cmd_serving)

    batch = sub.add_parser(
        "batch",
        help="interactive latency on a running server alone and beside a /v1/batches job",
    )
    _add_serving_args(batch, with_target=True)
    _add_dataset_args(batch)
    _add_output_args(batch)
    g = batch.add_argument_group("batch")
    g.add_argument("--rounds", type=int, default=3, help="alone / with-batch pairs")
    g.add_argument(
        "--batch-lines", type=int, default=400, help="chat requests in the batch"
    )
    g.add_argument(
        "--batch-input-words", type=int, default=120, help="words per batch prompt"
    )
    g.add_argument(
        "--batch-output-len", type=int, default=128, help="tokens per batch answer"
    )
    batch.set_defaults(func=cmd_batch)

    lora = sub.add_parser(
        "lora",
        help="decode step time with LoRA adapters in the batch vs the base model",
    )
    g = lora.add_argument_group("lora")
    g.add_argument("--model", default=None, help="default: the default model")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--num-adapters", type=int, default=8)
    g.add_argument("--rank", type=int, default=16)
    g.add_argument("--input-len", type=int, default=64)
    g.add_argument("--steps", type=int, default=16, help="timed decode steps per mix")
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--rounds", type=int, default=3)
    _add_output_args(lora)
    lora.set_defaults(func=cmd_lora)

    one = sub.add_parser(
        "one-batch", help="fixed batch x input x output on the offline engine"
    )
    add_engine_args(one)
    _add_one_batch_args(one)
    _add_output_args(one)
    one.set_defaults(func=cmd_one_batch)

    off = sub.add_parser("offline", help="offline engine throughput on a dataset")
    add_engine_args(off)
    _add_dataset_args(off)
    _add_output_args(off)
    off.set_defaults(func=cmd_offline)

    timing = sub.add_parser(
        "timing",
        help="one deployment timed two ways: fixed prefill batches and equal decode "
        "lengths (DeepSeek's method) vs the 20%%-90%% completion window with different "
        "new tokens per request (SGLang's) (strata/bench/timing.py)",
    )
    add_engine_args(timing)
    g = timing.add_argument_group("timing")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument(
        "--prefill-batches",
        type=int,
        default=9,
        help="fixed-batch method: prefill batches timed (default: 9)",
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.25,
        help="window method: output lengths spread over [ratio x, 1 x] --output-len",
    )
    g.add_argument("--seed", type=int, default=0)
    _add_output_args(timing)
    timing.set_defaults(func=cmd_timing)

    grammar = sub.add_parser(
        "grammar",
        help="structured output: compile time, decode step with/without grammar",
    )
    add_engine_args(grammar)
    _add_grammar_args(grammar)
    grammar.set_defaults(func=cmd_grammar)

    spec = sub.add_parser(
        "spec",
        help="speculative decoding on vs off: batch 1 and concurrent (strata/bench/spec.py)",
    )
    add_engine_args(spec)
    _add_spec_args(spec)
    spec.set_defaults(func=cmd_spec)

    moe = sub.add_parser(
        "moe",
        help="one MoE layer's decode step: Strata vs transformers (strata/bench/moe.py)",
    )
    _add_moe_args(moe)
    moe.set_defaults(func=cmd_moe)

    par = sub.add_parser(
        "parallel",
        help="tensor/expert parallel: EPLB balance, TP step time (strata/bench/parallel.py)",
    )
    _add_parallel_args(par)
    par.set_defaults(func=cmd_parallel)

    soak = sub.add_parser(
        "soak",
        help="a router, two replicas sharing L3 and a PD pair under mixed load and injected faults: "
        "lost / hung requests, leaked KV pages, memory drift (strata/bench/soak.py)",
    )
    _add_soak_args(soak)
    soak.set_defaults(func=cmd_soak)

    kv = sub.add_parser(
        "kv-layout",
        help="KV cache bytes per token from config.json; MLA vs per-head K/V",
    )
    kv.add_argument(
        "--model",
        nargs="+",
        required=True,
        metavar="DIR_OR_CONFIG",
        help="model directories holding config.json, or config.json files (no weights needed)",
    )
    kv.add_argument(
        "--kv-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16"
    )
    kv.add_argument(
        "--context-len",
        nargs="+",
        type=int,
        default=[8192, 65536],
        metavar="TOKENS",
        help="also report bytes per token one request of this many tokens holds",
    )
    kv.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="page size (DeepSeek-V4's rows per page)",
    )
    kv.add_argument(
        "--output-json", default=None, metavar="FILE", help="write the results as JSON"
    )
    kv.set_defaults(func=cmd_kv_layout)

    cmp = sub.add_parser(
        "compare",
        help="one workload on several targets, alternating rounds; medians and ratios",
    )
    cmp_sub = cmp.add_subparsers(dest="compare_mode", required=True)
    for mode in MODES:
        p = cmp_sub.add_parser(mode, help=f"compare {mode}")
        p.add_argument(
            "--targets",
            nargs="+",
            default=["strata", "transformers"],
            help="strata[:opt=v], transformers[:batch_size=N], transformers-serve, llamacpp, vllm[:python=PATH], url=http://...",
        )
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


def _add_moe_args(p: argparse.ArgumentParser) -> None:
    from strata.bench.moe_config import FAMILIES, MoEBenchConfig

    d = MoEBenchConfig()
    p.add_argument("--family", choices=sorted(FAMILIES), default=d.family)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument(
        "--intermediate-size",
        type=int,
        default=d.intermediate_size,
        help="of one expert",
    )
    p.add_argument("--num-experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(d.batch_sizes))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument(
        "--iters", type=int, default=d.iters, help="decode steps timed per round"
    )
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads"
    )
    p.add_argument("--output-json", default=None)


# ----------------------------------------------------------------- commands

# HTTP client libraries that log every request at INFO; a benchmark sends thousands
REQUEST_LOGGERS = ("httpx", "httpcore")


def quiet_request_logs() -> None:
    """Library request logs are debug output: held at WARNING unless the user asked for debug logging
    (--log-level debug), when they show as before."""
    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    for name in (
        REQUEST_LOGGERS
    ):  # NOTSET: they follow the root logger again (an earlier call held them)
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)


def cmd_moe(args: argparse.Namespace) -> int:
    import torch

    from strata.bench.moe import format_rows, run_moe_bench
    from strata.bench.moe_config import MoEBenchConfig

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = MoEBenchConfig(
        family=args.family,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        batch_sizes=tuple(args.batch_sizes),
        dtype=args.dtype,
        rounds=args.rounds,
        iters=args.iters,
    )
    rows = run_moe_bench(cfg)
    print(format_rows(cfg, rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "rows": rows}, f, indent=2)
    return 0


def _add_soak_args(p: argparse.ArgumentParser) -> None:
    import shlex

    from strata.bench.soak_config import (
        FAULTS,
        L3_TIERS,
        ClusterConfig,
        LoadConfig,
        SoakConfig,
    )

    d, ld, cd = SoakConfig(), LoadConfig(), ClusterConfig()
    p.add_argument(
        "--duration", type=float, default=d.duration_s, help="seconds of load"
    )
    p.add_argument(
        "--faults",
        nargs="*",
        choices=FAULTS,
        default=list(d.faults),
        help="faults to inject, spaced over the duration (default: all; none given: plain load)",
    )
    p.add_argument(
        "--model",
        default=cd.model,
        help="model directory or .gguf of every server (default: the default model)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=ld.concurrency,
        help="clients, each one request at a time",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=ld.max_tokens,
        help="answer length at most (most kinds)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=ld.request_timeout_s,
        help="seconds after which a request without a complete answer counts as hung",
    )
    p.add_argument(
        "--pd-share",
        type=float,
        default=ld.pd_share,
        help="fraction of requests sent to the PD pair",
    )
    p.add_argument(
        "--stop-seconds",
        type=float,
        default=d.stop_s,
        help="how long an engine stays SIGSTOPped",
    )
    p.add_argument(
        "--hold-seconds",
        type=float,
        default=d.hold_s,
        help="how long the disk stays full / Redis down",
    )
    p.add_argument(
        "--l3",
        choices=L3_TIERS,
        default=cd.l3,
        help="the replicas' shared L3 tier (redis needs redis-server on PATH)",
    )
    p.add_argument(
        "--l3-tmpfs-mib",
        type=int,
        default=cd.l3_tmpfs_mib,
        help="size of the tmpfs mounted for the file tier",
    )
    p.add_argument(
        "--server-args",
        type=shlex.split,
        default=list(cd.server_args),
        help="more flags for every `strata serve`, as one string",
    )
    p.add_argument(
        "--router-args",
        type=shlex.split,
        default=list(cd.router_args),
        help="more flags for both routers, as one string",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=d.startup_timeout_s,
        help="seconds for a server to load",
    )
    p.add_argument("--seed", type=int, default=ld.seed)
    p.add_argument(
        "--log-dir",
        default=None,
        help="keep every process's log here (default: a temp dir, removed when the soak passes)",
    )
    p.add_argument(
        "--output-json", default=None, metavar="FILE", help="write the results as JSON"
    )


def cmd_soak(args: argparse.Namespace) -> int:
    from strata.bench.soak import cmd

    quiet_request_logs()
    return cmd(args)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    from strata.bench.parallel import add_args

    add_args(p)


def cmd_parallel(args: argparse.Namespace) -> int:
    from strata.bench.parallel import cmd

    return cmd(args)


def cmd_kv_layout(args: argparse.Namespace) -> int:
    import torch

    from strata.bench import report
    from strata.bench.kv_layout import format_text, kv_layout

    contexts = tuple(args.context_len)
    rows = [
        kv_layout(model, getattr(torch, args.kv_dtype), contexts, args.page_size)
        for model in args.model
    ]
    print(format_text(rows))
    if args.output_json:
        report.write_json(args.output_json, "kv-layout", rows)
    return 0


def cmd_lora(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.lora import LoRABenchConfig, run, text

    cfg = LoRABenchConfig(
        model=args.model,
        batch_size=args.batch_size,
        num_adapters=args.num_adapters,
        rank=args.rank,
        input_len=args.input_len,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        dtype=args.dtype,
    )
    result = run(cfg, log=lambda line: print(line, flush=True))
    print(text(result))
    if args.output_json:
        report.write_json(args.output_json, "lora", result)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from strata.bench import batch_load, report

    quiet_request_logs()
    if args.rounds < 1 or args.batch_lines < 1:
        raise ValueError("--rounds and --batch-lines must be >= 1")
    _, tokenizer = load_bench_tokenizer(args.tokenizer)
    rate = args.request_rate[0]
    conc = (args.max_concurrency or [None])[0]
    config = serving_config_from_args(args, args.base_url, rate, conc, args.model)

    def dataset_for(offset: int):
        from strata.bench.datasets import make_dataset

        return make_dataset(
            dataset_config_from_args(args, seed_offset=offset), tokenizer
        )

    runs = batch_load.run_rounds(
        config,
        dataset_for,
        tokenizer,
        args.rounds,
        {
            "lines": args.batch_lines,
            "input_words": args.batch_input_words,
            "output_len": args.batch_output_len,
        },
        log=lambda run: print(f"  {run}", flush=True),
    )
    totals = batch_load.summary(runs)
    print(batch_load.text(runs, totals))
    if args.output_json:
        report.write_json(args.output_json, "batch", batch_load.as_json(runs, totals))
    return 0


def cmd_serving(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.datasets import make_dataset
    from strata.bench.serving import run_serving

    quiet_request_logs()
    _, tokenizer = load_bench_tokenizer(args.tokenizer)
    results = []
    for i, (rate, conc) in enumerate(sweep_points(args)):
        # each sweep point gets its own prompts (seed + i), so none is served from the previous one's cache
        conversations = make_dataset(
            dataset_config_from_args(args, seed_offset=i), tokenizer
        )
        try:
            r = run_serving(
                serving_config_from_args(args, args.base_url, rate, conc, args.model),
                conversations,
                tokenizer,
            )
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(report.serving_text(r), flush=True)
        print(flush=True)
        results.append(r)
    if len(results) > 1:
        rows = [
            [
                sweep_label(r.config.request_rate, r.config.max_concurrency),
                report.fmt(r.summary.request_throughput, 3),
                report.fmt(r.summary.output_throughput),
                report.fmt(r.summary.ttft.median_ms),
                report.fmt(r.summary.itl.median_ms),
                report.fmt(r.window.output_throughput if r.window else None),
                str(r.summary.failed),
            ]
            for r in results
        ]
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
        report.write_json(
            args.output_json, "serving", [report.serving_json(r) for r in results]
        )
    if args.plot:
        from strata.bench.plots import plot_serving

        for path in plot_serving({args.base_url: results}, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.summary.completed for r in results) else 1


def _make_engine(args: argparse.Namespace):
    from strata.engine.engine import Engine

    return Engine(**dataclasses.asdict(engine_config_from_args(args)))


def _check_one_batch_fits(
    engine, batch_sizes: list[int], input_lens: list[int], output_len: int
) -> None:
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
            results.append(
                run_strata_one_batch(engine, bs, input_len, args.output_len, args.seed)
            )
    print(report.one_batch_text(results))
    if args.output_json:
        report.write_json(args.output_json, "one-batch", results)
    if args.plot:
        from strata.bench.plots import plot_one_batch

        for path in plot_one_batch(results, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_timing(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.timing import run_timing_methods, timing_text

    engine = _make_engine(args)
    _check_one_batch_fits(engine, [args.batch_size], [args.input_len], args.output_len)
    print(
        f"timing: {args.prefill_batches} prefill batches, one decode batch, one window run "
        f"(batch {args.batch_size}) ...",
        file=sys.stderr,
        flush=True,
    )
    result = run_timing_methods(
        engine,
        args.batch_size,
        args.input_len,
        args.output_len,
        args.prefill_batches,
        args.range_ratio,
        args.seed,
    )
    print(timing_text(result))
    if args.output_json:
        report.write_json(
            args.output_json, "timing", {**vars(result), "summary": result.summary()}
        )
    return 0


def cmd_offline(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.bench.datasets import make_dataset
    from strata.bench.offline import run_strata_offline

    engine = _make_engine(args)
    conversations = make_dataset(dataset_config_from_args(args), engine.tokenizer)
    result = run_strata_offline(engine, conversations)
    print(report.offline_text(result))
    if args.output_json:
        report.write_json(args.output_json, "offline", result)
    return 0


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    from strata.bench.grammar import add_args

    add_args(p)
    p.add_argument(
        "--output-json", default=None, metavar="FILE", help="write the results as JSON"
    )


def cmd_grammar(args: argparse.Namespace) -> int:
    from strata.bench.grammar import format_text, run

    engine = _make_engine(args)
    result = run(engine, args)
    print(format_text(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    from strata.bench.spec import add_args

    add_args(p)
    p.add_argument(
        "--output-json", default=None, metavar="FILE", help="write the results as JSON"
    )


def cmd_spec(args: argparse.Namespace) -> int:
    from strata.bench.spec import (
        config_from_args,
        drafter_training,
        format_text,
        run,
    )

    cfg = config_from_args(args)
    options = dataclasses.asdict(engine_config_from_args(args))
    results = run(
        cfg, options, progress=lambda line: print(line, file=sys.stderr, flush=True)
    )
    training = drafter_training(options)
    print(format_text(results, training))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "config": dataclasses.asdict(cfg),
                    "results": [r.summary() for r in results],
                    "drafter_training": training,
                },
                f,
                indent=2,
            )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from strata.bench.compare_cli import run_compare_command

    quiet_request_logs()
    return run_compare_command(args)
