"""Offline throughput: a whole dataset through an in-process engine, no HTTP.

All single-turn requests are submitted at once (the engine batches them as it likes). Multi-turn
conversations go in waves: turn k of every conversation once every turn k-1 has been answered,
each prompt carrying the previous turns and answers as token ids (datasets.turn_prompt_ids).

Figures: requests/s, input/output/total tokens/s over the whole run; for Strata also the steady
window (20%..90% of requests completed: mean decode step time and tokens/s inside it), the
prompt tokens the radix cache served and, for a mixture-of-experts model, the tokens each expert
of each MoE layer got during the run (the model's counters before and after; warm-up excluded)
with how uneven that was (`strata.layers.expert_load`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata.bench.datasets import Conversation, turn_prompt_ids
from strata.bench.one_batch import WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, random_batch
from strata.bench.step_timer import StepTimer, mean_pieces_ms
from strata.bench.window import SteadyWindow, StepSample, engine_window
from strata.layers.expert_load import expert_load_delta, expert_load_summary

# (prompts as token ids, answer lengths) -> (answers as token ids, prompt tokens served from cache)
GenerateFn = Callable[[list[list[int]], list[int]], tuple[list[list[int]], int]]


@dataclass(frozen=True)
class OfflineResult:
    target: str
    num_requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: (
        int | None
    )  # prompt tokens served by the prefix cache (None: unknown)
    request_throughput: float
    input_tok_s: float
    output_tok_s: float
    total_tok_s: float
    window: SteadyWindow | None = None  # Strata only
    decode_pieces_ms: dict[str, float] | None = (
        None  # Strata only: mean per decode-only step (step_timer.py)
    )
    # Strata, MoE models only: {layer: tokens routed to each expert} during the run, and per layer
    # its tokens, busiest expert, max / mean (expert_load_summary)
    expert_load: dict[int, list[int]] | None = None
    expert_load_summary: dict[int, dict[str, Any]] | None = None

    @property
    def cache_hit_rate(self) -> float | None:
        return (
            None
            if self.cached_tokens is None or not self.input_tokens
            else self.cached_tokens / self.input_tokens
        )


def run_conversations(
    generate: GenerateFn, conversations: list[Conversation], tokenizer
) -> tuple[int, int, int, int]:
    """Answer every turn; returns (requests, input tokens, output tokens, cached tokens)."""
    prompts: list[list[int] | None] = [None] * len(conversations)
    answers: list[list[int] | None] = [None] * len(conversations)
    n_req = n_in = n_out = n_cached = 0
    for turn in range(max(len(c.turns) for c in conversations)):
        active = [i for i, c in enumerate(conversations) if len(c.turns) > turn]
        ids = [
            turn_prompt_ids(conversations[i], turn, prompts[i], answers[i], tokenizer)
            for i in active
        ]
        lens = [conversations[i].turns[turn].output_len for i in active]
        outs, cached = generate(ids, lens)
        for i, p, a in zip(active, ids, outs):
            prompts[i], answers[i] = p, a
        n_req += len(active)
        n_in += sum(len(p) for p in ids)
        n_out += sum(len(a) for a in outs)
        n_cached += cached
    return n_req, n_in, n_out, n_cached


def _result(
    target: str,
    counts: tuple[int, int, int, int],
    duration: float,
    cached_known: bool,
    window=None,
    pieces=None,
    expert_load: dict[int, list[int]] | None = None,
) -> OfflineResult:
    n_req, n_in, n_out, n_cached = counts
    return OfflineResult(
        target=target,
        num_requests=n_req,
        duration_s=duration,
        input_tokens=n_in,
        output_tokens=n_out,
        cached_tokens=n_cached if cached_known else None,
        request_throughput=n_req / duration,
        input_tok_s=n_in / duration,
        output_tok_s=n_out / duration,
        total_tok_s=(n_in + n_out) / duration,
        window=window,
        decode_pieces_ms=pieces,
        expert_load=expert_load or None,
        expert_load_summary=expert_load_summary(expert_load) if expert_load else None,
    )


def run_strata_offline(
    engine, conversations: list[Conversation], target: str = "strata"
) -> OfflineResult:
    from strata.sampling_params import SamplingParams

    warm = random_batch(
        engine.state.model_config.vocab_size,
        2,
        WARMUP_INPUT_LEN,
        seed=12345,
        exclude=set(),
    )
    engine.generate(
        warm,
        SamplingParams(
            max_new_tokens=WARMUP_OUTPUT_LEN, temperature=0.0, ignore_eos=True
        ),
    )

    def generate(ids: list[list[int]], lens: list[int]) -> tuple[list[list[int]], int]:
        params = [
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            for n in lens
        ]
        results = engine.generate(ids, params)
        errors = [r.choices[0].error for r in results if r.choices[0].error]
        if errors:
            raise RuntimeError(f"offline requests failed ({len(errors)}): {errors[0]}")
        return [r.token_ids for r in results], sum(r.cached_tokens for r in results)

    load_before = engine.model.expert_load()  # {} for a dense model
    with StepTimer(engine) as timer:
        start = time.perf_counter()
        counts = run_conversations(generate, conversations, engine.tokenizer)
        duration = time.perf_counter() - start
    load = expert_load_delta(engine.model.expert_load(), load_before)
    steps = [
        StepSample(s.end, s.duration_s, s.num_sampled, s.decode_only)
        for s in timer.steps
    ]
    finish_times = [s.end for s in timer.steps for _ in range(s.num_finished)]
    pieces = mean_pieces_ms([s for s in timer.steps if s.decode_only])
    return _result(
        target, counts, duration, True, engine_window(steps, finish_times), pieces, load
    )


def run_hf_offline(
    hf_model,
    conversations: list[Conversation],
    tokenizer,
    batch_size: int,
    target: str = "transformers",
) -> OfflineResult:
    warm = random_batch(
        hf_model.vocab_size, 2, WARMUP_INPUT_LEN, seed=12345, exclude=set()
    )
    hf_model.generate_batch(warm, [WARMUP_OUTPUT_LEN] * 2, batch_size)

    def generate(ids: list[list[int]], lens: list[int]) -> tuple[list[list[int]], int]:
        return hf_model.generate_batch(ids, lens, batch_size), 0

    start = time.perf_counter()
    counts = run_conversations(generate, conversations, tokenizer)
    return _result(target, counts, time.perf_counter() - start, False)
