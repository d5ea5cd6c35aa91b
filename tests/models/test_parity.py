"""Exactness against transformers (the oracle): logits and greedy tokens, fp32, every family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from strata import Engine, SamplingParams
from strata.engine.batch import ScheduleBatch
from strata.engine.request import Req

from tiny_models import FAMILIES

PROMPTS = [
    [5, 17, 33, 91, 120, 7, 64, 200, 13],
    [44, 2 + 1, 250],
    list(range(30, 30 + 41)),
    [300, 301, 302, 303, 304, 305, 306, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89],
]


def hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare with ignore_eos: generate every token
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt) :].tolist()


def forward_logits(engine: Engine, reqs: list[Req], extend_lens: list[int], num_decode: int) -> torch.Tensor:
    """One raw forward through the engine's model; logits for every fed token: [T, vocab]."""
    runner = engine.scheduler.runner
    for req, n in zip(reqs, extend_lens):
        assert engine.scheduler._alloc_for(req, req.kv_len + n)
    fb = runner.prepare(ScheduleBatch(reqs, extend_lens, num_decode))
    with torch.inference_mode():
        hidden = engine.model(fb.input_ids, fb.positions, fb.attn, runner.kv)
        logits = engine.model.compute_logits(hidden)
    for req, n in zip(reqs, extend_lens):
        req.kv_len += n
    return logits


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_and_decode_logits_match(tiny_models, family, page_size):
    model_dir = tiny_models[family]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024, page_size=page_size)
    ref = hf_model(model_dir)
    reqs = [Req(rid=str(i), prompt_ids=list(p), params=SamplingParams()) for i, p in enumerate(PROMPTS)]
    logits = forward_logits(engine, reqs, [len(p) for p in PROMPTS], num_decode=0)
    start = 0
    for p in PROMPTS:
        with torch.no_grad():
            expected = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start : start + len(p)], expected, atol=1e-4, rtol=0)
        start += len(p)
    # decode steps: feed the reference's greedy token to every request at once
    seqs = [list(p) for p in PROMPTS]
    for _ in range(4):
        with torch.no_grad():
            expected = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])
        nxt = expected.argmax(-1).tolist()
        for req, s, t in zip(reqs, seqs, nxt):
            req.output_ids.append(t)
            s.append(t)
        with torch.no_grad():
            expected = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])
        got = forward_logits(engine, reqs, [1] * len(reqs), num_decode=len(reqs))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_generate(tiny_models, family):
    model_dir = tiny_models[family]
    ref = hf_model(model_dir)
    expected = [hf_greedy(ref, p, GREEDY.max_new_tokens) for p in PROMPTS]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024)
    got = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert got == expected


@pytest.fixture(scope="module")
def llama_expected(llama_dir):
    ref = hf_model(llama_dir)
    return [hf_greedy(ref, p, GREEDY.max_new_tokens) for p in PROMPTS]


@pytest.mark.parametrize(
    "options",
    [
        {"chunked_prefill_size": 4},
        {"chunked_prefill_size": 0},
        {"page_size": 16},
        {"page_size": 16, "chunked_prefill_size": 5},
        {"disable_radix_cache": True},
        {"max_running_requests": 1},
        {"max_batch_tokens": 7, "chunked_prefill_size": 3},
    ],
    ids=str,
)
def test_greedy_under_scheduler_options(llama_dir, llama_expected, options):
    engine = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=1024, **options)
    got = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert got == llama_expected
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_hit_is_identical_and_reports_cached_tokens(llama_dir, llama_expected, page_size):
    engine = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=2048, page_size=page_size)
    first = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in first] == llama_expected
    second = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in second] == llama_expected
    long_prompt = PROMPTS[2]
    assert second[2].cached_tokens == ((len(long_prompt) - 1) // page_size) * page_size
    # a new prompt sharing only a prefix (a "system prompt") reuses that prefix
    shared = long_prompt[:32] + [7, 8, 9]
    third = engine.generate([shared], GREEDY)[0]
    assert third.cached_tokens == (32 // page_size) * page_size
    assert third.token_ids == hf_greedy(hf_model(llama_dir), shared, GREEDY.max_new_tokens)
    engine.scheduler.check_no_leaks()


def test_retraction_keeps_outputs_exact(llama_dir):
    """A pool too small for all requests at once: decode retracts some, and they still finish exactly."""
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [p + [11, 12] for p in PROMPTS] * 2
    ref = hf_model(llama_dir)
    expected = [hf_greedy(ref, p, params.max_new_tokens) for p in prompts[:4]] * 2
    engine = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=128, page_size=4)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert engine.scheduler.num_retractions > 0
    assert got == expected
    engine.scheduler.check_no_leaks()


def test_llama_with_attention_and_mlp_bias(tmp_path):
    from tiny_models import make_model

    model_dir = make_model(tmp_path / "biased", "llama", attention_bias=True, mlp_bias=True, tokenizer=False)
    ref = hf_model(model_dir)
    expected = [hf_greedy(ref, p, GREEDY.max_new_tokens) for p in PROMPTS]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import json

    from tiny_models import make_model

    model_dir = make_model(tmp_path / "m", "llama", tokenizer=False)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: LlamaForCausalLM"):
        Engine(str(model_dir), dtype="float32", kv_cache_tokens=64)
