"""Engram, DeepSeek-V4.1's conditional memory: rows of large tables looked up by hashed n-grams of
the token ids, gated by the hidden state and added to the residual streams before a layer's
attention (config: `strata.engram_config.EngramConfig`).

For position t of a sequence, at layer l (K = max order - 1):

    c[t - i] = vocab_map[id at t - i], or pad_id where t - i < 0                  i = 0 .. K
    table k = (order n, head j), k = order index * heads + j:
        idx_k = (c[t] * a_{l,n,j,0}  XOR  c[t-1] * a_{l,n,j,1}  XOR ...  c[t-n+1] * a_{l,n,j,n-1})
                mod table_size                         exact int64: ids < 2**31, multipliers odd < 2**31
    e = concat_k table_k[idx_k]                                                  # [num_tables * dim]
    key, value = key_proj(e), value_proj(e)                                      # [hidden] each
    per mHC stream s: gate_s = sigmoid(<RMSNorm(h_s), RMSNorm(key)> / sqrt(hidden));  v_s = gate_s * value

and h_s += v_s, or, with a short convolution (`conv_kernel` K taps `conv_dilation` d apart, as in
the public demo):

    x_s[t] = RMSNorm_s(v_s[t])                                      # a norm per stream
    h_s += v_s + SiLU(sum_i w[s, :, i] * x_s[t - (K - 1 - i) d])     # depthwise, causal; x = 0 before 0

x depends on the hidden state, so a request keeps the last (K - 1) d + 1 positions' x in a window
group of its paged state (`DSV4KVPool.conv`): chunks, prefix hits, PD and the tiers carry it as they
carry the compressors' windows.

The multipliers a come from `engram_multipliers` (splitmix64 of the seed, layer, order and head).
The indices depend on token ids only, so a step's rows are known when its batch is prepared:
`prepare` hashes every Engram layer's indices then, and tables kept outside the model
(`strata.layers.engram_tables`) start gathering the rows on a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from strata.cache.dsv4_pool import DSV4KVPool
from strata.engram_config import EngramConfig
from strata.layers.attention import AttentionMetadata
from strata.layers.dsv4_attention import RMSNorm32
from strata.layers.engram_tables import table_rows

_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """(next state, output) of splitmix64 over Python ints."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def engram_multipliers(seed: int, layer: int, order: int, head: int) -> list[int]:
    """The `order` odd 31-bit multipliers of one table: a_{layer,order,head,i}, i = tokens back."""
    state = ((seed & 0xFFFFFFFF) << 32) ^ (layer << 16) ^ (order << 8) ^ head
    out = []
    for _ in range(order):
        state, z = _splitmix64(state)
        out.append((z >> 33) | 1)
    return out


def multiplier_table(cfg: EngramConfig, layer: int) -> torch.Tensor:
    """[num_tables, K + 1] int64 on the CPU: column i multiplies the id i tokens back (0 past the
    table's order, so those ids drop out of its XOR)."""
    table = torch.zeros(
        cfg.num_tables, cfg.context_len + 1, dtype=torch.int64, device="cpu"
    )
    for o, n in enumerate(cfg.orders):
        for j in range(cfg.heads):
            table[o * cfg.heads + j, :n] = torch.tensor(
                engram_multipliers(cfg.hash_seed, layer, n, j), device="cpu"
            )
    return table


def hash_ngrams(
    compressed: torch.Tensor, multipliers: torch.Tensor, table_size: int
) -> torch.Tensor:
    """compressed: [T, K + 1] ids, oldest first (column K is the position's own token);
    multipliers: [num_tables, K + 1] by tokens back. Returns each table's row: [T, num_tables]."""
    back = compressed.flip(-1)  # column i: the id i tokens back
    mix = back[:, None, 0] * multipliers[None, :, 0]
    for i in range(1, back.shape[1]):
        mix = torch.bitwise_xor(mix, back[:, None, i] * multipliers[None, :, i])
    return (
        mix % table_size
    )  # [T, num_tables], non-negative: every product is below 2**62


@dataclass
class EngramInputs:
    """One step's Engram inputs, built when the batch is prepared: every Engram layer's table rows
    ([T, num_tables] indices), and, where the tables live outside the model, the gathered rows
    ([T, num_tables, dim]) being fetched ahead."""

    indices: dict[int, torch.Tensor]  # layer -> [T, num_tables] int64
    fetched: dict[int, Future] = field(
        default_factory=dict
    )  # layer -> rows being gathered
    ids: torch.Tensor | None = (
        None  # the [T, K + 1] token ids they were hashed from (CPU)
    )

    def rows(self, layer: int, device: torch.device) -> torch.Tensor | None:
        """The gathered rows of `layer` ([T, num_tables, dim] on `device`); None where the tables are
        the model's own."""
        future = self.fetched.get(layer)
        if future is None:
            return None
        return future.result().to(device, non_blocking=True)


class _Taps(nn.Module):
    """The convolution's weight, where nn.Conv1d keeps it (`conv.weight`)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class ShortConv(nn.Module):
    """Engram's causal depthwise convolution over each stream's gated value: a norm per stream
    (`norms`), `conv.weight` [hc_mult x hidden, 1, K] (nn.Conv1d's layout), SiLU."""

    def __init__(self, cfg: EngramConfig, hidden: int, eps: float):
        super().__init__()
        streams = cfg.state_width // hidden
        self.kernel, self.dilation = cfg.conv_kernel, cfg.conv_dilation
        self.norms = nn.ModuleList(RMSNorm32(hidden, eps) for _ in range(streams))
        self.conv = _Taps(cfg.state_width, cfg.conv_kernel)

    def forward(
        self,
        value: torch.Tensor,
        positions: torch.Tensor,
        state: torch.Tensor,
        group: AttentionMetadata,
    ) -> torch.Tensor:
        """value [T, hc_mult, H] (gated) -> the convolution's output, same shape. Writes the step's
        normalised values into `state` (the pool's conv rows of this layer, in the pages of the
        step's metadata `group`) first, then reads each position's taps from it."""
        T, S, H = value.shape
        x = torch.stack([norm(value[:, s]) for s, norm in enumerate(self.norms)], 1)
        state[group.out_slots] = x.reshape(T, S * H).to(state.dtype)
        back = (
            torch.arange(self.kernel - 1, -1, -1) * self.dilation
        )  # tap i reads (K-1-i) d back
        pos = positions.cpu().view(-1, 1) - back  # [T, K]
        slots = group.slots_at(group.token_owner, pos.clamp(min=0)).to(state.device)
        real = (pos >= 0).to(state.device, torch.float32)  # x is 0 before position 0
        w = self.conv.weight.float()[:, 0, :]  # [S * H, K]
        y = torch.zeros(T, S * H, dtype=torch.float32, device=state.device)
        for i in range(
            self.kernel
        ):  # one tap at a time: [T, S * H] live, not [T, K, S * H]
            y += state[slots[:, i]].float() * real[:, i : i + 1] * w[:, i]
        return torch.nn.functional.silu(y).view(T, S, H).to(value.dtype)


class Engram(nn.Module):
    """One layer's Engram: its tables (`embedding`, [num_tables, table_size, dim], or None when they
    live outside the model), the key/value projections of the memory vector, the gate's norms and,
    where the config has one, the short convolution."""

    def __init__(self, cfg: EngramConfig, layer_id: int, hidden: int, eps: float):
        super().__init__()
        self.layer_id = layer_id
        width = cfg.num_tables * cfg.dim
        # split over ranks: the first of the rows [start, end) of each table held here; None: all
        self.row_start = cfg.shard_rows[0] if cfg.shard_rows else None
        start, end = cfg.rows_here
        self.embedding: nn.Parameter | None = nn.Parameter(
            torch.empty(cfg.num_tables, end - start, cfg.dim)
        )
        # split over ranks: sums the ranks' rows (each holds its own, zeros elsewhere)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.key_proj = nn.Linear(width, hidden, bias=False)
        self.value_proj = nn.Linear(width, hidden, bias=False)
        self.hidden_norm = RMSNorm32(hidden, eps)
        self.key_norm = RMSNorm32(hidden, eps)
        self.scale = hidden**-0.5
        # a plain tensor, not a buffer: it survives the meta device and dtype casts
        self.multipliers = multiplier_table(cfg, layer_id)
        self.short_conv = ShortConv(cfg, hidden, eps) if cfg.conv_kernel else None

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """[T, num_tables] -> [T, num_tables, dim] from the model's own tables (zeros for rows
        another rank holds)."""
        assert self.embedding is not None
        return table_rows(self.embedding, indices, self.row_start)

    def forward(
        self,
        streams: torch.Tensor,
        inputs: EngramInputs,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: DSV4KVPool,
    ) -> torch.Tensor:
        """streams [T, hc_mult, H] -> the streams plus each one's gated memory value (and its
        convolution's output)."""
        rows = inputs.rows(self.layer_id, streams.device)
        if rows is None:
            rows = self.lookup(inputs.indices[self.layer_id])
        if self.all_reduce is not None:
            rows = self.all_reduce(rows)
        memory = rows.reshape(rows.shape[0], -1).to(
            streams.dtype
        )  # [T, num_tables * dim]
        key = self.key_norm(self.key_proj(memory))  # [T, H]
        value = self.value_proj(memory)  # [T, H]
        h = self.hidden_norm(streams)  # [T, hc_mult, H]
        gate = torch.sigmoid(
            (h.float() * key.float().unsqueeze(1)).sum(-1) * self.scale
        )  # [T, hc_mult]
        gated = gate.to(streams.dtype).unsqueeze(-1) * value.unsqueeze(1)
        if self.short_conv is None:
            return streams + gated
        state = kv.conv[self.layer_id]
        assert state is not None  # the pool keeps a conv window for every such layer
        conv = self.short_conv(gated, positions, state, meta.group(kv.group_of["conv"]))
        return streams + gated + conv
