"""`strata bench batch`: what a batch job running on a server costs its interactive traffic.

Against a running `strata serve` (`--base-url`), each round runs the same kind of interactive
load (the serving benchmark's: a dataset at a request rate) twice: once alone, once while a batch
of `--batch-lines` chat requests runs (uploaded through /v1/files, started with /v1/batches, and
cancelled when the interactive load ends, so the next run starts quiet). The two alternate (which
goes first flips each round) and every run has prompts of its own. It reports per run the
interactive TTFT (p50, p99), end-to-end p50, output tokens/s, and the batch's lines answered per
second meanwhile; then the medians over rounds and the ratio of the p99 TTFT with the batch to
without.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

WORDS = [
    "river",
    "stone",
    "lamp",
    "orbit",
    "cedar",
    "violet",
    "harbor",
    "signal",
    "meadow",
    "copper",
    "lantern",
    "glacier",
    "thistle",
    "ember",
    "canyon",
    "quartz",
    "willow",
    "falcon",
    "prism",
    "tundra",
]


@dataclass
class Run:
    round: int
    with_batch: bool
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    output_tok_s: float
    failed: int
    batch_lines_per_s: float | None  # answered while the interactive load ran


def batch_input(n: int, input_words: int, output_len: int, seed: int) -> bytes:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(input_words))
        lines.append(
            {
                "custom_id": f"bench-{seed}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


class BatchClient:
    def __init__(self, base_url: str, api_key: str | None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=60)

    def start(self, data: bytes, timeout_s: float = 300) -> str:
        """Upload and start a batch; returns once its first line is answered."""
        upload = self.http.post(
            "/v1/files",
            files={"file": ("bench.jsonl", data)},
            data={"purpose": "batch"},
        )
        upload.raise_for_status()
        made = self.http.post(
            "/v1/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        made.raise_for_status()
        batch_id = made.json()["id"]
        deadline = time.monotonic() + timeout_s
        while self.answered(batch_id) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"batch {batch_id} answered nothing in {timeout_s:.0f}s"
                )
            time.sleep(0.2)
        return batch_id

    def batch(self, batch_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/batches/{batch_id}")
        r.raise_for_status()
        return r.json()

    def answered(self, batch_id: str) -> int:
        counts = self.batch(batch_id)["request_counts"]
        return counts["completed"] + counts["failed"]

    def stop(self, batch_id: str, timeout_s: float = 120) -> None:
        self.http.post(f"/v1/batches/{batch_id}/cancel")
        deadline = time.monotonic() + timeout_s
        while self.batch(batch_id)["status"] not in (
            "cancelled",
            "completed",
            "failed",
            "expired",
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} did not stop in {timeout_s:.0f}s")
            time.sleep(0.2)


def run_rounds(
    serving_config, dataset_for, tokenizer, rounds: int, batch: dict[str, int], log
) -> list[Run]:
    """`dataset_for(seed_offset)` makes one run's conversations; `batch`: lines, input_words,
    output_len of the batch's requests."""
    from strata.bench.serving import run_serving

    client = BatchClient(serving_config.base_url, serving_config.api_key)
    runs: list[Run] = []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for with_batch in order:
            offset = 2 * r + int(with_batch)
            batch_id = None
            if with_batch:
                data = batch_input(
                    batch["lines"], batch["input_words"], batch["output_len"], 1000 + r
                )
                batch_id = client.start(data)
                answered_before = client.answered(batch_id)
            started = time.monotonic()
            result = run_serving(serving_config, dataset_for(offset), tokenizer)
            elapsed = time.monotonic() - started
            lines_per_s = None
            if batch_id is not None:
                lines_per_s = (client.answered(batch_id) - answered_before) / elapsed
                client.stop(batch_id)
            s = result.summary
            run = Run(
                round=r,
                with_batch=with_batch,
                ttft_p50_ms=s.ttft.median_ms,
                ttft_p99_ms=s.ttft.p99_ms,
                e2e_p50_ms=s.e2e.median_ms,
                output_tok_s=s.output_throughput,
                failed=s.failed,
                batch_lines_per_s=lines_per_s,
            )
            log(run)
            runs.append(run)
    return runs


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(runs: list[Run]) -> dict[str, Any]:
    alone = [r for r in runs if not r.with_batch]
    beside = [r for r in runs if r.with_batch]
    out: dict[str, Any] = {}
    for name, group in (("alone", alone), ("with_batch", beside)):
        out[name] = {
            "ttft_p50_ms": _median([r.ttft_p50_ms for r in group]),
            "ttft_p99_ms": _median([r.ttft_p99_ms for r in group]),
            "e2e_p50_ms": _median([r.e2e_p50_ms for r in group]),
            "output_tok_s": _median([r.output_tok_s for r in group]),
        }
    out["with_batch"]["batch_lines_per_s"] = _median(
        [r.batch_lines_per_s for r in beside]
    )
    a, b = out["alone"]["ttft_p99_ms"], out["with_batch"]["ttft_p99_ms"]
    out["ttft_p99_ratio"] = b / a if a and b is not None else None
    a, b = out["alone"]["ttft_p50_ms"], out["with_batch"]["ttft_p50_ms"]
    out["ttft_p50_ratio"] = b / a if a and b is not None else None
    return out


def text(runs: list[Run], totals: dict[str, Any]) -> str:
    from strata.bench.report import fmt, table

    rows = [
        [
            str(r.round),
            "with batch" if r.with_batch else "alone",
            fmt(r.ttft_p50_ms),
            fmt(r.ttft_p99_ms),
            fmt(r.e2e_p50_ms),
            fmt(r.output_tok_s),
            str(r.failed),
            fmt(r.batch_lines_per_s, 3),
        ]
        for r in runs
    ]
    for name in ("alone", "with_batch"):
        t = totals[name]
        rows.append(
            [
                "median",
                name.replace("_", " "),
                fmt(t["ttft_p50_ms"]),
                fmt(t["ttft_p99_ms"]),
                fmt(t["e2e_p50_ms"]),
                fmt(t["output_tok_s"]),
                "",
                fmt(t.get("batch_lines_per_s"), 3),
            ]
        )
    head = [
        "round",
        "run",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "E2E p50 ms",
        "out tok/s",
        "failed",
        "batch lines/s",
    ]
    return (
        table(rows, head)
        + f"\ninteractive TTFT with the batch / alone: p99 {fmt(totals['ttft_p99_ratio'], 3)}x, "
        f"p50 {fmt(totals['ttft_p50_ratio'], 3)}x (medians over rounds)"
    )


def as_json(runs: list[Run], totals: dict[str, Any]) -> dict[str, Any]:
    return {"runs": [asdict(r) for r in runs], "summary": totals}
