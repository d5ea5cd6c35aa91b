"""Messages between prefill and decode workers. Every message carries an HMAC-SHA256 over its
fields (and the KV payload) with the shared secret, so only workers that know it can announce
themselves or deliver KV; a worker also only accepts rooms it was told about by the router."""

from __future__ import annotations

import hashlib
import hmac

import msgspec


class Hello(msgspec.Struct, tag="hello"):
    """decode → prefill: room `room` waits for `prompt_len` tokens of KV at `kv_endpoint`."""

    room: int
    kv_endpoint: str
    prompt_len: int
    namespace: str  # KV layout identity (hex); must equal the prefill worker's
    mac: str = ""


class KVHeader(msgspec.Struct, tag="kv"):
    """prefill → decode, followed by one frame of raw KV bytes [layers, 2, prompt_len, kv_heads, head_dim]."""

    room: int
    prompt_len: int
    first_token: int
    first_logprob: float | None
    dtype: str
    shape: list[int]
    mac: str = ""


class KVFailed(msgspec.Struct, tag="failed"):
    """prefill → decode: the prefill for `room` failed; the decode worker fails the request."""

    room: int
    reason: str
    mac: str = ""


Message = Hello | KVHeader | KVFailed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def _fields(msg: Message) -> bytes:
    data = msgspec.structs.asdict(msg)
    data.pop("mac")
    return msgspec.json.encode({"type": type(msg).__name__, **data})


def sign(msg: Message, secret: bytes, payload: bytes = b"") -> Message:
    msg.mac = hmac.new(secret, _fields(msg) + payload, hashlib.sha256).hexdigest()
    return msg


def verify(msg: Message, secret: bytes, payload: bytes = b"") -> bool:
    expected = hmac.new(secret, _fields(msg) + payload, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, msg.mac)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
