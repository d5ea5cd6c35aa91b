"""`strata router` flags: defaults from RouterConfig, clear errors, engine flags passed to --launch."""

from __future__ import annotations

import argparse
import socket

import pytest

from strata.router.cli import add_router_args, config_from_args, router_main
from strata.router.config import RouterConfig, normalize_worker_url
from strata.router.launcher import LocalReplica, engine_flags


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="strata router")
    add_router_args(parser)
    return parser.parse_args(list(argv))


def test_flags_default_to_the_config_and_reach_it():
    assert config_from_args(parse()) == RouterConfig()
    config = config_from_args(
        parse(
            "--worker-urls",
            "http://a:1/",
            "https://b:2",
            "--policy",
            "round_robin",
            "--max-retries",
            "5",
            "--balance-abs-threshold",
            "8",
            "--worker-api-key",
            "k",
        )
    )
    assert config.worker_urls == ("http://a:1", "https://b:2")
    assert (config.policy, config.max_retries, config.balance_abs_threshold) == (
        "round_robin",
        5,
        8,
    )
    assert config.worker_api_key == "k"


def test_policy_choices_come_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        parse("--policy", "fastest")
    assert "cache_aware" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("127.0.0.1:30000", "must start with http:// or https://"),
        ("ftp://h:1", "must start with http:// or https://"),
        ("http://h:1/v1", "without a path"),
        ("http://h:1?x=1", "without a path or query"),
        ("http://user:pw@h:1", "credentials"),
        ("http://h:99999", "malformed"),
        ("", "non-empty"),
    ],
)
def test_bad_worker_urls_are_refused_with_the_reason(url, why, capsys):
    with pytest.raises(ValueError, match=why):
        normalize_worker_url(url)
    assert router_main(parse("--worker-urls", url or " ", "--port", "0")) == 2
    assert why.split()[0] in capsys.readouterr().err


def test_url_normalization():
    assert normalize_worker_url(" http://Host:8000/ ") == "http://host:8000"
    assert normalize_worker_url("http://[::1]:8000") == "http://[::1]:8000"
    with pytest.raises(ValueError, match="twice"):
        RouterConfig(worker_urls=("http://a:1", "http://a:1/"))


def test_other_errors_exit_2_before_anything_starts(capsys):
    assert router_main(parse("--launch", "-1")) == 2
    assert router_main(parse("--health-check-interval", "0")) == 2
    assert "health_check_interval must be > 0" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert (
            router_main(
                parse("--port", str(port), "--worker-urls", "http://127.0.0.1:1")
            )
            == 2
        )
    assert "pick another --port" in capsys.readouterr().err


def test_launch_passes_the_engine_flags_that_were_given():
    args = parse(
        "--launch",
        "2",
        "--model",
        "/m",
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--disable-radix-cache",
        "--disaggregation-secret",
        "pd-s3cret",
        "--hicache-storage-path",
        "redis://:pw@host:6379/0",
    )
    flags, secret_env = engine_flags(args)
    assert flags[:2] == ["--model", "/m"]
    assert {"--dtype", "float32", "--num-threads", "1", "--disable-radix-cache"} <= set(
        flags
    )
    assert "--page-size" not in flags  # defaults are left to `strata serve`
    replica = LocalReplica(flags, port=1234, api_key="wk", secret_env=secret_env)
    cmd = replica.command()
    assert cmd[1:3] == ["-m", "strata.server"]
    assert cmd[cmd.index("--port") + 1] == "1234"
    # secrets never go on a command line (readable by every local user in /proc): the environment
    assert (
        not {"wk", "pd-s3cret", "redis://:pw@host:6379/0"} & set(cmd)
        and "--api-key" not in cmd
    )
    env = replica.environment()
    assert env["STRATA_API_KEY"] == "wk" and env["STRATA_DISAGG_SECRET"] == "pd-s3cret"
    assert env["STRATA_HICACHE_STORAGE_PATH"] == "redis://:pw@host:6379/0"
