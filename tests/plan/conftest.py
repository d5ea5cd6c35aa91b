"""Shared pieces of the planner's tests: a cost model with round numbers (no model is ever run)."""

from __future__ import annotations

import pytest

from strata.plan.cost_model import CostModel


@pytest.fixture
def cost() -> CostModel:
    """10 ms a step + 1 ms a row; 2 us per decode context token; no kernel switch; 1 GB/s everywhere."""
    return CostModel(
        coef={"overhead": 0.010, "per_row": 0.001, "per_decode_ctx": 2e-6},
        kv_bytes_per_token=1000,
        host_bytes_per_s=1e9,
        storage_bytes_per_s=1e9,
        pd_bytes_per_s=1e9,
        pd_latency_s=0.001,
    )
