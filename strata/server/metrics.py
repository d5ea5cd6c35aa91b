"""Prometheus metrics, named as SGLang names them with the `strata:` prefix.

Counters and latency histograms are observed in the frontend as outputs arrive (so latencies
include the trip through the socket, as a client sees them); gauges mirror the `EngineStats` the
engine sends with every batch and on request. Each server has its own registry (served at GET /metrics).

    strata:prompt_tokens_total              prompt tokens of finished requests
    strata:generation_tokens_total          output tokens of finished requests
    strata:cached_tokens_total              prompt tokens served from the prefix cache
    strata:num_requests_total               finished engine requests (n > 1 counts n)
    strata:num_aborted_requests_total       of which aborted (client gone, shutdown)
    strata:time_to_first_token_seconds      arrival -> first output token
    strata:inter_token_latency_seconds      between output tokens (per token of each update)
    strata:e2e_request_latency_seconds      arrival -> finished
    strata:api_key_requests_total{key}      HTTP requests accepted with each API key (by its name)
    strata:api_key_prompt_tokens_total{key} / api_key_generation_tokens_total{key}  of its requests
    strata:num_running_reqs / num_queue_reqs  scheduler running / waiting, as of the last step
    strata:token_usage                      fraction of KV pages held by requests
    strata:cache_hit_rate                   cached_tokens_total / prompt_tokens_total
    strata:num_retracted_reqs               retractions so far (KV ran out during decode)
    strata:num_preempted_reqs               running requests retracted so far for a higher priority
    strata:spec_*                           speculative decoding, since start: request-steps that verified
                                            drafts, tokens drafted / accepted, request-steps the policy gave no draft,
                                            mean accept length, request-steps per chosen draft length
    strata:moe_expert_tokens{layer, expert}  a MoE model's tokens routed to each expert of each MoE
                                            layer since start (a token counts once per chosen expert);
                                            fetched from the engine by each scrape, see below

The per-expert gauge is one series per (layer, expert): 58 x 256 = 14,848 for DeepSeek-V3 (~80 KB
from the engine, ~1.2 MB of text). Its counts never travel with the outputs (every step): GET
/metrics asks the engine for them, one round trip that waits at most for the step in progress, so
nothing is spent while nobody scrapes and a scrape sees the counts of that moment. They are
written as text here, not through prometheus_client, which took ~0.06-0.2 s to set and ~0.2 s to
format that many labelled samples on a 2-core CPU, time in which the event loop serves no stream
(~7 ms this way). The imbalance of recent traffic, per layer:
    max by (layer) (rate(strata:moe_expert_tokens[5m])) / avg by (layer) (rate(strata:moe_expert_tokens[5m]))
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from strata.engine.outputs import RequestOutput
from strata.server.io import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 4, 8, 16, 32, 64, 128)
ITL_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"strata:{name}", doc, labels, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"strata:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(
                f"strata:{name}", doc, labels, buckets=buckets, registry=r
            ).labels(model_name)

        self.prompt_tokens = counter(
            "prompt_tokens_total", "Prompt tokens of finished requests."
        )
        self.generation_tokens = counter(
            "generation_tokens_total", "Generated tokens of finished requests."
        )
        self.cached_tokens = counter(
            "cached_tokens_total", "Prompt tokens served from the prefix cache."
        )
        self.num_requests = counter(
            "num_requests_total", "Finished requests (each of n samples counts)."
        )
        self.num_aborted = counter(
            "num_aborted_requests_total",
            "Requests aborted (client disconnect, shutdown).",
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            E2E_BUCKETS,
        )
        # usage per API key (strata.server.api_keys), labelled by the key's name, never the key
        self.key_requests, self.key_prompt_tokens, self.key_generation_tokens = (
            Counter(f"strata:api_key_{name}", doc, ["key"], registry=r)
            for name, doc in (
                ("requests_total", "HTTP requests accepted with each API key."),
                ("prompt_tokens", "Prompt tokens of each API key's finished requests."),
                (
                    "generation_tokens",
                    "Output tokens of each API key's finished requests.",
                ),
            )
        )
        self.num_running = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_queue = gauge(
            "num_queue_reqs", "Requests waiting in the scheduler queue."
        )
        self.token_usage = gauge(
            "token_usage", "Fraction of the KV cache held by requests."
        )
        self.cache_hit_rate = gauge(
            "cache_hit_rate", "Cached prompt tokens / prompt tokens, since start."
        )
        self.num_retracted = gauge(
            "num_retracted_reqs", "Requests retracted so far to free KV cache."
        )
        self.num_preempted = gauge(
            "num_preempted_reqs",
            "Running requests retracted so far for a waiting request of higher priority.",
        )
        # the KV cache hierarchy's own counters are cumulative in the engine, mirrored here as gauges
        self.hicache_hit_tokens = Gauge(
            "strata:hicache_hit_tokens",
            "Prompt tokens served per cache tier, since start.",
            ["model_name", "tier"],
            registry=r,
        )
        self.hicache_hit_rate = Gauge(
            "strata:hicache_hit_rate",
            "Per-tier hit tokens / prompt tokens, since start.",
            ["model_name", "tier"],
            registry=r,
        )
        self.hicache_bytes = Gauge(
            "strata:hicache_bytes",
            "Bytes moved between tiers, since start.",
            ["model_name", "direction"],
            registry=r,
        )
        self.hicache_events = Gauge(
            "strata:hicache_events",
            "Storage errors and corrupt pages ignored, since start.",
            ["model_name", "kind"],
            registry=r,
        )
        # speculative decoding's counters, cumulative in the engine
        self.spec_counts = Gauge(
            "strata:spec_events",
            "Speculative decoding since start: verify_steps (request-steps that fed "
            "drafts), drafted_tokens, accepted_tokens, declined (request-steps the policy gave no draft: a proposal "
            "not worth its row, or a step where none could be, when nothing is looked up), vetoed "
            "(request-steps its guard stood down before looking drafts up: drafting measured slower at that "
            "batch size).",
            ["model_name", "kind"],
            registry=r,
        )
        self.spec_accept_len = gauge(
            "spec_accept_length",
            "Tokens per verifying request-step (accepted drafts + 1), since start.",
        )
        self.spec_draft_lengths = Gauge(
            "strata:spec_draft_length_steps",
            "Request-steps that fed this many drafted tokens, since start.",
            ["model_name", "length"],
            registry=r,
        )
        self.model_name = model_name
        self.expert_load: dict[
            int, list[int]
        ] = {}  # the last counts the engine sent (MoE models)
        self._prompt_total = 0
        self._cached_total = 0

    def on_output(self, route, out: RequestOutput, now: float) -> None:
        """One update for one engine request (`route` has its arrival and previous-update times)."""
        num_new = len(out.new_token_ids)
        if num_new:
            if route.last_output_at is None:
                self.ttft.observe(now - route.gen.created)
            else:
                gap = (now - route.last_output_at) / num_new
                for _ in range(num_new):
                    self.itl.observe(gap)
        if out.finished:
            self.e2e.observe(now - route.gen.created)
            self.num_requests.inc()
            self.prompt_tokens.inc(out.prompt_tokens)
            self.generation_tokens.inc(out.completion_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            if out.finish_reason == "abort":
                self.num_aborted.inc()
            if route.gen.key is not None:
                self.key_prompt_tokens.labels(route.gen.key).inc(out.prompt_tokens)
                self.key_generation_tokens.labels(route.gen.key).inc(
                    out.completion_tokens
                )
            self._prompt_total += out.prompt_tokens
            self._cached_total += out.cached_tokens
            if self._prompt_total:
                self.cache_hit_rate.set(self._cached_total / self._prompt_total)

    def on_key_request(self, key: str) -> None:
        """An HTTP request the API key named `key` was accepted with."""
        self.key_requests.labels(key).inc()

    @property
    def hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def on_stats(self, stats: EngineStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_queue.set(stats.num_waiting)
        self.token_usage.set(stats.token_usage)
        self.num_retracted.set(stats.num_retractions)
        self.num_preempted.set(stats.num_preemptions)
        h = stats.hicache
        if h:
            m = self.model_name
            for tier, n in h["hit_tokens"].items():
                self.hicache_hit_tokens.labels(m, tier).set(n)
                self.hicache_hit_rate.labels(m, tier).set(h["hit_rate"][tier])
            for direction in (
                "bytes_to_host",
                "bytes_from_host",
                "bytes_to_storage",
                "bytes_from_storage",
            ):
                self.hicache_bytes.labels(m, direction.removeprefix("bytes_")).set(
                    h[direction]
                )
            for kind in ("storage_errors", "corrupt_pages"):
                self.hicache_events.labels(m, kind).set(h[kind])
        spec = stats.spec
        if spec:
            for kind in (
                "verify_steps",
                "drafted_tokens",
                "accepted_tokens",
                "declined",
                "vetoed",
            ):
                self.spec_counts.labels(self.model_name, kind).set(spec[kind])
            self.spec_accept_len.set(spec["mean_accept_len"])
            for length, steps in spec["draft_lengths"].items():
                self.spec_draft_lengths.labels(self.model_name, length).set(steps)
        if stats.expert_load is not None:
            self.expert_load = stats.expert_load

    def render(self) -> bytes:
        return generate_latest(self.registry) + self._expert_tokens_text()

    def _expert_tokens_text(self) -> bytes:
        """`strata:moe_expert_tokens` in the text exposition format (see the module docstring)."""
        if not self.expert_load:
            return b""
        name = "strata:moe_expert_tokens"
        model = (
            self.model_name.replace("\\", r"\\")
            .replace("\n", r"\n")
            .replace('"', r"\"")
        )
        lines = [
            f"# HELP {name} Tokens routed to each expert of each MoE layer, since start.",
            f"# TYPE {name} gauge",
        ]
        for layer, counts in self.expert_load.items():
            labels = f'model_name="{model}",layer="{layer}",expert='
            lines.extend(f'{name}{{{labels}"{e}"}} {n}' for e, n in enumerate(counts))
        return ("\n".join(lines) + "\n").encode()
