"""`strata plan calibrate --base-url`: fit a CostModel from a running server's (or router's) timings.

server   TTFT of prompts sent one at a time as token ids (prefill, plus the per-request
         overhead, fitted as its own coefficient) and the median ITL of B concurrent streams
         (a decode step of batch B). Against a router the KV size comes from its first worker.
colocated  (a router with two or more workers on one host) the same decode batch and the same
         prompt on the first worker alone, then on the first two at once: how much a second
         busy replica slows a step (`contention`, what the simulator's processor sharing uses)
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
from strata.plan.cost_model import (
    CostModel,
    Sample,
    Segment,
    chunked_prefill_steps,
    fit,
)


@dataclass(frozen=True)
class ServerPlan:
    prefill_lens: tuple[int, ...] = (32, 128, 512, 1024)
    cached_prefills: tuple[tuple[int, int], ...] = (
        (1024, 128),
        (256, 32),
    )  # (cached, new)
    decode_batches: tuple[int, ...] = (1, 4, 16, 48)
    decode_context: int = 128
    long_decodes: tuple[tuple[int, int], ...] = (
        (1, 1024),
        (4, 1024),
    )  # (batch, context): what context costs
    decode_tokens: int = 24
    repeats: int = 3
    chunked_prefill_size: int = 2048
    max_batch_tokens: int = 8192
    row_threshold: int | None = (
        None  # rows from which the server changes kernels (None: one regime)
    )
    seed: int = 0


def calibrate_server(
    base_url: str,
    plan: ServerPlan = ServerPlan(),
    api_key: str | None = None,
    tokenizer=None,
    progress=None,
) -> tuple[CostModel, list[Sample]]:
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
    samples = asyncio.run(
        _server_samples(base, model, api_key, pool, plan, progress or (lambda s: None))
    )
    info = server_info.server_info(base, api_key) or {}
    if _find(info, "num_kv_tokens") is None:  # a router: ask its first worker
        info = _first_worker_info(base, api_key) or info
    kv_tokens, kv_bytes = _find(info, "num_kv_tokens"), _find(info, "kv_bytes")
    bytes_per_token = int(kv_bytes // kv_tokens) if kv_tokens and kv_bytes else 0
    colocated = _colocated_workers(_workers(base, api_key))
    contention: tuple[float | None, float | None] = (None, None)
    if len(colocated) >= 2:
        contention = asyncio.run(
            _contention(
                colocated[:2], model, api_key, pool, plan, progress or (lambda s: None)
            )
        )
    cm = fit(
        samples,
        plan.row_threshold,
        kv_bytes_per_token=bytes_per_token,
        source=f"server {base} ({model})",
        contention=contention[0],
        contention_prefill=contention[1],
        **measure_rates(),
    )
    return cm, samples


def _workers(base: str, api_key: str | None) -> list[str]:
    """The worker URLs a router lists at /workers ([] for a plain server)."""
    import httpx

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        workers = (
            httpx.get(f"{base}/workers", headers=headers, timeout=10)
            .json()
            .get("workers")
            or []
        )
        return [
            w["url"]
            for w in workers
            if isinstance(w, dict) and isinstance(w.get("url"), str)
        ]
    except (httpx.HTTPError, ValueError, AttributeError, TypeError):
        return []


def _colocated_workers(urls: list[str]) -> list[str]:
    """The workers on the host of the first one (a router's --launch N, or several servers on one host)."""
    from urllib.parse import urlsplit

    hosts = [urlsplit(u).hostname for u in urls]
    return [u for u, h in zip(urls, hosts) if h == hosts[0]] if urls else []


def _first_worker_info(base: str, api_key: str | None) -> dict | None:
    from strata.bench import server_info

    workers = _workers(base, api_key)
    return server_info.server_info(workers[0], api_key) if workers else None


async def _contention(
    urls: list[str],
    model: str,
    api_key: str | None,
    pool,
    plan: ServerPlan,
    say,
    batch: int = 8,
    prompt_len: int = 512,
) -> tuple[float | None, float | None]:
    """How much a second busy co-located worker slows a step: a decode batch's median ITL and a
    prompt's TTFT on urls[0] alone, then on both at once (the same load on each), repeated. Returns
    each slowdown less 1, (decode, prefill) (1: the machine is split evenly; 0: no interference)."""
    from strata.bench.http_client import OpenAIClient

    rng = random.Random(plan.seed + 1)
    fresh = lambda n: [rng.choice(pool) for _ in range(n)]  # noqa: E731
    clients = [OpenAIClient(u, api_key=api_key) for u in urls]

    def body(ids: list[int], max_tokens: int) -> dict:
        return {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }

    async def decode_itl(client) -> list[float]:
        recs = await asyncio.gather(
            *(client.send("completions", body(fresh(16), 32), 16) for _ in range(batch))
        )
        return _middle_gaps(recs)

    async def ttft(client) -> list[float]:
        rec = await client.send("completions", body(fresh(prompt_len), 1), prompt_len)
        return [rec.ttft] if rec.ok and rec.ttft is not None else []

    ratios = []
    try:
        for c in clients:
            await c.send("completions", body(fresh(16), 4), 16)  # warm-up
        for what, measure in (
            ("ITL of a decode batch", decode_itl),
            ("TTFT of a prompt", ttft),
        ):
            alone, both = [], []
            for _ in range(plan.repeats + 1):
                say(f"calibrate: {what} on one co-located worker, then on two at once")
                alone += await measure(clients[0])
                for got in await asyncio.gather(*(measure(c) for c in clients)):
                    both += got
            ratios.append(
                max(0.0, statistics.median(both) / statistics.median(alone) - 1)
                if alone and both
                else None
            )
    finally:
        for c in clients:
            await c.close()
    return ratios[0], ratios[1]


def _middle_gaps(recs) -> list[float]:
    """Inter-token gaps of the middle half of each successful stream: there every request of the
    batch decodes and no prefill runs."""
    return [
        g
        for r in recs
        if r.ok
        for g in r.itls[len(r.itls) // 4 : -max(1, len(r.itls) // 4)]
    ]


def _find(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        if key in obj and isinstance(obj[key], (int, float)):
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


async def _server_samples(
    base, model, api_key, pool, plan: ServerPlan, say
) -> list[Sample]:
    from strata.bench.http_client import OpenAIClient

    rng = random.Random(plan.seed)
    fresh = lambda n: [rng.choice(pool) for _ in range(n)]  # noqa: E731
    client = OpenAIClient(base, api_key=api_key)
    thr, chunk, mbt = (
        plan.row_threshold,
        plan.chunked_prefill_size,
        plan.max_batch_tokens,
    )

    def body(ids: list[int], max_tokens: int) -> dict:
        return {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def prefill_sample(rec, new: int, cached: int) -> Sample | None:
        if not rec.ok or rec.ttft is None:
            return None
        s = Sample.of_steps(
            chunked_prefill_steps(1, new, cached, chunk, mbt),
            rec.ttft,
            thr,
            f"TTFT {new} on {cached}",
        )
        return Sample(s.features, s.seconds, s.what, s.num_steps, requests=1.0)

    samples: list[Sample] = []
    try:
        await client.send("completions", body(fresh(16), 4), 16)  # warm-up
        for _ in range(plan.repeats):
            for n in plan.prefill_lens:
                say(f"calibrate: TTFT of a {n}-token prompt")
                s = prefill_sample(
                    await client.send("completions", body(fresh(n), 1), n), n, 0
                )
                samples += [s] if s else []
            for cached, n in plan.cached_prefills:
                prefix = fresh(cached)
                await client.send("completions", body(prefix, 1), cached)
                say(f"calibrate: TTFT of {n} tokens after {cached} cached")
                s = prefill_sample(
                    await client.send(
                        "completions", body(prefix + fresh(n), 1), cached + n
                    ),
                    n,
                    cached,
                )
                samples += [s] if s else []
        decodes = [(b, plan.decode_context) for b in plan.decode_batches] + list(
            plan.long_decodes
        )
        for b, context in decodes:
            say(
                f"calibrate: ITL of {b} concurrent streams at {context} tokens of context"
            )
            prefix = fresh(
                context - 8
            )  # cached first, so the streams' prefills stay short
            await client.send("completions", body(prefix, 1), len(prefix))
            recs = await asyncio.gather(
                *(
                    client.send(
                        "completions",
                        body(prefix + fresh(8), plan.decode_tokens),
                        context,
                    )
                    for _ in range(b)
                )
            )
            # the middle of the streams: every request decodes, no prefill runs
            gaps = _middle_gaps(recs)
            if gaps:
                ctx = context + plan.decode_tokens // 2
                what = f"ITL batch {b} at {context}"
                samples.append(
                    Sample.of_steps(
                        [[Segment(1, ctx, True)] * b],
                        statistics.median(gaps),
                        thr,
                        what,
                    )
                )
    finally:
        await client.close()
    return samples


def calibrate_pd(
    base_url: str,
    base: CostModel,
    lens: Sequence[int] = (128, 512, 1024),
    repeats: int = 3,
    api_key: str | None = None,
    tokenizer=None,
    progress=None,
) -> tuple[CostModel, list[dict]]:
    """Measure the PD handoff through a PD router on top of `base` (one worker's calibration)."""
    from strata.bench import server_info
    from strata.bench.datasets import vocab_pool
    from strata.bench.http_client import OpenAIClient

    if not base.kv_bytes_per_token:
        raise ValueError(
            "the base calibration has no kv_bytes_per_token; calibrate one worker first"
        )
    base_url = base_url.rstrip("/")
    model = server_info.first_model(base_url, api_key)
    if model is None:
        raise ValueError(
            f"{base_url}/v1/models lists no model; is the PD router running there?"
        )
    if tokenizer is None:
        from strata.bench.cli import load_bench_tokenizer

        _, tokenizer = load_bench_tokenizer(None)
    pool, rng, say = (
        vocab_pool(tokenizer),
        random.Random(1),
        progress or (lambda s: None),
    )

    async def measure() -> list[tuple[int, float]]:
        client = OpenAIClient(base_url, api_key=api_key)
        out = []
        try:
            for _ in range(repeats):
                for n in lens:
                    say(f"calibrate: PD TTFT of a {n}-token prompt")
                    body = {
                        "model": model,
                        "prompt": [rng.choice(pool) for _ in range(n)],
                        "max_tokens": 2,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    rec = await client.send("completions", body, n)
                    if rec.ok and rec.ttft is not None:
                        out.append((n, rec.ttft))
        finally:
            await client.close()
        return out

    return fit_handoff(
        base, asyncio.run(measure()), source=f"; PD handoff from {base_url}"
    )


def fit_handoff(
    base: CostModel, measured: Sequence[tuple[int, float]], source: str = ""
) -> tuple[CostModel, list[dict]]:
    """(prompt tokens, TTFT through PD) pairs -> `base` with pd_latency_s / pd_bytes_per_s fitted to
    what the TTFTs exceed one worker's request overhead + prefill + first decode step by."""
    rows = []
    for n, ttft in measured:
        local = base.request_overhead_s + base.prefill_s(n) + base.decode_step_s(1, n)
        rows.append(
            {
                "new_tokens": n,
                "ttft_s": ttft,
                "without_handoff_s": local,
                "kv_bytes": base.kv_bytes(n),
            }
        )
    if len(rows) < 2:
        raise ValueError("too few PD requests succeeded to fit the handoff")
    x = np.array([r["kv_bytes"] for r in rows])
    y = np.array([r["ttft_s"] - r["without_handoff_s"] for r in rows])
    slope, intercept = (
        np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, float(np.median(y)))
    )
    changes = {"pd_latency_s": max(float(intercept), 0.0)}
    if slope > 0:
        changes["pd_bytes_per_s"] = float(1.0 / slope)
    else:  # no size dependence measurable: the median residual is the handoff, at any size
        changes["pd_latency_s"] = max(float(np.median(y)), 0.0)
    return base.with_(**changes, source=base.source + source), rows
