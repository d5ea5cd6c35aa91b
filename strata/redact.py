"""Secrets in configs: marked once on their dataclass field, redacted wherever a config or a message
leaves the process (server info, logs, error messages, benchmark JSON).

    api_key: str | None = field(default=None, metadata=SECRET)  # the whole value is secret
    storage_path: str | None = field(default=None, metadata=CREDENTIALS)  # only a URL's user:password

Torch-free: the HTTP frontend, the router and the engine process all use it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

SECRET = {"secret": "value"}
CREDENTIALS = {"secret": "url"}
REDACTED = "<redacted>"

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")


def secret(env: str | None = None) -> dict[str, str]:
    """Field metadata of a secret value; `env` names its environment variable (default STRATA_<NAME>)."""
    return {**SECRET, "env": env} if env else SECRET


def env_name(cls: type, name: str) -> str:
    """The environment variable that may carry secret field `name` of `cls` instead of its flag."""
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    return meta.get("env") or "STRATA_" + name.upper()


def with_env_secrets(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (a config's fields from flags), with each secret field left unset taken from its
    environment variable: a process can hand secrets to a child without a command line, which every
    local user can read in /proc."""
    out = dict(values)
    for f in dataclasses.fields(cls):
        if (
            f.metadata.get("secret")
            and out.get(f.name) is None
            and os.environ.get(env_name(cls, f.name))
        ):
            out[f.name] = os.environ[env_name(cls, f.name)]
    return out


def redact_url(text: str) -> str:
    """`redis://user:pw@host:6379/0` -> `redis://<redacted>@host:6379/0` (anywhere in `text`)."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def redacted(config: Any) -> dict[str, Any]:
    """`dataclasses.asdict(config)` with every SECRET field replaced and every CREDENTIALS field's
    URL user:password part removed (None stays None, so a reader still sees whether it is set)."""
    out = dataclasses.asdict(config)
    for f in dataclasses.fields(config):
        value = out[f.name]
        kind = f.metadata.get("secret")
        if value is None or kind is None:
            continue
        out[f.name] = REDACTED if kind == "value" else redact_url(str(value))
    return out


def secret_values(*configs: Any) -> list[str]:
    """Every secret string these configs (and the environment) hold, for scrubbing free text."""
    found: list[str] = []
    for config in configs:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            kind = f.metadata.get("secret")
            if not value or kind is None:
                continue
            if kind == "value":
                found.append(str(value))
            else:
                for match in _USERINFO.finditer(str(value)):
                    userinfo = match["userinfo"]  # user:password, or a token alone
                    password = userinfo.split(":", 1)[-1]
                    found += [userinfo, password, unquote(password)]
    return sorted(
        {s for s in found if len(s) >= 4}, key=len, reverse=True
    )  # longest first


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret value and URL credential replaced by <redacted>."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return redact_url(text)


def install_log_redaction(secrets: Iterable[str]) -> None:
    """Scrub secrets from every log record this process creates (message, arguments, traceback),
    whichever logger or handler it goes to. Call once, after the configs are known."""
    secrets = list(secrets)
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the logging module's to report
            return record
        scrubbed = scrub(message, secrets)
        if (
            scrubbed != message
        ):  # else leave msg/args alone: some formatters read the args (uvicorn's)
            record.msg, record.args = scrubbed, ()
        if record.exc_info:  # formatted now (handlers reuse exc_text), then scrubbed
            text = record.exc_text or logging.Formatter().formatException(
                record.exc_info
            )
            record.exc_text = scrub(text, secrets)
        return record

    logging.setLogRecordFactory(factory)
