"""The cost model: how long one scheduler step takes, and what moving KV between tiers costs.

A step feeds some requests `n` new tokens each on top of `c` tokens of KV they already have
(decodes: n = 1, or 1 + k drafts when verifying; prefill chunks: n = the chunk). Its time is linear
in a few features of the step, summed over its requests:

    t(step) = overhead        x [rows <  row_threshold]     fixed cost of a small step
            + overhead_large  x [rows >= row_threshold]     fixed cost of a large one
            + per_row         x rows  x [rows <  threshold]   linears, per token, small-row kernel
            + per_row_large   x rows  x [rows >= threshold]   linears, per token, large-row kernel (BLAS)
            + per_decode_ctx  x sum of c over decode rows    attention reads of decodes
            + per_prefill_attn x sum of n (c + n / 2) / 1e3  attention of prefill chunks (key x query pairs)
            + per_prefill_ctx x sum of c over prefill chunks / 1e3   reading a chunk's cached KV (per key)

`row_threshold` is where an engine switches kernels (an engine that moves to a BLAS past some step
size, as Strata's CPU linears once did at 32 rows); None means one regime (Strata, which computes
every row with the same kernel), and then the two "large" features are unused. A measurement that spans several steps
(a whole prefill, a decode median) is the sum of its steps' features, so every source — the
in-process engine, a server's TTFT/ITL, one-batch JSON figures — fits the same linear model.

The fit minimises relative error (weights 1 / measured time, and 1 / sqrt(samples) of each measured
configuration, so a run's many decode steps do not drown its one prefill) with non-negative coefficients (a
negative cost would extrapolate into negative step times): least squares, dropping the most
negative coefficient and refitting until none is left.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

FEATURES = (
    "overhead",
    "overhead_large",
    "per_row",
    "per_row_large",
    "per_decode_ctx",
    "per_prefill_attn",
    "per_prefill_ctx",
)
ATTN_UNIT = 1e3  # per_prefill_attn is seconds per thousand (query, key) pairs; per_prefill_ctx per thousand keys


@dataclass(frozen=True)
class Segment:
    """One request's part of a step: `new_len` tokens fed on top of `context_len` tokens of KV."""

    new_len: int
    context_len: int
    decode: bool  # a decode (or a verify of drafts): its rows read the whole context


def step_features(segments: Iterable[Segment], row_threshold: int | None) -> np.ndarray:
    """The feature vector (order of FEATURES) of one step."""
    rows = decode_ctx = attn = prefill_ctx = 0.0
    for s in segments:
        rows += s.new_len
        if s.decode:
            decode_ctx += s.new_len * s.context_len + s.new_len * (s.new_len - 1) / 2
        else:
            attn += s.new_len * (s.context_len + s.new_len / 2) / ATTN_UNIT
            prefill_ctx += s.context_len / ATTN_UNIT
    large = row_threshold is not None and rows >= row_threshold
    small_rows, large_rows = (0.0, rows) if large else (rows, 0.0)
    return np.array(
        [
            float(not large),
            float(large),
            small_rows,
            large_rows,
            decode_ctx,
            attn,
            prefill_ctx,
        ]
    )


def chunked_prefill_steps(
    batch_size: int, new_len: int, context_len: int, chunk: int, max_batch_tokens: int
) -> list[list[Segment]]:
    """The steps a batch of `batch_size` prompts takes to prefill `new_len` tokens each (on top of
    `context_len` cached ones), with the scheduler's budgets: each request adds at most `chunk`
    tokens per step, a step holds at most `max_batch_tokens`. (How one-batch figures map to steps.)"""
    done = [0] * batch_size
    steps: list[list[Segment]] = []
    while any(d < new_len for d in done):
        budget, segs = max_batch_tokens, []
        for i in range(batch_size):
            if done[i] >= new_len or budget <= 0:
                continue
            n = min(new_len - done[i], chunk if chunk > 0 else new_len, budget)
            segs.append(Segment(n, context_len + done[i], decode=False))
            done[i] += n
            budget -= n
        steps.append(segs)
    return steps


@dataclass(frozen=True)
class Sample:
    """One measurement: `seconds` for the steps whose summed features are `features` (`num_steps` of
    them); `what` says what was measured, for the fit report."""

    features: tuple[float, ...]
    seconds: float
    what: str = ""
    num_steps: int = 1
    requests: float = (
        0.0  # requests whose overhead outside the steps the time includes (a TTFT: 1)
    )

    @classmethod
    def of_steps(
        cls,
        steps: Sequence[Sequence[Segment]],
        seconds: float,
        row_threshold: int | None,
        what: str = "",
    ):
        total = sum(
            (step_features(s, row_threshold) for s in steps), np.zeros(len(FEATURES))
        )
        return cls(tuple(float(x) for x in total), seconds, what, len(steps))


@dataclass(frozen=True)
class CostModel:
    """Fitted step-time coefficients (seconds per unit of each feature) and the KV transfer rates.

    Rates are bytes per second; `kv_bytes_per_token` converts tokens into bytes. `request_overhead_s`
    is what a request spends outside the engine's steps before its first token reaches the client
    (HTTP, tokenization, the engine process's queue): 0 for the in-process engine.
    """

    coef: dict[str, float]
    row_threshold: int | None = None
    request_overhead_s: float = 0.0
    kv_bytes_per_token: int = 0
    host_bytes_per_s: float = 8e9  # L2 (host pool) -> L1 copy
    storage_bytes_per_s: float = (
        256 * 2**20
    )  # L3 read (HiCache's prior: a slow shared disk)
    pd_bytes_per_s: float = 1e9  # prefill -> decode KV transfer
    pd_latency_s: float = 0.002  # per transfer (handshake, framing)
    spec_accept_rate: float | None = (
        None  # per drafted token; None: no speculative decoding
    )
    spec_max_draft: int = 8
    # what a step that drafts pays its drafter beside the verified rows: a draft model's forwards,
    # a block drafter's one (0: n-gram lookup, free); `strata bench spec`'s drafter ms per call
    spec_draft_s: float = 0.0
    # replicas sharing one machine: each busy one more slows a decode step / a step with prefill
    # chunks by this fraction (measured on two co-located workers; None: not measured, the
    # simulator's --contention applies)
    contention: float | None = None
    contention_prefill: float | None = None
    source: str = ""
    fit: dict[str, float] = field(
        default_factory=dict
    )  # fit quality: median / max relative error, samples

    def __post_init__(self) -> None:
        unknown = set(self.coef) - set(FEATURES)
        if unknown:
            raise ValueError(
                f"unknown cost-model coefficients {sorted(unknown)}; known: {FEATURES}"
            )
        bad = {k: v for k, v in self.coef.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(
                f"cost-model coefficients must be finite and >= 0, got {bad}"
            )
        if self.spec_accept_rate is not None and not 0 <= self.spec_accept_rate < 1:
            raise ValueError(
                f"spec_accept_rate must be in [0, 1), got {self.spec_accept_rate}"
            )
        if not (math.isfinite(self.spec_draft_s) and self.spec_draft_s >= 0):
            raise ValueError(
                f"spec_draft_s must be finite and >= 0, got {self.spec_draft_s}"
            )
        for name in ("contention", "contention_prefill"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        for name in ("host_bytes_per_s", "storage_bytes_per_s", "pd_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def vector(self) -> np.ndarray:
        return np.array([self.coef.get(f, 0.0) for f in FEATURES])

    def step_s(self, segments: Iterable[Segment]) -> float:
        return float(step_features(segments, self.row_threshold) @ self.vector)

    def prefill_s(
        self,
        new_len: int,
        context_len: int = 0,
        chunk: int = 2048,
        max_batch_tokens: int = 8192,
    ) -> float:
        """One prompt alone: the sum of its chunked-prefill steps."""
        steps = chunked_prefill_steps(1, new_len, context_len, chunk, max_batch_tokens)
        return sum(self.step_s(s) for s in steps)

    def decode_step_s(self, batch_size: int, context_len: int) -> float:
        return self.step_s([Segment(1, context_len, True)] * batch_size)

    def kv_bytes(self, num_tokens: int) -> float:
        return float(num_tokens * self.kv_bytes_per_token)

    def with_(self, **changes) -> CostModel:
        return replace(self, **changes)

    # ----------------------------------------------------------------- JSON

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown cost-model fields {sorted(unknown)}; known: {sorted(known)}"
            )
        if "coef" not in data:
            raise ValueError(
                "a cost model needs 'coef': seconds per unit of " + ", ".join(FEATURES)
            )
        return cls(**data)

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        payload = {"cost_model": self.to_json(), **(extra or {})}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))


def load_cost_model(path: str | Path) -> CostModel:
    """A calibration file written by `strata plan calibrate` (or any JSON with a "cost_model" object)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"calibration file {p} does not exist; make one with `strata plan calibrate`"
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or "cost_model" not in data:
        raise ValueError(
            f"{p} has no 'cost_model' object; make it with `strata plan calibrate`"
        )
    return CostModel.from_json(data["cost_model"])


# ----------------------------------------------------------------- the fit


def fit(
    samples: Sequence[Sample], row_threshold: int | None, **model_fields
) -> CostModel:
    """Non-negative, relative-error least squares over `samples`; features no sample exercises get 0.
    Samples that include requests' overhead (TTFTs) fit `request_overhead_s` as one more coefficient."""
    if len(samples) < 2:
        raise ValueError(
            f"the cost model needs at least 2 measurements to fit, got {len(samples)}"
        )
    X = np.array([s.features for s in samples], dtype=np.float64)
    reqs = np.array([s.requests for s in samples], dtype=np.float64)
    with_requests = bool(np.any(reqs > 0))
    if with_requests:
        X = np.column_stack([X, reqs])
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("measured times must be positive and finite")
    # relative error, and every measured configuration (`what`) counts about equally however many
    # steps it contributed (a decode run's 10 steps must not drown its one prefill step)
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.what] = counts.get(s.what, 0) + 1
    w = 1.0 / y / np.sqrt([counts[s.what] for s in samples])
    Xw, yw = X * w[:, None], y * w
    active = [j for j in range(X.shape[1]) if np.any(X[:, j] > 0)]
    coef = np.zeros(X.shape[1])
    while active:
        cols = Xw[:, active]
        scale = np.abs(cols).max(axis=0)
        sol, *_ = np.linalg.lstsq(cols / scale, yw, rcond=None)
        sol = sol / scale
        if np.all(sol >= 0):
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    rel = np.abs(X @ coef - y) / y
    quality = {
        "median_rel_err": float(np.median(rel)),
        "max_rel_err": float(rel.max()),
        "samples": float(len(y)),
    }
    if with_requests:
        model_fields["request_overhead_s"] = float(coef[-1])
    return CostModel(
        coef={f: float(c) for f, c in zip(FEATURES, coef)},
        row_threshold=row_threshold,
        fit=quality,
        **model_fields,
    )


def accept_rate_from_length(accept_length: float, draft_length: float) -> float:
    """Per-token acceptance p such that a request drafting k tokens yields `accept_length` tokens per
    verify step on average: 1 + p + ... + p^k (the accepted run plus the target's own token)."""
    k = max(1, round(draft_length))
    if accept_length <= 1.0:
        return 0.0
    if accept_length >= k + 1:
        return 0.999
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(k + 1)) < accept_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
