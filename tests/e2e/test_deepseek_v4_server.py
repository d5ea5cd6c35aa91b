"""`strata serve` with a tiny DeepSeek-V4 (sliding, CSA, HCA layers; mHC; hash-routed experts): a
batch through /generate answers transformers' greedy tokens, a second request sharing a long prefix
hits the radix cache and still answers them, and the chat endpoint works with the model's template."""

from __future__ import annotations

import pytest
import torch
from live_server import LiveServer
from tiny_dsv4 import make_dsv4, prompt
from tiny_models import build_tokenizer

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(150, 1), prompt(61, 2)]
SHARED = PROMPTS[0][:130] + prompt(
    9, 5
)  # 130 tokens in common: a hit at 128 (page size 16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = make_dsv4(tmp_path_factory.mktemp("dsv4-serve"))
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(
        "--page-size", "16", "--kv-cache-tokens", "4096", model_dir=model_dir
    ) as srv:
        yield srv


def generate(
    server: LiveServer, prompts: list[list[int]], max_new_tokens: int = 10
) -> list[dict]:
    body = {
        "input_ids": prompts,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    with server.client() as c:
        return c.post("/generate", json=body).raise_for_status().json()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def test_batch_and_prefix_hit_answer_as_transformers(server, model_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got = generate(server, PROMPTS)
    assert [r["output_ids"] for r in got] == [hf_greedy(ref, p, 10) for p in PROMPTS]
    (hit,) = generate(server, [SHARED])
    assert hit["meta_info"]["cached_tokens"] == 128
    assert hit["output_ids"] == hf_greedy(ref, SHARED, 10)


def test_chat_completion(server):
    body = {
        "messages": [{"role": "user", "content": "Paged attention keeps the KV cache"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    with server.client() as c:
        answer = c.post("/v1/chat/completions", json=body).raise_for_status().json()
    assert answer["usage"]["completion_tokens"] == 6
    assert answer["choices"][0]["finish_reason"] == "length"
