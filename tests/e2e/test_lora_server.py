"""LoRA adapters through `strata serve`: picked per request by model name, listed in /v1/models,
loaded and unloaded at run time; answers equal PEFT's greedy tokens; bad input is 4xx."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer, tiny_model_dir
from lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.e2e

PROMPT = [5, 17, 33, 91, 120, 7, 64, 200, 13]


@pytest.fixture(scope="module")
def adapters():
    root = Path(tempfile.mkdtemp(prefix="strata-lora-"))
    try:
        yield {
            name: make_adapter(tiny_model_dir(), root, name, seed)
            for seed, name in enumerate(["attn", "mlp"])
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(adapters):
    with LiveServer(
        "--lora-modules", f"attn={adapters['attn']}", "--max-loras", "2"
    ) as srv:
        yield srv


def completion_ids(srv: LiveServer, model: str) -> list[int]:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body["choices"][0]["logprobs"]["tokens"]


def tokens_text(srv: LiveServer, ids: list[int]) -> list[str]:
    from strata.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    return [tok.decode([i]) for i in ids]


def test_adapters_answer_as_peft_and_are_listed(server, adapters):
    base_name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="-").models.list()
    cards = {m.id: m for m in models.data}
    assert set(cards) == {base_name, "attn"}
    assert cards["attn"].model_extra["parent"] == base_name
    want = {
        "attn": peft_greedy(tiny_model_dir(), adapters["attn"], [PROMPT], 8)[0],
        None: peft_greedy(tiny_model_dir(), None, [PROMPT], 8)[0],
    }
    assert want["attn"] != want[None]
    assert completion_ids(server, "attn") == tokens_text(server, want["attn"])
    assert completion_ids(server, base_name) == tokens_text(server, want[None])


def test_adapters_load_and_unload_at_run_time(server, adapters):
    http = httpx.Client(base_url=server.url, timeout=60)
    r = http.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])},
    )
    assert r.status_code == 200, r.text
    assert sorted(r.json()["adapters"]) == ["attn", "mlp"]
    want = peft_greedy(tiny_model_dir(), adapters["mlp"], [PROMPT], 8)[0]
    assert completion_ids(server, "mlp") == tokens_text(server, want)
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": "mlp",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        },
    )
    assert chat.status_code == 200 and '"model":"mlp"' in chat.text
    again = http.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])},
    )
    assert again.status_code == 409 and "registered already" in again.text
    assert (
        http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code
        == 200
    )
    gone = http.post(
        "/v1/completions", json={"model": "mlp", "prompt": "hi", "max_tokens": 2}
    )
    assert gone.status_code == 404 and "mlp" in gone.json()["error"]["message"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 404
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert "mlp" not in ids


def test_bad_adapter_requests_are_4xx(server, adapters, tmp_path):
    http = httpx.Client(base_url=server.url, timeout=60)
    base_name = http.get("/v1/models").json()["data"][0]["id"]
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "adapter_config.json"),
        (
            {"lora_name": base_name, "lora_path": str(adapters["mlp"])},
            400,
            "base model",
        ),
        ({"lora_name": "", "lora_path": "x"}, 400, "empty"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": 3, "lora_path": "x"}, 400, "lora_name"),
    ]
    for body, status, words in cases:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status, (body, r.text)
        assert words in r.text, (words, r.text)
    r = http.post("/v1/embeddings", json={"model": "attn", "input": "hi"})
    assert r.status_code == 400 and "LoRA adapter" in r.text
    r = http.post(
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 404 and "attn" in r.json()["error"]["message"]


def test_a_server_without_lora_says_how_to_enable_it():
    with LiveServer() as srv:
        r = httpx.post(
            srv.url + "/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": "/nonexistent"},
            timeout=30,
        )
        assert r.status_code == 400 and "--enable-lora" in r.text
