"""`strata serve --engine-wait`: the OpenMP wait settings its engine process gets, and that the
environment's own settings win."""

from __future__ import annotations

import pytest

from strata.server.config import ServerConfig
from strata.server.launch import (
    BOUNDED_SPIN_COUNT,
    build_parser,
    engine_wait_env,
    server_config_from_args,
)


def test_each_policy_sets_its_variables():
    assert engine_wait_env("passive", {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_wait_env("active", {}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    bounded = engine_wait_env("bounded", {"PATH": "/bin"})
    assert (
        bounded["GOMP_SPINCOUNT"] == str(BOUNDED_SPIN_COUNT)
        and "OMP_WAIT_POLICY" not in bounded
    )
    assert bounded["KMP_BLOCKTIME"]  # Intel's OpenMP, for torch builds that use it


@pytest.mark.parametrize("var", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"])
def test_the_environment_wins(var):
    assert engine_wait_env("bounded", {var: "1"}) == {}
    assert engine_wait_env("passive", {var: "1"}) == {}


def test_flag_default_and_bad_value():
    args = build_parser().parse_args([])
    assert server_config_from_args(args).engine_wait == "bounded"
    args = build_parser().parse_args(["--engine-wait", "passive"])
    assert server_config_from_args(args).engine_wait == "passive"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engine-wait", "sometimes"])
    with pytest.raises(ValueError, match="engine_wait must be one of"):
        ServerConfig(engine_wait="sometimes")
    with pytest.raises(ValueError, match="engine_wait must be one of"):
        engine_wait_env("sometimes", {})


def test_bench_target_passes_it_to_the_server_only(tmp_path):
    from strata.bench.targets import BenchContext, StrataTarget, parse_target

    ctx = BenchContext.__new__(BenchContext)
    object.__setattr__(ctx, "engine_options", {})
    target = StrataTarget(parse_target("strata:engine_wait=passive,page_size=4"), ctx)
    assert target.options == {"page_size": 4} and target.server_options == {
        "engine_wait": "passive"
    }
    assert target.unavailable(
        "one-batch"
    ) is not None and "serving" in target.unavailable("one-batch")
    with pytest.raises(ValueError, match="not an EngineConfig field"):
        StrataTarget(parse_target("strata:engine_waits=passive"), ctx)
