"""`strata serve` with a tiny mixture-of-experts model (Qwen2-MoE: experts in layers 0 and 2, 8 of
them, top-2): /metrics counts every token each expert got, /get_server_info summarises the imbalance."""

from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_model

pytestmark = pytest.mark.e2e

MOE_LAYERS, NUM_EXPERTS, TOP_K = (0, 2), 8, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_model(
        tmp_path_factory.mktemp("moe") / "tiny-qwen2-moe", "qwen2_moe"
    )
    with LiveServer(model_dir=model_dir) as srv:
        yield srv


def expert_tokens(server: LiveServer) -> dict[tuple[int, int], float]:
    """{(layer, expert): tokens routed since start} from one scrape of /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).raise_for_status().text
    family = next(
        f
        for f in text_string_to_metric_families(text)
        if f.name == "strata:moe_expert_tokens"
    )
    return {
        (int(s.labels["layer"]), int(s.labels["expert"])): s.value
        for s in family.samples
    }


def test_metrics_count_every_routed_token_and_server_info_summarises_them(server):
    before = expert_tokens(server)
    assert set(before) == {
        (layer, e) for layer in MOE_LAYERS for e in range(NUM_EXPERTS)
    }
    body = {
        "prompt": "Hello world! This is",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.client() as c:
        usage = c.post("/v1/completions", json=body).raise_for_status().json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # tokens through the model: the uncached prompt, then every output token but the last
    forwarded = usage["prompt_tokens"] - cached + usage["completion_tokens"] - 1
    after = expert_tokens(
        server
    )  # fresh from the engine, not as of the last batch of outputs
    for layer in MOE_LAYERS:
        routed = sum(after[layer, e] - before[layer, e] for e in range(NUM_EXPERTS))
        assert routed == TOP_K * forwarded, layer

    info = server.info()
    assert info["engine"]["num_experts"] == NUM_EXPERTS
    summary = info["expert_load"]
    assert set(summary) == {str(layer) for layer in MOE_LAYERS}
    for layer in MOE_LAYERS:
        counts = [after[layer, e] for e in range(NUM_EXPERTS)]
        s = summary[str(layer)]
        assert (s["tokens"], s["max_tokens"]) == (sum(counts), max(counts))
        assert counts[s["busiest_expert"]] == max(counts)
        assert s["max_over_mean"] == pytest.approx(
            max(counts) / (sum(counts) / NUM_EXPERTS)
        )
