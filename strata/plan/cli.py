"""`strata plan calibrate | simulate | size` — flags, and the glue to run and report.

Wired into the main CLI with one line in strata/cli.py's build_parser:
    from strata.plan.cli import add_plan_args; add_plan_args(sub)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from typing import TypedDict

from strata.config import EngineConfig


def _engine_default(name: str):
    return next(f.default for f in fields(EngineConfig) if f.name == name)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    # the same dataset flags as `strata bench serving`, so a simulated run and a measured one match
    from strata.bench.cli import _add_dataset_args

    _add_dataset_args(p)
    g = p.add_argument_group("arrivals")
    g.add_argument(
        "--arrival", choices=("poisson", "burst", "trace"), default="poisson"
    )
    g.add_argument(
        "--burst-size",
        type=int,
        default=8,
        help="burst: conversations arriving together",
    )
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="trace: JSONL of {t, input_len, output_len, ...}",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (closed loop)",
    )
    g.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        metavar="S",
        help="multi-turn: mean pause (exponential) before the next turn; 0 sends it at once, as the benchmark",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="make the dataset with this model's tokenizer (default: synthetic tokens of exact lengths)",
    )


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    from strata.plan.replica import ReplicaConfig
    from strata.router.registry import POLICIES

    g = p.add_argument_group("deployment")
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="data-parallel replicas (with --prefill: decode workers)",
    )
    g.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="PD: prefill workers (0: no disaggregation)",
    )
    g.add_argument("--policy", choices=tuple(POLICIES), default="cache_aware")
    g.add_argument("--prefill-policy", choices=tuple(POLICIES), default="least_load")
    g.add_argument(
        "--replicas-per-host",
        type=int,
        default=1,
        help="replicas sharing one machine's compute (--launch N on one CPU box: N)",
    )
    g.add_argument(
        "--contention",
        type=float,
        default=None,
        help="slowdown per other busy replica of the host (1: full processor sharing; default: the "
        "calibration's measured figure, else 1)",
    )
    e = p.add_argument_group("engine (EngineConfig's names)")
    e.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=ReplicaConfig().kv_cache_tokens,
        help="KV pool per worker (default: what strata serve reserves for the default model here)",
    )
    for name in (
        "max_running_requests",
        "max_batch_tokens",
        "chunked_prefill_size",
        "max_prefill_tokens",
    ):
        e.add_argument(
            "--" + name.replace("_", "-"), type=int, default=_engine_default(name)
        )
    e.add_argument("--disable-radix-cache", action="store_true")
    e.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="an L2 host pool per worker",
    )
    e.add_argument(
        "--hicache-ratio", type=float, default=_engine_default("hicache_ratio")
    )
    e.add_argument(
        "--hicache-prefetch-threshold",
        type=int,
        default=_engine_default("hicache_prefetch_threshold"),
    )
    e.add_argument(
        "--storage-tokens",
        type=float,
        default=0,
        help="shared L3 capacity in tokens (implies the L2 tier); inf: unbounded; 0: none",
    )
    e.add_argument(
        "--speculative",
        action="store_true",
        help="speculative decoding at the calibration's accept rate",
    )
    e.add_argument(
        "--spec-accept-rate",
        type=float,
        default=None,
        help="per drafted token (overrides the calibration)",
    )
    e.add_argument(
        "--spec-draft-ms",
        type=float,
        default=None,
        help="what a drafting step pays its drafter beside the verified rows (a draft model's "
        "forwards, a block drafter's one; default: the --spec-json figure, else 0, n-gram lookup)",
    )
    e.add_argument(
        "--spec-json",
        default=None,
        metavar="FILE",
        help="accept rate from `strata bench spec --output-json`",
    )
    e.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="prefix-matching granularity of the simulation (tokens)",
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration",
        required=True,
        metavar="FILE",
        help="from `strata plan calibrate`",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="conversations/s (default inf: all at once)",
    )
    _add_workload_args(p)
    _add_deployment_args(p)
    p.add_argument(
        "--sim-seed",
        type=int,
        default=0,
        help="seeds routing ties and draft acceptance",
    )
    p.add_argument("--output-json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="DIR")


def add_plan_args(subparsers) -> None:
    """Add `plan` and its subcommands to the main CLI's subparsers."""
    plan = subparsers.add_parser(
        "plan",
        help="capacity planning: calibrate a cost model, simulate, size (docs/PLANNING.md)",
    )
    sub = plan.add_subparsers(dest="plan_command", required=True)

    cal = sub.add_parser(
        "calibrate",
        help="measure this machine (engine), a server, or figures in JSON; fit",
    )
    from strata.config import add_engine_args

    add_engine_args(cal)
    g = cal.add_argument_group("calibration")
    g.add_argument(
        "--base-url",
        default=None,
        help="calibrate against this running server instead of the engine",
    )
    g.add_argument("--api-key", default=None)
    g.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="FILE",
        help="fit figures: one-batch / spec JSON, a figures file, a calibration",
    )
    g.add_argument(
        "--pd-transfer",
        action="store_true",
        help="--base-url is a PD router and --from-json one worker's calibration: measure the handoff",
    )
    g.add_argument(
        "--row-threshold",
        type=int,
        default=None,
        help="rows from which a server's step changes kernels (server/json; default: one regime)",
    )
    g.add_argument(
        "--spec-scenario",
        default=None,
        help="spec JSON: which scenario's accept length",
    )
    g.add_argument(
        "--quick", action="store_true", help="a smaller engine plan (about a minute)"
    )
    g.add_argument("--output", default="calibration.json", metavar="FILE")
    g.add_argument("--plot", default=None, metavar="DIR")
    cal.set_defaults(func=cmd_calibrate)

    sim = sub.add_parser(
        "simulate", help="discrete-event simulation of a deployment serving a workload"
    )
    _add_common(sim)
    sim.add_argument(
        "--compare-json",
        default=None,
        metavar="FILE",
        help="a `strata bench serving --output-json` run of the same workload: predicted vs measured",
    )
    sim.set_defaults(func=cmd_simulate)

    sz = sub.add_parser(
        "size",
        help="the cheapest deployment meeting p99 TTFT / ITL targets at a request rate",
    )
    _add_common(sz)
    sz.add_argument(
        "--rate",
        type=float,
        default=None,
        help="conversations/s to serve (same as --request-rate)",
    )
    sz.add_argument("--slo-ttft-p99", type=float, default=None, metavar="MS")
    sz.add_argument("--slo-itl-p99", type=float, default=None, metavar="MS")
    sz.add_argument("--max-workers", type=int, default=64)
    sz.add_argument("--no-pd", action="store_true", help="only data-parallel replicas")
    sz.add_argument("--no-dp", action="store_true", help="only PD splits")
    sz.add_argument(
        "--prefill-cost", type=float, default=1.0, help="unit cost of a prefill worker"
    )
    sz.add_argument(
        "--decode-cost",
        type=float,
        default=1.0,
        help="unit cost of a decode worker or replica",
    )
    sz.set_defaults(func=cmd_size)

    from strata.plan.memory_cli import add_memory_args

    add_memory_args(sub)


# ----------------------------------------------------------------- building blocks


def cost_model_from_args(args: argparse.Namespace):
    from strata.plan.cost_model import load_cost_model
    from strata.plan.figures import calibrate_json

    cost = load_cost_model(args.calibration)
    if args.spec_json:
        figures = calibrate_json([args.calibration, args.spec_json])[0]
        cost = cost.with_(
            spec_accept_rate=figures.spec_accept_rate,
            spec_draft_s=figures.spec_draft_s,
        )
    if args.spec_draft_ms is not None:
        cost = cost.with_(spec_draft_s=args.spec_draft_ms / 1e3)
    if args.spec_accept_rate is not None:
        cost = cost.with_(spec_accept_rate=args.spec_accept_rate)
    if args.speculative and cost.spec_accept_rate is None:
        raise ValueError(
            "--speculative needs an accept rate: --spec-accept-rate P, --spec-json FILE, or a calibration with one"
        )
    return cost


def deployment_from_args(args: argparse.Namespace, cost=None):
    from strata.plan.cluster import Deployment, host_cache_tokens
    from strata.plan.replica import ReplicaConfig

    storage = args.storage_tokens
    hier = args.enable_hierarchical_cache or storage != 0
    replica = ReplicaConfig(
        kv_cache_tokens=args.kv_cache_tokens,
        max_running_requests=args.max_running_requests,
        max_batch_tokens=args.max_batch_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        disable_radix_cache=args.disable_radix_cache,
        host_cache_tokens=host_cache_tokens(args.kv_cache_tokens, args.hicache_ratio)
        if hier
        else 0,
        prefetch_threshold_tokens=args.hicache_prefetch_threshold,
        speculative=args.speculative,
        block_size=args.block_size,
    )
    return Deployment(
        num_replicas=args.replicas,
        num_prefill=args.prefill,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        replica=replica,
        storage_tokens=None if math.isinf(storage) else int(storage),
        replicas_per_host=args.replicas_per_host,
        **contention_from(args.contention, cost),
    )


class _Contention(TypedDict):
    contention: float
    contention_prefill: float | None


def contention_from(flag: float | None, cost) -> _Contention:
    """Deployment's contention figures: --contention for every step, else the calibration's
    measured ones, else 1 (full processor sharing)."""
    if flag is not None:
        return {"contention": flag, "contention_prefill": flag}
    if cost is not None and cost.contention is not None:
        return {
            "contention": cost.contention,
            "contention_prefill": cost.contention_prefill,
        }
    return {"contention": 1.0, "contention_prefill": None}


def workload_from_args(args: argparse.Namespace, rate: float):
    from strata.bench.cli import dataset_config_from_args
    from strata.plan.workload import dataset_workload, trace_workload

    if args.arrival == "trace":
        if not args.trace:
            raise ValueError("--arrival trace needs --trace FILE.jsonl")
        wl = trace_workload(args.trace, args.max_concurrency, args.seed)
        wl.think_time_s = args.think_time
        return wl
    tokenizer = None
    if args.tokenizer:
        from strata.bench.cli import load_bench_tokenizer

        _, tokenizer = load_bench_tokenizer(
            None if args.tokenizer == "default" else args.tokenizer
        )
    return dataset_workload(
        dataset_config_from_args(args),
        rate,
        args.arrival,
        args.burst_size,
        args.max_concurrency,
        tokenizer,
        args.think_time,
    )


# ----------------------------------------------------------------- commands


def cmd_calibrate(args: argparse.Namespace) -> int:
    from strata.plan import calibrate, figures, remote

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.pd_transfer:
        if not (args.base_url and args.from_json):
            raise ValueError(
                "--pd-transfer needs --base-url (the PD router) and --from-json (one worker's calibration)"
            )
        base, _ = figures.calibrate_json(args.from_json, args.row_threshold)
        model, rows = remote.calibrate_pd(
            args.base_url, base, api_key=args.api_key, progress=say
        )
        for r in rows:
            say(
                f"PD: {r['new_tokens']} tokens: TTFT {r['ttft_s'] * 1e3:.0f} ms, "
                f"{r['without_handoff_s'] * 1e3:.0f} ms of it outside the handoff"
            )
        print(calibration_text(model))
        model.save(args.output, {"pd_handoff": rows})
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    if args.from_json:
        model, samples = figures.calibrate_json(
            args.from_json,
            args.row_threshold,
            args.chunked_prefill_size,
            args.max_batch_tokens,
            args.spec_scenario,
        )
    elif args.base_url:
        plan = remote.ServerPlan(
            chunked_prefill_size=args.chunked_prefill_size,
            max_batch_tokens=args.max_batch_tokens,
            row_threshold=args.row_threshold,
        )
        model, samples = remote.calibrate_server(
            args.base_url, plan, args.api_key, progress=say
        )
    else:
        import dataclasses

        from strata.config import engine_config_from_args
        from strata.engine.engine import Engine

        engine = Engine(**dataclasses.asdict(engine_config_from_args(args)))
        engine_plan = calibrate.EnginePlan()
        if args.quick:
            engine_plan = calibrate.EnginePlan(
                prefill_lens=(64, 512),
                cached_prefills=((512, 128),),
                decode_batches=(1, 8, 31, 48),
                decode_contexts=(64, 512),
                decode_steps=6,
            )
        model, samples = calibrate.calibrate_engine(engine, engine_plan, progress=say)
        engine.close()
    print(calibration_text(model))
    model.save(
        args.output,
        {
            "samples": [
                {
                    "what": s.what,
                    "seconds": s.seconds,
                    "features": list(s.features),
                    "steps": s.num_steps,
                    "requests": s.requests,
                }
                for s in samples
            ]
        },
    )
    print(f"wrote {args.output}", file=sys.stderr)
    if args.plot and samples:
        from strata.plan.plots import plot_fit

        for path in plot_fit(model, samples, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def calibration_text(model) -> str:
    from strata.bench import report

    rows = [[name, f"{value:.4g}"] for name, value in model.coef.items()]
    rows += [
        ["row_threshold", str(model.row_threshold)],
        ["request_overhead_s", f"{model.request_overhead_s:.4g}"],
        ["kv_bytes_per_token", str(model.kv_bytes_per_token)],
        [
            "host / storage / PD GB/s",
            " / ".join(
                f"{x / 1e9:.2f}"
                for x in (
                    model.host_bytes_per_s,
                    model.storage_bytes_per_s,
                    model.pd_bytes_per_s,
                )
            ),
        ],
        [
            "spec accept rate",
            "n/a"
            if model.spec_accept_rate is None
            else f"{model.spec_accept_rate:.3f}",
        ],
        [
            "spec drafter per drafting step (ms)",
            f"{model.spec_draft_s * 1e3:.2f}",
        ],
        [
            "co-located replicas' contention: decode / prefill",
            " / ".join(
                "n/a" if c is None else f"{c:.2f}"
                for c in (model.contention, model.contention_prefill)
            ),
        ],
        [
            "fit: median / max relative error",
            f"{model.fit.get('median_rel_err', float('nan')):.1%} / {model.fit.get('max_rel_err', float('nan')):.1%}",
        ],
        [
            "examples: prefill 512 / decode step b=1, b=32 (ms)",
            f"{model.prefill_s(512) * 1e3:.1f} / {model.decode_step_s(1, 512) * 1e3:.1f}, {model.decode_step_s(32, 512) * 1e3:.1f}",
        ],
    ]
    return f"cost model ({model.source})\n" + report.table(
        rows, ["coefficient", "value"]
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from strata.plan.cluster import simulate
    from strata.plan.results import compare_text, result_text

    cost = cost_model_from_args(args)
    result = simulate(
        workload_from_args(args, args.request_rate),
        deployment_from_args(args, cost),
        cost,
        args.sim_seed,
    )
    print(result_text(result))
    if args.compare_json:
        with open(args.compare_json) as f:
            measured = json.load(f)
        runs = measured.get("results") or []
        if not runs:
            raise ValueError(f"{args.compare_json} holds no serving result")
        print()
        print(compare_text(result, runs[0]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "plan": "simulate",
                    "cost_model": cost.to_json(),
                    "result": result.to_json(),
                },
                f,
                indent=2,
            )
    if args.plot:
        from strata.plan.plots import plot_result

        for path in plot_result(result, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_size(args: argparse.Namespace) -> int:
    from strata.bench import report
    from strata.plan.search import SLO, size

    if args.slo_ttft_p99 is None and args.slo_itl_p99 is None:
        raise ValueError(
            "give at least one target: --slo-ttft-p99 MS and/or --slo-itl-p99 MS"
        )
    rate = args.rate if args.rate is not None else args.request_rate
    if math.isinf(rate):
        raise ValueError("size needs an arrival rate: --rate R (conversations/s)")
    cost = cost_model_from_args(args)
    slo = SLO(args.slo_ttft_p99, args.slo_itl_p99)
    workload = workload_from_args(args, rate)
    best, tried = size(
        workload,
        deployment_from_args(args, cost),
        cost,
        slo,
        args.max_workers,
        pd=not args.no_pd,
        dp=not args.no_dp,
        prefill_cost=args.prefill_cost,
        decode_cost=args.decode_cost,
        seed=args.sim_seed,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    rows = [
        [
            c.deployment.label,
            f"{c.cost:g}",
            report.fmt(c.result.summary.ttft.p99_ms, 0),
            report.fmt(c.result.summary.itl.p99_ms, 0),
            report.fmt(c.result.summary.output_throughput, 1),
            "yes" if c.passes else "no",
        ]
        for c in tried
    ]
    print(
        report.table(
            rows,
            [
                "deployment",
                "cost",
                "TTFT p99 ms",
                "ITL p99 ms",
                "out tok/s",
                "meets SLO",
            ],
        )
    )
    if best is None:
        print(
            f"\nno deployment of at most {args.max_workers} workers meets the SLO at {rate:g} conversations/s"
        )
    else:
        print(
            f"\ncheapest meeting the SLO at {rate:g} conversations/s: {best.deployment.label} (cost {best.cost:g})"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "plan": "size",
                    "rate": rate,
                    "slo": {
                        "ttft_p99_ms": slo.ttft_p99_ms,
                        "itl_p99_ms": slo.itl_p99_ms,
                    },
                    "best": best.deployment.label if best else None,
                    "tried": [
                        {
                            "deployment": c.deployment.label,
                            "num_prefill": c.deployment.num_prefill,
                            "num_decode": c.deployment.num_replicas,
                            "cost": c.cost,
                            "passes": c.passes,
                            "result": c.result.to_json(),
                        }
                        for c in tried
                    ],
                },
                f,
                indent=2,
            )
    if args.plot:
        from strata.plan.plots import plot_size

        for path in plot_size(tried, slo, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if best is not None else 1
