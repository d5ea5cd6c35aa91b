"""The Engram part of a DeepSeek-V4.1-style config (`EngramConfig`), read from config.json by
`engram_from_hf`: conditional memory looked up by hashed n-grams of token ids at a few layers
(`strata.layers.engram`). A config.json without `engram_layers` has none. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_ID = (
    2**31 - 1
)  # compressed ids times 31-bit multipliers stay below 2**62: exact in int64


@dataclass(frozen=True)
class EngramConfig:
    layers: tuple[
        int, ...
    ]  # layer indices whose residual gets the memory before attention
    orders: tuple[int, ...]  # n-gram orders, e.g. (2, 3)
    heads: int  # hash heads per order: each order x head is one table
    table_size: int  # rows per table
    dim: int  # values per row; the memory vector e_t is num_tables x dim wide
    hash_seed: int
    # `engram_vocab_map`: token id -> compressed id (a [vocab] table in the checkpoint), ids below
    # this size; None: token ids are used as they are
    vocab_map_size: int | None
    pad_id: int  # the compressed id of positions before a sequence's first token
    # the short causal convolution over each stream's gated memory value (`engram_conv_kernel`;
    # 0: none): depthwise, `conv_kernel` taps `conv_dilation` positions apart
    conv_kernel: int = 0
    conv_dilation: int = 1
    # values one position keeps per Engram layer for it: hc_mult x hidden
    state_width: int = 0
    # split over ranks (strata.distributed.sharding): this rank's rows [start, end) of every table;
    # None: all of them
    shard_rows: tuple[int, int] | None = None

    @property
    def num_tables(self) -> int:
        return len(self.orders) * self.heads

    @property
    def context_len(self) -> int:
        """Tokens before a position that its n-grams read."""
        return max(self.orders) - 1

    @property
    def rows_here(self) -> tuple[int, int]:
        """[start, end) of each table's rows this process holds."""
        return self.shard_rows or (0, self.table_size)

    @property
    def conv_span(self) -> int:
        """Positions the convolution reads for one output, its own included (0: no convolution)."""
        return (
            (self.conv_kernel - 1) * self.conv_dilation + 1 if self.conv_kernel else 0
        )


def engram_from_hf(text: dict[str, Any], num_layers: int) -> EngramConfig | None:
    """The `engram_*` keys of a config.json; None where `engram_layers` is absent or empty."""
    layers = text.get("engram_layers")
    if not layers:
        return None
    orders = tuple(int(n) for n in text.get("engram_orders") or (2, 3))
    vocab_map = text.get("engram_vocab_map")
    ids = int(vocab_map) if vocab_map is not None else int(text["vocab_size"])
    kernel = int(text.get("engram_conv_kernel") or 0)
    dilation = text.get("engram_conv_dilation")
    cfg = EngramConfig(
        layers=tuple(sorted(int(i) for i in layers)),
        orders=orders,
        heads=int(text.get("engram_heads", 4)),
        table_size=int(text["engram_table_size"]),
        dim=int(text["engram_dim"]),
        hash_seed=int(text.get("engram_hash_seed", 0)),
        vocab_map_size=int(vocab_map) if vocab_map is not None else None,
        pad_id=ids,
        conv_kernel=kernel,
        conv_dilation=int(dilation) if dilation is not None else max(orders),
        state_width=int(text["hc_mult"]) * int(text["hidden_size"]) if kernel else 0,
    )
    if any(not 0 <= i < num_layers for i in cfg.layers) or len(set(cfg.layers)) != len(
        cfg.layers
    ):
        raise ValueError(
            f"engram_layers must be distinct layer indices below {num_layers}; got {layers}"
        )
    if any(n < 1 for n in orders) or cfg.heads < 1:
        raise ValueError(
            f"engram_orders must be >= 1 and engram_heads >= 1; got {list(orders)}, {cfg.heads}"
        )
    if cfg.table_size < 1 or cfg.dim < 1:
        raise ValueError(
            "engram_table_size and engram_dim must be positive; got "
            f"{cfg.table_size}, {cfg.dim}"
        )
    if kernel < 0 or (kernel and cfg.conv_dilation < 1):
        raise ValueError(
            "engram_conv_kernel must be >= 0 (0: no convolution) and engram_conv_dilation >= 1; "
            f"got {kernel}, {cfg.conv_dilation}"
        )
    if ids + 1 > MAX_ID:
        raise ValueError(
            f"Engram ids must stay below {MAX_ID}; the (compressed) vocabulary has {ids}"
        )
    return cfg
