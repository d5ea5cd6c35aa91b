"""Engine behaviour a user sees: sampling semantics end to end, stop handling, n > 1, streaming,
aborts, rejections and page accounting (tiny random model with a real tokenizer, fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from strata import Engine, SamplingParams, kernels
from strata.engine.hooks import StepObserver

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def engine(llama_dir) -> Engine:
    return Engine(str(llama_dir), dtype="float32", kv_cache_tokens=4096, page_size=4)


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kw)


def test_seed_reproducible_regardless_of_batch(engine):
    params = SamplingParams(
        temperature=1.0, max_new_tokens=16, seed=1234, ignore_eos=True
    )
    alone = engine.generate(PROMPT, params)[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
        for _ in range(3)
    ]
    mixed = engine.generate(
        ["Hello", PROMPT, "Radix trees", "Numbers"],
        [others[0], params, others[1], others[2]],
    )
    assert mixed[1].token_ids == alone
    other_seed = engine.generate(
        PROMPT,
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=99, ignore_eos=True),
    )
    assert other_seed[0].token_ids != alone


def test_max_new_tokens_gives_length(engine):
    r = engine.generate(PROMPT, greedy(7))[0]
    assert len(r.token_ids) == 7 and r.finish_reason == "length"


def test_stop_string_truncates_text_and_stream_never_shows_it(engine):
    full = engine.generate(PROMPT, greedy(30))[0].text
    assert len(full) > 12
    stop = full[6:10]
    cut = full[: full.index(stop)]
    r = engine.generate(PROMPT, greedy(30, stop=[stop]))[0]
    assert r.text == cut and r.finish_reason == "stop" and r.matched_stop == stop
    streamed = "".join(
        o.text_delta for o in engine.stream(PROMPT, greedy(30, stop=[stop]))
    )
    assert streamed == cut


def test_stop_token_id_and_min_new_tokens(engine):
    tokens = engine.generate(PROMPT, greedy(12))[0].token_ids
    stop_tok = tokens[2]
    first = tokens.index(stop_tok)
    r = engine.generate(PROMPT, greedy(12, stop_token_ids=[stop_tok]))[0]
    assert (
        r.finish_reason == "stop"
        and r.matched_stop == stop_tok
        and r.token_ids == tokens[: first + 1]
    )
    held = engine.generate(
        PROMPT, greedy(12, stop_token_ids=[stop_tok], min_new_tokens=6)
    )[0]
    assert len(held.token_ids) >= 6
    assert stop_tok not in held.token_ids[:5]


def test_logit_bias_steers_greedy_and_out_of_range_ids_are_rejected(engine):
    plain = engine.generate(PROMPT, greedy(8))[0].token_ids
    forced = next(t for t in range(100, 200) if t not in plain)
    assert (
        engine.generate(PROMPT, greedy(8, logit_bias={forced: 100}))[0].token_ids
        == [forced] * 8
    )
    # a ban on the first choice changes it; the rest of the batch is untouched
    ban = greedy(
        8, logit_bias={str(plain[0]): -100}
    )  # OpenAI's string keys work here too
    banned, other = engine.generate([PROMPT, PROMPT], [ban, greedy(8)])
    assert banned.token_ids[0] != plain[0] and other.token_ids == plain
    vocab = engine.scheduler.vocab_size
    with pytest.raises(
        ValueError,
        match=f"logit_bias names token id {vocab}, which is outside the vocab",
    ):
        engine.generate(PROMPT, greedy(4, logit_bias={vocab: 5}))
    with pytest.raises(
        ValueError, match="logit_bias for token id 3 must be a number in"
    ):
        engine.generate(PROMPT, greedy(4, logit_bias={3: -101}))
    engine.scheduler.check_no_leaks()


def test_n_greater_than_one_shares_the_prompt(engine):
    prompt = list(range(10, 90))
    r = engine.generate(
        prompt,
        SamplingParams(temperature=1.0, n=3, seed=7, max_new_tokens=8, ignore_eos=True),
    )[0]
    assert len(r.choices) == 3
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    assert r.cached_tokens >= 76  # siblings reuse the first one's prompt KV
    g = engine.generate(
        prompt + [1],
        SamplingParams(temperature=0, n=2, max_new_tokens=8, ignore_eos=True),
    )[0]
    assert g.choices[0].token_ids == g.choices[1].token_ids
    engine.scheduler.check_no_leaks()


def test_logprobs_with_alternatives(engine):
    r = engine.generate(PROMPT, greedy(5, logprobs=3))[0]
    assert len(r.choices[0].logprobs) == 5
    for tok, lp in zip(r.token_ids, r.choices[0].logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok and lp.top[0].logprob == pytest.approx(
            lp.logprob
        )
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_stream_concatenation_equals_generate(engine):
    whole = engine.generate(PROMPT, greedy(20))[0]
    parts = list(engine.stream(PROMPT, greedy(20)))
    assert "".join(p.text_delta for p in parts) == whole.text
    assert [t for p in parts for t in p.new_token_ids] == whole.token_ids
    assert parts[-1].finished and not any(p.finished for p in parts[:-1])


def test_closing_a_stream_aborts_and_frees_kv(engine):
    it = engine.stream(PROMPT, greedy(50))
    next(it)
    next(it)
    it.close()
    assert not engine.scheduler.running
    engine.scheduler.check_no_leaks()


def test_abort_frees_kv_at_once(engine):
    (rid,) = engine.add_request(list(range(5, 105)), greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.running
    assert engine.abort(rid)
    assert not engine.scheduler.running
    engine.scheduler.check_no_leaks()
    outs = engine.step()
    assert any(o.rid == rid and o.finish_reason == "abort" for o in outs)


def test_requests_that_cannot_fit_are_rejected_clearly(llama_dir):
    small = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=64)
    with pytest.raises(ValueError, match="KV cache holds 64"):
        small.add_request(list(range(3, 80)), greedy(4))
    with pytest.raises(ValueError, match="this model accepts 512"):
        small.add_request(list(range(3, 13)), greedy(600))
    with pytest.raises(ValueError, match="empty"):
        small.add_request([], greedy(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small.add_request([5, 100000], greedy(4))
    assert small.generate([5, 6, 7], greedy(4))[0].finish_reason == "length"


def test_chat_template(engine):
    r = engine.chat([{"role": "user", "content": "hi"}], greedy(6))
    assert len(r.token_ids) == 6
    with pytest.raises(ValueError, match="non-empty"):
        engine.chat([], greedy(6))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mix", ["mixed", "prefill-first"])
def test_no_page_leaks_under_a_random_workload(llama_dir, page_size, mix):
    rng = random.Random(page_size)
    eng = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=256,
        page_size=page_size,
        chunked_prefill_size=16,
        schedule_mix=mix,
    )
    system = [rng.randrange(3, 380) for _ in range(24)]
    live: list[str] = []
    for _ in range(300):
        if rng.random() < 0.3 and len(live) < 12:
            prompt = (system if rng.random() < 0.6 else []) + [
                rng.randrange(3, 380) for _ in range(rng.randint(1, 40))
            ]
            params = SamplingParams(
                temperature=rng.choice([0.0, 1.0]),
                max_new_tokens=rng.randint(1, 30),
                ignore_eos=True,
                n=rng.choice([1, 1, 2]),
            )
            live += eng.add_request(prompt, params)
        if rng.random() < 0.05 and live:
            eng.abort(rng.choice(live))
        for out in eng.step():
            if out.finished and out.rid in live:
                live.remove(out.rid)
        eng.scheduler.check_no_leaks()
    while eng.scheduler.has_work():
        eng.step()
    eng.scheduler.check_no_leaks()
    sched = eng.scheduler
    assert (
        sched.allocator.num_free_pages + sched.cache.total_pages
        == sched.allocator.num_pages
    )
    assert sched.cache.protected_pages == 0


def test_requests_arriving_together_share_a_new_prefix(llama_dir):
    """Four prompts with one 64-token system prompt, none cached yet, submitted at once: only the
    first computes the shared prefix; the others wait one step and reuse it."""
    eng = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=2048)
    system = [(i * 13) % 370 + 5 for i in range(64)]
    prompts = [system + [100 + i, 7, 8] for i in range(4)]
    results = eng.generate(prompts, greedy(6))
    assert results[0].cached_tokens == 0
    assert all(r.cached_tokens >= 64 for r in results[1:])
    alone = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=2048, disable_radix_cache=True
    )
    assert [r.token_ids for r in results] == [
        r.token_ids for r in alone.generate(prompts, greedy(6))
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_request_computes_the_same_alone_and_in_any_batch(llama_dir, dtype):
    """Batch invariance: a request's tokens and logprobs are bit for bit what it gets alone, whatever
    shares its steps: short prompts (int8 kernel, extend kernel), long ones (dequantized matmul, SDPA),
    prompts fed in pieces by chunked prefill, and other requests' decodes, in any order. (No prefix
    cache: a prefix computed within another prompt's prefill is other arithmetic than its own.)"""
    ops = kernels.usable(torch.zeros(1))
    if ops is None or not ops.has_simd():
        pytest.skip(
            "needs the SIMD kernels (torch's own matmuls are not batch-invariant)"
        )
    eng = Engine(
        str(llama_dir),
        dtype=dtype,
        quantization="int4",
        device="cpu",
        kv_cache_tokens=8192,
        page_size=4,
        chunked_prefill_size=64,
        max_batch_tokens=160,
        disable_radix_cache=True,
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (10, 40, 100, 300)]
    params = greedy(12, logprobs=2)

    def answers(results):
        return [
            (
                r.token_ids,
                [
                    (lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                    for lp in r.choices[0].logprobs
                ],
            )
            for r in results
        ]

    alone = [answers(eng.generate([p], params))[0] for p in prompts]
    assert answers(eng.generate(prompts, params)) == alone
    order = [3, 1, 0, 2]
    assert answers(eng.generate([prompts[i] for i in order], params)) == [
        alone[i] for i in order
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_request_computes_the_same_however_its_prompt_is_chunked_or_cached(
    llama_dir, dtype
):
    """On the CPU kernels every prompt row is computed by itself (the int8 kernel, the extend kernel's
    lane-wise attention): a request's tokens and logprobs are the same bits with its prompt fed whole,
    in pieces of any size, or after a radix hit on a prefix another request computed."""
    ops = kernels.usable(torch.zeros(1))
    if ops is None or not ops.has_simd():
        pytest.skip("needs the SIMD kernels")
    rng = random.Random(6)
    prefix = [rng.randrange(3, 200) for _ in range(150)]
    prompt = prefix + [rng.randrange(3, 200) for _ in range(90)]
    other = prefix + [rng.randrange(3, 200) for _ in range(30)]
    params = greedy(12, logprobs=2)

    def answer(chunk: int, cache: bool) -> tuple:
        eng = Engine(
            str(llama_dir),
            dtype=dtype,
            quantization="int4",
            device="cpu",
            kv_cache_tokens=8192,
            page_size=4,
            chunked_prefill_size=chunk,
            disable_radix_cache=not cache,
        )
        if cache:
            eng.generate([other], greedy(1))
        (r,) = eng.generate([prompt], params)
        assert r.cached_tokens == (
            148 if cache else 0
        )  # whole pages of the shared prefix
        return r.token_ids, [
            (lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            for lp in r.choices[0].logprobs
        ]

    whole = answer(4096, cache=False)
    for chunk, cache in ((64, False), (37, False), (4096, True), (50, True)):
        assert answer(chunk, cache) == whole, (chunk, cache)


def test_prefill_progresses_beside_decodes_when_pieces_exceed_the_step_budget(
    llama_dir,
):
    """Prompt pieces are not cut to fit a step, except the step's first: with a step budget below
    --chunked-prefill-size, a new prompt is still prefilled while another request decodes; it does
    not wait for the decoding one to finish."""
    eng = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=4096,
        page_size=4,
        chunked_prefill_size=64,
        max_batch_tokens=40,
    )
    rng = random.Random(9)
    first_prompt, second_prompt = (
        [rng.randrange(3, 200) for _ in range(n)] for n in (30, 100)
    )
    (first,) = eng.add_request(first_prompt, greedy(40))
    while not eng.step():
        pass  # the first request's prefill
    (second,) = eng.add_request(second_prompt, greedy(40))
    done: dict[str, list[int]] = {first: [], second: []}
    first_len_when_second_started = None
    while eng.scheduler.has_work():
        for o in eng.step():
            done[o.rid].extend(o.new_token_ids)
        if first_len_when_second_started is None and done[second]:
            first_len_when_second_started = len(done[first])
    assert (
        first_len_when_second_started is not None and first_len_when_second_started < 39
    )
    assert [len(done[first]), len(done[second])] == [
        39,
        40,
    ]  # the first's first token came before the loop


class Shapes(StepObserver):
    """(decode rows, prefill rows) of each step."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []

    def on_scheduled(self, batch):
        if batch is not None:
            self.batches.append((batch.num_decode, len(batch.reqs) - batch.num_decode))


def test_prefill_first_runs_waiting_prompts_alone_with_the_same_outputs(llama_dir):
    """--schedule-mix prefill-first: while a prompt is being fed, steps hold its chunks alone and
    the decoding request waits; each request's tokens are those of the mixed schedule."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (20, 90)]
    outputs = {}
    for mix in ("mixed", "prefill-first"):
        eng = Engine(
            str(llama_dir),
            dtype="float32",
            kv_cache_tokens=4096,
            page_size=4,
            chunked_prefill_size=32,
            schedule_mix=mix,
        )
        shapes = Shapes()
        eng.scheduler.add_observer(shapes)
        batches = shapes.batches
        (first,) = eng.add_request(prompts[0], greedy(30))
        while not eng.step():
            pass  # the first prompt, then it decodes
        (second,) = eng.add_request(prompts[1], greedy(30))
        done: dict[str, list[int]] = {first: [], second: []}
        while eng.scheduler.has_work():
            for o in eng.step():
                done[o.rid].extend(o.new_token_ids)
        outputs[mix] = [done[first], done[second]]
        # the second prompt takes 3 chunks of 32 tokens; then both decode together
        if mix == "mixed":
            assert batches[1:4] == [(1, 1)] * 3
        else:
            assert batches[1:4] == [(0, 1)] * 3
        assert batches[4] == (2, 0)
        eng.scheduler.check_no_leaks()
    assert outputs["mixed"] == outputs["prefill-first"]
