"""`strata plan calibrate --base-url`: fit a CostModel from a running server's (or router's) timings.

    server   TTFT of prompts sent one at a time as token ids (prefill, plus the per-request
             overhead, fitted as its own coefficient) and the median ITL of B concurrent streams
             (a decode step of batch B). Against a router the KV size comes from its first worker.
    pd       (`--pd-transfer`, with a base calibration of one worker) isolated requests through a
             PD router: what their TTFT exceeds the worker's own overhead + prefill + first decode
             step by is the prefill -> decode handoff, fitted as pd_latency_s + bytes / pd_bytes_per_s
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.plan.calibrate import measure_rates
from strata.plan.cost_model import CostModel, Sample, Segment, chunked_prefill_steps, fit


@dataclass(frozen=True)
class ServerPlan:
    prefill_lens: tuple[int, ...] = (32, 128, 512, 1024)
    cached_prefills: tuple[tuple[int, int], ...] = ((1024, 128),)
    decode_batches: tuple[int, ...] = (1, 4, 16, 48)
    decode_context: int = 128
    decode_tokens: int = 24
    repeats: int = 2
    chunked_prefill_size: int = 2048
    max_batch_tokens: int = 8192
    row_threshold: int | None = 32
    seed: int = 0


def calibrate_server(base_url: str, plan: ServerPlan = ServerPlan(), api_key: str | None = None,
                     tokenizer=None, progress=None) -> tuple[CostModel, list[Sample]]:  # fmt: skip
    """Fit from a running server's TTFTs and ITLs (prompts sent as token ids: exact lengths)."""
    from strata.bench import server_info
    from strata.bench.datasets import vocab_pool

    base = base_url.rstrip("/")
    model = server_info.first_model(base, api_key)
    if model is None:
        raise ValueError(f"{base}/v1/models lists no model; is a server running there?")
    if tokenizer is None:
        from strata.bench.cli import load_bench_tokenizer

        _, tokenizer = load_bench_tokenizer(None)
    pool = vocab_pool(tokenizer)
    samples = asyncio.run(_server_samples(base, model, api_key, pool, plan, progress or (lambda s: None)))
    info = server_info.server_info(base, api_key) or {}
    if _find(info, "num_kv_tokens") is None:  # a router: ask its first worker
        info = _first_worker_info(base, api_key) or info
    kv_tokens, kv_bytes = _find(info, "num_kv_tokens"), _find(info, "kv_bytes")
    bytes_per_token = int(kv_bytes // kv_tokens) if kv_tokens and kv_bytes else 0
    cm = fit(samples, plan.row_threshold, kv_bytes_per_token=bytes_per_token, source=f"server {base} ({model})",
             **measure_rates())  # fmt: skip
    return cm, samples


def _first_worker_info(base: str, api_key: str | None) -> dict | None:
    import httpx

    from strata.bench import server_info

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        workers = httpx.get(f"{base}/workers", headers=headers, timeout=10).json().get("workers") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return server_info.server_info(workers[0]["url"], api_key) if workers else None


def _find(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        if key in obj and isinstance(obj[key], (int, float)):
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


async def _server_samples(base, model, api_key, pool, plan: ServerPlan, say) -> list[Sample]:
    from strata.bench.http_client import OpenAIClient

    rng = random.Random(plan.seed)
    fresh = lambda n: [rng.choice(pool) for _ in range(n)]  # noqa: E731
    client = OpenAIClient(base, api_key=api_key)
    thr, chunk, mbt = plan.row_threshold, plan.chunked_prefill_size, plan.max_batch_tokens

    def body(ids: list[int], max_tokens: int) -> dict:
        return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip

    def prefill_sample(rec, new: int, cached: int) -> Sample | None:
        if not rec.ok or rec.ttft is None:
            return None
        s = Sample.of_steps(chunked_prefill_steps(1, new, cached, chunk, mbt), rec.ttft, thr, f"TTFT {new} on {cached}")
        return Sample(s.features, s.seconds, s.what, s.num_steps, requests=1.0)

    samples: list[Sample] = []
    try:
        await client.send("completions", body(fresh(16), 4), 16)  # warm-up
        for _ in range(plan.repeats):
            for n in plan.prefill_lens:
                say(f"calibrate: TTFT of a {n}-token prompt")
                s = prefill_sample(await client.send("completions", body(fresh(n), 1), n), n, 0)
                samples += [s] if s else []
            for cached, n in plan.cached_prefills:
                prefix = fresh(cached)
                await client.send("completions", body(prefix, 1), cached)
                say(f"calibrate: TTFT of {n} tokens after {cached} cached")
                s = prefill_sample(await client.send("completions", body(prefix + fresh(n), 1), cached + n), n, cached)
                samples += [s] if s else []
        for b in plan.decode_batches:
            say(f"calibrate: ITL of {b} concurrent streams")
            prefix = fresh(plan.decode_context - 8)
            await client.send("completions", body(prefix, 1), len(prefix))
            recs = await asyncio.gather(
                *(client.send("completions", body(prefix + fresh(8), plan.decode_tokens), plan.decode_context) for _ in range(b))
            )
            # the middle of the streams: every request decodes, no prefill runs
            gaps = [g for r in recs if r.ok for g in r.itls[len(r.itls) // 4 : -max(1, len(r.itls) // 4)]]
            if gaps:
                ctx = plan.decode_context + plan.decode_tokens // 2
                samples.append(Sample.of_steps([[Segment(1, ctx, True)] * b], statistics.median(gaps), thr, f"ITL batch {b}"))
    finally:
        await client.close()
    return samples


def calibrate_pd(base_url: str, base: CostModel, lens: Sequence[int] = (128, 512, 1024), repeats: int = 3,
                 api_key: str | None = None, tokenizer=None, progress=None) -> tuple[CostModel, list[dict]]:  # fmt: skip
    """Measure the PD handoff through a PD router on top of `base` (one worker's calibration)."""
    from strata.bench import server_info
    from strata.bench.datasets import vocab_pool
    from strata.bench.http_client import OpenAIClient

    if not base.kv_bytes_per_token:
        raise ValueError("the base calibration has no kv_bytes_per_token; calibrate one worker first")
    base_url = base_url.rstrip("/")
    model = server_info.first_model(base_url, api_key)
    if model is None:
        raise ValueError(f"{base_url}/v1/models lists no model; is the PD router running there?")
    if tokenizer is None:
        from strata.bench.cli import load_bench_tokenizer

        _, tokenizer = load_bench_tokenizer(None)
    pool, rng, say = vocab_pool(tokenizer), random.Random(1), progress or (lambda s: None)

    async def measure() -> list[tuple[int, float]]:
        client = OpenAIClient(base_url, api_key=api_key)
        out = []
        try:
            for _ in range(repeats):
                for n in lens:
                    say(f"calibrate: PD TTFT of a {n}-token prompt")
                    body = {"model": model, "prompt": [rng.choice(pool) for _ in range(n)], "max_tokens": 2,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
                    rec = await client.send("completions", body, n)
                    if rec.ok and rec.ttft is not None:
                        out.append((n, rec.ttft))
        finally:
            await client.close()
        return out

    return fit_handoff(base, asyncio.run(measure()), source=f"; PD handoff from {base_url}")


def fit_handoff(base: CostModel, measured: Sequence[tuple[int, float]], source: str = "") -> tuple[CostModel, list[dict]]:
    """(prompt tokens, TTFT through PD) pairs -> `base` with pd_latency_s / pd_bytes_per_s fitted to
    what the TTFTs exceed one worker's request overhead + prefill + first decode step by."""
    rows = []
    for n, ttft in measured:
        local = base.request_overhead_s + base.prefill_s(n) + base.decode_step_s(1, n)
        rows.append({"new_tokens": n, "ttft_s": ttft, "without_handoff_s": local, "kv_bytes": base.kv_bytes(n)})
    if len(rows) < 2:
        raise ValueError("too few PD requests succeeded to fit the handoff")
    x = np.array([r["kv_bytes"] for r in rows])
    y = np.array([r["ttft_s"] - r["without_handoff_s"] for r in rows])
    slope, intercept = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, float(np.median(y)))
    changes = {"pd_latency_s": max(float(intercept), 0.0)}
    if slope > 0:
        changes["pd_bytes_per_s"] = float(1.0 / slope)
    else:  # no size dependence measurable: the median residual is the handoff, at any size
        changes["pd_latency_s"] = max(float(np.median(y)), 0.0)
    return base.with_(**changes, source=base.source + source), rows
