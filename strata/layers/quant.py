"""Block-quantized weights for CPU linears: q4 and q8 in blocks of 32 input channels, as GGUF stores them.

Decode on a CPU is memory-bandwidth bound: every step reads every weight once for a few rows, so 4-
or 8-bit weights cut the bytes per step ~4x / ~2x against bf16 (~6x / ~3x against fp32). Two formats,
owned here (no private torch layout), into which GGUF's types convert without loss:

    q4   qs uint8 [N, K/2], d, m [N, K/32]:  w[n, 32b + j] = d[n, b] * q + m[n, b],  q in 0..15
         (byte 16b + j of a row holds q of channel 32b + j in its low nibble, 32b + 16 + j in its high
         nibble: ggml's Q4_0/Q4_1 order). Q4_0 (m = -8 d), Q4_1, Q4_K (d = d * scale, m = -dmin * min).
    q8   qs int8 [N, K], d [N, K/S], S = 32 or 16:  w[n, k] = d[n, k // S] * qs[n, k].
         Q8_0 (S = 32), Q6_K (S = 16, d = d * scale).

Scales and offsets are kept in float16 when every one of a layer's is exactly a float16 (GGUF's
Q4_0, Q4_1 and Q8_0 store them so), else in float32: a q4 block is then 20 bytes per 32 weights
instead of 24, and a decode step reads the fewer bytes.

A layer holds its blocks packed for the kernels (`pack_rows`, `pack_scales`): 16 output rows
interleaved, 4 bytes of each side by side, so one SIMD lane per row (quant_ops.cpp). The row-major
layout above is what checkpoints and GGUF converters speak; `qs`, `d`, `m` give it back (copies).

`QuantLinear.forward` runs the native kernel (strata/kernels/quant_ops.cpp: activations quantized to
int8 per block of 32, integer dot products with AVX2 or AVX-512 VNNI, as llama.cpp does) for every
row, decode and prefill alike: it is faster than dequantizing for a BLAS matmul at every row count
measured (1.2-1.3x at 512 rows, 2-3x at 32-128, on SmolLM2's layers), and it computes a row the same
whatever else is in the call, so a request's tokens, logits and KV do not depend on what shares its
step or how its prompt is chunked. Without the kernels (other devices, no SIMD build) it
dequantizes chunks of weight rows and calls `F.linear`. Two oracles in pure torch: `reference_forward`
(float32 matmul with the dequantized weight: the quantization error) and `emulated_forward` (the
kernel's own arithmetic, int8 activations included: the kernel's parity test).

Methods for float checkpoints are picked by name from `QUANT_METHODS` (`quantize_model`); GGUF
checkpoints bring their own blocks (strata.weights.gguf). Nothing here knows about requests.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from strata import kernels
from strata.layers.packed import DenseLinear, onednn_linear

logger = logging.getLogger(__name__)

BLOCK = 32  # input channels per block (weights and activations)
# the fallback path dequantizes this many weights at a time, so the chunk is still in cache when the
# matmul reads it; weights of up to twice this are done whole
DEQUANT_CHUNK_NUMEL = 1 << 20


def scale_dtype(*scales: torch.Tensor) -> torch.dtype:
    """float16 if every value of `scales` is exactly a float16 (finite), else float32."""
    for t in scales:
        t = t.float()
        if not torch.equal(t.half().float(), t):
            return torch.float32
    return torch.float16


def quantize_activations(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel does to its input, in torch: x [M, K] -> (q float [M, K/32, 32] in -127..127,
    d [M, K/32] = max|x| / 127, s [M, K/32] = the block's float sum, c = 8 (s - d sum(q)): the sum's
    rounding error, which lets q4 weights count as centred (q - 8), see quant_ops.cpp)."""
    xb = x.float().view(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])
    s = xb.sum(dim=2)
    return q, d, s, 8 * (s - d * q.sum(dim=2))


# {rows of a linear's input: (the [start, end) runs of it that take the int8 kernel, each request's


class QuantLinear(nn.Module, ABC):
    """`y = x @ dequantize().T + bias`, with the weight stored in blocks (one of the formats above).

    Contract: built once (`from_weight`, or from a checkpoint's blocks); its buffers never change
    afterwards. `forward` takes any float dtype `[..., in_features]` and returns that dtype
    `[..., out_features]`; it mutates nothing.
    """

    format: str
    bias: torch.Tensor | None  # a buffer

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(
                f"block quantization needs in_features divisible by {BLOCK}; got {in_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # --matmul fast (strata.layers.fast_matmul): calls of at least fast_rows rows multiply
        # fast_weight, a bf16 copy of the weight prepacked for oneDNN (0: never)
        self.fast_rows = 0
        self.fast_weight: torch.Tensor | None = None

    @classmethod
    @abstractmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> QuantLinear:
        """Quantize a float weight [out_features, in_features] (ValueError if the shape cannot be stored)."""

    @abstractmethod
    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """The weight rows `index` selects (a slice, or row ids) as float32 [rows, in_features], in torch."""

    def _ids(self, index: slice | torch.Tensor) -> torch.Tensor:
        """Row ids of `index` (a slice or ids) as int64 [T]."""
        if isinstance(index, slice):
            return torch.arange(self.out_features)[index]
        return index.reshape(-1).long()

    def dequantize_rows(
        self, start: int, end: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Weight rows [start, end) as `dtype` [end - start, in_features], in pure torch."""
        return self.rows(slice(start, end)).to(dtype)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` [T] as float32 [T, in_features] (an embedding lookup)."""
        return self.rows(ids.reshape(-1))

    @abstractmethod
    def kernel_mm(self, ops, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] contiguous -> [rows, out_features] with the native kernel `ops`."""

    @abstractmethod
    def emulated_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The native kernel's arithmetic in torch (int8 activations): float32 [rows, out_features]."""

    def dequantize(self) -> torch.Tensor:
        """The weight the blocks stand for: float32 [out_features, in_features]."""
        return self.dequantize_rows(0, self.out_features)

    def dequant_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features] without the kernels: dequantize
        DEQUANT_CHUNK_NUMEL weights at a time into x.dtype, then a dense matmul."""
        n, k = self.out_features, self.in_features
        step = (
            n if n * k <= 2 * DEQUANT_CHUNK_NUMEL else max(16, DEQUANT_CHUNK_NUMEL // k)
        )
        parts = [
            F.linear(x, self.dequantize_rows(i, min(i + step, n), x.dtype))
            for i in range(0, n, step)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Oracle of the quantization itself: float32 matmul with the dequantized weight, in x.dtype."""
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.dequantize(), bias).to(x.dtype)

    def emulated_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Oracle of the native kernel: `emulated_mm` (+ bias), in x.dtype."""
        out = self.emulated_mm(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features).contiguous()  # [rows, in_features]
        fast = self.fast_weight
        if fast is not None and x2d.shape[0] >= self.fast_rows:
            out = onednn_linear(x2d.to(torch.bfloat16), fast, None)
            out = out.to(x.dtype)
        else:
            ops = kernels.usable(x2d)
            out = self.kernel_mm(ops, x2d) if ops is not None else self.dequant_mm(x2d)
        bias = self._buffers[
            "bias"
        ]  # direct: Module.__getattr__ costs ~1 us, and decode calls this 121x a step
        if bias is not None:
            out = out.add_(bias.to(out.dtype))
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format={self.format}"
        )


class Q4Linear(QuantLinear):
    """4-bit, asymmetric, blocks of 32: w = d * q + m (see the module docstring for the byte order).
    Held packed (`pack_rows`): `qp` [G, K/32, 4, 16, 4], `dp`, `mp` [G, K/32, 16]; `qs`, `d`, `m` give
    the row-major layout back."""

    format = "q4"
    qp: torch.Tensor  # buffers
    dp: torch.Tensor
    mp: torch.Tensor

    def __init__(
        self,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        super().__init__(qs.shape[1] * 2, qs.shape[0], bias)
        n, nb = self.out_features, self.in_features // BLOCK
        if qs.dtype != torch.uint8 or d.shape != (n, nb) or m.shape != (n, nb):
            raise ValueError(
                f"q4 blocks need qs uint8 [N, K/2], d and m [N, K/32]; got {qs.shape} {d.shape} {m.shape}"
            )
        dtype = scale_dtype(d, m)
        self.register_buffer("qp", pack_rows(qs, 4))  # uint8 [G, K/32, 4, 16, 4]
        self.register_buffer(
            "dp", pack_scales(d.to(dtype), 1)[:, :, 0]
        )  # [G, K/32, 16] float16 or float32
        self.register_buffer("mp", pack_scales(m.to(dtype), 1)[:, :, 0])

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Q4Linear:
        """Each block's min..max spread over the 16 levels (a block's weights are rarely centred on 0)."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(
                f"block quantization needs in_features divisible by {BLOCK}; got {k}"
            )
        w = weight.detach().float().view(n, k // BLOCK, BLOCK)
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, K/32]
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (
            torch.round((w - lo[..., None]) * inv[..., None])
            .clamp_(0, 15)
            .to(torch.uint8)
        )
        return cls(pack_nibbles(q.view(n, k)), d, lo, bias)

    @property
    def qs(self) -> torch.Tensor:
        """uint8 [N, K/2] in the row-major byte order (a copy)."""
        return packed_rows(self.qp, self._ids(slice(None)))

    @property
    def d(self) -> torch.Tensor:
        return packed_scales(self.dp[:, :, None], self._ids(slice(None)))

    @property
    def m(self) -> torch.Tensor:
        return packed_scales(self.mp[:, :, None], self._ids(slice(None)))

    def unpacked(self, index: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """q of the rows `index` selects: uint8 [rows, K/32, 32]."""
        qs = packed_rows(self.qp, self._ids(index)).view(
            -1, self.in_features // BLOCK, BLOCK // 2
        )
        return torch.cat([qs & 15, qs >> 4], dim=2)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        ids = self._ids(index)
        d, m = (
            packed_scales(self.dp[:, :, None], ids),
            packed_scales(self.mp[:, :, None], ids),
        )
        w = self.unpacked(ids).float().mul_(d[..., None]).add_(m[..., None])
        return w.view(-1, self.in_features)

    def kernel_mm(self, ops, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        return ops.q4_linear(x, b["qp"], b["dp"], b["mp"], self.out_features)

    def emulated_mm(self, x: torch.Tensor) -> torch.Tensor:
        xq, xd, xs, xc = quantize_activations(x)
        d, m = self.d, self.m
        sums = torch.einsum(
            "mbj,nbj->mnb", xq, self.unpacked().float()
        )  # exact integers in float32
        offsets = m[None] * xs[:, None] + d[None] * xc[:, None]  # [M, N, K/32]
        return (sums * (d[None] * xd[:, None]) + offsets).sum(-1)


class Q8Linear(QuantLinear):
    """8-bit, symmetric, one scale per `group` (32 or 16) input channels: w = d * q. Held packed
    (`pack_rows`): `qp` [G, K/32, 8, 16, 4], `dp` [G, K/32, 32/group, 16]; `qs`, `d` give the row-major
    layout back."""

    format = "q8"
    qp: torch.Tensor  # buffers
    dp: torch.Tensor

    def __init__(
        self, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None
    ):
        super().__init__(qs.shape[1], qs.shape[0], bias)
        self.group = self.in_features // max(1, d.shape[1])
        if (
            qs.dtype != torch.int8
            or self.group not in (16, 32)
            or d.shape != (self.out_features, self.in_features // self.group)
        ):
            raise ValueError(
                f"q8 blocks need qs int8 [N, K], d [N, K/32] or [N, K/16]; got {qs.shape} {d.shape}"
            )
        self.register_buffer("qp", pack_rows(qs, 8))  # int8 [G, K/32, 8, 16, 4]
        self.register_buffer(
            "dp", pack_scales(d.to(scale_dtype(d)), BLOCK // self.group)
        )  # [G, K/32, subs, 16]

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Q8Linear:
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(
                f"block quantization needs in_features divisible by {BLOCK}; got {k}"
            )
        w = weight.detach().float().view(n, k // BLOCK, BLOCK)
        d = w.abs().amax(dim=2) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.view(n, k), d, bias)

    @property
    def qs(self) -> torch.Tensor:
        """int8 [N, K] (a copy)."""
        return packed_rows(self.qp, self._ids(slice(None)))

    @property
    def d(self) -> torch.Tensor:
        return packed_scales(self.dp, self._ids(slice(None)))

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        ids = self._ids(index)
        q = (
            packed_rows(self.qp, ids)
            .view(-1, self.in_features // self.group, self.group)
            .float()
        )
        return q.mul_(packed_scales(self.dp, ids)[..., None]).view(-1, self.in_features)

    def kernel_mm(self, ops, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        return ops.q8_linear(x, b["qp"], b["dp"], self.out_features)

    def emulated_mm(self, x: torch.Tensor) -> torch.Tensor:
        xq, xd, _, _ = quantize_activations(x)
        rows, subs = x.shape[0], self.in_features // self.group
        w = self.qs.float().view(self.out_features, subs, self.group)
        sums = torch.einsum("msj,nsj->mns", xq.view(rows, subs, self.group), w)
        scale = (
            self.d[None] * xd.repeat_interleave(BLOCK // self.group, dim=1)[:, None]
        )  # [M, N, subs]
        return (sums * scale).sum(-1)


GROUP = 16  # weight rows interleaved in the packed layout


def pack_rows(q: torch.Tensor, quads: int) -> torch.Tensor:
    """Row-major weight bytes [N, K/32 * quads * 4] (q4: qs, quads 4; q8: qs, quads 8) -> the kernels'
    layout [G, K/32, quads, 16, 4], G = ceil(N / 16): 4 bytes of each of 16 rows side by side (rows
    past N are zeros). See strata/kernels/quant_ops.cpp."""
    n, width = q.shape
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, width, dtype=q.dtype)
    padded[:n] = q
    return (
        padded.view(groups, GROUP, width // (quads * 4), quads, 4)
        .permute(0, 2, 3, 1, 4)
        .contiguous()
    )


def pack_scales(s: torch.Tensor, subs: int) -> torch.Tensor:
    """Scales [N, K/32 * subs] -> [G, K/32, subs, 16] (rows past N are zeros)."""
    n, width = s.shape
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, width, dtype=s.dtype)
    padded[:n] = s
    return (
        padded.view(groups, GROUP, width // subs, subs).permute(0, 2, 3, 1).contiguous()
    )


def packed_rows(qp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight, row-major: [len(ids), K/32 * quads * 4]."""
    picked = qp[ids // GROUP, :, :, ids % GROUP]  # [T, K/32, quads, 4]
    return picked.reshape(len(ids), -1)


def packed_scales(sp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of packed scales [G, K/32, subs, 16], row-major: [len(ids), K/32 * subs]."""
    return sp[ids // GROUP, :, :, ids % GROUP].reshape(len(ids), -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> qs [N, K/2] in the q4 byte order."""
    n, k = q.shape
    blocks = q.view(n, k // BLOCK, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2 :] << 4)).reshape(
        n, k // 2
    )


def concat_rows(
    parts: list[QuantLinear], bias: torch.Tensor | None = None
) -> nn.Module:
    """One layer computing the parts' outputs side by side (a fused qkv or gate/up projection).

    Parts of one format (and, for q8, one group size) merge into a single QuantLinear; a mix (e.g. a
    Q4_K_M checkpoint's Q4_K q and Q6_K v) becomes a `ConcatLinear` that runs each and joins them."""
    first = parts[0]
    if all(
        type(p) is type(first) and getattr(p, "group", 0) == getattr(first, "group", 0)
        for p in parts
    ):
        if isinstance(first, Q4Linear):
            qs, d, m = (
                torch.cat([getattr(p, t) for p in parts]) for t in ("qs", "d", "m")
            )
            return Q4Linear(qs, d, m, bias)
        q8 = cast("list[Q8Linear]", parts)  # the other format, checked above
        return Q8Linear(
            torch.cat([p.qs for p in q8]), torch.cat([p.d for p in q8]), bias
        )
    return ConcatLinear(parts, bias)


class ConcatLinear(nn.Module):
    """Row ranges of one output held in different formats: y = cat([part(x) for part]) + bias."""

    bias: torch.Tensor | None  # a buffer

    def __init__(self, parts: Sequence[QuantLinear], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out.add_(self.bias.to(out.dtype))

    def dequantize(self) -> torch.Tensor:
        return torch.cat([cast(QuantLinear, p).dequantize() for p in self.parts])


class QuantEmbedding(nn.Module):
    """An embedding table kept in blocks (a GGUF's Q8_0 token_embd): rows are dequantized on lookup,
    and the same blocks serve a tied output projection (`head`)."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.head = table  # [vocab, hidden] in blocks; also the tied lm_head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (
            self.head.gather_rows(ids.reshape(-1))
            .to(self.dtype)
            .view(*ids.shape, self.embedding_dim)
        )


QUANT_METHODS: dict[str, type[QuantLinear]] = {"int8": Q8Linear, "int4": Q4Linear}


# AMX int8 tiles (quant_ops.cpp): rows per call timed at load, and the speed-up they must show
TILE_TRIAL_ROWS = (16, 64, 256)
TILE_GAIN = 1.25
TILE_REPEATS = 5
# "off": never take the tiles; a number N: both formats from N rows, untimed; else ("auto") timed
TILES_ENV = "STRATA_INT8_TILES"


def median_call_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median ms of `fn()` over `repeats` calls, after one to warm up (caches, threads, tile state)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def fewest_winning_rows(timed: dict[int, list[float]], gain: float) -> int:
    """The fewest rows at which the second path (timed[rows] = [first ms, second ms]) is `gain`
    times faster, there and at every larger count timed; 0 if at none."""
    chosen = 0
    for rows in sorted(timed, reverse=True):
        first_ms, second_ms = timed[rows]
        if first_ms < gain * second_ms:
            break
        chosen = rows
    return chosen


def choose_int8_tiles(model: nn.Module, dtype: torch.dtype) -> dict[str, object] | None:
    """Time the model's largest q4 and q8 linear at TILE_TRIAL_ROWS rows with and without the AMX int8
    tiles, and let each format take the tiles from the fewest rows at which they win by TILE_GAIN at
    that count and every larger one (never, if at none). The tiles give the same bits as the dot
    products (the tests check it), so the choice moves only time. The setting is the process's, made
    by the first model loaded (a draft model loaded after its target keeps it). Returns what was
    chosen and timed ({format: {"rows", "layer", "timed": {rows: [dot ms, tile ms]}}}), also kept for
    strata.kernels.kernel_info; None where the tiles cannot run (no AMX, the OS refuses them, no
    native build) or TILES_ENV switches them off."""
    ops = kernels.cpu_ops()
    if (
        ops is None
        or not hasattr(ops, "int8_tiles_available")
        or not ops.int8_tiles_available()
    ):
        return None
    setting = os.environ.get(TILES_ENV, "auto").strip().lower()
    if setting in ("0", "off", "false", "no"):
        ops.set_int8_tile_rows(0, 0)
        kernels.record_int8_tiles({})
        logger.info("AMX int8 tiles: off (%s)", TILES_ENV)
        return None
    if setting.isdigit():  # forced, for measurements: both formats from that many rows
        rows = int(setting)
        ops.set_int8_tile_rows(rows, rows)
        forced: dict[str, object] = {
            fmt: {"rows": rows, "set_by": TILES_ENV} for fmt in ("q4", "q8")
        }
        kernels.record_int8_tiles(forced)
        logger.info(
            "AMX int8 tiles: %s (%s)", kernels.describe_int8_tiles(forced), TILES_ENV
        )
        return forced
    chosen_before = kernels.int8_tiles_choice()
    if chosen_before:  # the process's first model chose (a draft model keeps it)
        return chosen_before
    largest: dict[str, QuantLinear] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            size = module.in_features * module.out_features
            best = largest.get(module.format)
            if best is None or size > best.in_features * best.out_features:
                largest[module.format] = module
    if not largest:
        return None
    saved = ops.int8_tile_rows()
    choice: dict[str, object] = {}
    rows_by_format = {"q4": 0, "q8": 0}
    generator = torch.Generator().manual_seed(0)
    try:
        for fmt, layer in sorted(largest.items()):
            timed: dict[int, list[float]] = {}
            for rows in TILE_TRIAL_ROWS:
                x = torch.randn(rows, layer.in_features, generator=generator).to(dtype)
                pair = []
                for tiles in (False, True):
                    ops.set_int8_tile_rows(
                        *(rows if tiles and f == fmt else 0 for f in ("q4", "q8"))
                    )
                    pair.append(
                        round(
                            median_call_ms(
                                partial(layer.kernel_mm, ops, x), TILE_REPEATS
                            ),
                            4,
                        )
                    )
                timed[rows] = pair
            chosen = fewest_winning_rows(timed, TILE_GAIN)
            rows_by_format[fmt] = chosen
            choice[fmt] = {
                "rows": chosen,
                "layer": [layer.out_features, layer.in_features],
                "timed": timed,
            }
    finally:
        ops.set_int8_tile_rows(*saved)
    ops.set_int8_tile_rows(rows_by_format["q4"], rows_by_format["q8"])
    kernels.record_int8_tiles(choice)
    logger.info(
        "AMX int8 tiles: %s",
        kernels.describe_int8_tiles(choice),
    )
    return choice


def describe_weights(model: nn.Module) -> str:
    """The formats a model's matmul weights are held in, e.g. "q4 x120, q8 x1" or "float x120"."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            name = (
                module.format
                if not isinstance(module, Q8Linear) or module.group == BLOCK
                else "q8/16"
            )
        elif isinstance(module, nn.Linear) or type(module).__name__ in (
            "PackedLinear",
            "DenseLinear",
        ):
            name = "float"
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none"


def quantize_model(
    model: nn.Module, method: str, *, tied_lm_head: bool = True
) -> nn.Module:
    """Replace the decoder layers' nn.Linear modules and the output projection by `QuantLinear`s, in place.

    With tied embeddings and `tied_lm_head`, `model.lm_head` becomes a quantized copy of the embedding
    table (the lookup keeps the float table); without `tied_lm_head` the head stays float (the
    embedding, or the packed copy of it that `strata.layers.packed` made). Linears the loader packed
    (DenseLinear) are quantized from the weights they hold. A linear the method cannot store
    (in_features not a multiple of 32) stays float, with a warning. Returns the model.
    """
    if method not in QUANT_METHODS:
        raise ValueError(
            f"quantization must be one of {tuple(QUANT_METHODS)}, got {method!r}"
        )
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise ValueError(
            f"block quantization runs on the CPU; the model is on {sorted(devices)}. "
            "Use --device cpu or --quantization none."
        )
    cls = QUANT_METHODS[method]
    head = getattr(model, "lm_head", "absent")
    tied_copy = (
        isinstance(head, DenseLinear) and head.tied_embedding
    )  # pack_linears' copy of the embedding
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, DenseLinear))
    ]
    targets = [
        (name, m)
        for name, m in targets
        if name.startswith("layers.") or (name == "lm_head" and not tied_copy)
    ]
    kept: list[str] = []
    for name, linear in targets:
        try:
            if isinstance(
                linear, DenseLinear
            ):  # packed by the loader: quantize the weight it holds
                weight = linear.unpacked()
                quantized = cls.from_weight(
                    weight,
                    None if linear.bias is None else linear.bias.to(weight.dtype),
                )
            else:
                quantized = cls.from_weight(linear.weight, linear.bias)
        except ValueError as e:
            kept.append(f"{name} ({e})")
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(
            model.get_submodule(parent_name) if parent_name else model, attr, quantized
        )
    tied = (head is None or tied_copy) and isinstance(
        getattr(model, "embed_tokens", None), nn.Embedding
    )
    if tied and tied_lm_head:
        try:
            model.lm_head = cls.from_weight(
                cast(nn.Embedding, model.embed_tokens).weight
            )
        except ValueError as e:
            kept.append(f"lm_head (tied embedding: {e})")
    if kept:
        logger.warning(
            "%s: %d linear layers stay unquantized: %s",
            method,
            len(kept),
            "; ".join(kept[:4]),
        )
    reset = getattr(model, "reset_native_decode", None)
    if callable(
        reset
    ):  # a native decode loop built before holds the replaced modules' tensors
        reset()
    return model
