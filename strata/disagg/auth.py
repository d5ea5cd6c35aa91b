"""Who may hand a worker a bootstrap room: only the router, which signs it.

A disaggregated worker takes `bootstrap_room` (and, on a decode worker, `bootstrap_addr`: where it
will connect to fetch KV) only from a request that carries

    X-Strata-Bootstrap: <hex HMAC-SHA256(secret, ["strata-bootstrap/1", room, addr, sha256(body)])>

keyed by the secret every prefill and decode worker and the router share (--disaggregation-secret
or STRATA_DISAGG_SECRET). The MAC covers the exact request body the worker receives, so a signature
cannot be moved to another prompt or another address. Torch-free: the HTTP frontend and the router
import it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgspec

HEADER = "x-strata-bootstrap"
SECRET_ENV = "STRATA_DISAGG_SECRET"
MAX_ROOM = 2**63  # rooms are in [0, MAX_ROOM)


def shared_secret(configured: str | None) -> bytes | None:
    """The disaggregation secret: the configured one, else $STRATA_DISAGG_SECRET, else None."""
    secret = configured or os.environ.get(SECRET_ENV)
    return secret.encode() if secret else None


def new_room() -> int:
    """A fresh room id; unguessable, so nobody but the router and its two workers knows it."""
    return secrets.randbelow(MAX_ROOM)


def sign_bootstrap(secret: bytes, room: int, addr: str | None, body: bytes) -> str:
    """The X-Strata-Bootstrap value for a request `body` that carries `room` and `addr`."""
    signed = msgspec.json.encode(
        ["strata-bootstrap/1", room, addr, hashlib.sha256(body).hexdigest()]
    )
    return hmac.new(secret, signed, hashlib.sha256).hexdigest()


def verify_bootstrap(
    secret: bytes | None,
    room: int | None,
    addr: str | None,
    body: bytes,
    signature: str | None,
) -> bool:
    """True when `signature` is the router's for exactly this room, address and body."""
    if (
        secret is None
        or not signature
        or not isinstance(room, int)
        or not 0 <= room < MAX_ROOM
    ):
        return False
    expected = sign_bootstrap(secret, room, addr, body)
    return hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace"))
