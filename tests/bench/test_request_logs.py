"""`strata bench serving` and `strata bench compare` print no log line per request: httpx's
"HTTP Request: ..." INFO records are held back unless the user asks for debug logging."""

from __future__ import annotations

import argparse
import logging

import pytest

from strata.bench.cli import add_bench_args

REQUEST_LOGGERS = ("httpx", "httpcore")  # the HTTP client libraries' loggers


@pytest.fixture(autouse=True)
def restore_request_loggers():
    loggers = [logging.getLogger(name) for name in REQUEST_LOGGERS]
    levels = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def request_records(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name.split(".")[0] in REQUEST_LOGGERS and "HTTP Request" in r.getMessage()
    ]


DATASET = [
    "--num-prompts",
    "3",
    "--input-len",
    "8",
    "--output-len",
    "2",
    "--num-warmup",
    "0",
    "--disable-progress",
]


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_bench_serving_logs_requests_only_when_asked_for_debug(
    fake_server, llama_dir, caplog, level
):
    caplog.set_level(
        level
    )  # the root logger, as `strata --log-level info|debug` sets it
    args = parse(
        [
            "serving",
            "--base-url",
            fake_server.base_url,
            "--tokenizer",
            str(llama_dir),
            *DATASET,
        ]
    )
    assert args.func(args) == 0
    if level == logging.DEBUG:
        assert (
            len(request_records(caplog)) >= 3
        )  # the check sees them where they are wanted
    else:
        assert request_records(caplog) == []


def test_bench_compare_logs_no_request_at_info(fake_server, llama_dir, caplog):
    caplog.set_level(logging.INFO)
    args = parse(
        [
            "compare",
            "serving",
            "--targets",
            f"url={fake_server.base_url}",
            "--model",
            str(llama_dir),
            "--rounds",
            "1",
            *DATASET,
        ]
    )
    assert args.func(args) == 0
    assert request_records(caplog) == []
