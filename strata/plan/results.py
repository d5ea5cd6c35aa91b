"""What a simulation reports, in `strata bench serving`'s terms.

Each finished request becomes a `strata.bench.metrics.RequestRecord` (sent, chunk arrivals, end,
lengths, cached tokens), shifted by the cost model's `request_overhead_s` where a client would see
it, and `summarize` computes throughput and TTFT / ITL / TPOT / E2E statistics with the very
definitions the benchmark uses. On top: prompt tokens served from each KV tier, and per worker
its utilisation (busy time / run time), mean batch size, steps, peak KV use and retractions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from strata.bench import report
from strata.bench.metrics import RequestRecord, ServingSummary, summarize


@dataclass
class WorkerStats:
    name: str
    role: str  # replica | prefill | decode
    utilisation: float
    steps: int
    mean_batch: float
    tokens_per_step: float
    kv_peak_tokens: int
    retractions: int


@dataclass
class SimResult:
    label: str
    summary: ServingSummary
    hit_rate: dict[str, float]  # tier -> prompt tokens served from it / prompt tokens
    workers: list[WorkerStats]
    spec_accepted_fraction: float | None = (
        None  # accepted / drafted tokens, when drafting
    )
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "summary": report._jsonable(self.summary),
            "hit_rate": self.hit_rate,
            "workers": [asdict(w) for w in self.workers],
            "spec_accepted_fraction": self.spec_accepted_fraction,
        }

    def headline(self) -> dict[str, float | None]:
        s = self.summary
        return {
            "req/s": s.request_throughput,
            "out tok/s": s.output_throughput,
            "TTFT p50 ms": s.ttft.median_ms,
            "TTFT p99 ms": s.ttft.p99_ms,
            "ITL p50 ms": s.itl.median_ms,
            "ITL p99 ms": s.itl.p99_ms,
            "E2E p50 ms": s.e2e.median_ms,
            "hit rate": sum(self.hit_rate.values()),
        }


def collect(done, decode_replicas, prefill_replicas, sim) -> SimResult:
    overhead = sim.cost.request_overhead_s
    records, tiers, prompt_tokens = [], {"device": 0, "host": 0, "storage": 0}, 0
    for r in done:
        records.append(
            RequestRecord(
                start=r.sent_t,
                end=r.finish_t + overhead,
                chunk_times=[t + overhead for t in r.chunk_times],
                prompt_len=r.prompt_len,
                output_len=r.outputs,
                cached_tokens=sum(r.cached_by_tier.values()),
            )
        )
        prompt_tokens += r.prompt_len
        for k, v in r.cached_by_tier.items():
            tiers[k] += v
    summary = summarize(records, start=0.0)
    duration = summary.duration_s
    workers = []
    pd = bool(prefill_replicas)
    for role, reps in (
        ("decode" if pd else "replica", decode_replicas),
        ("prefill", prefill_replicas),
    ):
        for rep in reps:
            workers.append(
                WorkerStats(
                    name=rep.name,
                    role=role,
                    utilisation=rep.busy_s / duration if duration > 0 else 0.0,
                    steps=rep.num_steps,
                    mean_batch=rep.batch_size_sum / rep.num_steps
                    if rep.num_steps
                    else 0.0,
                    tokens_per_step=rep.tokens_fed / rep.num_steps
                    if rep.num_steps
                    else 0.0,
                    kv_peak_tokens=rep.kv_peak_tokens,
                    retractions=rep.num_retractions,
                )
            )
    drafted = sum(rep.spec_drafted for rep in decode_replicas)
    accepted = sum(rep.spec_accepted for rep in decode_replicas)
    hit = {k: v / prompt_tokens if prompt_tokens else 0.0 for k, v in tiers.items()}
    return SimResult(
        label=sim.dep.label,
        summary=summary,
        hit_rate=hit,
        workers=workers,
        spec_accepted_fraction=(accepted / drafted if drafted else None),
        records=records,
    )


def result_text(r: SimResult) -> str:
    s = r.summary
    rows = [
        ["requests (completed)", str(s.completed)],
        ["duration (s)", report.fmt(s.duration_s)],
        ["requests/s", report.fmt(s.request_throughput, 3)],
        ["output tok/s", report.fmt(s.output_throughput)],
        ["total tok/s", report.fmt(s.total_throughput)],
    ]
    for name, st in (
        ("TTFT", s.ttft),
        ("ITL", s.itl),
        ("TPOT", s.tpot),
        ("E2E", s.e2e),
    ):
        rows.append(
            [
                f"{name} ms (mean / p50 / p90 / p99)",
                " / ".join(
                    report.fmt(x, 1)
                    for x in (st.mean_ms, st.median_ms, st.p90_ms, st.p99_ms)
                ),
            ]
        )
    rows.append(
        [
            "cache hit rate: device / host / storage",
            " / ".join(f"{r.hit_rate[k]:.3f}" for k in ("device", "host", "storage")),
        ]
    )
    if r.spec_accepted_fraction is not None:
        rows.append(["drafted tokens accepted", f"{r.spec_accepted_fraction:.2f}"])
    out = [f"simulated: {r.label}", report.table(rows, ["figure", "value"]), ""]
    wrows = [
        [
            w.name,
            w.role,
            f"{w.utilisation:.2f}",
            str(w.steps),
            f"{w.mean_batch:.1f}",
            f"{w.tokens_per_step:.0f}",
            str(w.kv_peak_tokens),
            str(w.retractions),
        ]
        for w in r.workers
    ]
    if len(wrows) > 16:
        util = sorted(w.utilisation for w in r.workers)
        out.append(
            f"{len(wrows)} workers: utilisation min {util[0]:.2f}, median {util[len(util) // 2]:.2f}, max {util[-1]:.2f}"
        )
    else:
        out.append(
            report.table(
                wrows,
                [
                    "worker",
                    "role",
                    "util",
                    "steps",
                    "mean batch",
                    "tok/step",
                    "KV peak",
                    "retracted",
                ],
            )
        )
    return "\n".join(out)


def compare_text(r: SimResult, measured: dict[str, Any]) -> str:
    """Predicted vs measured (a `strata bench serving --output-json` file's first result)."""
    s = measured["summary"]
    pairs = [
        ("requests/s", r.summary.request_throughput, s.get("request_throughput")),
        ("output tok/s", r.summary.output_throughput, s.get("output_throughput")),
        (
            "TTFT p50 ms",
            r.summary.ttft.median_ms,
            (s.get("ttft") or {}).get("median_ms"),
        ),
        ("TTFT p99 ms", r.summary.ttft.p99_ms, (s.get("ttft") or {}).get("p99_ms")),
        ("ITL p50 ms", r.summary.itl.median_ms, (s.get("itl") or {}).get("median_ms")),
        ("E2E p50 ms", r.summary.e2e.median_ms, (s.get("e2e") or {}).get("median_ms")),
        ("cache hit rate", sum(r.hit_rate.values()), s.get("usage_cache_hit_rate")),
    ]
    rows = []
    for name, pred, real in pairs:
        err = (
            f"{(pred - real) / real * 100:+.0f}%"
            if pred is not None and real
            else "n/a"
        )
        rows.append([name, report.fmt(pred), report.fmt(real), err])
    return report.table(rows, ["figure", "predicted", "measured", "error"])
