"""How `strata bench` reads its flags into configs, shared by its commands (cli.py, compare_cli.py)
and the planner: the dataset, a serving run, the rate/concurrency sweep, the tokenizer prompts are
made with."""

from __future__ import annotations

import argparse
import math


def dataset_config_from_args(args: argparse.Namespace, seed_offset: int = 0):
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


def load_bench_tokenizer(model: str | None):
    from strata.tokenizer import load_tokenizer
    from strata.weights.default_model import resolve_model_path

    model_dir = resolve_model_path(model)
    assert model_dir is not None  # None only for no model, and there is one here
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(
            f"{model_dir} has no tokenizer; benchmarks make text prompts, pass a model directory with one"
        )
    return model_dir, tokenizer


def serving_config_from_args(
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


def sweep_points(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    return [
        (rate, conc)
        for rate in args.request_rate
        for conc in (args.max_concurrency or [None])
    ]


def sweep_label(rate: float, conc: int | None) -> str:
    parts = [f"c={conc}"] if conc else []
    if not math.isinf(rate) or not parts:
        parts.append(f"rate={rate:g}")
    return " ".join(parts)
