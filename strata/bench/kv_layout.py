"""`strata bench kv-layout`: the KV cache bytes one token takes in a model's pool, from its
config.json alone (no weights are read, nothing is downloaded), and, for a multi-head latent
attention model (DeepSeek-V2/V3), what per-head K/V of the same attention would take:

    MHA pool (MHAKVPool)         layers x 2 (K, V) x kv_heads x head_dim            x dtype bytes
    latent pool (LatentKVPool)   layers x (kv_lora_rank + qk_rope_head_dim)          x dtype bytes
    per-head K/V of MLA          layers x heads x (qk_nope + qk_rope + v_head_dim)   x dtype bytes

Every layer counts a token in full (sliding-window layers keep only their window of it, which the
engine's pool sizing accounts for; the layout column says how many such layers there are). The
"at context" columns divide what one request of that many tokens holds by its length: there a
sliding-window layer counts only its window, and DeepSeek-V4 (`strata.cache.dsv4_pool`) its
compressed entries (CSA: head_dim + index_head_dim per m tokens, HCA: head_dim per m' tokens, at the
page size's rows) plus its windows (sliding K, the compressors' last 2m / m' tokens of inputs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.cache.dsv4_pool import bytes_per_token as dsv4_bytes_per_token
from strata.cache.dsv4_pool import context_bytes as dsv4_context_bytes
from strata.cache.kv_plan import kv_layer_bytes_per_token
from strata.model_config import ModelConfig
from strata.models import config_from_dir, config_from_hf

CONTEXT_LENS = (8192, 65536)


@dataclass(frozen=True)
class KVLayout:
    model: str  # the directory's name
    architecture: str
    num_layers: int
    kv_dtype: str
    layout: str  # what the pool keeps per layer and token
    bytes_per_token: int  # over every layer
    per_head_layout: str | None = None  # MLA models: per-head K/V of the same heads
    per_head_bytes_per_token: int | None = None
    at_context: dict[int, float] | None = (
        None  # context length -> bytes per token one request holds
    )

    @property
    def per_head_over_pool(self) -> float | None:
        return (
            self.per_head_bytes_per_token / self.bytes_per_token
            if self.per_head_bytes_per_token
            else None
        )


def bytes_at_context(
    mc: ModelConfig, kv_dtype: torch.dtype, context_len: int, page_size: int
) -> float:
    """Bytes per token of one request of context_len tokens (see the module docstring)."""
    if mc.dsv4 is not None:
        return (
            dsv4_context_bytes(
                mc.dsv4, mc.head_dim, context_len, page_size, kv_dtype.itemsize
            )
            / context_len
        )
    layer = kv_layer_bytes_per_token(mc, kv_dtype)
    held = sum(
        context_len if spec.window is None or mc.mla else min(context_len, spec.window)
        for spec in mc.layers
    )
    return layer * held / context_len


def read_config(model: str | Path) -> tuple[str, ModelConfig]:
    """(name, config) of a model directory holding config.json, or of a config.json file itself."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.name, config_from_dir(path)
    if path.suffix != ".json" or not path.is_file():
        raise ValueError(
            f"{model}: expected a model directory holding config.json, or a config.json file"
        )
    return path.parent.name, config_from_hf(json.loads(path.read_text()))


def kv_layout(
    model: str | Path,
    kv_dtype: torch.dtype = torch.bfloat16,
    context_lens: tuple[int, ...] = CONTEXT_LENS,
    page_size: int = 16,
) -> KVLayout:
    name, mc = read_config(model)
    layers = mc.num_layers
    bytes_per_token = layers * kv_layer_bytes_per_token(mc, kv_dtype)
    dtype = str(kv_dtype).removeprefix("torch.")
    at_context = {c: bytes_at_context(mc, kv_dtype, c, page_size) for c in context_lens}
    if mc.dsv4 is not None:
        v4 = mc.dsv4
        entries, _ = dsv4_bytes_per_token(v4, mc.head_dim, page_size, kv_dtype.itemsize)
        kinds = {k: v4.layer_kinds.count(k) for k in ("sliding", "csa", "hca")}
        layout = (
            f"V4: K=V {mc.head_dim} in window {v4.sliding_window}; CSA x{kinds['csa']} "
            f"({mc.head_dim}+{v4.index_head_dim})/{v4.csa_rate}; HCA x{kinds['hca']} {mc.head_dim}/{v4.hca_rate}"
        )
        return KVLayout(
            name,
            mc.architecture,
            layers,
            dtype,
            layout,
            round(entries),
            at_context=at_context,
        )
    mla = mc.mla
    if mla is None:
        windowed = sum(spec.window is not None for spec in mc.layers)
        layout = f"K+V: 2 x {mc.num_kv_heads} KV heads x {mc.head_dim}"
        if windowed:
            layout += f" ({windowed} sliding-window layers)"
        return KVLayout(
            name,
            mc.architecture,
            layers,
            dtype,
            layout,
            bytes_per_token,
            at_context=at_context,
        )
    per_head = mc.num_heads * (
        mla.qk_head_dim + mla.v_head_dim
    )  # values per layer and token
    return KVLayout(
        name,
        mc.architecture,
        layers,
        dtype,
        layout=f"latent {mla.kv_lora_rank} + rope {mla.qk_rope_head_dim} = {mla.latent_dim}",
        bytes_per_token=bytes_per_token,
        per_head_layout=(
            f"{mc.num_heads} heads x (K {mla.qk_nope_head_dim}+{mla.qk_rope_head_dim} + V {mla.v_head_dim})"
            f" = {per_head:,}"
        ),
        per_head_bytes_per_token=layers * per_head * kv_dtype.itemsize,
        at_context=at_context,
    )


def format_text(rows: list[KVLayout]) -> str:
    from strata.bench.report import fmt, table

    def count(n: int | None) -> str:
        return f"{n:,}" if n else "n/a"

    contexts = sorted({c for r in rows for c in (r.at_context or {})})
    body = [
        [
            r.model,
            str(r.num_layers),
            r.layout,
            count(r.bytes_per_token),
            r.per_head_layout or "n/a",
            count(r.per_head_bytes_per_token),
            f"{fmt(r.per_head_over_pool, 1)}x" if r.per_head_over_pool else "n/a",
            *[
                count(round(r.at_context[c]))
                if r.at_context and c in r.at_context
                else "n/a"
                for c in contexts
            ],
        ]
        for r in rows
    ]
    header = [
        "model",
        "layers",
        "pool: values per layer",
        "pool bytes/token",
        "per-head K/V: values per layer",
        "per-head K/V bytes/token",
        "per-head / pool",
        *[f"bytes/token at {c // 1024}k" for c in contexts],
    ]
    dtypes = ", ".join(sorted({r.kv_dtype for r in rows}))
    return (
        f"KV cache bytes per token ({dtypes}; every layer), from config.json:\n"
        + table(body, header)
    )
