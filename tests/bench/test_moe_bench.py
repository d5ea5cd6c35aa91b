"""`strata bench moe`: every implementation runs, agrees with transformers, and the table reads."""

from __future__ import annotations

import pytest

from strata.bench.moe import format_rows, run_moe_bench
from strata.bench.moe_config import FAMILIES, IMPLEMENTATIONS, MoEBenchConfig
from strata.layers.packed import dense_target


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_bench_runs_every_implementation_and_matches_transformers(family):
    cfg = MoEBenchConfig(
        family=family,
        hidden_size=32,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
        batch_sizes=(1, 5),
        rounds=1,
        iters=1,
    )
    rows = run_moe_bench(cfg)
    optional = {"strata"} | ({"strata-native"} if dense_target() is None else set())
    assert {(r["batch_size"], r["implementation"]) for r in rows} >= {
        (b, impl) for b in (1, 5) for impl in IMPLEMENTATIONS if impl not in optional
    }
    assert all(r["max_abs_diff"] < 1e-4 and r["tok_s"] > 0 for r in rows), rows
    table = format_rows(cfg, rows)
    assert table.count("\n") == len(rows) + 1 and "transformers-eager" in table
