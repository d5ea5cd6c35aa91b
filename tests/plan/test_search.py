"""`strata plan size` picks the smallest configuration that meets the SLO (synthetic cost model)."""

from __future__ import annotations

from strata.bench.datasets import DatasetConfig
from strata.plan.cluster import Deployment, simulate, with_replicas
from strata.plan.search import SLO, size
from strata.plan.workload import dataset_workload


def workload():
    # ~20 requests/s of 128-token prompts: one replica (a 128-token prefill alone is 138 ms) cannot keep up
    cfg = DatasetConfig(
        name="random", num_prompts=120, input_len=128, output_len=16, range_ratio=0.5
    )
    return dataset_workload(cfg, rate=20.0)


def test_size_picks_the_smallest_data_parallel_deployment_that_meets_the_slo(cost):
    slo = SLO(ttft_p99_ms=800, itl_p99_ms=400)
    best, tried = size(workload, Deployment(1), cost, slo, max_workers=16, pd=False)
    assert best is not None and best.passes
    n = best.deployment.num_replicas
    assert n > 1
    fewer = simulate(workload(), with_replicas(Deployment(1), n - 1), cost)
    assert not slo.met(fewer)  # one replica less misses it: n is the smallest
    assert slo.met(simulate(workload(), with_replicas(Deployment(1), n), cost))
    assert all(c.cost >= best.cost for c in tried if c.passes)


def test_size_considers_pd_splits_and_reports_when_nothing_fits(cost):
    slo = SLO(ttft_p99_ms=800)
    best, tried = size(workload, Deployment(1), cost, slo, max_workers=16)
    assert any(c.deployment.num_prefill for c in tried)
    assert best is not None and all(c.cost >= best.cost for c in tried if c.passes)
    nothing, _ = size(workload, Deployment(1), cost, SLO(ttft_p99_ms=1), max_workers=4)
    assert nothing is None
