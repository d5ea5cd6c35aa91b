"""One fixed batch on the offline Engine: batch_size prompts of input_len random tokens, each
generating exactly output_len tokens (greedy, ignore_eos). No server, no arrivals.

    prefill   from adding the batch to the step in which the last request got its first token;
              prefill throughput = batch_size * input_len / that time (chunked prefill may take
              several steps, and early finishers may already decode inside them)
    decode    every later step in which all requests decode; the decode step time is their median

Also reported: the mean time of each piece of a step (schedule / prepare / model / logits /
sample / process, see step_timer.py) over the prefill steps and over the decode steps.
A short warm-up batch runs first so one-time costs are not measured.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from strata.bench.step_timer import StepTimer, mean_pieces_ms

WARMUP_INPUT_LEN = 16
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class OneBatchResult:
    target: str
    batch_size: int
    input_len: int
    output_len: int
    prefill_s: float
    prefill_tok_s: float  # batch_size * input_len / prefill_s
    decode_step_ms: float | None  # median over steps in which every request decodes
    decode_tok_s: float | None  # batch_size / decode step time
    num_decode_steps: int
    prefill_pieces_ms: dict[str, float] | None = (
        None  # mean per prefill step (Strata only)
    )
    decode_pieces_ms: dict[str, float] | None = (
        None  # mean per decode step (Strata only)
    )
    path: dict[str, object] | None = (
        None  # what ran: dtype (and why), weight formats, kernel build, ISA
    )
    # the most KV memory in use after any step, per request (Strata only; with the prefix cache on it
    # includes what the cache keeps, so measure per-request needs with --disable-radix-cache)
    kv_peak_bytes_per_request: float | None = None

    @classmethod
    def measured(
        cls,
        target: str,
        batch_size: int,
        input_len: int,
        output_len: int,
        prefill_s: float,
        decode_step_ms: float | None,
        num_decode_steps: int,
        **extra: Any,
    ) -> OneBatchResult:
        """A result from the measured times; the rates follow from them."""
        return cls(
            target=target,
            batch_size=batch_size,
            input_len=input_len,
            output_len=output_len,
            prefill_s=prefill_s,
            prefill_tok_s=batch_size * input_len / prefill_s,
            decode_step_ms=decode_step_ms,
            decode_tok_s=batch_size / (decode_step_ms / 1000.0)
            if decode_step_ms
            else None,
            num_decode_steps=num_decode_steps,
            **extra,
        )


def random_batch(
    vocab_size: int, batch_size: int, input_len: int, seed: int, exclude: set[int]
) -> list[list[int]]:
    """batch_size prompts of input_len token ids, distinct first tokens (so no prefix is shared)."""
    rng = random.Random(seed)
    pool = [i for i in range(vocab_size) if i not in exclude]
    firsts = (
        rng.sample(pool, batch_size)
        if batch_size <= len(pool)
        else [rng.choice(pool) for _ in range(batch_size)]
    )
    return [
        [first] + [rng.choice(pool) for _ in range(input_len - 1)] for first in firsts
    ]


def special_ids(tokenizer) -> set[int]:
    return (
        set(getattr(tokenizer, "all_special_ids", []) or [])
        if tokenizer is not None
        else set()
    )


def run_strata_one_batch(
    engine, batch_size: int, input_len: int, output_len: int, seed: int = 0
) -> OneBatchResult:
    """Measure one batch on `engine` (a strata.Engine). The radix cache cannot help: prompts are fresh."""
    from strata.sampling_params import SamplingParams

    vocab = engine.state.model_config.vocab_size
    exclude = special_ids(engine.tokenizer) | set(engine.state.eos_token_ids)
    warm = random_batch(
        vocab, batch_size, min(WARMUP_INPUT_LEN, input_len), seed + 10_000, exclude
    )
    engine.generate(
        warm,
        SamplingParams(
            max_new_tokens=WARMUP_OUTPUT_LEN, temperature=0.0, ignore_eos=True
        ),
    )

    prompts = random_batch(vocab, batch_size, input_len, seed, exclude)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    with StepTimer(engine) as timer:
        start = time.perf_counter()
        results = engine.generate(prompts, params)
    errors = [r.choices[0].error for r in results if r.choices[0].error]
    if errors:
        raise RuntimeError(f"one-batch requests failed: {errors[0]}")
    steps = timer.steps
    # prefill ends with the step in which the last request got its first token
    firsts, prefill_steps = 0, len(steps)
    for i, s in enumerate(steps):
        firsts += s.num_first_tokens
        if firsts >= batch_size:
            prefill_steps = i + 1
            break
    prefill, rest = steps[:prefill_steps], steps[prefill_steps:]
    decode = [s for s in rest if s.decode_only and s.num_decode == batch_size]
    prefill_s = prefill[-1].end - start
    step_ms = (
        statistics.median(1000.0 * s.duration_s for s in decode) if decode else None
    )
    return OneBatchResult.measured(
        "strata",
        batch_size,
        input_len,
        output_len,
        prefill_s,
        step_ms,
        len(decode),
        prefill_pieces_ms=mean_pieces_ms(prefill),
        decode_pieces_ms=mean_pieces_ms(decode),
        path=engine_path(engine),
        kv_peak_bytes_per_request=max(s.kv_bytes for s in steps) / batch_size,
    )


def engine_path(engine) -> dict[str, object]:
    """Which code path an engine's figures come from, for the benchmark record."""
    st = engine.state
    return {
        "dtype": str(st.dtype).removeprefix("torch."),
        "dtype_reason": st.dtype_reason,
        "weights": st.weights,
        "quantization": engine.config.quantization,
        "decode_loop": st.decode_loop,
        "step_threads": engine.config.step_threads,
        **st.kernels,
    }
