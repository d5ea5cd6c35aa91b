"""`strata plan calibrate --from-json`: fit a CostModel from figures, for hardware we do not have.

Files (several; later ones override rates):
    `strata bench one-batch --output-json`  prefill over the steps the scheduler's budgets cut it
                                            into; the decode step at input + output / 2 context
    `strata bench spec --output-json`       the accept rate, from a scenario's accept and draft lengths
    a calibration                           to start from (e.g. to change a rate)
    a figures file                          {"samples": [...], "row_threshold": ..., rates ...}
                                            (docs/PLANNING.md gives its format)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from strata.plan.cost_model import (
    CostModel,
    Sample,
    Segment,
    accept_rate_from_length,
    chunked_prefill_steps,
    fit,
)

RATE_FIELDS = (
    "host_bytes_per_s",
    "storage_bytes_per_s",
    "pd_bytes_per_s",
    "pd_latency_s",
    "request_overhead_s",
    "contention",
    "contention_prefill",
)


def calibrate_json(
    paths: Sequence[str],
    row_threshold: int | None = None,
    chunked_prefill_size: int = 2048,
    max_batch_tokens: int = 8192,
    spec_scenario: str | None = None,
) -> tuple[CostModel, list[Sample]]:
    """Fit from files of figures (see the module docstring); later files override earlier rates."""
    samples: list[Sample] = []
    extra: dict[str, Any] = {}
    base: CostModel | None = None
    thr = row_threshold
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{p} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} is not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}: expected a JSON object")
        if "cost_model" in data:
            base = CostModel.from_json(data["cost_model"])
            thr = thr if thr is not None else base.row_threshold
        elif data.get("benchmark") == "one-batch":
            for r in data.get("results", []):
                b, n = int(r["batch_size"]), int(r["input_len"])
                steps = chunked_prefill_steps(
                    b, n, 0, chunked_prefill_size, max_batch_tokens
                )
                samples.append(
                    Sample.of_steps(
                        steps, float(r["prefill_s"]), thr, f"one-batch prefill {b}x{n}"
                    )
                )
                if r.get("decode_step_ms"):
                    ctx = n + int(r.get("output_len", 0)) // 2
                    step = [[Segment(1, ctx, True)] * b]
                    samples.append(
                        Sample.of_steps(
                            step,
                            r["decode_step_ms"] / 1000,
                            thr,
                            f"one-batch decode {b}x{ctx}",
                        )
                    )
        elif (
            "results" in data
            and isinstance(data.get("config"), dict)
            and "scenarios" in data["config"]
        ):
            extra.update(_spec_rate(data, spec_scenario, p))
        else:
            thr = data.get("row_threshold", thr)
            for i, s in enumerate(data.get("samples", [])):
                samples.append(
                    _figure_sample(
                        s,
                        thr,
                        chunked_prefill_size,
                        max_batch_tokens,
                        f"{p}: samples[{i}]",
                    )
                )
            if "spec" in data:
                spec = data["spec"]
                extra["spec_accept_rate"] = accept_rate_from_length(
                    float(spec["accept_length"]), float(spec["draft_length"])
                )
            known = {f.name for f in fields(CostModel)}
            extra.update(
                {
                    k: v
                    for k, v in data.items()
                    if k in known and k not in ("coef", "row_threshold")
                }
            )
    if base is not None and not samples:
        return base.with_(**extra, row_threshold=thr), []
    if not samples:
        raise ValueError(
            "no measurements in "
            + ", ".join(paths)
            + ": give one-batch JSON, samples or a calibration"
        )
    start = base.to_json() if base is not None else {}
    rates = {
        k: start[k]
        for k in RATE_FIELDS
        + ("kv_bytes_per_token", "spec_accept_rate", "spec_max_draft", "spec_draft_s")
        if k in start
    }
    rates.update(extra)
    rates.setdefault("source", "figures from " + ", ".join(Path(x).name for x in paths))
    return fit(samples, thr, **rates), samples


def _figure_sample(s: dict, thr, chunk: int, mbt: int, where: str) -> Sample:
    try:
        kind, seconds = s["kind"], float(s["seconds"])
        if kind == "prefill":
            new, cached = int(s["new_tokens"]), int(s.get("cached_tokens", 0))
            b = int(s.get("batch_size", 1))
            sample = Sample.of_steps(
                chunked_prefill_steps(b, new, cached, chunk, mbt),
                seconds,
                thr,
                f"prefill {b}x{new}",
            )
            return Sample(
                sample.features,
                seconds,
                sample.what,
                sample.num_steps,
                requests=float(s.get("requests", 0)),
            )
        if kind == "decode":
            b, ctx = int(s["batch_size"]), int(s["context_tokens"])
            return Sample.of_steps(
                [[Segment(1, ctx, True)] * b], seconds, thr, f"decode {b}x{ctx}"
            )
        if kind == "step":
            segs = [Segment(int(n), int(c), bool(d)) for n, c, d in s["segments"]]
            return Sample.of_steps([segs], seconds, thr, "step")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{where}: {exc!r}; see docs/PLANNING.md for the figures format"
        ) from None
    raise ValueError(f"{where}: kind must be prefill, decode or step, got {kind!r}")


def _spec_rate(data: dict, scenario: str | None, path: Path) -> dict[str, float]:
    rows = [r for r in data["results"] if r.get("accept_length")]
    if scenario:
        rows = [r for r in rows if r.get("scenario") == scenario]
    if not rows:
        raise ValueError(
            f"{path}: no scenario with an accept length"
            + (f" named {scenario!r}" if scenario else "")
        )
    r = rows[0]
    out = {
        "spec_accept_rate": accept_rate_from_length(
            float(r["accept_length"]), float(r.get("draft_length") or 4)
        )
    }
    if r.get(
        "drafter_ms_per_call"
    ):  # a draft model or block drafter: its forward per step
        share = min(1.0, float(r.get("drafter_calls_per_verify_step") or 1.0))
        out["spec_draft_s"] = float(r["drafter_ms_per_call"]) / 1e3 * share
    return out
