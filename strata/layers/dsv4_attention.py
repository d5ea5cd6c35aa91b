"""DeepSeek-V4 attention over its paged state (`strata.cache.dsv4_pool.DSV4KVPool`).

Every layer: one KV head used as both key and value (kv_proj -> norm -> RoPE), queries through a
low-rank bottleneck (q_a_proj -> norm -> q_b_proj -> per-head unweighted norm -> RoPE), RoPE on the
last `rope_head_dim` values of a head as interleaved pairs, a learned sink logit per head, the
output's rope part rotated back by its own position, then the grouped low-rank output projection
(o_a_proj per group of heads, o_b_proj over the groups).

Keys per query at position p, all in one softmax (with the sink):

    sliding   the layer's K of positions p - W < j <= p            (window group W)
    hca       + every entry i with (i + 1) m' <= p + 1              (entries closed by p)
    csa       + the entries the indexer picks: among those closed by p, the index_topk with the
              highest sum_h w_h(p) * relu(q_h(p) . key_i) (ties: torch.topk's order, not
              transformers'; with >= 8 index heads exact ties are rare)

`Compressor` turns each window into one entry the moment its last token is fed: the window's
inputs are the last 2m (CSA) or m' (HCA) rows of the compressor's window group, written by the
same step or earlier ones, so chunks may end anywhere inside a window.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from strata.cache.dsv4_pool import DSV4KVPool, entry_slots
from strata.layers.attention import AttentionMetadata, SegmentMeta
from strata.layers.hyper_connection import unweighted_rms_norm
from strata.layers.packed import NativePackable, grouped_dense, pack_groups
from strata.layers.rope import inv_freq_and_scale
from strata.model_config import ModelConfig, RopeConfig


class RMSNorm32(nn.Module):
    """RMSNorm with a float32 weight, multiplied in float32 and cast once (DeepSeek-V4's norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class PartialRope:
    """RoPE on the last `2 * len(inv_freq)` values, rotating interleaved pairs (x0, x1), (x2, x3), ...
    A plain object: its float32 table survives dtype casts and meta-device construction."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_position_embeddings: int,
        device: torch.device | str,
    ):
        with torch.device(
            "cpu"
        ):  # explicit: construction may run under a meta default device
            inv_freq, self.scaling = inv_freq_and_scale(
                rope, head_dim, max_position_embeddings
            )
        self.inv_freq = inv_freq.to(device)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim / 2] (rounded to the model's dtype, as transformers does)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(
            dtype
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with cos, sin [T, r / 2]: rotate the last r values of each row (pairs 2i, 2i + 1)."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.float().view(shape), sin.float().view(shape)
    rope = x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


class GroupedLinear(NativePackable, nn.Module):
    """Block-diagonal projection: input [T, g, d_in] -> [T, g, d_out], group i by weight rows
    [i * d_out, (i + 1) * d_out). Not an nn.Linear, so no weight format swaps it for a dense one; on
    the CPU `pack` adds the groups packed for the native dense kernel (rows independent of the call)."""

    packed: torch.Tensor  # a buffer `pack` registers

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def pack_sources(self) -> list[torch.Tensor]:
        """The groups' weights, [g, d_out, d_in]."""
        return [self.weight.detach().view(self.groups, -1, self.weight.shape[1])]

    def pack(self, target: str) -> None:
        self.register_buffer(
            "packed", pack_groups(self.pack_sources()[0]), persistent=False
        )
        self.packed_target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_target is not None and x.is_cpu:
            return grouped_dense(
                x, self.packed, self.weight.shape[0] // self.groups, self.packed_target
            )
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(
            1, 2
        )  # [g, d_in, d_out]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


SCORES_MAX = 1 << 24  # float scores (and index scores) per block of queries: 64 MiB


def pad_queries(x: torch.Tensor, seg: SegmentMeta) -> torch.Tensor:
    """A segment's per-token rows [tokens, ...] -> [B, max_q, ...] (padding rows zero)."""
    batch = seg.kv_slots.shape[0]
    if seg.pad_index is None:
        return x.view(batch, 1, *x.shape[1:])
    out = x.new_zeros(batch * seg.max_q, *x.shape[1:])
    out[seg.pad_index] = x
    return out.view(batch, seg.max_q, *x.shape[1:])


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """q [B, Q, H, D] over keys [B, N, D] (also the values), mask [B, 1, Q, N] (True: attend), one
    sink logit per head in every softmax, its share dropped. Returns [B, Q, H, D]."""
    H = q.shape[2]
    scores = (
        torch.einsum("bqhd,bnd->bhqn", q, keys)
        .float()
        .mul_(scale)
        .masked_fill_(~mask, float("-inf"))
    )
    # exp(s - top) / (sum + exp(sink - top)); a row with no key left gives everything to the sink
    sink = sinks.float().view(1, H, 1, 1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    probs = scores.sub_(top).exp_()
    probs = probs.div_(probs.sum(dim=-1, keepdim=True) + (sink - top).exp())
    return torch.einsum("bhqn,bnd->bqhd", probs.to(keys.dtype), keys)


class Compressor(nn.Module):
    """Pools each window of `rate` tokens into one entry (CSA: two overlapping series, entry i pools
    the first half of window i - 1 and the second half of window i; HCA: window i alone):
    entry = norm(sum_j softmax_j(gate_j + bias_j) * kv_j), roped at position i * rate.
    Also the indexer's compressor (`dim` = index_head_dim), whose entries are the index keys."""

    indexer: (
        Indexer  # a CSA layer's compressor holds its indexer (set by DSV4Attention)
    )

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm32(dim, eps)

    @property
    def width(self) -> int:
        """Values each token stores: kv then gate (+ bias), both series for CSA."""
        return 2 * self.kv_proj.out_features

    def inputs(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What each token stores in the window group: [T, width] = kv | gate + position bias."""
        gate = self.gate_proj(x) + self.position_bias[positions % self.rate]
        return torch.cat([self.kv_proj(x), gate.to(x.dtype)], dim=-1)

    def pool(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """rows [C, span, width]: each closing window's inputs, oldest first (span 2m for CSA, m for
        HCA); valid [C, span]: False before position 0. Returns the entries [C, dim] (not roped)."""
        d, m = self.dim, self.rate
        if self.overlap:  # first m rows: the previous window's first series; last m: this window's second
            half = rows.shape[-1] // 2
            kv = torch.cat([rows[:, :m, :d], rows[:, m:, d : 2 * d]], dim=1)
            gate = torch.cat(
                [rows[:, :m, half : half + d], rows[:, m:, half + d :]], dim=1
            )
        else:
            kv, gate = rows[..., :d], rows[..., d:]
        gate = gate.float().masked_fill(~valid.unsqueeze(-1), float("-inf"))
        return self.kv_norm((kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1))


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: a compressor of its own (its entries are the index keys)
    and multi-head queries from the query bottleneck, weighted per head."""

    def __init__(self, cfg: ModelConfig):
        v4 = cfg.dsv4
        assert v4 is not None  # a DeepSeek-V4 layer
        super().__init__(
            cfg.hidden_size, v4.index_head_dim, v4.csa_rate, True, cfg.rms_norm_eps
        )
        self.num_heads, self.topk = v4.index_n_heads, v4.index_topk
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.num_heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(
            cfg.hidden_size, self.num_heads, bias=False
        )

    def queries(
        self, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ):
        """(q [T, Hi, Di] roped, head weights [T, Hi] float32)."""
        q = apply_rope(
            self.q_b_proj(q_res).view(x.shape[0], self.num_heads, self.dim), cos, sin
        )
        weights_proj = cast(nn.Linear, self.scorer.weights_proj)
        return q, weights_proj(x).float() * self.num_heads**-0.5

    def select(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """q [B, max_q, Hi, Di], w [B, max_q, Hi], keys [B, n, Di], visible [B, max_q, n] ->
        [B, max_q, n] bool: the top index_topk visible entries of each query."""
        scores = (
            torch.einsum("bqhd,bnd->bqhn", q.float(), keys.float()).relu()
            * self.dim**-0.5
        )
        scores = (
            (scores * w.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))
        )
        top = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible


class DSV4Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rope_device: torch.device | str
    ):
        super().__init__()
        v4 = cfg.dsv4
        if v4 is None:
            raise ValueError(f"{cfg.architecture} has no DeepSeek-V4 configuration")
        self.layer_id, self.kind = layer_id, v4.layer_kinds[layer_id]
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.window, self.o_groups = v4.sliding_window, v4.o_groups
        self.scale = cfg.layers[layer_id].scale
        self.eps = cfg.rms_norm_eps
        H, D, hidden = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        self.q_a_proj = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm32(v4.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(hidden, D, bias=False)
        self.kv_norm = RMSNorm32(D, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            H * D // v4.o_groups, v4.o_groups * v4.o_lora_rank, v4.o_groups
        )
        self.o_b_proj = nn.Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(H, dtype=torch.float32))
        # sliding layers rotate with the main RoPE; CSA/HCA layers, their compressors and indexer with
        # the compressors' (the layer spec's rope)
        self.rope_key = cfg.layers[
            layer_id
        ].rope  # layers with equal RoPE share a step's tables
        self.rope = PartialRope(
            self.rope_key, D, cfg.max_position_embeddings, rope_device
        )
        self.compressor: Compressor | None = None
        if self.kind != "sliding":
            self.rate = v4.rate(self.kind)
            self.compressor = Compressor(
                hidden, D, self.rate, self.kind == "csa", cfg.rms_norm_eps
            )
            if self.kind == "csa":
                self.compressor.indexer = Indexer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: DSV4KVPool,
        shared: dict | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the step's sliding K, compressor inputs and the
        entries its tokens close into the pool first. shared: what every layer of a step would
        compute alike (RoPE tables, which tokens close windows and where entries sit), kept by the
        model for one forward; None: computed here."""
        shared = {} if shared is None else shared
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        cos, sin = _once(
            shared,
            ("rope", self.rope_key),
            lambda: self.rope.tables(positions, x.dtype),
        )
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = apply_rope(
            unweighted_rms_norm(self.q_b_proj(q_res).view(T, H, D), self.eps), cos, sin
        )
        k = apply_rope(
            self.kv_norm(self.kv_proj(x)), cos, sin
        )  # [T, D], also the value
        swa = meta.group(kv.group_of["swa"])
        kv.swa[self.layer_id][swa.out_slots] = k.to(kv.dtype)
        index_q = None
        if self.compressor is not None:
            self._compress(self.compressor, x, positions, meta, kv, shared)
            if self.kind == "csa":
                index_q = self.compressor.indexer.queries(q_res, x, cos, sin)
        out = q.new_empty(T, H, D)
        nd = meta.num_decode
        view = swa.view(self.window)
        if nd:
            seg = swa.decode_segment(view)
            out[:nd] = self._attend(
                q[:nd], seg, slice(0, nd), meta, kv, index_q, slice(0, nd), shared
            )
        if nd < T:
            seg = swa.extend_segment(view)
            out[nd:] = self._attend(
                q[nd:], seg, slice(nd, None), meta, kv, index_q, slice(nd, T), shared
            )
        out = apply_rope(
            out, cos, -sin
        )  # undo the values' rotation at the query's own position
        grouped = self.o_a_proj(out.view(T, self.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)

    def _compress(
        self,
        comp: Compressor,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: DSV4KVPool,
        shared: dict,
    ) -> None:
        """Store this step's compressor inputs; pool every window whose last token is in the step."""
        layer = self.layer_id
        indexer: Indexer | None = getattr(comp, "indexer", None)
        group = meta.group(kv.group_of[self.kind])
        inputs = [comp.inputs(x, positions)] + (
            [indexer.inputs(x, positions)] if indexer else []
        )
        state = kv.state[layer]
        assert state is not None  # a compressed layer keeps its windows' inputs
        state[group.out_slots] = torch.cat(inputs, dim=-1).to(state.dtype)
        closing = _once(
            shared,
            ("close", self.kind, self.rope_key),
            lambda: self._closing_windows(
                positions, meta, group, x.dtype, state.device
            ),
        )
        if closing is None:
            return
        slots, valid, where, cos, sin = closing
        rows = state[slots]  # [C, span, width]
        entries = kv.entries[layer]
        assert entries is not None  # and its entries
        entries[where] = apply_rope(
            comp.pool(rows[..., : comp.width], valid), cos, sin
        ).to(entries.dtype)
        if indexer is not None:
            keys = indexer.pool(rows[..., comp.width :], valid)
            index_keys = kv.index_keys[layer]
            assert index_keys is not None  # a CSA layer keeps its index keys
            index_keys[where] = apply_rope(keys, cos, sin).to(entries.dtype)

    def _closing_windows(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        group: AttentionMetadata,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, ...] | None:
        """For the tokens that close a window this step (None: none do): the slots of each window's
        rows in the group [C, span], which of them are real positions [C, span], where its entry
        goes [C], and the RoPE tables of the window's first position (where an entry is roped)."""
        m = self.rate
        pos = positions.cpu()
        closing = torch.nonzero((pos + 1) % m == 0, as_tuple=True)[0]
        if not len(closing):
            return None
        owner, end = meta.token_owner[closing], pos[closing]
        span = 2 * m if self.kind == "csa" else m
        window = (
            end.view(-1, 1) - span + 1 + torch.arange(span)
        )  # [C, span] the positions pooled
        at = window.clamp(min=0)
        ps = meta.page_size
        slots = group.slots_at(owner, at)
        where = entry_slots(meta.page_table[owner], end.view(-1, 1), ps, m).view(-1)
        cos, sin = self.rope.tables((end + 1 - m).to(positions.device), dtype)
        return slots.to(device), (window >= 0).to(device), where.to(device), cos, sin

    def _attend(
        self,
        q: torch.Tensor,
        seg: SegmentMeta,
        rows: slice,
        meta: AttentionMetadata,
        kv: DSV4KVPool,
        index_q: tuple[torch.Tensor, torch.Tensor] | None,
        tokens: slice,
        shared: dict,
    ) -> torch.Tensor:
        """One segment (the decodes, or the extends): sliding keys, then the compressed entries, in
        blocks of queries that bound the scores to SCORES_MAX floats. Sliding column j of request b is
        its key key_start_b + j (`AttentionMetadata`), so queries i0 .. i1 - 1 read columns
        max(0, i0 - W + 1) .. i1 + W - 2 at most."""
        H, D, W = self.num_heads, self.head_dim, self.window
        keys = kv.swa[self.layer_id][seg.kv_slots]  # [B, N, D]
        B, N = keys.shape[:2]
        qp = pad_queries(q, seg)  # [B, max_q, H, D]
        entries: torch.Tensor | None = None
        index_keys: torch.Tensor | None = None
        visible: torch.Tensor | None = None
        index: tuple[torch.Tensor, torch.Tensor] | None = None
        n = 0
        if self.compressor is not None:
            n, where, visible = _once(
                shared,
                ("entries", self.kind, rows.start),
                lambda: self._entries_read(seg, rows, meta, keys.device),
            )
            if n:
                layer_entries = kv.entries[self.layer_id]
                assert layer_entries is not None  # a compressed layer keeps entries
                entries = layer_entries[where].to(keys.dtype)  # [B, n, D]
                if index_q is not None:
                    layer_keys = kv.index_keys[self.layer_id]
                    assert layer_keys is not None  # a CSA layer keeps index keys
                    index_keys = layer_keys[where]  # [B, n, Di]
                    index = (
                        pad_queries(index_q[0][tokens], seg),
                        pad_queries(index_q[1][tokens], seg),
                    )
        indexer = (
            self.compressor.indexer
            if index is not None and self.compressor is not None
            else None
        )
        per_query = B * (
            H * (N + n) + (indexer.num_heads * n if indexer is not None else 0)
        )
        block = max(1, SCORES_MAX // per_query)
        out = qp.new_empty(B, seg.max_q, H, D)
        for i0 in range(0, seg.max_q, block):
            i1 = min(seg.max_q, i0 + block)
            lo, hi = (
                (0, N)
                if block >= seg.max_q
                else (max(0, i0 - W + 1), min(N, i1 + W - 1))
            )
            k, mask = keys[:, lo:hi], seg.mask[:, :, i0:i1, lo:hi]
            if n:
                assert visible is not None and entries is not None
                vis = visible[:, i0:i1]
                if indexer is not None:
                    assert index is not None and index_keys is not None
                    vis = indexer.select(
                        index[0][:, i0:i1], index[1][:, i0:i1], index_keys, vis
                    )
                k = torch.cat([k, entries], dim=1)
                mask = torch.cat([mask, vis.unsqueeze(1)], dim=-1)
            out[:, i0:i1] = sink_attention(
                qp[:, i0:i1], k, mask, self.scale, self.sinks
            )
        out = out.view(-1, H, D)
        return out if seg.pad_index is None else out[seg.pad_index]

    def _entries_read(
        self,
        seg: SegmentMeta,
        rows: slice,
        meta: AttentionMetadata,
        device: torch.device,
    ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The entries a segment's requests read this step: how many at most (n: those closed by
        its longest request's end), their rows [B, n] (padding repeats a real row) and which each
        query may see [B, max_q, n] (entry i once its window closed: i < (p + 1) // m)."""
        m = self.rate
        q_len, kv_len = meta.q_len[rows], meta.kv_len[rows]
        n = int((kv_len // m).max())
        if not n:
            return 0, None, None
        B, i = len(kv_len), torch.arange(n)
        last = meta.page_table.shape[1] * meta.page_size - 1
        ends = ((i + 1) * m - 1).clamp(max=last).expand(B, -1)
        where = entry_slots(meta.page_table[rows], ends, meta.page_size, m)
        query_pos = (kv_len - q_len).view(B, 1) + torch.arange(seg.max_q)  # [B, max_q]
        visible = i.view(1, 1, -1) < ((query_pos + 1) // m).unsqueeze(-1)
        return n, where.to(device), visible.to(device)


def _once(shared: dict, key: tuple, compute):
    """shared[key], computed on first use (one step's values common to several layers)."""
    if key not in shared:
        shared[key] = compute()
    return shared[key]
