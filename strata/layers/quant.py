"""Weight-only quantization of linear layers for CPU decode: int8 per output channel, int4 per group.

Decode on a CPU is memory-bandwidth bound: every step reads every weight once for a few rows, so
8- or 4-bit weights cut the bytes per step about 2x / 4x against bf16. Activations stay in the
model dtype; only weights are quantized, once, after loading (`quantize_model`).

A `QuantLinear` has three matmuls over the same stored weight:

  * packed     torch's CPU weight-only kernels (`torch._weight_int8pack_mm`,
               `aten._weight_int4pack_mm_for_cpu`): fastest for the few rows of a decode step;
  * dequant    dequantize into the activation dtype, then `F.linear` (oneDNN): faster from
               `packed_max_rows` rows on (prefill, big decode batches), where the matmul is
               compute bound and the weight conversion is amortised over the rows;
  * reference  pure torch in float32 from the unpacked integers: the test oracle for both.

Tied embeddings get a `TiedQuantHead` (a quantized copy of the table for logits of a few rows).
Methods are picked by name from `QUANT_METHODS`. Nothing here knows about requests or the scheduler.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu accepts
INT4_BLOCK_N = 64  # output rows interleaved per block by aten._convert_weight_to_int4pack_for_cpu
# the dequant matmul dequantizes this many weights at a time, so the chunk is still in cache when the
# matmul reads it (a 49152 x 576 lm_head dequantized whole is 3-4x slower than in chunks); weights of
# up to twice this are done whole
DEQUANT_CHUNK_NUMEL = 1 << 20


class QuantLinear(nn.Module, ABC):
    """`y = x @ dequantize().T + bias`, with the weight stored quantized.

    Contract: built once from a float weight by `from_weight` (which may raise ValueError for a
    shape the method cannot store); its buffers never change afterwards. `forward` takes any float
    dtype, `[..., in_features]`, and returns that dtype, `[..., out_features]`; it mutates nothing.
    """

    # Rows up to which the packed kernel is faster than the dequant matmul (`forward`), and than a
    # dense matmul with a float weight already in memory (`TiedQuantHead`). Both kernels' cost grows
    # with rows x weights; dequantizing costs weights once. Measured on one AVX-512 (Zen 4) core.
    packed_max_rows: int = 8
    dense_max_rows: int = 4

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    @abstractmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> QuantLinear:
        """Quantize a float weight [out_features, in_features]; scales are kept in its dtype.
        group_size: input channels per scale, for methods that group (int4)."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight the quantized values stand for, in pure torch: float32 [out_features, in_features]."""

    @abstractmethod
    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] contiguous -> [rows, out_features], with torch's packed CPU kernel."""

    @abstractmethod
    def dequant_mm_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """x: [rows, in_features] -> output columns [start, end): [rows, end - start], by dequantizing
        weight rows [start, end) into x.dtype and a dense matmul. start and end are multiples of 64
        (end may be out_features)."""

    def dequant_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] -> [rows, out_features], dequantizing DEQUANT_CHUNK_NUMEL weights at a time."""
        n, k = self.out_features, self.in_features
        if n * k <= 2 * DEQUANT_CHUNK_NUMEL:
            return self.dequant_mm_rows(x, 0, n)
        step = max(INT4_BLOCK_N, DEQUANT_CHUNK_NUMEL // k // INT4_BLOCK_N * INT4_BLOCK_N)
        return torch.cat([self.dequant_mm_rows(x, i, min(i + step, n)) for i in range(0, n, step)], dim=1)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The oracle: float32 matmul with the dequantized weight, cast back to x.dtype."""
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.dequantize(), bias).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features).contiguous()  # [rows, in_features]
        out = self.packed_mm(x2d) if x2d.shape[0] <= self.packed_max_rows else self.dequant_mm(x2d)
        if self.bias is not None:
            out = out.add_(self.bias.to(out.dtype))
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int8Linear(QuantLinear):
    """Symmetric int8, one scale per output channel: w[n, k] = weight_int8[n, k] * scales[n]."""

    packed_max_rows = 8  # one SmolLM2 layer: 1.12 vs 1.13 ms at 8 rows, 1.87 vs 1.42 at 16
    dense_max_rows = 4  # 49152 x 576: 9.6 vs 11.0 ms (bf16) at 4 rows, 15.3 vs 12.1 at 8

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight_int8.shape[1], weight_int8.shape[0], bias)
        self.register_buffer("weight_int8", weight_int8)  # [out_features, in_features] int8 in [-127, 127]
        self.register_buffer("scales", scales)  # [out_features], the float weight's dtype

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> Int8Linear:
        w = weight.detach().float()
        # round the scale to its storage dtype first, so the integers are chosen for the scale kept
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(weight.dtype)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight_int8, self.scales.to(x.dtype))

    def dequant_mm_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # int8 values are exact in bf16/fp16, so scale the output columns rather than the weight
        out = F.linear(x, self.weight_int8[start:end].to(x.dtype))
        return out.mul_(self.scales[start:end].to(x.dtype))


class Int4Linear(QuantLinear):
    """Asymmetric int4 in groups of `group_size` input channels, in the layout of torch's CPU kernel:

        w[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n],   q in [0, 15]

    (`zero` is the value of q = 8, i.e. the group's min + 8 * scale). Asymmetric because a group's
    weights are rarely centred on 0: min..max spends all 16 levels on the range actually used.
    Groups of 32 by default: on the default model (a Q4_1 GGUF, itself in blocks of 32) perplexity
    rises 3% with groups of 32 and 59% with 64, at the same decode speed.
    """

    packed_max_rows = 64  # one SmolLM2 layer: 5.5 vs 9.8 ms at 64 rows, 14.7 vs 11.8 at 128
    dense_max_rows = 12  # 49152 x 576: 7.9 vs 12.1 ms (bf16) at 8 rows, 15.3 vs 14.1 at 16

    def __init__(self, weight_int4pack: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, bias):
        out_features, in_features = weight_int4pack.shape[0], weight_int4pack.shape[1] * 2
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.register_buffer("weight_int4pack", weight_int4pack)  # [out_features, in_features // 2] uint8
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in_features // g, out_features, 2]

    @staticmethod
    def pick_group_size(in_features: int, group_size: int) -> int:
        """`group_size`, halved until it divides in_features (576 = 4.5 x 128 -> 64); ValueError if none."""
        g = group_size
        while g > INT4_GROUP_SIZES[0] and in_features % g:
            g //= 2
        if g not in INT4_GROUP_SIZES or in_features % g:
            raise ValueError(
                f"int4 needs in_features divisible by a group size in {INT4_GROUP_SIZES} (at most the "
                f"requested {group_size}); {in_features} is not"
            )
        return g

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> Int4Linear:
        out_features, in_features = weight.shape
        if out_features % 16:
            raise ValueError(
                f"int4 needs out_features divisible by 16 (torch's CPU packing); got {out_features}"
            )
        g = cls.pick_group_size(in_features, group_size)
        w = weight.detach().float().view(out_features, in_features // g, g)  # [N, K/g, g]
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, K/g]
        scales = ((hi - lo) / 15).clamp(min=1e-6).to(weight.dtype)
        zeros = (lo + 8 * scales.float()).to(weight.dtype)
        q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp_(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(
            q.view(out_features, in_features).to(torch.int32), 1
        )
        scales_and_zeros = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous()  # [K/g, N, 2]
        return cls(packed, scales_and_zeros, g, bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_t(0, self.out_features).t()

    def dequantize_t(self, start: int, end: int) -> torch.Tensor:
        """Weight rows [start, end) dequantized and transposed: float32 [in_features, end - start].

        Transposed because that is the order the packed bytes unpack into cheaply, and the scales
        are already [in_features // g, out_features]; F.linear takes its `.t()` without a copy.
        Rows [start, end) of the packed tensor are whole 64-row blocks (start % 64 == 0, and end
        % 64 == 0 or end == out_features), so they unpack on their own.
        """
        n, k, g = end - start, self.in_features, self.group_size
        qt = unpack_int4_cpu(self.weight_int4pack[start:end], n, k).float().view(k // g, g, n)
        scales, zeros = self.scales_and_zeros[:, start:end].float().unbind(2)  # 2 x [K/g, n], strided
        offsets = zeros - 8 * scales  # w = q * scale + (zero - 8 * scale): one pass less over the weight
        return qt.mul_(scales.contiguous()[:, None]).add_(offsets[:, None]).view(k, n)

    def dequant_mm_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # dequantize in float32 (bf16 broadcasting ops are ~10x slower on CPU), matmul in x.dtype
        return F.linear(x, self.dequantize_t(start, end).to(x.dtype).t())

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu.default(
            x, self.weight_int4pack, self.group_size, self.scales_and_zeros.to(x.dtype)
        )


def unpack_int4_cpu(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `aten._convert_weight_to_int4pack_for_cpu`, transposed: [N, K/2] uint8 -> qt [K, N] uint8.

    The packed bytes, read flat, hold the full 64-row blocks of q [N, K], then the rest (N % 64 rows):

        block b, input channel k, byte j < 32:  low nibble q[64b + j, k], high nibble q[64b + 32 + j, k]
        rest,    input channel k, byte j:       low nibble q[n0 + 2j, k], high nibble q[n0 + 2j + 1, k]

    with n0 = N // 64 * 64. Unpacking into [K, N] moves 64-byte runs; [N, K] would need a byte
    transpose. A layout change in torch breaks the round-trip test, not this silently.
    """
    n, k = out_features, in_features
    n0 = n // INT4_BLOCK_N * INT4_BLOCK_N
    flat = packed.reshape(-1)
    head = flat[: n0 * k // 2].view(n // INT4_BLOCK_N, k, INT4_BLOCK_N // 2)  # [blocks, K, 32]
    head = torch.stack([head & 15, head >> 4], dim=2)  # [blocks, K, 2 (lo, hi), 32]
    head = head.permute(1, 0, 2, 3).reshape(k, n0)
    if n0 == n:
        return head
    rest = flat[n0 * k // 2 :].view(k, (n - n0) // 2)  # [K, (N - n0) / 2]
    rest = torch.stack([rest & 15, rest >> 4], dim=2).reshape(k, n - n0)
    return torch.cat([head, rest], dim=1)


class TiedQuantHead(nn.Module):
    """Logits for tied embeddings: a quantized copy of the table for up to `dense_max_rows` rows
    (decode of a few sequences), the float table itself above that, where a dense matmul beats the
    packed kernel. The float table is the embedding's own tensor, not a copy."""

    def __init__(self, quantized: QuantLinear, embedding_weight: torch.Tensor):
        super().__init__()
        self.quantized = quantized
        self.embedding_weight = embedding_weight.detach()  # [vocab, hidden], shared; not a parameter here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.quantized.in_features).contiguous()  # [rows, hidden]
        if x2d.shape[0] <= self.quantized.dense_max_rows:
            out = self.quantized.packed_mm(x2d)
        else:
            out = F.linear(x2d, self.embedding_weight.to(x2d.dtype))
        return out.view(*x.shape[:-1], self.quantized.out_features)


QUANT_METHODS: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_model(
    model: nn.Module, method: str, group_size: int = 32, *, tied_lm_head: bool = True
) -> nn.Module:
    """Replace the decoder layers' nn.Linear modules and the output projection by `QuantLinear`s, in place.

    With tied embeddings and `tied_lm_head`, `model.lm_head` becomes a `TiedQuantHead`: a quantized
    copy of the embedding table for small batches (the embedding lookup keeps the float table).
    The model's `compute_logits` must call `self.lm_head(hidden)` when lm_head is set.
    A linear the method cannot store (e.g. int4 with out_features % 16) stays float, with a warning.
    Returns the model.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {tuple(QUANT_METHODS)}, got {method!r}")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"weight-only quantization uses torch's CPU kernels; the model is on {sorted(devices)}. "
            "Use --device cpu or drop --quantization."
        )
    cls = QUANT_METHODS[method]
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    targets = [(name, m) for name, m in targets if name.startswith("layers.") or name == "lm_head"]
    kept: list[str] = []
    for name, linear in targets:
        try:
            quantized = cls.from_weight(linear.weight, linear.bias, group_size)
        except ValueError as e:
            kept.append(f"{name} ({e})")
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, quantized)
    tied = getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens")
    if tied and tied_lm_head:
        try:
            quantized = cls.from_weight(model.embed_tokens.weight, None, group_size)
            model.lm_head = TiedQuantHead(quantized, model.embed_tokens.weight)
        except ValueError as e:
            kept.append(f"lm_head (tied embedding: {e})")
    if kept:
        logger.warning("%s: %d linear layers stay unquantized: %s", method, len(kept), "; ".join(kept[:4]))
    return model
