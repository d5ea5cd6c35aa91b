"""Messages between prefill and decode workers, and what makes them trustworthy.

Authenticated: every message carries an HMAC-SHA256, keyed by the shared secret, over its fields
(msgpack, so every float is signed as itself) and, for KV, the payload. A transfer is bound to one
request: the decode worker's Hello names the prompt (`prompt_digest`, `prompt_len`) and a fresh
random `nonce`; the prefill worker sends KV only if the prompt is the one it computed, and every
answer echoes the nonce, so KV (or a failure) from another request or an earlier use of the room
is rejected.

Validated on decoding (msgspec constraints): room ids in [0, 2**63), hex digests, nonces and MACs of
their exact length, a tcp:// endpoint, bounded strings and shapes. Whether the KV fits the room
(shape, dtype, payload size, first token in the vocabulary, a finite logprob <= 0) is checked by
the receiving manager once the MAC holds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

import msgspec

from strata.disagg.auth import MAX_ROOM

MAX_FRAMES = 2  # a header frame, then (KV only) one payload frame
MAX_HEADER_BYTES = (
    16 * 1024
)  # far above the largest header (a KVFailed with a capped reason)
MAX_REASON_CHARS = 1000

Room = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM - 1)]
Digest = Annotated[
    str, msgspec.Meta(pattern="^[0-9a-f]{64}$")
]  # sha256 / HMAC-SHA256, hex
Nonce = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
Mac = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")]  # empty until signed
Endpoint = Annotated[
    str, msgspec.Meta(max_length=300, pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$")
]
TokenCount = Annotated[int, msgspec.Meta(ge=1, lt=2**31)]
Dim = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Tier = Annotated[str, msgspec.Meta(max_length=16, pattern="^[a-z]+$")]


class Hello(msgspec.Struct, tag="hello"):
    """decode → prefill: room `room` waits at `kv_endpoint` for the KV of the prompt `prompt_digest`."""

    room: Room
    kv_endpoint: Endpoint
    prompt_len: TokenCount
    prompt_digest: Digest  # prompt_digest(prompt ids)
    namespace: Annotated[
        str, msgspec.Meta(max_length=512, pattern="^[0-9a-f]*$")
    ]  # KV layout identity
    nonce: Nonce  # fresh per room; every answer must echo it
    mac: Mac = ""


class KVHeader(msgspec.Struct, tag="kv"):
    """prefill → decode, then one frame of raw KV bytes [layers, 2, prompt_len, kv_heads, head_dim]."""

    room: Room
    nonce: Nonce
    prompt_len: TokenCount
    first_token: Annotated[int, msgspec.Meta(ge=-(2**31), lt=2**31)]
    first_logprob: float | None
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[list[Dim], msgspec.Meta(max_length=8)]
    # prompt tokens the prefill worker took from its prefix cache, in all and per tier (the
    # decode side reports them in the request's usage, as a single worker would)
    cached_tokens: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = 0
    cached_by_tier: Annotated[
        dict[Tier, Annotated[int, msgspec.Meta(ge=0, lt=2**31)]],
        msgspec.Meta(max_length=4),
    ] = {}
    mac: Mac = ""


class KVFailed(msgspec.Struct, tag="failed"):
    """prefill → decode: the prefill for `room` failed; the decode worker fails the request."""

    room: Room
    nonce: Nonce
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
    mac: Mac = ""


Message = Hello | KVHeader | KVFailed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def prompt_digest(prompt_ids: list[int]) -> str:
    return hashlib.sha256(_encoder.encode(list(prompt_ids))).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def failure_reason(text: str) -> str:
    """A KVFailed reason within the cap the receiver enforces."""
    return (
        text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
    )


def _signed_bytes(msg: Message) -> bytes:
    fields = msgspec.structs.astuple(msg)[:-1]  # all but the mac
    return _encoder.encode(["strata-pd/2", type(msg).__name__, *fields])


def sign(msg: Message, secret: bytes, payload: bytes = b"") -> Message:
    msg.mac = hmac.new(secret, _signed_bytes(msg) + payload, hashlib.sha256).hexdigest()
    return msg


def verify(msg: Message, secret: bytes, payload: bytes = b"") -> bool:
    """True when the MAC is right; never raises, whatever the message holds."""
    expected = hmac.new(
        secret, _signed_bytes(msg) + payload, hashlib.sha256
    ).hexdigest()
    return hmac.compare_digest(expected.encode(), msg.mac.encode("utf-8", "replace"))


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError (or ValidationError, a subclass) for anything malformed."""
    try:
        return _decoder.decode(data)
    except (
        UnicodeDecodeError
    ) as exc:  # msgspec lets invalid UTF-8 in a string through as this
        raise msgspec.DecodeError(f"invalid UTF-8 in a string: {exc}") from None
