"""Rotary position embeddings with the scaling variants HF configs use (default, linear, llama3, yarn,
longrope)."""

from __future__ import annotations

import math

import torch

from strata.kernels import token_rows, usable
from strata.model_config import RopeConfig


def inv_freq_and_scale(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rot_dim // 2], attention_scaling applied to cos/sin)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    base = rope.theta
    inv_freq = 1.0 / (
        base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        # dynamic NTK only changes frequencies past the original length; within it, it is the default.
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    if kind == "longrope":
        return _longrope(rope, dim, rope.short_factor), _longrope_scale(rope)
    supported = "default, linear, llama3, yarn, dynamic, longrope"
    raise ValueError(f"unsupported rope_type {kind!r}; supported: {supported}")


def _longrope(
    rope: RopeConfig, dim: int, factors: tuple[float, ...] | None
) -> torch.Tensor:
    if factors is None or len(factors) != dim // 2:
        raise ValueError(
            f"longrope needs {dim // 2} short and long factors, got {len(factors or ())}"
        )
    base = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)


def _longrope_scale(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    assert rope.original_max_position_embeddings is not None  # longrope sets it
    return math.sqrt(
        1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings)
    )


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(
    rope: RopeConfig, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    old_len = rope.original_max_position_embeddings or max_position_embeddings

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = rope.yarn_mscale(rope.mscale) / rope.yarn_mscale(
                rope.mscale_all_dim
            )
        else:
            attention_factor = rope.yarn_mscale()

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = (
        1 - ramp
    )  # 1 where the dimension rotates fast enough to keep its original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding:
    """Precomputed float32 cos/sin tables indexed by absolute position (HF "rotate_half" layout).

    longrope: positions below `original_max_position_embeddings` rotate with the short factors, the
    rest with the long ones. transformers picks one set for a whole forward call by its longest
    position, so the two agree when a prompt fits the original length (decode steps past it use the
    long set in both), and differ for a single prefill longer than it, whose early keys we keep on
    the short set (what a KV cache computed token by token would hold).
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        max_position_embeddings: int,
        device: torch.device | str = "cpu",
    ):
        cpu = torch.device(
            "cpu"
        )  # explicit: construction may run under a meta default device
        with torch.device(cpu):
            inv_freq, scale = inv_freq_and_scale(
                rope, head_dim, max_position_embeddings
            )
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [max_positions, rot_dim // 2]
            if rope.rope_type == "longrope":
                old_len = rope.original_max_position_embeddings
                assert old_len is not None  # longrope sets it
                long_freqs = torch.outer(
                    positions, _longrope(rope, 2 * inv_freq.numel(), rope.long_factor)
                )
                freqs = torch.where(
                    (positions >= old_len).unsqueeze(1), long_freqs, freqs
                )
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = (emb.cos() * scale).to(device)
            self.sin = (emb.sin() * scale).to(device)
        self.rot_dim = emb.shape[-1]

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim].

        With the native kernels q and k are rotated in place (they are fresh projections) and
        returned; otherwise new tensors are returned."""
        ops = usable(q)
        if (
            ops
            and token_rows(q)
            and token_rows(k)
            and positions.dtype == torch.int64
            and positions.is_contiguous()
        ):
            ops.rotary_embedding(q, k, self.cos, self.sin, positions)
            return q, k
        return self.reference(positions, q, k)

    def reference(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _apply(q, cos, sin, self.rot_dim), _apply(k, cos, sin, self.rot_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int
) -> torch.Tensor:
    if rot_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
