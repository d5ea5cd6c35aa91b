"""Paged attention over the KV pool, batched over requests without a Python loop per request.

A forward batch is laid out decode-first:

    tokens: [ d0 d1 ... d(B_d-1) | e0 e0 e0 e1 e1 ... ]      (flattened, T tokens)
             one token per decode   a chunk of q_len tokens per extend (prefill) request

Each request's keys live in pages at arbitrary places in the pool; `page_table[b, i]` is the page
of positions [i * page_size, (i + 1) * page_size), so key j is at slot
page_table[b, j // page_size] * page_size + j % page_size. The new tokens' K/V are written to
`out_slots` first, so a request's query i (absolute position p = kv_len - q_len + i) attends to the
keys j with p - window < j <= p (window None: 0 <= j <= p). A layer may also soft-cap its scores
(c * tanh(s / c), Gemma 2) and add a learned per-head "sink" logit to each softmax whose
probability is dropped (GPT-OSS).

With a window W, a request's keys before its earliest query's window are never read, nor their
page-table entries (those pages may already be freed):

    keys:  0 ........ key_start ........ kv_len - q_len ......... kv_len - 1
           [ not read ][ in some query's window ][ the q_len new tokens ]
           key_start = max(0, kv_len - q_len - W + 1)

`AttentionMetadata.build` runs once per step; the views each layer kind needs (one per window size:
sliding and full layers differ) are built on first use and shared by the later layers.
On the CPU the native kernels (strata.kernels) store the new K/V and run decode attention straight
from the pool, one pass per (token, KV head) with an online softmax: no gather, no padding. Extend
(prefill) requests take the kernels' flash-style extend attention, whose rows compute the same bits
in any batch and in any chunking of their prompt (2-2.6x faster than SDPA on a 400-token prompt,
AVX-512, SmolLM2 shapes); without the kernels, or with a head dim they do not take (MLA's 576),
SDPA, or explicit matmuls and softmax when the layer soft-caps or has sinks (SDPA can do neither),
one request at a time: each request's path and shapes are its own, so its result does not depend
on what shares its step.
`reference_attention` is the per-request loop kept as the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from strata.kernels import token_rows, usable


@dataclass
class SegmentMeta:
    """Padded view of one group of requests (all decodes, or all extends) for one window size.

    Column j of request b is its key key_start[b] + j (columns past its last key repeat that key,
    masked out)."""

    token_start: int  # first flattened token of this segment
    num_tokens: int
    kv_slots: torch.Tensor  # [B, max_kv] int64
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True = attend
    pad_index: (
        torch.Tensor | None
    )  # [num_tokens] -> row of the [B * max_q] padded query; None if max_q == 1
    max_q: int
    causal: bool = False  # a single request with nothing cached and no window: plain causal attention


EXTEND_KERNEL_MAX_HEAD_DIM = (
    512  # the extend kernel's limit (MLA's latent rows, 576, take SDPA)
)


@dataclass
class WindowView:
    """What the layers with one window size read in a step, built on first use and shared."""

    window: (
        int | None
    )  # None: full causal (also when the window covers every request's keys)
    decode: SegmentMeta | None = None  # torch-path views, built when first needed
    extend: SegmentMeta | None = None
    extend_alone: dict[int, SegmentMeta] = field(
        default_factory=dict
    )  # extend i's own torch-path view


@dataclass
class AttentionMetadata:
    """One step's batch as attention sees it: built once per step and shared by every layer."""

    positions: torch.Tensor  # [T] absolute position of each new token
    out_slots: torch.Tensor  # [T] slot that each new token's K/V is written to
    q_len: torch.Tensor  # [B] tokens fed per request (CPU)
    kv_len: torch.Tensor  # [B] tokens in KV after this step (CPU)
    page_table: torch.Tensor  # [B, max_pages] int64, contiguous (CPU)
    page_size: int
    num_decode: int
    device: torch.device
    decode_owner: (
        torch.Tensor
    )  # [num_decode] page-table row of each decode token (for the decode kernel)
    extend_q_start: (
        torch.Tensor
    )  # [B - num_decode] first flattened token of each extend (for the kernel)
    token_owner: torch.Tensor  # [T] page-table row of each token (CPU)
    # [B] first key each request may read (CPU), or None: all. Set on a window group's metadata while
    # a request replays its window (`--swa-replay`): the group holds nothing before that position
    key_floor: torch.Tensor | None = None
    views: dict[int | None, WindowView] = field(default_factory=dict, repr=False)
    # the same step for each window group of the KV pool, whose pages differ (strata.cache.kv_pool)
    groups: list[AttentionMetadata] = field(default_factory=list, repr=False)

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        kv_lens: list[int],
        page_table: torch.Tensor,
        page_size: int,
        num_decode: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Per request (decodes, q_len 1, first): tokens fed, tokens in KV after this step, and
        `page_table[b, i]` = the page holding positions [i * page_size, (i + 1) * page_size)."""
        q = torch.tensor(q_lens)
        kv = torch.tensor(kv_lens)
        # token t of request b sits at position kv_len[b] - q_len[b] + (t - first token of b)
        owner = torch.repeat_interleave(torch.arange(len(q_lens)), q)
        first = torch.cumsum(q, 0) - q
        positions = torch.arange(int(q.sum())) - first[owner] + (kv - q)[owner]
        out_slots = (
            page_table[owner, positions // page_size] * page_size
            + positions % page_size
        )
        return cls(
            positions=positions.to(device),
            out_slots=out_slots.to(device),
            q_len=q,
            kv_len=kv,
            page_table=page_table.contiguous(),
            page_size=page_size,
            num_decode=num_decode,
            device=device,
            decode_owner=torch.arange(num_decode),
            extend_q_start=first[num_decode:].contiguous(),
            token_owner=owner,
        )

    def with_page_table(self, page_table: torch.Tensor) -> AttentionMetadata:
        """This step over another page table (a window group's pages for the same positions)."""
        ps = self.page_size
        positions = self.positions.cpu()
        out_slots = page_table[self.token_owner, positions // ps] * ps + positions % ps
        return AttentionMetadata(
            positions=self.positions,
            out_slots=out_slots.to(self.device),
            q_len=self.q_len,
            kv_len=self.kv_len,
            page_table=page_table.contiguous(),
            page_size=ps,
            num_decode=self.num_decode,
            device=self.device,
            decode_owner=self.decode_owner,
            extend_q_start=self.extend_q_start,
            token_owner=self.token_owner,
        )

    def slots_at(self, owner: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots of `positions` [N, M] (>= 0, CPU) of the requests at page-table rows `owner` [N],
        in this metadata's pages (a window group's, for a group's metadata)."""
        ps = self.page_size
        return self.page_table[owner].gather(1, positions // ps) * ps + positions % ps

    def group(self, g: int) -> AttentionMetadata:
        """The metadata of KV group g (0: the primary pages, this one)."""
        return self if g == 0 else self.groups[g - 1]

    def view(self, window: int | None) -> WindowView:
        """The view for layers with this window (cached: built once per step and window size)."""
        view = self.views.get(window)
        if view is None:
            if window is not None and window < 1:
                raise ValueError(
                    f"attention window is {window} tokens; it must be at least 1 (None: none)"
                )
            # a window as long as every request's keys is no window: those layers share the full view
            effective = (
                None if window is None or window >= int(self.kv_len.max()) else window
            )
            if effective not in self.views:
                self.views[effective] = WindowView(effective)
            view = self.views[window] = self.views[effective]
        return view

    def decode_segment(self, view: WindowView) -> SegmentMeta:
        """The torch path's view of the decodes (requests 0 .. num_decode - 1), built once."""
        if view.decode is None:
            view.decode = self._segment(slice(0, self.num_decode), view.window)
        return view.decode

    def extend_segment(self, view: WindowView) -> SegmentMeta:
        """The torch path's view of the extends (requests num_decode ..), built once."""
        if view.extend is None:
            view.extend = self._segment(slice(self.num_decode, None), view.window)
        return view.extend

    def extend_alone_segment(self, view: WindowView, i: int) -> SegmentMeta:
        """The torch path's view of extend i (request num_decode + i) by itself, built once."""
        seg = view.extend_alone.get(i)
        if seg is None:
            b = self.num_decode + i
            seg = view.extend_alone[i] = self._segment(
                slice(b, b + 1), view.window, int(self.extend_q_start[i])
            )
        return seg

    def _segment(
        self, rows: slice, window: int | None, token_start: int | None = None
    ) -> SegmentMeta:
        # decodes are one token each, so request row r < num_decode is token r, and the extends start there
        floor = None if self.key_floor is None else self.key_floor[rows]
        return _segment(
            rows.start if token_start is None else token_start,
            self.q_len[rows],
            self.kv_len[rows],
            self.page_table[rows],
            self.page_size,
            self.device,
            window,
            floor,
        )


def _segment(
    token_start: int,
    q_len: torch.Tensor,
    kv_len: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    device: torch.device,
    window: int | None,
    key_floor: torch.Tensor | None = None,
) -> SegmentMeta:
    batch = len(q_len)
    max_q = int(q_len.max())
    # keys before the earliest query's window are left out (their pages are never read)
    key_start = (
        torch.zeros_like(kv_len)
        if window is None
        else (kv_len - q_len - window + 1).clamp(min=0)
    )
    if key_floor is not None:  # keys before the floor do not exist (a replayed window)
        key_start = torch.maximum(key_start, key_floor)
    max_kv = int((kv_len - key_start).max())
    kj = torch.arange(max_kv)
    # [B, max_kv] the absolute key of each column; past the request's last key, that key again (masked)
    key = torch.minimum(key_start.view(batch, 1) + kj, (kv_len - 1).view(batch, 1))
    kv_slots = page_table.gather(1, key // page_size) * page_size + key % page_size
    qi = torch.arange(max_q).view(1, max_q, 1)
    # query i of request b sits at absolute position kv_len - q_len + i and sees keys up to it
    query_pos = (kv_len - q_len).view(batch, 1, 1) + qi
    key_pos = key_start.view(batch, 1, 1) + kj.view(1, 1, max_kv)
    real_query = qi < q_len.view(batch, 1, 1)
    mask = (key_pos <= query_pos) & real_query
    if key_floor is not None:
        mask &= key_pos >= key_floor.view(batch, 1, 1)
    if window is not None:
        mask &= (
            key_pos > query_pos - window
        )  # every real query still sees itself: no empty row
    mask[:, :, 0] |= ~real_query[..., 0]  # padded query rows see column 0: no NaN rows
    pad_index = None
    if max_q > 1:
        pad_index = torch.nonzero(real_query.view(-1), as_tuple=True)[0].to(device)
    return SegmentMeta(
        token_start=token_start,
        num_tokens=int(q_len.sum()),
        kv_slots=kv_slots.to(device),
        mask=mask.unsqueeze(1).to(device),
        pad_index=pad_index,
        max_q=max_q,
        causal=window is None
        and batch == 1
        and max_q > 1
        and int(q_len[0]) == int(kv_len[0]),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens); caches: [num_slots, Hkv, D]. Returns [T, H, D].

    Every new token's k, v is stored. q may also hold only the batch's first num_decode rows: then only
    the decodes attend (the caller attends the extends its own way, as MLA's decompressed prefill).
    window: each query sees only the last `window` keys up to itself (None: all of them);
    sinks: [H] one logit per query head, in every softmax but with no value row; softcap: the
    scaled scores become softcap * tanh(scores / softcap) before masking and softmax."""
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks has shape {tuple(sinks.shape)}; it must hold one logit per query head ({q.shape[1]})"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(
            f"softcap is {softcap}; it must be positive (None: no softcap)"
        )
    store_kv(k, v, k_cache, v_cache, meta.out_slots)
    return attend_paged(
        q, k_cache, v_cache, meta, scale, window=window, sinks=sinks, softcap=softcap
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write rows of K/V ([T, Hkv, D]) to `slots` ([T]) of the caches."""
    ops = usable(k)
    if (
        ops
        and token_rows(k)
        and token_rows(v)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        ops.store_kv(k, v, k_cache, v_cache, slots)
    else:
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)


def attend_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_attention` over keys already in the caches: nothing is stored (a query's keys are
    those up to its position in `meta`, whoever wrote them)."""
    ops = usable(q)
    view = meta.view(window)
    if (
        meta.key_floor is not None
    ):  # a replayed window: the torch path honours the floor, the kernels do not
        ops = None
    out = q.new_empty(q.shape)
    nd, num_tokens, head_dim = meta.num_decode, q.shape[0], q.shape[2]
    if ops:  # the kernels spell "off" as 0 and take the sinks in float32
        sink_logits = None if sinks is None else sinks.float().contiguous()
        options = {
            "window": view.window or 0,
            "softcap": softcap or 0.0,
            "sinks": sink_logits,
        }
    if nd and ops:  # decode tokens through the native kernel
        ops.paged_attention(
            out[:nd],
            q[:nd],
            k_cache,
            v_cache,
            meta.page_table[:nd],
            meta.decode_owner,
            meta.positions[:nd],
            meta.page_size,
            scale,
            **options,
        )
    elif nd:
        seg = meta.decode_segment(view)
        out[:nd] = _segment_attention(
            q[:nd], k_cache, v_cache, seg, scale, softcap, sinks
        )
    if nd == num_tokens:
        return out
    # Extends: the kernel for all of them in one call where it fits (its rows compute the same in any
    # batch and in any chunk of their prompt), else SDPA or matmuls one request at a time (a padded
    # batch's shapes would change a request's blocking, and so its bits).
    if (
        ops
        and ops.has_simd()
        and head_dim % 16 == 0
        and head_dim <= EXTEND_KERNEL_MAX_HEAD_DIM
    ):
        ops.extend_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.page_table[nd:],
            meta.extend_q_start,
            meta.q_len[nd:],
            meta.kv_len[nd:],
            meta.page_size,
            scale,
            **options,
        )
        return out
    for i in range(len(meta.q_len) - nd):
        seg = meta.extend_alone_segment(view, i)
        rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
        out[rows] = _segment_attention(
            q[rows], k_cache, v_cache, seg, scale, softcap, sinks
        )
    return out


def _segment_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: SegmentMeta,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    keys = k_cache[seg.kv_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, max_kv, D]
    values = v_cache[seg.kv_slots].to(q.dtype).transpose(1, 2)
    return segment_attention(q, keys, values, seg, scale, softcap, sinks)


def segment_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seg: SegmentMeta,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one segment's tokens over keys already gathered in its padded layout.

    q: [num_tokens, H, D]; keys: [B, Hkv, max_kv, D], values: [B, Hkv, max_kv, Dv] (column j of
    request b as in `seg.kv_slots`). Returns [num_tokens, H, Dv]."""
    batch, max_kv = seg.kv_slots.shape
    num_heads, head_dim, value_dim = q.shape[1], q.shape[2], values.shape[-1]
    if seg.pad_index is None:  # one query per request
        return _matmul_attention(
            q.unsqueeze(2), keys, values, seg.mask, scale, softcap, sinks
        ).squeeze(2)
    plain = softcap is None and sinks is None
    if seg.causal and plain:
        # one request, no cached prefix: plain causal attention, no mask to read
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0).transpose(1, 2),
            keys,
            values,
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(-1, num_heads, value_dim)
    q_pad = q.new_zeros(batch * seg.max_q, num_heads, head_dim)
    q_pad[seg.pad_index] = q
    q_pad = q_pad.view(batch, seg.max_q, num_heads, head_dim).transpose(
        1, 2
    )  # [B, H, max_q, D]
    if plain:
        out = F.scaled_dot_product_attention(
            q_pad, keys, values, attn_mask=seg.mask, scale=scale, enable_gqa=True
        )
    else:  # SDPA can neither soft-cap nor add sinks; query blocks bound the [B, H, rows, max_kv] scores
        rows = max(1, MATMUL_SCORES_MAX // (batch * num_heads * max_kv))
        blocks = [
            _matmul_attention(
                q_pad[:, :, i : i + rows],
                keys,
                values,
                seg.mask[:, :, i : i + rows],
                scale,
                softcap,
                sinks,
            )
            for i in range(0, seg.max_q, rows)
        ]
        out = torch.cat(blocks, dim=2)
    return out.transpose(1, 2).reshape(batch * seg.max_q, num_heads, value_dim)[
        seg.pad_index
    ]


MATMUL_SCORES_MAX = 1 << 24  # float scores per block of _matmul_attention (64 MiB)


def _matmul_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Two batched matmuls and a float softmax (much faster than masked SDPA on CPU for one query).

    q: [B, H, M, D]; keys: [B, Hkv, N, D], values: [B, Hkv, N, Dv]; mask: [B, 1, M, N]. Query heads
    are grouped by their KV head (head h uses KV head h // (H / Hkv)), so q views as
    [B, Hkv, group * M, D].
    """
    batch, num_heads, num_q, head_dim = q.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group * num_q, head_dim)
    scores = (
        torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    )  # [B, Hkv, group * M, N]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, num_kv_heads, group, num_q, num_keys)
    scores = scores.masked_fill(
        ~mask.unsqueeze(1), float("-inf")
    )  # mask: [B, 1, 1, M, N]
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = (
            sinks.float()
            .view(1, num_kv_heads, group, 1, 1)
            .expand(batch, -1, -1, num_q, 1)
        )
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[
            ..., :num_keys
        ]  # the sink's share is dropped
    probs = probs.to(values.dtype).view(batch, num_kv_heads, group * num_q, num_keys)
    return torch.matmul(probs, values).view(batch, num_heads, num_q, values.shape[-1])


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_lens: list[int],
    kv_slot_lists: list[torch.Tensor],
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-request loop in float32: the oracle for `paged_attention` (caches already hold the new K/V;
    `kv_slot_lists[b]` are request b's slots of keys 0 .. kv_len - 1, the window's cut included)."""
    outs, start = [], 0
    for q_len, slots in zip(q_lens, kv_slot_lists):
        kv_len = slots.numel()
        qr = q[start : start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        kr = k_cache[slots].float().transpose(0, 1)  # [Hkv, kv_len, D]
        vr = v_cache[slots].float().transpose(0, 1)
        groups = qr.shape[0] // kr.shape[0]
        kr, vr = kr.repeat_interleave(groups, 0), vr.repeat_interleave(groups, 0)
        scores = (qr @ kr.transpose(1, 2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(kv_len - q_len, kv_len).view(
            -1, 1
        )  # the queries' absolute positions
        key = torch.arange(kv_len).view(1, -1)
        hidden = key > pos
        if window is not None:
            hidden |= key <= pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # one more logit per head, whose probability is dropped
            sink = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :kv_len]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ vr).transpose(0, 1))
        start += q_len
    return torch.cat(outs).to(q.dtype)
