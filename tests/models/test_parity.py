"""Exactness against transformers (the oracle): logits and greedy tokens, fp32, every family."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES
from transformers import AutoModelForCausalLM, GenerationConfig

from strata import Engine, SamplingParams
from strata.engine.batch import ScheduleBatch
from strata.engine.request import Req

PROMPTS = [
    [5, 17, 33, 91, 120, 7, 64, 200, 13],
    [44, 2 + 1, 250],
    list(range(30, 30 + 41)),
    [300, 301, 302, 303, 304, 305, 306, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89],
]


def hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = (
        None  # compare with ignore_eos: generate every token
    )
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), generation_config=cfg
    )
    return out[0, len(prompt) :].tolist()


def forward_logits(
    engine: Engine, reqs: list[Req], extend_lens: list[int], num_decode: int
) -> torch.Tensor:
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
    return logits.cpu()  # the oracle runs on the CPU


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_and_decode_logits_match(tiny_models, family, page_size):
    model_dir = tiny_models[family]
    engine = Engine(
        str(model_dir), dtype="float32", kv_cache_tokens=1024, page_size=page_size
    )
    ref = hf_model(model_dir)
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    logits = forward_logits(engine, reqs, [len(p) for p in PROMPTS], num_decode=0)
    start = 0
    for p in PROMPTS:
        with torch.no_grad():
            expected = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(
            logits[start : start + len(p)], expected, atol=1e-4, rtol=0
        )
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


def prefill_then_decode_logits(engine: Engine, steps: int = 3) -> torch.Tensor:
    """Logits of a batched prefill of PROMPTS, then `steps` batched decode steps feeding fixed tokens."""
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    out = [forward_logits(engine, reqs, [len(p) for p in PROMPTS], num_decode=0)]
    for step in range(steps):
        for i, req in enumerate(reqs):
            req.output_ids.append(11 + 7 * i + step)
        out.append(forward_logits(engine, reqs, [1] * len(reqs), num_decode=len(reqs)))
    return torch.cat(out).float()


@pytest.mark.parametrize("page_size", [1, 16])
def test_pytorch_path_matches_too(tiny_models, page_size):
    """The fallback used without the native kernels (no compiler, STRATA_CPU_KERNELS=0, GPUs)."""
    from strata import kernels

    with kernels.disabled():
        engine = Engine(
            str(tiny_models["qwen3"]),
            dtype="float32",
            kv_cache_tokens=1024,
            page_size=page_size,
        )
        got = prefill_then_decode_logits(engine)
    with_kernels = Engine(
        str(tiny_models["qwen3"]),
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=page_size,
    )
    torch.testing.assert_close(
        got, prefill_then_decode_logits(with_kernels), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_fast_paths_are_as_close_to_the_oracle_as_pytorch_bf16(
    tiny_models, family
):
    """bf16 with the native kernels and packed linears vs bf16 through plain PyTorch ops: both are
    compared with the float32 engine (itself exact against transformers, above), and the fast path
    must not add error: within 1.5x the PyTorch path's worst logit error plus 0.02, 1.2x its mean."""
    from strata import kernels

    model_dir = str(tiny_models[family])
    exact = prefill_then_decode_logits(
        Engine(model_dir, dtype="float32", kv_cache_tokens=1024)
    )
    fast = prefill_then_decode_logits(
        Engine(model_dir, dtype="bfloat16", kv_cache_tokens=1024)
    )
    with kernels.disabled():
        plain = prefill_then_decode_logits(
            Engine(model_dir, dtype="bfloat16", kv_cache_tokens=1024)
        )
    fast_err = (fast - exact).abs().max().item()
    plain_err = (plain - exact).abs().max().item()
    assert fast_err <= 1.5 * plain_err + 0.02, (fast_err, plain_err)
    fast_mean, plain_mean = (
        (fast - exact).abs().mean().item(),
        (plain - exact).abs().mean().item(),
    )
    assert fast_mean <= 1.2 * plain_mean + 1e-3, (fast_mean, plain_mean)
    # and the greedy choice agrees with the exact model about as often as plain bf16 does
    fast_agree = (fast.argmax(-1) == exact.argmax(-1)).float().mean().item()
    plain_agree = (plain.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert fast_agree >= plain_agree - 0.05, (fast_agree, plain_agree)


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
def test_radix_hit_is_identical_and_reports_cached_tokens(
    llama_dir, llama_expected, page_size
):
    engine = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=2048, page_size=page_size
    )
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
    assert third.token_ids == hf_greedy(
        hf_model(llama_dir), shared, GREEDY.max_new_tokens
    )
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

    model_dir = make_model(
        tmp_path / "biased",
        "llama",
        attention_bias=True,
        mlp_bias=True,
        tokenizer=False,
    )
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
    with pytest.raises(
        ValueError, match=r"not supported; supported: .*LlamaForCausalLM"
    ):
        Engine(str(model_dir), dtype="float32", kv_cache_tokens=64)
