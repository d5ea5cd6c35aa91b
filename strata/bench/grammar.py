"""`strata bench grammar`: what structured output costs on the offline Engine.

    compile   per JSON schema (SCHEMAS: 8 shapes, each made distinct per index): the first
              `GrammarCompiler.new_state` (compile + copy) and a later one (LRU hit + copy), median
              over the schemas
    decode    one fixed batch (--batch-size, default 1 and 64) of random prompts decoding
              --output-len tokens greedily, once free and once with a JSON-schema grammar per request
              (the schemas cycled, so a batch mixes distinct grammars; each needs far more than
              --output-len tokens to complete, so every request decodes every step); the figure is
              the median step time over the steps in which every request decodes, and the overhead
              is with / without - 1. The grammar's work happens in two step pieces (step_timer.py):
              `sample` (mask fill + apply + sampling) and `process` (appending tokens, advancing
              the grammar); `added_ms` is their growth, measured inside the same steps, and
              `added_fraction` = added_ms / the free step. On a shared CPU the model's time varies
              more between runs than the grammar adds, so `added_fraction` is the steadier figure.
The free and constrained runs alternate --rounds times; each reports its median round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

from strata.bench.one_batch import random_batch, special_ids
from strata.bench.step_timer import StepTimer, mean_pieces_ms


def schema(i: int) -> dict:
    """A JSON schema exercising integers, bounded strings, enums, nested objects and a long array;
    `i` makes each one a distinct grammar (and cache entry)."""
    kinds = i % 8
    item = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "maxLength": 12},
            "qty": {"type": "integer", "minimum": 0, "maximum": 10_000},
        },
        "required": ["sku", "qty"],
        "additionalProperties": False,
    }
    props = {
        f"id_{i}": {"type": "integer"},
        "name": {"type": "string", "maxLength": 16 + kinds},
        "status": {"enum": ["open", "closed", "pending", f"state{i}"]},
        "score": {"type": "number"},
        "items": {"type": "array", "items": item, "minItems": 40 + kinds},
    }
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class CompileResult:
    num_schemas: int
    first_ms: float  # median: compile + copy
    cached_ms: float  # median: cache hit + copy


@dataclass(frozen=True)
class DecodeResult:
    batch_size: int
    output_len: int
    free_step_ms: float
    grammar_step_ms: float
    overhead: float  # grammar / free - 1
    added_ms: float  # growth of the sample + process pieces
    added_fraction: float  # added_ms / free_step_ms
    free_pieces_ms: dict[str, float]
    grammar_pieces_ms: dict[str, float]


def bench_compile(engine, num_schemas: int) -> CompileResult:
    from strata.grammar.compiler import GrammarCompiler
    from strata.grammar.spec import json_schema_spec

    compiler = GrammarCompiler(
        engine.tokenizer, engine.scheduler.vocab_size, engine.scheduler.eos_token_ids
    )
    first, cached = [], []
    for i in range(num_schemas):
        spec = json_schema_spec(schema(10_000 + i))
        t0 = time.perf_counter()
        compiler.new_state(spec)
        t1 = time.perf_counter()
        compiler.new_state(json_schema_spec(schema(10_000 + i)))
        t2 = time.perf_counter()
        first.append(t1 - t0)
        cached.append(t2 - t1)
    return CompileResult(
        num_schemas, 1000 * statistics.median(first), 1000 * statistics.median(cached)
    )


def _decode_run(engine, prompts: list[list[int]], output_len: int, grammar: bool):
    from strata.grammar.spec import json_schema_spec
    from strata.sampling_params import SamplingParams

    params = [
        SamplingParams(
            max_new_tokens=output_len,
            temperature=0.0,
            ignore_eos=True,
            structured=json_schema_spec(schema(i % 8)) if grammar else None,
        )
        for i in range(len(prompts))
    ]
    with StepTimer(engine) as timer:
        results = engine.generate(prompts, params)
    errors = [r.choices[0].error for r in results if r.choices[0].error]
    if errors:
        raise RuntimeError(f"grammar bench requests failed: {errors[0]}")
    short = [
        len(r.choices[0].token_ids)
        for r in results
        if len(r.choices[0].token_ids) < output_len
    ]
    if short:
        raise RuntimeError(
            f"a request finished after {short[0]} of {output_len} tokens: the grammar completed early"
        )
    decode = [s for s in timer.steps if s.decode_only and s.num_decode == len(prompts)]
    return 1000 * statistics.median(s.duration_s for s in decode), mean_pieces_ms(
        decode
    )


def bench_decode(
    engine, batch_size: int, input_len: int, output_len: int, rounds: int, seed: int
) -> DecodeResult:
    vocab = engine.state.model_config.vocab_size
    exclude = special_ids(engine.tokenizer) | set(engine.state.eos_token_ids)
    prompts = random_batch(vocab, batch_size, input_len, seed, exclude)
    _decode_run(
        engine, prompts, 4, grammar=True
    )  # warm-up: compiles the schemas, first-use costs
    runs: dict[bool, list[tuple[float, dict[str, float]]]] = {False: [], True: []}
    for r in range(rounds):
        for grammar in (False, True):
            fresh = random_batch(vocab, batch_size, input_len, seed + 1 + r, exclude)
            runs[grammar].append(_decode_run(engine, fresh, output_len, grammar))
    free = sorted(runs[False], key=lambda x: x[0])[len(runs[False]) // 2]
    constrained = sorted(runs[True], key=lambda x: x[0])[len(runs[True]) // 2]
    added = sum(constrained[1][p] - free[1][p] for p in ("sample", "process"))
    return DecodeResult(
        batch_size,
        output_len,
        free[0],
        constrained[0],
        constrained[0] / free[0] - 1,
        added,
        added / free[0],
        free[1],
        constrained[1],
    )


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grammar bench")
    g.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument(
        "--num-schemas",
        type=int,
        default=32,
        help="schemas compiled for the compile figure",
    )
    g.add_argument("--seed", type=int, default=0)


def run(engine, args: argparse.Namespace) -> dict:
    compile_result = bench_compile(engine, args.num_schemas)
    decode = [
        bench_decode(
            engine, bs, args.input_len, args.output_len, args.rounds, args.seed
        )
        for bs in args.batch_size
    ]
    return {"compile": asdict(compile_result), "decode": [asdict(d) for d in decode]}


def format_text(result: dict) -> str:
    c = result["compile"]
    lines = [
        f"grammar compile ({c['num_schemas']} JSON schemas): first {c['first_ms']:.2f} ms, cached {c['cached_ms']:.3f} ms",
        (
            f"{'batch':>5} {'free ms/step':>13} {'grammar ms/step':>16} {'overhead':>9} {'model ms':>17} "
            f"{'sample ms':>17} {'process ms':>17} {'added ms':>9} {'added':>7}"
        ),
    ]
    for d in result["decode"]:
        fp, gp = d["free_pieces_ms"], d["grammar_pieces_ms"]
        lines.append(
            f"{d['batch_size']:>5} {d['free_step_ms']:>13.2f} {d['grammar_step_ms']:>16.2f} {100 * d['overhead']:>8.1f}% "
            f"{fp['model']:>7.2f} -> {gp['model']:>6.2f} "
            f"{fp['sample']:>7.2f} -> {gp['sample']:>6.2f} {fp['process']:>7.2f} -> {gp['process']:>6.2f} "
            f"{d['added_ms']:>9.2f} {100 * d['added_fraction']:>6.1f}%"
        )
    return "\n".join(lines)
