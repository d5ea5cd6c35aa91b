"""API keys: `--api-key` and `--api-key-file`, each key with the name its usage is counted under.

A key file holds one key per line as `NAME KEY` (blank lines and `#` comments skipped): several
clients or teams, each with its own key, and /metrics counts their requests and tokens by NAME
(`strata:api_key_*{key="NAME"}`), never by the key. `--api-key` alone is named `default`.

The HTTP guard (strata.server.app.Guard) sets `current_key` for the request it lets through, so
whatever the request starts (a `Generation`) knows whose it is without being told.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from pathlib import Path

DEFAULT_NAME = "default"  # the name of --api-key's key
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MIN_KEY_CHARS = 8

# the name of the key the current HTTP request came with (None: the server has no keys)
current_key: ContextVar[str | None] = ContextVar("strata_api_key", default=None)


def load_api_keys(api_key: str | None, key_file: str | None) -> dict[str, str]:
    """key -> name, from --api-key (named `default`) and the lines of --api-key-file. ValueError
    saying which line and what to fix for a malformed file, a short key or a repeated name/key."""
    keys: dict[str, str] = {}
    if api_key:
        keys[api_key] = DEFAULT_NAME
    if key_file is None:
        return keys
    path = Path(key_file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(
            f"cannot read --api-key-file {key_file}: {exc.strerror}"
        ) from None
    names = set(keys.values())
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--api-key-file {key_file}, line {number}"
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'NAME KEY' (two fields)")
        name, key = parts
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}: the name must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(
                f"{where}: the key of {name!r} is shorter than {MIN_KEY_CHARS} characters"
            )
        if name in names:
            raise ValueError(f"{where}: the name {name!r} is used twice")
        if key in keys:
            raise ValueError(
                f"{where}: the key of {name!r} is also the key of {keys[key]!r}"
            )
        keys[key] = name
        names.add(name)
    if not keys:
        raise ValueError(f"--api-key-file {key_file} holds no key")
    return keys
