"""Several API keys on one server (--api-key-file): each is let in, and /metrics counts each key's
requests and tokens under its name, never the key itself."""

from __future__ import annotations

import re

import httpx
from live_server import LiveServer

KEYS = {"alice": "key-of-alice-0123", "bob": "key-of-bob-4567"}


def usage(metrics: str, name: str, key: str) -> float:
    found = re.search(
        rf'^strata:api_key_{name}_total{{key="{key}"}} (\S+)$', metrics, re.M
    )
    return float(found.group(1)) if found else 0.0


def test_each_key_is_counted_under_its_name(tmp_path):
    path = tmp_path / "keys"
    path.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    with LiveServer("--api-key-file", str(path), "--served-model-name", "tiny") as srv:

        def post(key: str | None, max_tokens: int) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"model": "tiny", "prompt": "Hello there", "max_tokens": max_tokens}
            body["ignore_eos"] = True
            return httpx.post(
                srv.url + "/v1/completions", json=body, headers=headers, timeout=60
            )

        for _ in range(2):
            assert post(KEYS["alice"], 3).status_code == 200
        done = post(KEYS["bob"], 5)
        assert done.status_code == 200
        assert post("key-of-nobody-89", 3).status_code == 401
        assert post(None, 3).status_code == 401
        metrics = httpx.get(
            srv.url + "/metrics",
            headers={"Authorization": f"Bearer {KEYS['bob']}"},
            timeout=30,
        ).text
        assert usage(metrics, "requests", "alice") == 2
        assert usage(metrics, "requests", "bob") == 2  # its completion and this scrape
        assert usage(metrics, "generation_tokens", "alice") == 6
        assert usage(metrics, "generation_tokens", "bob") == 5
        prompt = done.json()["usage"]["prompt_tokens"]
        assert usage(metrics, "prompt_tokens", "alice") == 2 * prompt
        assert usage(metrics, "prompt_tokens", "bob") == prompt
        assert not any(key in metrics for key in KEYS.values())
