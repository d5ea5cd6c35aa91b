"""KV pages across tiers: their names (a chained hash over the token ids, seeded by the KV layout's
namespace) and their stored form (a checked header, then the payload)."""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

import numpy as np


class PageHasher:
    """Chained SHA-256 per page: digest_i = H(digest_{i-1} || tokens of page i), seeded by the namespace."""

    def __init__(self, page_size: int, namespace: bytes):
        self.page_size = page_size
        self.seed = hashlib.sha256(namespace).digest()

    def hashes(self, tokens: Sequence[int], prev: bytes | None = None) -> list[bytes]:
        """Digests of every whole page of `tokens` (which start at a page boundary after `prev`)."""
        ps = self.page_size
        out, h = [], prev or self.seed
        for i in range(len(tokens) // ps):
            page = np.asarray(tokens[i * ps : (i + 1) * ps], dtype=np.int64).tobytes()
            h = hashlib.sha256(h + page).digest()
            out.append(h)
        return out


# --------------------------------------------------------------------------- page codec

_MAGIC = b"STKV"
_HEADER = struct.Struct(
    "<4s32s32sIQ"
)  # magic, key digest, namespace digest, crc32, payload bytes
HEADER_BYTES = _HEADER.size  # what a stored page adds to its payload


class CorruptPage(ValueError):
    pass


def encode_page(key: bytes, namespace: bytes, payload: bytes) -> bytes:
    return (
        _HEADER.pack(_MAGIC, key, namespace, zlib.crc32(payload), len(payload))
        + payload
    )


def decode_page(data: bytes, key: bytes, namespace: bytes, expected_len: int) -> bytes:
    """The payload, or CorruptPage (never another exception) if the entry is truncated, foreign,
    damaged, or not bytes at all."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptPage(f"entry is a {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise CorruptPage("truncated header")
    magic, stored_key, stored_ns, crc, length = _HEADER.unpack_from(data)
    payload = data[_HEADER.size :]
    if magic != _MAGIC:
        raise CorruptPage("bad magic")
    if stored_key != key or stored_ns != namespace:
        raise CorruptPage("entry belongs to another key or KV layout")
    if length != expected_len or len(payload) != length:
        raise CorruptPage(f"payload is {len(payload)} bytes, expected {expected_len}")
    if zlib.crc32(payload) != crc:
        raise CorruptPage("checksum mismatch")
    return payload
