"""`strata plan size`: the cheapest deployment whose simulated p99 TTFT and p99 ITL meet the SLO.

Candidates are N data-parallel replicas and PD splits of T workers into P prefill + (T - P) decode
(P at fixed fractions of T: 1/8 ... 3/4). Cost = workers x their unit cost (`prefill_cost`,
`decode_cost`; a data-parallel replica costs `decode_cost`). Meeting the SLO is taken to be
monotone in the number of workers, so each family is searched by bisection: the smallest N (or T,
with the best split of T) that passes. Among the passing candidates the cheapest wins; ties go to
the lower p99 TTFT. Every simulated candidate is reported, passing or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from strata.plan.cluster import Deployment, simulate, with_replicas
from strata.plan.cost_model import CostModel
from strata.plan.results import SimResult
from strata.plan.workload import Workload

PD_FRACTIONS = (1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4)


@dataclass(frozen=True)
class SLO:
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None

    def met(self, r: SimResult) -> bool:
        s = r.summary
        if s.failed or not s.completed:
            return False
        if self.ttft_p99_ms is not None and (
            s.ttft.p99_ms is None or s.ttft.p99_ms > self.ttft_p99_ms
        ):
            return False
        return not (
            self.itl_p99_ms is not None
            and s.itl.p99_ms is not None
            and s.itl.p99_ms > self.itl_p99_ms
        )


@dataclass
class Candidate:
    deployment: Deployment
    cost: float
    result: SimResult
    passes: bool


def size(
    workload: Workload | Callable[[], Workload],
    base: Deployment,
    cost_model: CostModel,
    slo: SLO,
    max_workers: int = 64,
    pd: bool = True,
    dp: bool = True,
    prefill_cost: float = 1.0,
    decode_cost: float = 1.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[Candidate | None, list[Candidate]]:
    """(the cheapest passing candidate or None, every candidate simulated)."""
    get = workload if callable(workload) else (lambda: workload)
    say = progress or (lambda line: None)
    tried: dict[tuple[int, int], Candidate] = {}

    def run(decode: int, prefill: int) -> Candidate:
        key = (decode, prefill)
        if key not in tried:
            dep = with_replicas(base, decode, prefill)
            result = simulate(get(), dep, cost_model, seed)
            c = decode * decode_cost + prefill * prefill_cost
            tried[key] = Candidate(dep, c, result, slo.met(result))
            s = result.summary
            say(
                f"size: {dep.label}: TTFT p99 {s.ttft.p99_ms or 0:,.0f} ms, ITL p99 {s.itl.p99_ms or 0:,.0f} ms"
                f" -> {'meets' if tried[key].passes else 'misses'} the SLO"
            )
        return tried[key]

    def smallest(lo: int, hi: int, passes: Callable[[int], bool]) -> int | None:
        if hi < lo or not passes(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if passes(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def best_split(total: int) -> Candidate | None:
        splits = sorted(
            {min(total - 1, max(1, round(total * f))) for f in PD_FRACTIONS}
        )
        passing = [c for c in (run(total - p, p) for p in splits) if c.passes]
        return min(
            passing,
            key=lambda c: (c.cost, c.result.summary.ttft.p99_ms or 0.0),
            default=None,
        )

    if dp:
        smallest(1, max_workers, lambda n: run(n, 0).passes)
    if pd and max_workers >= 2:
        smallest(2, max_workers, lambda t: best_split(t) is not None)
    passing = [c for c in tried.values() if c.passes]
    best = min(
        passing,
        key=lambda c: (c.cost, c.result.summary.ttft.p99_ms or 0.0),
        default=None,
    )
    return best, sorted(
        tried.values(), key=lambda c: (c.cost, c.deployment.num_prefill)
    )
