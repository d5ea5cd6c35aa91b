"""GGUF's quantized tensor types converted, without loss, into Strata's q4 / q8 block formats.

The formats are defined in strata.layers.quant; this module only reads ggml's byte layouts (numpy,
no torch) and rewrites them:

    Q4_0  [d f16][16 B nibbles]            per 32     -> q4: d, m = -8 d
    Q4_1  [d f16][m f16][16 B nibbles]     per 32     -> q4: d, m
    Q4_K  [d f16][dmin f16][12 B 6-bit scales/mins][128 B nibbles]  per 256 (8 blocks of 32)
                                                      -> q4: d * scale_j, m = -dmin * min_j
    Q8_0  [d f16][32 x int8]               per 32     -> q8 (S = 32): d
    Q5_0  [d f16][4 B high bits][16 B nibbles]  per 32 -> q8 (S = 32): d, q - 16 in -16..15
    Q6_K  [128 B low nibbles][64 B high 2 bits][16 x int8 scales][d f16]  per 256 (16 groups of 16)
                                                      -> q8 (S = 16): d * scale_j, q - 32 in -32..31

Scales are kept in float32, so every product above is exact. `to_blocks` returns None for a type
without a native format (F32, F16, BF16, Q5_1, Q5_K, Q2_K, ...): such tensors load dequantized.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

# ggml type -> our format
BLOCK_FORMATS: dict[Q, str] = {
    Q.Q4_0: "q4",
    Q.Q4_1: "q4",
    Q.Q4_K: "q4",
    Q.Q8_0: "q8",
    Q.Q5_0: "q8",
    Q.Q6_K: "q8",
}


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_to_q4(low_high: np.ndarray) -> np.ndarray:
    """[..., 32] values in 0..15 (channel order) -> [..., 16] bytes in the q4 order."""
    return (low_high[..., :16] | (low_high[..., 16:] << 4)).astype(np.uint8)


def to_blocks(
    raw: np.ndarray, qtype: Q, rows: int, cols: int
) -> dict[str, np.ndarray] | None:
    """A GGUF tensor's raw bytes (`ReaderTensor.data`) as our blocks: {"qs", "d"[, "m"]} for [rows, cols]."""
    if qtype not in BLOCK_FORMATS:
        return None
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    if qtype in (Q.Q4_0, Q.Q4_1):
        blocks = data.reshape(rows, cols // 32, 18 if qtype == Q.Q4_0 else 20)
        d = _f16(blocks[..., 0:2])
        if qtype == Q.Q4_0:
            m, qs = -8 * d, blocks[..., 2:]
        else:
            m, qs = _f16(blocks[..., 2:4]), blocks[..., 4:]
        return {"qs": qs.reshape(rows, cols // 2).copy(), "d": d, "m": m}
    if qtype == Q.Q8_0:
        blocks = data.reshape(rows, cols // 32, 34)
        return {
            "qs": blocks[..., 2:].view(np.int8).reshape(rows, cols).copy(),
            "d": _f16(blocks[..., 0:2]),
        }
    if qtype == Q.Q5_0:
        return _q5_0(data.reshape(rows, cols // 32, 22), rows, cols)
    if qtype == Q.Q4_K:
        return _q4_k(data.reshape(rows, cols // 256, 144), rows, cols)
    return _q6_k(data.reshape(rows, cols // 256, 210), rows, cols)


def _q5_0(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    # value j < 16: low nibble of qs[j], value 16 + j: its high nibble; bit j of the little-endian
    # 32-bit qh is value j's fifth bit. x = d * (q - 16)
    qh = blocks[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [rows, blocks, 32]
    qs = blocks[..., 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    q = (low | (high << 4)).astype(np.int16) - 16
    return {"qs": q.astype(np.int8).reshape(rows, cols), "d": _f16(blocks[..., 0:2])}


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, supers]
    sc = blocks[..., 4:16].astype(
        np.uint8
    )  # 12 bytes: 8 six-bit scales and 8 six-bit mins
    scales = np.concatenate(
        [sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], axis=-1
    )
    mins = np.concatenate(
        [sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1
    )
    # 128 bytes = 4 chunks of 32: the low nibbles are block 2c, the high nibbles block 2c + 1
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
    values = np.stack([qs & 15, qs >> 4], axis=3).reshape(
        rows, -1, 8, 32
    )  # [rows, supers, 8, 32]
    return {
        "qs": _nibbles_to_q4(values).reshape(rows, cols // 2),
        "d": (d[..., None] * scales.astype(np.float32)).reshape(rows, cols // 32),
        "m": (-dmin[..., None] * mins.astype(np.float32)).reshape(rows, cols // 32),
    }


def _q6_k(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 64)  # two halves of 128 values
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 32)
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [rows, supers, 16]
    d = _f16(blocks[..., 208:210])
    # value l + 32 k of a half (l < 32, k < 4): low 4 bits from ql (nibble k // 2 of byte l + 32 (k % 2)),
    # high 2 bits from qh[l] >> 2k
    low = np.stack(
        [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4],
        axis=3,
    )
    high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=3)
    q = (low | (high << 4)).astype(
        np.int16
    ) - 32  # [rows, supers, 2, 4, 32] = channel order
    return {
        "qs": q.astype(np.int8).reshape(rows, cols),
        "d": (d[..., None] * scales).reshape(rows, cols // 16),
    }
