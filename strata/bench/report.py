"""Readable terminal tables and machine-readable JSON for every benchmark result."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from strata.bench.compare import CompareResult, higher_is_better
from strata.bench.metrics import LatencyStats
from strata.bench.offline import OfflineResult
from strata.bench.one_batch import OneBatchResult
from strata.bench.serving import ServingResult
from strata.bench.step_timer import PIECES
from strata.bench.window import SteadyWindow
from strata.redact import redacted

PIECE_NAMES = [*PIECES, "total"]


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(rows: list[list[str]], header: list[str] | None = None) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the others right."""
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        )

    out = [line(header), "  ".join("-" * w for w in widths)] if header else []
    return "\n".join(out + [line(r) for r in rows])


def _latency_rows(name: str, s: LatencyStats) -> list[list[str]]:
    return [
        [f"{name} {k} (ms)", fmt(getattr(s, f"{k}_ms"))]
        for k in ("mean", "median", "p90", "p99")
    ]


def _window_rows(w: SteadyWindow | None) -> list[list[str]]:
    if w is None:
        return [
            [
                "steady window (20%..90% completed)",
                "n/a (too few requests, or they finished together)",
            ]
        ]
    return [
        [
            f"steady window ({w.low_fraction:.0%}..{w.high_fraction:.0%} completed) duration (s)",
            fmt(w.duration_s),
        ],
        ["steady request throughput (req/s)", fmt(w.request_throughput, 3)],
        ["steady output throughput (tok/s)", fmt(w.output_throughput)],
        [f"steady decode step (ms) [{w.step_source}]", fmt(w.mean_step_ms)],
    ]


def serving_text(r: ServingResult) -> str:
    s, c = r.summary, r.config
    rate = "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g}"
    rows = [
        ["target", c.base_url],
        ["model / endpoint", f"{r.model} / {c.endpoint}"],
        ["request rate / max concurrency", f"{rate} / {c.max_concurrency or 'none'}"],
        ["completed requests", fmt(s.completed)],
        ["failed requests", fmt(s.failed)],
        ["completed with fewer tokens than asked", fmt(s.short_outputs)],
        ["duration, whole run (s)", fmt(s.duration_s)],
        ["request throughput, whole run (req/s)", fmt(s.request_throughput, 3)],
        ["input token throughput, whole run (tok/s)", fmt(s.input_throughput)],
        ["output token throughput, whole run (tok/s)", fmt(s.output_throughput)],
        ["total token throughput, whole run (tok/s)", fmt(s.total_throughput)],
        ["mean concurrency", fmt(s.mean_concurrency)],
        ["input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"],
    ]
    for name, stats in (
        ("TTFT", s.ttft),
        ("TPOT", s.tpot),
        ("ITL", s.itl),
        ("E2E", s.e2e),
    ):
        rows += _latency_rows(name, stats)
    rows += _window_rows(r.window)
    rows.append(
        [
            "cache hit rate, usage.cached_tokens (this run)",
            fmt(s.usage_cache_hit_rate, 3),
        ]
    )
    rows.append(
        [
            f"cache hit rate, server [{r.server_cache_hit_rate_source or 'not reported'}]",
            fmt(r.server_cache_hit_rate, 3),
        ]
    )
    for name, ms in r.server_cpu_ms_per_output_token.items():
        rows.append([f"server {name} CPU per output token (ms)", fmt(ms, 3)])
    text = table(rows, ["serving benchmark", "value"])
    if s.errors:
        text += "\nerrors:\n" + "\n".join(
            f"  {n} x {msg}" for msg, n in s.errors.items()
        )
    return text


def one_batch_text(results: list[OneBatchResult]) -> str:
    rows = [
        [
            r.target,
            str(r.batch_size),
            str(r.input_len),
            str(r.output_len),
            fmt(r.prefill_s, 3),
            fmt(r.prefill_tok_s, 1),
            fmt(r.decode_step_ms),
            fmt(r.decode_tok_s, 1),
            fmt(
                None
                if r.kv_peak_bytes_per_request is None
                else r.kv_peak_bytes_per_request / 2**20,
                2,
            ),
        ]
        for r in results
    ]
    text = table(
        rows,
        [
            "target",
            "batch",
            "input",
            "output",
            "prefill (s)",
            "prefill tok/s",
            "decode step ms",
            "decode tok/s",
            "KV/request peak (MiB)",
        ],
    )
    pieces = [r for r in results if r.decode_pieces_ms or r.prefill_pieces_ms]
    if pieces:
        names = PIECE_NAMES
        rows = []
        for r in pieces:
            for phase, p in (
                ("prefill", r.prefill_pieces_ms),
                ("decode", r.decode_pieces_ms),
            ):
                if p:
                    rows.append(
                        [f"bs={r.batch_size} in={r.input_len} {phase}"]
                        + [fmt(p[n], 2) for n in names]
                    )
        text += "\n\nper-step breakdown, mean ms per step:\n" + table(
            rows, ["step"] + names
        )
    return text


def offline_text(r: OfflineResult) -> str:
    rows = [
        ["target", r.target],
        ["requests", str(r.num_requests)],
        ["duration, whole run (s)", fmt(r.duration_s)],
        ["input / output tokens", f"{r.input_tokens} / {r.output_tokens}"],
        ["request throughput (req/s)", fmt(r.request_throughput, 3)],
        ["input throughput (tok/s)", fmt(r.input_tok_s)],
        ["output throughput (tok/s)", fmt(r.output_tok_s)],
        ["total throughput (tok/s)", fmt(r.total_tok_s)],
        [
            "cache hit rate (prompt tokens from the prefix cache)",
            fmt(r.cache_hit_rate, 3),
        ],
    ]
    if r.window is not None or r.target.startswith("strata"):
        rows += _window_rows(r.window)
    if r.decode_pieces_ms:
        p = r.decode_pieces_ms
        rows.append(
            [
                "decode step pieces, mean ms: " + " / ".join(PIECE_NAMES),
                " / ".join(fmt(p[n]) for n in PIECE_NAMES),
            ]
        )
    text = table(rows, ["offline benchmark", "value"])
    if r.expert_load_summary:
        text += "\n\n" + expert_load_text(r.expert_load_summary)
    return text


def expert_load_text(summary: dict[int, dict[str, Any]]) -> str:
    """One row per MoE layer: how unevenly its experts were used (strata.layers.expert_load)."""
    rows = [
        [
            str(layer),
            str(s["tokens"]),
            str(s["busiest_expert"]),
            str(s["max_tokens"]),
            fmt(s["mean_tokens"], 1),
            fmt(s["max_over_mean"]),
            str(s["idle_experts"]),
        ]
        for layer, s in summary.items()
    ]
    header = [
        "MoE layer",
        "tokens routed",
        "busiest expert",
        "its tokens",
        "mean/expert",
        "max/mean",
        "idle experts",
    ]
    return "expert load of this run (a token counts once per chosen expert):\n" + table(
        rows, header
    )


def compare_text(c: CompareResult) -> str:
    targets = [t for t in c.targets if t in c.values]
    header = (
        ["figure (median of rounds)"]
        + targets
        + [f"{t} / {c.targets[0]}" for t in targets[1:]]
    )
    rows = []
    for fig in c.figures:
        row = [fig + ("" if higher_is_better(fig) else " [lower is better]")]
        row += [fmt(c.median(t, fig)) for t in targets]
        row += [
            (f"{c.ratio(t, fig):.2f}x" if c.ratio(t, fig) is not None else "n/a")
            for t in targets[1:]
        ]
        rows.append(row)
    text = f"compare {c.mode}: {c.rounds} round(s), order alternating each round\n"
    text += table(rows, header) if rows else "(no target produced figures)"
    for t, why in c.skipped.items():
        text += f"\nskipped {t}: {why}"
    return text


# ----------------------------------------------------------------- JSON


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            k: _jsonable(v) for k, v in redacted(obj).items()
        }  # secret fields never reach a file
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    return obj


def serving_json(r: ServingResult) -> dict[str, Any]:
    out = {
        "config": _jsonable(r.config),
        "model": r.model,
        "summary": _jsonable(r.summary),
        "steady_window": _jsonable(r.window),
        "server_cache_hit_rate": r.server_cache_hit_rate,
        "server_cache_hit_rate_source": r.server_cache_hit_rate_source,
        "server_cpu_ms_per_output_token": r.server_cpu_ms_per_output_token,
        "requests": [
            {
                "prompt_len": x.prompt_len,
                "output_len": x.output_len,
                "ttft_s": x.ttft,
                "e2e_s": x.e2e,
                "itl_s": x.itls,
                "cached_tokens": x.cached_tokens,
                "error": x.error,
            }
            for x in r.records
        ],
    }
    return out


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the SIMD extensions that decide which kernels can run."""
    from strata.kernels import ISA_FLAGS, cpu_flags

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in f
                    if line.startswith("model name")
                ),
                model,
            )
    except OSError:
        pass
    return {
        "model": model,
        "isa": sorted(f for f in cpu_flags() if f in ISA_FLAGS.values()),
    }


def environment() -> dict[str, Any]:
    import torch

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_description(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        # OpenMP spin-waiting decides CPU results on a busy machine (see docs/BENCHMARKS.md)
        "env": {
            k: os.environ.get(k)
            for k in (
                "OMP_WAIT_POLICY",
                "GOMP_SPINCOUNT",
                "OMP_NUM_THREADS",
                "CUDA_VISIBLE_DEVICES",
            )
        },
        "argv": sys.argv,
    }


def write_json(path: str | Path, kind: str, results: Any) -> None:
    payload = {
        "benchmark": kind,
        "environment": environment(),
        "results": _jsonable(results),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))
