"""Float linear layers with weights prepacked at load time (CPU).

`DenseLinear` holds a bf16 or float32 weight packed 16 output rows side by side for the native
kernel (`dense_linear`, strata/kernels/dense_ops.cpp). Each output row's bits depend on its input row
alone, never on how many rows share the call, which BLAS does not promise (oneDNN and MKL pick
blocking and K splits by the matrix sizes): so a speculative verification's rows equal one-at-a-time
decoding over float weights too, as they do over block-quantized ones. It is also the faster
kernel here, most of all for the few-row matmuls of decode steps (docs/BENCHMARKS.md).

Where the native kernels cannot be built (no compiler, an unknown CPU), bf16 linears fall back to
oneDNN-prepacked weights (`PackedLinear`): `F.linear` on bf16 CPU tensors reorders the weight into
oneDNN's blocked layout on every call, and packing it once makes every projection faster. Neither
promises the invariance above; the engine warns when speculation runs over them.

`pack_linears` swaps each float `nn.Linear` of a loaded CPU model (and the tied output head) for
whichever applies, after checking on a random input that it matches F.linear; on any failure the
model is left as it was. With the native kernels it also packs the float matmuls outside linear
layers (each module's `pack`, run by the grouped entry `dense_grouped_linear`): MoE routers and
expert stacks (strata.layers.moe), MLA's absorbed up-projections (strata.layers.mla) and
DeepSeek-V4's grouped output projection (strata.layers.dsv4_attention). Off with the other CPU
fast paths under STRATA_CPU_KERNELS=0; STRATA_DENSE_KERNEL=0 turns off the dense kernel alone
(oneDNN packing or BLAS then), for A/B runs.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from strata import kernels
from strata.kernels import enabled_by_env

logger = logging.getLogger(__name__)

GROUP = 16  # output rows side by side in DenseLinear's packed weight
DENSE_ENV_VAR = "STRATA_DENSE_KERNEL"


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [G, K/2, 16, 2] (channel pairs of 16 rows); float32 -> [G, K, 16]. G = ceil(N / 16),
    the last group's missing rows zero."""
    n, k = weight.shape
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    if weight.dtype == torch.bfloat16:
        return padded.view(groups, GROUP, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(groups, GROUP, k).permute(0, 2, 1).contiguous()


def unpack_dense(wp: torch.Tensor, n: int) -> torch.Tensor:
    """pack_dense's inverse: the [N, K] weight."""
    if wp.dim() == 4:
        return wp.permute(0, 2, 1, 3).reshape(wp.shape[0] * GROUP, -1)[:n]
    return wp.permute(0, 2, 1).reshape(wp.shape[0] * GROUP, -1)[:n]


class DenseLinear(nn.Module):
    """y = x @ W^T + b over a packed bf16/float32 weight, by the native kernel of the build `target`
    (the one loaded when the model was: a model keeps its kernels, as the quantized layers do)."""

    wp: torch.Tensor  # buffers
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: str,
        tied_embedding: bool = False,
    ):
        super().__init__()
        self.tied_embedding = (
            tied_embedding  # a copy of the embedding table serving as the output head
        )
        if weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
            raise ValueError(
                f"DenseLinear takes a 2-D bf16 or float32 weight, got {weight.dtype} {tuple(weight.shape)}"
            )
        if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
            raise ValueError(
                f"a bf16 DenseLinear needs an even number of inputs, got {weight.shape[1]}"
            )
        self.out_features, self.in_features = weight.shape
        self.target = target
        self.register_buffer("wp", pack_dense(weight), persistent=False)
        self.register_buffer(
            "bias",
            None if bias is None else bias.detach().float().contiguous(),
            persistent=False,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.wp.dtype

    def unpacked(self) -> torch.Tensor:
        return unpack_dense(self.wp, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        ops = kernels.load(self.target) if x.is_cpu and self.wp.is_cpu else None
        if ops is None:  # moved off the CPU after packing
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.unpacked().to(x.dtype), bias)
        out = ops.dense_linear(
            rows.to(self.dtype).contiguous(), self.wp, self.bias, self.out_features
        )
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{str(self.dtype).removeprefix('torch.')}, kernels {self.target}"
        )


class NativePackable:
    """A module with float matmuls outside nn.Linear that the native dense kernel can take over:
    `pack_sources()` lists the [..., N, K] weights `pack(target)` packs (pack_linears checks that the
    kernel takes them), and `packed_target` is the kernel build they run on once packed (None before)."""

    packed_target: str | None = None

    @property
    def native_kernel(self) -> bool:
        return self.packed_target is not None

    def pack_sources(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def pack(self, target: str) -> None:
        raise NotImplementedError


def pack_groups(weights: torch.Tensor) -> torch.Tensor:
    """[g, N, K] -> [g, *pack_dense's layout]: one packed weight per group (or expert, or head)."""
    return torch.stack([pack_dense(w) for w in weights])


def grouped_dense(
    x: torch.Tensor, packed: torch.Tensor, n: int, target: str
) -> torch.Tensor:
    """x [T, g, K] -> [T, g, n]: slice i of every token through packed weight i of `packed` (pack_groups),
    each row's bits independent of T, as dense_linear's are."""
    tokens, groups, k = x.shape
    rows = x.transpose(0, 1).reshape(groups * tokens, k)
    ends = torch.arange(1, groups + 1, dtype=torch.int64) * tokens
    out = kernels.loaded(target).dense_grouped_linear(
        rows.contiguous(), packed, ends, None, n
    )
    return out.view(groups, tokens, n).transpose(0, 1)


def float_weight(module: nn.Module) -> torch.Tensor:
    """The [N, K] weight of a float linear, packed (DenseLinear) or not (nn.Linear)."""
    if isinstance(module, DenseLinear):
        return module.unpacked()
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


# Modules whose float matmuls run on BLAS (besides nn.Linear): oneDNN-packed linears; MoE routers and
# expert stacks, MLA's absorbed up-projections and DeepSeek-V4's grouped output projection unless
# packed for the native kernels (`native_kernel`); expert-parallel experts; DeepSeek-V4's MoE,
# hyper-connections and compressed attention.
BLAS_MATMUL_MODULES = frozenset(
    {
        "PackedLinear",
        "Router",
        "Experts",
        "EPExperts",
        "KVUpProjection",
        "GroupedLinear",
        "DSV4MoE",
        "HyperConnection",
        "HyperHead",
        "DSV4Attention",
    }
)


def blas_matmuls(model: torch.nn.Module) -> list[str]:
    """The kinds of the model's modules that multiply float weights through BLAS rather than the native
    kernels (block-quantized, or DenseLinear's packed bf16/float32), which compute a row the same in
    any call; block linears count where --matmul fast sends their large calls to oneDNN."""
    return sorted(
        {
            type(m).__name__
            for m in model.modules()
            if type(m) is torch.nn.Linear
            or (
                type(m).__name__ in BLAS_MATMUL_MODULES
                and not getattr(m, "native_kernel", False)
            )
            or getattr(m, "fast_rows", 0)
            > 0  # --matmul fast: block linears' large calls
        }
    )


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


class PackedLinear(nn.Module):
    """A bf16 linear with its weight prepacked for oneDNN: the fallback where the native kernels are
    unavailable."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = onednn_pack(
            weight
        )  # an opaque oneDNN tensor: a plain attribute, not a parameter
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = onednn_linear(
            x.reshape(-1, self.in_features).contiguous(), self.packed, self.bias
        )
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn_packed"


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02)


def dense_target() -> str | None:
    """The native build DenseLinear would run here, if it runs and matches F.linear (bf16 and float32);
    None also under DENSE_ENV_VAR=0 (oneDNN packing or BLAS then, for A/B comparisons)."""
    if os.environ.get(DENSE_ENV_VAR, "1").strip().lower() in (
        "0",
        "false",
        "no",
        "off",
    ):
        return None
    if (
        not enabled_by_env()
        or kernels.cpu_ops() is None
        or not hasattr(kernels.cpu_ops(), "dense_linear")
    ):
        return None
    target = kernels.selected_target()
    assert target is not None  # the CPU kernels loaded
    try:
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(40, 32, generator=gen).to(dtype)
            b = torch.randn(40, generator=gen).to(dtype)
            x = torch.randn(5, 32, generator=gen).to(dtype)
            if not _close(DenseLinear(w, b, target)(x), F.linear(x, w, b)):
                logger.warning(
                    "the native dense kernel disagrees with F.linear (%s); not using it",
                    dtype,
                )
                return None
    except Exception as exc:  # noqa: BLE001 - a build without the kernel, ...
        logger.info("native dense linears unavailable (%s)", exc)
        return None
    return target


def packing_works() -> bool:
    """True if oneDNN's packed bf16 linear runs here and matches F.linear."""
    if not enabled_by_env() or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
        b = torch.randn(48, generator=gen).to(torch.bfloat16)
        x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
        return _close(onednn_linear(x, onednn_pack(w), b), F.linear(x, w, b))
    except Exception as exc:  # noqa: BLE001 - an op missing from this torch build, an unsupported CPU, ...
        logger.info("oneDNN weight packing unavailable (%s)", exc)
        return False


def _fits(weight: torch.Tensor) -> bool:
    """Whether the dense kernel takes this weight ([..., N, K]): float32, or bf16 with an even K."""
    return weight.is_cpu and (
        weight.dtype == torch.float32
        or (weight.dtype == torch.bfloat16 and weight.shape[-1] % 2 == 0)
    )


def pack_linears(model: nn.Module) -> int:
    """Replace the model's float CPU nn.Linear modules (and a tied output head) by DenseLinear (bf16 and
    float32, the native kernels), or by oneDNN's PackedLinear (bf16 only) where those are unavailable;
    with the native kernels, MoE routers and expert stacks, MLA's absorbed up-projections and
    DeepSeek-V4's grouped projections are packed for them too. Returns how many modules were replaced
    or packed."""
    targets: list[tuple[nn.Module, str, nn.Linear | nn.Embedding]] = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    embed = getattr(model, "embed_tokens", None)
    if (
        getattr(model, "lm_head", "absent") is None
        and isinstance(embed, nn.Embedding)
        and embed.weight.is_cpu
    ):
        targets.append(
            (model, "lm_head", embed)
        )  # tied: a packed copy of the embedding matrix, no bias
    grouped = [
        m
        for m in model.modules()
        if isinstance(m, NativePackable) and not m.native_kernel
    ]
    if not targets and not grouped:
        return 0
    target = dense_target()
    onednn = target is None and packing_works()
    count = 0
    for parent, name, child in targets:
        weight, bias = child.weight, getattr(child, "bias", None)
        if target is not None and _fits(weight):
            setattr(
                parent,
                name,
                DenseLinear(weight, bias, target, tied_embedding=child is embed),
            )
        elif onednn and weight.dtype == torch.bfloat16:
            setattr(parent, name, PackedLinear(weight, bias))
        else:
            continue
        count += 1
    if target is not None:
        for module in grouped:
            if all(_fits(w) for w in module.pack_sources()):
                module.pack(target)
                count += 1
    return count
