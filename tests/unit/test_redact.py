"""Secret config fields are marked once and redacted wherever a config or a message leaves."""

from __future__ import annotations

import logging

from strata.bench.report import _jsonable
from strata.bench.serving import ServingConfig
from strata.config import EngineConfig
from strata.redact import (
    REDACTED,
    install_log_redaction,
    redact_url,
    redacted,
    scrub,
    secret_values,
    with_env_secrets,
)
from strata.router.config import RouterConfig
from strata.server.config import ServerConfig


def test_every_secret_field_is_redacted():
    engine = EngineConfig(
        disaggregation_secret="pd-secret",
        hicache_storage_path="redis://u:p%40ss@h:6379/0",
    )
    out = redacted(engine)
    assert out["disaggregation_secret"] == REDACTED
    assert out["hicache_storage_path"] == "redis://<redacted>@h:6379/0"
    assert (
        redacted(EngineConfig())["disaggregation_secret"] is None
    )  # unset stays visibly unset
    assert redacted(ServerConfig(api_key="k3y"))["api_key"] == REDACTED
    router = redacted(RouterConfig(api_key="k3y", worker_api_key="wk3y"))
    assert router["api_key"] == router["worker_api_key"] == REDACTED
    bench = _jsonable(ServingConfig(base_url="http://x", api_key="k3y"))
    assert bench["api_key"] == REDACTED and bench["base_url"] == "http://x"


def test_secret_values_and_scrub():
    engine = EngineConfig(
        disaggregation_secret="pd-secret",
        hicache_storage_path="redis://u:p%40ss@h:6379/0",
    )
    values = secret_values(engine, ServerConfig(api_key="k3y-value"))
    assert {"pd-secret", "k3y-value", "p@ss", "p%40ss"} <= set(values)
    text = "failed: pd-secret k3y-value connecting to redis://u:p%40ss@h:6379/0 (password p@ss)"
    clean = scrub(text, values)
    assert not any(v in clean for v in values) and clean.count(REDACTED) == 4
    assert redact_url("see https://tok@example.com/x and http://a:b@c:1") == (
        "see https://<redacted>@example.com/x and http://<redacted>@c:1"
    )


def test_log_records_are_scrubbed(caplog):
    previous = logging.getLogRecordFactory()
    try:
        install_log_redaction(["sup3r-secret"])
        log = logging.getLogger("strata.test_redact")
        with caplog.at_level(logging.INFO, logger="strata.test_redact"):
            log.info("connecting with %s to %s", "sup3r-secret", "redis://:pw@host:1/0")
            log.info(
                "%s %s", "plain", "args"
            )  # untouched: formatters may read record.args
            try:
                raise RuntimeError("boom sup3r-secret")
            except RuntimeError:
                log.exception("failed")
        first, plain, failed = caplog.records
        assert (
            first.getMessage()
            == "connecting with <redacted> to redis://<redacted>@host:1/0"
        )
        assert plain.args == ("plain", "args")
        assert "sup3r-secret" not in failed.exc_text and REDACTED in failed.exc_text
    finally:
        logging.setLogRecordFactory(previous)


def test_secrets_come_from_the_environment_not_the_command_line(monkeypatch):
    monkeypatch.setenv("STRATA_DISAGG_SECRET", "from-env")
    monkeypatch.setenv("STRATA_API_KEY", "key-from-env")
    values = with_env_secrets(
        EngineConfig, {"disaggregation_secret": None, "model": None}
    )
    assert values["disaggregation_secret"] == "from-env"
    assert with_env_secrets(ServerConfig, {})["api_key"] == "key-from-env"
    assert (
        with_env_secrets(ServerConfig, {"api_key": "flag"})["api_key"] == "flag"
    )  # a flag wins
