"""Two ways of timing one deployment, side by side, in one run (`strata bench timing`).

The seed's comparison of two serving stacks turned on how each timed its benchmark:

    fixed batches      (DeepSeek's method) a fixed number of prefill batches, each the same
                       prompt on every rank, timed on rank 0; decode timed on a batch whose
                       requests all ask for the same number of new tokens
    completion window  (SGLang's method) every request different in the new tokens it asks for,
                       all sent at once; the figures of the steps between 20% and 90% of requests
                       completed (strata.bench.window)

Both run here on the same engine, one after the other, with the same batch size and prompt
length:

    fixed batches      `prefill_batches` batches of `batch_size` requests of one prompt (its first
                       token made distinct per row, so the radix cache shares nothing, as separate
                       ranks would not), each asking for one token: a batch's time is from its
                       submission to its last request's first token, its throughput
                       batch_size * input_len / that time; then one batch of fresh prompts asking
                       for `output_len` tokens each, timed on its steps in which every request
                       decodes. Reported: medians.
    completion window  `batch_size` fresh prompts asking for output lengths spread evenly over
                       [range_ratio * output_len, output_len], all at once: output tokens/s and
                       the mean decode step inside the window, and the whole run's output tokens/s.

On one process "rank 0" is the engine: with --tp-size the scheduler and its step timings are rank
0's, which is where DeepSeek's method reads them too.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from strata.bench.one_batch import engine_path, random_batch, special_ids
from strata.bench.step_timer import StepTimer
from strata.bench.window import SteadyWindow, StepSample, engine_window

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class FixedBatches:
    """DeepSeek's method."""

    prefill_tok_s: list[float]  # one per prefill batch
    decode_step_ms: list[float]  # each step in which the whole batch decodes

    @property
    def prefill_tok_s_median(self) -> float:
        return statistics.median(self.prefill_tok_s)

    @property
    def decode_step_ms_median(self) -> float | None:
        return statistics.median(self.decode_step_ms) if self.decode_step_ms else None


@dataclass(frozen=True)
class CompletionWindow:
    """SGLang's method."""

    output_lens: list[int]
    window: SteadyWindow | None
    run_s: float
    run_output_tok_s: float
    prefill_tok_s: float  # all prompts: submission to the last first token


@dataclass(frozen=True)
class TimingComparison:
    batch_size: int
    input_len: int
    output_len: int
    range_ratio: float
    fixed: FixedBatches
    window: CompletionWindow
    path: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, float | None]:
        """The figures the two methods report for the same deployment, and their ratios."""
        w = self.window.window
        fixed_decode = self.fixed.decode_step_ms_median
        fixed_out = 1000.0 * self.batch_size / fixed_decode if fixed_decode else None
        window_out = w.output_throughput if w else None
        return {
            "fixed_prefill_tok_s": self.fixed.prefill_tok_s_median,
            "window_prefill_tok_s": self.window.prefill_tok_s,
            "fixed_decode_step_ms": fixed_decode,
            "window_decode_step_ms": w.mean_step_ms if w else None,
            "fixed_output_tok_s": fixed_out,
            "window_output_tok_s": window_out,
            "run_output_tok_s": self.window.run_output_tok_s,
            "fixed_over_window_output": (
                fixed_out / window_out if fixed_out and window_out else None
            ),
        }


def spread_lengths(n: int, output_len: int, range_ratio: float) -> list[int]:
    """n output lengths spread evenly over [range_ratio * output_len, output_len], so requests
    sent together finish one after another instead of all at once."""
    low = max(1, round(range_ratio * output_len))
    if n == 1:
        return [output_len]
    return [round(low + (output_len - low) * i / (n - 1)) for i in range(n)]


def run_timing_methods(
    engine,
    batch_size: int,
    input_len: int,
    output_len: int,
    prefill_batches: int = 9,
    range_ratio: float = 0.25,
    seed: int = 0,
) -> TimingComparison:
    """Both methods on `engine` (a strata.Engine), fixed batches first."""
    from strata.sampling_params import SamplingParams

    if batch_size < 2 or prefill_batches < 1 or not 0 < range_ratio <= 1:
        raise ValueError(
            "batch_size >= 2, prefill_batches >= 1 and 0 < range_ratio <= 1 are needed"
        )
    vocab = engine.state.model_config.vocab_size
    exclude = special_ids(engine.tokenizer) | set(engine.state.eos_token_ids)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    engine.generate(
        random_batch(vocab, batch_size, WARMUP_TOKENS, seed + 10_000, exclude),
        params(4),
    )
    # fixed batches: one prompt, its first token distinct per row
    (prompt,) = random_batch(vocab, 1, input_len, seed, exclude)
    firsts = random_batch(vocab, batch_size, 1, seed + 1, exclude)
    rows = [first + prompt[1:] for first in firsts]
    prefill = []
    for _ in range(prefill_batches):
        engine.flush_cache()
        start = time.perf_counter()
        _check(engine.generate(rows, params(1)))
        prefill.append(batch_size * input_len / (time.perf_counter() - start))
    engine.flush_cache()
    fresh = random_batch(vocab, batch_size, input_len, seed + 2, exclude)
    with StepTimer(engine) as timer:
        _check(engine.generate(fresh, params(output_len)))
    decode = [
        1000.0 * s.duration_s
        for s in timer.steps
        if s.decode_only and s.num_decode == batch_size
    ]
    fixed = FixedBatches(prefill, decode)
    # completion window: different new tokens per request, all sent at once
    engine.flush_cache()
    prompts = random_batch(vocab, batch_size, input_len, seed + 3, exclude)
    lens = spread_lengths(batch_size, output_len, range_ratio)
    with StepTimer(engine) as timer:
        start = time.perf_counter()
        _check(engine.generate(prompts, [params(n) for n in lens]))
        run_s = time.perf_counter() - start
    steps = timer.steps
    firsts_seen, first_done = 0, run_s
    for s in steps:
        firsts_seen += s.num_first_tokens
        if firsts_seen >= batch_size:
            first_done = s.end - start
            break
    samples = [
        StepSample(s.end, s.duration_s, s.num_sampled, s.decode_only) for s in steps
    ]
    finish_times = [s.end for s in steps for _ in range(s.num_finished)]
    window = CompletionWindow(
        lens,
        engine_window(samples, finish_times),
        run_s,
        sum(lens) / run_s,
        batch_size * input_len / first_done,
    )
    return TimingComparison(
        batch_size,
        input_len,
        output_len,
        range_ratio,
        fixed,
        window,
        engine_path(engine),
    )


def _check(results) -> None:
    errors = [r.choices[0].error for r in results if r.choices[0].error]
    if errors:
        raise RuntimeError(f"timing requests failed ({len(errors)}): {errors[0]}")


def timing_text(c: TimingComparison) -> str:
    s = c.summary()

    def fmt(x: float | None, spec: str = ".1f") -> str:
        return "n/a" if x is None else format(x, spec)

    head = (
        f"timing methods: batch {c.batch_size}, input {c.input_len}, "
        f"output {c.output_len} (window run: {c.range_ratio:g}x..1x of it per request)"
    )
    rows = [
        ("prefill tok/s", "prefill_tok_s", ".1f"),
        ("decode step ms", "decode_step_ms", ".2f"),
        ("output tok/s", "output_tok_s", ".1f"),
    ]
    table = [f"{'figure':<28}{'fixed batches':>16}{'20%-90% window':>16}"]
    for label, key, spec in rows:
        fixed, window = fmt(s[f"fixed_{key}"], spec), fmt(s[f"window_{key}"], spec)
        table.append(f"{label:<28}{fixed:>16}{window:>16}")
    ratio = fmt(s["fixed_over_window_output"], ".2f")
    run = fmt(s["run_output_tok_s"])
    batches = ", ".join(f"{x:.0f}" for x in c.fixed.prefill_tok_s)
    lines = [
        head,
        "",
        *table,
        "",
        f"whole window run: {run} output tok/s; fixed / window output: {ratio}x",
        f"prefill batches (tok/s): {batches}",
    ]
    if c.window.window is None:
        lines.append(
            "no 20%-90% window: the requests finished together "
            "(lower --range-ratio or raise --batch-size)"
        )
    return "\n".join(lines)
